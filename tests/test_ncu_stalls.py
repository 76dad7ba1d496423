"""`bench/ncu_stalls.py` on a small hand-made Nsight Compute source export (CPU)."""

from bench import ncu_stalls

_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
           '"stall_barrier","stall_long_sb","stall_math","stall_barrier (Not Issued)"')


def _row(address: int, source: str, samples: int, executed: int, barrier: int, long_sb: int,
         math: int) -> str:
    return f'"0x{address:x}","{source}","{samples}","{executed}","{barrier}","{long_sb}",' \
           f'"{math}","0"'


def _export() -> str:
    a = [_row(0, "      LDC R1, c[0x0][0x28]", 1, 8, 0, 1, 0),
         _row(16, "      PRMT R2, R3, R4, R5", 30, 800, 0, 10, 20),
         _row(32, "      @!P0 BRA 0x10", 10, 800, 0, 10, 0),
         _row(48, "      WARPGROUP.DEPBAR.LE gsb0, 0x0", 50, 400, 50, 0, 0),
         _row(64, "      EXIT", 0, 0, 0, 0, 0)]
    b = [_row(0, "      QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], RZ", 5, 10, 5, 0, 0)]
    return "\n".join(['"Kernel Name","first"', _HEADER, *a, '"Kernel Name","second"', _HEADER,
                      *b]) + "\n"


def test_kernels_are_split_and_grouped_by_execution_count():
    parsed = ncu_stalls.kernels(_export())
    assert [name for name, _ in parsed] == ["first", "second"]
    groups = ncu_stalls.loop_groups(parsed[0][1])
    # most samples first; the instruction never executed is in no group
    assert [(g["executed"], g["instructions"], g["samples"]) for g in groups] == \
        [(400, 1, 50), (800, 2, 40), (8, 1, 1)]
    loop = groups[1]
    assert (loop["first"], loop["last"]) == (1, 2)
    assert loop["stalls"] == {"barrier": 0, "long_sb": 20, "math": 20}
    assert loop["opcodes"] == {"PRMT": 1, "BRA": 1}
    assert ncu_stalls.opcode("      @!UP0 SYNCS.EXCH.64 URZ, [UR13], UR4") == "SYNCS"
    (only,) = ncu_stalls.loop_groups(parsed[1][1])
    assert only["opcodes"] == {"QGMMA": 1} and only["stalls"]["barrier"] == 5
