"""Input staging kernel: compiled for sm_90a/sm_100a on the CPU; bit-exact on the GPU."""

import pytest
import torch

from cute_megamoe import quant
from cute_megamoe.quant import RECIPES

ARCHS = ("sm_90a", "sm_100a")


def _compile_staging(arch: str, recipe: str, hidden: int = 7168, num_topk: int = 8):
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64

    from cute_megamoe.kernels.staging import InputStagingKernel
    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    out = BFloat16 if recipe == "bf16xbf16" else Float8E4M3FN
    sf = Int32 if recipe == "fp8xfp4" else Float32
    kernel = InputStagingKernel(recipe, hidden, num_topk)
    return compile_for_arch(
        kernel, fake_ptr(BFloat16), fake_ptr(Int64), fake_ptr(Float32), fake_ptr(out),
        fake_ptr(sf), fake_ptr(Int64), fake_ptr(Float32), Int32(1), fake_stream(), arch=arch)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_staging_compiles_to_wide_loads_without_spills(arch, recipe):
    art = _compile_staging(arch, recipe)
    assert f".target {arch}" in art.ptx
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX checked only")
    # every BF16 row access is a 16-byte load; FP8 rows leave as 16-byte stores
    assert art.count("LDG.E.128") == 8
    assert art.count("STG.E.128") == (8 if recipe == "bf16xbf16" else 4)
    assert art.count("STL") == 0 and art.count("LDL") == 0
    if recipe != "bf16xbf16":
        assert "cvt.rn.satfinite.e4m3x2.f32" in art.ptx
        assert "div.rn.f32" in art.ptx  # amax / 448 is a true division, as the reference
        assert art.count("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C") == 32
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0


def _random_activations(n: int, hidden: int, device) -> torch.Tensor:
    """Random rows spanning many magnitudes, with some all-zero 32-groups and huge/tiny values."""
    x = torch.randn(n, hidden, device=device)
    x *= torch.exp2(torch.randint(-30, 30, (n, 1), device=device).float())
    if n > 0:
        groups = x.view(n, hidden // 32, 32)
        groups[torch.rand(n, hidden // 32, device=device) < 0.05] = 0
        x[0, :32] = 3.0e38  # near the BF16 maximum
        x[-1, 32:64] = 1.0e-30
    return x.to(torch.bfloat16)


def _make_buffer(recipe, num_max_tokens, hidden, num_topk, num_experts=16):
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe

    return get_symm_buffer_for_mega_moe(None, num_experts, num_max_tokens, num_topk, hidden,
                                        256, mma_type=recipe, device="cuda")


def _poison(buf):
    buf.x.view(torch.uint8).fill_(0xFF)  # NaN in e4m3 and bf16: never produced
    if buf.recipe != "bf16xbf16":
        buf.x_sf.view(torch.uint8).fill_(0xFF)  # UE8M0 255 / f32 NaN: never produced
    buf.topk_idx.fill_(0x7EEEEEEE)
    buf.topk_weights.view(torch.int32).fill_(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("hidden", [128, 7168])
def test_staging_is_bit_exact_with_quant(recipe, hidden):
    from cute_megamoe.api import stage_inputs

    torch.manual_seed(hash((recipe, hidden)) % 2**31)
    num_topk, num_experts, cap = 6, 16, 4133
    buf = _make_buffer(recipe, cap, hidden, num_topk, num_experts)
    for n in (1, 37, 1000, cap, 0, 256):  # back to back, shrinking and growing
        _poison(buf)
        x = _random_activations(n, hidden, "cuda")
        topk_idx = torch.rand(n, num_experts, device="cuda").topk(num_topk, dim=1).indices
        topk_idx = topk_idx.masked_fill(torch.rand(n, num_topk, device="cuda") < 0.2, -1)
        topk_w = torch.rand(n, num_topk, device="cuda")
        stage_inputs(buf, x, topk_idx, topk_w)
        torch.cuda.synchronize()
        if recipe == "bf16xbf16":
            assert torch.equal(buf.x[:n].view(torch.int16), x.view(torch.int16))
        else:
            ref_q, ref_sf = quant.quantize_activations_for_recipe(x, recipe)
            assert torch.equal(buf.x[:n].view(torch.uint8), ref_q.view(torch.uint8))
            assert torch.equal(buf.x_sf[:n].view(torch.int32), ref_sf.view(torch.int32))
            # rows past n are untouched
            assert bool((buf.x[n:].view(torch.uint8) == 0xFF).all())
        assert torch.equal(buf.topk_idx[:n], topk_idx)
        assert torch.equal(buf.topk_weights[:n].view(torch.int32), topk_w.view(torch.int32))
        assert bool((buf.topk_idx[n:] == 0x7EEEEEEE).all())


@pytest.mark.gpu
def test_staging_rejects_bad_inputs_before_launch():
    from cute_megamoe.api import stage_inputs

    buf = _make_buffer("fp8xfp4", 64, 256, 4)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 16, (8, 4), device="cuda")
    w = torch.rand(8, 4, device="cuda")
    with pytest.raises(TypeError, match="x"):
        stage_inputs(buf, x.float(), idx, w)
    with pytest.raises(ValueError, match="x"):
        stage_inputs(buf, x[:, :128], idx, w)
    with pytest.raises(ValueError, match="exceed"):
        stage_inputs(buf, torch.randn(65 + 128, 256, device="cuda", dtype=torch.bfloat16),
                     torch.zeros(193, 4, dtype=torch.int64, device="cuda"),
                     torch.zeros(193, 4, device="cuda"))
    with pytest.raises(TypeError, match="topk_idx"):
        stage_inputs(buf, x, idx.int(), w)
    # expert ids are checked here only with the "host" check; by default the dispatch
    # checks them on the GPU (tests/test_fused.py::test_bad_routing_is_masked_...)
    for bad in (16, -2):
        with pytest.raises(ValueError, match="topk_idx"):
            stage_inputs(buf, x, idx.clone().fill_(bad), w, validate_routing="host")
        stage_inputs(buf, x, idx.clone().fill_(bad), w, validate_routing="device")
    with pytest.raises(ValueError, match="contiguous"):
        stage_inputs(buf, torch.randn(256, 8, device="cuda", dtype=torch.bfloat16).t(), idx, w)
    with pytest.raises(ValueError, match="device"):
        stage_inputs(buf, x.cpu(), idx, w)
