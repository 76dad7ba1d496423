"""The device tile scheduler (`scheduler.device.ExpertTileScheduler`) against the host model.

A small kernel lets every CTA walk its tiles exactly as the grouped GEMMs do (pool prefix built
in shared memory from the per-expert counts, then `tile()` for indices cta, cta + S, ...) and
record (expert, m-block, n-block, pool block, valid rows) per tile. CPU: it compiles for both
arches. GPU: the record equals `HostTileScheduler` for every CTA, on uneven, empty, skewed and
decode-sized counts (a few experts of 128), grids smaller and larger than the tile count, with
and without raster bands, with either search for a tile's owner (``owner_search``).
"""

import pytest
import torch

FIELDS = 5  # expert, m_block, n_block, pool_block, valid_m


def _walk_prelude(counts, out, num_experts, block_m, record_words, sequence=None):
    """The walk kernels' start, in every CTA: the pool prefix in shared memory (as the grouped
    GEMMs build it), and the CTA's ``record_words`` of ``out``. Returns (thread, CTA, grid,
    block_start, row_start, record), and with a `DataflowSequence` ``sequence`` its banded
    blocks' prefix last (`build_band_start`; None with one-block bands)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_megamoe.kernels.common.pool import build_pool_prefix

    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    smem = cutlass.memory.SmemAllocator()
    block_start = smem.allocate_tensor(Int32, cute.make_layout(num_experts + 1))
    row_start = smem.allocate_tensor(Int32, cute.make_layout(num_experts + 1))
    band_start = None
    if cutlass.const_expr(sequence is not None and sequence.band > 1):
        band_start = smem.allocate_tensor(Int32, cute.make_layout(num_experts + 1))
    build_pool_prefix(counts, row_start, block_start, num_experts, block_m)
    cute.arch.sync_threads()
    record = cute.make_tensor(out + bidx * record_words, cute.make_layout(record_words))
    if cutlass.const_expr(sequence is None):
        return tidx, bidx, grid, block_start, row_start, record
    if cutlass.const_expr(band_start is not None):
        sequence.build_band_start(block_start, band_start, num_experts)
    return tidx, bidx, grid, block_start, row_start, record, band_start


def _walk_kernel(num_experts: int, block_m: int, num_n: int, max_tiles: int,
                 cluster_m: int = 1, owner_search: str = "linear"):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_megamoe.scheduler.device import ExpertTileScheduler

    class WalkKernel:
        def __init__(self):
            self.scheduler = ExpertTileScheduler(num_experts, block_m, num_n, cluster_m,
                                                 owner_search)

        @cute.jit
        def __call__(self, counts: cute.Pointer, out: cute.Pointer, num_ctas: Int32,
                     raster_group: Int32, stream):
            self.kernel(cute.make_tensor(counts, cute.make_layout(num_experts)), out,
                        raster_group).launch(
                grid=[num_ctas, 1, 1], block=[32, 1, 1], cluster=[cluster_m, 1, 1],
                stream=stream)

        @cute.kernel
        def kernel(self, counts: cute.Tensor, out: cute.Pointer, raster_group: Int32):
            tidx, bidx, grid, block_start, row_start, record = _walk_prelude(
                counts, out, num_experts, block_m, max_tiles * FIELDS)
            rank = Int32(0)
            if cutlass.const_expr(cluster_m > 1):
                rank = cute.arch.block_idx_in_cluster()
            if tidx == 0:
                num_tiles = self.scheduler.num_tiles(block_start)
                tile = bidx // cluster_m
                owner = Int32(0)
                i = Int32(0)
                while tile < num_tiles:
                    owner, expert, m_block, n_block, pool_block, valid_m = self.scheduler.tile(
                        tile, owner, block_start, row_start, raster_group, rank)
                    if i < max_tiles:
                        record[i * FIELDS + 0] = expert
                        record[i * FIELDS + 1] = m_block
                        record[i * FIELDS + 2] = n_block
                        record[i * FIELDS + 3] = pool_block
                        record[i * FIELDS + 4] = valid_m
                    i += 1
                    tile += grid // cluster_m

    return WalkKernel()


@pytest.mark.compile
@pytest.mark.parametrize("arch", ("sm_90a", "sm_100a"))
@pytest.mark.parametrize("cluster_m", (1, 2))
@pytest.mark.parametrize("owner_search", ("linear", "gallop"))
def test_walk_kernel_compiles(arch, cluster_m, owner_search):
    from cutlass import Int32

    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    art = compile_for_arch(_walk_kernel(8, 64, 3, 16, cluster_m, owner_search),
                           fake_ptr(Int32, 4),
                           fake_ptr(Int32, 4),
                           Int32(4), Int32(2), fake_stream(), arch=arch, keep_sass=False)
    assert "st.global" in art.ptx


@pytest.mark.parametrize("arg", ("num_experts", "block_m", "num_n_blocks", "cluster_m"))
@pytest.mark.parametrize("value", (0, -1))
def test_device_scheduler_rejects_zero_sizes(arg, value):
    """A zero size is rejected on the host, by name, before it reaches a kernel (where
    block_m 0 divides by zero and num_n_blocks 0 makes the walk spin)."""
    from cute_megamoe.scheduler.device import ExpertTileScheduler

    sizes = {"num_experts": 8, "block_m": 64, "num_n_blocks": 3, "cluster_m": 1, arg: value}
    with pytest.raises(ValueError, match=f"{arg} must be >= 1"):
        ExpertTileScheduler(**sizes)
    with pytest.raises(ValueError, match="owner_search"):
        ExpertTileScheduler(8, 64, 3, owner_search="binary")


CASES = [  # counts, block_m, n-blocks, CTAs, CTAs per cluster along M, raster band
    ([300, 41, 129, 1, 77, 256, 5, 200], 64, 4, 7, 1, 1),
    ([300, 41, 129, 1, 77, 256, 5, 200], 128, 2, 132, 1, 1),
    ([0, 0, 0, 0], 64, 3, 5, 1, 1),
    ([0, 1, 0, 5, 0, 0, 129, 1], 128, 5, 3, 1, 1),
    ([700, 3, 0, 1, 2, 0, 9, 4] * 4, 64, 1, 16, 1, 1),
    # pairs of pool blocks: odd block counts (a dummy at the end), pairs spanning two experts
    ([300, 41, 129, 1, 77, 256, 5, 200], 128, 2, 132, 2, 1),
    ([0, 1, 0, 5, 0, 0, 129, 1], 128, 5, 4, 2, 1),
    ([0, 0, 0, 0], 64, 3, 6, 2, 1),
    ([700, 3, 0, 1, 2, 0, 9, 4] * 4, 64, 1, 16, 2, 1),
    # raster bands: bands shorter than, equal to and longer than an expert's blocks
    ([300, 41, 129, 1, 77, 256, 5, 200], 64, 4, 7, 1, 2),
    ([700, 3, 0, 1, 2, 0, 9, 4] * 4, 64, 3, 16, 1, 3),
    ([0, 1, 0, 5, 0, 0, 129, 1], 128, 5, 3, 1, 8),
    ([300, 41, 129, 1, 77, 256, 5, 200], 64, 2, 132, 2, 2),
    ([700, 3, 0, 1, 2, 0, 9, 4] * 4, 64, 3, 16, 2, 3),
    ([0, 1, 0, 5, 0, 0, 129, 1], 128, 5, 4, 2, 5),
    # decode: a few experts of many hold a row each (a CTA's first owner lies far along)
    ([1 if e in (3, 40, 41, 77, 100, 126, 127) else 0 for e in range(128)], 64, 16, 132, 1, 1),
    ([1 if e % 17 == 5 else 0 for e in range(128)], 64, 28, 132, 1, 1),
    ([0] * 127 + [2], 64, 4, 5, 1, 1),
]


def test_host_cluster_walk_covers_every_block_once():
    """Clusters of 2: every (pool block, n-block) exactly once over the CTAs; dummies only
    past the last block; the two CTAs of a cluster always at the same n-block."""
    from cute_megamoe.scheduler.host_model import (
        HostTileScheduler,
        grouped_gemm_tiles,
        pool_block_offsets,
    )

    for counts, block_m, num_n, num_ctas, cluster_m, raster in CASES:
        if cluster_m == 1:
            continue
        walks = [list(HostTileScheduler(counts, block_m, 128, num_n * 128, num_ctas, cta,
                                        cluster_m, raster)) for cta in range(num_ctas)]
        real = sorted((t.pool_block, t.n_block, t.expert, t.m_block, t.valid_m)
                      for w in walks for t in w if t.valid_m > 0)
        want = sorted((t.pool_block, t.n_block, t.expert, t.m_block, t.valid_m)
                      for t in grouped_gemm_tiles(counts, block_m, 128, num_n * 128))
        assert real == want
        num_blocks = pool_block_offsets(counts, block_m)[-1]
        assert all(t.pool_block >= num_blocks for w in walks for t in w if t.valid_m == 0)
        for c in range(0, num_ctas, cluster_m):
            pair = walks[c:c + cluster_m]
            assert len({len(w) for w in pair}) == 1
            for tiles in zip(*pair, strict=True):
                assert len({t.n_block for t in tiles}) == 1
                assert [t.pool_block for t in tiles] == list(
                    range(tiles[0].pool_block, tiles[0].pool_block + cluster_m))


def _run_walk(kernel, counts, num_ctas: int, max_tiles: int, fields: int, *extra):
    """Run a walk kernel (`_walk_kernel`, `_dataflow_walk_kernel`) on the GPU over ``counts``
    with ``num_ctas`` CTAs: its record, ``[num_ctas, max_tiles, fields]``, -1 where unwritten."""
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_megamoe.runtime import as_ptr, current_stream

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev_counts = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out = torch.full((num_ctas, max_tiles, fields), -1, dtype=torch.int32, device="cuda")
    args = (as_ptr(dev_counts, align=4), as_ptr(out, align=4), Int32(num_ctas), *extra,
            current_stream())
    cute.compile(kernel, *args)(*args)
    return out.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("owner_search", ("linear", "gallop"))
@pytest.mark.parametrize("counts,block_m,num_n,num_ctas,cluster_m,raster", CASES)
def test_device_walk_matches_host_model(counts, block_m, num_n, num_ctas, cluster_m, raster,
                                        owner_search):
    from cutlass import Int32

    from cute_megamoe.scheduler.host_model import HostTileScheduler

    max_tiles = 64
    got = _run_walk(_walk_kernel(len(counts), block_m, num_n, max_tiles, cluster_m,
                                 owner_search), counts, num_ctas, max_tiles, FIELDS,
                    Int32(raster))
    for cta in range(num_ctas):
        want = [(t.expert, t.m_block, t.n_block, t.pool_block, t.valid_m)
                for t in HostTileScheduler(counts, block_m, 128, num_n * 128, num_ctas,
                                           cta, cluster_m, raster)]
        assert len(want) <= max_tiles
        rows = [tuple(r) for r in got[cta].tolist() if r[0] != -1]
        assert rows == want, f"cta {cta}"


# ----------------------------------------------------------------------------- dataflow walk

DATAFLOW_FIELDS = 6  # is_l2, expert, m_block, n_block, pool_block, valid_m


def _dataflow_walk_kernel(num_experts: int, block_m: int, num_n1: int, num_n2: int, lag: int,
                          max_tiles: int, band: int = 1):
    """Every CTA walks positions cta, cta + S, ... of the dataflow sequence
    (`scheduler.device.DataflowSequence`, bands of ``band`` blocks of one expert, laid out by
    the first warp: the padding's positions skipped), each tile found by its phase's
    scheduler."""
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_megamoe.scheduler.device import DataflowSequence, ExpertTileScheduler

    class DataflowWalkKernel:
        def __init__(self):
            self.sequence = DataflowSequence(num_n1, num_n2, lag, band)
            self.l1 = ExpertTileScheduler(num_experts, block_m, num_n1)
            self.l2 = ExpertTileScheduler(num_experts, block_m, num_n2)

        @cute.jit
        def __call__(self, counts: cute.Pointer, out: cute.Pointer, num_ctas: Int32, stream):
            self.kernel(cute.make_tensor(counts, cute.make_layout(num_experts)), out).launch(
                grid=[num_ctas, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, counts: cute.Tensor, out: cute.Pointer):
            tidx, bidx, grid, block_start, row_start, record, band_start = _walk_prelude(
                counts, out, num_experts, block_m, max_tiles * DATAFLOW_FIELDS, self.sequence)
            if tidx == 0:
                num_blocks = block_start[num_experts]
                end = self.sequence.num_positions(
                    self.sequence.num_banded(block_start, band_start, num_experts))
                position = Int32(bidx)
                owner1 = Int32(0)  # (each phase's walk moves forward alone)
                owner2 = Int32(0)
                i = Int32(0)
                while position < end:
                    is_l2, banded, n = self.sequence.position(
                        position, self.sequence.num_banded(block_start, band_start,
                                                           num_experts))
                    pool_block = self.sequence.pool_block(banded, block_start, band_start,
                                                          num_experts)
                    if pool_block < num_blocks:  # (else an expert's band padding)
                        expert, m_block, n_block, block, valid_m = (Int32(0),) * 5
                        if is_l2 == 0:
                            owner1, expert, m_block, n_block, block, valid_m = self.l1.tile(
                                pool_block * num_n1 + n, owner1, block_start, row_start,
                                Int32(1))
                        else:
                            owner2, expert, m_block, n_block, block, valid_m = self.l2.tile(
                                pool_block * num_n2 + n, owner2, block_start, row_start,
                                Int32(1))
                        if i < max_tiles:
                            first = i * DATAFLOW_FIELDS
                            record[first + 0] = is_l2
                            record[first + 1] = expert
                            record[first + 2] = m_block
                            record[first + 3] = n_block
                            record[first + 4] = block
                            record[first + 5] = valid_m
                        i += 1
                    position += grid

    return DataflowWalkKernel()


def test_host_dataflow_position_is_the_sequence():
    """`host_model.dataflow_position` over the banded blocks (`banded_blocks`) gives every
    entry of `dataflow_sequence`, and an expert's band padding at every other position:
    random counts (empty experts, one row), both BLOCK_Ms, lags from 0 to past the block
    count, bands of 1-4."""
    import random

    from cute_megamoe.scheduler.host_model import (
        banded_blocks,
        dataflow_position,
        dataflow_positions,
        dataflow_sequence,
        pool_block_offsets,
    )

    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.choice((0, 1, rng.randint(0, 700))) for _ in range(rng.randint(1, 10))]
        block_m, n1, n2, lag = rng.choice((64, 128)), rng.randint(1, 5), rng.randint(1, 6), \
            rng.randint(0, 12)
        band = rng.choice((1, 1, 2, 3, 4))
        num_blocks = pool_block_offsets(counts, block_m)[-1]
        banded = banded_blocks(counts, block_m, band)
        seq = dataflow_sequence(counts, block_m, 128, 128 * n1, 128, 128 * n2, lag, band=band)
        assert len(seq) == num_blocks * (n1 + n2)
        by_position = {e.position: (e.phase, e.tile.pool_block, e.tile.n_block) for e in seq}
        for position in range(dataflow_positions(len(banded), n1, n2, band)):
            phase, v, n_block = dataflow_position(position, len(banded), n1, n2, lag, band)
            if banded[v] is None:  # (an expert's band padding)
                assert position not in by_position
            else:
                assert by_position[position] == (phase, banded[v], n_block)
    with pytest.raises(ValueError, match="outside the sequence"):
        dataflow_position(12, 2, 3, 3, 1)
    with pytest.raises(ValueError, match="outside the sequence"):
        dataflow_position(24, 3, 3, 3, 1, band=2)  # (two bands of 2: 24 positions)


DATAFLOW_CASES = [  # counts, block_m, L1 n-blocks, L2 n-blocks, lag, CTAs, band
    ([300, 41, 129, 1, 77, 256, 5, 200], 64, 4, 7, 3, 7, 1),
    ([300, 41, 129, 1, 77, 256, 5, 200], 128, 16, 28, 6, 132, 1),
    ([0, 0, 0, 0], 64, 3, 2, 2, 5, 1),
    ([0, 1, 0, 5, 0, 0, 129, 1], 128, 5, 3, 9, 3, 1),  # lag past the block count
    ([700, 3, 0, 1, 2, 0, 9, 4] * 4, 64, 2, 3, 0, 16, 1),
    ([300, 41, 129, 1, 77, 256, 5, 200], 64, 4, 7, 2, 9, 3),  # bands, each expert's padded
    ([700, 3, 0, 1, 2, 0, 9, 4] * 4, 128, 16, 28, 2, 132, 4),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ("sm_90a", "sm_100a"))
def test_dataflow_walk_kernel_compiles(arch):
    from cutlass import Int32

    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    art = compile_for_arch(_dataflow_walk_kernel(8, 64, 3, 5, 2, 16, band=3), fake_ptr(Int32, 4),
                           fake_ptr(Int32, 4), Int32(4), fake_stream(), arch=arch,
                           keep_sass=False)
    assert "st.global" in art.ptx


@pytest.mark.gpu
@pytest.mark.parametrize("counts,block_m,num_n1,num_n2,lag,num_ctas,band", DATAFLOW_CASES)
def test_device_dataflow_walk_matches_host_model(counts, block_m, num_n1, num_n2, lag,
                                                 num_ctas, band):
    from cute_megamoe.scheduler.host_model import PHASE_L2, dataflow_tile_walk

    max_tiles = 96
    got = _run_walk(_dataflow_walk_kernel(len(counts), block_m, num_n1, num_n2, lag,
                                          max_tiles, band), counts, num_ctas, max_tiles,
                    DATAFLOW_FIELDS)
    for cta in range(num_ctas):
        want = [(int(e.phase == PHASE_L2), e.tile.expert, e.tile.m_block, e.tile.n_block,
                 e.tile.pool_block, e.tile.valid_m)
                for e in dataflow_tile_walk(counts, block_m, 128, num_n1 * 128, 128,
                                            num_n2 * 128, num_ctas, cta, lag, band=band)]
        assert len(want) <= max_tiles
        rows = [tuple(r) for r in got[cta].tolist() if r[0] != -1]
        assert rows == want, f"cta {cta}"
