"""Device-side scale arithmetic, bit-exact with `cute_megamoe.quant`.

All scales in this project are powers of two stored as UE8M0 bytes (the float32 exponent
field) or as float32 values with a zero mantissa, so the scale math is integer work on the
float32 bit pattern:

* `ceil_ue8m0_biased_exponent(v)`: the biased exponent of the smallest power of two >= v,
  clamped to [1, 254] (DeepGEMM's `ceil_to_ue8m0`, `deep_gemm/utils/math.py`).
* `float_from_biased_exponent(e)`: 2^(e - 127) built from its bits.
"""

import cutlass
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
