"""The dataflow kernel's schedule (issue 65, docs/notes/dataflow.md) on the CPU: the lag-ordered
walk covers every tile once, and the discrete-event model of its waits completes under every
routing and grid with the ring the note's argument asks for, and deadlocks with one slot less."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from cute_megamoe.layout.dataflow import OUT_RING_ROWS, ROW_RING_ROWS
from cute_megamoe.scheduler import (
    banded_blocks,
    dataflow_lag,
    dataflow_sequence,
    dataflow_tile_walk,
    fused_tile_walk,
    grouped_gemm_tiles,
    min_ring_slots,
    num_m_blocks,
)
from cute_megamoe.testing.dataflow_model import (
    DataflowCosts,
    block_sources,
    simulate_dataflow,
    weight_reads,
)

# small tiles: L1 2 n-blocks (n1), L2 3 (n2)
SHAPE = (64, 256, 512, 256, 768)
N1, N2 = 2, 3
COUNT_CASES = {
    "random": [random.Random(7).randrange(0, 300) for _ in range(9)],
    "skewed": [0, 3, 1000, 0, 2, 1],
    "empty": [0] * 5,
    "single_row": [0, 1, 0],
    "exact": [64, 128, 192],
}


def _expected_runs(counts: list[int], block_m: int) -> Counter:
    blocks = sum(num_m_blocks(c, block_m) for c in counts)
    return Counter({(phase, b, nb): 1 for b in range(blocks)
                    for phase, n in (("l1", N1), ("l2", N2)) for nb in range(n)})


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("lag", [0, 1, 3, 50])
def test_the_sequence_is_lag_ordered_and_has_every_tile_once(case, lag):
    counts = COUNT_CASES[case]
    seq = dataflow_sequence(counts, *SHAPE, lag)
    l1 = grouped_gemm_tiles(counts, 64, 256, 512)
    l2 = grouped_gemm_tiles(counts, 64, 256, 768)
    assert [s.tile for s in seq if s.phase == "l1"] == l1  # L1 tiles keep today's order
    assert [s.tile for s in seq if s.phase == "l2"] == l2
    assert [s.position for s in seq] == list(range(len(l1) + len(l2)))
    num_blocks = len(l1) // N1
    for s in seq:
        assert s.ring_slot == s.tile.pool_block % (lag + 1)
    # L2 of block b starts after the L1 of blocks 0 .. min(b + lag, B - 1) and the L2 of
    # blocks 0 .. b - 1: lag * n1 L1 tiles after its own L1 (fewer at the tail)
    for b in range(num_blocks):
        first = next(s.position for s in seq if s.phase == "l2" and s.tile.pool_block == b)
        assert first == (min(b + lag, num_blocks - 1) + 1) * N1 + b * N2


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("num_ctas", [1, 3, 7, 132])
def test_the_walks_split_the_sequence_round_robin(case, num_ctas):
    counts = COUNT_CASES[case]
    seq = dataflow_sequence(counts, *SHAPE, 2, ring_slots=5)
    walks = [dataflow_tile_walk(counts, *SHAPE, num_ctas, c, 2, ring_slots=5)
             for c in range(num_ctas)]
    assert sorted((s for w in walks for s in w), key=lambda s: s.position) == seq
    for c, w in enumerate(walks):
        assert [s.position for s in w] == list(range(c, len(seq), num_ctas))
        assert all(s.ring_slot == s.tile.pool_block % 5 for s in w)


def test_a_lag_past_the_last_block_is_todays_fused_walk():
    """With the lag past the last pool block every L2 tile follows every L1 tile: the fused
    kernel's walk today (`fused_tile_walk`, no raster groups)."""
    counts = [3, 0, 130, 64, 1]
    for num_ctas in (1, 5, 132):
        for c in range(num_ctas):
            walk = dataflow_tile_walk(counts, *SHAPE, num_ctas, c, lag=100)
            assert [(s.phase, s.tile) for s in walk] == fused_tile_walk(counts, *SHAPE,
                                                                       num_ctas, c)


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("band,lag", [(2, 0), (3, 1), (4, 2), (4, 50)])
def test_banded_sequences_read_each_weight_tile_at_neighbouring_positions(case, band, lag):
    """Bands of ``band`` blocks of one expert (`banded_blocks`: each expert's blocks padded to
    a multiple of ``band``): every tile once, positions counting the padding; a band's blocks
    are one expert's, each phase's experts in position order; inside a band's L1 (L2) tiles
    the n-block is slowest, so the band's blocks take one weight tile at consecutive
    positions; a band's L2 tiles come right after the L1 tiles of the band ``lag`` later (its
    own L1 when that is past the end)."""
    counts = COUNT_CASES[case]
    seq = dataflow_sequence(counts, *SHAPE, lag, band=band)
    assert Counter((s.phase, s.tile.pool_block, s.tile.n_block) for s in seq) == \
        _expected_runs(counts, 64)
    banded = banded_blocks(counts, 64, band)
    assert [b for b in banded if b is not None] == list(range(sum(num_m_blocks(c, 64)
                                                                  for c in counts)))
    assert len(banded) % band == 0
    bands = len(banded) // band
    unit = {b: v // band for v, b in enumerate(banded) if b is not None}
    assert len({s.position for s in seq}) == len(seq)
    assert all(0 <= s.position < len(banded) * (N1 + N2) for s in seq)
    for s in seq:
        assert s.ring_slot == s.tile.pool_block % min_ring_slots(lag, band)
    for phase in ("l1", "l2"):  # (what the kernel's owner hints rely on: any CTA's positions
        # of a phase, an increasing subsequence, meet its experts in order)
        experts = [s.tile.expert for s in seq if s.phase == phase]
        assert experts == sorted(experts)
    for u in range(bands):
        assert len({s.tile.expert for s in seq if unit[s.tile.pool_block] == u}) <= 1
        for phase in ("l1", "l2"):
            mine = [s for s in seq if s.phase == phase and unit[s.tile.pool_block] == u]
            assert [s.tile.n_block for s in mine] == sorted(s.tile.n_block for s in mine)
            assert all(b.position - a.position == 1 for a, b in zip(mine, mine[1:], strict=False)
                       if a.tile.n_block == b.tile.n_block)
        assert any(b is not None for b in banded[u * band:(u + 1) * band])
        l2 = min(s.position for s in seq if s.phase == "l2" and unit[s.tile.pool_block] == u)
        l1_after = max(s.position for s in seq if s.phase == "l1"
                       and unit[s.tile.pool_block] == min(u + lag, bands - 1))
        assert l1_after < l2 and all(not (l1_after < s.position < l2) or s.phase == "l2"
                                     for s in seq)


@pytest.mark.parametrize("band", [1, 2, 4])
def test_the_model_completes_banded_walks_with_their_ring(band):
    """With bands the L1-output ring needs ``(lag + 1) * band`` slots (`min_ring_slots`);
    the model completes every routing on small and large grids with that ring."""
    for case in ("random", "skewed", "single_row"):
        for num_ctas in (1, 5, 40):
            lag = dataflow_lag(num_ctas, N1, N2, band=band)
            result = simulate_dataflow(COUNT_CASES[case], *SHAPE, num_ctas, lag,
                                       ring_slots=min_ring_slots(lag, band), band=band)
            assert result.completed, (case, num_ctas, band, result.stuck)


def test_lag_and_ring_rules():
    assert [min_ring_slots(lag) for lag in (0, 1, 6)] == [1, 2, 7]
    assert min_ring_slots(2, band=4) == 12 and dataflow_lag(132, 16, 28, band=4) == 2
    # DeepSeek-V3 at BLOCK_M 128: L1 4096 / 256 = 16 tiles, L2 7168 / 256 = 28 per block
    assert dataflow_lag(132, 16, 28) == 6 and dataflow_lag(1, 16, 28) == 1
    assert dataflow_lag(132, 16, 28, grids=1) == 3
    # the layout's L1-output ring holds the lag with slack at both BLOCK_Ms
    assert OUT_RING_ROWS // 128 >= dataflow_lag(132, 16, 28) + 3
    assert ROW_RING_ROWS // 128 == 128
    with pytest.raises(ValueError, match="lag"):
        min_ring_slots(-1)
    with pytest.raises(ValueError, match="ring_slots"):
        dataflow_sequence([5], *SHAPE, 1, ring_slots=0)
    with pytest.raises(ValueError, match="cta"):
        dataflow_tile_walk([5], *SHAPE, 4, 4, 1)


def test_block_sources_follow_the_pool_order():
    """Sources take turns, one row each in rank order (the dispatch's pool order)."""
    assert block_sources([3, 1, 2], 4) == [{0: 2, 1: 1, 2: 1}, {0: 1, 2: 1}]
    assert block_sources([0, 0], 4) == []
    assert sum(sum(b.values()) for b in block_sources([100, 0, 37], 16)) == 137


def _random_case(rng: random.Random) -> dict:
    experts = rng.randrange(1, 10)
    kind = rng.choice(["uniform", "skewed", "hot", "zeros"])
    if kind == "hot":  # one expert takes everything
        counts = [0] * experts
        counts[rng.randrange(experts)] = rng.randrange(1, 1500)
    elif kind == "zeros":
        counts = [rng.choice([0, 0, rng.randrange(1, 200)]) for _ in range(experts)]
    elif kind == "skewed":
        counts = [int(rng.paretovariate(1.2) * 20) for _ in range(experts)]
    else:
        counts = [rng.randrange(0, 400) for _ in range(experts)]
    ranks = rng.randrange(1, 9)
    sources = []
    for c in counts:  # split each expert's rows over the source ranks, some ranks sending 0
        cuts = sorted(rng.randrange(0, c + 1) for _ in range(ranks - 1))
        sources.append([b - a for a, b in zip([0] + cuts, cuts + [c], strict=True)])
    lag = rng.randrange(0, 7)
    return dict(expert_counts=counts, block_m=rng.choice([16, 32, 64]), l1_block_n=256,
                l1_n=512, l2_block_n=256, l2_n=768, num_ctas=rng.randrange(1, 133), lag=lag,
                ring_slots=min_ring_slots(lag), row_slots=rng.choice([None, 1, 2, 5]),
                sources=sources, assignment=rng.choice(["static", "ticket"]),
                costs=DataflowCosts(row=rng.choice([0.0, 0.01, 0.5])),
                jitter=rng.choice([0.0, 1.0]), seed=rng.randrange(1000))


def test_no_deadlock_over_random_routings_with_the_minimal_ring():
    """600 seeded routings (uniform, skewed, one expert taking everything, 0 rows), 1 to 8
    source ranks, BLOCK_M 16-64, 1 to 132 CTAs, lags 0-6 with ``lag + 1`` slots, row rings of
    1 to 5 slots or none, both assignments: every run completes, each tile once, every row
    moved once. The same cases with one slot less deadlock now and then (9 of the 510 with a
    lag, small grids: the model can fail)."""
    rng = random.Random(65)
    completed = deadlocked = 0
    for _ in range(600):
        case = _random_case(rng)
        run = simulate_dataflow(**case)
        assert run.completed, (case, run.stuck)
        assert run.tile_runs == _expected_runs(case["expert_counts"], case["block_m"])
        assert run.rows_moved == sum(case["expert_counts"])
        completed += 1
        if case["lag"] >= 1:
            deadlocked += not simulate_dataflow(**{**case, "ring_slots": case["lag"]}).completed
    assert completed == 600
    assert deadlocked == 9


@pytest.mark.parametrize("assignment", ["static", "ticket"])
def test_degenerate_routings_complete_on_every_grid(assignment):
    """One expert taking every row, a single row, no rows at all; grids of 1 to 132 CTAs;
    one-slot row ring, minimal L1-output ring."""
    for counts in ([0, 0, 777, 0], [0, 1, 0], [0, 0, 0]):
        for num_ctas in range(1, 133):
            run = simulate_dataflow(counts, *SHAPE, num_ctas, lag=2, row_slots=1,
                                    assignment=assignment)
            assert run.completed, (counts, num_ctas, run.stuck)
            assert run.tile_runs == _expected_runs(counts, 64)
            if not any(counts):
                assert run.makespan == 0.0 and run.rows_moved == 0


@pytest.mark.parametrize("lag", [1, 2, 4])
def test_one_slot_less_than_lag_plus_one_deadlocks(lag):
    """The bound is tight: with ``lag`` slots, L1 of block ``lag`` waits for L2 of block 0,
    which comes after it. A grid of at most ``n1 + n2 - 1`` CTAs (static) or ``n1`` (tickets)
    deadlocks; larger grids happen to pass. A pool with no more than ``lag`` blocks never
    reuses a slot."""
    counts = [300, 5, 0, 200]  # 10 pool blocks at BLOCK_M 64
    for assignment, worst in (("static", N1 + N2 - 1), ("ticket", N1)):
        passes = [simulate_dataflow(counts, *SHAPE, g, lag, ring_slots=lag,
                                    assignment=assignment).completed for g in range(1, 12)]
        assert passes == [g > worst for g in range(1, 12)], assignment
    run = simulate_dataflow(counts, *SHAPE, 1, lag, ring_slots=lag)
    assert run.stuck == (f"CTA 0: ('l1', {lag}, 0) waits for L2 tiles of block 0 (0/{N2})",)
    assert sum(run.tile_runs.values()) == lag * N1
    assert simulate_dataflow([64 * lag], *SHAPE, 1, lag, ring_slots=lag).completed


def test_senders_that_share_the_ctas_deadlock_with_a_row_ring():
    """Why the rows need senders of their own: CTAs that move their share of the rows before
    their tiles (today's order) wait for a slot whose L1 tiles no CTA has started; with a whole
    pool (no back-pressure) the same order completes."""
    counts, sources = [300, 5, 0, 200], [[100, 200], [5, 0], [0, 0], [100, 100]]
    for assignment in ("static", "ticket"):
        stuck = simulate_dataflow(counts, *SHAPE, 4, 2, row_slots=3, sources=sources,
                                  senders_on_ctas=True, assignment=assignment)
        assert not stuck.completed and len(stuck.stuck) == 4
        assert all("waits for L1 tiles of block" in line for line in stuck.stuck)
        assert stuck.rows_moved < sum(counts)
        ok = simulate_dataflow(counts, *SHAPE, 4, 2, row_slots=None, sources=sources,
                               senders_on_ctas=True, assignment=assignment)
        assert ok.completed and ok.rows_moved == sum(counts)


def test_makespan_at_the_deepseek_v3_ep8_shape():
    """One rank's balanced share at EP8, 8192 tokens (32 experts x 2048 rows), BLOCK_M 128,
    16 L1 and 28 L2 tiles per block, 132 CTAs; time in L2 tiles (an L1 tile is 3.5). The lower
    bound is the work over the grid. Tickets at the default lag (6) with 3 slots of slack come
    within 1 %; the minimal ring (lag + 1) makes each L1 wait for the L2 tiles right before
    it; static round-robin puts 16 of every 44 positions, L1 tiles only, on the same 48 CTAs
    (132 = 3 x 44) and runs 1.8x the bound. Abstract units: nothing here is measured."""
    counts, shape = [2048] * 32, (128, 256, 4096, 256, 7168)
    bound = 512 * (16 * 3.5 + 28) / 132
    lag = dataflow_lag(132, 16, 28)
    best = simulate_dataflow(counts, *shape, 132, lag, ring_slots=lag + 3)
    minimal = simulate_dataflow(counts, *shape, 132, lag)
    static = simulate_dataflow(counts, *shape, 132, lag, ring_slots=lag + 3,
                               assignment="static")
    assert best.completed and minimal.completed and static.completed
    assert best.makespan / bound == pytest.approx(1.0067, abs=1e-3)
    assert minimal.makespan / bound == pytest.approx(1.1832, abs=1e-3)
    assert static.makespan / bound == pytest.approx(1.8292, abs=1e-3)
    # with senders: 8 source ranks, a 16-slot row ring, rows moved in 18 % of the GEMM time
    senders = simulate_dataflow(counts, *shape, 132, lag, ring_slots=lag + 3, row_slots=16,
                                sources=[[256] * 8] * 32, costs=DataflowCosts(row=0.0072))
    assert senders.completed and senders.makespan / bound < 1.01


def test_a_decode_call_wants_its_first_grid_of_positions_all_l1():
    """One token (8 experts of 128 with one row each, BLOCK_M 64): 128 L1 and 224 L2 tiles on
    132 CTAs. At the default lag (6 blocks: 96 L1 positions, then L2 tiles of block 0) the
    last two blocks' L1 tiles start a round late, 9 units against the 5.5 (one L1 tile, two
    rounds of L2 tiles) once every L1 tile comes first (lag 7 here; any call's first 132
    positions are L1 tiles from ``(lag + 1) * 16 >= 132`` on: 8). The measured ticket walk took
    1.10x the phase walk's time at one token (H200, `layer-20261207T180425.json`). Abstract
    units: nothing here is measured."""
    counts = [0] * 128
    for e in (3, 17, 40, 41, 77, 90, 101, 126):
        counts[e] = 1
    shape = (64, 256, 4096, 256, 7168)
    assert dataflow_lag(132, 16, 28) == 6
    runs = {lag: simulate_dataflow(counts, *shape, 132, lag) for lag in (6, 7, 9, 12)}
    assert all(run.completed for run in runs.values())
    assert [runs[lag].makespan for lag in (6, 7, 9, 12)] == [9.0, 5.5, 5.5, 5.5]


def test_weight_reads_of_the_walks_at_8192_tokens():
    """An LRU model of a 40 MB L2 cache (`weight_reads`), 132 tiles at a time, one rank of 128
    experts at 8192 tokens x 8 (about 4.5 blocks of 128 per expert), DeepSeek-V3 tiles
    (FP8 weight tiles of 1.75 / 0.5 MiB): the phase walk (raster bands of 18 / 64 blocks,
    within an expert) reads each weight tile once; the ticket walk with one-block bands reads
    an expert's tiles again for later blocks of the expert (once the other phase's tiles in
    between evict them), about 1.75x; bands of 8 blocks of one expert read them once again.
    The measured ticket walk (one-block bands) took 1.04x the phase walk's time at 8192
    (H200, `layer-20261207T180425.json`). Abstract: a comparison of orders, not bytes."""
    rng = random.Random(1)
    counts = [0] * 128
    for _ in range(8192 * 8):
        counts[rng.randrange(128)] += 1
    shape = (128, 256, 4096, 256, 7168)
    tile_bytes = {"l1": 256 * 7168, "l2": 256 * 2048}
    once = sum(1 for c in counts if c) * (16 * tile_bytes["l1"] + 28 * tile_bytes["l2"])

    def reads(order):
        return weight_reads(order, tile_bytes, 40 << 20, 132) / once

    phases = [("l1", t.expert, t.n_block) for t in grouped_gemm_tiles(counts, 128, 256, 4096,
                                                                      18)]
    phases += [("l2", t.expert, t.n_block) for t in grouped_gemm_tiles(counts, 128, 256, 7168,
                                                                       64)]

    def tickets(lag, band):
        return [(s.phase, s.tile.expert, s.tile.n_block)
                for s in dataflow_sequence(counts, *shape, lag, band=band)]

    assert reads(phases) == 1.0
    assert reads(tickets(dataflow_lag(132, 16, 28), 1)) == pytest.approx(1.75, abs=0.05)
    assert reads(tickets(dataflow_lag(132, 16, 28, band=8), 8)) == 1.0


@pytest.mark.parametrize("tokens", [4096, 8192])
def test_bands_of_8_want_a_lag_of_6_bands(tokens):
    """Bands of 8 blocks of one expert read the weights once, but `dataflow_lag` counts full
    bands: at 4096 tokens an expert has about 2.5 blocks, so lag_grids 2 (1 band) or 4 (2)
    leaves L2 positions a few real blocks behind their L1, and CTAs wait for it (the model,
    no ring: 1.34x / 1.04x the bound); lag_grids 16 (6 bands) stays within 1.005x from 2048
    tokens up, weights still read once. One-block bands at lag 6: within 1.015x, reads 1.25x
    (4096) / 1.75x (8192). Abstract units, as above."""
    rng = random.Random(1)
    counts = [0] * 128
    for _ in range(tokens * 8):
        counts[rng.randrange(128)] += 1
    shape = (128, 256, 4096, 256, 7168)
    tile_bytes = {"l1": 256 * 7168, "l2": 256 * 2048}
    once = sum(1 for c in counts if c) * (16 * tile_bytes["l1"] + 28 * tile_bytes["l2"])
    bound = sum(num_m_blocks(c, 128) for c in counts) * (16 * 3.5 + 28) / 132

    def run(lag_grids, band):
        lag = dataflow_lag(132, 16, 28, lag_grids, band)
        order = [(s.phase, s.tile.expert, s.tile.n_block)
                 for s in dataflow_sequence(counts, *shape, lag, band=band)]
        span = simulate_dataflow(counts, *shape, 132, lag, ring_slots=1 << 20, band=band)
        return span.makespan / bound, weight_reads(order, tile_bytes, 40 << 20, 132) / once

    assert dataflow_lag(132, 16, 28, 16, 8) == 6
    span, reads = run(16, 8)
    assert span <= 1.005 and reads == 1.0
    assert run(2, 8)[0] > 1.03 and run(4, 8)[0] > (1.03 if tokens == 4096 else 1.0)
    span, reads = run(2, 1)
    assert span <= 1.015 and reads > 1.2


def test_the_note_states_the_bound_and_the_sizes_the_code_gives():
    """docs/notes/dataflow.md: at most 150 lines, and its numbers are the code's."""
    from cute_megamoe.layout.dataflow import dataflow_buffer_bytes

    note = (Path(__file__).resolve().parent.parent / "docs/notes/dataflow.md").read_text()
    assert len(note.splitlines()) <= 150
    total = dataflow_buffer_bytes(8, 256, 8192, 8, 7168, 2048)["total"] / 2**20
    assert f"**{total:.1f} ({total / 1024:.2f} GiB)**" in note
    lag = dataflow_lag(132, 16, 28)
    assert "`S >= lag + 1`" in note and f"dataflow_lag(132, 16, 28) = {lag}" in note


@pytest.mark.parametrize("band,row_slots", [(1, 2), (2, 4), (2, 5)])
def test_late_l1_signals_go_out_first_a_row_ring_away(band, row_slots):
    """The kernel's consumers signal an L1 tile one tile late (after their next L1 tile's
    mainloop). With a row ring that alone deadlocks: a CTA whose next L1 tile lies a ring
    ahead waits for rows whose slot waits for the signal it holds (found under jittered
    timings with tickets). The kernel's rule, signal first when the next L1 block is at least
    ``row_slots - band`` later (`Sm90MegaMoEKernel.consume_by_ticket`), completes every run."""
    counts = [300, 5, 0, 200, 700, 64, 1, 900]
    runs = {far: [simulate_dataflow(counts, *SHAPE, grid, 2, row_slots=row_slots, band=band,
                                    jitter=8.0, seed=seed, late_signals=True, signal_far=far)
                  for seed in range(40) for grid in (2, 3, 5)]
            for far in (None, row_slots - band)}
    assert any(not run.completed for run in runs[None])
    assert all("waits for" in line for run in runs[None] for line in run.stuck)
    assert all(run.completed for run in runs[row_slots - band])
    assert all(run.tile_runs == runs[row_slots - band][0].tile_runs
               for run in runs[row_slots - band])
