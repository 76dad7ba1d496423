"""Device-side scale arithmetic, bit-exact with `cute_megamoe.quant`.

All scales in this project are powers of two stored as UE8M0 bytes (the float32 exponent
field) or as float32 values with a zero mantissa, so the scale math is integer work on the
float32 bit pattern:

* `ceil_ue8m0_biased_exponent(v)`: the biased exponent of the smallest power of two >= v,
  clamped to [1, 254] (DeepGEMM's `ceil_to_ue8m0`, `deep_gemm/utils/math.py`).
* `float_from_biased_exponent(e)`: 2^(e - 127) built from its bits.
* `requant_exponent(amax)`: the power-of-two exponent of the GEMM epilogue's FP8 requantizer.
* `clamped_silu_mul(g, u, ...)`: the SwiGLU of the L1 epilogue (clamp, fast or IEEE SiLU).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cutlass.dsl_user_op
def ceil_ue8m0_biased_exponent(value: Float32, *, loc=None, ip=None) -> Int32:
    """Biased exponent of the power of two that rounds `value` (> 0) up, clamped to [1, 254]."""
    bits = Float32(value).bitcast(Int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    # (mantissa + 0x7FFFFF) >> 23 is 1 exactly when the mantissa is non-zero
    exponent = exponent + ((mantissa + 0x7FFFFF) >> 23)
    return cutlass.max(cutlass.min(exponent, Int32(254)), Int32(1))


@cutlass.dsl_user_op
def float_from_biased_exponent(exponent: Int32, *, loc=None, ip=None) -> Float32:
    """2^(exponent - 127) for a biased exponent in [1, 254]."""
    return (Int32(exponent) << 23).bitcast(Float32)


LOG2_E = 1.4426950408889634
FP8_E4M3_MAX = 448.0


@cute.jit
def clamped_silu_mul(g: Float32, u: Float32, clamp: cutlass.Constexpr,
                     fast_math: cutlass.Constexpr) -> Float32:
    """``silu(g) * u`` after the clamp (``g <= c``, ``-c <= u <= c``; none when ``clamp`` is
    None): fast = ex2.approx and rcp.approx, else IEEE division and an accurate exp."""
    if cutlass.const_expr(clamp is not None):
        g = cutlass.min(g, Float32(clamp))
        u = cutlass.max(cutlass.min(u, Float32(clamp)), Float32(-clamp))
    silu = g
    if cutlass.const_expr(fast_math):
        silu = g * cute.arch.rcp_approx(1.0 + cute.arch.exp2(g * (-LOG2_E)))
    else:
        silu = g / (1.0 + cute.math.exp(-g))
    return silu * u


@cutlass.dsl_user_op
def requant_exponent(amax: Float32, *, loc=None, ip=None) -> Int32:
    """``e`` of the epilogue re-quantizer (`quant.requant_fp8_pow2`): the unbiased exponent of
    ``amax * float32(1/448)`` rounded up to a power of two (-127 for ``amax = 0``); the scale
    is ``2^e`` (UE8M0 byte ``e + 127``) and values are multiplied by ``2^-e``."""
    bits = (Float32(amax) * Float32(1.0 / FP8_E4M3_MAX)).bitcast(Int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(Int32)
