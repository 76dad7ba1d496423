"""Device side of the grouped-GEMM tile scheduler (the walk `host_model.HostTileScheduler` models).

A CTA keeps two integers: its linear tile index and the expert that index last fell in. Tiles
run expert-major, then m-block, then n-block (n fastest); expert ``e`` owns tiles
``[block_start[e] * num_n, block_start[e + 1] * num_n)`` where ``block_start`` is the pool block
offset prefix (``pool_block_offsets``) built in shared memory by ``build_pool_prefix``. Because
a CTA's tile index only grows, its expert only moves forward. No tile list is materialised.

With clusters of ``cluster_m`` CTAs along M, the index walks cluster tiles: cluster tile ``t``
is pool blocks ``cluster_m * (t // num_n) + rank`` (one per CTA ``rank`` of the cluster) at
n-block ``t % num_n``, so the CTAs of a cluster do the same n-block of neighbouring pool blocks
at the same time (the weight tile they share when both blocks belong to one expert). A block
past the last pool block is a dummy: ``valid_m`` 0, the expert of the CTA's previous tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class ExpertTileScheduler:
    """Maps a linear tile index to (expert, m-block, n-block, pool block, valid rows)."""

    def __init__(self, num_experts: int, block_m: int, num_n_blocks: int, cluster_m: int = 1):
        self.num_experts = num_experts
        self.block_m = block_m
        self.num_n_blocks = num_n_blocks
        self.cluster_m = cluster_m

    @cute.jit
    def num_tiles(self, block_start: cute.Tensor) -> Int32:
        """(Cluster) tiles of the whole grouped GEMM: the pool blocks (in groups of
        ``cluster_m``) times the n-blocks."""
        num_blocks = block_start[self.num_experts]
        return (num_blocks + self.cluster_m - 1) // self.cluster_m * self.num_n_blocks

    @cute.jit
    def tile(self, tile: Int32, expert: Int32, block_start: cute.Tensor,
             row_start: cute.Tensor, rank: Int32 = 0):
        """Tile ``tile`` (< ``num_tiles``) of CTA ``rank`` of the cluster, given the expert of
        this CTA's previous tile (0 at first). Returns
        ``(expert, m_block, n_block, pool_block, valid_m)``; ``valid_m`` is 0 for a dummy."""
        group = tile // self.num_n_blocks
        n_block = tile - group * self.num_n_blocks
        pool_block = group * self.cluster_m + rank
        m_block = Int32(0)
        valid_m = Int32(0)
        if pool_block < block_start[self.num_experts]:
            while pool_block >= block_start[expert + 1]:
                expert += 1
            m_block = pool_block - block_start[expert]
            count = row_start[expert + 1] - row_start[expert]
            valid_m = cutlass.min(count - m_block * self.block_m, Int32(self.block_m))
        return expert, m_block, n_block, pool_block, valid_m
