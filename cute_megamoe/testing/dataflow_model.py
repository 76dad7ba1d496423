"""A discrete-event model of the dataflow kernel's waits (issue 65, ``docs/notes/dataflow.md``).

Pure Python, no GPU, no kernel: it runs one rank's lag-ordered work lists
(`scheduler.host_model.dataflow_tile_walk`) with exactly the waits the design has, and says
whether every tile finishes (and when, in abstract time units) or where the waits deadlock.

Executors, each in order, one item at a time:

* every CTA, through its work list of L1 and L2 tiles: positions ``c, c + S, ...`` of the
  sequence ("static"), or the next position whenever it is free ("ticket", the default);
* every source rank's sender (the warps that push its rows into this rank's pool), through
  its rows of this rank's pool blocks in pool order (one item per (source, block)).

Waits (``b`` a pool block, ``S`` the L1-output ring's slots, ``A`` the row ring's slots):

* an L1 tile of ``b`` waits for every source's rows of ``b`` and, when ``b >= S``, for every
  L2 tile of ``b - S`` (the previous occupant of its ring slot has been read);
* an L2 tile of ``b`` waits for every L1 tile of ``b``;
* with a row ring (``row_slots`` = ``A``), a sender's rows of ``b >= A`` wait for every L1
  tile of ``b - A`` (the slot's previous rows have been read).

Every wait names a fixed set of items, so the waits-for graph is static: the run deadlocks
under every timing exactly when that graph (plus each executor's order) has a cycle, and
completes under every timing otherwise. The durations (``DataflowCosts``, optional seeded
jitter) only decide the makespan. Each item starts once its executor is free and its waits
are met (``start = max(executor free, last awaited finish)``): no contention for memory or
NVLink is modelled, and a CTA runs one tile at a time (the kernel's producer runs ahead of its
consumers, which adds only waits from earlier to later positions of the same list). With
``late_signals`` (the consumers' one-tile-late L1 signal) a signal waits for the CTA's next
item, which with tickets depends on timing: the jittered runs then explore timings.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..scheduler.host_model import (
    PHASE_L1,
    dataflow_sequence,
    min_ring_slots,
    num_m_blocks,
)

__all__ = ["ASSIGNMENTS", "DataflowCosts", "DataflowRun", "block_sources", "simulate_dataflow",
           "weight_reads"]

#: how CTAs get their positions of the sequence: "static", CTA c takes c, c + S, ... (as the
#: fused kernel's walk today); "ticket", a free CTA takes the next position (one atomic add
#: per tile on a per-call counter)
ASSIGNMENTS = ("static", "ticket")
_ROWS, _L1, _L2 = 0, 1, 2  # group kinds: a block's rows arrived, its L1 tiles, its L2 tiles


@dataclass(frozen=True)
class DataflowCosts:
    """Abstract durations: an L1 tile (``K = H``) against an L2 tile (``K = I``; DeepSeek-V3
    7168 / 2048 = 3.5 L2 tiles per L1 tile of the same width), and one sender's time per
    row it moves (0: rows are there as soon as the slot is free)."""

    l1_tile: float = 3.5
    l2_tile: float = 1.0
    row: float = 0.0


@dataclass(frozen=True)
class DataflowRun:
    """The outcome of :func:`simulate_dataflow`.

    ``completed``: every item finished; ``makespan``: the last finish (the time reached when
    it deadlocked); ``tile_runs``: how often each ``(phase, pool_block, n_block)`` ran;
    ``rows_moved``: rows the senders moved; ``stuck``: one line per executor left waiting
    (its next item and the wait it cannot pass), empty when completed.
    """

    completed: bool
    makespan: float
    tile_runs: Counter = field(repr=False)
    rows_moved: int
    stuck: tuple[str, ...]


def block_sources(sources: Sequence[int], block_m: int) -> list[dict[int, int]]:
    """Rows per source rank in each pool block of one expert with ``sources[s]`` rows from
    rank ``s``: the dispatch's pool order, the sources taking turns one row each in rank order
    (`kernels/dispatch.py`)."""
    remaining = [int(c) for c in sources]
    if any(c < 0 for c in remaining):
        raise ValueError(f"sources must be non-negative, got {list(sources)}")
    order: list[int] = []
    while any(remaining):
        for s, c in enumerate(remaining):
            if c:
                order.append(s)
                remaining[s] -= 1
    return [dict(Counter(order[i:i + block_m])) for i in range(0, len(order), block_m)]


def simulate_dataflow(
    expert_counts: Sequence[int],
    block_m: int,
    l1_block_n: int,
    l1_n: int,
    l2_block_n: int,
    l2_n: int,
    num_ctas: int,
    lag: int,
    ring_slots: int | None = None,
    row_slots: int | None = None,
    sources: Sequence[Sequence[int]] | None = None,
    costs: DataflowCosts = DataflowCosts(),
    jitter: float = 0.0,
    seed: int = 0,
    assignment: str = "ticket",
    senders_on_ctas: bool = False,
    band: int = 1,
    late_signals: bool = False,
    signal_far: int | None = None,
) -> DataflowRun:
    """Run one rank's dataflow schedule (see the module docstring).

    ``expert_counts``, the tile shape, ``num_ctas``, ``lag``, ``ring_slots`` (default
    `min_ring_slots`) and ``band`` as `scheduler.host_model.dataflow_sequence`;
    ``row_slots``: slots of the received-rows ring (None: a whole pool, no back-pressure);
    ``sources[e][s]``: expert ``e``'s rows from source rank ``s`` (None: one source);
    ``jitter``: each item's duration is multiplied by a seeded uniform factor in
    ``[1, 1 + jitter]``; ``assignment``: one of
    `ASSIGNMENTS`; ``senders_on_ctas``: the rows are moved by the CTAs themselves, each its
    share (round-robin over (source, block) items) before its tiles, as the fused kernel's
    threads do today, instead of by senders of their own (the negative case of the note).
    ``late_signals``: as the kernel's consumers, a CTA signals an L1 tile once its next item's
    L1 mainloop is done, before an L2 tile starts, or at the end of its list; with
    ``signal_far`` it signals first when its next L1 tile's block is at least that many blocks
    later (the kernel's rule with a row ring: ``row_slots - band``, note section 2).
    """
    counts = [int(c) for c in expert_counts]
    seq = dataflow_sequence(counts, block_m, l1_block_n, l1_n, l2_block_n, l2_n, lag,
                            ring_slots, band)
    slots = min_ring_slots(lag, band) if ring_slots is None else ring_slots
    if row_slots is not None and row_slots < 1:
        raise ValueError(f"row_slots must be >= 1 or None, got {row_slots}")
    if jitter < 0:
        raise ValueError(f"jitter must be >= 0, got {jitter}")
    if sources is None:
        sources = [[c] for c in counts]
    if len(sources) != len(counts) \
            or any(sum(s) != c for s, c in zip(sources, counts, strict=True)):
        raise ValueError("sources[e] must sum to expert_counts[e] for every expert")
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    ticket = assignment == "ticket"
    rng = random.Random(seed)

    def duration(base: float) -> float:
        return base * (1.0 + jitter * rng.random()) if jitter else base

    # per pool block: rows per source, in pool order
    per_block: list[dict[int, int]] = []
    for e, src in enumerate(sources):
        blocks = block_sources(src, block_m)
        assert len(blocks) == num_m_blocks(counts[e], block_m)
        per_block += blocks
    num_sources = max((len(s) for s in sources), default=1)

    # items: (executor, waits, groups it counts into, duration, label)
    target: dict[tuple[int, int], int] = Counter()
    executors: list[list[tuple[tuple[tuple[int, int], ...], tuple[int, int], float, tuple]]]
    executors = [[] for _ in range(num_ctas + num_sources)]
    tickets: list = []  # with tickets: the sequence, handed out in order
    tiles_of = [0] * num_ctas  # (static) tiles in each CTA's list
    for item in seq:
        b = item.tile.pool_block
        if item.phase == PHASE_L1:
            waits = ((_ROWS, b),) + (((_L2, b - slots),) if b >= slots else ())
            group, base = (_L1, b), costs.l1_tile
        else:
            waits, group, base = ((_L1, b),), (_L2, b), costs.l2_tile
        target[group] += 1
        entry = (waits, group, duration(base), (item.phase, b, item.tile.n_block))
        if ticket:
            tickets.append(entry)
        else:
            executors[item.position % num_ctas].append(entry)
            tiles_of[item.position % num_ctas] += 1
    sends = []
    for b, rows in enumerate(per_block):
        for s in sorted(rows):
            waits = ((_L1, b - row_slots),) if row_slots is not None and b >= row_slots else ()
            target[(_ROWS, b)] += 1
            sends.append((s, (waits, (_ROWS, b), duration(costs.row * rows[s]),
                              ("rows", b, s, rows[s]))))
    for i, (s, entry) in enumerate(sends):
        if senders_on_ctas:  # CTA c sends its share first, then computes (today's order)
            executors[i % num_ctas].insert(len(executors[i % num_ctas]) - tiles_of[i % num_ctas],
                                           entry)
        else:
            executors[num_ctas + s].append(entry)

    done: dict[tuple[int, int], int] = Counter()
    waiters: dict[tuple[int, int], list[int]] = {}
    head = [0] * len(executors)  # (tickets: the CTAs' lists fill as they take positions)
    held: list[tuple | None] = [None] * len(executors)  # the item an executor waits to start
    running = [False] * len(executors)
    owed: list[tuple[int, int] | None] = [None] * len(executors)  # (`late_signals`)
    events: list[tuple[float, int, int]] = []  # (finish time, order, executor)
    runs: Counter = Counter()
    counter = itertools.count()
    next_ticket = 0
    now = 0.0

    def next_item(x: int) -> tuple | None:
        nonlocal next_ticket
        if held[x] is None:
            if head[x] == len(executors[x]) and ticket and x < num_ctas \
                    and next_ticket < len(tickets):
                executors[x].append(tickets[next_ticket])
                next_ticket += 1
            if head[x] == len(executors[x]):
                return None
            held[x] = executors[x][head[x]]
        return held[x]

    def complete(group: tuple[int, int]) -> list[int]:
        done[group] += 1
        return waiters.pop(group, []) if done[group] == target[group] else []

    def try_start(x: int) -> None:
        if running[x]:
            return
        item = next_item(x)
        woken = []
        if owed[x] is not None and (item is None or item[1][0] != _L1 or (
                signal_far is not None and item[1][1] - owed[x][1] >= signal_far)):
            woken, owed[x] = complete(owed[x]), None
        if item is not None:
            waits, _, dur, _ = item
            blocked = next((w for w in waits if done[w] < target[w]), None)
            if blocked is not None:
                waiters.setdefault(blocked, []).append(x)
            else:
                running[x] = True
                heapq.heappush(events, (now + dur, next(counter), x))
        for w in woken:
            try_start(w)

    for x in range(len(executors)):
        try_start(x)
    while events:
        now, _, x = heapq.heappop(events)
        _, group, _, label = held[x]
        held[x] = None
        running[x] = False
        head[x] += 1
        runs[label] += 1
        if late_signals and x < num_ctas and group[0] == _L1:
            woken = complete(owed[x]) if owed[x] is not None else []
            owed[x] = group  # (signalled after this CTA's next L1 tile, or before an L2 tile)
        else:
            woken = complete(group)
        for w in [x] + woken:
            try_start(w)
    names = {_ROWS: "rows of block", _L1: "L1 tiles of block", _L2: "L2 tiles of block"}
    stuck = []
    for x in range(len(executors)):
        if held[x] is not None:
            waits, _, _, label = held[x]
            w = next(w for w in waits if done[w] < target[w])
            who = f"CTA {x}" if x < num_ctas else f"sender {x - num_ctas}"
            stuck.append(f"{who}: {label} waits for {names[w[0]]} {w[1]} "
                         f"({done[w]}/{target[w]})")
    rows_moved = sum(label[3] * n for label, n in runs.items() if label[0] == "rows")
    tiles = Counter({label: n for label, n in runs.items() if label[0] != "rows"})
    return DataflowRun(completed=not stuck, makespan=now, tile_runs=tiles,
                       rows_moved=rows_moved, stuck=tuple(stuck))


def weight_reads(tiles: Sequence[tuple[str, int, int]], tile_bytes: dict[str, int],
                 cache_bytes: int, concurrent: int) -> int:
    """The bytes of weight tiles a tile order reads from memory, in a least-recently-used
    model of the L2 cache: ``tiles`` are ``(phase, expert, n_block)`` in the order CTAs start
    them, ``concurrent`` at a time (a grid's worth: the tiles of one such round ask for a
    weight tile once between them); a weight tile (``tile_bytes[phase]``) is read unless it
    is still among the ``cache_bytes`` most recently used. Activations, partitions and
    timing are not modelled: a comparison of orders, not a prediction of bytes."""
    cache: OrderedDict = OrderedDict()
    held = read = 0
    for first in range(0, len(tiles), concurrent):
        for key in dict.fromkeys(tiles[first:first + concurrent]):
            if key in cache:
                cache.move_to_end(key)
                continue
            size = tile_bytes[key[0]]
            read += size
            cache[key] = size
            held += size
            while held > cache_bytes:
                held -= cache.popitem(last=False)[1]
    return read
