"""Device side of the grouped-GEMM tile scheduler (the walk `host_model.HostTileScheduler` models).

A CTA keeps two integers: its linear tile index and the expert that index last fell in. Tiles
run expert-major, then m-block, then n-block (n fastest); expert ``e`` owns tiles
``[block_start[e] * num_n, block_start[e + 1] * num_n)`` where ``block_start`` is the pool block
offset prefix (``pool_block_offsets``) built in shared memory by ``build_pool_prefix``. Because
a CTA's tile index only grows, its expert only moves forward. No tile list is materialised.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class ExpertTileScheduler:
    """Maps a linear tile index to (expert, m-block, n-block, pool block, valid rows)."""

    def __init__(self, num_experts: int, block_m: int, num_n_blocks: int):
        self.num_experts = num_experts
        self.block_m = block_m
        self.num_n_blocks = num_n_blocks

    @cute.jit
    def num_tiles(self, block_start: cute.Tensor) -> Int32:
        """Tiles of the whole grouped GEMM: all pool blocks times the n-blocks."""
        return block_start[self.num_experts] * self.num_n_blocks

    @cute.jit
    def tile(self, tile: Int32, expert: Int32, block_start: cute.Tensor,
             row_start: cute.Tensor):
        """Tile ``tile`` (< ``num_tiles``) given the expert of this CTA's previous tile (0 at
        first). Returns ``(expert, m_block, n_block, pool_block, valid_m)``."""
        while tile >= block_start[expert + 1] * self.num_n_blocks:
            expert += 1
        local = tile - block_start[expert] * self.num_n_blocks
        m_block = local // self.num_n_blocks
        n_block = local - m_block * self.num_n_blocks
        count = row_start[expert + 1] - row_start[expert]
        valid_m = cutlass.min(count - m_block * self.block_m, Int32(self.block_m))
        return expert, m_block, n_block, block_start[expert] + m_block, valid_m
