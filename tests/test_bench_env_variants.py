"""The benches' kernel-variant settings (`bench_layer --staged-env / --fused-env`, `bench_gemm
--env-ab`): parsed into variables, named in columns, anything else refused before any GPU work."""

from __future__ import annotations

import pytest


def test_layer_env_variants_parse_and_name_their_columns():
    from bench.bench_layer import _env_column, _env_pairs

    both = "CUTE_MEGAMOE_SM90_TRANSPOSED=1+CUTE_MEGAMOE_SM90_PROMOTION=chunk"
    assert _env_pairs(both) == [("CUTE_MEGAMOE_SM90_TRANSPOSED", "1"),
                                ("CUTE_MEGAMOE_SM90_PROMOTION", "chunk")]
    assert _env_column(both) == "sm90_transposed_1__sm90_promotion_chunk"
    assert _env_column("CUTE_MEGAMOE_TILE_SEARCH=Linear") == "tile_search_linear"
    for bad in ("CUTE_MEGAMOE_TILE_SEARCH", "PATH=/tmp", "CUTE_MEGAMOE_A=1+B=2"):
        with pytest.raises(SystemExit, match="CUTE_MEGAMOE_"):
            _env_pairs(bad)
    # (a variable the layer plans are not keyed by would time the default's kernels again)
    with pytest.raises(SystemExit, match="KERNEL_VARIANT_ENV"):
        _env_pairs("CUTE_MEGAMOE_RESULTS_DIR=/tmp")


def test_gemm_env_variants_parse():
    from bench.bench_gemm import _parse_env

    assert _parse_env("CUTE_MEGAMOE_SM90_TRANSPOSED=1,CUTE_MEGAMOE_SM90_PROMOTION=chunk") == {
        "CUTE_MEGAMOE_SM90_TRANSPOSED": "1", "CUTE_MEGAMOE_SM90_PROMOTION": "chunk"}
    for bad in ("CUTE_MEGAMOE_SM90_TRANSPOSED", "OMP_NUM_THREADS=2"):
        with pytest.raises(SystemExit, match="--env-ab"):
            _parse_env(bad)
