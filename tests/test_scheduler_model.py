"""Host scheduler model: tile coverage, pool offsets, valid rows, waves, device-style walks."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cute_megamoe.heuristics import (
    expected_tokens_per_expert,
    experts_per_wave,
    get_num_sms,
    normalize_arch,
    select_block_m,
)
from cute_megamoe.scheduler import (
    HostMegaMoETileScheduler,
    HostTileScheduler,
    Tile,
    assign_tiles,
    grouped_gemm_tiles,
    mega_moe_tile_sequence,
    num_m_blocks,
    pool_block_offsets,
    raster_order,
    waves,
)

_rng = random.Random(1234)
COUNT_CASES = {
    "random": [_rng.randrange(0, 300) for _ in range(12)],
    "skewed": [0, 3, 1000, 0, 2, 1],  # one hot expert
    "empty": [0] * 7,
    "single": [517],
    "primes": [97, 1, 251, 13, 0, 389, 7],  # multiples of nothing
    "exact": [64, 128, 192],
}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("block_m", [16, 64, 192])
def test_pool_block_offsets_are_prefix_sums(case, block_m):
    counts = COUNT_CASES[case]
    offsets = pool_block_offsets(counts, block_m)
    assert len(offsets) == len(counts) + 1 and offsets[0] == 0
    for e, c in enumerate(counts):
        assert offsets[e + 1] - offsets[e] == _ceil(c, block_m)
    assert offsets[-1] == sum(_ceil(c, block_m) for c in counts)
    assert pool_block_offsets(torch.tensor(counts, dtype=torch.int32), block_m) == offsets


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("block_m, block_n, n", [(16, 128, 256), (64, 128, 512), (192, 64, 64)])
def test_grouped_gemm_tiles(case, block_m, block_n, n):
    counts = COUNT_CASES[case]
    tiles = grouped_gemm_tiles(counts, block_m, block_n, n)
    num_n = n // block_n
    offsets = pool_block_offsets(counts, block_m)
    assert len(tiles) == offsets[-1] * num_n
    assert len(set(tiles)) == len(tiles)
    # Expert-major, then m, then n (n fastest): the order is lexicographic.
    keys = [(t.expert, t.m_block, t.n_block) for t in tiles]
    assert keys == sorted(keys)
    for t in tiles:
        assert t.pool_block == offsets[t.expert] + t.m_block
        assert t.valid_m == min(block_m, counts[t.expert] - t.m_block * block_m) > 0
    # valid_m over the m-blocks of one n-column sums to each expert's count.
    for e, c in enumerate(counts):
        assert sum(t.valid_m for t in tiles if t.expert == e and t.n_block == 0) == c
    # Pool blocks are dense: every block from 0 to the total appears.
    assert sorted({t.pool_block for t in tiles}) == list(range(offsets[-1]))


@pytest.mark.parametrize("num_tiles, num_ctas", [(0, 4), (5, 8), (100, 7), (132, 132), (1, 1)])
def test_assign_tiles_every_tile_once(num_tiles, num_ctas):
    parts = assign_tiles(num_tiles, num_ctas)
    assert len(parts) == num_ctas
    flat = sorted(itertools.chain.from_iterable(parts))
    assert flat == list(range(num_tiles))
    for c, part in enumerate(parts):
        assert part == list(range(c, num_tiles, num_ctas))


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("num_ctas", [1, 3, 8, 132])
@pytest.mark.parametrize("raster_group", [1, 2, 5])
def test_host_tile_scheduler_matches_list(case, num_ctas, raster_group):
    counts = COUNT_CASES[case]
    block_m, block_n, n = 64, 128, 384
    tiles = grouped_gemm_tiles(counts, block_m, block_n, n, raster_group)
    parts = assign_tiles(len(tiles), num_ctas)
    seen: list[Tile] = []
    for cta in range(num_ctas):
        walked = list(HostTileScheduler(counts, block_m, block_n, n, num_ctas, cta,
                                        raster_group=raster_group))
        assert walked == [tiles[i] for i in parts[cta]]
        seen += walked
    key = lambda t: (t.expert, t.m_block, t.n_block)  # noqa: E731
    assert sorted(seen, key=key) == sorted(grouped_gemm_tiles(counts, block_m, block_n, n),
                                           key=key)


@pytest.mark.parametrize("num_groups,num_n,raster_group", [(1, 3, 1), (7, 3, 1), (7, 3, 2),
                                                           (7, 3, 7), (7, 3, 9), (16, 28, 4)])
def test_raster_order(num_groups, num_n, raster_group):
    """Every (group, n-block) once; inside a band the n-blocks go in order with the band's
    groups fastest, so the tiles of one n-block (one weight tile) are neighbours."""
    order = raster_order(num_groups, num_n, raster_group)
    assert sorted(order) == [(g, nb) for g in range(num_groups) for nb in range(num_n)]
    pos = 0
    for first in range(0, num_groups, raster_group):
        band = list(range(first, min(first + raster_group, num_groups)))
        for nb in range(num_n):
            assert order[pos:pos + len(band)] == [(g, nb) for g in band]
            pos += len(band)
    if raster_group == 1:
        assert order == [(g, nb) for g in range(num_groups) for nb in range(num_n)]


@pytest.mark.parametrize("num_local_experts, per_wave", [(7, 1), (7, 3), (7, 7), (8, 4), (8, 9)])
def test_waves_partition_experts(num_local_experts, per_wave):
    ws = waves(num_local_experts, per_wave)
    assert [e for w in ws for e in w] == list(range(num_local_experts))
    assert all(1 <= len(w) <= per_wave for w in ws)
    assert all(len(w) == per_wave for w in ws[:-1])


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("per_wave", [1, 2, 5, 100])
def test_mega_moe_tile_sequence(case, per_wave):
    counts = COUNT_CASES[case]
    block_m, l1_bn, l1_n, l2_bn, l2_n = 32, 128, 512, 128, 256
    seq = mega_moe_tile_sequence(counts, block_m, l1_bn, l1_n, l2_bn, l2_n, per_wave)
    l1 = grouped_gemm_tiles(counts, block_m, l1_bn, l1_n)
    l2 = grouped_gemm_tiles(counts, block_m, l2_bn, l2_n)
    # Each phase's tiles appear exactly once, in grouped-GEMM order.
    assert [t for p, t in seq if p == "l1"] == l1
    assert [t for p, t in seq if p == "l2"] == l2
    # Wave structure: L1(w), L2(w) for each wave, in wave order.
    expected = []
    for w in waves(len(counts), per_wave):
        expected += [("l1", t) for t in l1 if t.expert in w]
        expected += [("l2", t) for t in l2 if t.expert in w]
    assert seq == expected
    # Each wave's L2 tiles come after all of that wave's L1 tiles.
    last_l1 = {}
    for pos, (p, t) in enumerate(seq):
        if p == "l1":
            last_l1[t.expert] = pos
    for pos, (p, t) in enumerate(seq):
        if p == "l2":
            w = t.expert // per_wave
            assert all(last_l1.get(e, -1) < pos for e in range(len(counts)) if e // per_wave == w)


@pytest.mark.parametrize("case", COUNT_CASES)
@pytest.mark.parametrize("per_wave, num_ctas", [(1, 4), (3, 132), (100, 7), (2, 1)])
def test_host_mega_moe_scheduler_matches_list(case, per_wave, num_ctas):
    counts = COUNT_CASES[case]
    args = (counts, 64, 128, 512, 128, 256, per_wave)
    seq = mega_moe_tile_sequence(*args)
    parts = assign_tiles(len(seq), num_ctas)
    total = 0
    for cta in range(num_ctas):
        walked = list(HostMegaMoETileScheduler(*args, num_ctas=num_ctas, cta=cta))
        assert walked == [seq[i] for i in parts[cta]]
        total += len(walked)
    assert total == len(seq)


def test_scheduler_argument_checks():
    with pytest.raises(ValueError, match="block_n"):
        grouped_gemm_tiles([1, 2], 64, 128, 200)
    with pytest.raises(ValueError, match="expert_counts"):
        pool_block_offsets([1, -1], 64)
    with pytest.raises(ValueError, match="block_m"):
        pool_block_offsets([1], 0)
    with pytest.raises(ValueError, match="cta"):
        HostTileScheduler([1], 64, 128, 128, num_ctas=4, cta=4)
    assert pool_block_offsets([], 64) == [0]
    assert grouped_gemm_tiles([], 64, 128, 128) == []


@pytest.mark.parametrize("block_m", [0, -64])
def test_zero_or_negative_block_size_is_a_clear_error(block_m):
    """A zero block size names the argument instead of raising a bare ZeroDivisionError."""
    for call in (
        lambda: num_m_blocks(5, block_m),
        lambda: pool_block_offsets([5, 3], block_m),
        lambda: grouped_gemm_tiles([5, 3], block_m, 128, 256),
        lambda: mega_moe_tile_sequence([5, 3], block_m, 128, 256, 128, 256, 1),
        lambda: HostTileScheduler([5, 3], block_m, 128, 256, num_ctas=2, cta=0),
        lambda: HostMegaMoETileScheduler([5, 3], block_m, 128, 256, 128, 256, 1, 2, 0),
    ):
        with pytest.raises(ValueError, match=r"block_m must be >= 1"):
            call()
    with pytest.raises(ValueError, match=r"block_n must be >= 1"):
        grouped_gemm_tiles([5], 64, block_m, 256)
    with pytest.raises(ValueError, match=r"raster_group must be >= 1"):
        raster_order(3, 2, block_m)
    with pytest.raises(ValueError, match=r"experts_per_wave must be >= 1"):
        waves(4, block_m)
    with pytest.raises(ValueError, match=r"num_ctas must be >= 1"):
        assign_tiles(4, block_m)
    with pytest.raises(ValueError, match=r"count must be >= 0"):
        num_m_blocks(-1, 64)
    with pytest.raises(TypeError, match=r"block_m must be an int"):
        num_m_blocks(5, 64.0)
    assert num_m_blocks(0, 64) == 0 and num_m_blocks(5, 1) == 5 and num_m_blocks(65, 64) == 2


# ---------------------------------------------------------------------------- heuristics


def test_heuristics_block_m():
    assert expected_tokens_per_expert(64, 8, 6, 384) == 8.0
    assert select_block_m(0.1, "sm100") == 64
    assert select_block_m(64.0, "sm100") == 64
    assert select_block_m(96.0, "sm100") == 128
    assert select_block_m(1024.0, "sm_100a") == 256
    assert select_block_m(8.0, "sm90") == 64
    assert select_block_m(1024.0, "sm90a") == 128
    for arch in ("sm90", "sm100"):
        prev = 0
        for x in [0, 1, 5, 9, 17, 33, 65, 97, 200, 10**6]:
            bm = select_block_m(float(x), arch)
            assert bm >= prev
            prev = bm
    with pytest.raises(ValueError):
        normalize_arch("sm80")


def test_heuristics_cluster_m():
    from cute_megamoe.heuristics import select_cluster_m

    # sm90: weight multicast in 2-CTA clusters at BLOCK_M 128 with 256-column tiles only
    assert select_cluster_m("sm_90a", "l2", 128, 7168) == 2
    assert select_cluster_m("sm_90a", "l2", 128, 7168 - 128) == 1  # 128-column tiles
    assert select_cluster_m("sm_90a", "l1", 128, 4096) == 2
    assert select_cluster_m("sm_90a", "l1", 64, 4096) == 1
    assert select_cluster_m("sm_90a", "l2", 64, 7168) == 1
    assert select_cluster_m("sm_100a", "l2", 128, 7168) == 1
    if not torch.cuda.is_available():
        assert get_num_sms() == 132 and get_num_sms(default=148) == 148



def test_heuristics_sm90_transposed():
    """The transposed sm_90a mainloop: FP8 activations (fp8xfp8, MXFP4 weights) at BLOCK_M 64
    with at most 16 expected tokens per expert, unless the configuration
    (`Sm90GemmConfig.transposed`) sets it, or sets a field the transposed kernel cannot take."""
    from cute_megamoe.config import Sm90GemmConfig
    from cute_megamoe.heuristics import default_gemm_config, select_sm90_transposed

    def runs_transposed(recipe, block_m, expected, config=None):
        return default_gemm_config("sm_90a", recipe, "l1", 4096, block_m, expected, False,
                                   config).transposed

    assert select_sm90_transposed("fp8xfp4_sm90", 64, 0.0)
    assert select_sm90_transposed("fp8xfp4_sm90", 64, 16.0)
    assert not select_sm90_transposed("fp8xfp4_sm90", 64, 17.0)
    assert not select_sm90_transposed("fp8xfp4_sm90", 64, None)  # unknown: staged
    assert not select_sm90_transposed("fp8xfp4_sm90", 128, 1.0)
    assert select_sm90_transposed("fp8xfp8", 64, 1.0)
    assert not select_sm90_transposed("fp8xfp8", 64, 17.0)
    assert not select_sm90_transposed("bf16xbf16", 64, 1.0)
    # one threshold for both FP8 recipes (a loopback group's warm-up covers both with it)
    for expected in (0.0, 8.0, 16.0, 16.5, 16.6, 17.0, 100.0, None):
        assert select_sm90_transposed("fp8xfp8", 64, expected) == \
            select_sm90_transposed("fp8xfp4_sm90", 64, expected)
    # the 128-token staged layer at R = 1 with 128 experts of top-8: 8 per expert
    assert select_sm90_transposed("fp8xfp4_sm90", select_block_m(8.0, "sm90"),
                                  expected_tokens_per_expert(128, 1, 8, 128))
    assert runs_transposed("fp8xfp4_sm90", 64, 4.0)
    assert not runs_transposed("bf16xbf16", 64, 4.0)
    assert not runs_transposed("fp8xfp4_sm90", 128, 4.0)
    for forced in (True, False):
        for recipe, expected in (("fp8xfp4_sm90", 4.0), ("fp8xfp4_sm90", 100.0),
                                 ("fp8xfp8", None)):
            assert runs_transposed(recipe, 64, expected, Sm90GemmConfig(transposed=forced)) \
                is forced
    # a field the transposed kernel cannot take keeps the staged one
    assert not runs_transposed("fp8xfp8", 64, 4.0, Sm90GemmConfig(promotion="quarter"))
    assert runs_transposed("fp8xfp8", 64, 4.0, Sm90GemmConfig(promotion="chunk"))
    with pytest.raises(ValueError, match="transposed"):
        Sm90GemmConfig(transposed="yes")
    with pytest.raises(ValueError, match="block_m"):  # (no transposed kernel at BLOCK_M 128)
        runs_transposed("fp8xfp4_sm90", 128, 4.0, Sm90GemmConfig(transposed=True))

def test_warm_up_token_counts_pick_every_kernel_a_call_can_pick():
    """A loopback group's warm-up (`testing.fused_checks.FusedLayer.warm_up`) loads, at each
    BLOCK_M, every kernel choice that any call of 0 .. max tokens per rank makes: the sm_90a
    MXFP4 GEMMs' transposed choice and the combine's rounds (a choice first met in a later call
    deadlocked its loopback group on an H200, 12-04)."""
    from cute_megamoe.heuristics import (
        expected_tokens_per_expert,
        select_combine_rounds,
        select_sm90_transposed,
        warm_up_token_counts,
    )

    assert warm_up_token_counts(1) == (1,)
    assert warm_up_token_counts(200) == (1, 200)
    assert warm_up_token_counts(9000) == (1, 2048, 8192, 9000)
    with pytest.raises(ValueError, match="max_tokens"):
        warm_up_token_counts(0)
    # (ranks, experts, top-k) of the loopback tests and of a decode layer
    for num_ranks, num_experts, num_topk in ((2, 16, 4), (1, 40, 5), (1, 128, 8), (8, 256, 8)):
        for max_tokens in (1, 7, 200, 2100, 8500):
            def choices(n, num_ranks=num_ranks, num_experts=num_experts, num_topk=num_topk):
                expected = expected_tokens_per_expert(n, num_ranks, num_topk, num_experts)
                return (select_sm90_transposed("fp8xfp4_sm90", 64, expected),
                        tuple(select_combine_rounds(n)))
            # (the GEMMs and the combine are separate kernels: each choice on its own)
            warmed = [{choices(n)[i] for n in warm_up_token_counts(max_tokens)} for i in (0, 1)]
            for n in range(0, max_tokens + 1, max(1, max_tokens // 997)):
                assert all(c in w for c, w in zip(choices(n), warmed, strict=True)), \
                    (num_ranks, num_experts, max_tokens, n)


def test_heuristics_experts_per_wave_matches_reference_table():
    # DeepGEMM's heuristics (csrc/jit_kernels/heuristics/mega_moe.hpp at 54e2261) for
    # V4-Pro EP8 (E_l=48, K=6, I=3072), S=148.
    def ew(n, bm):
        return experts_per_wave(n, 6, 48, 3072, bm, 148)

    assert ew(1, 16) == 48  # almost no tokens: one wave
    assert ew(64, 16) == 8
    assert ew(128, 32) == 8
    assert ew(8192, 192) == 2  # one expert fills the GPU
    assert experts_per_wave(64, 6, 48, 3072, 16, 148, max_experts_per_wave=5) == 5
