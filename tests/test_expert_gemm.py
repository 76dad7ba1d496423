"""Hopper grouped GEMMs over the expert pool (L1 + SwiGLU + requant, L2): `expert_gemm`.

CPU: the weight preparation (compact FP8 weight scales) and, for every configuration the
heuristics can choose (BLOCK_M 64 / 128, L1 / L2, fp8xfp8 / bf16xbf16), a compile for sm_90a
whose SASS must show the tensor-core op (QGMMA / HGMMA), the TMA loads and setmaxnreg, and no
local memory. GPU: `testing.gemm_checks.check_expert_ffn` against the float64 reference on fresh
random pools with poisoned outputs, random / skewed / sparse / empty experts, both tile paths,
clamp on and off, fast and precise SiLU, and a small grid (many tiles per CTA).
"""

import copy
import dataclasses
import zlib

import pytest
import torch

from cute_megamoe import quant
from cute_megamoe.config import Sm90GemmConfig
from cute_megamoe.expert_gemm import ExpertWeights, _block_weight_sf
from cute_megamoe.testing.compile import ptxas_notes_or_skip

RECIPES = ("fp8xfp8", "bf16xbf16")
# the GPU checks also run the MXFP4-weight kernels (their compile tests: test_fp4_sm90_gemm.py)
GPU_RECIPES = (*RECIPES, "fp8xfp4_sm90")


def test_weights_fp8_block_scales_k_major_gate_up_order():
    gen = torch.Generator().manual_seed(0)
    e, inter, hidden = 2, 256, 384
    w1 = torch.randn(e, 2 * inter, hidden, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(e, hidden, inter, generator=gen).to(torch.bfloat16)
    q1 = quant.quantize_weights_for_recipe(w1, "fp8xfp8")
    q2 = quant.quantize_weights_for_recipe(w2, "fp8xfp8")
    w = ExpertWeights.from_quantized(q1, q2, "fp8xfp8")  # CPU weights: the arch with kernels
    assert w.arch == "sm_90a"
    # q*[1] are [E, N/128, K/128] block scales of the [gate | up] rows: the kernels read them
    # K-block major, whatever the interleave of the weight rows
    # rows padded to 16 bytes: 4 blocks for the 512 L1 rows, 3 -> 4 for the 384 L2 rows
    assert w.w1_sf.shape == (e, hidden // 128, 4) and w.w1_sf.is_contiguous()
    assert w.w2_sf.shape == (e, inter // 128, 4) and w.w2_sf.is_contiguous()
    assert torch.equal(w.w1_sf, q1[1].transpose(1, 2))
    assert torch.equal(w.w2_sf[:, :, :3], q2[1].transpose(1, 2))
    # the sm90 kernel's view of the same facts: gate/up groups of 8 rows, 128x128 blocks
    from cute_megamoe import expert_gemm
    from cute_megamoe.kernels import sm90_expert_gemm as k90

    assert k90.GATE_UP_GROUP == quant.INTERLEAVE_GRAN
    assert k90.SF_BLOCK == expert_gemm.SF_BLOCK == 128
    u8 = torch.uint8
    # (stored in TMA-box order by default: `ExpertWeights.tiled`)
    from cute_megamoe.expert_gemm import tile_weight_rows

    assert w.tiled and not ExpertWeights.from_quantized(q1, q2, "fp8xfp8", tiled=False).tiled
    plain = w.untiled_copy()
    assert torch.equal(plain.w1.view(u8), quant.interleave_gate_up(q1[0]).view(u8))
    assert torch.equal(plain.w2.view(u8), q2[0].view(u8))
    assert torch.equal(w.w1.view(u8), tile_weight_rows(plain.w1).view(u8))


def test_weights_reject_per_row_scales_and_other_recipes():
    sf = torch.ones(1, 256, 2)
    sf[0, 3, 0] = 2.0  # differs inside the first block of 128 rows
    for gate_up in (False, True):
        with pytest.raises(ValueError, match="equal within every block"):
            _block_weight_sf(sf, "sf", gate_up)
    with pytest.raises(ValueError, match="no grouped-GEMM kernels on 'sm_90a'.*TorchExpertWeights"):
        ExpertWeights.from_quantized(None, None, "fp8xfp4", arch="sm90")
    with pytest.raises(ValueError, match="no grouped-GEMM kernels on 'sm_100a'"):
        ExpertWeights.from_quantized(None, None, "fp8xfp8", arch="sm_100a")


@pytest.mark.parametrize("recipe,hidden,inter,match", [
    ("fp8xfp8", 1000, 512, "not whole blocks of 128.*hidden and 2 \\* intermediate"),
    ("fp8xfp8", 1024, 200, "not whole blocks of 128"),
    ("fp8xfp4_sm90", 1000, 512, "hidden .* must be a multiple of 32"),
    ("fp8xfp4_sm90", 1024, 520, "intermediate .* must be a multiple of 32")])
def test_weights_reject_sizes_their_scales_cannot_cover(recipe, hidden, inter, match):
    """Sizes the recipe's scale blocks do not tile raise a `ValueError` naming the sizes when
    the weights are made (a reshape error deep in the conversion before)."""
    w1 = torch.randn(2, 2 * inter, hidden).to(torch.bfloat16)
    w2 = torch.randn(2, hidden, inter).to(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        ExpertWeights.from_bf16(w1, w2, recipe, arch="sm_90a")


def test_weights_fp4_for_sm100():
    gen = torch.Generator().manual_seed(1)
    e, inter, hidden = 2, 128, 256
    w1 = torch.randn(e, 2 * inter, hidden, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(e, hidden, inter, generator=gen).to(torch.bfloat16)
    w = ExpertWeights.from_bf16(w1, w2, "fp8xfp4", arch="sm_100a")
    assert (w.hidden, w.intermediate, w.arch) == (hidden, inter, "sm_100a")
    assert w.w1.dtype == torch.int8 and w.w1.shape == (e, 2 * inter, hidden // 2)
    assert w.w1_sf.shape == (e, hidden // 128, 2 * inter) and w.w1_sf.is_contiguous()
    assert w.w2_sf.shape == (e, inter // 128, hidden) and w.w2_sf.is_contiguous()


def test_weights_bf16_interleaved():
    w1 = torch.randn(2, 32, 128).to(torch.bfloat16)
    w2 = torch.randn(2, 128, 16).to(torch.bfloat16)
    w = ExpertWeights.from_bf16(w1, w2, "bf16xbf16", arch="sm_90a")
    assert w.w1_sf is None and torch.equal(w.w1, quant.interleave_gate_up(w1))


def test_check_pool_capacity():
    from cute_megamoe.expert_gemm import check_pool_capacity

    counts = torch.tensor([65, 0, 1], dtype=torch.int32)  # 2 + 0 + 1 blocks of 64
    check_pool_capacity(counts, 64, 192)
    with pytest.raises(ValueError, match="need 256 pool rows"):
        check_pool_capacity(counts, 128, 192)
    with pytest.raises(ValueError, match=">= 0"):
        check_pool_capacity(torch.tensor([-1], dtype=torch.int32), 64, 64)


def test_expert_ffn_rejects_cpu_tensors():
    from cute_megamoe.expert_gemm import expert_ffn

    w = ExpertWeights.from_bf16(torch.zeros(1, 32, 128, dtype=torch.bfloat16),
                                torch.zeros(1, 128, 16, dtype=torch.bfloat16), "bf16xbf16",
                                arch="sm_90a")
    with pytest.raises(ValueError, match="CUDA"):
        expert_ffn(torch.zeros(64, 128, dtype=torch.bfloat16), None, torch.zeros(64),
                   torch.zeros(1, dtype=torch.int32), w, block_m=64)


# ------------------------------------------------------------------------------ compile (CPU)

def _compile(phase: str, recipe: str, block_m: int, hidden: int = 7168, inter: int = 2048,
             arch: str = "sm_90a", combine_layout=None):
    """Compile exactly what `expert_ffn` launches (`gemm_kernel`'s kernel and pointer types)."""
    from cutlass import Int32

    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        gemm_kernel_for,
    )

    n, k = (2 * inter, hidden) if phase == "l1" else (hidden, inter)
    pool_rows = 8192 if combine_layout is None else combine_layout.num_pool_rows
    kernel, dtypes = gemm_kernel_for(arch, recipe, phase, 32, pool_rows, n, k, block_m,
                                     activation_clamp=10.0, combine_layout=combine_layout)
    args = [fake_ptr(d, 4 if i == 4 else 16) for i, d in enumerate(dtypes)]
    return compile_for_arch(kernel, *args, Int32(132), fake_stream(), arch=arch)


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("phase", ("l1", "l2"))
@pytest.mark.parametrize("block_m", (64, 128))
def test_compiles_sm90_with_tensor_cores_and_no_spills(recipe, phase, block_m):
    from cute_megamoe.heuristics import DEFAULT_PROMOTION

    art = _compile(phase, recipe, block_m)
    # (FP8 at BLOCK_M 64 promotes by 64-column quarters: m64n64 WGMMAs)
    n = 64 if DEFAULT_PROMOTION.get((recipe, block_m)) == "quarter" else 128
    shape = f"m64n{n}k32.f32.e4m3.e4m3" if recipe == "fp8xfp8" else "m64n128k16.f32.bf16.bf16"
    assert f"wgmma.mma_async.sync.aligned.{shape}" in art.ptx
    assert "setmaxnreg" in art.ptx
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("QGMMA" if recipe == "fp8xfp8" else "HGMMA") > 0
    assert art.count("UTMALDG") > 0
    # BLOCK_M 128 runs in 2-CTA clusters that multicast the weight tile
    multicast = art.count("UTMALDG.2D.MULTICAST")
    assert multicast > 0 if block_m == 128 else multicast == 0
    # ... and its second consumer warpgroup starts 2 k-blocks late (a named-barrier arrive)
    assert (art.count("BAR.ARV") > 0) == (phase == "l2" and block_m == 128)
    assert art.count("USETMAXREG") == 2
    assert art.count("STL") == 0 and art.count("LDL") == 0
    # staged epilogue: tile rows leave shared memory by bulk copies, not per-thread stores
    # (the only global stores left are the FP8 L1 scales, one per row); fp8xfp8 (`tma_store`)
    # by TMA tensor stores of whole boxes (L1: one per warp and tile, L2: four), a warp with pad
    # rows its valid rows by 16-byte stores from the boxes
    scale_stores = 2 if recipe == "fp8xfp8" and phase == "l1" else 0
    if recipe == "fp8xfp8":
        boxes = 1 if phase == "l1" else 4
        assert art.count("UTMASTG") == boxes and art.count("UBLKCP.G.S") == 0
        assert art.count("STG.E.128") == 8 * boxes
        assert art.count("STG") == 8 * boxes + scale_stores
    else:
        assert art.count("UBLKCP.G.S") > 0 and art.count("UTMASTG") == 0
        assert art.count("STG") == scale_stores
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


@pytest.mark.compile
@pytest.mark.parametrize("phase", ("l1", "l2"))
@pytest.mark.parametrize("block_m", (64, 128))
def test_sm90_quarter_promotion_compiles_with_m64n64_wgmmas(phase, block_m):
    """The "quarter" promotion (both FP8 recipes' default at BLOCK_M 64, set by
    `Sm90GemmConfig.promotion`): m64n64 WGMMAs into two scratch accumulators, three waits
    that leave one group in flight per k-block (the promotion of a quarter runs beside the next
    quarter's WGMMAs), no spills; FP8 only."""
    from cutlass import Int32

    from cute_megamoe.kernels.sm90_expert_gemm import Sm90ExpertGemmKernel
    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        gemm_kernel_for,
    )

    n, k = (4096, 7168) if phase == "l1" else (7168, 2048)
    # the default: by BLOCK_M, for both FP8 recipes; BF16 has no promotion
    for recipe in ("fp8xfp8", "fp8xfp4_sm90"):
        default, _ = gemm_kernel_for("sm_90a", recipe, phase, 32, 8192, n, k, block_m,
                                     activation_clamp=10.0)
        want = "quarter" if block_m == 64 else "chunk"
        assert default.promotion == want, recipe
    assert gemm_kernel_for("sm_90a", "bf16xbf16", phase, 32, 8192, n, k, block_m,
                           Sm90GemmConfig(promotion="quarter"))[0].promotion == "chunk"
    kernel, dtypes = gemm_kernel_for("sm_90a", "fp8xfp8", phase, 32, 8192, n, k, block_m,
                                     Sm90GemmConfig(promotion="quarter"), activation_clamp=10.0)
    assert kernel.promotion == "quarter" and kernel.quarters == 4
    art = compile_for_arch(kernel, *(fake_ptr(d, 4 if i == 4 else 16)
                                     for i, d in enumerate(dtypes)),
                           Int32(132), fake_stream(), arch="sm_90a")
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("QGMMA.64x64x32.F32.E4M3.E4M3") > 0 and art.count("QGMMA.64x128x32") == 0
    assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    with pytest.raises(ValueError, match="promotion"):  # (BF16: no quarters)
        Sm90ExpertGemmKernel(phase, "bf16xbf16", 32, 8192, n, k,
                             dataclasses.replace(kernel.config, tma_store=False))
    with pytest.raises(ValueError, match="Sm90GemmConfig.promotion"):
        Sm90GemmConfig(promotion="chunk_rs")


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ("fp8xfp8", "fp8xfp4_sm90"))
@pytest.mark.parametrize("phase,n,k", [("l1", 4096, 7168), ("l2", 7168, 2048),
                                       ("l2", 1152, 512)])
def test_sm90_transposed_compiles_with_m64n16_wgmmas(recipe, phase, n, k, monkeypatch):
    """`Sm90GemmConfig.transposed` (BLOCK_M 64): the weight tile as the WGMMA's A, 16-token
    sub-blocks: m64n16k32 WGMMAs only, 4 per m64 block of the tile per sub-block (two groups
    of two sub-blocks, each group built for both and for its first alone), no spills, WGMMAs
    not serialized, and no WGMMA descriptor moved from a vector register (R2UR) among them
    (the issue order keeps them on the uniform datapath); BLOCK_M 128 and BF16 are built
    without it. The pool block's rows load in 16-row TMA boxes of received tokens, the stage's
    barrier expecting one box in its transaction count (the others per tile)."""
    import re

    from cutlass import Int32

    from cute_megamoe.kernels.sm90_expert_gemm_transposed import Sm90TransposedExpertGemmKernel
    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        gemm_kernel_for,
    )

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, dtypes = gemm_kernel_for("sm_90a", recipe, phase, 32, 8192, n, k, 64,
                                     Sm90GemmConfig(transposed=True), activation_clamp=10.0)
    assert isinstance(kernel, Sm90TransposedExpertGemmKernel)
    assert (kernel.weight_blocks, kernel.token_blocks) == (kernel.block_n // 64, 4)
    assert kernel.a_box_rows == 16
    assert kernel.stage_tx_bytes - kernel.ring_tx_bytes == 48 * 128
    for other in (gemm_kernel_for("sm_90a", recipe, phase, 32, 8192, n, k, 128, None, 1.0,
                                  activation_clamp=10.0)[0],
                  gemm_kernel_for("sm_90a", "bf16xbf16", phase, 32, 8192, n, k, 64, None, 1.0,
                                  activation_clamp=10.0)[0]):
        assert not isinstance(other, Sm90TransposedExpertGemmKernel)
    art = compile_for_arch(kernel, *(fake_ptr(d, 4 if i == 4 else 16)
                                     for i, d in enumerate(dtypes)),
                           Int32(132), fake_stream(), arch="sm_90a")
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("QGMMA") == art.count("QGMMA.64x16x32.F32.E4M3.E4M3") \
        == 4 * kernel.weight_blocks * (kernel.token_blocks + kernel.token_blocks // 2)
    assert art.count("HGMMA") == 0  # (no empty WGMMA carrying a group's scoreboard)
    assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    ops = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                     art.sass, re.M)
    wgmmas = [i for i, op in enumerate(ops) if op.startswith("QGMMA")]
    assert "R2UR" not in ops[wgmmas[0] - 40: wgmmas[-1] + 1]
    with pytest.raises(ValueError, match="transposed"):  # (a staged kernel's configuration)
        Sm90TransposedExpertGemmKernel(phase, recipe, 32, 8192, n, k,
                                       dataclasses.replace(kernel.config, transposed=False))
    with pytest.raises(ValueError, match="transposed"):
        Sm90TransposedExpertGemmKernel(phase, "bf16xbf16", 32, 8192, n, k, kernel.config)
    with pytest.raises(ValueError, match="block_m"):
        Sm90GemmConfig(block_m=128, transposed=True)
    assert ptxas_notes_or_skip(art) == []  # (last: skips where ptxas cannot read the PTX)


@pytest.mark.compile
@pytest.mark.parametrize("recipe,promotion,block_m", [
    ("fp8xfp8", "chunk", 128), ("fp8xfp8", "quarter", 64), ("fp8xfp8", "quarter", 128),
    ("fp8xfp4_sm90", "chunk", 128), ("fp8xfp4_sm90", "quarter", 64), ("bf16xbf16", "chunk", 128)])
@pytest.mark.parametrize("phase", ("l1", "l2"))
def test_sm90_wgmmas_are_not_serialized(recipe, promotion, block_m, phase):
    """ptxas keeps the WGMMAs asynchronous (no "wgmma serialized" performance note: a
    non-WGMMA access to an in-flight accumulator, or a wait it cannot match, makes it wait
    after every WGMMA; a "carry" promotion across k-blocks did that)."""
    from cutlass import Int32

    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        find_cuda_tool,
        gemm_kernel_for,
    )

    if find_cuda_tool("ptxas") is None:
        pytest.skip("ptxas not available")
    n, k = (4096, 7168) if phase == "l1" else (7168, 2048)
    kernel, dtypes = gemm_kernel_for("sm_90a", recipe, phase, 32, 8192, n, k, block_m,
                                     Sm90GemmConfig(promotion=promotion), activation_clamp=10.0)
    assert kernel.promotion == promotion
    art = compile_for_arch(kernel, *(fake_ptr(d, 4 if i == 4 else 16)
                                     for i, d in enumerate(dtypes)),
                           Int32(132), fake_stream(), arch="sm_90a")
    assert ptxas_notes_or_skip(art) == []


def test_sm90_raster_band_fits_l2_budget():
    """A raster band holds as many cluster groups of pool blocks as keep its activation rows
    within RASTER_L2_BYTES (at least one group)."""
    from cute_megamoe.kernels.sm90_expert_gemm import RASTER_L2_BYTES
    from cute_megamoe.testing.compile import gemm_kernel_for

    for phase, recipe, block_m, cluster_m, want in (
            ("l1", "fp8xfp8", 128, 2, 9), ("l1", "bf16xbf16", 128, 2, 4),
            ("l2", "fp8xfp8", 128, 2, 32), ("l2", "bf16xbf16", 128, 2, 16),
            ("l1", "fp8xfp8", 64, 1, 36)):
        n, k = (4096, 7168) if phase == "l1" else (7168, 2048)
        kern, _ = gemm_kernel_for("sm_90a", recipe, phase, 32, 32768, n, k, block_m,
                                  Sm90GemmConfig(cluster_m=cluster_m))
        band_bytes = cluster_m * block_m * k * (1 if recipe == "fp8xfp8" else 2)
        assert kern.raster_group == want
        assert want * band_bytes <= RASTER_L2_BYTES < (want + 1) * band_bytes
    assert gemm_kernel_for("sm_90a", "fp8xfp8", "l1", 4, 1024, 4096, 1 << 20,
                           128)[0].raster_group == 1


def test_sm90_staging_and_stages_fit_shared_memory():
    """The staged epilogue's rows and the pipeline stages share the 227 KB of shared memory:
    whole tile rows for FP8; for BF16 whole rows where that costs no stage, a chunk or half a
    chunk at a time where that saves one."""
    from cute_megamoe.kernels.sm90_expert_gemm import SMEM_BUDGET
    from cute_megamoe.testing.compile import gemm_kernel_for

    expect = {  # (phase, recipe, block_m) -> (staging parts, stages)
        ("l1", "fp8xfp8", 128): (1, 4), ("l2", "fp8xfp8", 128): (1, 3),
        ("l1", "bf16xbf16", 128): (2, 4), ("l2", "bf16xbf16", 128): (4, 4),
        ("l1", "fp8xfp8", 64): (1, 5), ("l2", "fp8xfp8", 64): (1, 4),
        ("l2", "bf16xbf16", 64): (2, 5),
    }
    for (phase, recipe, block_m), (parts, stages) in expect.items():
        n, k = (4096, 7168) if phase == "l1" else (7168, 2048)
        kern, _ = gemm_kernel_for("sm_90a", recipe, phase, 32, 32768, n, k, block_m,
                                  activation_clamp=10.0)
        assert (kern.staging_parts, kern.num_stages) == (parts, stages), (phase, recipe, block_m)
        # warpgroup 1 trails warpgroup 0 by 2 k-blocks in L2 (within the stage ring), not in L1
        assert kern.wg_skew == (min(2, stages - 1) if phase == "l2" and block_m == 128 else 0)
        used = kern.staging_bytes + kern.num_stages * (kern.stage_tx_bytes + 64)
        assert used <= SMEM_BUDGET
        # staging rows: 16 per consumer warp, 16-byte aligned for the bulk copies, 16 bytes of
        # padding; fp8xfp8 (TMA stores of 128-byte-swizzled boxes): whole rows, no padding
        assert kern.staging_stride % 16 == 0
        assert kern.tma_store == (recipe == "fp8xfp8")
        assert kern.staging_stride == kern.tile_row_bytes // parts + (0 if kern.tma_store else 16)


def test_sm90_clusters_need_256_column_tiles():
    from cute_megamoe.kernels.sm90_expert_gemm import Sm90ExpertGemmKernel
    from cute_megamoe.testing.compile import gemm_kernel_for

    kern, _ = gemm_kernel_for("sm_90a", "bf16xbf16", "l2", 4, 1024, 7168, 2048, 128)
    assert kern.cluster_m == 2 and kern.scheduler.cluster_m == 2
    # (N = 7040: 128-column tiles; the heuristics keep them single)
    assert gemm_kernel_for("sm_90a", "bf16xbf16", "l2", 4, 1024, 7040, 2048, 128)[0] \
        .cluster_m == 1
    with pytest.raises(ValueError, match="cluster_m"):
        Sm90ExpertGemmKernel("l2", "bf16xbf16", 4, 1024, 7040, 2048, kern.config)
    with pytest.raises(ValueError, match="cluster_m"):
        Sm90GemmConfig(cluster_m=4)


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("block_m", (64, 128))
def test_sm90_l2_compiles_sending_rows_to_the_combine_buffers(recipe, block_m):
    """L2 with the combine buffers as destination (design step f): the same tensor-core
    mainloop, rows leave by bulk copies to addresses built from the pool row's metadata, no
    spills."""
    from cute_megamoe.layout import MegaMoELayout

    layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe)
    art = _compile("l2", recipe, block_m, combine_layout=layout)
    if art.sass is None:
        pytest.skip("nvdisasm not available")
    assert art.count("QGMMA" if recipe == "fp8xfp8" else "HGMMA") > 0
    assert art.count("UBLKCP.G.S") > 0 and art.count("STG") == 0
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


@pytest.mark.compile
@pytest.mark.parametrize("recipe,block_m", [("fp8xfp8", 128), ("fp8xfp8", 64),
                                            ("fp8xfp4_sm90", 128)])
def test_sm90_k_unroll(recipe, block_m, monkeypatch):
    """The FP8 consumer loop's k-blocks per body (`heuristics.DEFAULT_K_UNROLL`: 4 for fp8xfp8
    at BLOCK_M 128, else 1; MXFP4 weights in the clusters that share the decode, BLOCK_M 128
    with no token count: `SHARED_DECODE_K_UNROLL`; `Sm90GemmConfig.k_unroll` sets it): that
    many k-blocks' WGMMAs in the SASS (8 per k-block: two chunks of four k32 steps), no
    spills."""
    from cutlass import Int32

    from cute_megamoe.heuristics import SHARED_DECODE_K_UNROLL
    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        gemm_kernel_for,
    )

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")

    want = {("fp8xfp8", 128): 4, ("fp8xfp4_sm90", 128): SHARED_DECODE_K_UNROLL}.get(
        (recipe, block_m), 1)
    # (forced: with the chunk promotion; the quarter one's scratch pairs spill when unrolled)
    forcings = {("fp8xfp8", 64): (None,), ("fp8xfp4_sm90", 64): (None,),
                ("fp8xfp4_sm90", 128): (None, 1)}
    for forced in forcings.get((recipe, block_m), (None, 2)):
        if forced:
            want = forced
        kernel, dtypes = gemm_kernel_for("sm_90a", recipe, "l2", 32, 8192, 7168, 2048, block_m,
                                         Sm90GemmConfig(k_unroll=forced),
                                         tiled_weights=True)
        assert kernel.k_unroll == want
        art = compile_for_arch(kernel, *(fake_ptr(d, 4 if i == 4 else 16)
                                         for i, d in enumerate(dtypes)),
                               Int32(132), fake_stream(), arch="sm_90a")
        if art.sass is None:
            pytest.skip("nvdisasm not available")
        per_k_block = 16 if kernel.quarter_promotion else 8  # (quarters: 4 x m64n64, 4 k32)
        assert art.count("QGMMA") == per_k_block * want
        assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    for bad in (3, 8):
        with pytest.raises(ValueError, match="k_unroll"):
            Sm90GemmConfig(k_unroll=bad)


@pytest.mark.compile
@pytest.mark.parametrize("phase,block_m", [("l1", 128), ("l2", 64), ("l2", 128)])
def test_sm90_tma_store_compiles(phase, block_m, monkeypatch):
    """fp8xfp8 into `out` (the default, `heuristics.DEFAULT_TMA_STORE`; ``tma_store=False``,
    the fused kernel's L1, the row copies): the epilogue sends a warp's rows as TMA tensor
    stores of swizzled 16-row x 128-byte boxes (L2: four, L1: one; no row copies left: the only
    bulk copies are the producer's scale loads), no spills; refused for BF16 and the combine
    buffers as destination."""
    from cutlass import Int32

    from cute_megamoe.kernels.sm90_expert_gemm import Sm90ExpertGemmKernel
    from cute_megamoe.layout import MegaMoELayout
    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        gemm_kernel_for,
    )

    n, k = (4096, 7168) if phase == "l1" else (7168, 2048)
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    assert not gemm_kernel_for("sm_90a", "fp8xfp8", phase, 32, 8192, n, k, block_m,
                               Sm90GemmConfig(tma_store=False),
                               activation_clamp=10.0)[0].tma_store
    kernel, dtypes = gemm_kernel_for("sm_90a", "fp8xfp8", phase, 32, 8192, n, k, block_m,
                                     activation_clamp=10.0, tiled_weights=True)
    assert kernel.tma_store and kernel.staging_stride == kernel.tile_row_bytes
    art = compile_for_arch(kernel, *(fake_ptr(d, 4 if i == 4 else 16)
                                     for i, d in enumerate(dtypes)),
                           Int32(132), fake_stream(), arch="sm_90a")
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in art.ptx
    if art.sass is None:
        pytest.skip("nvdisasm not available")
    assert art.count("UTMASTG") == (4 if phase == "l2" else 1)
    assert art.count("UBLKCP.G.S") == 0
    assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    # (the combine buffers as destination keep their row copies: the option does not apply)
    layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, "fp8xfp8")
    assert not gemm_kernel_for("sm_90a", "fp8xfp8", "l2", 32, layout.num_pool_rows, 7168, 2048,
                               block_m, Sm90GemmConfig(tma_store=True),
                               combine_layout=layout)[0].tma_store
    with pytest.raises(ValueError, match="tma_store"):
        Sm90ExpertGemmKernel(phase, "bf16xbf16", 32, 8192, n, k, kernel.config)
    assert not gemm_kernel_for("sm_90a", "bf16xbf16", phase, 32, 8192, n, k, block_m,
                               Sm90GemmConfig(tma_store=True))[0].tma_store


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", (64, 128))
def test_tma_store_is_bit_identical(block_m):
    """The rows sent by TMA tensor stores (the fp8xfp8 default: L1's into the L2 pool, L2's
    into `out`) equal the row copies' (``tma_store=False``) bit for bit, every
    valid row written to its last column (warps whose 16 rows all hold tokens: the stores;
    warps with pad rows: their lanes' copies), pad rows untouched."""
    from cute_megamoe.testing.gemm_checks import (
        COUNT_PATTERNS,
        assert_same_valid_rows,
        make_pool_problem,
        run_fp8_ffn_poisoned,
    )

    device = _gpu()
    for pattern in ("random", "skewed", "sparse"):
        problem = make_pool_problem("fp8xfp8", COUNT_PATTERNS[pattern], block_m, 1024, 512,
                                    device, seed=53 + block_m)
        results = [run_fp8_ffn_poisoned(problem, config=Sm90GemmConfig(tma_store=value))
                   for value in (False, True)]
        assert_same_valid_rows(problem, results)


@pytest.mark.parametrize("arch,recipe", [("sm_90a", "fp8xfp8"), ("sm_100a", "fp8xfp4")])
def test_combine_layout_only_for_l2_of_the_same_pool(arch, recipe):
    from cute_megamoe.layout import MegaMoELayout
    from cute_megamoe.testing.compile import gemm_kernel_for

    layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe)
    pool = layout.num_pool_rows
    kern, dtypes = gemm_kernel_for(arch, recipe, "l2", 32, pool, 7168, 2048, 128,
                                   combine_layout=layout)
    assert kern.to_combine and kern.combine_tokens == 512
    assert len(dtypes) == (11 if arch == "sm_90a" else 10)  # sm_90a: FP4 per-32 scales last
    with pytest.raises(ValueError, match="combine_layout"):
        gemm_kernel_for(arch, recipe, "l1", 32, pool, 4096, 7168, 128, combine_layout=layout)
    with pytest.raises(ValueError, match="combine_layout"):
        gemm_kernel_for(arch, recipe, "l2", 32, pool + 128, 7168, 2048, 128,
                        combine_layout=layout)


@pytest.mark.compile
@pytest.mark.parametrize("phase", ("l1", "l2"))
def test_expert_ffn_plan_compiles_for_sm100(phase):
    """The sm_100a plan `expert_ffn` uses on Blackwell (fp8xfp4): block-scaled MMA present."""
    art = _compile(phase, "fp8xfp4", 128, arch="sm_100a")
    assert "kind::mxf8f6f4.block_scale" in art.ptx
    if art.sass is not None:
        assert art.count("UTCQMMA") > 0 and art.count("STL") == 0


def test_gemm_kernel_rejects_unknown_arch():
    from cute_megamoe.expert_gemm import gemm_kernel

    with pytest.raises(ValueError, match="sm_80"):
        gemm_kernel("sm_80", "bf16xbf16", "l1", 8, 1024, 512, 256, Sm90GemmConfig())


# ---------------------------------------------------------------------------------- GPU checks

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm90 kernels need a Hopper GPU")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
@pytest.mark.parametrize("block_m", (64, 128))
@pytest.mark.parametrize("pattern", ("random", "skewed", "sparse", "empty"))
def test_expert_ffn_matches_reference(recipe, block_m, pattern):
    from cute_megamoe.testing.gemm_checks import COUNT_PATTERNS, check_expert_ffn, make_pool_problem

    device = _gpu()
    problem = make_pool_problem(recipe, COUNT_PATTERNS[pattern], block_m, 512, 256, device,
                                seed=zlib.crc32(f"{recipe}{block_m}{pattern}".encode()) % 1000)
    check_expert_ffn(problem, activation_clamp=7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
@pytest.mark.parametrize("clamp,fast_math,num_sms", [(None, True, 7), (3.0, False, 5),
                                                     (None, False, None)])
def test_expert_ffn_clamp_precise_small_grid(recipe, clamp, fast_math, num_sms):
    from cute_megamoe.testing.gemm_checks import COUNT_PATTERNS, check_expert_ffn, make_pool_problem

    device = _gpu()
    problem = make_pool_problem(recipe, COUNT_PATTERNS["random"], 128, 1024, 512, device,
                                seed=17)
    check_expert_ffn(problem, activation_clamp=clamp, fast_math=fast_math, num_sms=num_sms)


@pytest.mark.gpu
def test_expert_ffn_rejects_bad_inputs():
    from cute_megamoe.expert_gemm import expert_ffn
    from cute_megamoe.testing.gemm_checks import make_pool_problem

    device = _gpu()
    p = make_pool_problem("fp8xfp8", [3, 0], 64, 256, 128, device)
    counts = torch.tensor(p.counts, dtype=torch.int32, device=device)
    args = (p.acts, p.acts_sf, p.topk_weights, counts, p.weights)
    with pytest.raises(ValueError, match="block_m"):
        expert_ffn(*args, block_m=96)
    with pytest.raises(ValueError, match="no grouped-GEMM kernels on 'sm_100a'"):
        ExpertWeights(p.weights.recipe, p.weights.w1, p.weights.w2, p.weights.w1_sf,
                      p.weights.w2_sf, arch="sm_100a")
    bad = copy.copy(p.weights)
    bad.arch = "sm_100a"  # (weights prepared elsewhere, then relabelled)
    with pytest.raises(ValueError, match="prepared for sm_100a"):
        expert_ffn(p.acts, p.acts_sf, p.topk_weights, counts, bad, block_m=64)
    with pytest.raises(ValueError, match="acts_sf"):
        expert_ffn(p.acts, None, p.topk_weights, counts, p.weights, block_m=64)
    with pytest.raises(ValueError, match="acts_sf"):
        expert_ffn(p.acts, p.acts_sf.contiguous(), p.topk_weights, counts, p.weights,
                   block_m=64)
    with pytest.raises(TypeError, match="expert_recv_tokens"):
        expert_ffn(p.acts, p.acts_sf, p.topk_weights, counts.long(), p.weights, block_m=64)
    with pytest.raises(ValueError, match="pool rows in blocks"):
        too_many = torch.tensor([p.acts.shape[0] + 1, 0], dtype=torch.int32, device=device)
        expert_ffn(p.acts, p.acts_sf, p.topk_weights, too_many, p.weights, block_m=64)
    with pytest.raises(ValueError, match="multiple of block_m"):
        expert_ffn(p.acts[:-1], p.acts_sf[:-1], p.topk_weights[:-1], counts, p.weights,
                   block_m=64)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_expert_ffn_deepseek_shape(recipe):
    """H 7168, I 2048 (56 / 16 K-blocks, 16 / 32 L1 n-tiles, 56 L2 n-tiles); the quantized
    recipes' error against the unquantized FFN in float64 at most 1.01x the reference's."""
    from cute_megamoe.testing.gemm_checks import COUNT_PATTERNS, check_expert_ffn, make_pool_problem

    device = _gpu()
    problem = make_pool_problem(recipe, COUNT_PATTERNS["random"], 128, 7168, 2048, device,
                                seed=5, keep_unquantized=True)
    stats = check_expert_ffn(problem, activation_clamp=10.0)
    assert stats["unquantized_err"] > 0 and stats["ref_unquantized_err"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_expert_ffn_narrow_tiles(recipe):
    """H 640: the L2 GEMM (N = H) falls back to 128-column tiles; I 384 gives 3 L1 tiles."""
    from cute_megamoe.testing.gemm_checks import COUNT_PATTERNS, check_expert_ffn, make_pool_problem

    device = _gpu()
    problem = make_pool_problem(recipe, COUNT_PATTERNS["random"], 64, 640, 384, device, seed=9)
    check_expert_ffn(problem, activation_clamp=None, num_sms=11)


def test_tile_weight_rows_stores_contiguous_boxes():
    """`tile_weight_rows`: the same shape, each [128 rows, 128 bytes] box contiguous, row
    blocks one after the other, a row block's k-blocks in order; `ExpertWeights.tiled` only
    for the sm_90a FP8 / BF16 weights, and `tiled_copy` keeps the scales."""
    from cute_megamoe.expert_gemm import tile_weight_rows

    for dtype, bk in ((torch.float8_e4m3fn, 128), (torch.bfloat16, 64)):
        e, n, k = 2, 256, 3 * bk
        w = torch.randn(e, n, k).to(dtype)
        t = tile_weight_rows(w)
        assert t.shape == w.shape and t.dtype == w.dtype and t.is_contiguous()
        flat = t.reshape(-1).view(torch.uint8 if dtype != torch.bfloat16 else torch.int16)
        src = w.view(flat.dtype)
        for ei, ni, ki in ((0, 0, 0), (1, 255, 3 * bk - 1), (0, 129, bk + 5), (1, 7, 2 * bk)):
            r = ei * n + ni
            index = ((r // 128) * (k // bk) + ki // bk) * 128 * bk + (r % 128) * bk + ki % bk
            assert flat[index] == src[ei, ni, ki]
        assert torch.equal(torch.sort(flat).values, torch.sort(src.reshape(-1)).values)
    with pytest.raises(ValueError, match="boxes"):
        tile_weight_rows(torch.zeros(1, 192, 128, dtype=torch.bfloat16))
    q = quant.quantize_weights_for_recipe
    w1, w2 = torch.randn(2, 512, 256), torch.randn(2, 256, 256)
    weights = ExpertWeights.from_quantized(q(w1, "fp8xfp8"), q(w2, "fp8xfp8"), "fp8xfp8",
                                           arch="sm_90a")
    assert weights.tiled  # (the constructors' default on sm_90a)
    weights = weights.untiled_copy()
    tiled = weights.tiled_copy()
    assert tiled.tiled and not weights.tiled and tiled.tiled_copy() is tiled
    assert torch.equal(tiled.untiled_copy().w1.view(torch.uint8), weights.w1.view(torch.uint8))
    assert tiled.w1_sf is weights.w1_sf and torch.equal(tiled.w2, tile_weight_rows(weights.w2))
    with pytest.raises(ValueError, match="tiled"):
        ExpertWeights("fp8xfp4", weights.w1, weights.w2, tiled=True, arch="sm_100a")


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16", "fp8xfp4_sm90"))
@pytest.mark.parametrize("phase,n,k", [("l1", 4096, 7168), ("l2", 7168, 2048)])
def test_sm90_tiled_weights_load_4d_boxes(recipe, phase, n, k, monkeypatch):
    """Tiled weights (`ExpertWeights.tiled`): the weight loads (MXFP4: of the packed codes)
    are 4-D TMA boxes (each one contiguous run of HBM), the pool rows stay 2-D; no spills."""
    from cutlass import Int32

    from cute_megamoe.config import Sm100GemmConfig
    from cute_megamoe.launch import gemm_kernel
    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        gemm_kernel_for,
    )

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    for block_m in (64, 128):
        kernel, dtypes = gemm_kernel_for("sm_90a", recipe, phase, 8, 2048, n, k, block_m,
                                         activation_clamp=10.0, tiled_weights=True)
        art = compile_for_arch(kernel, *(fake_ptr(d, 4 if i == 4 else 16)
                                         for i, d in enumerate(dtypes)),
                               Int32(132), fake_stream(), arch="sm_90a")
        assert "cp.async.bulk.tensor.4d" in art.ptx and "cp.async.bulk.tensor.2d" in art.ptx
        if art.sass is not None:
            assert art.count("UTMALDG.4D") > 0 and art.count("UTMALDG.2D") > 0
            assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    with pytest.raises(ValueError, match="tiled_weights"):
        gemm_kernel("sm_100a", "bf16xbf16", phase, 8, 2048, n, k, Sm100GemmConfig(64),
                    tiled_weights=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", (64, 128))
def test_tiled_weights_are_bit_identical(block_m):
    """The grouped GEMMs on weights in TMA-box order (`ExpertWeights.tiled`) equal them on
    row-order weights bit for bit (fp8xfp8 and MXFP4 weights: L2 inputs, scales and outputs,
    pad rows untouched) and pass the reference checks (bf16xbf16)."""
    import dataclasses

    from cute_megamoe.testing.gemm_checks import (
        COUNT_PATTERNS,
        assert_same_valid_rows,
        check_expert_ffn,
        make_pool_problem,
        run_fp8_ffn_poisoned,
    )

    device = _gpu()
    for recipe in ("fp8xfp8", "fp8xfp4_sm90"):  # (MXFP4 in boxes: an A/B option)
        problem = make_pool_problem(recipe, COUNT_PATTERNS["skewed"], block_m, 1024, 512,
                                    device, seed=31 + block_m)
        weights = problem.weights
        other = weights.untiled_copy() if weights.tiled else weights.tiled_copy()
        assert_same_valid_rows(problem, [
            run_fp8_ffn_poisoned(problem),
            run_fp8_ffn_poisoned(dataclasses.replace(problem, weights=other))])
    bf16 = make_pool_problem("bf16xbf16", COUNT_PATTERNS["random"], block_m, 1024, 512, device,
                             seed=37 + block_m)
    check_expert_ffn(dataclasses.replace(bf16, weights=bf16.weights.tiled_copy()),
                     activation_clamp=10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ("fp8xfp8", "fp8xfp4_sm90"))
@pytest.mark.parametrize("block_m,variant", [(64, "quarter"), (128, "quarter"),
                                             (64, "transposed"), (128, "unroll4"),
                                             (128, "unroll2")])
def test_mainloop_variants_are_bit_identical_to_chunk(recipe, block_m, variant):
    """The "quarter" promotion, the consumer loop unrolled by 4 or 2 k-blocks (at BLOCK_M 128
    MXFP4 weights run in the clusters that share the decode, whose default is 2) and the
    transposed kernels (`Sm90GemmConfig` fields) compute the same products and promote them in
    the same order as "chunk" with one k-block per loop body: L2 inputs, their scales and the
    outputs equal bit for bit, pad rows untouched."""
    from cute_megamoe.testing.gemm_checks import (
        COUNT_PATTERNS,
        assert_same_valid_rows,
        make_pool_problem,
        run_fp8_ffn_poisoned,
    )

    device = _gpu()
    problem = make_pool_problem(recipe, COUNT_PATTERNS["skewed"], block_m, 1024, 512, device,
                                seed=23 + block_m)
    config = {"quarter": Sm90GemmConfig(promotion="quarter"),
              "unroll4": Sm90GemmConfig(promotion="chunk", k_unroll=4),
              "unroll2": Sm90GemmConfig(promotion="chunk", k_unroll=2),
              "transposed": Sm90GemmConfig(promotion="chunk", transposed=True)}[variant]
    results = [run_fp8_ffn_poisoned(problem, config=c)
               for c in (Sm90GemmConfig(promotion="chunk", k_unroll=1), config)]
    assert_same_valid_rows(problem, results)
