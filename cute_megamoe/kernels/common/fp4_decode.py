"""MXFP4 (e2m1 + UE8M0 per 32) weights decoded to e4m3 on chip, for FP8 tensor cores that have
no FP4 MMA (Hopper). Bit-exact with `quant.fp4_weights_to_fp8_blocks`.

An element ``v`` of a 32-group with scale ``2**s`` inside a 128x128 block with base ``2**b``
becomes ``e4m3(v * 2**d)``, ``d = s - b <= 6``; the block's scale ``2**b`` goes into the
GEMM's per-128 promotion. Per group the eight e4m3 bytes of the magnitudes ``{0, 0.5, 1, 1.5,
2, 3, 4, 6} * 2**d`` form a lookup table of two words, and each word of eight packed codes
becomes eight e4m3 bytes through byte permutes. The weights keep their codes in the sm_90a word
order (`quant.fp4_words_for_sm90_decode`, applied when `ExpertWeights` are made): word ``q`` of
a 32-code group holds the codes of columns ``4q .. 4q + 3`` and ``16 + 4q .. 16 + 4q + 3`` (what
lane ``q`` of a quad holds of an FP8 WGMMA's register A fragment), and in a word of codes
``c0 .. c7`` the low 16 bits hold the magnitudes (low three bits) of ``c0 .. c3`` as
nibbles, the high 16 bits those of ``c4 .. c7``, and each code's sign bit sits where its output
byte's sign goes, ``c0 .. c3`` at bits 7, 15, 23, 31 of the word and ``c4 .. c7`` at bits 3,
11, 19, 27 (bits 7, 15, 23, 31 of the word shifted left by 4). Per word:

* magnitudes: ``prmt(lut_lo, lut_hi, word & 0x77777777)`` takes the low 16 bits as four byte
  selectors (``c0 .. c3``); the high half, taken by ``mul.hi`` on the FMA pipe, gives
  ``c4 .. c7`` (the decode is bound by the ALU pipe, where permutes, logic ops and shifts go);
* signs: or-ed in from ``word & 0x80808080`` and ``(word << 4) & 0x80808080`` (one logic op
  each; the shift is an integer multiply, FMA pipe). A negative zero code (0x8, which the
  quantizer never writes) becomes e4m3 -0 (the host decode gives +0; the products agree).

Five ALU-pipe instructions per eight codes (the plain nibble order needed nine: two more
permutes to move the signs).

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
def vote_tables(shifts: list):
    """The tables of `e2m1_table` for a list of shifts, as one register tensor ``(lo, hi)`` per
    shift: the two integer adds for all, and the float path for all of them behind one warp vote
    when any lane's shift is under `FAST_MIN_SHIFT` (rare: a group more than 5 binades under its
    block; the branch is uniform, so a decode loop has no branch per table)."""
    tables = cute.make_rmem_tensor(2 * len(shifts), Int32)
    lowest = shifts[0]
    for t in cutlass.range_constexpr(len(shifts)):
        tables[2 * t] = Int32(LUT_LO) + shifts[t] * Int32(LUT_STEP_LO)
        tables[2 * t + 1] = Int32(LUT_HI) + shifts[t] * Int32(LUT_STEP_HI)
        lowest = cutlass.min(lowest, shifts[t])
    if cute.arch.vote_any_sync(lowest < FAST_MIN_SHIFT):
        for t in cutlass.range_constexpr(len(shifts)):
            tables[2 * t], tables[2 * t + 1] = e2m1_table(shifts[t])
    return tables


@cute.jit
def decode_e2m1_word(word: Int32, lut_lo: Int32, lut_hi: Int32):
    """Eight e2m1 codes in the sm_90a word order (see the module doc) -> eight e4m3 bytes as
    ``(elements 0-3, elements 4-7)``, through the table of `e2m1_table`."""
    selectors = word & Int32(0x77777777)
    signs = Int32(0x80808080 - 2**32)
    return prmt(lut_lo, lut_hi, selectors) | (word & signs), \
        prmt(lut_lo, lut_hi, upper_half(selectors)) | ((word << 4) & signs)
