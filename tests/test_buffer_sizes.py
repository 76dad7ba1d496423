"""`bench.buffer_sizes`: DeepGEMM's buffer size formula reproduces the reference doc's own table
(section 2.4, EP8, FP8xFP4), and our layout's size is what the bench compares with it."""

import pytest

from bench.buffer_sizes import deepgemm_buffer_bytes
from cute_megamoe.layout import MegaMoELayout
from cute_megamoe.layout.dataflow import (
    OUT_RING_ROWS,
    RING_REGIONS,
    ROW_RING_ROWS,
    dataflow_buffer_bytes,
)

# (E, H, I, K, T after alignment) -> (Rg, total GiB) from the doc's table
DOC_ROWS = [
    ((384, 7168, 3072, 6, 768), 55_296, 0.87),
    ((384, 7168, 3072, 6, 4224), 221_184, 3.58),
    ((384, 7168, 3072, 6, 8448), 423_936, 6.90),
    ((384, 7168, 3072, 6, 33024), 786_432, 14.5),
    ((256, 4096, 2048, 6, 8448), 417_792, 4.08),
]


@pytest.mark.parametrize("shape,ring,total_gib", DOC_ROWS)
def test_deepgemm_formula_reproduces_the_reference_table(shape, ring, total_gib):
    e, h, i, k, t = shape
    parts = deepgemm_buffer_bytes(8, e, t, k, h, i)
    assert parts["ring_tokens"] == ring
    assert round(parts["total"] / 2**30, 2 if total_gib < 10 else 1) == total_gib
    assert parts["total"] == sum(v for name, v in parts.items()
                                 if name not in ("total", "ring_tokens"))


def test_tokens_align_to_384_and_bf16_doubles_the_rows():
    fp8 = deepgemm_buffer_bytes(2, 256, 8192, 8, 7168, 2048)
    assert fp8 == deepgemm_buffer_bytes(2, 256, 8448, 8, 7168, 2048)  # 8192 -> 8448
    bf16 = deepgemm_buffer_bytes(2, 256, 8192, 8, 7168, 2048, fp8=False)
    assert bf16["l2_ring"] == 2 * bf16["ring_tokens"] * 2048
    assert bf16["total"] > fp8["total"]


def test_the_dataflow_buffer_fits_1_2_gib_at_ep8_8192_tokens():
    """Issue 65's target: DeepSeek-V3 (E 256, K 8, H 7168, I 2048), EP8, 8192 tokens, FP8xFP8:
    today's 5.66 GiB per rank becomes 1105 MiB with the pools as rings; every other region
    keeps its size (the per-block L2 and per-token arrival counters among them)."""
    shape = (8, 256, 8192, 8, 7168, 2048, "fp8xfp8")
    layout = MegaMoELayout(*shape)
    parts = dataflow_buffer_bytes(*shape)
    mib = 2**20
    assert round(layout.num_bytes / 2**30, 2) == 5.66
    assert parts["total"] <= 1.2 * 2**30
    assert round(parts["total"] / mib) == 1105
    assert parts["row_ring_rows"] == ROW_RING_ROWS and parts["out_ring_rows"] == OUT_RING_ROWS
    assert parts["l1_acts"] == 16384 * 7168 == 112 * mib
    assert parts["l2_acts"] == 8192 * 2048 == 16 * mib
    assert parts["l1_acts_sf"] == 16384 * 56 * 4 and parts["l2_acts_sf"] == 8192 * 16 * 4
    assert parts["combine"] == 896 * mib and parts["token_arrivals"] == 4 * 8192
    assert parts["pool_block_ready"] == 133_248 and parts["pool_block_l2_done"] == 133_120
    for region in layout.regions:
        if region.name not in RING_REGIONS:  # the other regions keep their sizes
            assert parts[region.name] == -(-region.nbytes // 128) * 128, region.name
    assert parts["total"] == sum(v for name, v in parts.items()
                                 if name not in ("total", "row_ring_rows", "out_ring_rows"))
    # by part, MiB: rows 3753.75 -> 115.5, L1 outputs 1072.5 -> 16.5, combine 896 kept
    rows = parts["l1_acts"] + parts["l1_acts_sf"]
    outs = parts["l2_acts"] + parts["l2_acts_sf"]
    assert (rows / mib, outs / mib) == (115.5, 16.5)


@pytest.mark.parametrize("shape", [(8, 256, 8192, 8, 7168, 2048, "fp8xfp8"),
                                   (2, 256, 4096, 8, 7168, 2048, "fp8xfp4"),
                                   (1, 8, 128, 2, 256, 256, "bf16xbf16")])
def test_our_layout_with_both_rings_is_the_dataflow_buffer(shape):
    """The bench's ``ours_rings_*`` column: `MegaMoELayout` with ``received_rows`` and
    ``l1_output_rows`` at the design's rings is the dataflow buffer, its per-token combine's
    two counters included; at DeepSeek-V3's shapes, EP8, 8192 tokens, FP8xFP8: 5.66 GiB ->
    1105 MiB (1.08 GiB), within issue 65's 1.2 GiB."""
    layout = MegaMoELayout(*shape, l1_output_rows=OUT_RING_ROWS, received_rows=ROW_RING_ROWS)
    parts = dataflow_buffer_bytes(*shape)
    assert layout.num_bytes == parts["total"]
    assert (layout.num_received_rows, layout.num_l1_output_rows) == (
        parts["row_ring_rows"], parts["out_ring_rows"])
    if shape == (8, 256, 8192, 8, 7168, 2048, "fp8xfp8"):
        assert round(layout.num_bytes / 2**20) == 1105 and layout.num_bytes <= 1.2 * 2**30


def test_dataflow_rings_are_capped_at_the_worst_case_pool():
    """A buffer whose worst-case pool fits a ring keeps the pool (it never wraps)."""
    shape = (1, 8, 128, 2, 256, 256, "bf16xbf16")
    layout = MegaMoELayout(*shape)
    parts = dataflow_buffer_bytes(*shape)
    assert layout.num_pool_rows == 2304 < OUT_RING_ROWS
    assert parts["row_ring_rows"] == parts["out_ring_rows"] == 2304
    assert parts["l1_acts"] == layout.region("l1_acts").nbytes == 2304 * 256 * 2
    with pytest.raises(ValueError, match="row_ring_rows"):
        dataflow_buffer_bytes(*shape, row_ring_rows=1000)
