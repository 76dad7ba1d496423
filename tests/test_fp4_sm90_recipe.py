"""The recipe ``fp8xfp4_sm90`` (issue 19) above the kernels, on the CPU: MXFP4 weights for
Hopper, decoded on chip to fp8xfp8's weight format, with fp8xfp8's activations.

The tables; the quantization round trips, bit-exact (the weights dequantize to the plain FP4
values while a 128x128 block's per-32 scales span at most 14 binades, and otherwise exactly to
the e4m3 rounding `quant.fp4_weights_to_fp8_blocks` defines, rebuilt here from the raw codes
and scale bytes); `ExpertWeights` (shapes, dtypes, the scale words' layout, the block scales
against the raw exponents, the arch / recipe mismatches, the decoded fp8xfp8 weights); the
reference against a hand-built float64 layer; the buffer and the entry points' recipe checks.
The wiring on a stubbed GPU (launches, the fused kernel's refusal) is in test_launch_path.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cute_megamoe as cm
from cute_megamoe import api, quant, tables
from cute_megamoe.expert_gemm import ExpertWeights, _check_weights, weights_recipe
from cute_megamoe.kernels.common.gemm_config import weight_sf_row_len

RECIPE = "fp8xfp4_sm90"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _bf16(e: int, n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(e, n, k, generator=gen) / k**0.5).to(torch.bfloat16)


def _with_scale_bytes(q: tuple[torch.Tensor, torch.Tensor], expert: int, row: int, group: int,
                      byte: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` with the UE8M0 byte of one per-32 scale replaced."""
    w, sf = q
    b = sf.contiguous().view(torch.uint8).clone()
    b[expert, row, group] = byte
    return w, b.view(torch.int32)


def _spread(q: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 0's first 128x128 block gets groups 14, 15 and 20 binades below its largest
    scale and one at 2**-127 (byte 0); expert 1's first block gets every scale at most
    2**-122 (b clamped to -126)."""
    top = int(q[1].contiguous().view(torch.uint8)[0, :128, :4].max())
    for row, group, below in ((1, 1, 14), (2, 2, 15), (3, 3, 20), (4, 1, 200)):
        q = _with_scale_bytes(q, 0, row, group, max(top - below, 0))
    w, sf = q
    b = sf.view(torch.uint8).clone()
    b[1, :128, :4] = torch.randint(0, 6, (128, 4), generator=torch.Generator().manual_seed(5),
                                   dtype=torch.uint8)
    return w, b.view(torch.int32)


def _e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to e4m3's grid (3 mantissa bits, subnormal step 2**-9; RNE; no
    saturation: the callers stay below 448)."""
    _, e = torch.frexp(v.abs().clamp_min(2.0**-6))
    step = torch.ldexp(torch.ones_like(v), e - 1 - 3)
    return torch.round(v / step) * step


def _hand_exponents(sf: torch.Tensor) -> torch.Tensor:
    """Per-32 scale exponents from packed UE8M0 words: byte - 127 (byte 0 is 2**-127)."""
    return sf.contiguous().view(torch.uint8).to(torch.int64) - 127


def _hand_block_exponents(s: torch.Tensor) -> torch.Tensor:
    e, n, groups = s.shape
    top = s.view(e, n // 128, 128, groups // 4, 4).amax(dim=(2, 4))
    return (top - 6).clamp_min(-126)


def _hand_decode(q: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """float64 [E, N, K]: e4m3(e2m1 * 2**(s - b)) * 2**b, from the raw nibbles and bytes."""
    w, sf = q
    e, n, half_k = w.shape
    byte = w.view(torch.uint8).to(torch.int64)
    nibbles = torch.stack((byte & 0xF, byte >> 4), dim=-1).view(e, n, 2 * half_k)
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    values = table[nibbles]
    s = _hand_exponents(sf)[..., : 2 * half_k // 32]
    b = _hand_block_exponents(s)
    b_cols = b.repeat_interleave(128, dim=1).repeat_interleave(4, dim=2)  # per group
    shift = (s - b_cols).repeat_interleave(32, dim=2).double()
    block_scale = torch.exp2(b_cols.double()).repeat_interleave(32, dim=2)
    return _e4m3_round(values * torch.exp2(shift)) * block_scale


# ----------------------------------------------------------------------------- tables

def test_recipe_tables():
    assert RECIPE in tables.RECIPES and RECIPE in quant.RECIPES
    assert tables.GEMM_RECIPES["sm_90a"] == ("fp8xfp8", "bf16xbf16", RECIPE)
    assert RECIPE not in tables.GEMM_RECIPES["sm_100a"]
    assert tables.has_gemm_kernels("sm90", RECIPE) and not tables.has_gemm_kernels("sm100", RECIPE)
    assert RECIPE in tables.FUSED_RECIPES["sm_90a"]
    assert tables.EXPERIMENTAL_FUSED_RECIPES["sm_90a"] == (RECIPE,)
    assert RECIPE not in tables.FUSED_RECIPES["sm_100a"]
    for arch, recipes in tables.FUSED_RECIPES.items():
        assert set(recipes) <= set(tables.GEMM_RECIPES[arch])
    assert {r: tables.activation_recipe(r) for r in tables.RECIPES} == {
        "fp8xfp4": "fp8xfp4", "fp8xfp8": "fp8xfp8", "bf16xbf16": "bf16xbf16", RECIPE: "fp8xfp8"}


# ----------------------------------------------------------------------------- quantization

def test_weights_quantize_as_fp8xfp4_and_dequantize_as_their_decode():
    w = _bf16(2, 256, 384, 1)
    q = quant.quantize_weights_for_recipe(w, RECIPE)
    ref = quant.quantize_weights_for_recipe(w, "fp8xfp4")
    assert torch.equal(q[0], ref[0]) and torch.equal(q[1], ref[1])
    # realistic scales (well within 14 binades per block): exactly the FP4 weights
    deq = quant.dequantize_weights_for_recipe(q, RECIPE)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    assert torch.equal(deq, quant.dequantize_weights_for_recipe(q, "fp8xfp4"))
    assert torch.equal(deq.double(), _hand_decode(q))


def test_weights_beyond_14_binades_dequantize_to_the_defined_rounding():
    q = _spread(quant.quantize_weights_for_recipe(_bf16(2, 256, 256, 2), "fp8xfp4"))
    deq = quant.dequantize_weights_for_recipe(q, RECIPE)
    fp4 = quant.dequantize_weights_for_recipe(q, "fp8xfp4")
    assert torch.equal(deq.double(), _hand_decode(q))
    # rows 2, 3, 4 of expert 0 (groups 15, 20 binades down, 2**-127) differ, nothing else
    diff = (deq != fp4).any(dim=2)
    assert diff[0, 2:5].all() and int(diff.sum()) == 3
    assert torch.equal(deq[0, 1], fp4[0, 1])  # 14 binades down: still exact
    assert not bool(deq[0, 4, 32:64].any())  # 2**-127 under a normal block: flushed to zero
    # the clamped block of expert 1 (b = -126) holds its tiny scales exactly
    assert torch.equal(deq[1, :128], fp4[1, :128])
    assert float(quant.fp4_weights_to_fp8_blocks(q)[1][1, 0, 0]) == 2.0**-126


def test_activations_are_fp8xfp8s():
    x = (torch.randn(5, 384, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    xq, sf = quant.quantize_activations_for_recipe(x, RECIPE)
    ref_q, ref_sf = quant.quantize_activations_for_recipe(x, "fp8xfp8")
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(sf, ref_sf)
    assert sf.dtype == torch.float32 and sf.shape == (5, 3)
    assert torch.equal(quant.dequantize_activations_for_recipe((xq, sf), RECIPE),
                       quant.dequantize_activations_for_recipe((xq, sf), "fp8xfp8"))


# ----------------------------------------------------------------------------- ExpertWeights

E, INTER, HIDDEN = 2, 256, 384


def _quantized(seed: int = 4):
    q1 = quant.quantize_weights_for_recipe(_bf16(E, 2 * INTER, HIDDEN, seed), "fp8xfp4")
    q2 = quant.quantize_weights_for_recipe(_bf16(E, HIDDEN, INTER, seed + 1), "fp8xfp4")
    return _spread(q1), _spread(q2)


def _hand_block_sf(sf: torch.Tensor) -> torch.Tensor:
    """``[E, K/128, weight_sf_row_len(N)]`` f32: 2**b of ``[E, N, K/128]`` packed scales,
    K-block major, rows padded with 1.0."""
    b = _hand_block_exponents(_hand_exponents(sf))  # [E, N/128, K/128]
    n = sf.shape[1]
    out = torch.ones(sf.shape[0], sf.shape[2], weight_sf_row_len(n))
    out[:, :, : n // 128] = torch.exp2(b.double()).float().transpose(1, 2)
    return out


def test_expert_weights_layout():
    q1, q2 = _quantized()
    w = ExpertWeights.from_quantized(q1, q2, RECIPE)  # CPU weights: the arch with kernels
    assert (w.recipe, w.arch, w.num_experts, w.hidden, w.intermediate) == (
        RECIPE, "sm_90a", E, HIDDEN, INTER)
    (t1, tsf1), (t2, tsf2) = quant.transform_weights_for_mega_moe(q1, q2, arch="sm_90a")
    assert w.w1.dtype == torch.int8 and w.w1.shape == (E, 2 * INTER, HIDDEN // 2)
    assert w.w2.dtype == torch.int8 and w.w2.shape == (E, HIDDEN, INTER // 2)
    # the codes in the decode's word order (and back: the plain packed codes)
    assert torch.equal(w.w1, quant.fp4_words_for_sm90_decode(t1))
    assert torch.equal(quant.fp4_words_from_sm90_decode(w.w1), quant.interleave_gate_up(q1[0]))
    assert torch.equal(quant.fp4_words_from_sm90_decode(w.w2), q2[0])
    # the sm_90a transform's packed words (interleaved, no UTCCP), MN-major
    assert w.w1_sf.dtype == torch.int32 and w.w1_sf.shape == (E, HIDDEN // 128, 2 * INTER)
    assert w.w2_sf.shape == (E, INTER // 128, HIDDEN)
    assert w.w1_sf.is_contiguous() and w.w2_sf.is_contiguous()
    assert torch.equal(w.w1_sf, tsf1.transpose(1, 2)) and torch.equal(w.w2_sf, tsf2.transpose(1, 2))
    # byte j of word (k, row) is the scale of 32-group 4k + j of that (interleaved) row
    groups = quant.unpack_ue8m0_from_int(quant.interleave_gate_up(q1[1]).reshape(-1, 3))
    bytes_ = w.w1_sf.transpose(1, 2).contiguous().view(torch.uint8).view(E, 2 * INTER, 12)
    assert torch.equal(bytes_.view(-1, 12).to(torch.int32),
                       torch.where(groups == 2.0**-127, 0, torch.log2(groups).int() + 127))
    # block scales: 2**b from the raw exponents of the [gate | up] rows, fp8xfp8's layout
    assert w.w1_block_sf.dtype == torch.float32 and w.w1_block_sf.is_contiguous()
    assert w.w1_block_sf.shape == (E, HIDDEN // 128, 4) and w.w2_block_sf.shape == (E, 2, 4)
    assert torch.equal(w.w1_block_sf, _hand_block_sf(q1[1]))
    assert torch.equal(w.w2_block_sf, _hand_block_sf(q2[1]))
    assert float(w.w1_block_sf[1, 0, 0]) == 2.0**-126  # the clamped block
    assert _check_weights(w, torch.device("cpu")) == (E, HIDDEN, INTER)
    # the same from the BF16 masters and from the sm_90a transform's output
    same = [ExpertWeights.from_transformed((t1, tsf1), (t2, tsf2), arch="sm90"),
            ExpertWeights.from_transformed((t1, tsf1), (t2, tsf2), RECIPE)]
    for other in same:
        for f in ("w1", "w2", "w1_sf", "w2_sf", "w1_block_sf", "w2_block_sf", "recipe", "arch"):
            a, b = getattr(other, f), getattr(w, f)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f


def test_expert_weights_from_bf16():
    w1, w2 = _bf16(E, 2 * INTER, HIDDEN, 6), _bf16(E, HIDDEN, INTER, 7)
    w = ExpertWeights.from_bf16(w1, w2, RECIPE, arch="sm_90a")
    ref = ExpertWeights.from_quantized(quant.quantize_weights_for_recipe(w1, "fp8xfp4"),
                                       quant.quantize_weights_for_recipe(w2, "fp8xfp4"), RECIPE)
    for f in ("w1", "w2", "w1_sf", "w2_sf", "w1_block_sf", "w2_block_sf"):
        assert torch.equal(getattr(w, f), getattr(ref, f)), f
    for other in ("fp8xfp8", "bf16xbf16"):
        assert ExpertWeights.from_bf16(w1, w2, other, arch="sm_90a").w1_block_sf is None


def test_tiled_mxfp4_weights_keep_their_codes():
    """MXFP4 weights in TMA-box order (`ExpertWeights.tiled_copy`, an A/B option: row order
    stays the default): [128 rows, 64 bytes] boxes of packed codes, the scales untouched, the
    same codes back (`untiled_copy`) and the same host decode (`decoded_fp8`)."""
    from cute_megamoe.expert_gemm import tile_weight_rows

    q1, q2 = _quantized()
    w = ExpertWeights.from_quantized(q1, q2, RECIPE)
    assert not w.tiled  # (MXFP4: not tiled by default)
    t = w.tiled_copy()
    assert t.tiled and t.w1.shape == w.w1.shape and t.w1_sf is w.w1_sf
    assert torch.equal(t.w1, tile_weight_rows(w.w1, box_bytes=64))
    assert torch.equal(t.w2, tile_weight_rows(w.w2, box_bytes=64))
    assert not torch.equal(t.w1, w.w1)
    back = t.untiled_copy()
    assert torch.equal(back.w1, w.w1) and torch.equal(back.w2, w.w2)
    d, dt = w.decoded_fp8(), t.decoded_fp8()
    assert not dt.tiled and torch.equal(d.w1.view(torch.uint8), dt.w1.view(torch.uint8))
    assert torch.equal(d.w2.view(torch.uint8), dt.w2.view(torch.uint8))


def test_decoded_fp8_is_the_host_decode():
    q1, q2 = _quantized()
    w = ExpertWeights.from_quantized(q1, q2, RECIPE)
    d = w.decoded_fp8()
    assert (d.recipe, d.arch) == ("fp8xfp8", "sm_90a") and d.w1_block_sf is None
    assert torch.equal(d.w1_sf, w.w1_block_sf) and torch.equal(d.w2_sf, w.w2_block_sf)
    fp8_1, _ = quant.fp4_weights_to_fp8_blocks(q1)
    u8 = torch.uint8
    assert torch.equal(d.w1.view(u8), quant.interleave_gate_up(fp8_1).view(u8))
    assert torch.equal(d.w2.view(u8), quant.fp4_weights_to_fp8_blocks(q2)[0].view(u8))
    # e4m3 x block scale is the recipe's dequantization, rebuilt from the raw bytes
    rows = quant.deinterleave_gate_up(d.w1).float().double()
    scales = d.w1_sf[:, :, :4].transpose(1, 2).double()
    scales = scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    assert torch.equal(rows * scales, _hand_decode(q1))
    _check_weights(d, torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8xfp4_sm90 weights only"):
        d.decoded_fp8()


def _prmt(a, b, selector):
    """PTX ``prmt.b32`` (default mode) on uint32 arrays: target byte ``i`` is source byte
    ``s & 7`` of ``{b, a}``, ``s`` the selector's nibble ``i``; ``s & 8`` replicates that byte's
    top bit. Only the selector's low 16 bits count."""
    src = torch.stack([(x >> (8 * i)) & 0xFF for x in (a, b) for i in range(4)])  # [8, n]
    out = torch.zeros_like(a)
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = torch.gather(src, 0, (s & 7).unsqueeze(0)).squeeze(0)
        byte = torch.where((s & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


def test_word_order_decode_model_is_exact():
    """The device decode (`kernels/common/fp4_decode.py`) on the host, operation by operation
    with PTX's ``prmt`` semantics, on groups in the sm_90a order (`quant.fp4_words_for_sm90_
    decode`): every code at every position of a group, every fast-path shift, gives word ``q``
    of a group the e4m3 bytes ``e4m3(value * 2**d)`` of columns ``4q .. 4q + 3`` (first output)
    and ``16 + 4q .. 16 + 4q + 3`` (second), the columns of lane ``q`` of a quad in a WGMMA
    register fragment; the order round-trips."""
    from cute_megamoe.kernels.common import fp4_decode as dec

    gen = torch.Generator().manual_seed(11)
    valid = torch.tensor([c for c in range(16) if c != 8], dtype=torch.uint8)  # no -0
    rows = valid[torch.randint(0, 15, (15 * 32, 32), generator=gen)]
    for pos in range(32):  # every code at every position
        rows[pos * 15: pos * 15 + 15, pos] = valid
    packed = quant.pack_fp4(rows)
    ordered = quant.fp4_words_for_sm90_decode(packed)
    assert torch.equal(quant.fp4_words_from_sm90_decode(ordered), packed)
    want_cols = [list(range(4 * q, 4 * q + 4)) + list(range(16 + 4 * q, 20 + 4 * q))
                 for q in range(4)]
    assert quant.SM90_GROUP_ORDER == [c for cols in want_cols for c in cols]
    mask32 = 0xFFFFFFFF
    for q in range(4):
        word = ordered.view(torch.uint8)[:, 4 * q: 4 * q + 4].to(torch.int64)
        word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
        for d in range(dec.FAST_MIN_SHIFT, 7):
            lut_lo = torch.full_like(word, (dec.LUT_LO + d * dec.LUT_STEP_LO) & mask32)
            lut_hi = torch.full_like(word, (dec.LUT_HI + d * dec.LUT_STEP_HI) & mask32)
            selectors = word & 0x77777777
            lo = _prmt(lut_lo, lut_hi, selectors) | (word & 0x80808080)
            hi = _prmt(lut_lo, lut_hi, selectors >> 16) | ((word << 4) & 0x80808080)
            got = torch.stack([(x >> (8 * i)) & 0xFF for x in (lo, hi) for i in range(4)], dim=1)
            want = (quant.fp4_codes_to_float(rows[:, want_cols[q]]) * 2.0**d)
            assert torch.equal(got.to(torch.uint8),
                               want.to(torch.float8_e4m3fn).view(torch.uint8)), (q, d)


def test_arch_and_recipe_mismatches_name_the_other_recipe():
    w1, w2 = _bf16(E, 2 * INTER, HIDDEN, 8), _bf16(E, HIDDEN, INTER, 9)
    with pytest.raises(ValueError, match="'fp8xfp4' has no grouped-GEMM kernels on 'sm_90a'.*"
                                         "as recipe 'fp8xfp4_sm90'"):
        ExpertWeights.from_bf16(w1, w2, "fp8xfp4", arch="sm90")
    with pytest.raises(ValueError, match="'fp8xfp4_sm90' has no grouped-GEMM kernels on "
                                         "'sm_100a'.*as recipe 'fp8xfp4'"):
        ExpertWeights.from_bf16(w1, w2, RECIPE, arch="sm_100a")
    q1, q2 = (quant.quantize_weights_for_recipe(w, "fp8xfp4") for w in (w1, w2))
    l1, l2 = quant.transform_weights_for_mega_moe(q1, q2, arch="sm_90a")
    assert weights_recipe(l1) == "fp8xfp4"  # the dtype alone: DeepGEMM's
    assert weights_recipe(l1, arch="sm90a") == RECIPE and weights_recipe(l1, arch="sm100") == \
        "fp8xfp4"
    assert ExpertWeights.from_transformed(l1, l2, arch="sm_90a").recipe == RECIPE
    with pytest.raises(ValueError, match="'fp8xfp4' has no grouped-GEMM kernels on 'sm_90a'"):
        ExpertWeights.from_transformed(l1, l2, "fp8xfp4", arch="sm_90a")
    with pytest.raises(TypeError, match="fp8xfp4_sm90 weights, expected fp8xfp8"):
        ExpertWeights.from_transformed(l1, l2, "fp8xfp8", arch="sm_90a")
    w = ExpertWeights.from_transformed(l1, l2, arch="sm_90a")
    with pytest.raises(TypeError, match="weights.w1_block_sf"):
        _check_weights(dataclasses.replace(w, w1_block_sf=None), torch.device("cpu"))
    with pytest.raises(TypeError, match="weights.w2_sf"):
        _check_weights(dataclasses.replace(w, w2_sf=w.w2_sf.float()), torch.device("cpu"))
    fp8 = ExpertWeights.from_bf16(w1, w2, "fp8xfp8", arch="sm_90a")
    with pytest.raises(ValueError, match="only for fp8xfp4_sm90"):
        _check_weights(dataclasses.replace(fp8, w1_block_sf=w.w1_block_sf), torch.device("cpu"))


# ----------------------------------------------------------------------------- reference

def _hand_requant(h: torch.Tensor) -> torch.Tensor:
    """The L2 input of ``h`` (f32 [m, I]), per 128 features: scale 2**ceil(log2(amax * f32(1 /
    448))), e4m3 of h / scale (float64, by hand), times the scale."""
    m, inter = h.shape
    groups = h.double().view(m, inter // 128, 128)
    v = (groups.abs().amax(dim=2).float() * torch.tensor(1 / 448, dtype=torch.float32)).double()
    scale = torch.exp2(torch.ceil(torch.log2(v)))
    q = _e4m3_round((groups / scale[..., None]).clamp(-448.0, 448.0))  # (satfinite)
    return (q * scale[..., None]).view(m, inter)


def test_reference_matches_a_hand_built_float64_layer():
    """One rank, two experts, a weight block with groups 15+ binades under its largest scale:
    the reference equals, bit for bit, the layer built here from the numerics list (float64
    GEMMs, the documented f32 / BF16 roundings) on the hand decode of the weights, with
    fp8xfp8's activations and a per-128 requantization of the L2 input."""
    gen = torch.Generator().manual_seed(11)
    n, k, hidden, inter, clamp = 24, 2, 256, 128, 10.0
    w1 = (torch.randn(2, 2 * inter, hidden, generator=gen) * 2.7 / hidden**0.5)
    # a group of scale 2**8 in a block whose second groups are at about 2**-8: 16 binades down
    w1[0, 5, :32] *= 3000.0
    w1[0, :128, 32:64] *= 2.0**-5
    w1 = w1.to(torch.bfloat16)
    w2 = (torch.randn(2, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    x = (torch.randn(n, hidden, generator=gen) * 1.5).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(2, generator=gen) for _ in range(n)])
    idx[3, 1] = -1
    tw = torch.rand(n, k, generator=gen) + 0.1
    res = cm.mega_moe_reference([x], [idx], [tw], [w1], [w2], recipe=RECIPE,
                                activation_clamp=clamp)
    q1 = quant.quantize_weights_for_recipe(w1, "fp8xfp4")
    w1d, w2d = _hand_decode(q1), _hand_decode(quant.quantize_weights_for_recipe(w2, "fp8xfp4"))
    assert not torch.equal(w1d, quant.dequantize_weights_for_recipe(q1, "fp8xfp4").double())
    x_deq = quant.dequantize_activations_for_recipe(
        quant.quantize_activations_for_recipe(x, "fp8xfp8"), "fp8xfp8").double()
    y = torch.zeros(n, hidden, dtype=torch.float32)  # (two slots: the f32 sum's order is moot)
    for e in range(2):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        pairs = res.expert_pairs[e]
        assert torch.equal(pairs[:, 1], tok) and torch.equal(pairs[:, 2], slot)
        acc = (x_deq[tok] @ w1d[e].T).float()
        gate = acc[:, :inter].bfloat16().float().clamp(max=clamp)
        up = acc[:, inter:].bfloat16().float().clamp(-clamp, clamp)
        h = (gate / (1.0 + torch.exp(-gate)) * up) * tw[tok, slot][:, None]
        l2_in = _hand_requant(h)
        assert torch.equal(res.l1_outputs[e], h)
        assert torch.equal(res.l2_inputs[e].double(), l2_in)
        y.index_add_(0, tok, (l2_in @ w2d[e].T).float().bfloat16().float())
    assert torch.equal(res.y[0], y.bfloat16())
    assert bool((res.y[0][3] != 0).any())


# ----------------------------------------------------------------------------- buffer, entry points

def test_buffer_is_laid_out_as_fp8xfp8():
    buf = cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, True, RECIPE, device="cpu")
    assert buf.recipe == buf.mma_type == RECIPE and buf.layout.recipe == RECIPE
    ref = dataclasses.replace(buf.layout, recipe="fp8xfp8")
    assert buf.layout.regions == ref.regions and buf.num_bytes == ref.num_bytes
    assert buf.x.dtype == torch.float8_e4m3fn and buf.x_sf.dtype == torch.float32
    assert buf.l1_acts_sf.shape == (buf.layout.num_pool_rows, 2)
    assert buf.l1_acts_sf.stride() == (1, buf.layout.num_pool_rows)
    with pytest.raises(ValueError, match="use_fp8_dispatch=False contradicts"):
        cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, False, RECIPE, device="cpu")


def test_entry_points_take_or_refuse_the_recipe():
    """`fp8_mega_moe` takes an fp8xfp4_sm90 buffer (the CPU buffer fails later, on its
    device); DeepGEMM's `fp8_fp4_mega_moe` does not (its weights are DeepGEMM's layout)."""
    buf = cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, mma_type=RECIPE,
                                          device="cpu")
    w1, w2 = _bf16(8, 256, 256, 12), _bf16(8, 256, 128, 13)
    weights = ExpertWeights.from_bf16(w1, w2, RECIPE)
    y = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert RECIPE in api._FP8_RECIPES
    assert api._check_layer_call(api._FP8_RECIPES, "fp8_mega_moe", y, weights, buf) == 4
    with pytest.raises((RuntimeError, ValueError), match="sym_buffer: (the kernels need a CUDA|"
                                                         "must live on a CUDA)"):
        cm.fp8_mega_moe(y, weights, buf)
    l1, l2 = quant.transform_weights_for_mega_moe(
        *(quant.quantize_weights_for_recipe(w, "fp8xfp4") for w in (w1, w2)))
    with pytest.raises(ValueError, match="takes a buffer of fp8xfp4 or fp8xfp8, this one is "
                                         "'fp8xfp4_sm90'"):
        cm.fp8_fp4_mega_moe(y, l1, l2, buf, recipe=(1, 128, 128))


def test_module_on_cpu_runs_the_reference_and_refuses_fused():
    w1, w2 = _bf16(4, 256, 256, 14), _bf16(4, 256, 128, 15)
    moe = cm.MegaMoE(None, 4, 32, 2, 256, 128, RECIPE, w1, w2, device="cpu")
    assert moe.config.recipe == RECIPE and moe.config.path == "reference"
    with pytest.raises(ValueError, match="fused"):
        cm.MegaMoE(None, 4, 32, 2, 256, 128, RECIPE, w1, w2, device="cpu", fused=True)


def test_torch_expert_weights_are_the_decode_in_bf16():
    w1, w2 = _bf16(2, 256, 256, 16), _bf16(2, 256, 128, 17)
    w1[0, :128, 64:96] *= 2.0**-20  # the decode rounds this group; BF16 holds it exactly
    tw = cm.staged.TorchExpertWeights.from_bf16(w1, w2, RECIPE)
    q1 = quant.quantize_weights_for_recipe(w1, "fp8xfp4")
    assert torch.equal(tw.w1.double(), _hand_decode(q1))
    assert tw.w1.dtype == torch.bfloat16 and tw.w2.shape == (2, 256, 128)


def test_staging_and_dispatch_kernels_move_fp8xfp8_rows():
    """The kernels' host side: the staging quantizes per 128 into f32 scales (fp8xfp8's), the
    dispatch moves fp8xfp8's rows and scale words and publishes the recipe's own code."""
    from cute_megamoe.kernels.dispatch import DispatchKernel
    from cute_megamoe.kernels.staging import InputStagingKernel
    from cute_megamoe.layout import CountWord, MegaMoELayout

    ours, fp8 = (InputStagingKernel(r, 7168, 8) for r in (RECIPE, "fp8xfp8"))
    for attr in ("quantize", "packed_ue8m0", "group_shuffles", "out_dtype"):
        assert getattr(ours, attr) == getattr(fp8, attr), attr
    assert not ours.packed_ue8m0
    layouts = [MegaMoELayout(2, 16, 256, 4, 1024, 512, r) for r in (RECIPE, "fp8xfp8")]
    ours, fp8 = (DispatchKernel(layout, 64) for layout in layouts)
    for attr in ("has_sf", "sf_words", "sf_vec", "row_bytes"):
        assert getattr(ours, attr) == getattr(fp8, attr), attr
    assert ours.settings == CountWord.settings(64, RECIPE, True) != fp8.settings
    assert CountWord.decode(ours.settings << CountWord.COUNT_BITS)["recipe"] == RECIPE
