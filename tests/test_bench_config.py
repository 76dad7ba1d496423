"""The benches' configuration settings (``--config KEY=VALUE``, `bench.common.parse_config`;
`bench_layer --staged-config / --fused-config` variants, `bench_gemm --config-ab`): parsed into
configuration values, named in columns, anything else refused before any GPU work."""

from __future__ import annotations

import pytest

from cute_megamoe.config import LayerConfig, Sm90FusedConfig, Sm90GemmConfig


def test_settings_parse_into_the_configuration_values():
    from bench.common import config_label, parse_config

    assert parse_config([]) == LayerConfig()
    config = parse_config(["gemm.promotion=chunk", "gemm.k_unroll=4", "fused=0",
                           "fused_kernel.row_transfer=barrier", "experimental_fused_fp4=1",
                           "fused_kernel.stages_inputs=auto"])
    assert config == LayerConfig(fused=False, experimental_fused_fp4=True,
                                 gemm=Sm90GemmConfig(promotion="chunk", k_unroll=4),
                                 fused_kernel=Sm90FusedConfig(row_transfer="barrier"))
    # (on top of another configuration, of another type)
    assert parse_config(["transposed=true"], Sm90GemmConfig(block_m=64)) == \
        Sm90GemmConfig(block_m=64, transposed=True)
    assert config_label(["gemm.transposed=1", "gemm.promotion=chunk"]) == \
        "gemm_transposed_1__gemm_promotion_chunk"


@pytest.mark.parametrize("setting,message", [
    ("gemm", "KEY=VALUE"), ("gemm.promo=1", "no field 'promo'"),
    ("gemm=1", "name one of its fields"), ("gemm.k_unroll=3", "k_unroll"),
    ("gemm.k_unroll=four", "invalid literal"), ("fused=maybe", "fused: one of"),
    ("fused_kernel.row_transfer=with_gemm", "row_transfer"),
    ("gemm.promotion.x=1", "promotion has no fields")])
def test_bad_settings_stop_naming_the_option(setting, message):
    from bench.common import parse_config

    with pytest.raises(SystemExit, match=message) as info:
        parse_config([setting], option="--staged-config")
    assert str(info.value).startswith("--staged-config")


def test_layer_variants_and_gemm_ab_settings():
    from bench.bench_gemm import _parse_config_ab
    from bench.bench_layer import _variant

    config, label = _variant("gemm.transposed=1+gemm.promotion=chunk", LayerConfig(),
                             "--staged-config")
    assert config.gemm == Sm90GemmConfig(transposed=True, promotion="chunk")
    assert label == "gemm_transposed_1__gemm_promotion_chunk"
    with pytest.raises(SystemExit, match="--fused-config"):
        _variant("fused_kernel.k_unroll=8", LayerConfig(), "--fused-config")
    # the ticket walk's A/B fields
    config, label = _variant("fused_kernel.walk=tickets+fused_kernel.band=4+"
                             "fused_kernel.lag_grids=3", LayerConfig(), "--fused-config")
    assert config.fused_kernel == Sm90FusedConfig(walk="tickets", band=4, lag_grids=3)
    assert label == ("fused_kernel_walk_tickets__fused_kernel_band_4__"
                     "fused_kernel_lag_grids_3")
    with pytest.raises(SystemExit, match="band"):
        _variant("fused_kernel.band=5", LayerConfig(), "--fused-config")
    assert _parse_config_ab("k_unroll=1,promotion=chunk", Sm90GemmConfig()) == \
        Sm90GemmConfig(k_unroll=1, promotion="chunk")
    with pytest.raises(SystemExit, match="--config-ab"):
        _parse_config_ab("CUTE_MEGAMOE_SM90_K_UNROLL=1", Sm90GemmConfig())
