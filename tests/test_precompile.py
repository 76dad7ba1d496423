"""Compile feedback and ahead-of-time compile (issue 62): `runtime.compiled_kernel` logs each
compile, `cute_megamoe.precompile` compiles every kernel a layer can pick for a shape."""

import logging

import pytest
import torch

from cute_megamoe import launch, runtime
from cute_megamoe import precompile as pc
from cute_megamoe.expert_gemm import expert_ffn_configs
from cute_megamoe.heuristics import block_m_for_call, expected_tokens_per_expert
from cute_megamoe.heuristics import select_combine_rounds as rounds_for


@pytest.mark.compile
def test_precompile_compiles_a_tiny_layer_logs_each_compile_and_keeps_it(caplog, capsys):
    pytest.importorskip("cutlass")
    args = ["--experts", "8", "--topk", "2", "--hidden", "256", "--intermediate", "384",
            "--max-tokens", "24", "--recipe", "bf16xbf16", "--arch", "sm_90a",
            "--block-m", "64", "--paths", "staged"]
    before = set(runtime._COMPILED)
    with caplog.at_level(logging.INFO, logger="cute_megamoe"):
        assert pc.main(args) == 0
    table = capsys.readouterr().out
    new = [key for key in runtime._COMPILED if key not in before
           and key[0][-1] not in ("plan", "kernel")]  # (the kernel objects' entries)
    names = sorted(key[0][0] for key in new)
    assert names == ["combine", "dispatch", "expert_gemm", "expert_gemm", "staging"], names
    assert "5 kernels compiled for sm_90a" in table and "0-0 tokens" not in table
    for name in ("dispatch", "expert_gemm l1", "expert_gemm l2", "combine", "staging"):
        assert name in table
    assert "calls: 1-24 tokens: BLOCK_M 64, combine epilogue 8" in table
    compiles = [r for r in caplog.records if hasattr(r, "cute_megamoe_compile")]
    assert len(compiles) == 5
    for record in compiles:
        info = record.cute_megamoe_compile
        assert record.levelno == logging.INFO and record.name == "cute_megamoe"
        assert info["seconds"] > 0 and info["key"][0] == info["name"]
        message = record.getMessage()
        assert f"compiled {info['name']} in" in message and "compiled-kernel cache" in message
        assert "sm_90a" in message
    # in the cache: a second run compiles nothing
    again = pc.precompile(8, 2, 256, 384, 24, "bf16xbf16", arch="sm_90a", block_m=64,
                          paths=("staged",))
    assert again.compiled == [] and again.arch == "sm_90a"


@pytest.fixture
def no_compiles(monkeypatch):
    """`launch.compiled_kernel` recording the keys it is asked to compile (the kernel objects
    are built, nothing is compiled)."""
    keys = []

    def record(key, build):
        if key[-1] in ("plan", "kernel"):
            return build()
        keys.append(key)
        return lambda *args: None

    monkeypatch.setattr(launch, "compiled_kernel", record)
    return keys


def test_precompile_covers_every_choice_the_layer_makes(no_compiles, monkeypatch):
    pytest.importorskip("cutlass")
    e, k, h, i, t = 256, 8, 7168, 2048, 8192
    report = pc.precompile(e, k, h, i, t, "fp8xfp8", arch="sm_90a")
    gemms = {(key[2], key[11]) for key in no_compiles if key[0] == "expert_gemm"}
    # every (phase, complete GEMM configuration) the heuristics pick for 0..t tokens
    want = set()
    for n in range(t + 1):
        bm = block_m_for_call(n, 1, k, e, "sm_90a")
        l1, l2 = expert_ffn_configs("sm_90a", "fp8xfp8", bm, h, i,
                                    expected_tokens_per_expert(n, 1, k, e), True, None)
        want |= {("l1", l1), ("l2", l2)}
    assert gemms == want and len(want) == 6
    assert {(c.block_m, c.transposed) for _, c in gemms} == {(64, True), (64, False),
                                                               (128, False)}
    fused = {key[7].block_m for key in no_compiles if key[0] == "mega_moe"}
    assert fused == {64, 128}  # the fused kernel at both BLOCK_Ms (one rank, sm_90a)
    combine = {(key[3], key[4]) for key in no_compiles if key[0] == "combine"}
    assert combine == {(64, "epilogue"), (128, "epilogue")}
    assert {key[0] for key in no_compiles} == {"staging", "dispatch", "expert_gemm", "combine",
                                               "mega_moe"}
    assert any("GEMMs transposed" in call for call in report.calls)
    # a layer that runs the fused kernel up to 128 tokens (`MegaMoEConfig.fused_max_tokens`):
    # its kernels for 0..128 tokens, the staged GEMMs for the larger calls only
    served = []
    for path in ("staged", "fused"):
        call = getattr(pc, f"_{path}_call")
        monkeypatch.setattr(pc, f"_{path}_call", lambda buf, w, n, *args, path=path, call=call:
                            served.append((path, n)) or call(buf, w, n, *args))
    no_compiles.clear()
    pc.precompile(e, k, h, i, t, "fp8xfp8", arch="sm_90a", fused_max_tokens=128)
    assert served and all((n <= 128) == (path == "fused") for path, n in served)
    fused = {key[7].block_m for key in no_compiles if key[0] == "mega_moe"}
    assert fused == {block_m_for_call(n, 1, k, e, "sm_90a") for n in range(129)}
    assert {"staged", "fused"} == {path for path, _ in served}
    # eight ranks: no fused kernel; fp8xfp4 on Hopper: the torch experts between our kernels,
    # the combine's rounds by the token count
    no_compiles.clear()
    pc.precompile(e, k, h, i, t, "fp8xfp4", num_ranks=8, arch="sm_90a")
    assert {key[0] for key in no_compiles} == {"staging", "dispatch", "combine"}
    rounds = {key[5] for key in no_compiles if key[0] == "combine"}
    assert rounds == {rounds_for(n) for n in range(t + 1)} and len(rounds) == 3


def test_precompile_checks_its_arguments(monkeypatch, capsys, no_compiles):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        pc.main(["--experts", "8", "--topk", "2", "--hidden", "256", "--intermediate", "128",
                 "--max-tokens", "16", "--recipe", "fp8xfp8"])
    assert "--arch" in capsys.readouterr().err
    with pytest.raises(ValueError, match="arch"):
        pc.precompile(8, 2, 256, 128, 16, "fp8xfp8")
    with pytest.raises(ValueError, match="paths"):
        pc.precompile(8, 2, 256, 128, 16, "fp8xfp8", arch="sm_90a", paths=("both",))
    with pytest.raises(ValueError, match="max_tokens"):
        pc.precompile(8, 2, 256, 128, 0, "fp8xfp8", arch="sm_90a")
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="fused_max_tokens"):
            pc.precompile(8, 2, 256, 128, 16, "fp8xfp8", arch="sm_90a", fused_max_tokens=bad)
    with pytest.raises(ValueError, match="recipe"):
        pc.precompile(8, 2, 256, 128, 16, "fp4xfp4", arch="sm_90a")
    assert no_compiles == []


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,fused", (("fp8xfp8", None), ("fp8xfp8", False),
                                          ("bf16xbf16", None), ("fp8xfp4_sm90", None)))
def test_precompile_then_first_layer_calls_compile_nothing(recipe, fused):
    import cute_megamoe as cm

    e, t, k, h, i = 8, 300, 4, 512, 256
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(e, 2 * i, h, generator=gen).to(torch.bfloat16).cuda()
    w2 = torch.randn(e, h, i, generator=gen).to(torch.bfloat16).cuda()
    layer = cm.MegaMoE(None, e, t, k, h, i, recipe, w1, w2, activation_clamp=10.0, fused=fused)
    pc.precompile_layer(layer)
    compiled = len(runtime._COMPILED)
    for n in (0, 1, 17, 100, 300):
        x = torch.randn(n, h, generator=gen).to(torch.bfloat16).cuda()
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).cuda() \
            if n else torch.empty(0, k, dtype=torch.int64, device="cuda")
        w = torch.rand(n, k, generator=gen).cuda()
        layer(x, idx, w)
    torch.cuda.synchronize()
    assert len(runtime._COMPILED) == compiled, "a layer call compiled after precompile_layer"
