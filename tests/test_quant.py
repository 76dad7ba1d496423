"""Bit-exactness and layout tests for ``cute_megamoe.quant`` (CPU only, fast).

The reference formulas are DeepGEMM's (``deep_gemm/utils/math.py`` at 54e2261, the Mega-MoE
weight transform in ``deep_gemm/mega/__init__.py`` and the kernel's FP8 re-quantizer). The
``_np_*`` helpers below re-implement them independently in numpy float32 arithmetic with the
rounding done by bit manipulation (no float64 anywhere), and the module is compared against
them with ``torch.equal`` on raw bits.
"""

import numpy as np
import pytest
import torch

from cute_megamoe import quant as q

F32_MIN_NORMAL = 2.0**-126
UE8M0_BYTE0_BITS = 0x00400000  # float32 bits of 2^-127


# ----------------------------------------------------------------------------------------------
# Independent numpy reference (float32 arithmetic + integer bit logic only)
# ----------------------------------------------------------------------------------------------


def _np_f32(x: torch.Tensor) -> np.ndarray:
    """Exact float32 copy of a bf16 / f32 tensor, converted through bits for bf16."""
    if x.dtype == torch.bfloat16:
        bits = x.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    assert x.dtype == torch.float32
    return x.numpy().copy()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _from_bits(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b, dtype=np.uint32).view(np.float32)


def _np_ceil_ue8m0(v: np.ndarray) -> np.ndarray:
    b = _bits(np.abs(v))
    e = ((b >> 23) & 0xFF).astype(np.int64) + ((b & 0x7FFFFF) != 0)
    return _from_bits((np.clip(e, 1, 254) << 23).astype(np.uint32))


def _np_e4m3(y: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn byte, round-to-nearest-even; the reference must never overflow."""
    b = _bits(y)
    sign = ((b >> 31) << 7).astype(np.uint8)
    a = _from_bits(b & 0x7FFFFFFF)
    biased = ((b >> 23) & 0xFF).astype(np.int64)
    mant = (b & 0x7FFFFF).astype(np.int64)
    m3, rem = mant >> 20, mant & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((m3 & 1) == 1))
    normal = ((biased - 127 + 7) << 3) + m3 + up
    subnormal = np.rint(a * np.float32(512.0)).astype(np.int64)  # exact scaling, RNE
    code = np.where(a < np.float32(2.0**-6), subnormal, normal)
    assert not np.isnan(y).any() and code.max(initial=0) <= 0x7E, "reference overflow"
    return code.astype(np.uint8) | sign


def _np_e2m1(y: np.ndarray) -> np.ndarray:
    a = np.abs(y)
    code = np.zeros(y.shape, dtype=np.uint8)
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        code += (a > np.float32(t)).astype(np.uint8)
    return code | (((y < 0) & (code != 0)).astype(np.uint8) << 3)


def _np_groups(x: np.ndarray, g: int) -> np.ndarray:
    m, n = x.shape
    pad = -n % g
    return np.concatenate([x, np.zeros((m, pad), np.float32)], axis=1).reshape(m, -1, g)


def _np_pack_words(byte: np.ndarray) -> np.ndarray:
    """UE8M0 bytes [m, k] -> int32 words [m, ceil(k/4)], byte g -> bits 8*(g%4) of word g//4."""
    m, k = byte.shape
    pad = -k % 4
    byte = np.concatenate([byte, np.full((m, pad), 127, np.uint32)], axis=1).astype(np.uint32)
    byte = byte.reshape(m, -1, 4)
    word = byte[..., 0] | (byte[..., 1] << 8) | (byte[..., 2] << 16) | (byte[..., 3] << 24)
    return word.astype(np.uint32).view(np.int32)


def _np_scale(amax: np.ndarray, max_value: float, ue8m0: bool) -> np.ndarray:
    sf = np.maximum(amax, np.float32(1e-4)) / np.float32(max_value)  # float32 division
    return _np_ceil_ue8m0(sf) if ue8m0 else sf


def _np_per_token_fp8(x, ue8m0, g):
    xf = _np_f32(x)
    n = xf.shape[1]
    grp = _np_groups(xf, g)
    sf = _np_scale(np.abs(grp).max(axis=2), 448.0, ue8m0)
    y = grp * (np.float32(1.0) / sf)[..., None]
    return _np_e4m3(y).reshape(xf.shape[0], -1)[:, :n], sf


def _np_per_token_fp4(x, ue8m0, g):
    xf = _np_f32(x)
    n = xf.shape[1]
    grp = _np_groups(xf, g)
    sf = _np_scale(np.abs(grp).max(axis=2), 6.0, ue8m0)
    codes = _np_e2m1(grp * (np.float32(1.0) / sf)[..., None]).reshape(xf.shape[0], -1)[:, :n]
    packed = (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
    return packed.astype(np.uint8), sf


def _np_per_block_fp8(x, ue8m0, g):
    xf = _np_f32(x)
    m, n = xf.shape
    pm, pn = -(-m // g) * g, -(-n // g) * g
    xp = np.zeros((pm, pn), np.float32)
    xp[:m, :n] = xf
    blk = xp.reshape(pm // g, g, pn // g, g)
    sf = _np_scale(np.abs(blk).max(axis=(1, 3)), 448.0, ue8m0)
    y = blk * (np.float32(1.0) / sf)[:, None, :, None]
    return _np_e4m3(y).reshape(pm, pn)[:m, :n], sf


def _np_requant(h, g):
    hf = _np_f32(h)
    n = hf.shape[1]
    grp = _np_groups(hf, g)
    v = np.abs(grp).max(axis=2) * (np.float32(1.0) / np.float32(448.0))
    b = _bits(v)
    e = ((b >> 23) & 0xFF).astype(np.int64) - 127 + ((b & 0x7FFFFF) != 0)
    sf_inv = _from_bits(((127 - e) << 23).astype(np.uint32))
    y = np.clip(grp * sf_inv[..., None], np.float32(-448), np.float32(448))
    return _np_e4m3(y).reshape(hf.shape[0], -1)[:, :n], (e + 127).astype(np.uint32)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _random_input(m: int, n: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Random values whose magnitude varies per 16 columns over 2^-20 .. 2^20, some zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=gen)
    exps = torch.randint(-20, 21, (m, (n + 15) // 16), generator=gen).repeat_interleave(16, 1)
    x = x * torch.exp2(exps[:, :n].float())
    x[0, : min(n, 40)] = 0.0
    return x.to(dtype)


SHAPES = [(1, 128), (4, 512), (3, 200), (5, 96), (2, 1000), (7, 2)]


# ----------------------------------------------------------------------------------------------
# UE8M0
# ----------------------------------------------------------------------------------------------


def test_ceil_to_ue8m0_hand_vectors():
    one_plus_ulp = float(np.nextafter(np.float32(1), np.float32(2)))
    assert one_plus_ulp == 1.0000001192092896
    x = torch.tensor(
        [1.0, 2.0, 0.5, 2.0**-126, 2.0**127, one_plus_ulp, 3.0, 0.0, 1e-45, -4.0, -5.0, 3e38]
        + [float("inf"), 1e-40, 448.0, 1e-4 / 448]
    )
    expected = torch.tensor(
        [1.0, 2.0, 0.5, 2.0**-126, 2.0**127, 2.0, 4.0, 2.0**-126, 2.0**-126, 4.0, 8.0]
        + [2.0**127, 2.0**127, 2.0**-126, 512.0, 2.0**-22]
    )
    out = q.ceil_to_ue8m0(x)
    assert out.dtype == torch.float32
    assert torch.equal(_i32(out), _i32(expected))
    # bf16 input goes through float32 first
    bf16_three = torch.tensor([3.0], dtype=torch.bfloat16)
    assert torch.equal(q.ceil_to_ue8m0(bf16_three), torch.tensor([4.0]))


@pytest.mark.parametrize("max_value", [448.0, 6.0])
def test_ue8m0_scale_same_for_division_and_reciprocal_multiply(max_value):
    # CUDA evaluates `amax / 448.0` as `amax * float32(1/448)`; after ceil_to_ue8m0 the two
    # agree for every amax in a whole binade, hence (by exact power-of-two scaling) everywhere.
    amax = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    inv = float(torch.tensor(1.0 / max_value, dtype=torch.float32))
    divided = q.ceil_to_ue8m0(amax / max_value)
    multiplied = q.ceil_to_ue8m0(amax * inv)
    assert torch.equal(divided, multiplied)
    assert not torch.equal(amax / max_value, amax * inv)  # the raw scales do differ


def test_pack_ue8m0_little_endian_and_unpack():
    sf = torch.tensor([[1.0, 2.0, 0.5, 2.0**-126, 8.0, 2.0**127, 2.0**-127, 0.0]])
    sf[0, 6] = torch.tensor(UE8M0_BYTE0_BITS, dtype=torch.int32).view(torch.float32)
    packed = q.pack_ue8m0_to_int(sf)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    word0 = 127 | (128 << 8) | (126 << 16) | (1 << 24)
    word1 = 130 | (254 << 8) | (0 << 16) | (0 << 24)
    expected = np.array([[word0, word1]], dtype=np.uint32).view(np.int32)
    assert torch.equal(packed, torch.from_numpy(expected))
    unpacked = q.unpack_ue8m0_from_int(packed)
    # byte 0 decodes to 2^-127 (a float32 subnormal), both for 2^-127 and for +0.0 inputs
    exp_bits = [127 << 23, 128 << 23, 126 << 23, 1 << 23, 130 << 23, 254 << 23]
    exp_bits += [UE8M0_BYTE0_BITS, UE8M0_BYTE0_BITS]
    assert torch.equal(_i32(unpacked), torch.tensor([exp_bits], dtype=torch.int32))
    assert unpacked[0, 6].item() == 2.0**-127
    # byte 0 survives a second round trip
    assert torch.equal(q.pack_ue8m0_to_int(unpacked), packed)


def test_pack_ue8m0_rejects_bad_input():
    with pytest.raises(ValueError, match="x"):
        q.pack_ue8m0_to_int(torch.tensor([1.0, 3.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="x"):
        q.pack_ue8m0_to_int(torch.tensor([1.0, -2.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="multiple of 4"):
        q.pack_ue8m0_to_int(torch.ones(6))
    with pytest.raises(TypeError, match="x"):
        q.pack_ue8m0_to_int(torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="packed"):
        q.unpack_ue8m0_from_int(torch.ones(4, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------
# e2m1 codes
# ----------------------------------------------------------------------------------------------


def _next_up(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(np.inf)))


def _next_down(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(-np.inf)))


def test_e2m1_code_table_and_ties():
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    codes = q.quantize_e2m1(torch.tensor(values))
    assert codes.dtype == torch.int8
    assert codes.tolist() == list(range(8))
    assert q.quantize_e2m1(-torch.tensor(values)).tolist() == [0] + list(range(9, 16))
    # a tie goes to the smaller magnitude; one float32 ulp above goes to the larger one
    assert q.quantize_e2m1(torch.tensor(ties)).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert q.quantize_e2m1(torch.tensor([_next_up(t) for t in ties])).tolist() == list(range(1, 8))
    assert q.quantize_e2m1(torch.tensor([_next_down(t) for t in ties])).tolist() == list(range(7))
    assert q.quantize_e2m1(-torch.tensor(ties)).tolist() == [0, 9, 10, 11, 12, 13, 14]
    # saturation, no negative zero, NaN -> 0
    special = torch.tensor([100.0, -100.0, -0.0, -0.1, -0.25, float("nan"), float("-inf")])
    assert q.quantize_e2m1(special).tolist() == [7, 15, 0, 0, 0, 0, 15]


def test_fp4_codes_to_float_and_nibble_packing():
    out = q.fp4_codes_to_float(torch.arange(16, dtype=torch.int8))
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert out.dtype == torch.float32 and out.tolist() == expected
    assert torch.signbit(out[8]).item() is False  # code 8 decodes to +0.0
    codes = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.int8)
    packed = q.pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert _u8(packed).tolist() == [[0x21, 0x8F, 0x70]]
    assert torch.equal(q.unpack_fp4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    assert torch.equal(q.pack_fp4(q.unpack_fp4(every_byte)), every_byte)
    # transpose of a packed matrix: codes [[1, 2], [3, 4]] -> [[1, 3], [2, 4]]
    square = q.pack_fp4(torch.tensor([[1, 2], [3, 4]], dtype=torch.int8))
    assert _u8(q.transpose_packed_fp4(square)).tolist() == [[0x31], [0x42]]
    wide = every_byte.view(8, 32)
    assert torch.equal(q.unpack_fp4(q.transpose_packed_fp4(wide)), q.unpack_fp4(wide).t())


# ----------------------------------------------------------------------------------------------
# Casts: bit-exact against the numpy reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gran_k", [32, 128])
@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_casts_match_reference(shape, gran_k, use_ue8m0, dtype):
    x = _random_input(*shape, seed=shape[0] * 1000 + shape[1], dtype=dtype)
    q8, sf8 = q.per_token_cast_to_fp8(x, use_ue8m0, gran_k)
    ref_q8, ref_sf8 = _np_per_token_fp8(x, use_ue8m0, gran_k)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == shape
    assert sf8.shape == (shape[0], -(-shape[1] // gran_k))
    assert torch.equal(_u8(q8), torch.from_numpy(ref_q8))
    assert torch.equal(_i32(sf8), torch.from_numpy(_bits(ref_sf8).view(np.int32)))

    q4, sf4 = q.per_token_cast_to_fp4(x, use_ue8m0, gran_k)
    ref_q4, ref_sf4 = _np_per_token_fp4(x, use_ue8m0, gran_k)
    assert q4.dtype == torch.int8 and q4.shape == (shape[0], shape[1] // 2)
    assert torch.equal(_u8(q4), torch.from_numpy(ref_q4))
    assert torch.equal(_i32(sf4), torch.from_numpy(_bits(ref_sf4).view(np.int32)))

    if use_ue8m0:
        words = torch.from_numpy(_np_pack_words(_bits(ref_sf8) >> 23))
        q8p, sf8p = q.per_token_cast_to_fp8(x, True, gran_k, use_packed_ue8m0=True)
        assert torch.equal(_u8(q8p), _u8(q8)) and torch.equal(sf8p, words)
        words4 = torch.from_numpy(_np_pack_words(_bits(ref_sf4) >> 23))
        q4p, sf4p = q.per_token_cast_to_fp4(x, True, gran_k, use_packed_ue8m0=True)
        assert torch.equal(q4p, q4) and torch.equal(sf4p, words4)


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (5, 7), (256, 384)])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_per_block_cast_matches_reference(shape, use_ue8m0):
    x = _random_input(*shape, seed=shape[0] + shape[1])
    qb, sfb = q.per_block_cast_to_fp8(x, use_ue8m0)
    ref_q, ref_sf = _np_per_block_fp8(x, use_ue8m0, 128)
    assert sfb.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.equal(_u8(qb), torch.from_numpy(ref_q))
    assert torch.equal(_i32(sfb), torch.from_numpy(_bits(ref_sf).view(np.int32)))


def test_per_channel_cast_matches_per_block_columns():
    x = _random_input(256, 64, seed=3)
    qc, sfc = q.per_channel_cast_to_fp8(x, use_ue8m0=True, gran_k=128)
    assert qc.shape == (256, 64) and sfc.shape == (2, 64)
    ref_q, ref_sf = _np_per_token_fp8(x.t().contiguous(), True, 128)
    assert torch.equal(_u8(qc), torch.from_numpy(np.ascontiguousarray(ref_q.T)))
    assert torch.equal(sfc, torch.from_numpy(np.ascontiguousarray(ref_sf.T)))


def test_fp8_cast_edge_groups_zero_huge_tiny():
    x = torch.zeros(2, 384)
    x[0, 128:256] = torch.linspace(-1.0, 1.0, 128) * 1e30
    x[0, 256:384] = 1e-30
    x[1, :128] = -1e-30
    x[1, 300] = 3.0
    x = x.to(torch.bfloat16)
    floor_sf = np.float32(1e-4) / np.float32(448.0)
    for use_ue8m0 in (False, True):
        q8, sf = q.per_token_cast_to_fp8(x, use_ue8m0)
        assert not torch.isnan(q8.float()).any()
        amax = float(x[0, 128:256].float().abs().max())
        expected = [floor_sf, np.float32(amax) / np.float32(448.0), floor_sf]
        if use_ue8m0:
            expected = [2.0**-22, 2.0 ** np.ceil(np.log2(amax / 448.0)), 2.0**-22]
        assert sf[0].tolist() == [float(v) for v in expected]
        # zeros and 1e-30 (below the 1e-4 amax floor) quantize to 0 (+0 / -0)
        assert (_u8(q8[0, :128]) == 0).all() and (_u8(q8[0, 256:]) == 0).all()
        assert (_u8(q8[1, :128]) == 0x80).all()
        # the group maximum maps close to 448
        assert abs(q8[0, 255].float().item()) > 224 and q8[0, 255].float().item() <= 448
        back = q.cast_back_from_fp8(q8, sf)
        assert torch.allclose(back[0, 128:256], x[0, 128:256].float(), rtol=2.0**-4, atol=0)
        assert back[1, 300].item() == 3.0


# ----------------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("gran_k", [32, 128])
def test_fp8_round_trip_error_bound(use_ue8m0, gran_k):
    x = _random_input(16, 1000, seed=11)
    xf = x.float()
    q8, sf = q.per_token_cast_to_fp8(x, use_ue8m0, gran_k)
    back = q.cast_back_from_fp8(q8, sf, gran_k)
    col_sf = sf.repeat_interleave(gran_k, dim=1)[:, :1000]
    # e4m3: relative error <= 2^-4 in the normal range, absolute <= 2^-10 * sf when subnormal
    assert ((back - xf).abs() <= 2.0**-4 * xf.abs() + 2.0**-10 * col_sf).all()
    if use_ue8m0:
        q8p, sfp = q.per_token_cast_to_fp8(x, True, gran_k, use_packed_ue8m0=True)
        assert torch.equal(q.cast_back_from_fp8(q8p, sfp, gran_k, use_packed_ue8m0=True), back)
    qb, sfb = q.per_block_cast_to_fp8(x, use_ue8m0)
    backb = q.cast_back_from_fp8_block(qb, sfb)
    blk_sf = sfb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:16, :1000]
    assert ((backb - xf).abs() <= 2.0**-4 * xf.abs() + 2.0**-10 * blk_sf).all()


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_fp4_round_trip_within_half_step(use_ue8m0):
    x = _random_input(8, 512, seed=5)
    xf = x.float()
    packed, sf = q.per_token_cast_to_fp4(x, use_ue8m0, gran_k=32)
    back = q.cast_back_from_fp4(packed, sf, gran_k=32)
    col_sf = sf.repeat_interleave(32, dim=1)
    y = xf.abs() / col_sf
    half_step = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    assert y.max() <= 6.0 * (1 + 2.0**-20)
    assert ((back - xf).abs() <= half_step * col_sf * (1 + 2.0**-20)).all()
    if use_ue8m0:
        pp, sfp = q.per_token_cast_to_fp4(x, True, gran_k=32, use_packed_ue8m0=True)
        assert sfp.shape == (8, 4)
        assert torch.equal(q.cast_back_from_fp4(pp, sfp, 32, use_packed_ue8m0=True), back)


def test_packed_scales_pad_with_one():
    x = _random_input(3, 64, seed=9)  # 2 groups of 32 -> one word, bytes 2 and 3 are 1.0
    _, sf = q.per_token_cast_to_fp4(x, True, gran_k=32)
    _, words = q.per_token_cast_to_fp4(x, True, gran_k=32, use_packed_ue8m0=True)
    assert words.shape == (3, 1)
    unpacked = q.unpack_ue8m0_from_int(words)
    assert torch.equal(unpacked[:, :2], sf) and (unpacked[:, 2:] == 1.0).all()
    _, words8 = q.per_token_cast_to_fp8(x, True, gran_k=32, use_packed_ue8m0=True)
    assert torch.equal(q.unpack_ue8m0_from_int(words8)[:, 2:], torch.ones(3, 2))


# ----------------------------------------------------------------------------------------------
# Epilogue re-quantizer
# ----------------------------------------------------------------------------------------------


def test_requant_fp8_pow2_hand_vectors():
    h = torch.zeros(6, 64)
    h[1, :32] = torch.linspace(-448.0, 448.0, 32)  # amax exactly 448 -> scale 1
    h[2, 0], h[2, 40] = 448.0 * 2.0**5, -448.0 * 2.0**-10
    h[3, 0] = _next_up(448.0 * 2.0**5)  # one ulp above 448 * 2^5 -> next power of two
    h[3, 32] = float(np.nextafter(np.float32(448.0), np.float32(0)))  # one ulp below 448
    h[4, 0] = 2.0**-130  # v is a float32 subnormal -> e = -126
    h[5, :32] = torch.tensor([1.75, 1.0, -1.5, 0.0] * 8) * 2.0**-20  # amax / 448 = 2^-28
    h[5, 32:] = torch.tensor([3.0, -1.0, 0.5, 0.0] * 8) * 2.0**-20  # e = ceil(-27.2) = -27
    qq, sf = q.requant_fp8_pow2(h, 32)
    _, words = q.requant_fp8_pow2(h, 32, use_packed_ue8m0=True)
    padded = torch.cat([sf, torch.ones(6, 2)], dim=1)
    assert torch.equal(q.pack_ue8m0_to_int(padded), words)  # 2^-127 packs to byte 0
    expected_e = torch.tensor(
        [[-127, -127], [0, -127], [5, -10], [6, 0], [-126, -127], [-28, -27]], dtype=torch.int32
    )
    exp_bits = torch.where(expected_e == -127, UE8M0_BYTE0_BITS, (expected_e + 127) << 23)
    assert torch.equal(_i32(sf), exp_bits)
    exp_words = (expected_e[:, 0] + 127) | ((expected_e[:, 1] + 127) << 8) | (127 << 16)
    exp_words = exp_words | (127 << 24)  # wraps to a negative int32, as the packed word does
    assert torch.equal(words[:, 0], exp_words.to(torch.int32))
    assert torch.equal(q.unpack_ue8m0_from_int(words)[:, :2], sf)  # byte 0 round-trips
    # zeros stay +0; exact powers of two are exact; e4m3 bytes where hand-computable
    assert (_u8(qq[0]) == 0).all() and (_u8(qq[1, 32:]) == 0).all()
    assert _u8(qq[1, [0, 31]]).tolist() == [0xFE, 0x7E]  # -448, 448
    assert _u8(qq[2, [0, 40]]).tolist() == [0x7E, 0xFE]
    assert qq[3, 0].float().item() == 224.0 and _u8(qq[3, 32]).item() == 0x7E
    assert qq[4, 0].float().item() == 2.0**-4
    assert torch.equal(qq[5].float() * sf[5].repeat_interleave(32), h[5])


def test_requant_multiplies_by_rounded_reciprocal():
    # amax = 224 * 2^-149 (a float32 subnormal): amax / 448 is exactly half the smallest
    # subnormal and rounds to 0 (e = -127), but float32(1/448) is slightly above 1/448, so
    # amax * float32(1/448) rounds up to 2^-149 (e = -126). 223 * 2^-149 gives 0 either way.
    h = torch.zeros(2, 32)
    h[0, 0], h[1, 0] = 224 * 2.0**-149, 223 * 2.0**-149
    assert (h[:, 0] > 0).all() and (h[:, 0] / 448.0 == 0).all()
    qq, words = q.requant_fp8_pow2(h, 32, use_packed_ue8m0=True)
    assert (words & 0xFF).view(-1).tolist() == [1, 0]
    assert (_u8(qq) == 0).all()


def test_requant_differs_from_per_token_cast_only_where_expected():
    h = torch.zeros(1, 64)
    h[0, :32] = 1e-6  # below the 1e-4 floor of the reference cast
    h[0, 32:] = torch.linspace(-3.0, 5.0, 32)
    qr, sfr = q.requant_fp8_pow2(h, 32)
    qt, sft = q.per_token_cast_to_fp8(h, use_ue8m0=True, gran_k=32)
    assert sfr[0, 0].item() == 2.0**-28 and sft[0, 0].item() == 2.0**-22
    assert sfr[0, 1].item() == sft[0, 1].item() == 2.0**-6
    assert torch.equal(_u8(qr[:, 32:]), _u8(qt[:, 32:]))


@pytest.mark.parametrize("shape", [(4, 256), (3, 200), (9, 64)])
@pytest.mark.parametrize("gran_k", [32, 128])
def test_requant_matches_reference(shape, gran_k):
    h = _random_input(*shape, seed=shape[1] + gran_k, dtype=torch.float32)
    h[1, :gran_k] = 0.0
    qq, sf = q.requant_fp8_pow2(h, gran_k)
    ref_q, ref_byte = _np_requant(h, gran_k)
    assert torch.equal(_u8(qq), torch.from_numpy(ref_q))
    sf_bits = np.where(ref_byte == 0, UE8M0_BYTE0_BITS, ref_byte << 23).astype(np.uint32)
    assert torch.equal(_i32(sf), torch.from_numpy(sf_bits.view(np.int32)))
    _, words = q.requant_fp8_pow2(h, gran_k, use_packed_ue8m0=True)
    assert torch.equal(words, torch.from_numpy(_np_pack_words(ref_byte)))
    # the scale really is the smallest power of two with amax / sf <= 448
    amax = torch.from_numpy(np.abs(_np_groups(_np_f32(h), gran_k)).max(axis=2))
    nz = amax > 0
    assert (amax[nz] / sf[nz] <= 448).all() and (amax[nz] / sf[nz] > 224 * (1 - 2.0**-20)).all()


# ----------------------------------------------------------------------------------------------
# Weight layout transforms
# ----------------------------------------------------------------------------------------------


def test_interleave_gate_up_explicit():
    t = torch.arange(32).view(1, 32)  # I = 16: gate rows 0..15, up rows 16..31
    expected = list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))
    assert q.interleave_gate_up(t).view(-1).tolist() == expected
    by_two = q.interleave_gate_up(torch.arange(8).view(1, 8), gran=2)
    assert by_two.view(-1).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # the closed form of the reference doc, on a larger tensor with trailing dims
    n = 96
    t = torch.randn(3, n, 5, 2).to(torch.bfloat16)
    out = q.interleave_gate_up(t)
    for p in range(n):
        b, r = divmod(p, 16)
        src = 8 * b + r if r < 8 else n // 2 + 8 * b + r - 8
        assert torch.equal(out[:, p], t[:, src])
    assert torch.equal(q.deinterleave_gate_up(out), t)
    assert torch.equal(q.interleave_gate_up(q.deinterleave_gate_up(t)), t)


def test_utccp_transpose_explicit_and_inverse():
    sf = torch.arange(2 * 256 * 3, dtype=torch.int32).view(2, 256, 3)
    out = q.transpose_sf_for_utccp(sf)
    for base in (0, 128):
        for i in range(32):
            for j in range(4):
                assert torch.equal(out[:, base + 4 * i + j], sf[:, base + 32 * j + i])
    assert torch.equal(q.untranspose_sf_for_utccp(out), sf)
    assert torch.equal(q.transpose_sf_for_utccp(q.untranspose_sf_for_utccp(sf)), sf)
    # an MN-major input keeps its strides (the kernel's TMA descriptors depend on them)
    mn_major = sf.transpose(1, 2).contiguous().transpose(1, 2)
    out_mn = q.transpose_sf_for_utccp(mn_major)
    assert out_mn.stride() == mn_major.stride() and torch.equal(out_mn, out)


def _random_bf16_weights(e, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(e, n, k, generator=gen) * 0.05).to(torch.bfloat16)


# NOTE: explicit ids: a bare "sm100" id would match the `sm100` marker keyword in conftest.py
ARCH_PARAMS = [pytest.param("sm100", id="arch-sm100"), pytest.param("sm90", id="arch-sm90")]


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_transform_fp8xfp4(arch):
    num_experts, hidden, inter = 2, 256, 64
    l1 = q.quantize_weights_for_recipe(_random_bf16_weights(2, 2 * inter, hidden, 1), "fp8xfp4")
    l2 = q.quantize_weights_for_recipe(_random_bf16_weights(2, hidden, inter, 2), "fp8xfp4")
    assert l1[0].shape == (num_experts, 2 * inter, hidden // 2) and l1[0].dtype == torch.int8
    assert l1[1].shape == (num_experts, 2 * inter, hidden // 128) and l1[1].dtype == torch.int32
    (w1, sf1), (w2, sf2) = q.transform_weights_for_mega_moe(l1, l2, arch=arch)
    assert w1.shape == l1[0].shape and sf1.shape == l1[1].shape and sf2.shape == l2[1].shape
    assert torch.equal(q.deinterleave_gate_up(w1), l1[0])
    assert torch.equal(w2, l2[0])
    if arch == "sm100":
        assert torch.equal(q.deinterleave_gate_up(q.untranspose_sf_for_utccp(sf1)), l1[1])
        assert torch.equal(q.untranspose_sf_for_utccp(sf2), l2[1])
        # row 4*i+j of the transposed interleaved scales is interleaved row 32*j+i
        assert torch.equal(sf1[:, 4 * 5 + 3], q.interleave_gate_up(l1[1])[:, 32 * 3 + 5])
    else:
        assert torch.equal(q.deinterleave_gate_up(sf1), l1[1])
        assert torch.equal(sf2, l2[1])


@pytest.mark.parametrize("arch", ARCH_PARAMS + [pytest.param("sm_90a", id="arch-sm_90a")])
def test_transform_bf16(arch):
    l1 = _random_bf16_weights(2, 64, 32, 3)
    l2 = _random_bf16_weights(2, 32, 32, 4)
    out1, out2 = q.transform_weights_for_mega_moe(l1, l2, arch=arch)
    assert torch.equal(out1[:, 8:16], l1[:, 32:40]) and torch.equal(out1[:, 16:24], l1[:, 8:16])
    assert torch.equal(q.deinterleave_gate_up(out1), l1) and torch.equal(out2, l2)


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@pytest.mark.parametrize("inter", [128, 80])
def test_transform_fp8xfp8_expands_block_scales_per_row(arch, inter):
    num_experts, hidden = 2, 256
    w1 = _random_bf16_weights(num_experts, 2 * inter, hidden, 5)
    w2 = _random_bf16_weights(num_experts, hidden, inter, 6)
    l1 = q.quantize_weights_for_recipe(w1, "fp8xfp8")
    l2 = q.quantize_weights_for_recipe(w2, "fp8xfp8")
    assert l1[1].shape == (num_experts, -(-2 * inter // 128), 2)
    assert l2[1].shape == (num_experts, 2, -(-inter // 128))
    (tw1, tsf1), (tw2, tsf2) = q.transform_weights_for_mega_moe(l1, l2, arch=arch)
    assert tsf1.shape == (num_experts, 2 * inter, 2) and tsf2.shape == (num_experts, hidden, 1)
    assert torch.equal(_u8(q.deinterleave_gate_up(tw1)), _u8(l1[0]))
    assert torch.equal(_u8(tw2), _u8(l2[0]))
    rows1 = q.deinterleave_gate_up(tsf1)
    for r in range(2 * inter):
        assert torch.equal(rows1[:, r], l1[1][:, r // 128])
    for r in range(hidden):
        assert torch.equal(tsf2[:, r], l2[1][:, r // 128])
    # the transformed (interleaved, per-row) pair dequantizes to the interleaved weights
    deq = q.dequantize_weights_for_recipe((tw1, tsf1), "fp8xfp8")
    assert torch.equal(deq, q.interleave_gate_up(q.dequantize_weights_for_recipe(l1, "fp8xfp8")))


def test_transform_rejects_bad_inputs():
    bf1, bf2 = _random_bf16_weights(2, 64, 32, 7), _random_bf16_weights(2, 32, 32, 8)
    fp4_1 = q.quantize_weights_for_recipe(_random_bf16_weights(2, 128, 256, 9), "fp8xfp4")
    fp4_2 = q.quantize_weights_for_recipe(_random_bf16_weights(2, 256, 64, 10), "fp8xfp4")
    with pytest.raises(ValueError, match="l1_weights.*16"):
        q.transform_weights_for_mega_moe(bf1[:, :40], bf2[:, :, :20])
    with pytest.raises(TypeError, match="l1_weights"):
        q.transform_weights_for_mega_moe(bf1.float(), bf2)
    with pytest.raises(ValueError, match="l2_weights"):
        q.transform_weights_for_mega_moe(bf1, bf2[:, :16])
    with pytest.raises(ValueError, match="l1_weights\\[1\\]"):
        q.transform_weights_for_mega_moe((fp4_1[0], fp4_1[1][:, :, :1]), fp4_2)
    with pytest.raises(TypeError, match="l1_weights\\[1\\]"):
        q.transform_weights_for_mega_moe((fp4_1[0], fp4_1[1].float()), fp4_2)
    with pytest.raises(TypeError, match="l1_weights\\[0\\]"):
        q.transform_weights_for_mega_moe((fp4_1[0].float(), fp4_1[1]), fp4_2)
    with pytest.raises(TypeError, match="l2_weights"):
        q.transform_weights_for_mega_moe(fp4_1, fp4_2[0])
    with pytest.raises(ValueError, match="activation"):
        q.transform_weights_for_mega_moe(bf1, bf2, activation="gelu")
    with pytest.raises(ValueError, match="arch"):
        q.transform_weights_for_mega_moe(bf1, bf2, arch="sm80")
    # sm100 needs 128-row scale groups for UTCCP; sm90 does not
    small1 = q.quantize_weights_for_recipe(_random_bf16_weights(1, 32, 256, 11), "fp8xfp4")
    small2 = q.quantize_weights_for_recipe(_random_bf16_weights(1, 256, 16, 12), "fp8xfp4")
    with pytest.raises(ValueError, match="multiple of 128"):
        q.transform_weights_for_mega_moe(small1, small2, arch="sm100")
    (w1, _), _ = q.transform_weights_for_mega_moe(small1, small2, arch="sm90")
    assert torch.equal(q.deinterleave_gate_up(w1), small1[0])
    fp8_1 = q.quantize_weights_for_recipe(_random_bf16_weights(1, 256, 256, 13), "fp8xfp8")
    fp8_2 = q.quantize_weights_for_recipe(_random_bf16_weights(1, 256, 128, 14), "fp8xfp8")
    with pytest.raises(ValueError, match="l2_weights\\[1\\]"):
        q.transform_weights_for_mega_moe(fp8_1, (fp8_2[0], fp8_2[1][:, :1]), arch="sm90")
    with pytest.raises(ValueError, match="multiple of 128"):
        q.transpose_sf_for_utccp(torch.zeros(1, 64, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="sf"):
        q.transpose_sf_for_utccp(torch.zeros(1, 128, 1))


def test_cast_argument_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="even"):
        q.per_token_cast_to_fp4(torch.randn(4, 63), True)
    with pytest.raises(ValueError, match="x"):
        q.per_token_cast_to_fp8(torch.randn(64), True)
    with pytest.raises(TypeError, match="x"):
        q.per_token_cast_to_fp8(torch.ones(4, 64, dtype=torch.int32), True)
    with pytest.raises(ValueError, match="use_ue8m0"):
        q.per_token_cast_to_fp8(x, False, 32, use_packed_ue8m0=True)
    with pytest.raises(ValueError, match="use_ue8m0"):
        q.per_token_cast_to_fp4(x, False, 32, use_packed_ue8m0=True)
    with pytest.raises(ValueError, match="gran_k"):
        q.per_token_cast_to_fp8(x, True, 0)
    with pytest.raises(ValueError, match="gran_k"):
        q.requant_fp8_pow2(x, -32)
    with pytest.raises(ValueError, match="sf"):
        q.cast_back_from_fp8(q.per_token_cast_to_fp8(x, True)[0], torch.ones(3, 1))
    with pytest.raises(ValueError, match="recipe"):
        q.check_recipe("fp4xfp4")
    with pytest.raises(ValueError, match="recipe"):
        q.quantize_weights_for_recipe(torch.randn(1, 16, 64), "int8")
    assert q.check_recipe("fp8xfp8") == "fp8xfp8"
    assert q.RECIPES == ("fp8xfp4", "fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")


# ----------------------------------------------------------------------------------------------
# Recipe helpers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [128, 96])
def test_quantize_weights_for_recipe_is_per_expert(n):
    w = _random_bf16_weights(3, n, 256, 15)
    w4, s4 = q.quantize_weights_for_recipe(w, "fp8xfp4")
    w8, s8 = q.quantize_weights_for_recipe(w, "fp8xfp8")
    assert w4.shape == (3, n, 128) and s4.shape == (3, n, 2) and s4.dtype == torch.int32
    assert w8.shape == (3, n, 256) and s8.shape == (3, 1, 2) and s8.dtype == torch.float32
    for e in range(3):
        ref4 = q.per_token_cast_to_fp4(w[e], True, gran_k=32, use_packed_ue8m0=True)
        ref8 = q.per_block_cast_to_fp8(w[e], use_ue8m0=False)
        assert torch.equal(w4[e], ref4[0]) and torch.equal(s4[e], ref4[1])
        assert torch.equal(_u8(w8[e]), _u8(ref8[0])) and torch.equal(s8[e], ref8[1])
    assert q.quantize_weights_for_recipe(w, "bf16xbf16") is w
    wf = w.float()
    deq4 = q.dequantize_weights_for_recipe((w4, s4), "fp8xfp4")
    unpacked = q.unpack_ue8m0_from_int(s4.view(3 * n, -1)).view(3, n, -1)
    assert torch.equal(q.dequantize_weights_for_recipe((w4, unpacked), "fp8xfp4"), deq4)
    col_sf = unpacked.repeat_interleave(32, dim=2)
    assert ((deq4 - wf).abs() <= col_sf).all()  # half of the largest e2m1 step (2)
    deq8 = q.dequantize_weights_for_recipe((w8, s8), "fp8xfp8")
    assert ((deq8 - wf).abs() <= 2.0**-4 * wf.abs() + 2.0**-10 * s8.max()).all()
    assert torch.equal(q.dequantize_weights_for_recipe(w, "bf16xbf16"), wf)


@pytest.mark.parametrize("recipe", ["fp8xfp4", "fp8xfp8", "bf16xbf16"])
def test_quantize_activations_for_recipe(recipe):
    x = _random_input(6, 512, seed=21)
    out = q.quantize_activations_for_recipe(x, recipe)
    back = q.dequantize_activations_for_recipe(out, recipe)
    assert back.dtype == torch.float32 and back.shape == x.shape
    if recipe == "bf16xbf16":
        assert out is x and torch.equal(back, x.float())
        return
    xq, sf = out
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == (6, 512)
    if recipe == "fp8xfp4":
        assert sf.dtype == torch.int32 and sf.shape == (6, 4)
        ref = _np_per_token_fp8(x, True, 32)
        assert torch.equal(sf, torch.from_numpy(_np_pack_words(_bits(ref[1]) >> 23)))
        col_sf = q.unpack_ue8m0_from_int(sf).repeat_interleave(32, 1)
    else:
        assert sf.dtype == torch.float32 and sf.shape == (6, 4)
        ref = _np_per_token_fp8(x, True, 128)
        assert torch.equal(sf, torch.from_numpy(ref[1]))
        col_sf = sf.repeat_interleave(128, 1)
    assert torch.equal(_u8(xq), torch.from_numpy(ref[0]))
    xf = x.float()
    assert ((back - xf).abs() <= 2.0**-4 * xf.abs() + 2.0**-10 * col_sf).all()


# ------------------------------------------------------------ MXFP4 weights as FP8 blocks (sm90)

def _fp4_weights(e: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * torch.exp2(torch.randint(-3, 4, (e, n, 1),
                                                                     generator=g).float())
    return q.quantize_weights_for_recipe(w.to(torch.bfloat16), "fp8xfp4")


@pytest.mark.parametrize("shape", [(2, 256, 512), (1, 200, 96), (3, 128, 160)])
def test_fp4_weights_as_fp8_blocks_are_exact(shape):
    """Realistic weights (scales within 14 binades per 128 x 128 block): the FP8 blocks
    dequantize to exactly the FP4 weights, never near e4m3's limit; int32-packed and float
    scales alike; blocks cut by uneven N and K."""
    pair = _fp4_weights(*shape, seed=sum(shape))
    w8, sf8 = q.fp4_weights_to_fp8_blocks(pair)
    e, n, k = shape
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (e, n, k)
    assert sf8.shape == (e, -(-n // 128), -(-k // 128)) and sf8.dtype == torch.float32
    want = q.dequantize_weights_for_recipe(pair, "fp8xfp4")
    got = q.dequantize_weights_for_recipe((w8, sf8), "fp8xfp8")
    assert torch.equal(got, want)
    assert float(w8.float().abs().max()) <= 384.0
    # the scales' exponents are what matter: float scales give the same blocks
    sf_float = q.unpack_ue8m0_from_int(pair[1].reshape(e * n, -1)).view(e, n, -1)
    w8f, sf8f = q.fp4_weights_to_fp8_blocks((pair[0], sf_float))
    assert torch.equal(w8f.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(sf8f, sf8)


def test_fp4_weights_as_fp8_blocks_beyond_14_binades_round_to_e4m3():
    """One 128 x 128 block whose per-32 scales span 2**-12 .. 2**8: the block scale follows the
    largest (2**(8 - 6)); groups within 14 binades of it stay exact, the others are the e4m3
    rounding (nearest even, subnormals) of their exact values over the block scale."""
    codes = torch.arange(128 * 128).remainder(16).to(torch.int8).view(1, 128, 128)
    packed = q.pack_fp4(codes)
    exps = torch.tensor([8, -6, -7, -12], dtype=torch.float32)  # per 32-column group
    sf = torch.exp2(exps).expand(1, 128, 4).contiguous()
    w8, sf8 = q.fp4_weights_to_fp8_blocks((packed, sf))
    assert float(sf8) == 2.0**2
    exact = q.fp4_codes_to_float(codes) * sf.repeat_interleave(32, dim=2)
    got = w8.float() * sf8
    within = (exps >= 8 - 14).repeat_interleave(32)  # groups 0, 1 (spread 14) exact
    assert torch.equal(got[..., within], exact[..., within])
    want = (exact[..., ~within] / 4.0).to(torch.float8_e4m3fn).float() * 4.0
    assert torch.equal(got[..., ~within], want)
    assert not torch.equal(want, exact[..., ~within])  # (the case does lose bits)
    assert not bool(w8.float().isnan().any())


def test_fp4_weights_as_fp8_blocks_clamp_the_block_exponent_to_normal_floats():
    """A block whose largest per-32 scale is below 2**-120 gets b = -126, not max(s) - 6: its
    scale 2**b stays a normal float32 (the kernel reads b from its exponent bits), and its
    elements, e2m1 * 2**(s + 126) with s >= -127, stay exact; the block below it keeps
    b = max(s) - 6. `fp4_block_scales` gives the same scales, from packed or float scales."""
    codes = torch.arange(256 * 128).remainder(16).to(torch.int8).view(1, 256, 128)
    exps = torch.tensor([[-127, -125, -122, -127], [0, -3, -10, -20]], dtype=torch.float32)
    sf = torch.exp2(exps).repeat_interleave(128, dim=0).unsqueeze(0)  # [1, 256, 4]
    w8, sf8 = q.fp4_weights_to_fp8_blocks((q.pack_fp4(codes), sf))
    assert sf8.flatten().tolist() == [2.0**-126, 2.0**-6]
    assert bool((((sf8.view(torch.int32) >> 23) & 0xFF) > 0).all())  # normal floats
    exact = q.fp4_codes_to_float(codes) * sf.repeat_interleave(32, dim=2)
    got = w8.float() * sf8.repeat_interleave(128, dim=1)
    assert torch.equal(got[:, :128], exact[:, :128])
    want = q.fp4_codes_to_float(codes[:, :128]) * torch.exp2(exps[0] + 126).repeat_interleave(32)
    assert torch.equal(w8[:, :128].float(), want) and float(want.abs().max()) == 6 * 2.0**4
    low = exact[:, 128:] * 2.0**6
    assert torch.equal(got[:, 128:], low.to(torch.float8_e4m3fn).float() * 2.0**-6)
    for scales in (sf, q.pack_ue8m0_to_int(sf)):
        assert torch.equal(q.fp4_block_scales(scales), sf8)
    # K = 96: the packed word's pad scale (1.0) must not count
    padded = q.pack_ue8m0_to_int(torch.cat([sf[:, :, :3], torch.ones(1, 256, 1)], dim=2))
    assert q.fp4_block_scales(padded, k=96).flatten().tolist() == [2.0**-126, 2.0**-6]
    assert q.fp4_block_scales(padded).flatten().tolist() == [2.0**-6, 2.0**-6]


def test_fp4_weights_as_fp8_blocks_rejects_non_power_of_two_scales():
    pair = _fp4_weights(1, 128, 128, seed=1)
    sf = q.unpack_ue8m0_from_int(pair[1].reshape(128, -1)).view(1, 128, -1) * 1.5
    with pytest.raises(ValueError, match="powers of two"):
        q.fp4_weights_to_fp8_blocks((pair[0], sf))
