"""MXFP4 (e2m1 + UE8M0 per 32) weights decoded to e4m3 on chip, for FP8 tensor cores that have
no FP4 MMA (Hopper). Bit-exact with `quant.fp4_weights_to_fp8_blocks`.

An element ``v`` of a 32-group with scale ``2**s`` inside a 128x128 block with base ``2**b``
becomes ``e4m3(v * 2**d)``, ``d = s - b <= 6``; the block's scale ``2**b`` goes into the
GEMM's per-128 promotion. Per group the eight e4m3 bytes of the magnitudes ``{0, 0.5, 1, 1.5,
2, 3, 4, 6} * 2**d`` form a lookup table of two words, and each word of eight packed codes
becomes eight e4m3 bytes through byte permutes:

* magnitudes: ``prmt(lut_lo, lut_hi, codes & 0x77777777)`` takes the low three bits of four
  codes as byte selectors (a selector is the low 16 bits: codes 0-3 of the word; codes 4-7
  through the upper half, taken by ``mul.hi`` on the FMA pipe: the decode is bound by the ALU
  pipe, where shifts, permutes and logic ops go);
* signs: a selector nibble with bit 3 set makes ``prmt`` replicate the sign bit of the byte it
  selects; bit 3 of code ``2i`` is the top bit of byte ``i`` of ``codes << 4``, of code
  ``2i + 1`` the top bit of byte ``i`` of ``codes``, so one ``prmt`` over the pair gives 0xFF
  or 0x00 per output byte, masked to 0x80 and or-ed in. A negative zero code (0x8, which the
  quantizer never writes) becomes e4m3 -0 (the host decode gives +0; the products agree).

The table for ``-5 <= d <= 6`` (every value normal in e4m3) is two integer adds: the e4m3 byte
of ``m * 2**d`` is that of ``m`` with ``d`` added to the exponent field, and no byte carries
into the next. Below that (a group more than 11 binades under its block's largest) the seven
values are built in float32 and rounded by ``cvt.rn.satfinite.e4m3x2`` (round to nearest even
as the host decode; they underflow to zero from about ``d < -12``).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# e4m3 bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5 (word 0) and 2, 3, 4, 6 (word 1), d = 0
LUT_LO, LUT_HI = 0x3C383000, 0x4C484440
# what d adds to each byte (exponent field, bits 3-6); byte 0 of the low word (zero) stays 0
LUT_STEP_LO, LUT_STEP_HI = 0x08080800, 0x08080808
FAST_MIN_SHIFT = -5  # the smallest d whose table the adds give (0.5 * 2**-5 = 2**-6, normal)
MIN_SHIFT = -40  # d below this rounds every value to zero: clamp (keeps 2**d a normal float)
SIGN_SEL_LO, SIGN_SEL_HI = 0xD9C8, 0xFBEA  # sign-replicating selectors of codes 0-3 / 4-7


def _asm_i32(asm: str, constraints: str, *args, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip) for a in args],
                                 asm, constraints, has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def prmt(lo: Int32, hi: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: bytes of the pair ``(hi, lo)`` picked by the selector's four nibbles."""
    return _asm_i32("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", lo, hi, selector, loc=loc, ip=ip)


@dsl_user_op
def upper_half(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x >> 16`` (logical) as ``mul.hi.u32 x, 2**16``: an IMAD on the FMA pipe, not a shift on
    the ALU pipe."""
    return _asm_i32("mul.hi.u32 $0, $1, 65536;", "=r,r", x, loc=loc, ip=ip)


@dsl_user_op
def cvt_e4m3x4(v0: Float32, v1: Float32, v2: Float32, v3: Float32, *, loc=None,
               ip=None) -> Int32:
    """Four float32 values rounded to e4m3 (nearest even, saturating), ``v0`` in byte 0."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)]
    return Int32(llvm.inline_asm(
        T.i32(), args,
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def e2m1_table(shift: Int32):
    """The e4m3 bytes of the eight e2m1 magnitudes times ``2**shift`` (``shift <= 6``), as
    ``(codes 0-3, codes 4-7)``."""
    lo = Int32(LUT_LO) + shift * Int32(LUT_STEP_LO)
    hi = Int32(LUT_HI) + shift * Int32(LUT_STEP_HI)
    if shift < FAST_MIN_SHIFT:
        scale = ((cutlass.max(shift, Int32(MIN_SHIFT)) + 127) << 23).bitcast(Float32)
        lo = cvt_e4m3x4(Float32(0.0), scale * 0.5, scale, scale * 1.5)
        hi = cvt_e4m3x4(scale * 2.0, scale * 3.0, scale * 4.0, scale * 6.0)
    return lo, hi


@cute.jit
def decode_e2m1_word(codes: Int32, lut_lo: Int32, lut_hi: Int32):
    """Eight packed e2m1 codes (code ``i`` in bits ``4i..4i+3``) -> eight e4m3 bytes as
    ``(elements 0-3, elements 4-7)``, through the table of `e2m1_table`."""
    shifted = codes << 4
    selectors = codes & Int32(0x77777777)
    mag_lo = prmt(lut_lo, lut_hi, selectors)
    mag_hi = prmt(lut_lo, lut_hi, upper_half(selectors))
    sign_lo = prmt(shifted, codes, Int32(SIGN_SEL_LO))
    sign_hi = prmt(shifted, codes, Int32(SIGN_SEL_HI))
    return mag_lo | (sign_lo & Int32(0x80808080 - 2**32)), \
        mag_hi | (sign_hi & Int32(0x80808080 - 2**32))
