"""FP8 / FP4 / UE8M0 quantization, packing and the Mega-MoE weight transforms (host side).

What this is
------------
The numerics contract of the whole package: every cast a kernel must reproduce, written in
plain PyTorch so it runs on CPU and (unchanged) on CUDA tensors. The formulas are DeepGEMM's
(``deep_gemm/utils/math.py`` and ``deep_gemm/mega/__init__.py`` at commit 54e2261; the epilogue
re-quantizer is the kernel's ``get_e4m3_sf_and_sf_inv`` in ``common/math.cuh``). Results are
bit-identical with DeepGEMM's Python helpers on every input those accept; the operations are
evaluated in the same dtypes and with the same PyTorch primitives, so they also match on each
device.

Formulas
--------
All arithmetic below is float32 unless stated; ``RN`` is round-to-nearest-even.

* ``ceil_to_ue8m0(v)``: with ``b = bits(|v|)`` (float32), ``e = ((b >> 23) & 0xff) +
  [b & 0x7fffff != 0]``, clamped to ``[1, 254]``; result ``bits = e << 23``, i.e. the smallest
  power of two ``>= |v|`` (``2^-126 <= result <= 2^127``; 0 and subnormals give ``2^-126``).
* UE8M0 byte of a power-of-two float ``s``: its biased exponent (``bits(s) >> 23``); byte 0 is
  ``2^-127`` (the float32 subnormal with bits ``0x00400000``). Four bytes pack into one int32
  little-endian: scale group ``g`` goes to byte ``g % 4`` of word ``g // 4``.
* Per-token / per-block / per-channel FP8 (e4m3) casts, per group of ``gran_k`` elements
  (groups padded with zeros): ``amax = max(float32(|x|), 1e-4)``; ``sf = amax / 448.0``
  (float32, written as tensor / Python scalar exactly like DeepGEMM); optionally
  ``sf = ceil_to_ue8m0(sf)``; ``q = e4m3(x * (1.0 / sf))`` where the product is promoted to
  float32 for bf16/fp16/f32 inputs and the cast is PyTorch's (RN).
* Per-token FP4 (e2m1) cast: as above with ``sf = amax / 6.0``; ``y = x * (1.0 / sf)``;
  ``code = #{t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0) : |y| > t}`` (strict ``>``: a tie
  goes to the smaller magnitude), sign bit 3 set only when ``y < 0`` and ``code != 0`` (no
  negative zero). Magnitudes by code: ``0, .5, 1, 1.5, 2, 3, 4, 6``. Two codes per byte,
  element ``2i`` in the low nibble. With packed UE8M0 the scale row is padded to a multiple of
  four groups with ``1.0`` (byte 127).
* Epilogue re-quantizer (``requant_fp8_pow2``, what the fused kernel does after SwiGLU;
  differs from the per-token cast): ``amax = max |h|`` (no floor);
  ``v = amax * float32(1/448)``; ``e = biased_exp(v) - 127 + [mantissa(v) != 0]``;
  ``sf_inv = float(bits=(127 - e) << 23)``; ``q = e4m3_satfinite(RN(h * sf_inv))``; the scale
  is the UE8M0 byte ``e + 127`` (``amax = 0`` gives byte 0, i.e. ``2^-127``, and ``q = 0``).
* MXFP4 weights as FP8 blocks (recipe ``fp8xfp4_sm90``, ``fp4_weights_to_fp8_blocks``): per
  128 x 128 block ``b = max(max(s) - 6, -126)`` over its per-32 scale exponents ``s``; each
  element ``e4m3(RN(e2m1 * 2^(s - b)))``, the block scale ``2^b``.
* Weight transforms: gate/up interleave with granularity 8 along the N axis of L1; the UTCCP
  4x32 transpose of packed scale rows inside each group of 128 (sm100 only); f32 block scales
  of FP8 weights are expanded to one scale row per weight row (before the interleave).

Device note: PyTorch evaluates ``tensor / python_scalar`` as a true division on CPU but as
``tensor * float32(1 / scalar)`` on CUDA. Keeping DeepGEMM's expression keeps us bit-identical
with DeepGEMM on each device. After ``ceil_to_ue8m0`` both give the same scale for every amax
(``float32(1/448)`` and ``float32(1/6)`` are within half an ulp of the exact reciprocals; the tests
check a whole binade), so every UE8M0 path is device-independent. Raw float32 scales
(``use_ue8m0=False``, e.g. the ``fp8xfp8`` weight recipe) can differ in the last bit between CPU
and CUDA: quantize once and share the tensors. ``requant_fp8_pow2`` multiplies explicitly and
is device-independent.

Deliberate differences from DeepGEMM (only on inputs DeepGEMM rejects or never produces):
``unpack_ue8m0_from_int`` decodes byte 0 as ``2^-127`` (the UE8M0 meaning) where DeepGEMM gives
``0.0``, and ``pack_ue8m0_to_int`` accepts ``2^-127``; ``per_token_cast_to_fp8`` pads a packed
scale row to a multiple of four groups (as DeepGEMM's FP4 cast does) instead of failing; the
pad bytes of packed scale rows are ``127`` (1.0, as DeepGEMM's FP4 cast writes them) where
DeepGEMM's ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` writes ``0`` (no kernel reads them);
argument errors raise ``ValueError`` / ``TypeError`` instead of ``AssertionError``. The
conformance tests (`tests/test_deepgemm_conformance.py`) check everything else bit-exact.
"""

from __future__ import annotations

import torch

from cute_megamoe.checks import check_tensor
from cute_megamoe.chunks import chunk_experts_for, map_experts
from cute_megamoe.tables import RECIPES, activation_recipe, normalize_arch
from cute_megamoe.utils import align, ceil_div

__all__ = [
    "RECIPES",
    "align",
    "cast_back_from_fp4",
    "cast_back_from_fp8",
    "cast_back_from_fp8_block",
    "ceil_div",
    "ceil_to_ue8m0",
    "check_recipe",
    "deinterleave_gate_up",
    "dequantize_activations_for_recipe",
    "dequantize_weights_for_recipe",
    "fp4_block_scales",
    "fp4_codes_to_float",
    "fp4_weights_to_fp8_blocks",
    "interleave_gate_up",
    "pack_fp4",
    "fp4_words_for_sm90_decode",
    "fp4_words_from_sm90_decode",
    "pack_ue8m0_to_int",
    "per_block_cast_to_fp8",
    "per_channel_cast_to_fp8",
    "per_token_cast_to_fp4",
    "per_token_cast_to_fp8",
    "quantize_activations_for_recipe",
    "quantize_e2m1",
    "quantize_weights_for_recipe",
    "requant_fp8_pow2",
    "transform_weights_for_mega_moe",
    "transpose_packed_fp4",
    "transpose_sf_for_utccp",
    "unpack_fp4",
    "unpack_ue8m0_from_int",
    "untranspose_sf_for_utccp",
    "weight_sf_for_sm100",
]

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
#: Lower clamp of the group amax in the reference casts (not in the epilogue re-quantizer).
AMAX_FLOOR = 1e-4
#: Decision thresholds of the e2m1 quantizer (strict ``>``) and the magnitude of each code.
E2M1_THRESHOLDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: UE8M0 byte of 1.0, used to pad packed scale rows.
UE8M0_ONE = 127
#: Row granularity of the gate/up interleave and block size of the UTCCP transpose.
INTERLEAVE_GRAN = 8
UTCCP_ROWS = 128
#: Block size of FP8 weight scales (per 128 x 128 block) and of per-token FP8 scales.
FP8_BLOCK = 128

_F32_MANT_BITS = 23
_F32_MANT_MASK = 0x7FFFFF
_F32_EXP_MASK = 0xFF
_F32_BIAS = 127
#: float32 bits of 2^-127, the value of UE8M0 byte 0 (a float32 subnormal).
_UE8M0_ZERO_BYTE_BITS = 0x00400000
#: float32(1/448) = 0x3B124925 as a Python float (exact).
_INV_FP8_E4M3_MAX_F32 = float(torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32).item())


#: A bf16 weight tensor, or a (quantized weight, scale) pair.
WeightPair = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _check_dim(x: torch.Tensor, dim: int, name: str) -> None:
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")


def _check_dtype(x: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")


def _check_floating(x: torch.Tensor, name: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _check_gran(gran: int, name: str) -> None:
    if isinstance(gran, bool) or not isinstance(gran, int) or gran <= 0:
        raise ValueError(f"{name} must be a positive int, got {gran!r}")


def _check_shape(x: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_recipe(recipe: str) -> str:
    """Return ``recipe`` if it is one of :data:`RECIPES`, else raise ``ValueError``."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return recipe


# ----------------------------------------------------------------------------------------------
# UE8M0 scales
# ----------------------------------------------------------------------------------------------


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round ``|x|`` up to a power of two with biased exponent in [1, 254] (float32 result)."""
    bits = x.abs().float().view(torch.int32)
    exp = (bits >> _F32_MANT_BITS) & _F32_EXP_MASK
    exp = exp + ((bits & _F32_MANT_MASK) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << _F32_MANT_BITS).view(torch.float32)


def _ue8m0_bytes_to_float(byte: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (any integer dtype, values 0..255) -> float32 ``2^(byte - 127)``."""
    byte = byte.to(torch.int32)
    bits = torch.where(byte == 0, _UE8M0_ZERO_BYTE_BITS, byte << _F32_MANT_BITS)
    return bits.view(torch.float32)


def _pack_bytes(byte: torch.Tensor) -> torch.Tensor:
    """Pack UE8M0 bytes ``[..., 4w]`` (values 0..255) into int32 ``[..., w]``, little-endian."""
    return byte.to(torch.uint8).contiguous().view(torch.int32)


def _pack_bytes_padded(byte: torch.Tensor) -> torch.Tensor:
    """Like :func:`_pack_bytes` but pads the last dim to a multiple of 4 with byte 127 (1.0)."""
    num = byte.size(-1)
    if num % 4 != 0:
        byte = torch.nn.functional.pad(byte, (0, align(num, 4) - num), value=UE8M0_ONE)
    return _pack_bytes(byte)


def _float_to_ue8m0_bytes(x: torch.Tensor, name: str) -> torch.Tensor:
    """float32 powers of two (or +0.0, or 2^-127) -> int32 UE8M0 bytes; ValueError otherwise."""
    _check_dtype(x, torch.float32, name)
    bits = x.view(torch.int32)
    exact = (bits >= 0) & ((bits & _F32_MANT_MASK) == 0)
    smallest = bits == _UE8M0_ZERO_BYTE_BITS
    if not bool((exact | smallest).all()):
        raise ValueError(f"{name} must hold non-negative powers of two (UE8M0 values)")
    return torch.where(smallest, 0, bits >> _F32_MANT_BITS)


def pack_ue8m0_to_int(x: torch.Tensor) -> torch.Tensor:
    """Pack float32 power-of-two scales ``[..., 4w]`` into int32 ``[..., w]`` (4 UE8M0 bytes).

    Group ``g`` lands in byte ``g % 4`` (little-endian) of word ``g // 4``. ``+0.0`` packs to
    byte 0 as in DeepGEMM; ``2^-127`` (the value of byte 0) is accepted as well.
    """
    check_tensor("x", x, for_kernel=False)
    if x.dim() == 0 or x.size(-1) % 4 != 0:
        raise ValueError(f"x's last dim must be a multiple of 4, got shape {tuple(x.shape)}")
    return _pack_bytes(_float_to_ue8m0_bytes(x, "x"))


def unpack_ue8m0_from_int(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int32 ``[..., w]`` (4 UE8M0 bytes each) into float32 scales ``[..., 4w]``.

    Byte ``b`` decodes to ``2^(b - 127)``; byte 0 decodes to ``2^-127`` (float32 subnormal).
    """
    check_tensor("packed", packed, for_kernel=False)
    _check_dtype(packed, torch.int32, "packed")
    return _ue8m0_bytes_to_float(packed.contiguous().view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# FP8 (e4m3) casts
# ----------------------------------------------------------------------------------------------


def _split_groups(x: torch.Tensor, gran_k: int) -> torch.Tensor:
    """``[m, n]`` -> ``[m, ceil(n / gran_k), gran_k]`` in ``x.dtype``, zero padded."""
    m, n = x.shape
    padded_n = align(n, gran_k)
    if padded_n != n:
        padded = torch.zeros((m, padded_n), dtype=x.dtype, device=x.device)
        padded[:, :n] = x
        x = padded
    return x.reshape(m, padded_n // gran_k, gran_k)


def _reference_scale(amax: torch.Tensor, max_value: float, use_ue8m0: bool) -> torch.Tensor:
    """DeepGEMM's scale: ``amax`` floored at 1e-4, divided by ``max_value``, optionally ceiled."""
    sf = amax.clamp(min=AMAX_FLOOR) / max_value
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def _check_cast_args(x: torch.Tensor, gran_k: int) -> None:
    check_tensor("x", x, for_kernel=False)
    _check_dim(x, 2, "x")
    _check_floating(x, "x")
    _check_gran(gran_k, "gran_k")


def per_token_cast_to_fp8(
    x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [m, n]`` to e4m3 with one scale per row and ``gran_k`` columns.

    Returns ``(q e4m3 [m, n], sf)`` with ``sf`` float32 ``[m, ceil(n / gran_k)]``, or with
    ``use_packed_ue8m0`` int32 ``[m, ceil(ceil(n / gran_k) / 4)]`` (padded with 1.0 scales).
    ``x ~= q * sf`` (broadcast over each group).
    """
    _check_cast_args(x, gran_k)
    if use_packed_ue8m0 and not use_ue8m0:
        raise ValueError("use_packed_ue8m0=True requires use_ue8m0=True")
    m, n = x.shape
    groups = _split_groups(x, gran_k)
    sf = _reference_scale(groups.abs().float().amax(dim=2), FP8_E4M3_MAX, use_ue8m0)
    q = (groups * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn)
    q = q.reshape(m, groups.shape[1] * gran_k)[:, :n].contiguous()
    if use_packed_ue8m0:
        return q, _pack_bytes_padded(sf.view(torch.int32) >> _F32_MANT_BITS)
    return q, sf


def per_channel_cast_to_fp8(
    x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [m, n]`` to e4m3 with one scale per column and ``gran_k`` rows.

    Requires ``m % gran_k == 0``. Returns ``(q e4m3 [m, n], sf float32 [m / gran_k, n])``.
    """
    _check_cast_args(x, gran_k)
    m, n = x.shape
    if m % gran_k != 0:
        raise ValueError(f"x.shape[0] must be a multiple of gran_k={gran_k}, got {m}")
    groups = x.reshape(m // gran_k, gran_k, n)
    sf = _reference_scale(groups.abs().float().amax(dim=1), FP8_E4M3_MAX, use_ue8m0)
    q = (groups * (1.0 / sf.unsqueeze(1))).to(torch.float8_e4m3fn)
    return q.reshape(m, n), sf


def per_block_cast_to_fp8(
    x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [m, n]`` to e4m3 with one scale per ``gran_k x gran_k`` block.

    Returns ``(q e4m3 [m, n], sf float32 [ceil(m / gran_k), ceil(n / gran_k)])``.
    """
    _check_cast_args(x, gran_k)
    m, n = x.shape
    pm, pn = align(m, gran_k), align(n, gran_k)
    if (pm, pn) != (m, n):
        padded = torch.zeros((pm, pn), dtype=x.dtype, device=x.device)
        padded[:m, :n] = x
        x = padded
    blocks = x.reshape(pm // gran_k, gran_k, pn // gran_k, gran_k)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True)
    sf = _reference_scale(amax, FP8_E4M3_MAX, use_ue8m0)
    q = (blocks * (1.0 / sf)).to(torch.float8_e4m3fn).reshape(pm, pn)[:m, :n].contiguous()
    return q, sf.reshape(pm // gran_k, pn // gran_k)


# ----------------------------------------------------------------------------------------------
# FP4 (e2m1) casts
# ----------------------------------------------------------------------------------------------


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Map already-scaled values to 4-bit e2m1 codes (int8 in ``[0, 15]``, one per element).

    Strict ``>`` thresholds (ties go to the smaller magnitude), sign in bit 3, no ``-0``;
    NaN maps to code 0 and values beyond 5.0 to 6.0 (code 7), as in DeepGEMM.
    """
    check_tensor("x", x, for_kernel=False)
    magnitude = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold in E2M1_THRESHOLDS:
        code += (magnitude > threshold).to(torch.uint8)
    negative = (x < 0) & (code != 0)
    code |= negative.to(torch.uint8) << 3
    return code.view(torch.int8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes ``[..., n]`` (n even) two per byte: element ``2i`` in the low nibble."""
    check_tensor("codes", codes, for_kernel=False)
    if codes.dim() == 0 or codes.size(-1) % 2 != 0:
        raise ValueError(f"codes' last dim must be even, got shape {tuple(codes.shape)}")
    if codes.dtype in (torch.int8, torch.uint8):
        c = codes.view(torch.uint8)
    else:
        c = codes.to(torch.uint8)
    low, high = c[..., 0::2] & 0x0F, c[..., 1::2] & 0x0F
    return (low | (high << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int8 ``[..., n/2]`` (two e2m1 codes per byte) into int8 codes ``[..., n]``."""
    check_tensor("packed", packed, for_kernel=False)
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"packed must have dtype torch.int8 or torch.uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension")
    p = packed.view(torch.uint8)
    codes = torch.stack((p & 0x0F, p >> 4), dim=-1)
    return codes.reshape(*p.shape[:-1], 2 * p.shape[-1]).view(torch.int8)


def _check_fp4_groups(packed: torch.Tensor, name: str) -> torch.Tensor:
    check_tensor(name, packed, for_kernel=False)
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"{name} must have dtype torch.int8 or torch.uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.size(-1) % 16 != 0:
        raise ValueError(f"{name}'s last dim must be a multiple of 16 bytes (groups of 32 "
                         f"codes), got shape {tuple(packed.shape)}")
    return packed.view(torch.uint8)


# The sm_90a order of a 32-code group: word q (bytes 4q .. 4q + 3) holds codes 4q .. 4q + 3
# and 16 + 4q .. 16 + 4q + 3, the k-columns lane q of a quad holds in a register A fragment of
# an FP8 m64nNk32 WGMMA (chosen for a register-operand decode, since removed; the decode of
# `kernels/sm90_expert_gemm.py` writes the same codes to their columns at no cost)
SM90_GROUP_ORDER = [16 * h + 4 * q + i for q in range(4) for h in range(2) for i in range(4)]
_SM90_GROUP_ORDER_INV = [SM90_GROUP_ORDER.index(c) for c in range(32)]


def fp4_words_for_sm90_decode(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 codes (`pack_fp4`, int8 ``[..., n/2]``, ``n`` a multiple of 32) rearranged
    for the sm_90a decode (`kernels/common/fp4_decode.py`). Within each group of 32 codes, word
    ``q`` (bytes ``4q .. 4q + 3``) holds codes ``4q .. 4q + 3`` then ``16 + 4q .. 16 + 4q + 3``
    (`SM90_GROUP_ORDER`); within a word of those eight codes ``c0 .. c7``, byte ``j`` holds the
    magnitude (low 3 bits) of ``c(2j)`` in bits 0-2 and of ``c(2j+1)`` in bits 4-6, the sign of
    ``c(4+j)`` in bit 3 and of ``c(j)`` in bit 7. So the low 16 bits are the magnitude
    selectors of ``c0 .. c3``, the high 16 those of ``c4 .. c7``, and each code's sign already
    sits on the top bit of its e4m3 output byte (``c0 .. c3``: the word; ``c4 .. c7``: the word
    shifted left by 4). Same shape and dtype; `fp4_words_from_sm90_decode` inverts it."""
    b = _check_fp4_groups(packed, "packed")
    codes = unpack_fp4(b).view(torch.uint8)
    codes = codes.reshape(*b.shape[:-1], -1, 32)[..., SM90_GROUP_ORDER]
    codes = codes.reshape(*b.shape[:-1], -1, 8)
    mag, sign = codes & 0x7, (codes >> 3) & 0x1
    out = torch.empty(*codes.shape[:-1], 4, dtype=torch.uint8, device=b.device)
    for j in range(4):
        out[..., j] = (mag[..., 2 * j] | (sign[..., 4 + j] << 3) | (mag[..., 2 * j + 1] << 4)
                       | (sign[..., j] << 7))
    return out.reshape(packed.shape).view(packed.dtype)


def fp4_words_from_sm90_decode(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `fp4_words_for_sm90_decode`: plain `pack_fp4` order."""
    b = _check_fp4_groups(packed, "packed")
    w = b.reshape(*b.shape[:-1], -1, 4)
    codes = torch.empty(*w.shape[:-1], 8, dtype=torch.uint8, device=b.device)
    for c in range(8):
        byte = w[..., c // 2]
        mag = (byte >> (4 * (c % 2))) & 0x7
        sign = (w[..., c % 4] >> (7 if c < 4 else 3)) & 0x1
        codes[..., c] = mag | (sign << 3)
    codes = codes.reshape(*b.shape[:-1], -1, 32)[..., _SM90_GROUP_ORDER_INV]
    return pack_fp4(codes.reshape(*b.shape[:-1], -1)).reshape(packed.shape).view(packed.dtype)


def transpose_packed_fp4(a: torch.Tensor) -> torch.Tensor:
    """Transpose a packed e2m1 matrix: int8 ``[m, n/2]`` -> int8 ``[n, m/2]`` (``m`` even)."""
    check_tensor("a", a, for_kernel=False)
    _check_dtype(a, torch.int8, "a")
    _check_dim(a, 2, "a")
    if a.size(0) % 2 != 0:
        raise ValueError(f"a.shape[0] must be even, got {tuple(a.shape)}")
    return pack_fp4(unpack_fp4(a).t().contiguous()).contiguous()


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode e2m1 codes (low 4 bits of each element) to float32; code 8 (``-0``) gives +0.0."""
    check_tensor("codes", codes, for_kernel=False)
    table = torch.tensor(
        E2M1_VALUES + (0.0,) + tuple(-v for v in E2M1_VALUES[1:]),
        dtype=torch.float32,
        device=codes.device,
    )
    return table[codes.to(torch.int64) & 0x0F]


def per_token_cast_to_fp4(
    x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [m, n]`` (n even) to e2m1 with one scale per row and ``gran_k`` columns.

    Returns ``(packed int8 [m, n / 2], sf)``: two codes per byte (element ``2i`` in the low
    nibble); ``sf`` float32 ``[m, ceil(n / gran_k)]``, or with ``use_packed_ue8m0`` int32
    ``[m, ceil(ceil(n / gran_k) / 4)]`` with the last word padded by 1.0 scales.
    """
    _check_cast_args(x, gran_k)
    m, n = x.shape
    if n % 2 != 0:
        raise ValueError(f"x.shape[1] must be even for FP4 packing, got {n}")
    if use_packed_ue8m0 and not use_ue8m0:
        raise ValueError("use_packed_ue8m0=True requires use_ue8m0=True")
    groups = _split_groups(x, gran_k)
    sf = _reference_scale(groups.abs().float().amax(dim=2), FP4_E2M1_MAX, use_ue8m0)
    codes = quantize_e2m1(groups * (1.0 / sf.unsqueeze(2)))
    codes = codes.reshape(m, groups.shape[1] * gran_k)[:, :n]
    packed = pack_fp4(codes).contiguous()
    if use_packed_ue8m0:
        return packed, _pack_bytes_padded(sf.view(torch.int32) >> _F32_MANT_BITS)
    return packed, sf


# ----------------------------------------------------------------------------------------------
# Inverses (float32 results)
# ----------------------------------------------------------------------------------------------


def _column_scales(sf: torch.Tensor, n: int, gran_k: int, name: str) -> torch.Tensor:
    """Expand group scales ``[m, >= ceil(n / gran_k)]`` to one scale per column ``[m, n]``."""
    need = ceil_div(n, gran_k)
    if sf.dim() != 2 or sf.size(1) < need:
        raise ValueError(
            f"{name} must be 2-D with at least {need} scale columns, got {tuple(sf.shape)}"
        )
    return sf[:, torch.arange(n, device=sf.device) // gran_k]


def _token_scales(sf: torch.Tensor, m: int, use_packed_ue8m0: bool, name: str) -> torch.Tensor:
    check_tensor(name, sf, for_kernel=False)
    if use_packed_ue8m0:
        _check_dtype(sf, torch.int32, name)
        sf = unpack_ue8m0_from_int(sf)
    else:
        _check_floating(sf, name)
    if sf.dim() != 2 or sf.size(0) != m:
        raise ValueError(f"{name} must have shape [{m}, groups], got {tuple(sf.shape)}")
    return sf


def cast_back_from_fp8(
    x_fp8: torch.Tensor, sf: torch.Tensor, gran_k: int = 128, use_packed_ue8m0: bool = False
) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp8`: float32 ``q * sf`` per ``gran_k`` columns."""
    check_tensor("x_fp8", x_fp8, for_kernel=False)
    _check_dim(x_fp8, 2, "x_fp8")
    _check_gran(gran_k, "gran_k")
    m, n = x_fp8.shape
    sf = _token_scales(sf, m, use_packed_ue8m0, "sf")
    return x_fp8.float() * _column_scales(sf, n, gran_k, "sf")


def cast_back_from_fp4(
    packed: torch.Tensor, sf: torch.Tensor, gran_k: int = 128, use_packed_ue8m0: bool = False
) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp4`: float32 ``[m, 2 * packed.shape[1]]``."""
    check_tensor("packed", packed, for_kernel=False)
    _check_dim(packed, 2, "packed")
    _check_gran(gran_k, "gran_k")
    m, half_n = packed.shape
    sf = _token_scales(sf, m, use_packed_ue8m0, "sf")
    values = fp4_codes_to_float(unpack_fp4(packed))
    return values * _column_scales(sf, 2 * half_n, gran_k, "sf")


def cast_back_from_fp8_block(
    x_fp8: torch.Tensor, sf: torch.Tensor, gran_k: int = 128
) -> torch.Tensor:
    """Inverse of :func:`per_block_cast_to_fp8`: float32 ``[m, n]``."""
    check_tensor("x_fp8", x_fp8, for_kernel=False)
    _check_dim(x_fp8, 2, "x_fp8")
    check_tensor("sf", sf, for_kernel=False)
    _check_gran(gran_k, "gran_k")
    m, n = x_fp8.shape
    _check_shape(sf, (ceil_div(m, gran_k), ceil_div(n, gran_k)), "sf")
    rows = torch.arange(m, device=sf.device) // gran_k
    return x_fp8.float() * _column_scales(sf[rows], n, gran_k, "sf")


# ----------------------------------------------------------------------------------------------
# Epilogue re-quantizer (L1 output -> L2 input)
# ----------------------------------------------------------------------------------------------


def requant_fp8_pow2(
    h: torch.Tensor, gran_k: int, use_packed_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 re-quantization of the SwiGLU output, exactly as the fused kernel does it.

    Per row and group of ``gran_k`` columns: ``amax = max |h|`` (no floor),
    ``v = amax * float32(1/448)``, ``e = biased_exp(v) - 127 + [mantissa(v) != 0]``,
    ``q = e4m3_satfinite(h * 2^-e)`` with ``2^-e`` built from its exponent bits. ``h`` is
    converted to float32 first. Returns ``(q e4m3 [m, n], sf)`` with ``sf`` float32 ``2^e``
    ``[m, ceil(n / gran_k)]`` (``2^-127`` for an all-zero group), or with ``use_packed_ue8m0``
    the UE8M0 bytes ``e + 127`` packed four per int32 (padded with byte 127).
    """
    check_tensor("h", h, for_kernel=False)
    _check_dim(h, 2, "h")
    _check_floating(h, "h")
    _check_gran(gran_k, "gran_k")
    m, n = h.shape
    groups = _split_groups(h.float(), gran_k)
    amax = groups.abs().amax(dim=2)
    bits = (amax * _INV_FP8_E4M3_MAX_F32).view(torch.int32)
    exp = ((bits >> _F32_MANT_BITS) & _F32_EXP_MASK) - _F32_BIAS
    exp = exp + ((bits & _F32_MANT_MASK) != 0).to(torch.int32)
    sf_inv = ((_F32_BIAS - exp) << _F32_MANT_BITS).view(torch.float32)
    scaled = (groups * sf_inv.unsqueeze(2)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn).reshape(m, groups.shape[1] * gran_k)[:, :n].contiguous()
    byte = (exp + _F32_BIAS) & 0xFF
    if use_packed_ue8m0:
        return q, _pack_bytes_padded(byte)
    return q, _ue8m0_bytes_to_float(byte)


# ----------------------------------------------------------------------------------------------
# Weight layout transforms
# ----------------------------------------------------------------------------------------------


def _permute_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` with dim 1 gathered by ``index``, keeping ``t``'s strides (as ``empty_like``)."""
    return torch.empty_like(t).copy_(t.index_select(1, index))


def _check_interleavable(t: torch.Tensor, gran: int, name: str) -> None:
    check_tensor(name, t, for_kernel=False)
    _check_gran(gran, "gran")
    if t.dim() < 2 or t.size(1) % (2 * gran) != 0:
        raise ValueError(
            f"{name} must have dim 1 (= 2 * intermediate) divisible by {2 * gran}, "
            f"got shape {tuple(t.shape)}"
        )


def interleave_gate_up(t: torch.Tensor, gran: int = INTERLEAVE_GRAN) -> torch.Tensor:
    """Interleave ``[gate | up]`` rows (dim 1 of ``[E, 2I, ...]``) in blocks of ``gran``.

    New row ``p``: ``b, r = divmod(p, 2 * gran)``; it is ``gate[gran * b + r]`` if ``r < gran``
    else ``up[gran * b + r - gran]`` (``gate = t[:, :I]``, ``up = t[:, I:]``).
    """
    _check_interleavable(t, gran, "t")
    n = t.size(1)
    p = torch.arange(n, device=t.device)
    block, r = p // (2 * gran), p % (2 * gran)
    src = torch.where(r < gran, block * gran + r, n // 2 + block * gran + r - gran)
    return _permute_rows(t, src)


def deinterleave_gate_up(t: torch.Tensor, gran: int = INTERLEAVE_GRAN) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up`."""
    _check_interleavable(t, gran, "t")
    n = t.size(1)
    s = torch.arange(n, device=t.device)
    is_up = s >= n // 2
    local = torch.where(is_up, s - n // 2, s)
    src = (local // gran) * (2 * gran) + local % gran + is_up.to(s.dtype) * gran
    return _permute_rows(t, src)


def _check_utccp(sf: torch.Tensor, name: str) -> None:
    check_tensor(name, sf, for_kernel=False)
    _check_dtype(sf, torch.int32, name)
    _check_dim(sf, 3, name)
    if sf.size(1) % UTCCP_ROWS != 0:
        raise ValueError(
            f"{name}.shape[1] must be a multiple of {UTCCP_ROWS}, got shape {tuple(sf.shape)}"
        )


def transpose_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    """UTCCP 4x32 transpose of packed scales ``int32 [E, mn, k]`` (``mn % 128 == 0``).

    Within each group of 128 rows, new row ``4 * i + j`` holds old row ``32 * j + i``
    (``i < 32``, ``j < 4``).
    """
    _check_utccp(sf, "sf")
    p = torch.arange(sf.size(1), device=sf.device)
    local = p % UTCCP_ROWS
    src = p - local + 32 * (local % 4) + local // 4
    return _permute_rows(sf, src)


def untranspose_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`transpose_sf_for_utccp`."""
    _check_utccp(sf, "sf")
    s = torch.arange(sf.size(1), device=sf.device)
    local = s % UTCCP_ROWS
    src = s - local + 4 * (local % 32) + local // 32
    return _permute_rows(sf, src)


def weight_sf_for_sm100(sf: torch.Tensor) -> torch.Tensor:
    """The FP4 weight scales as the sm100 expert GEMM reads them: int32 ``[E, K/128, N]``.

    ``sf`` is the ``int32 [E, N, K/128]`` scale tensor that :func:`transform_weights_for_mega_moe`
    returns for ``arch="sm_100a"`` (rows already UTCCP-transposed, any strides). The result holds
    the same words, MN-major and contiguous (DeepGEMM's physical layout), so the 128 rows of one
    word form one 512-byte chunk the TMA can load as the block-scaled MMA's scale chunk.
    """
    _check_utccp(sf, "sf")
    return sf.transpose(1, 2).contiguous()


def _unpack_pair(obj: object, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(obj, tuple) or len(obj) != 2:
        raise TypeError(f"{name} must be a (weight, scale) tuple")
    w, sf = obj
    return (check_tensor(f"{name}[0]", w, for_kernel=False),
            check_tensor(f"{name}[1]", sf, for_kernel=False))


def _check_3d(t: torch.Tensor, name: str) -> tuple[int, int, int]:
    _check_dim(t, 3, name)
    return tuple(t.shape)


def _rows_from_block_sf(
    sf: torch.Tensor, num_experts: int, rows: int, cols: int, name: str
) -> torch.Tensor:
    """f32 FP8 weight scales, block ``[E, ceil(rows/128), c]`` or per-row ``[E, rows, c]``,
    returned per row ``[E, rows, c]`` (row ``r`` takes its 128-row block's scale)."""
    _check_dtype(sf, torch.float32, name)
    _check_dim(sf, 3, name)
    col_groups = ceil_div(cols, FP8_BLOCK)
    block_shape = (num_experts, ceil_div(rows, FP8_BLOCK), col_groups)
    if tuple(sf.shape) == (num_experts, rows, col_groups):
        return sf.contiguous()
    if tuple(sf.shape) != block_shape:
        raise ValueError(
            f"{name} must have shape {block_shape} (per block) or "
            f"{(num_experts, rows, col_groups)} (per row), got {tuple(sf.shape)}"
        )
    index = torch.arange(rows, device=sf.device) // FP8_BLOCK
    return sf.index_select(1, index).contiguous()


def _transform_fp4(l1: object, l2: object, arch: str) -> tuple[WeightPair, WeightPair]:
    w1, sf1 = _unpack_pair(l1, "l1_weights")
    w2, sf2 = _unpack_pair(l2, "l2_weights")
    for t, name in ((w1, "l1_weights[0]"), (w2, "l2_weights[0]")):
        _check_dtype(t, torch.int8, name)
    for t, name in ((sf1, "l1_weights[1]"), (sf2, "l2_weights[1]")):
        _check_dtype(t, torch.int32, name)
    num_experts, n1, half_hidden = _check_3d(w1, "l1_weights[0]")
    hidden, inter = 2 * half_hidden, n1 // 2
    _check_interleavable(w1, INTERLEAVE_GRAN, "l1_weights[0]")
    _check_shape(sf1, (num_experts, n1, ceil_div(hidden, 4 * 32)), "l1_weights[1]")
    _check_shape(w2, (num_experts, hidden, inter // 2), "l2_weights[0]")
    _check_shape(sf2, (num_experts, hidden, ceil_div(inter, 4 * 32)), "l2_weights[1]")
    if arch == "sm_100a":
        for t, name in ((sf1, "l1_weights[1]"), (sf2, "l2_weights[1]")):
            _check_utccp(t, name)
    l1_sf, l2_sf = interleave_gate_up(sf1), sf2
    if arch == "sm_100a":
        l1_sf, l2_sf = transpose_sf_for_utccp(l1_sf), transpose_sf_for_utccp(sf2)
    return (interleave_gate_up(w1), l1_sf), (w2, l2_sf)


def _transform_fp8(l1: object, l2: object) -> tuple[WeightPair, WeightPair]:
    w1, sf1 = _unpack_pair(l1, "l1_weights")
    w2, sf2 = _unpack_pair(l2, "l2_weights")
    for t, name in ((w1, "l1_weights[0]"), (w2, "l2_weights[0]")):
        _check_dtype(t, torch.float8_e4m3fn, name)
    num_experts, n1, hidden = _check_3d(w1, "l1_weights[0]")
    _check_interleavable(w1, INTERLEAVE_GRAN, "l1_weights[0]")
    _check_shape(w2, (num_experts, hidden, n1 // 2), "l2_weights[0]")
    l1_sf = _rows_from_block_sf(sf1, num_experts, n1, hidden, "l1_weights[1]")
    l2_sf = _rows_from_block_sf(sf2, num_experts, hidden, n1 // 2, "l2_weights[1]")
    return (interleave_gate_up(w1), interleave_gate_up(l1_sf)), (w2, l2_sf)


def _transform_bf16(l1: torch.Tensor, l2: object) -> tuple[WeightPair, WeightPair]:
    check_tensor("l2_weights", l2, for_kernel=False)
    _check_dtype(l1, torch.bfloat16, "l1_weights")
    _check_dtype(l2, torch.bfloat16, "l2_weights")
    num_experts, n1, hidden = _check_3d(l1, "l1_weights")
    _check_interleavable(l1, INTERLEAVE_GRAN, "l1_weights")
    _check_shape(l2, (num_experts, hidden, n1 // 2), "l2_weights")
    return interleave_gate_up(l1), l2


def transform_weights_for_mega_moe(
    l1_weights: WeightPair,
    l2_weights: WeightPair,
    activation: str = "swiglu",
    arch: str = "sm_100a",
    *,
    chunk_experts: int | None = None,
) -> tuple[WeightPair, WeightPair]:
    """Put expert weights into the layout the Mega-MoE kernels read (done once at load time).

    Inputs (E experts, hidden H, intermediate I; L1 rows are ``[gate | up]``):

    * FP8xFP4: ``((w1 int8 [E, 2I, H/2], sf1 int32 [E, 2I, ceil(H/128)]),
      (w2 int8 [E, H, I/2], sf2 int32 [E, H, ceil(I/128)]))`` (packed UE8M0 per 32).
      L1 weight and scales are gate/up interleaved; on sm100 both scale tensors then get the
      UTCCP transpose (needs ``2I % 128 == 0`` and ``H % 128 == 0``). L2 weight unchanged.
    * FP8xFP8: ``((w1 e4m3 [E, 2I, H], sf1 f32 [E, ceil(2I/128), ceil(H/128)]),
      (w2 e4m3 [E, H, I], sf2 f32 [E, ceil(H/128), ceil(I/128)]))`` (per-row scales
      ``[E, rows, ...]`` are accepted too). Scales are expanded to one row per weight row, then
      L1 weight and scales are interleaved (a 128-row block of the interleaved weight mixes
      gate and up rows of different blocks). Same on both arches: no UTCCP for f32 scales.
    * BF16xBF16: plain bf16 tensors ``[E, 2I, H]`` and ``[E, H, I]``; L1 interleaved.

    Returns ``(l1_transformed, l2_transformed)`` with the same structure as the inputs.
    ``arch`` (any spelling `tables.normalize_arch` takes) only changes the FP4 scales; the
    default is DeepGEMM's layout, the one `cute_megamoe.fp8_fp4_mega_moe` consumes on every GPU.

    Runs ``chunk_experts`` experts at a time into outputs allocated once (`chunks`; default:
    as many as keep the temporaries within a quarter of the output plus 1.5 GiB); the result
    (values, dtypes, shapes and strides) does not depend on it.
    """
    if activation != "swiglu":
        raise ValueError(f"activation must be 'swiglu', got {activation!r}")
    arch = normalize_arch(arch)
    sources = [t for pair in (l1_weights, l2_weights)
               for t in (pair if isinstance(pair, tuple) else (pair,))]
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in sources):
        return _transform_weights(l1_weights, l2_weights, arch)  # (its checks name them)
    num_experts = sources[0].shape[0]
    size = sum(t.numel() * t.element_size() for t in sources)
    chunk = chunk_experts_for(num_experts, TRANSFORM_PEAK_FACTOR * size // max(num_experts, 1),
                              size, chunk_experts)
    return map_experts(lambda l1, l2: _transform_weights(l1, l2, arch),
                       (l1_weights, l2_weights), chunk)


#: Peak temporaries of transforming one expert (`transform_weights_for_mega_moe`) in a chunk, as
#: a multiple of its input bytes, the chunk's result included (`chunks`; measured with
#: `testing.memory`: 0.7 plus the result; rounded up).
TRANSFORM_PEAK_FACTOR = 3


def _transform_weights(l1_weights: WeightPair, l2_weights: WeightPair,
                       arch: str) -> tuple[WeightPair, WeightPair]:
    """`transform_weights_for_mega_moe` of all experts at once (``arch`` normalized)."""
    if isinstance(l1_weights, torch.Tensor):
        return _transform_bf16(l1_weights, l2_weights)
    w1, _ = _unpack_pair(l1_weights, "l1_weights")
    if w1.dtype == torch.float8_e4m3fn:
        return _transform_fp8(l1_weights, l2_weights)
    if w1.dtype == torch.int8:
        return _transform_fp4(l1_weights, l2_weights, arch)
    raise TypeError(
        f"l1_weights[0] must have dtype torch.int8 (FP4) or torch.float8_e4m3fn (FP8), "
        f"got {w1.dtype}"
    )


# ----------------------------------------------------------------------------------------------
# Recipe helpers
# ----------------------------------------------------------------------------------------------


#: Peak temporaries of quantizing one expert (`quantize_weights_for_recipe`) in a chunk, in
#: bytes per weight element, its result included (`chunks`; measured with `testing.memory`
#: for BF16 and float32 weights and rounded up: fp8xfp8 5 / 8, MXFP4 11.6 / 15.6, plus the
#: chunk's result).
QUANTIZE_PEAK_BYTES = {"fp8xfp8": 10, "fp8xfp4": 18, "fp8xfp4_sm90": 18, "bf16xbf16": 4}


def quantized_weight_bytes(shape: tuple[int, ...], recipe: str) -> int:
    """Bytes of `quantize_weights_for_recipe`'s output for weights of ``shape`` ``[E, N, K]``."""
    num_experts, n, k = shape
    if recipe == "bf16xbf16":
        return 2 * num_experts * n * k
    if recipe in ("fp8xfp4", "fp8xfp4_sm90"):
        return num_experts * n * (k // 2 + 4 * ceil_div(k, 4 * 32))
    return num_experts * (n * k + 4 * ceil_div(n, FP8_BLOCK) * ceil_div(k, FP8_BLOCK))


def quantize_weights_for_recipe(w: torch.Tensor, recipe: str, *,
                                chunk_experts: int | None = None) -> WeightPair:
    """Quantize expert weights ``w [E, N, K]`` (bf16) for ``recipe`` (before the transform).

    * ``'fp8xfp4'``, ``'fp8xfp4_sm90'``: per row, e2m1 with UE8M0 scale per 32 ->
      ``(int8 [E, N, K/2], int32 [E, N, ceil(K/128)])``
      (``per_token_cast_to_fp4(ue8m0, 32, packed)``).
    * ``'fp8xfp8'``: e4m3 with an f32 scale per 128x128 block -> ``(e4m3 [E, N, K],
      f32 [E, ceil(N/128), ceil(K/128)])`` (``per_block_cast_to_fp8(use_ue8m0=False)``; these
      raw scales depend on the device in the last bit, see the module docstring).
    * ``'bf16xbf16'``: ``w`` as bf16.

    Runs ``chunk_experts`` experts at a time into outputs allocated once (`chunks`; default:
    as many as keep the temporaries within a quarter of the output plus 1.5 GiB); the result
    does not depend on it.
    """
    check_recipe(recipe)
    check_tensor("w", w, for_kernel=False)
    _check_dim(w, 3, "w")
    _check_floating(w, "w")
    if recipe == "bf16xbf16" and w.dtype == torch.bfloat16:
        return w
    chunk = chunk_experts_for(w.shape[0], QUANTIZE_PEAK_BYTES[recipe] * w[0].numel(),
                              quantized_weight_bytes(tuple(w.shape), recipe), chunk_experts)
    return map_experts(lambda part: _quantize_weights(part, recipe), (w,), chunk)


def _quantize_weights(w: torch.Tensor, recipe: str) -> WeightPair:
    """`quantize_weights_for_recipe` of all of ``w``'s experts at once."""
    num_experts, n, k = w.shape
    if recipe == "bf16xbf16":
        return w.to(torch.bfloat16)
    if recipe in ("fp8xfp4", "fp8xfp4_sm90"):
        packed, sf = per_token_cast_to_fp4(
            w.reshape(num_experts * n, k), use_ue8m0=True, gran_k=32, use_packed_ue8m0=True
        )
        return packed.view(num_experts, n, -1), sf.view(num_experts, n, -1)
    if n % FP8_BLOCK == 0:
        q, sf = per_block_cast_to_fp8(w.reshape(num_experts * n, k), use_ue8m0=False)
        return q.view(num_experts, n, k), sf.view(num_experts, n // FP8_BLOCK, -1)
    pairs = [per_block_cast_to_fp8(w[e], use_ue8m0=False) for e in range(num_experts)]
    return torch.stack([q for q, _ in pairs]), torch.stack([sf for _, sf in pairs])


def dequantize_weights_for_recipe(q: WeightPair, recipe: str) -> torch.Tensor:
    """Float32 ``[E, N, K]`` from :func:`quantize_weights_for_recipe` output.

    ``'fp8xfp4'`` takes int32 packed or float32 ``[E, N, ceil(K/32)]`` scales; ``'fp8xfp8'``
    takes block ``[E, ceil(N/128), ceil(K/128)]`` or per-row ``[E, N, ceil(K/128)]`` scales.
    ``'fp8xfp4_sm90'`` takes ``'fp8xfp4'``'s pair and returns what the Hopper kernels compute
    with: the e4m3 blocks of :func:`fp4_weights_to_fp8_blocks` times their block scales (the
    FP4 weights exactly, but for groups more than 14 binades below their block's largest).
    """
    check_recipe(recipe)
    if recipe == "bf16xbf16":
        check_tensor("q", q, for_kernel=False)
        return q.float()
    if recipe == "fp8xfp4_sm90":
        return dequantize_weights_for_recipe(fp4_weights_to_fp8_blocks(q), "fp8xfp8")
    w, sf = _unpack_pair(q, "q")
    num_experts, n, k_stored = _check_3d(w, "q[0]")
    _check_dim(sf, 3, "q[1]")
    if recipe == "fp8xfp4":
        _check_dtype(w, torch.int8, "q[0]")
        if tuple(sf.shape[:2]) != (num_experts, n):
            raise ValueError(
                f"q[1] must have shape [{num_experts}, {n}, groups], got {tuple(sf.shape)}"
            )
        packed_sf = sf.dtype == torch.int32
        out = cast_back_from_fp4(
            w.reshape(num_experts * n, k_stored),
            sf.reshape(num_experts * n, -1),
            gran_k=32,
            use_packed_ue8m0=packed_sf,
        )
        return out.view(num_experts, n, 2 * k_stored)
    _check_dtype(w, torch.float8_e4m3fn, "q[0]")
    rows = _rows_from_block_sf(sf, num_experts, n, k_stored, "q[1]")
    out = cast_back_from_fp8(
        w.reshape(num_experts * n, k_stored), rows.reshape(num_experts * n, -1), FP8_BLOCK
    )
    return out.view(num_experts, n, k_stored)


#: The largest power of two an e2m1 value times 2**d may carry and still fit e4m3 (6 * 2**6 =
#: 384 <= 448), and how many binades below it e4m3 still holds every e2m1 value exactly (down to
#: 0.5 * 2**-8 = 2**-9, the smallest e4m3 subnormal).
FP4_IN_FP8_TOP = 6
FP4_IN_FP8_EXACT_BINADES = 14
#: The smallest block-scale exponent: 2**-126 is float32's smallest normal (the Hopper kernel
#: reads the exponent back from the scale's exponent bits).
FP4_BLOCK_MIN_EXP = -126


def _fp4_exponents(sf: torch.Tensor, num_experts: int, n: int, k: int,
                   name: str) -> torch.Tensor:
    """The exponents ``s`` (int32 ``[E, N, K/32]``) of MXFP4 scales, int32-packed or float
    ``[E, N, >= K/32]``; ValueError unless every scale is a power of two."""
    _check_dim(sf, 3, name)
    if sf.dtype == torch.int32:
        sf = unpack_ue8m0_from_int(sf.reshape(num_experts * n, -1)).view(num_experts, n, -1)
    else:
        _check_floating(sf, name)
    if tuple(sf.shape[:2]) != (num_experts, n) or sf.shape[2] < k // 32:
        raise ValueError(f"{name}: expected [{num_experts}, {n}, >= {k // 32}] scales, got "
                         f"{tuple(sf.shape)}")
    sf = sf[..., : k // 32].float()
    exponent = torch.frexp(sf).exponent - 1  # sf = 2**exponent (UE8M0: powers of two)
    if not torch.equal(torch.ldexp(torch.ones_like(sf), exponent), sf):
        raise ValueError(f"{name}: scales must be powers of two (UE8M0)")
    return exponent


def _fp4_block_exponents(exponent: torch.Tensor) -> torch.Tensor:
    """``b = max(max(s) - FP4_IN_FP8_TOP, FP4_BLOCK_MIN_EXP)`` per 128 x 128 block
    (``[E, ceil(N/128), ceil(K/128)]``) of per-32 scale exponents ``s`` ``[E, N, K/32]``."""
    num_experts, n, groups = exponent.shape
    per_block = FP8_BLOCK // 32
    nb, kb = ceil_div(n, FP8_BLOCK), ceil_div(groups, per_block)
    padded = torch.full((num_experts, nb * FP8_BLOCK, kb * per_block), -(2**30),
                        dtype=exponent.dtype, device=exponent.device)
    padded[:, :n, :groups] = exponent
    top = padded.view(num_experts, nb, FP8_BLOCK, kb, per_block).amax(dim=(2, 4))
    return (top - FP4_IN_FP8_TOP).clamp_min(FP4_BLOCK_MIN_EXP)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.int32))


def fp4_block_scales(sf: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """The f32 block scales ``2**b`` (``[E, ceil(N/128), ceil(K/128)]``) that
    :func:`fp4_weights_to_fp8_blocks` gives MXFP4 weights with the scales ``sf``: UE8M0 per
    32, int32-packed ``[E, N, ceil(K/128)]`` or float ``[E, N, >= K/32]``. ``k``: the weights'
    K, a multiple of 32 (default: 32 per scale, 128 per packed word), so that pad scales do not
    count."""
    check_tensor("sf", sf, for_kernel=False)
    _check_dim(sf, 3, "sf")
    num_experts, n, width = sf.shape
    if k is None:
        k = width * (FP8_BLOCK if sf.dtype == torch.int32 else 32)
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % 32 != 0:
        raise ValueError(f"k: expected a positive multiple of 32, got {k!r}")
    return _pow2(_fp4_block_exponents(_fp4_exponents(sf, num_experts, n, k, "sf")))


def fp4_weights_to_fp8_blocks(q: WeightPair) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights (``quantize_weights_for_recipe(w, "fp8xfp4")``: e2m1 ``int8 [E, N, K/2]``
    and UE8M0 scales per 32, int32-packed or float ``[E, N, K/32]``) as e4m3 with a power-of-two
    f32 scale per 128 x 128 block, the ``fp8xfp8`` weight format (``(e4m3 [E, N, K],
    f32 [E, ceil(N/128), ceil(K/128)])``): what a Hopper kernel that keeps FP4 weights in HBM
    decodes on chip before its FP8 WGMMAs (issue 19; recipe ``fp8xfp4_sm90``).

    A block's scale is ``2**b`` with ``b = max(max(s) - FP4_IN_FP8_TOP, -126)`` over its
    per-32 scale exponents ``s``: the clamp keeps ``2**b`` a normal float32, whose exponent
    bits the kernel reads back (:func:`fp4_block_scales` gives the same scales). An element
    becomes ``e4m3(e2m1 * 2**(s - b))`` (round to nearest even). Exact, so that the blocks
    dequantize to exactly the FP4 weights, when every nonzero element has ``s >= b - 8``:
    ``s >= max(s) - FP4_IN_FP8_EXACT_BINADES``, and always in a clamped block (``b - 8 = -134``
    is below the smallest UE8M0 scale, so the clamp costs no bits); an element of a group more
    than 14 binades below its block's largest is rounded to e4m3's subnormal grid
    (``2**(b - 9)``), possibly to zero. Never saturates (at most 384).
    """
    w, sf = _unpack_pair(q, "q")
    num_experts, n, half_k = _check_3d(w, "q[0]")
    _check_dtype(w, torch.int8, "q[0]")
    k = 2 * half_k
    if k % 32 != 0:
        raise ValueError(f"q[0]: K = {k} must be a multiple of 32")
    exponent = _fp4_exponents(sf, num_experts, n, k, "q[1]")
    base = _fp4_block_exponents(exponent)  # [E, nb, kb]
    # per element: 2**(s - b) as float32 (exact), times the e2m1 value (exact), then e4m3
    rows = torch.arange(n, device=w.device) // FP8_BLOCK
    cols = torch.arange(k // 32, device=w.device) // (FP8_BLOCK // 32)
    shift = exponent - base[:, rows][:, :, cols]
    values = fp4_codes_to_float(unpack_fp4(w)).view(num_experts, n, k // 32, 32)
    scaled = torch.ldexp(values, shift.unsqueeze(-1).to(torch.int32))
    w_fp8 = scaled.view(num_experts, n, k).to(torch.float8_e4m3fn)
    return w_fp8, _pow2(base)


def quantize_activations_for_recipe(x: torch.Tensor, recipe: str) -> WeightPair:
    """Quantize tokens ``x [m, H]`` for ``recipe``.

    * ``'fp8xfp4'``: e4m3 with UE8M0 scale per 32, packed -> ``(e4m3 [m, H],
      int32 [m, ceil(H/128)])``.
    * ``'fp8xfp8'``, ``'fp8xfp4_sm90'``: e4m3 with a power-of-two f32 scale per 128 ->
      ``(e4m3 [m, H], f32 [m, ceil(H/128)])``.
    * ``'bf16xbf16'``: ``x`` as bf16.
    """
    recipe = activation_recipe(check_recipe(recipe))
    check_tensor("x", x, for_kernel=False)
    _check_dim(x, 2, "x")
    if recipe == "bf16xbf16":
        return x.to(torch.bfloat16)
    if recipe == "fp8xfp4":
        return per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
    return per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=FP8_BLOCK)


def dequantize_activations_for_recipe(q: WeightPair, recipe: str) -> torch.Tensor:
    """Float32 ``[m, H]`` from :func:`quantize_activations_for_recipe` output."""
    recipe = activation_recipe(check_recipe(recipe))
    if recipe == "bf16xbf16":
        check_tensor("q", q, for_kernel=False)
        return q.float()
    x, sf = _unpack_pair(q, "q")
    gran_k = 32 if recipe == "fp8xfp4" else FP8_BLOCK
    return cast_back_from_fp8(x, sf, gran_k, use_packed_ue8m0=sf.dtype == torch.int32)
