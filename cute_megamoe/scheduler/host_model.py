"""Host model of the persistent tile scheduler: which (expert, m-block, n-block) each CTA does.

The device scheduler never materialises a tile list: each CTA starts at linear tile index
``cta``, advances by the grid size, and finds its tile by subtracting whole experts' tile counts
(design.md section 3; DeepGEMM ``scheduler/mega_moe.cuh``). This module is the pure-Python
statement of the same order, used by tests (every tile exactly once, pool offsets, valid rows)
and by kernel tests as the expected schedule. It never touches data.

Conventions (the kernels must agree):

* The pool is expert-major; expert ``e`` occupies ``ceil(count[e] / BM)`` blocks starting at
  pool block ``pool_block_offsets(...)[e]`` (an exclusive prefix sum), rows padded to ``BM``.
* One grouped GEMM's tiles run expert-major; inside an expert the pool blocks go in bands of
  ``raster_group`` (cluster) groups, a band n-block by n-block with its blocks fastest, so
  the tiles that read one weight tile are neighbours (run at the same time on neighbouring
  CTAs). ``raster_group`` 1: block-major, n fastest (neighbours share activation rows).
* The Mega MoE kernel groups local experts into waves of ``experts_per_wave`` and runs
  ``L1(wave 0), L2(wave 0), L1(wave 1), L2(wave 1), ...``; CTA ``c`` of ``S`` takes positions
  ``c, c + S, c + 2S, ...`` of that whole sequence, so the linear index carries over from one
  phase to the next.
* The dataflow kernel (issue 65, ``docs/notes/dataflow.md``; not built yet) runs one
  lag-ordered sequence instead: ``L1(0) .. L1(lag - 1)``, then per pool block ``b``
  ``L1(b), L2(b - lag)``, then the last ``lag`` blocks' L2; block ``b``'s L1 outputs live in
  slot ``b % ring_slots`` of a ring, which ``ring_slots >= lag + 1`` keeps deadlock-free
  (:func:`dataflow_sequence`, :func:`dataflow_tile_walk`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..utils import ceil_div

__all__ = [
    "DataflowTile",
    "HostMegaMoETileScheduler",
    "fused_tile_walk",
    "HostTileScheduler",
    "Tile",
    "assign_tiles",
    "dataflow_lag",
    "banded_blocks",
    "dataflow_position",
    "dataflow_positions",
    "dataflow_sequence",
    "dataflow_tile_walk",
    "grouped_gemm_tiles",
    "min_ring_slots",
    "mega_moe_tile_sequence",
    "num_m_blocks",
    "pool_block_offsets",
    "raster_order",
    "waves",
]

PHASE_L1 = "l1"
PHASE_L2 = "l2"


def _counts(expert_counts: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(expert_counts, torch.Tensor):
        if expert_counts.dim() != 1:
            raise ValueError(f"expert_counts must be 1-D, got shape {tuple(expert_counts.shape)}")
        values = [int(v) for v in expert_counts.tolist()]
    else:
        values = []
        for v in expert_counts:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"expert_counts must hold ints, got {type(v).__name__}")
            values.append(v)
    if any(v < 0 for v in values):
        raise ValueError(f"expert_counts must be non-negative, got {values}")
    return values


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _num_n_blocks(block_n: int, n: int, what: str = "n") -> int:
    _positive("block_n", block_n)
    _positive(what, n)
    if n % block_n != 0:
        raise ValueError(f"{what} ({n}) must be a multiple of block_n ({block_n})")
    return n // block_n


def _non_negative(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_cta(cta: int, num_ctas: int) -> None:
    _positive("num_ctas", num_ctas)
    if isinstance(cta, bool) or not isinstance(cta, int) or not 0 <= cta < num_ctas:
        raise ValueError(f"cta must be an int in [0, {num_ctas}), got {cta!r}")


def num_m_blocks(count: int, block_m: int) -> int:
    """Pool blocks of ``block_m`` rows one expert with ``count`` rows occupies.

    ``block_m`` must be >= 1 and ``count`` >= 0 (``ValueError`` naming the argument otherwise).
    """
    return ceil_div(_non_negative("count", count), _positive("block_m", block_m))


def pool_block_offsets(expert_counts: Sequence[int] | torch.Tensor, block_m: int) -> list[int]:
    """Exclusive prefix sum of ``ceil(count / block_m)``: length ``E_l + 1``.

    ``offsets[e]`` is expert ``e``'s first pool block, ``offsets[E_l]`` the total block count.
    """
    _positive("block_m", block_m)
    offsets = [0]
    for c in _counts(expert_counts):
        offsets.append(offsets[-1] + num_m_blocks(c, block_m))
    return offsets


@dataclass(frozen=True)
class Tile:
    """One output tile of a grouped GEMM.

    ``m_block`` counts within the expert, ``pool_block = offsets[expert] + m_block`` is the
    block's index in the pool (rows ``pool_block * BM`` onwards), and ``valid_m`` is how many of
    its ``BM`` rows hold real tokens (the rest is padding).
    """

    expert: int
    m_block: int
    n_block: int
    pool_block: int
    valid_m: int


def raster_order(num_groups: int, num_n: int, raster_group: int) -> list[tuple[int, int]]:
    """One expert's ``(group, n_block)`` pairs in walk order: bands of ``raster_group``
    groups, each band n-block by n-block with its groups fastest."""
    _non_negative("num_groups", num_groups)
    _non_negative("num_n", num_n)
    _positive("raster_group", raster_group)
    order = []
    for band_first in range(0, num_groups, raster_group):
        band = range(band_first, min(band_first + raster_group, num_groups))
        for nb in range(num_n):
            order += [(g, nb) for g in band]
    return order


def _tiles_of_experts(
    counts: list[int], offsets: list[int], experts: range, block_m: int, num_n: int,
    raster_group: int = 1,
) -> list[Tile]:
    tiles = []
    for e in experts:
        count = counts[e]
        for m, nb in raster_order(num_m_blocks(count, block_m), num_n, raster_group):
            tiles.append(Tile(e, m, nb, offsets[e] + m, min(block_m, count - m * block_m)))
    return tiles


def grouped_gemm_tiles(
    expert_counts: Sequence[int] | torch.Tensor, block_m: int, block_n: int, n: int,
    raster_group: int = 1,
) -> list[Tile]:
    """Every tile of one grouped GEMM with output width ``n``, in walk order (without
    clusters): expert-major, then :func:`raster_order` of the expert's blocks."""
    counts = _counts(expert_counts)
    num_n = _num_n_blocks(block_n, n)
    offsets = pool_block_offsets(counts, block_m)
    return _tiles_of_experts(counts, offsets, range(len(counts)), block_m, num_n,
                             _positive("raster_group", raster_group))


def assign_tiles(num_tiles: int, num_ctas: int) -> list[list[int]]:
    """Persistent-grid assignment: CTA ``c`` takes tile indices ``c, c + S, c + 2S, ...``."""
    _non_negative("num_tiles", num_tiles)
    _positive("num_ctas", num_ctas)
    return [list(range(c, num_tiles, num_ctas)) for c in range(num_ctas)]


def waves(num_local_experts: int, experts_per_wave: int) -> list[range]:
    """Local experts grouped into consecutive waves of ``experts_per_wave`` (last may be short)."""
    _non_negative("num_local_experts", num_local_experts)
    _positive("experts_per_wave", experts_per_wave)
    return [
        range(start, min(start + experts_per_wave, num_local_experts))
        for start in range(0, num_local_experts, experts_per_wave)
    ]


def mega_moe_tile_sequence(
    expert_counts: Sequence[int] | torch.Tensor,
    block_m: int,
    l1_block_n: int,
    l1_n: int,
    l2_block_n: int,
    l2_n: int,
    experts_per_wave: int,
) -> list[tuple[str, Tile]]:
    """The whole Mega MoE tile order: ``L1(w0), L2(w0), L1(w1), L2(w1), ...``.

    Each phase lists its wave's tiles in :func:`grouped_gemm_tiles` order; entries are
    ``('l1' | 'l2', Tile)``. ``l1_n`` is the L1 output width (``2 * I``), ``l2_n`` the L2 one
    (``H``). Pool blocks are the same in both phases (L2 reads the rows L1 wrote).
    """
    counts = _counts(expert_counts)
    num_n1 = _num_n_blocks(l1_block_n, l1_n, "l1_n")
    num_n2 = _num_n_blocks(l2_block_n, l2_n, "l2_n")
    offsets = pool_block_offsets(counts, block_m)
    seq: list[tuple[str, Tile]] = []
    for wave in waves(len(counts), experts_per_wave):
        seq += [(PHASE_L1, t) for t in _tiles_of_experts(counts, offsets, wave, block_m, num_n1)]
        seq += [(PHASE_L2, t) for t in _tiles_of_experts(counts, offsets, wave, block_m, num_n2)]
    return seq


class HostTileScheduler:
    """Walks one CTA's tiles of a grouped GEMM the way the device scheduler does.

    No tile list: a linear index starts at the CTA's cluster and advances by the number of
    clusters (``num_ctas / cluster_m``); the expert that owns it only moves forward. With
    ``cluster_m`` 1 this yields :class:`Tile` in the order of
    ``[grouped_gemm_tiles(..., raster_group)[i] for i in assign_tiles(...)[cta]]``.

    With ``cluster_m`` > 1 (``num_ctas`` a multiple of it), CTA ``cta`` is rank
    ``cta % cluster_m`` of cluster ``cta // cluster_m``; the walk is over groups of
    ``cluster_m`` neighbouring pool blocks (group ``g`` owned by the expert of block
    ``cluster_m * g``), a CTA does block ``cluster_m * g + rank`` (possibly a later expert's);
    past the last block it yields a dummy (``valid_m`` 0, ``m_block`` 0, the owner expert).
    """

    def __init__(
        self,
        expert_counts: Sequence[int] | torch.Tensor,
        block_m: int,
        block_n: int,
        n: int,
        num_ctas: int,
        cta: int,
        cluster_m: int = 1,
        raster_group: int = 1,
    ) -> None:
        self.counts = _counts(expert_counts)
        self.block_m = _positive("block_m", block_m)
        self.num_n_blocks = _num_n_blocks(block_n, n)
        self.num_ctas = _positive("num_ctas", num_ctas)
        if isinstance(cta, bool) or not isinstance(cta, int) or not 0 <= cta < num_ctas:
            raise ValueError(f"cta must be an int in [0, {num_ctas}), got {cta!r}")
        self.cta = cta
        self.cluster_m = _positive("cluster_m", cluster_m)
        if num_ctas % cluster_m:
            raise ValueError(f"num_ctas ({num_ctas}) must be a multiple of cluster_m "
                             f"({cluster_m})")
        self.raster_group = _positive("raster_group", raster_group)

    def __iter__(self) -> Iterator[Tile]:
        offsets = pool_block_offsets(self.counts, self.block_m)
        c, num_n, band = self.cluster_m, self.num_n_blocks, self.raster_group
        group_start = [ceil_div(o, c) for o in offsets]
        rank = self.cta % c
        owner = 0
        for tile in range(self.cta // c, group_start[-1] * num_n, self.num_ctas // c):
            while tile >= group_start[owner + 1] * num_n:
                owner += 1
            groups = group_start[owner + 1] - group_start[owner]
            band_idx, in_band = divmod(tile - group_start[owner] * num_n, band * num_n)
            nb, in_group = divmod(in_band, min(band, groups - band_idx * band))
            pool_block = (group_start[owner] + band_idx * band + in_group) * c + rank
            if pool_block >= offsets[-1]:
                yield Tile(owner, 0, nb, pool_block, 0)
                continue
            expert = owner
            while pool_block >= offsets[expert + 1]:
                expert += 1
            m = pool_block - offsets[expert]
            valid_m = min(self.block_m, self.counts[expert] - m * self.block_m)
            yield Tile(expert, m, nb, pool_block, valid_m)


class HostMegaMoETileScheduler:
    """One CTA's walk over the whole Mega MoE sequence (waves, L1 then L2), device-style.

    The linear index carries across phases: when a wave's L1 tiles are exhausted the index
    keeps its remainder and the walk restarts at the wave's first expert for L2; when L2 is
    exhausted it continues with L1 of the next wave. Yields ``(phase, Tile)`` in the order of
    ``[mega_moe_tile_sequence(...)[i] for i in assign_tiles(...)[cta]]``.
    """

    def __init__(
        self,
        expert_counts: Sequence[int] | torch.Tensor,
        block_m: int,
        l1_block_n: int,
        l1_n: int,
        l2_block_n: int,
        l2_n: int,
        experts_per_wave: int,
        num_ctas: int,
        cta: int,
    ) -> None:
        self.counts = _counts(expert_counts)
        self.block_m = _positive("block_m", block_m)
        self.num_n = {
            PHASE_L1: _num_n_blocks(l1_block_n, l1_n, "l1_n"),
            PHASE_L2: _num_n_blocks(l2_block_n, l2_n, "l2_n"),
        }
        self.experts_per_wave = _positive("experts_per_wave", experts_per_wave)
        self.num_ctas = _positive("num_ctas", num_ctas)
        if isinstance(cta, bool) or not isinstance(cta, int) or not 0 <= cta < num_ctas:
            raise ValueError(f"cta must be an int in [0, {num_ctas}), got {cta!r}")
        self.cta = cta

    def __iter__(self) -> Iterator[tuple[str, Tile]]:
        block_idx = self.cta
        num_experts = len(self.counts)
        wave_start = 0
        wave_pool_offset = 0  # first pool block of the wave's first expert
        while wave_start < num_experts:
            wave_end = min(wave_start + self.experts_per_wave, num_experts)
            for phase in (PHASE_L1, PHASE_L2):
                num_n = self.num_n[phase]
                expert, pool_offset = wave_start, wave_pool_offset
                while expert < wave_end:
                    m_blocks = num_m_blocks(self.counts[expert], self.block_m)
                    if block_idx >= m_blocks * num_n:
                        block_idx -= m_blocks * num_n
                        pool_offset += m_blocks
                        expert += 1
                        continue
                    m, nb = divmod(block_idx, num_n)
                    valid_m = min(self.block_m, self.counts[expert] - m * self.block_m)
                    yield phase, Tile(expert, m, nb, pool_offset + m, valid_m)
                    block_idx += self.num_ctas
            wave_pool_offset = pool_offset
            wave_start = wave_end


def fused_tile_walk(
    expert_counts: Sequence[int] | torch.Tensor,
    block_m: int,
    l1_block_n: int,
    l1_n: int,
    l2_block_n: int,
    l2_n: int,
    num_ctas: int,
    cta: int,
    raster_groups: tuple[int, int] = (1, 1),
) -> list[tuple[str, Tile]]:
    """One CTA's tiles in the sm90 fused layer kernel (`kernels/sm90_mega_moe.py`): the L1
    grouped GEMM's tiles followed by the L2 one's, each in :class:`HostTileScheduler` order
    (no clusters; ``raster_groups`` of L1 and L2), CTA ``cta`` taking positions
    ``cta, cta + num_ctas, ...`` of the concatenation: the linear index carries from L1 into
    L2, so the grid stays busy across the phase change."""
    _check_cta(cta, num_ctas)
    seq = [(PHASE_L1, t) for t in grouped_gemm_tiles(expert_counts, block_m, l1_block_n, l1_n,
                                                      raster_groups[0])]
    seq += [(PHASE_L2, t) for t in grouped_gemm_tiles(expert_counts, block_m, l2_block_n, l2_n,
                                                       raster_groups[1])]
    return [seq[i] for i in range(cta, len(seq), num_ctas)]


@dataclass(frozen=True)
class DataflowTile:
    """One entry of the dataflow kernel's lag-ordered sequence.

    ``phase`` is ``'l1'`` or ``'l2'``; ``position`` the entry's index in the whole sequence
    (:func:`dataflow_sequence`; CTA ``c`` of ``S`` takes positions ``c, c + S, ...``);
    ``ring_slot`` the slot of the L1-output ring that holds ``tile.pool_block``'s L1 outputs
    (``pool_block % ring_slots``): where the L1 tile writes and the L2 tile reads.
    """

    phase: str
    tile: Tile
    ring_slot: int
    position: int


def min_ring_slots(lag: int, band: int = 1) -> int:
    """The fewest L1-output ring slots (pool blocks) the lag-ordered sequence with lag ``lag``
    bands of ``band`` blocks is deadlock-free with under every routing and grid:
    ``(lag + 1) * band`` (``docs/notes/dataflow.md``; with one-block bands, one slot fewer
    deadlocks a one-CTA grid as soon as there are ``lag + 1`` pool blocks)."""
    return (_non_negative("lag", lag) + 1) * _positive("band", band)


def dataflow_sequence(
    expert_counts: Sequence[int] | torch.Tensor,
    block_m: int,
    l1_block_n: int,
    l1_n: int,
    l2_block_n: int,
    l2_n: int,
    lag: int,
    ring_slots: int | None = None,
    band: int = 1,
) -> list[DataflowTile]:
    """The whole lag-ordered L1/L2 sequence of one rank's dataflow kernel.

    Pool blocks in pool order (expert-major, :func:`pool_block_offsets`), each expert's in
    bands of ``band`` consecutive blocks (its last band padded to ``band`` with blocks that
    hold no tile, :func:`banded_blocks`: a band never mixes experts, so its weight tiles are
    one expert's); for ``j = 0, 1, ..., NB - 1 + lag`` over the ``NB`` bands: band ``j``'s L1
    tiles if
    ``j < NB``, then band ``j - lag``'s L2 tiles if ``j >= lag``; inside a band's tiles of a
    phase the n-block is slowest, so the band's blocks read each weight tile at neighbouring
    positions (at the same time on neighbouring CTAs). So the L2 of band ``u`` comes right
    after the L1 of band ``u + lag`` (after the last L1 at the tail); with one-block bands
    (the default) the L2 of block ``b`` comes ``lag * n1`` L1 tiles after its own L1 and its
    ``n2`` L2 tiles spread over ``n2`` neighbouring CTAs of a round-robin grid. Positions of
    the padding blocks are counted but hold no tile (`dataflow_position` names them).
    ``ring_slots`` (default :func:`min_ring_slots`) numbers the L1-output ring's slots; any
    value >= 1 is accepted so a model can show what too small a ring does.
    """
    counts = _counts(expert_counts)
    _positive("block_m", block_m)
    num_n1 = _num_n_blocks(l1_block_n, l1_n, "l1_n")
    num_n2 = _num_n_blocks(l2_block_n, l2_n, "l2_n")
    _positive("band", band)
    slots = min_ring_slots(lag, band) if ring_slots is None else _positive("ring_slots",
                                                                           ring_slots)
    offsets = pool_block_offsets(counts, block_m)
    blocks = []  # (expert, m_block, valid_m) per pool block
    for e, count in enumerate(counts):
        blocks += [(e, m, min(block_m, count - m * block_m))
                   for m in range(num_m_blocks(count, block_m))]
    banded = banded_blocks(counts, block_m, band)
    seq: list[DataflowTile] = []
    position = 0

    def emit(phase: str, unit: int, num_n: int) -> None:
        nonlocal position
        for nb in range(num_n):
            for b in banded[unit * band:(unit + 1) * band]:
                if b is not None:
                    e, m, valid = blocks[b]
                    seq.append(DataflowTile(phase, Tile(e, m, nb, offsets[e] + m, valid),
                                            b % slots, position))
                position += 1

    num_bands = len(banded) // band
    for j in range(num_bands + lag):
        if j < num_bands:
            emit(PHASE_L1, j, num_n1)
        if j >= lag and j - lag < num_bands:
            emit(PHASE_L2, j - lag, num_n2)
    return seq


def banded_blocks(expert_counts: Sequence[int] | torch.Tensor, block_m: int,
                  band: int = 1) -> list[int | None]:
    """The banded blocks of :func:`dataflow_sequence`: every expert's pool blocks in order,
    each expert's padded to a multiple of ``band`` with None (no tile); entry ``v`` is the
    pool block of banded block ``v`` (with one-block bands, every pool block itself)."""
    _positive("block_m", block_m)
    _positive("band", band)
    out: list[int | None] = []
    first = 0
    for count in _counts(expert_counts):
        n = num_m_blocks(count, block_m)
        out += list(range(first, first + n)) + [None] * (-n % band)
        first += n
    return out


def dataflow_positions(num_blocks: int, num_n1: int, num_n2: int, band: int = 1) -> int:
    """Positions of :func:`dataflow_sequence` over ``num_blocks`` banded blocks
    (:func:`banded_blocks`; with one-block bands the pool blocks), padding included."""
    return ceil_div(num_blocks, band) * band * (num_n1 + num_n2)


def dataflow_position(position: int, num_blocks: int, num_n1: int, num_n2: int,
                      lag: int, band: int = 1) -> tuple[str, int, int]:
    """Entry ``position`` of :func:`dataflow_sequence` over ``num_blocks`` banded blocks
    (:func:`banded_blocks`), without the list: (phase, banded block, n-block); the banded
    block's pool block is ``banded_blocks(...)[v]`` (None, or past ``num_blocks``: padding,
    no tile). Over ``NB`` bands of ``band`` blocks the sequence has
    three parts: the L1 tiles of the first ``min(lag, NB)`` bands; then, per band ``j`` in
    ``[lag, NB)``, its L1 tiles followed by band ``j - lag``'s L2 tiles; then the L2 tiles of
    the last ``min(lag, NB)`` bands; inside a band's tiles of a phase the n-block is slowest.
    What the device walk computes from a ticket (`scheduler.device.DataflowSequence.position`),
    in a few integer operations."""
    _non_negative("num_blocks", num_blocks)
    _positive("num_n1", num_n1)
    _positive("num_n2", num_n2)
    _non_negative("lag", lag)
    _positive("band", band)
    end = dataflow_positions(num_blocks, num_n1, num_n2, band)
    if not 0 <= position < end:
        raise ValueError(f"position {position} outside the sequence's {end} entries")
    num_bands = ceil_div(num_blocks, band)
    u1, u2 = band * num_n1, band * num_n2  # entries of a band's L1 / L2 tiles
    head = min(lag, num_bands) * u1
    body_end = head + max(num_bands - lag, 0) * (u1 + u2)
    if position < head:
        phase, unit, offset = PHASE_L1, position // u1, position % u1
    elif position < body_end:
        step, offset = divmod(position - head, u1 + u2)
        phase, unit = PHASE_L1, lag + step
        if offset >= u1:
            phase, unit, offset = PHASE_L2, step, offset - u1
    else:
        unit, offset = divmod(position - body_end, u2)
        phase, unit = PHASE_L2, max(num_bands - lag, 0) + unit
    n_block, in_band = divmod(offset, band)
    return phase, unit * band + in_band, n_block


def dataflow_tile_walk(
    expert_counts: Sequence[int] | torch.Tensor,
    block_m: int,
    l1_block_n: int,
    l1_n: int,
    l2_block_n: int,
    l2_n: int,
    num_ctas: int,
    cta: int,
    lag: int,
    ring_slots: int | None = None,
    band: int = 1,
) -> list[DataflowTile]:
    """One CTA's work list in the dataflow kernel: positions ``cta, cta + num_ctas, ...`` of
    :func:`dataflow_sequence`, in order (L1 and L2 tiles interleaved, each L2 a fixed ``lag``
    bands behind its L1; the padding's positions hold no tile). The device walk would count
    the same positions without a list."""
    _check_cta(cta, num_ctas)
    seq = dataflow_sequence(expert_counts, block_m, l1_block_n, l1_n, l2_block_n, l2_n, lag,
                            ring_slots, band)
    return [entry for entry in seq if entry.position % num_ctas == cta]


def dataflow_lag(num_ctas: int, num_n1: int, num_n2: int, grids: int = 2,
                 band: int = 1) -> int:
    """The lag (bands of ``band`` pool blocks) that puts ``grids`` grids' worth of tiles
    between the first L1 tile of a band and its first L2 tile:
    ``ceil(grids * num_ctas / (band * (num_n1 + num_n2)))``, at least 1. Band ``u``'s L1
    tiles then ran about ``grids`` tile times before a CTA reaches its L2, so a CTA rarely
    waits for them (a performance choice, not a safety one: every lag is deadlock-free with
    :func:`min_ring_slots` slots)."""
    _positive("num_ctas", num_ctas)
    _positive("num_n1", num_n1)
    _positive("num_n2", num_n2)
    _positive("grids", grids)
    _positive("band", band)
    return max(1, ceil_div(grids * num_ctas, band * (num_n1 + num_n2)))
