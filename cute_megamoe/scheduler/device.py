"""Device side of the grouped-GEMM tile scheduler (the walk `host_model.HostTileScheduler` models).

A CTA keeps two integers: its linear tile index and the expert that owns it (``owner``, which
only moves forward as the index grows). Tiles run expert-major; inside an expert, its pool
blocks are taken in bands of ``raster_group`` (cluster) groups, and a band's tiles run n-block
by n-block with the band's blocks fastest. The tiles that read one weight tile (one n-block, the
band's blocks) are neighbours in the walk, so they run at the same time on neighbouring CTAs
and the weight tile comes from DRAM once per band; with ``raster_group`` = 1 the order is
block-major, n fastest. The sm90 grouped GEMMs size a band so that its activation rows (read
once per n-block) stay in L2 (``sm90_expert_gemm.RASTER_L2_BYTES``).

With clusters of ``cluster_m`` CTAs along M the walk is over groups of ``cluster_m``
neighbouring pool blocks (one per CTA ``rank``; both CTAs of a cluster at the same n-block).
Group ``g`` is owned by the expert of its first block, so expert ``e`` owns groups
``[ceil(block_start[e] / cluster_m), ceil(block_start[e + 1] / cluster_m))``; the second block
of a group may belong to a later expert. ``block_start`` is the pool block offset prefix
(``pool_block_offsets``) built in shared memory by ``build_pool_prefix``. A block past the last
pool block is a dummy: ``valid_m`` 0, expert = the owner. No tile list is materialised.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..kernels.common.pool import expert_of_row
from ..kernels.common.warp import warp_inclusive_sum
from .host_model import _non_negative, _positive

OWNER_SEARCHES = ("linear", "gallop")


class ExpertTileScheduler:
    """Maps a linear tile index to (expert, m-block, n-block, pool block, valid rows)."""

    def __init__(self, num_experts: int, block_m: int, num_n_blocks: int, cluster_m: int = 1,
                 owner_search: str = "linear"):
        # Checked here, on the host: a zero would make the device walk divide by zero or spin.
        self.num_experts = _positive("num_experts", num_experts)
        self.block_m = _positive("block_m", block_m)
        self.num_n_blocks = _positive("num_n_blocks", num_n_blocks)
        self.cluster_m = _positive("cluster_m", cluster_m)
        # how a tile's owner is found from the previous one (`owner_of`): "linear", one expert
        # at a time, or "gallop", steps doubling from the previous owner, then halving (the
        # same owner; a CTA's first tile at decode sizes, past up to E empty experts, in
        # O(log E) shared-memory loads instead of O(E); the sm_90a kernels' default, measured
        # there; the sm_100a kernels, never run, keep "linear")
        if owner_search not in OWNER_SEARCHES:
            raise ValueError(f"owner_search: one of {OWNER_SEARCHES}, got {owner_search!r}")
        self.owner_search = owner_search

    @cute.jit
    def group_start(self, block_start: cute.Tensor, expert: Int32) -> Int32:
        """First (cluster) group owned by ``expert``: ``ceil(block_start[expert] / cluster_m)``."""
        first = block_start[expert]
        if cutlass.const_expr(self.cluster_m > 1):
            first = (first + self.cluster_m - 1) // self.cluster_m
        return first

    @cute.jit
    def num_tiles(self, block_start: cute.Tensor) -> Int32:
        """(Cluster) tiles of the whole grouped GEMM: the pool blocks (in groups of
        ``cluster_m``) times the n-blocks."""
        return self.group_start(block_start, Int32(self.num_experts)) * self.num_n_blocks

    @cute.jit
    def owner_of(self, tile: Int32, owner: Int32, block_start: cute.Tensor) -> Int32:
        """The expert that owns ``tile`` (< ``num_tiles``), given an expert at or before it
        (``owner``: the previous tile's, 0 at first): the last expert ``e >= owner`` whose
        first tile ``group_start(e) * num_n_blocks`` is at most ``tile`` (empty experts
        before the owner start where it does, so the last one is the owner)."""
        num_n = self.num_n_blocks
        # (the walks stop at the last expert whatever the table holds: a corrupt one, or a tile
        # past the last, gives a wrong owner rather than a walk past the table's end)
        last = Int32(self.num_experts - 1)
        if cutlass.const_expr(self.owner_search == "linear"):
            while owner < last and tile >= self.group_start(block_start, owner + 1) * num_n:
                owner += 1
        else:
            # gallop: probes owner + 1, + 2, + 4, ... until one starts past the tile (expert E
            # does: its start is num_tiles), keeping the last that does not in `owner`
            step = Int32(1)
            hi = owner + 1
            while hi <= last and tile >= self.group_start(block_start, hi) * num_n:
                owner = hi
                hi = cutlass.min(hi + step, Int32(self.num_experts))
                step = step * 2
            # then halve [owner, hi): owner's start <= tile < hi's start
            while hi - owner > 1:
                mid = (owner + hi) // 2
                if tile >= self.group_start(block_start, mid) * num_n:
                    owner = mid
                else:
                    hi = mid
        return owner

    @cute.jit
    def tile(self, tile: Int32, owner: Int32, block_start: cute.Tensor, row_start: cute.Tensor,
             raster_group: Int32, rank: Int32 = 0):
        """Tile ``tile`` (< ``num_tiles``) of CTA ``rank`` of the cluster, given the owner of
        this CTA's previous tile (0 at first). Returns
        ``(owner, expert, m_block, n_block, pool_block, valid_m)``: ``expert`` is the pool
        block's; ``valid_m`` is 0 for a dummy."""
        num_n = self.num_n_blocks
        owner = self.owner_of(tile, owner, block_start)
        first = self.group_start(block_start, owner)
        groups = self.group_start(block_start, owner + 1) - first
        local = tile - first * num_n
        band = local // (raster_group * num_n)
        in_band = local - band * (raster_group * num_n)
        band_groups = cutlass.min(raster_group, groups - band * raster_group)
        n_block = in_band // band_groups
        group = first + band * raster_group + (in_band - n_block * band_groups)
        pool_block = group * self.cluster_m + rank
        expert = owner
        m_block = Int32(0)
        valid_m = Int32(0)
        if pool_block < block_start[self.num_experts]:
            last = Int32(self.num_experts - 1)
            while expert < last and pool_block >= block_start[expert + 1]:
                expert += 1
            m_block = pool_block - block_start[expert]
            count = row_start[expert + 1] - row_start[expert]
            valid_m = cutlass.min(count - m_block * self.block_m, Int32(self.block_m))
        return owner, expert, m_block, n_block, pool_block, valid_m


class DataflowSequence:
    """The dataflow kernel's lag-ordered L1 / L2 sequence (`host_model.dataflow_sequence`;
    docs/notes/dataflow.md): an entry's (phase, banded block, n-block) from its position, as a
    CTA finds its next tile from a ticket. The device twin of `host_model.dataflow_position`,
    with bands of ``band`` blocks of one expert (`host_model.banded_blocks`: each expert's
    blocks padded to a multiple of ``band``; `pool_block` maps a banded block to its pool
    block, or past the pool for the padding, which holds no tile); the pool block's expert,
    m-block and valid rows then come from the phase's `ExpertTileScheduler` (with one-block
    raster bands, tile ``pool_block * n + n_block``). With ``band`` > 1 the banded blocks' own
    prefix (``band_start``, `build_band_start`) sits in shared memory beside ``block_start``."""

    def __init__(self, num_n1: int, num_n2: int, lag: int, band: int = 1):
        self.num_n1 = _positive("num_n1", num_n1)
        self.num_n2 = _positive("num_n2", num_n2)
        self.lag = _non_negative("lag", lag)
        self.band = _positive("band", band)

    @cute.jit
    def build_band_start(self, block_start: cute.Tensor, band_start: cute.Tensor,
                         num_experts: cutlass.Constexpr):
        """``band_start[e]``: the first banded block of expert ``e`` (the exclusive prefix of
        its blocks rounded up to ``band``), ``num_experts + 1`` entries. Call from one whole
        warp; its lanes (or, after a CTA sync, every thread) may then read it."""
        lane = cute.arch.lane_idx()
        carry = Int32(0)
        for base in cutlass.range(0, num_experts, 32):
            e = base + lane
            banded = Int32(0)
            if e < num_experts:
                blocks = block_start[e + 1] - block_start[e]
                banded = (blocks + self.band - 1) // self.band * self.band
            incl = warp_inclusive_sum(banded)
            if e < num_experts:
                band_start[e + 1] = carry + incl
            carry += cute.arch.shuffle_sync(incl, 31)
        if lane == 0:
            band_start[0] = 0
        cute.arch.sync_warp()

    @cute.jit
    def num_banded(self, block_start: cute.Tensor, band_start: cute.Tensor,
                   num_experts: cutlass.Constexpr) -> Int32:
        """Banded blocks of the pool (`num_positions`' argument): the pool blocks with
        one-block bands."""
        total = block_start[num_experts]
        if cutlass.const_expr(self.band > 1):
            total = band_start[num_experts]
        return total

    @cute.jit
    def pool_block(self, banded: Int32, block_start: cute.Tensor, band_start: cute.Tensor,
                   num_experts: cutlass.Constexpr) -> Int32:
        """The pool block of banded block ``banded`` (< `num_banded`), or the pool's block
        count for an expert's padding (no tile): the last expert whose banded blocks start at
        or before it, found by halving (empty experts start where the next one does)."""
        block = banded
        if cutlass.const_expr(self.band > 1):
            expert = expert_of_row(band_start, banded, num_experts)  # (the same halving)
            local = banded - band_start[expert]
            block = block_start[num_experts]
            if local < block_start[expert + 1] - block_start[expert]:
                block = block_start[expert] + local
        return block

    @cute.jit
    def num_positions(self, num_blocks: Int32) -> Int32:
        """Entries of the sequence over ``num_blocks`` banded blocks (`num_banded`; the
        padding included)."""
        return (num_blocks + self.band - 1) // self.band * self.band * (self.num_n1
                                                                          + self.num_n2)

    @cute.jit
    def position(self, position: Int32, num_blocks: Int32):
        """Entry ``position`` (< `num_positions`): ``(is_l2, banded block, n_block)`` (the
        pool block itself with one-block bands; else `pool_block`)."""
        band, lag = self.band, self.lag
        u1, u2 = band * self.num_n1, band * self.num_n2  # a band's L1 / L2 entries
        num_bands = (num_blocks + band - 1) // band
        head = cutlass.min(num_bands, Int32(lag)) * u1
        body_end = head + cutlass.max(num_bands - lag, Int32(0)) * (u1 + u2)
        is_l2 = Int32(0)
        unit = Int32(0)
        offset = Int32(0)
        if position < head:  # the first bands' L1 tiles
            unit = position // u1
            offset = position - unit * u1
        elif position < body_end:  # band lag + step's L1 tiles, then band step's L2 tiles
            step = (position - head) // (u1 + u2)
            offset = position - head - step * (u1 + u2)
            if offset < u1:
                unit = lag + step
            else:
                is_l2 = Int32(1)
                unit = step
                offset = offset - u1
        else:  # the last bands' L2 tiles
            tail = position - body_end
            is_l2 = Int32(1)
            unit = cutlass.max(num_bands - lag, Int32(0)) + tail // u2
            offset = tail - (tail // u2) * u2
        # (inside a band's tiles of a phase the n-block is slowest)
        n_block = offset // band
        return is_l2, unit * band + (offset - n_block * band), n_block
