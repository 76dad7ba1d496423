"""The persistent tile scheduler: which (expert, m-block, n-block) each CTA does next.

:mod:`cute_megamoe.scheduler.host_model` is the pure-Python model the device scheduler must
agree with (pool block offsets, tile order, the persistent-grid walk).
"""

from .host_model import (
    DataflowTile,
    HostMegaMoETileScheduler,
    HostTileScheduler,
    Tile,
    assign_tiles,
    banded_blocks,
    dataflow_lag,
    dataflow_position,
    dataflow_positions,
    dataflow_sequence,
    dataflow_tile_walk,
    fused_tile_walk,
    grouped_gemm_tiles,
    mega_moe_tile_sequence,
    min_ring_slots,
    num_m_blocks,
    pool_block_offsets,
    raster_order,
    waves,
)

__all__ = [
    "DataflowTile",
    "HostMegaMoETileScheduler",
    "fused_tile_walk",
    "HostTileScheduler",
    "Tile",
    "assign_tiles",
    "banded_blocks",
    "dataflow_lag",
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
