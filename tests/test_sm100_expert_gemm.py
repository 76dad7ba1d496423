"""Blackwell grouped GEMMs over the pool (`kernels.sm100_expert_gemm`): fp8xfp4 and bf16xbf16.

CPU: what the kernel's TMA reads (the layouts of `gmem_layouts`, evaluated here in plain torch
index arithmetic on the real host-side tensors) dequantizes to exactly the reference operands:
the FP4 weights and their UTCCP-ordered scales after `transform_weights_for_mega_moe(sm100)` +
`weight_sf_for_sm100`, the pool's e4m3 tokens and plain MN-major scales under the kernel's row
permutation, the L1 epilogue's scale bytes as the L2 input, and the BF16 weights / tokens of
`ExpertWeights.from_bf16(..., "bf16xbf16", arch="sm_100a")`. Compile: every configuration
(BLOCK_M 64 / 128 / 256, 1-CTA and 2-CTA, L1 and L2) of both recipes for sm_100a; the SASS must
show the MMA (block-scaled UTCQMMA with the UTCCP scale copies; BF16 UTCHMMA, `kind::f16`, and
no scale traffic), TMEM loads (LDTM), TMA loads, and no local memory; the BF16 ones are built by
`expert_gemm.gemm_kernel`, exactly what `expert_ffn` launches. sm100: `expert_ffn` against the
float64 reference on random pools with poisoned outputs, both recipes (skips without a
compute-capability-10 GPU).
"""

import pytest
import torch

from cute_megamoe import quant, reference
from cute_megamoe.config import Sm100GemmConfig
from cute_megamoe.expert_gemm import ExpertWeights
from cute_megamoe.kernels.sm100_expert_gemm import (
    Sm100ExpertGemmKernel,
    gmem_layouts,
    lane_to_group_row,
)
from cute_megamoe.scheduler.host_model import pool_block_offsets

RECIPES = ("fp8xfp4", "bf16xbf16")


def _flat(shape, stride):
    if isinstance(shape, tuple):
        pairs = []
        for s, d in zip(shape, stride, strict=True):
            pairs += _flat(s, d)
        return pairs
    return [(shape, stride)]


def _offset(layout, coords):
    """Element offsets of a CuTe ``(shape, stride)`` at integer coordinate tensors, one per top
    mode (each decomposed colexicographically over its sub-modes, as CuTe does)."""
    shape, stride = layout
    total = torch.zeros_like(coords[0])
    for mode_shape, mode_stride, c in zip(shape, stride, coords, strict=True):
        c = c.clone()
        for s, d in _flat(mode_shape, mode_stride):
            total += (c % s) * d
            c = c // s
    return total


def _grid(*sizes):
    return [t.reshape(-1) for t in torch.meshgrid(*[torch.arange(s) for s in sizes],
                                                  indexing="ij")]


def _ue8m0(byte: torch.Tensor) -> torch.Tensor:
    return torch.where(byte == 0, torch.tensor(2.0 ** -127),
                       (byte.to(torch.int32) << 23).view(torch.float32))


def test_lane_to_group_row_is_the_utccp_row_order():
    rows = [lane_to_group_row(m) for m in range(128)]
    assert sorted(rows) == list(range(128))
    # transpose_sf_for_utccp puts row m (= 32 j + i) at position 4 i + j
    t = quant.transpose_sf_for_utccp(torch.arange(128, dtype=torch.int32).view(1, 128, 1))
    assert all(int(t[0, rows[m], 0]) == m for m in range(128))


@pytest.mark.parametrize("phase", ("l1", "l2"))
def test_weights_as_the_kernel_reads_them_equal_the_reference(phase):
    gen = torch.Generator().manual_seed(1)
    e, inter, hidden = 2, 128, 256
    w1 = (torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(e, hidden, inter, generator=gen) * 3.0).to(torch.bfloat16)
    q1 = quant.quantize_weights_for_recipe(w1, "fp8xfp4")
    q2 = quant.quantize_weights_for_recipe(w2, "fp8xfp4")
    t1, t2 = quant.transform_weights_for_mega_moe(q1, q2, arch="sm100")
    if phase == "l1":
        (b, sf), n, k = t1, 2 * inter, hidden
        expected = quant.interleave_gate_up(quant.dequantize_weights_for_recipe(q1, "fp8xfp4"))
    else:
        (b, sf), n, k = t2, hidden, inter
        expected = quant.dequantize_weights_for_recipe(q2, "fp8xfp4")
    b_sf = quant.weight_sf_for_sm100(sf)
    assert b_sf.shape == (e, k // 128, n) and b_sf.is_contiguous()
    _, _, lay_b, lay_sfb = gmem_layouts(128, k, n, e)
    nn, kk, ee = _grid(n, k, e)
    code_off = _offset(lay_b, (nn, kk, ee))
    byte = b.contiguous().view(torch.uint8).reshape(-1)[code_off // 2].to(torch.int32)
    code = torch.where(code_off % 2 == 0, byte & 0xF, byte >> 4)
    scale = _ue8m0(b_sf.view(torch.uint8).reshape(-1)[_offset(lay_sfb, (nn, kk, ee))])
    read = quant.fp4_codes_to_float(code) * scale
    assert torch.equal(read, expected[ee, nn, kk])


def test_pool_tokens_as_the_kernel_reads_them_equal_the_reference():
    gen = torch.Generator().manual_seed(2)
    p, hidden = 256, 384
    x = (torch.randn(p, hidden, generator=gen) * torch.rand(p, 1, generator=gen) * 8)
    q, sf = quant.quantize_activations_for_recipe(x.to(torch.bfloat16), "fp8xfp4")
    deq = quant.dequantize_activations_for_recipe((q, sf), "fp8xfp4")
    pool_sf = sf.t().contiguous()  # the l1_acts_sf region: [H/128, P], pool row fastest
    lay_a, lay_sfa, _, _ = gmem_layouts(p, hidden, 128, 1)
    mm, kk = _grid(p, hidden)
    zero = torch.zeros_like(mm)
    vals = q.view(torch.uint8).reshape(-1)[_offset(lay_a, (mm, kk, zero))]
    scale = _ue8m0(pool_sf.view(torch.uint8).reshape(-1)[_offset(lay_sfa, (mm, kk, zero))])
    read = vals.view(torch.float8_e4m3fn).float() * scale
    rows = torch.tensor([128 * (m // 128) + lane_to_group_row(m % 128) for m in range(p)])
    assert torch.equal(read, deq[rows[mm], kk])


def test_l1_scale_bytes_are_the_l2_input_scales():
    """The L1 epilogue writes byte ``e + 127`` of group ``g`` of pool row ``r`` at byte
    ``((g // 4) * P + r) * 4 + g % 4`` of int32 ``[I/128, P]``; the L2 GEMM reads that buffer as
    its SFA. Both must agree with ``requant_fp8_pow2(h, 32, use_packed_ue8m0=True)``."""
    gen = torch.Generator().manual_seed(3)
    p, inter = 128, 256
    h = torch.randn(p, inter, generator=gen) * torch.rand(p, 1, generator=gen) * 30
    h[5, 32:64] = 0.0  # an all-zero group: byte 0
    q, sf_packed = quant.requant_fp8_pow2(h, 32, use_packed_ue8m0=True)
    _, sf = quant.requant_fp8_pow2(h, 32)
    byte = torch.where(sf == 2.0 ** -127, 0, sf.view(torch.int32) >> 23).to(torch.uint8)
    written = torch.zeros(inter // 128 * p * 4, dtype=torch.uint8)
    rr, gg = _grid(p, inter // 32)
    written[((gg // 4) * p + rr) * 4 + gg % 4] = byte[rr, gg]
    assert torch.equal(written.view(torch.int32).view(inter // 128, p), sf_packed.t())
    lay_a, lay_sfa, _, _ = gmem_layouts(p, inter, 128, 1)
    mm, kk = _grid(p, inter)
    zero = torch.zeros_like(mm)
    scale = _ue8m0(written[_offset(lay_sfa, (mm, kk, zero))])
    vals = q.view(torch.uint8).reshape(-1)[_offset(lay_a, (mm, kk, zero))]
    read = vals.view(torch.float8_e4m3fn).float() * scale
    rows = torch.tensor([lane_to_group_row(m) for m in range(p)])
    assert torch.equal(read, reference.l2_input_reference(h, "fp8xfp4")[rows[mm], kk])


def test_bf16_operands_as_the_kernel_reads_them_equal_the_reference():
    """bf16xbf16: the weights of `ExpertWeights.from_bf16(arch="sm_100a")` read through the B
    layout are the interleaved master weights; the pool tokens read through the (row-permuted)
    A layout are pool row ``lane_to_group_row`` of each 128-row group."""
    gen = torch.Generator().manual_seed(4)
    e, inter, hidden, p = 2, 64, 192, 256
    w1 = torch.randn(e, 2 * inter, hidden, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(e, hidden, inter, generator=gen).to(torch.bfloat16)
    w = ExpertWeights.from_bf16(w1, w2, "bf16xbf16", arch="sm_100a")
    assert w.w1_sf is None and w.w2_sf is None and (w.hidden, w.intermediate) == (hidden, inter)
    for b, expected in ((w.w1, quant.interleave_gate_up(w1)), (w.w2, w2)):
        n, k = b.shape[1:]
        _, _, lay_b, _ = gmem_layouts(p, k, n, e)
        nn, kk, ee = _grid(n, k, e)
        read = b.reshape(-1)[_offset(lay_b, (nn, kk, ee))]
        assert torch.equal(read, expected[ee, nn, kk])
    x = torch.randn(p, hidden, generator=gen).to(torch.bfloat16)
    lay_a, _, _, _ = gmem_layouts(p, hidden, 128, 1)
    mm, kk = _grid(p, hidden)
    read = x.reshape(-1)[_offset(lay_a, (mm, kk, torch.zeros_like(mm)))]
    rows = torch.tensor([128 * (m // 128) + lane_to_group_row(m % 128) for m in range(p)])
    assert torch.equal(read, x[rows[mm], kk])


def test_rejects_bad_configurations():
    with pytest.raises(ValueError, match="block_m"):
        Sm100GemmConfig(96)
    with pytest.raises(ValueError, match="recipe"):
        Sm100ExpertGemmKernel("l2", "fp8xfp8", 4, 1024, 256, 256, Sm100GemmConfig(128))
    with pytest.raises(ValueError, match="k"):
        # (K % 64)
        Sm100ExpertGemmKernel("l2", "bf16xbf16", 4, 1024, 256, 96, Sm100GemmConfig(128))
    # bf16 L1 tiles hold 64 features: N = 2I needs only to be a multiple of 128
    assert Sm100ExpertGemmKernel("l1", "bf16xbf16", 4, 1024, 384, 192,
                                 Sm100GemmConfig(128)).num_k_blocks == 3
    with pytest.raises(ValueError, match="num_pool_rows"):
        Sm100ExpertGemmKernel("l2", "fp8xfp4", 4, 64 * 3, 256, 256, Sm100GemmConfig(64))
    with pytest.raises(ValueError, match="multiple of 256"):
        Sm100ExpertGemmKernel("l1", "fp8xfp4", 4, 1024, 384, 256, Sm100GemmConfig(128))
    with pytest.raises(ValueError, match="k"):
        Sm100ExpertGemmKernel("l2", "fp8xfp4", 4, 1024, 256, 200, Sm100GemmConfig(128))
    # one CTA per SM: the stages alone fill more than half of the SM's shared memory (each
    # CTA holds its TMEM columns for the whole run: two on one SM could wait forever)
    for recipe in ("fp8xfp4", "bf16xbf16"):
        for block_m in (64, 128, 256):
            kernel = Sm100ExpertGemmKernel("l2", recipe, 32, 8192, 7168, 2048,
                                           Sm100GemmConfig(block_m))
            # a stage: 128 A rows and the B rows (a 2-CTA pair splits them) of 128 bytes each
            # (128 e4m3 / FP4 codes, or 64 BF16), plus two 512-byte scale chunks for fp8xfp4
            b_rows = 64 if block_m == 256 else 128
            stage = (128 + b_rows) * 128 + (1024 if recipe == "fp8xfp4" else 0)
            assert kernel.num_stages * stage > 233472 // 2, (recipe, block_m, kernel.num_stages)


# ------------------------------------------------------------------------------ compile (CPU)

def _args(phase: str, ptrs=None, num_ctas: int = 148, stream=None):
    from cutlass import (
        BFloat16,
        Float4E2M1FN,
        Float8E4M3FN,
        Float8E8M0FNU,
        Float32,
        Int32,
        Int64,
        Uint8,
    )

    from cute_megamoe.testing.compile import fake_ptr, fake_stream

    # (the last two, peer_bases and src_metadata, are read only with a combine_layout)
    dtypes = (Float8E4M3FN, Float8E8M0FNU, Float4E2M1FN, Float8E8M0FNU, Int32, Float32,
              Float8E4M3FN if phase == "l1" else BFloat16, Uint8, Int64, Int32)
    if ptrs is None:
        ptrs = [fake_ptr(d, 4 if d in (Int32, Uint8) else 16) for d in dtypes]
    return (*ptrs, Int32(num_ctas), fake_stream() if stream is None else stream)


@pytest.mark.compile
@pytest.mark.parametrize("phase,block_m", [("l1", 64), ("l2", 64), ("l1", 128), ("l2", 128),
                                           ("l1", 256), ("l2", 256)])
def test_compiles_sm100_with_block_scaled_mma_and_no_spills(phase, block_m):
    from cute_megamoe.testing.compile import compile_for_arch

    inter, hidden = 2048, 7168
    n, k = (2 * inter, hidden) if phase == "l1" else (hidden, inter)
    kernel = Sm100ExpertGemmKernel(phase, "fp8xfp4", 32, 8192, n, k, Sm100GemmConfig(block_m),
                                   activation_clamp=10.0 if phase == "l1" else None)
    art = compile_for_arch(kernel, *_args(phase), arch="sm_100a")
    group = "cta_group::2" if block_m == 256 else "cta_group::1"
    assert f"tcgen05.mma.{group}.kind::mxf8f6f4.block_scale.block32" in art.ptx
    assert f"tcgen05.cp.{group}.32x128b.warpx4" in art.ptx
    assert "tcgen05.ld.sync.aligned.32x32b" in art.ptx
    # accumulator hand-offs between the MMA warp and the epilogue (as DeepGEMM orders them)
    assert art.ptx.count("tcgen05.fence::after_thread_sync") == 2
    assert art.ptx.count("tcgen05.fence::before_thread_sync") == 1
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    suffix = ".2CTA" if block_m == 256 else ""
    ops = art.sass_opcodes()
    assert ops[f"UTCQMMA{suffix}"] == 4  # 4 x K=32 per 128-deep k-block
    assert art.count(f"UTCCP.T.S{suffix}") == 2  # SFA and SFB chunks
    assert art.count("LDTM") == (2 if phase == "l1" else 4)  # 64 / 32 columns per load
    assert art.count("UTMALDG") == 4
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert usage["REG"] <= 128, usage


@pytest.mark.compile
@pytest.mark.parametrize("phase,block_m", [("l1", 64), ("l2", 64), ("l1", 128), ("l2", 128),
                                           ("l1", 256), ("l2", 256)])
def test_compiles_sm100_bf16_with_f16_mma_and_no_spills(phase, block_m):
    """bf16xbf16 as `expert_ffn` launches it (`gemm_kernel`'s kernel and pointer dtypes)."""
    from cutlass import Int32

    from cute_megamoe.expert_gemm import gemm_kernel
    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    inter, hidden = 2048, 7168
    n, k = (2 * inter, hidden) if phase == "l1" else (hidden, inter)
    kernel, dtypes = gemm_kernel("sm_100a", "bf16xbf16", phase, 32, 8192, n, k,
                                 Sm100GemmConfig(block_m), activation_clamp=10.0)
    assert kernel.block_k == 64 and kernel.num_stages >= 4
    args = [fake_ptr(d, 4 if i == 4 else 16) for i, d in enumerate(dtypes)]
    art = compile_for_arch(kernel, *args, Int32(148), fake_stream(), arch="sm_100a")
    group = "cta_group::2" if block_m == 256 else "cta_group::1"
    assert f"tcgen05.mma.{group}.kind::f16" in art.ptx
    assert "block_scale" not in art.ptx and "tcgen05.cp" not in art.ptx
    assert "tcgen05.ld.sync.aligned.32x32b" in art.ptx
    # accumulator hand-offs between the MMA warp and the epilogue (as DeepGEMM orders them)
    assert art.ptx.count("tcgen05.fence::after_thread_sync") == 2
    assert art.ptx.count("tcgen05.fence::before_thread_sync") == 1
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    suffix = ".2CTA" if block_m == 256 else ""
    ops = art.sass_opcodes()
    assert ops[f"UTCHMMA{suffix}"] == 4  # 4 x K=16 per 64-deep k-block
    assert art.count("UTCQMMA") == 0 and art.count("UTCCP") == 0
    assert art.count("LDTM") == (2 if phase == "l1" else 4)  # 64 / 32 columns per load
    assert art.count("UTMALDG") == 2  # tokens and weights only
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert usage["REG"] <= 128, usage


@pytest.mark.compile
@pytest.mark.parametrize("recipe,block_m", [("fp8xfp4", 128), ("bf16xbf16", 256)])
def test_compiles_sm100_l2_sending_rows_to_the_combine_buffers(recipe, block_m):
    """L2 with the combine buffers as destination (design step f): each epilogue thread stores
    its row's 32-byte pieces at the address its pool row's metadata gives, no spills."""
    from cutlass import Int32

    from cute_megamoe.expert_gemm import gemm_kernel
    from cute_megamoe.layout import MegaMoELayout
    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe)
    kernel, dtypes = gemm_kernel("sm_100a", recipe, "l2", 32, layout.num_pool_rows, 7168,
                                 2048, Sm100GemmConfig(block_m), combine_layout=layout)
    args = [fake_ptr(d, 4 if i == 4 else 16) for i, d in enumerate(dtypes)]
    art = compile_for_arch(kernel, *args, Int32(148), fake_stream(), arch="sm_100a")
    assert "tcgen05.mma" in art.ptx and "st.global.v8.b32" in art.ptx
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("UTCQMMA" if recipe == "fp8xfp4" else "UTCHMMA") > 0
    assert art.count("STG") > 0
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


# ------------------------------------------------------------------------------- sm100 (GPU)

COUNTS = {"random": [300, 41, 129, 1, 77, 256, 5, 200], "sparse": [0, 1, 0, 5, 0, 0, 129, 1],
          "empty": [0] * 8}


@pytest.mark.sm100
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("block_m", (64, 128, 256))
@pytest.mark.parametrize("pattern", ("random", "sparse", "empty"))
@pytest.mark.parametrize("clamp,fast_math,small_grid", [(7.0, True, False), (None, False, True)])
def test_sm100_expert_ffn_matches_reference(recipe, block_m, pattern, clamp, fast_math,
                                            small_grid):
    """`expert_ffn` on Blackwell (both GEMMs, pool tensors as it documents them) against the
    float64 reference per expert, with every output poisoned so pad rows must stay untouched."""
    from cute_megamoe.expert_gemm import expert_ffn
    from cute_megamoe.testing.gemm_checks import TOLERANCE

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(block_m + len(pattern))
    counts, hidden, inter = COUNTS[pattern], 512, 256
    e = len(counts)
    fp8 = recipe == "fp8xfp4"
    offsets = pool_block_offsets(counts, block_m)
    rows_of = [range(offsets[i] * block_m, offsets[i] * block_m + counts[i]) for i in range(e)]
    p = quant.align((offsets[-1] + 1) * block_m, 256)
    x = (torch.randn(p, hidden, generator=gen) * 2).to(torch.bfloat16)
    topk_w = torch.rand(p, generator=gen)
    w1 = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5).to(torch.bfloat16)
    q1 = quant.quantize_weights_for_recipe(w1, recipe)
    q2 = quant.quantize_weights_for_recipe(w2, recipe)
    w1_deq = quant.dequantize_weights_for_recipe(q1, recipe).float()
    w2_deq = quant.dequantize_weights_for_recipe(q2, recipe).float()
    weights = ExpertWeights.from_quantized(q1, q2, recipe, arch="sm_100a")
    weights.w1, weights.w2 = weights.w1.to(dev), weights.w2.to(dev)
    if fp8:
        weights.w1_sf, weights.w2_sf = weights.w1_sf.to(dev), weights.w2_sf.to(dev)
        acts, sf = quant.quantize_activations_for_recipe(x, recipe)
        x_deq = quant.dequantize_activations_for_recipe((acts, sf), recipe)
        acts_sf = sf.t().contiguous().to(dev).t()  # [P, H/128] int32, strides (1, P)
        l2_acts = torch.full((p, inter), 0x7F, dtype=torch.uint8, device=dev)  # e4m3 NaN
        l2_acts = l2_acts.view(torch.float8_e4m3fn)
        l2_sf = torch.full((inter // 128, p), -1, dtype=torch.int32, device=dev).t()  # UE8M0 NaN
    else:
        acts, acts_sf, x_deq = x, None, x.float()
        l2_acts = torch.full((p, inter), 0x7FFF, dtype=torch.int16, device=dev)  # bf16 NaN
        l2_acts = l2_acts.view(torch.bfloat16)
        l2_sf = None
    out = torch.full((p, hidden), 0x7FFF, dtype=torch.int16, device=dev).view(torch.bfloat16)
    expert_ffn(acts.to(dev), acts_sf, topk_w.to(dev), torch.tensor(counts, dtype=torch.int32,
                                                                   device=dev),
               weights, block_m=block_m, activation_clamp=clamp, fast_math=fast_math,
               l2_acts=l2_acts, l2_acts_sf=l2_sf, out=out, num_sms=6 if small_grid else None)
    torch.cuda.synchronize()

    l2_acts, out = l2_acts.cpu(), out.cpu()
    valid = torch.zeros(p, dtype=torch.bool)
    for rows in rows_of:
        valid[rows.start:rows.stop] = True
    assert bool(torch.isnan(out[~valid].float()).all()), "a pad row of out was written"
    assert bool(torch.isnan(l2_acts[~valid].float()).all()), "a pad row of l2_acts was written"
    if fp8:
        l2_sf_rows = l2_sf.cpu().contiguous()  # [P, I/128] packed
        assert bool((l2_sf_rows[~valid] == -1).all()), "a pad row's L2 scales were written"
    # fp8xfp4: no L1 relative bound (the e4m3 steps are counted instead)
    l1_tol, l2_tol, e2e_tol, flip_tol = TOLERANCE[recipe] if not fp8 else (
        None, 1e-2, 3e-2, 2e-2)
    flips = big = total = 0
    for i, rows in enumerate(rows_of):
        if len(rows) == 0:
            continue
        sl = slice(rows.start, rows.stop)
        h_ref, l2_in_ref, o_ref = reference.expert_ffn_reference(
            x_deq[sl], topk_w[sl], w1_deq[i], w2_deq[i], recipe, clamp, fast_math)
        assert bool(torch.isfinite(out[sl].float()).all()), f"expert {i}: out not finite"
        if fp8:
            l2_in = quant.cast_back_from_fp8(l2_acts[sl], l2_sf_rows[sl], 32,
                                             use_packed_ue8m0=True)
            _, sf_ref = quant.requant_fp8_pow2(h_ref, 32)
            sf_ours = quant.unpack_ue8m0_from_int(l2_sf_rows[sl])[:, : inter // 32]
            amax = h_ref.abs().view(len(rows), -1, 32).amax(dim=2) / 448.0
            near = (torch.log2(amax) - torch.round(torch.log2(amax))).abs() < 1e-2
            assert bool(((sf_ours == sf_ref) | near).all()), f"expert {i}: requant scale mismatch"
            # one e4m3 step: 2^-3 relative for normals, sf * 2^-9 for subnormals
            step = torch.maximum(l2_in_ref.abs() * 2.0 ** -3,
                                 sf_ours.repeat_interleave(32, dim=1) * 2.0 ** -9)
        else:
            l2_in = l2_acts[sl].float()  # h as BF16
            step = l2_in_ref.abs() * 2.0 ** -7  # one BF16 step
            rel = (l2_in.double() - l2_in_ref.double()).norm() / \
                l2_in_ref.double().norm().clamp_min(1e-30)
            assert rel <= l1_tol, f"expert {i}: L1 error {rel}"
        diff = (l2_in - l2_in_ref).abs()
        flips += int((diff > 0).sum())
        big += int((diff > 2.01 * step.clamp_min(1e-30)).sum())
        total += diff.numel()
        o_ours = (l2_in.double() @ w2_deq[i].double().T)
        rel = (out[sl].double() - o_ours).norm() / o_ours.norm().clamp_min(1e-30)
        assert rel <= l2_tol, f"expert {i}: L2 error {rel}"
        rel = (out[sl].double() - o_ref.double()).norm() / o_ref.double().norm().clamp_min(1e-30)
        assert rel <= e2e_tol, f"expert {i}: end-to-end error {rel}"
    assert big <= 1e-3 * max(total, 1), f"L1 outputs off by > 1 rounding step: {big} / {total}"
    assert flips <= flip_tol * max(total, 1), f"too many L1 rounding flips: {flips} / {total}"
