"""Proposed buffer sizes of the dataflow kernel (issue 65, ``docs/notes/dataflow.md``).

Host arithmetic only: nothing here changes :class:`MegaMoELayout` or any kernel. The dataflow
kernel keeps every region of today's layout except the two pools, which become rings:

* ``l1_acts`` and ``l1_acts_sf`` (the received rows and their scales): a ring of
  ``row_ring_rows`` rows; pool block ``b`` of a rank with BLOCK_M ``BM`` lives in slot
  ``b % (row_ring_rows // BM)``, which senders fill only once the slot's previous block's L1
  tiles are done (back-pressure);
* ``l2_acts`` and ``l2_acts_sf`` (the L1 outputs): a ring of ``out_ring_rows`` rows, block
  ``b`` in slot ``b % (out_ring_rows // BM)``, written once the slot's previous block's L2
  tiles are done;

each capped at the worst-case pool ``P`` (a buffer whose pool fits the ring never wraps). The
per-row tables the L1 and L2 epilogues index by logical pool row (``token_src_metadata``,
``l1_topk_weights``) keep their ``P`` rows (16 + 4 bytes a row), as do the per-block counters,
so nothing indexed by a logical row or block is reused within a call. The per-token combine's
two counters are the layout's own (``pool_block_l2_done``, per block its L2 tiles done, and
``token_arrivals``, per token the L2 rows that came back in this call); the tile ticket is the
counter past ``pool_block_ready``'s blocks.
"""

from __future__ import annotations

from ..utils import align
from .mega_moe import BLOCK_M_MAX, REGION_ALIGNMENT, MegaMoELayout

__all__ = ["OUT_RING_ROWS", "RING_REGIONS", "ROW_RING_ROWS", "dataflow_buffer_bytes"]

#: Received-rows ring: 128 slots at BLOCK_M 128 (256 at 64). The model
#: (`testing.dataflow_model`) needs about ``lag + 3`` slots at 132 CTAs; the rest absorbs
#: senders that run in bursts and routing skew.
ROW_RING_ROWS = 16384
#: L1-output ring: 64 slots at BLOCK_M 128, room for a lag up to 60 with 3 slots of slack.
OUT_RING_ROWS = 8192
#: The pool regions that become rings, and which ring.
RING_REGIONS = {"l1_acts": "row", "l1_acts_sf": "row", "l2_acts": "out", "l2_acts_sf": "out"}


def dataflow_buffer_bytes(
    num_ranks: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate: int,
    recipe: str = "fp8xfp8",
    row_ring_rows: int = ROW_RING_ROWS,
    out_ring_rows: int = OUT_RING_ROWS,
) -> dict[str, int]:
    """Bytes per rank of every region of the proposed dataflow buffer (each region aligned as
    the layout aligns them), with ``"total"``, ``"row_ring_rows"`` and ``"out_ring_rows"``
    (after the cap at the worst-case pool). Ring sizes must be positive multiples of
    `BLOCK_M_MAX`, so that every BLOCK_M divides them."""
    for name, rows in (("row_ring_rows", row_ring_rows), ("out_ring_rows", out_ring_rows)):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 \
                or rows % BLOCK_M_MAX:
            raise ValueError(f"{name} must be a positive multiple of {BLOCK_M_MAX}, got {rows}")
    layout = MegaMoELayout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                           intermediate, recipe)
    pool = layout.num_pool_rows
    rings = {"row": min(row_ring_rows, pool), "out": min(out_ring_rows, pool)}
    parts: dict[str, int] = {}
    for region in layout.regions:
        nbytes = region.nbytes
        ring = RING_REGIONS.get(region.name)
        if ring is not None:
            nbytes = nbytes // pool * rings[ring]  # (every pool region is a whole row per row)
        parts[region.name] = align(nbytes, REGION_ALIGNMENT)
    parts["total"] = sum(parts.values())
    parts["row_ring_rows"] = rings["row"]
    parts["out_ring_rows"] = rings["out"]
    return parts
