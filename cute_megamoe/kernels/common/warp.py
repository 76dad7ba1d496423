"""Warp-level collectives."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def warp_inclusive_sum(value: Int32) -> Int32:
    """Inclusive prefix sum over the 32 lanes (Kogge-Stone with `shfl.sync.up`)."""
    lane = cute.arch.lane_idx()
    for i in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(value, 1 << i)
        if lane >= (1 << i):
            value = value + other
    return value
