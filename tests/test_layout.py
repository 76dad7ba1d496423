"""MegaMoELayout: region sizes match the formulas, alignment, no overlap, views alias bytes."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from cute_megamoe.layout import (
    DATA_REGION_NAMES,
    REGION_NAMES,
    WORKSPACE_REGION_NAMES,
    AbsentRegionError,
    MegaMoELayout,
)

RECIPES = ("fp8xfp4", "fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")
SF_REGIONS = ("x_sf", "l1_acts_sf", "l2_acts_sf")

# (R, E, num_max_tokens_per_rank, K, H, I): small enough to allocate on the CPU.
SMALL_CONFIGS = [
    (1, 8, 100, 2, 256, 128),
    (4, 8, 129, 6, 384, 256),  # E_l = 2 < K: min(K, E_l) matters; T rounds 129 -> 256
    (3, 3, 1, 1, 128, 384),
]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def expected_regions(r, e, m, k, h, i, recipe):
    """name -> (dtype, shape, strides), written from the spec independently of the module."""
    e_l = e // r
    t = _ceil(m, 128) * 128
    p = _ceil(r * t * min(k, e_l) + e_l * 255, 256) * 256
    act = torch.bfloat16 if recipe == "bf16xbf16" else torch.float8_e4m3fn
    sf = {"fp8xfp4": torch.int32, "fp8xfp8": torch.float32, "bf16xbf16": None,
          "fp8xfp4_sm90": torch.float32}[recipe]  # (fp8xfp4_sm90: fp8xfp8's activations)
    spec = {
        "barrier": (torch.int32, (64,), (1,)),
        "expert_send_count": (torch.int64, (e,), (1,)),
        "expert_recv_count": (torch.int64, (r, e), (e, 1)),
        "src_token_topk_idx": (torch.int32, (e_l, r, t), (r * t, t, 1)),
        "dispatch_pair_slot": (torch.int32, (t, k), (k, 1)),
        "token_src_metadata": (torch.int32, (p, 4), (4, 1)),
        "pool_block_arrivals": (torch.int32, (p // 16,), (1,)),
        "pool_block_ready": (torch.int32, (p // 16 + 1,), (1,)),
        "pool_block_l2_done": (torch.int32, (p // 16,), (1,)),
        "token_arrivals": (torch.int32, (t,), (1,)),
        "cta_progress": (torch.int32, (256, 4), (4, 1)),
        "x": (act, (t, h), (h, 1)),
        "x_sf": (sf, (t, h // 128), (h // 128, 1)),
        "topk_idx": (torch.int64, (t, k), (k, 1)),
        "topk_weights": (torch.float32, (t, k), (k, 1)),
        "l1_acts": (act, (p, h), (h, 1)),
        "l1_acts_sf": (sf, (p, h // 128), (1, p)),
        "l1_topk_weights": (torch.float32, (p,), (1,)),
        "l2_acts": (act, (p, i), (i, 1)),
        "l2_acts_sf": (sf, (p, i // 128), (1, p)),
        "combine": (torch.bfloat16, (k, t, h), (t * h, h, 1)),
    }
    return {name: v for name, v in spec.items() if v[0] is not None}, t, p


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("cfg", SMALL_CONFIGS + [(8, 256, 8192, 8, 7168, 2048)])
def test_regions_match_formulas(cfg, recipe):
    lay = MegaMoELayout(*cfg, recipe=recipe)
    spec, t, p = expected_regions(*cfg, recipe)
    assert lay.num_tokens == t
    assert lay.num_pool_rows == p
    assert lay.num_pool_blocks_max == p // 16
    assert lay.num_local_experts == cfg[1] // cfg[0]
    assert lay.block_m_max == 256

    names = [reg.name for reg in lay.regions]
    assert names == [n for n in REGION_NAMES if n in spec]  # spec order, absent ones skipped
    prev_end = 0
    for reg in lay.regions:
        dtype, shape, strides = spec[reg.name]
        assert (reg.dtype, reg.shape, reg.strides) == (dtype, shape, strides), reg.name
        assert reg.nbytes == math.prod(shape) * _itemsize(dtype), reg.name
        assert reg.offset % 128 == 0, reg.name
        # Back to back: the only gap is the padding up to the next multiple of 128.
        assert prev_end <= reg.offset < prev_end + 128, reg.name
        assert reg.workspace == (reg.name in WORKSPACE_REGION_NAMES)
        assert lay.offset(reg.name) == reg.offset
        assert lay.region(reg.name) is reg
        assert lay.has(reg.name)
        prev_end = reg.end
    assert lay.num_bytes == _ceil(prev_end, 128) * 128
    assert lay.workspace_nbytes == lay.offset("x")
    assert all(r.workspace for r in lay.workspace_regions)
    assert not any(r.workspace for r in lay.data_regions)

    # No two regions overlap (checked pairwise, not just via ordering).
    spans = sorted((reg.offset, reg.end) for reg in lay.regions)
    for (_, end_a), (start_b, _) in itertools.pairwise(spans):
        assert end_a <= start_b


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("cfg", SMALL_CONFIGS)
def test_views_alias_the_right_bytes(cfg, recipe):
    lay = MegaMoELayout(*cfg, recipe=recipe)
    buf = torch.zeros(lay.num_bytes, dtype=torch.uint8)
    expected = torch.zeros_like(buf)
    gen = torch.Generator().manual_seed(0)
    for n, reg in enumerate(lay.regions):
        v = lay.view(buf, reg.name)
        assert v.dtype == reg.dtype and tuple(v.shape) == reg.shape
        assert tuple(v.stride()) == reg.strides
        assert v.data_ptr() == buf.data_ptr() + reg.offset
        first = tuple(0 for _ in reg.shape)
        last = tuple(s - 1 for s in reg.shape)
        rand = tuple(int(torch.randint(s, (1,), generator=gen)) for s in reg.shape)
        value = n % 7 + 1
        value_bytes = torch.tensor([value], dtype=reg.dtype).view(torch.uint8)
        for idx in (first, last, rand):
            v[idx] = value
            # Where the element must land, computed by hand from offset, strides and itemsize.
            elem = sum(i * s for i, s in zip(idx, reg.strides, strict=True))
            lo = reg.offset + elem * reg.element_size
            expected[lo : lo + reg.element_size] = value_bytes
        # The last element ends exactly at the region's end.
        last_elem = sum(i * s for i, s in zip(last, reg.strides, strict=True))
        assert reg.offset + (last_elem + 1) * reg.element_size == reg.end
    # Every byte written through a view is where it should be, and no byte elsewhere changed.
    assert torch.equal(buf, expected)


def test_absent_and_unknown_regions_raise():
    lay = MegaMoELayout(1, 8, 64, 2, 256, 128, recipe="bf16xbf16")
    buf = torch.zeros(lay.num_bytes, dtype=torch.uint8)
    for name in SF_REGIONS:
        assert not lay.has(name)
        with pytest.raises(AbsentRegionError, match=name):
            lay.region(name)
        with pytest.raises(LookupError):
            lay.offset(name)
        with pytest.raises(AbsentRegionError):
            lay.view(buf, name)
    with pytest.raises(KeyError):
        lay.region("no_such_region")
    assert not lay.has("no_such_region")
    fp8 = MegaMoELayout(1, 8, 64, 2, 256, 128, recipe="fp8xfp8")
    assert all(fp8.has(n) for n in SF_REGIONS)
    assert set(REGION_NAMES) == set(WORKSPACE_REGION_NAMES) | set(DATA_REGION_NAMES)


GOOD = dict(
    num_ranks=2,
    num_experts=8,
    num_max_tokens_per_rank=64,
    num_topk=2,
    hidden=256,
    intermediate_hidden=128,
    recipe="fp8xfp4",
)


@pytest.mark.parametrize(
    "arg, value",
    [
        ("num_experts", 9),  # not divisible by num_ranks
        ("num_experts", 0),
        ("hidden", 200),
        ("hidden", 0),
        ("intermediate_hidden", 100),
        ("num_topk", 0),
        ("num_topk", 33),
        ("num_topk", 9),  # > num_experts
        ("num_ranks", 0),
        ("num_ranks", 9),  # the kernels take at most 8
        ("num_ranks", 16),
        ("num_max_tokens_per_rank", 0),
        ("num_max_tokens_per_rank", (1 << 20) + 1),  # a published count holds 24 bits
        ("recipe", "fp4xfp4"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(arg, value):
    kwargs = dict(GOOD, **{arg: value})
    if arg == "num_ranks" and value > 2:
        kwargs["num_experts"] = value * 2
    with pytest.raises(ValueError, match=arg):
        MegaMoELayout(**kwargs)


@pytest.mark.parametrize("arg, value", [("hidden", 256.0), ("num_topk", True), ("recipe", 1)])
def test_bad_argument_types_raise_type_error(arg, value):
    with pytest.raises(TypeError, match=arg):
        MegaMoELayout(**dict(GOOD, **{arg: value}))


def test_view_checks_the_buffer():
    lay = MegaMoELayout(**GOOD)
    with pytest.raises(TypeError):
        lay.view(torch.zeros(lay.num_bytes, dtype=torch.int8), "x")
    with pytest.raises(ValueError):
        lay.view(torch.zeros(lay.num_bytes - 1, dtype=torch.uint8), "x")
    with pytest.raises(ValueError):
        lay.view(torch.zeros(2, lay.num_bytes, dtype=torch.uint8), "x")
    # A larger buffer is fine: regions sit at the same offsets.
    big = torch.zeros(lay.num_bytes + 4096, dtype=torch.uint8)
    assert lay.view(big, "combine").data_ptr() == big.data_ptr() + lay.offset("combine")


def test_frozen_equal_hashable():
    a, b = MegaMoELayout(**GOOD), MegaMoELayout(**GOOD)
    assert a == b and hash(a) == hash(b)
    assert a != MegaMoELayout(**dict(GOOD, recipe="fp8xfp8"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_topk = 4  # type: ignore[misc]


def test_l1_output_ring_shrinks_only_the_l1_outputs():
    """``l1_output_rows``: the L1 outputs (``l2_acts`` and its MN-major scales) in a ring of
    that many rows, capped at the pool; every other region keeps its shape, and the layouts
    differ (cache keys)."""
    whole = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8"))
    ring = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8", l1_output_rows=512))
    assert whole.num_l1_output_rows == whole.num_pool_rows and whole.l1_output_rows is None
    assert ring.num_l1_output_rows == 512 < ring.num_pool_rows and ring != whole
    assert ring.region("l2_acts").shape == (512, GOOD["intermediate_hidden"])
    assert ring.region("l2_acts_sf").strides == (1, 512)
    for reg in whole.regions:
        if reg.name not in ("l2_acts", "l2_acts_sf"):
            assert ring.region(reg.name).shape == reg.shape, reg.name
    saved = (whole.num_pool_rows - 512) * GOOD["intermediate_hidden"] * (1 + 4 / 128)
    assert whole.num_bytes - ring.num_bytes == pytest.approx(saved, abs=4 * 128)
    assert "Q=512" in ring.summary()
    capped = MegaMoELayout(**dict(GOOD, l1_output_rows=1 << 20))
    assert capped.num_l1_output_rows == capped.num_pool_rows
    for bad in (0, 100, -256):
        with pytest.raises(ValueError, match="l1_output_rows"):
            MegaMoELayout(**dict(GOOD, l1_output_rows=bad))
    with pytest.raises(TypeError, match="l1_output_rows"):
        MegaMoELayout(**dict(GOOD, l1_output_rows=512.0))


def test_received_rows_ring_shrinks_only_the_received_rows():
    """``received_rows``: the received rows (``l1_acts`` and its MN-major scales) in a ring of
    that many rows, capped at the pool; every other region keeps its shape (the per-row tables
    and per-block counters their ``P`` rows), the regions stay back to back, and the layouts
    differ (cache keys)."""
    h = GOOD["hidden"]
    whole = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8"))
    ring = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8", received_rows=512))
    p = whole.num_pool_rows
    assert whole.num_received_rows == p and whole.received_rows is None
    assert ring.num_received_rows == 512 < ring.num_pool_rows == p and ring != whole
    assert ring.num_l1_output_rows == p  # (the other ring is separate)
    acts, scales = ring.region("l1_acts"), ring.region("l1_acts_sf")
    assert (acts.shape, acts.strides) == ((512, h), (h, 1))
    assert (scales.shape, scales.strides) == ((512, h // 128), (1, 512))
    for reg in whole.regions:
        if reg.name not in ("l1_acts", "l1_acts_sf"):
            assert ring.region(reg.name).shape == reg.shape, reg.name
    for name in ("token_src_metadata", "l1_topk_weights", "pool_block_arrivals",
                 "pool_block_ready"):
        assert ring.region(name).nbytes == whole.region(name).nbytes, name
    # regions up to the ring keep their offsets; the rest move down, back to back
    for reg in ring.regions[:[r.name for r in ring.regions].index("l1_acts") + 1]:
        assert reg.offset == whole.offset(reg.name), reg.name
    for a, b in itertools.pairwise(ring.regions):
        assert a.end <= b.offset < a.end + 128 and b.offset % 128 == 0, b.name
    saved = (p - 512) * h * (1 + 4 / 128)
    assert whole.num_bytes - ring.num_bytes == pytest.approx(saved, abs=4 * 128)
    buf = torch.zeros(ring.num_bytes, dtype=torch.uint8)
    assert ring.view(buf, "l1_acts_sf").stride() == (1, 512)
    assert "Pr=512" in ring.summary() and "Pr=" not in whole.summary()
    capped = MegaMoELayout(**dict(GOOD, received_rows=1 << 20))
    assert capped.num_received_rows == capped.num_pool_rows
    assert capped.region("l1_acts").shape == whole.region("l1_acts").shape
    for bad in (0, 100, -256):
        with pytest.raises(ValueError, match="received_rows"):
            MegaMoELayout(**dict(GOOD, received_rows=bad))
    with pytest.raises(TypeError, match="received_rows"):
        MegaMoELayout(**dict(GOOD, received_rows=512.0))


def test_both_rings_shrink_both_pools():
    """``l1_output_rows`` with ``received_rows``: each pool its own ring, the savings add up,
    and the layout differs from either ring alone (sizes at DeepSeek-V3's shapes:
    tests/test_buffer_sizes.py)."""
    whole = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8"))
    rows = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8", received_rows=512))
    outs = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8", l1_output_rows=256))
    both = MegaMoELayout(**dict(GOOD, recipe="fp8xfp8", received_rows=512, l1_output_rows=256))
    assert (both.num_received_rows, both.num_l1_output_rows) == (512, 256)
    assert both.region("l1_acts").shape[0] == 512 and both.region("l2_acts").shape[0] == 256
    assert len({whole, rows, outs, both}) == 4
    saved = (whole.num_bytes - rows.num_bytes) + (whole.num_bytes - outs.num_bytes)
    assert whole.num_bytes - both.num_bytes == pytest.approx(saved, abs=2 * 128)
    assert "Q=256, Pr=512)" in both.summary()


def test_deepseek_v3_like_total_is_sane():
    r, e, m, k, h, i = 8, 256, 8192, 8, 7168, 2048
    lay = MegaMoELayout(r, e, m, k, h, i, recipe="fp8xfp4")
    e_l, t = e // r, m
    p = _ceil(r * t * min(k, e_l) + e_l * 255, 256) * 256
    exact = (
        64 * 4
        + e * 8
        + r * e * 8
        + e_l * r * t * 4
        + t * k * 4
        + p * 16
        + p // 16 * 4
        + (p // 16 + 1) * 4
        + p // 16 * 4
        + t * 4
        + 256 * 4 * 4
        + t * h
        + t * (h // 128) * 4
        + t * k * 8
        + t * k * 4
        + p * h
        + p * (h // 128) * 4
        + p * 4
        + p * i
        + p * (i // 128) * 4
        + k * t * h * 2
    )
    assert exact <= lay.num_bytes <= exact + 128 * len(lay.regions)
    # Dominated by the two activation pools and the combine buffer: about 5.7 GiB.
    assert 5 * 2**30 < lay.num_bytes < 6 * 2**30
    # DeepGEMM's src_token_topk_idx would be R times larger; ours is E_l * R * T int32s.
    assert lay.region("src_token_topk_idx").nbytes == e_l * r * t * 4


def test_summary_lists_every_region():
    lay = MegaMoELayout(**GOOD)
    text = str(lay)
    assert text == lay.summary()
    for reg in lay.regions:
        assert reg.name in text
    assert "total" in text and "MiB" in text and "workspace" in text


def test_count_word_fields_round_trip():
    """The dispatch's published count word (`layout.CountWord`): every setting a rank launches
    a call with decodes back, and different settings never share a code."""
    from cute_megamoe.layout import CountWord

    codes = {}
    for block_m in range(16, 513, 16):
        for recipe in RECIPES:
            for push in (False, True):
                for counted in (False, True):
                    settings = CountWord.settings(block_m, recipe, push, counted)
                    assert 0 <= settings <= CountWord.SETTINGS_MASK
                    codes[settings] = (block_m, recipe, push, counted)
                    tag, count = (1 << 32) - 3, 1 << 20  # a tag past 2**31; the largest count
                    word = tag << 32 | settings << CountWord.COUNT_BITS | count
                    assert CountWord.decode(word) == dict(
                        tag=tag, count=count, block_m=block_m, recipe=recipe, push=push,
                        rows_counted=counted)
    assert len(codes) == 32 * len(RECIPES) * 2 * 2
    # the count field holds every count a rank can publish
    from cute_megamoe.layout import MAX_NUM_TOKENS_PER_RANK

    assert MAX_NUM_TOKENS_PER_RANK <= CountWord.COUNT_MASK
    for bad in (0, 8, 528, 100):
        with pytest.raises(ValueError, match="block_m"):
            CountWord.settings(bad, "fp8xfp8", True)
