"""Where every byte of the Mega MoE symmetric buffer lives (host-side sizes, offsets, views).

See :mod:`cute_megamoe.layout.mega_moe` for the region list and who reads and writes each one.
"""

from .mega_moe import (
    BLOCK_M_MAX,
    DATA_REGION_NAMES,
    MAX_NUM_RANKS,
    MAX_NUM_TOKENS_PER_RANK,
    MAX_NUM_TOPK,
    MIN_BLOCK_M,
    NUM_BARRIER_SLOTS,
    RECIPES,
    REGION_ALIGNMENT,
    REGION_NAMES,
    TOKEN_ALIGNMENT,
    WORKSPACE_REGION_NAMES,
    AbsentRegionError,
    BarrierSlots,
    CountWord,
    MegaMoELayout,
    Region,
)

__all__ = [
    "BLOCK_M_MAX",
    "DATA_REGION_NAMES",
    "MAX_NUM_RANKS",
    "MAX_NUM_TOKENS_PER_RANK",
    "MAX_NUM_TOPK",
    "MIN_BLOCK_M",
    "NUM_BARRIER_SLOTS",
    "RECIPES",
    "REGION_ALIGNMENT",
    "REGION_NAMES",
    "TOKEN_ALIGNMENT",
    "WORKSPACE_REGION_NAMES",
    "AbsentRegionError",
    "BarrierSlots",
    "CountWord",
    "MegaMoELayout",
    "Region",
]
