"""The whole Mega MoE layer on Hopper (sm_90a) in one persistent launch per rank.

What it computes, on every rank of an R-rank group (all ranks launch it once per call, with
this rank's staged inputs in the symmetric buffer, `kernels/staging.py`, or, with
`stages_inputs`, the caller's BF16 inputs, which step 0 stages into the buffer itself):

    y = combine(L2(SwiGLU(L1(dispatch(x, topk_idx)))))

bit-identical to the staged layer (`staged.staged_mega_moe` with `ExpertWeights` and
`l2_sends=True`: the same dispatch, grouped GEMMs, epilogues and reduction, run as phases of
one kernel), for `fp8xfp8`, `bf16xbf16` and `fp8xfp4_sm90` (MXFP4 weights decoded on chip).

How: one CTA per SM, `128 * (1 + BLOCK_M / 64)` threads (FP4 weights: plus the decode
warpgroups, 512 in all), launched cooperatively.
0. With `stages_inputs`: every CTA quantizes its grid-stride share of the activations into
   the buffer (`InputStagingKernel.stage_vectors`) and copies the routing of the pairs it
   counts in step 1 (`DispatchKernel.pair_share`); other CTAs read those rows only after the
   count publication, which every CTA's arrival (after its staging) precedes.
1. Dispatch: count, prefix, scatter, publish the counts (tagged with the call number,
   `layout.CountWord`), write the pool's metadata and push the rows into the destinations'
   pools; it leaves this rank's pool prefix sums in shared memory. How the rows move is the
   `row_transfer` (`config.ROW_TRANSFERS`; default `heuristics.default_row_transfer`: "counted"
   for buffers of at most `heuristics.COUNTED_ROWS_MAX_TOKENS` tokens per rank, else
   "barrier"):
   * "barrier": every thread runs the whole staged dispatch (`DispatchKernel.run`), which
     meets the other ranks once every row has moved; a grid barrier then tells every CTA that
     the pool is complete.
   * "counted": every thread runs steps 1-6 (`DispatchKernel.exchange_counts`, whose metadata
     writes add 1 per row to the row's pool block in this rank's `pool_block_arrivals`), then
     every warp pushes this rank's rows into the destinations' pools in each pool's order
     (`DispatchKernel.push_in_pool_order`), adding 1 per row to its pool block's counter in
     the destination's `pool_block_arrivals` (a fence per batch of 32 rows, system scope; GPU
     scope in a one-rank group, as every flag of the kernel: `common.sync.group_scope`).
     No barrier: each CTA goes on to its GEMM tiles, an L1 tile starting once its pool block
     is complete.
   * one-rank groups with "counted" rows that stage their own inputs (`local_dispatch`; the
     default for buffers of at most `heuristics.LOCAL_MAX_TOKENS` tokens): no CTA waits for
     another.
     Every CTA counts all of the call's pairs from the caller's routing
     (`DispatchKernel.count_locally`: in all and before its own share, so each has the pool's
     layout and its first slot per expert), then places its share of the pairs in batches of
     one per thread (`place_pairs`: slot, metadata, weight), quantizes their
     rows from the caller's activations straight into their pool rows
     (`InputStagingKernel.stage_rows`, the staging kernel's numerics; the buffer's `x` is not
     written) and counts each row into its pool block (`count_placed`, 2 per row as above).
   * "pulled" (the ticket walk only): every thread runs steps 1-6 as for "counted" (without
     the scale words), then warps 1-3 of the loads' warpgroup pull this rank's rows from their
     sources in its pool order while the GEMM roles run (`DispatchKernel.pull_in_pool_order`),
     counting each into its pool block; on a buffer that keeps the received rows in a ring
     (`MegaMoELayout.received_rows`) a slot is refilled once every L1 tile of its previous
     block is done (docs/notes/dataflow.md, W4), the L1 loads reading block b's rows from
     slot b mod the ring's blocks.
   Each is a row protocol of its own, which every rank of a call must share (checked through
   the count words).
2. Grouped GEMMs (warp-specialized as `sm90_expert_gemm`: warp 0 loads by TMA, the other
   warpgroups run WGMMA and the epilogues). One walk over the L1 tiles followed by the L2 tiles
   (CTA c takes tiles c, c + G, ... of the concatenation,
   `scheduler.host_model.fused_tile_walk`), through one ring of pipeline stages
   (`sm90_expert_gemm.share_ring`), so a CTA's first L2 tiles load while its last L1 tiles still
   compute (FP4 weights: warp 1 loads the packed weights of both walks into their own stages,
   waiting for nothing, and the decode warpgroups walk the same tiles). With the counted row
   transfers, an L1 tile starts once its pool block is complete: warp 0 acquires the block's
   arrival counter (system scope, then a proxy fence) until it reaches twice the block's row
   count (with `weights_first`, a tile that finds its block not ready loads its first stages'
   weights before the wait). An L2 tile waits only
   for the L1 tiles of its own pool block: every consumer warp
   adds 1 to the block's counter in `pool_block_ready` once its rows of an L1 tile are in global
   memory (release at GPU scope, after its bulk stores completed), and the L2 producer acquires
   it (and fences the async proxy) before its TMA loads. The senders wait for nothing, L1 tiles
   only for rows, and every CTA walks its L1 tiles before its L2 tiles, so the waits always
   end. The L2 epilogue writes each row into its source rank's combine buffer over NVLink.
3. Combine (every thread, `CombineKernel.send_and_reduce` in its "epilogue" mode): the split
   barriers meet the other ranks once every CTA's rows are delivered, then the top-k
   reduction in ascending k writes `y`; with the counted row transfers, CTA 0 then records the
   call as finished (`common.sync.finish_call`; the dispatch's closing barrier does otherwise).
   With `combine` "tokens" (the ticket walk, exchanged dispatch; docs/notes/dataflow.md, 1.6)
   no CTA waits for the other ranks before it reduces: the consumer warp that completes a
   pool block's L2 tiles (`pool_block_l2_done`) adds 1 per row of the block to the row's token
   in its source rank's `token_arrivals` (`signal_tokens`: the rows' stores, fenced at the
   group's scope, released to the token), and every CTA, once its walk is done, arrives at
   the split barriers, reduces its share of the tokens as above, each once its count reaches
   its valid slots (`CombineKernel`'s `per_token`), then waits at the barriers (by then
   every rank is past its walk: they end the call, as below).

4. Every CTA zeroes its share of the readiness and arrival counters once the combine's
   barriers are past (every rank is done with them; the token counts: at the next call's
   start, since other CTAs may still reduce).

Readiness and arrival counters are per call: every call leaves them at 0 (step 4; a fresh
buffer is zeroed), which is all the local dispatch relies on; the exchanged one also zeroes its
share at the start, and step 1's arrival at the grid counter after the scatter orders that
before any use (the last CTA
to arrive publishes the counts; a sender adds to a destination's arrivals only once it holds
the destination's counts of the call, published after the zeroing); nothing else is reset
(the barriers and call tags of `common/sync.py` only grow, wrap-safe), so back-to-back calls
and CUDA-graph replays need nothing from the host.
With the counted row transfers there is no closing cross-rank barrier in the dispatch; the
calls stay apart through the counts: a rank pushes
rows into a peer's pool only with the peer's counts of the same call (published once the
peer's previous call has ended), an L2 epilogue writes into a peer's combine buffer only rows
that peer sent in this call, and a rank's next call rewrites its inputs and scatter tables only
after this call's combine barriers, which every rank passes after its own dispatch.
With `combine` "tokens" the same holds: its barriers are passed at the end of the call, once
every CTA of every rank is past its walk; and a peer reads this rank's inputs for a row only
before the row's L1 tile, so before it signals the row's token, which this rank's call waits
for before it ends. The token counts a peer signals are this call's: it holds this rank's
counts of the call first, published after the counters were zeroed.

`weights_first` (default: on with the counted row transfers at BLOCK_M 64, FP8 / BF16
weights): tiles that find their pool block not ready load their first stages' weights before
they wait, and warp 0 loads the weights of its first L1 tile's first stages as soon as the
pool's prefix sums are in, before the metadata and the rows (the early weights).

Constraints: those of the three parts (`dispatch`: push transfer only here; `sm90_expert_gemm`:
BLOCK_M 64 or 128, `hidden` and `2 * intermediate` multiples of 256, no clusters); the grid at
most one CTA per SM (cooperative launch: the host checks the grid before launching).
"""

from __future__ import annotations

from dataclasses import replace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, Uint8
from cutlass.cute.nvgpu import cpasync

from ..config import Sm90FusedConfig, Sm90GemmConfig
from ..heuristics import DEFAULT_NUM_SMS
from ..layout.device import BufferRegions
from ..layout.mega_moe import PROGRESS_WARPGROUPS, BarrierSlots, MegaMoELayout
from ..reports import REPORT_NAMES, Progress, ReportKind
from ..scheduler.device import DataflowSequence
from ..scheduler.host_model import dataflow_lag, min_ring_slots
from .combine import CombineKernel
from .common.sync import (
    call_tags,
    fence_acq_rel,
    finish_call,
    grid_barrier,
    report,
    spin_timeout_ns,
    wait_stage,
)
from .dispatch import DispatchKernel
from .sm90_expert_gemm import (
    FP4_WARPGROUPS,
    MAX_STAGES,
    ROWS_PER_WARP,
    Sm90ExpertGemmKernel,
    share_ring,
)
from .staging import ELEMENTS_PER_THREAD, InputStagingKernel

RECIPES = ("fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")
# With `phase_clock`: per CTA, the global timer (ns) at the kernel's start, once the pool's
# prefix sums are in place ("barrier" rows: once the pool is complete), with the counted row
# transfers when its first warp has sent its rows, when
# its first consumer warp finished its L1 tiles and its L2 tiles, when warp 0
# issued its last loads and saw them consumed, (FP4 weights) when warp 1 did the same for the
# packed weights and the first decode warp finished, and at the end (0: not reached). Each
# stamp is fenced at system scope, so a host reading pinned memory sees where a hung call is
PHASE_STAMPS = ("start", "prefix_ready", "rows_sent", "l1_done", "l2_done", "loads_done",
                "packed_done", "decode_done", "end",
                # inside the dispatch (`DispatchKernel.exchange_counts`, `run`): unfenced
                "scattered", "counts_published", "counts_seen", "rows_pushed")
# dynamic shared memory one CTA may use on H100 / H200 (227 KB), less 2 KB of margin for what
# `smem_bytes` does not count
SM_SMEM_CAPACITY = 227 * 1024 - 2048
# registers of every thread in the combine phase: the consumers give back what the producer
# warpgroup takes (2 x 128 x (232 - 168) = 128 x (168 - 40) at BLOCK_M 128)
COMBINE_REGS = 168
REGS_BARRIER = 2  # named barriers 2 + warpgroup: a warpgroup's warps meet before a setmaxnreg
# Named barrier of the register handover (every warpgroup of the GEMM roles once): the GEMM
# consumers arrive once their setmaxnreg.inc has its registers, the other warpgroups wait there
# before their own increase for the combine. setmaxnreg.inc takes registers from the CTA's
# pool, which holds no spare ones (BLOCK_M 128: 384 x 168 = 128 x 40 + 256 x 232): a
# warpgroup with no tiles that took its combine registers back before the consumers took
# theirs left them waiting for registers forever (docs/notes/register-handover.md)
REGS_TAKEN_BARRIER = 8
# the test builds' injected delays (`config.Sm90FusedConfig.debug`): "hold_cta" holds this CTA
# back before its combine, "late_consumers" starts the odd CTAs' GEMM consumers this late (ns)
HELD_CTA = 5
LATE_CONSUMERS_NS = 200_000
# `walk` "tickets": positions of the tile sequence warp 0 has taken and the consumer warps have
# not yet read (the shared-memory tile queue between them)
TILE_QUEUE_SLOTS = 4
# `debug` "tile_clock" (the ticket walk): per CTA, the first TILE_CLOCK_TILES tiles its
# consumers ran, each int32 x 4: ((1 + is_l2) << 24 | n-block, pool block, the global timer's
# low 32 bits (ns) when the consumers read the position and when its epilogue was done);
# the debug tensor is int32 [grid, TILE_CLOCK_TILES, 4], zeroed by the caller
TILE_CLOCK_TILES = 512


def walk_lengths(l1_tiles, l2_tiles, cta, num_ctas):
    """How many L1 and L2 tiles CTA ``cta`` of ``num_ctas`` takes in the fused walk (L1 tiles
    ``cta``, ``cta + num_ctas``, ..., then the L2 walk on from the first index past the L1
    tiles, as `scheduler.fused_tile_walk`): ``(l1, l2)``, for Python ints and DSL Int32
    alike."""
    l1 = (cutlass.max(l1_tiles - cta, 0) + num_ctas - 1) // num_ctas
    first_l2 = cta + l1 * num_ctas - l1_tiles
    return l1, (cutlass.max(l2_tiles - first_l2, 0) + num_ctas - 1) // num_ctas


class Sm90MegaMoEKernel:
    """The fused layer for one rank (see the module docstring), built from the buffer's
    ``layout`` and a complete `config.Sm90FusedConfig` (`heuristics.default_fused_config`).
    ``has_stats``: the call counts its pairs into ``stats``; ``tiled_weights``: the weights
    are stored as `expert_gemm.tile_weight_rows` makes them."""

    # CTAs per cluster: none (the launcher rounds the grid to whole clusters; 2-CTA clusters
    # took 1.20x the fused layer's time at 4096 / 8192 tokens on an H200 and were removed)
    cluster_m = 1

    def __init__(self, layout: MegaMoELayout, config: Sm90FusedConfig,
                 activation_clamp: float | None = None, fast_math: bool = True,
                 has_stats: bool = False, tiled_weights: bool = False):
        if not isinstance(config, Sm90FusedConfig):
            raise TypeError(f"config: an Sm90FusedConfig, got {type(config).__name__}")
        config.check_complete("Sm90MegaMoEKernel")
        if layout.recipe not in RECIPES:
            raise ValueError(f"recipe: the sm_90a fused kernel runs {RECIPES}, got "
                             f"{layout.recipe!r}")
        self.config = config
        block_m = config.block_m
        self.layout = layout
        self.regions = BufferRegions(layout)
        # ``cta_progress`` from the ``barrier`` region, in int32 words (`mark`)
        self.progress_offset = (self.regions.offset("cta_progress")
                                - self.regions.offset("barrier")) // 4
        # write each CTA's phase boundaries (`PHASE_STAMPS`, ns) to `phase_clock` (diagnostic)
        self.phase_clock = config.debug == "phase_clock"
        # record every CTA's tiles in `tile_log` (diagnostic: the walk against the host model)
        self.tile_log = config.debug == "tile_log"
        # record each tile's span in the ticket walk (`TILE_CLOCK_TILES`; diagnostic)
        self.tile_clock = config.debug == "tile_clock"
        # (tests) CTA `HELD_CTA` waits before its combine until well past the combine's time
        # limit: an injected stall, which the other CTAs' stall report must name
        self.hold_cta = HELD_CTA if config.debug == "hold_cta" else None
        # (tests) the GEMM consumers of odd CTAs start their role `LATE_CONSUMERS_NS` late: the
        # register handover must not depend on which warpgroup gets there first
        self.late_consumers_ns = LATE_CONSUMERS_NS if config.debug == "late_consumers" else 0
        self.block_m = block_m
        self.fp4_weights = layout.recipe == "fp8xfp4_sm90"
        self.num_gemm_wgs = 1 + block_m // 64
        # (FP4 weights: the decode warpgroups come after the GEMM warpgroups)
        decode_wgs = FP4_WARPGROUPS[block_m // 64][0] if self.fp4_weights else 0
        self.num_threads = 128 * (self.num_gemm_wgs + decode_wgs)
        # registers of every thread in the dispatch and the combine: what the launch gives
        self.combine_regs = min(COMBINE_REGS, 65536 // self.num_threads // 8 * 8)
        self.num_ranks = layout.num_ranks
        self.num_local_experts = layout.num_local_experts
        self.num_pool_blocks = layout.num_pool_rows // block_m
        # how the rows move (step 1, `config.ROW_TRANSFERS`): "barrier" and "counted" are
        # different row protocols, which every rank of a call must share (published in the
        # count words and checked, `layout.CountWord`); ranks may mix BLOCK_Ms
        self.row_transfer = config.row_transfer
        # "counted" and "pulled" count every row into its pool block (no barrier); "pulled":
        # warps 1-3 of the loads' warpgroup pull this rank's rows (`pull_in_pool_order`)
        self.rows_counted = config.row_transfer in ("counted", "pulled")
        self.rows_pulled = config.row_transfer == "pulled"
        # `stages_inputs`: this kernel quantizes the caller's activations into the buffer and
        # copies the routing itself (step 0), instead of a staging launch before it: one launch
        # per layer call. Each CTA copies the routing of the (token, slot) pairs it counts next
        # (`DispatchKernel.pair_share`) and quantizes its grid-stride share of the activation
        # vectors (`InputStagingKernel.stage_vectors`, the same numerics); the rows are read by
        # other CTAs only after the count publication, which every CTA's staging precedes
        self.stages_inputs = config.stages_inputs
        self.staging = InputStagingKernel(layout.recipe, layout.hidden, layout.num_topk,
                                          num_threads=self.num_threads)
        # `local_dispatch` (one-rank groups with counted rows staging their own inputs; by
        # default for buffers of at most `heuristics.LOCAL_MAX_TOKENS` tokens): every CTA counts
        # all of the call's pairs itself, so each knows the pool's layout without any other
        # CTA, and quantizes its own pairs' rows straight into their pool rows (step 1's
        # "local" form); no count exchange, no staged rows in between
        if config.local_dispatch and not (self.num_ranks == 1
                                          and config.row_transfer == "counted"
                                          and self.stages_inputs and not self.fp4_weights):
            raise ValueError("config.local_dispatch: one-rank groups with counted rows that "
                             "stage their own inputs, FP8 / BF16 weights")
        self.local_dispatch = config.local_dispatch
        self.dispatch = DispatchKernel(layout, block_m, num_threads=self.num_threads,
                                       has_stats=has_stats,
                                       transfer="pull" if self.rows_pulled else "push",
                                       pool_order=self.rows_counted, local=self.local_dispatch)
        # `combine` "tokens" (docs/notes/dataflow.md, 1.6): the last consumer warp to finish
        # an L2 tile of a pool block signals the block's rows' tokens in their source ranks'
        # `token_arrivals` (`signal_tokens`), and each token is reduced once its rows are in,
        # without waiting for the other ranks (`CombineKernel`'s `per_token`). Its tile hook is
        # the ticket walk's, and it needs counters zeroed before any rank signals a token:
        # at the call's start, ordered by the exchanged dispatch's count publication
        self.combine_tokens = config.combine == "tokens"
        if self.combine_tokens and not (config.walk == "tickets" and not config.local_dispatch):
            raise ValueError(f"config.combine: 'tokens' with walk='tickets' and the exchanged "
                             f"dispatch only, got walk={config.walk!r}, local_dispatch="
                             f"{config.local_dispatch!r}")
        self.combine = CombineKernel(layout, block_m, num_threads=self.num_threads,
                                     send_mode="epilogue", per_token=self.combine_tokens)
        # the combine's barriers wait behind every other wait of the call: a CTA stalled
        # anywhere else is seen there first, so they get twice the time limit and the stalled
        # wait itself makes the rank's report (one per rank: the first to time out)
        self.combine.timeout_ns *= 2
        if self.hold_cta is not None and self.combine.timeout_ns == 0:
            raise ValueError("debug 'hold_cta': needs a spin limit (CUTE_MEGAMOE_SPIN_TIMEOUT_S "
                             "> 0)")
        # (its stall report names the CTAs that did not arrive: `Progress` of every warpgroup)
        self.combine.progress_warpgroups = self.num_threads // 128
        # the warpgroups in the GEMM roles: the register handover's (`REGS_TAKEN_BARRIER`)
        self.role_threads = 128 * (self.num_gemm_wgs + decode_wgs)
        reserved = self.dispatch.smem_bytes()
        e_l, p = layout.num_local_experts, layout.num_pool_rows
        h, inter = layout.hidden, layout.intermediate_hidden
        # the GEMM phases (the staged kernels' mainloop; the L1 rows go to the L2 pool by row
        # copies: the TMA store is not built into the fused kernel; L2 sends its rows to the
        # combine buffers as `config.row_stores` says). No clusters: CTA pairs multicasting the
        # weight tile (as the staged GEMMs at BLOCK_M 128) were bit-identical, but took 1.20x
        # the fused layer's time at 4096 / 8192 tokens on an H200 (R = 1, 2026-12-04; pairs of
        # 128-row blocks often straddle two experts there, docs/performance.md); and ranks that
        # share a GPU (loopback tests) can leave a cooperative grid no room for its SM pairs
        gemm = Sm90GemmConfig(block_m=block_m, cluster_m=1, transposed=False,
                              promotion=config.promotion, k_unroll=config.k_unroll,
                              tma_store=False, row_stores="bulk",
                              decode_tables=config.decode_tables, early_tables=False)
        self.l1 = Sm90ExpertGemmKernel("l1", layout.recipe, e_l, p, 2 * inter, h, gemm,
                                       activation_clamp=activation_clamp, fast_math=fast_math,
                                       tiled_weights=tiled_weights, smem_reserved=reserved)
        self.l2 = Sm90ExpertGemmKernel("l2", layout.recipe, e_l, p, h, inter,
                                       replace(gemm, row_stores=config.row_stores),
                                       fast_math=fast_math, combine_layout=layout,
                                       tiled_weights=tiled_weights, smem_reserved=reserved)
        assert self.l1.decode_wgs == decode_wgs
        assert 128 * (self.l1.producer_regs + decode_wgs * self.l1.decode_regs
                      + self.l1.num_mma_wgs * self.l1.consumer_regs) <= 65536
        # L2 tiles start when the L1 tiles of their pool block are done (a gate on all L1
        # tiles, one counter, took 1.01-1.03x the time at 128 / 4096 tokens and 0.99x at 8192
        # on an H200: docs/performance.md, the phase clock)
        share_ring(self.l1, self.l2)
        self.l1.sync_scope = self.l2.sync_scope = self.dispatch.scope
        # the loads (and the FP4 decode warps) wait for their stages with time limits and
        # stall reports (which wait, CTA and thread), as the cross-rank waits do: a CTA whose
        # consumers stop otherwise shows up only as the other CTAs' stall at the combine's
        # barrier, since the first wait to time out is the rank's one report (the CTAs stuck
        # elsewhere are named by that report's progress scan, docs/notes/register-handover.md).
        # Not the consumers: a report's registers in their loop made ptxas spill the accumulators
        self.l1.stage_reports = self.l2.stage_reports = True
        # and instead a watchdog warp over the consumers' k-blocks, which reports which state
        # of their next stage they stopped at (`watch_consumers`; the producer warpgroup's
        # warp 2, idle while the GEMMs run)
        self.watchdog = self.fp4_weights and spin_timeout_ns() > 0
        self.l2.late_metadata = self.rows_counted  # (no grid barrier after the metadata)
        # `weights_first`: tiles whose pool block is not ready load their first stages'
        # weights before they wait (`Sm90ExpertGemmKernel.produce`). Loading them first for
        # every waiting tile (the A/B of docs/performance.md) delayed ready tiles' first stages
        # (1.02-1.04x at 4096-8192 with barrier rows); the variant that checks the pool block
        # first measured no change at 1 token, where with counted rows a CTA's own pushes come
        # before its first tile. So with the counted transfers (FP8 / BF16 weights, BLOCK_M
        # 64) warp 0 also loads its first L1 tile's first stages' weights
        # once the pool's prefix sums are in place, before the metadata and the rows: 1 token
        # 108 us graph against 114 (R = 1, H200), 128 tokens unchanged. By default on with the
        # counted transfers at BLOCK_M 64 (`heuristics.default_fused_config`)
        self.l1.weights_first = self.l2.weights_first = config.weights_first
        # `walk` "tickets" (docs/notes/dataflow.md, sections 1-3; the pools keep their size, no
        # rings yet): the L1 and L2 tiles of the lag-ordered sequence (`DataflowSequence`,
        # one-block raster bands), warp 0 taking the next position with one atomic add on this
        # call's ticket counter (`pool_block_ready[num_pool_blocks]`, zeroed with the
        # readiness counters) and handing it to the consumers through the tile queue; every
        # wait points to an earlier position (an L2 tile's to its block's L1 tiles, which
        # signal once each is stored), so the walk ends for any grid and routing
        self.tickets = config.walk == "tickets"
        if self.tickets and self.fp4_weights:
            raise ValueError("config.walk: 'tickets' with FP8 / BF16 weights only (the decode "
                             "warpgroups walk their tiles in phases)")
        n1, n2 = self.l1.num_n_blocks, self.l2.num_n_blocks
        self.sequence = DataflowSequence(
            n1, n2, dataflow_lag(DEFAULT_NUM_SMS, n1, n2, config.lag_grids, config.band),
            config.band)
        # `l1_ring_rows` (the ticket walk): the L1 outputs in a ring of pool blocks, each
        # reused once the L2 tiles of its previous block loaded their rows (the readiness
        # counter counts those too); deadlock-free from `min_ring_slots` slots on
        # (docs/notes/dataflow.md, section 2). The buffer's L1-output region holds the whole
        # pool or, laid out for it (`MegaMoELayout.l1_output_rows`), at least the ring's slots
        self.ring_blocks = config.l1_ring_rows // block_m
        ring_region = layout.num_l1_output_rows
        if ring_region < layout.num_pool_rows and not (
                self.ring_blocks and self.ring_blocks * block_m <= ring_region):
            raise ValueError(
                f"the buffer keeps the L1 outputs in a ring of {ring_region} rows "
                f"(l1_output_rows {layout.l1_output_rows}); the fused kernel runs on it with "
                f"walk='tickets' and l1_ring_rows <= {ring_region} only, got walk "
                f"{config.walk!r}, l1_ring_rows {config.l1_ring_rows}")
        # (the region's rows: the L1 outputs' and their scales' row stride)
        self.l1.out_rows = self.l2.a_rows = ring_region
        self.l2.a_ring_blocks = self.ring_blocks
        if self.ring_blocks:
            fewest = min_ring_slots(self.sequence.lag, config.band)
            if self.ring_blocks < fewest:
                raise ValueError(
                    f"config.l1_ring_rows: {config.l1_ring_rows} rows are {self.ring_blocks} "
                    f"blocks of {block_m}, fewer than the {fewest} the ticket walk's lag "
                    f"{self.sequence.lag} (lag_grids {config.lag_grids}, band {config.band}) "
                    f"needs to be deadlock-free")
            for phase in (self.l1, self.l2):
                phase.ring_blocks = self.ring_blocks
            self.l1.ring_reads = self.l1.tile_signals() + n2
        # "pulled" rows (the ticket walk): the received rows in a ring of pool blocks where
        # the buffer lays them out so (`MegaMoELayout.received_rows`), a slot refilled once
        # every L1 tile of its previous block is done (W4); deadlock-free with slots of at
        # least a band, and from two bands on a consumer's one-tile-late L1 signal never
        # holds back the rows of its next L1 tile (`consume_by_ticket`)
        if self.rows_pulled and not self.tickets:
            raise ValueError("config.row_transfer: 'pulled' with walk='tickets' only")
        rows_region = layout.num_received_rows
        self.rows_ring_blocks = 0
        if rows_region < layout.num_pool_rows:
            if not self.rows_pulled:
                raise ValueError(
                    f"the buffer keeps the received rows in a ring of {rows_region} rows "
                    f"(received_rows {layout.received_rows}); the fused kernel fills it with "
                    f"row_transfer='pulled' only, got {config.row_transfer!r}")
            self.rows_ring_blocks = rows_region // block_m
            if self.rows_ring_blocks < 2 * config.band:
                raise ValueError(
                    f"the buffer's received-rows ring holds {self.rows_ring_blocks} blocks of "
                    f"{block_m} rows, fewer than the 2 bands of {config.band} the ticket walk "
                    f"needs")
        self.l1.a_rows = rows_region
        self.l1.a_ring_blocks = self.rows_ring_blocks
        # (the ticket walk: of its first ticket's tile, taken as soon as the prefix sums are in)
        self.early_weights = (self.l1.weights_first and self.rows_counted and block_m == 64
                              and not self.fp4_weights)
        # as many ring stages as shared memory holds next to the staging rows and the
        # dispatch's arrays (the phases' own choices keep a margin for a standalone kernel);
        # FP4 weights: the MMA stages the phases chose, and as many packed stages as fit
        self.num_stages = self.l1.num_stages
        if self.fp4_weights:
            self.packed_stages = 2
            share_ring(self.l1, self.l2, self.num_stages, 2)
            while (self.packed_stages < MAX_STAGES
                   and self.smem_bytes(packed_stages=self.packed_stages + 1)
                   <= SM_SMEM_CAPACITY):
                self.packed_stages += 1
        else:
            self.packed_stages = 0
            while (self.num_stages < MAX_STAGES
                   and self.smem_bytes(self.num_stages + 1) <= SM_SMEM_CAPACITY):
                self.num_stages += 1
        share_ring(self.l1, self.l2, self.num_stages, self.packed_stages or None)
        if self.smem_bytes() > SM_SMEM_CAPACITY:
            raise ValueError(f"the fused kernel needs {self.smem_bytes()} bytes of shared "
                             f"memory, more than a CTA may have ({SM_SMEM_CAPACITY})")
        self.timeout_ns = spin_timeout_ns()

    def pointer_args(self) -> tuple[tuple[str, object], ...]:
        """``(name, CuTe dtype)`` of the pointer arguments of ``__call__``, in order (the
        launcher and the compile tests build them from this). The scale pointers of
        ``bf16xbf16`` are never dereferenced, the caller's inputs (``x``, ``topk_idx``,
        ``topk_weights``) only with `stages_inputs`."""
        from cutlass import BFloat16

        ab = self.l1.ab_dtype
        w = Uint8 if self.fp4_weights else ab  # (FP4: packed codes; w*_sf their block scales)
        return (("peer_bases", Int64), ("expert_recv_tokens", Int32), ("stats", Int32),
                ("l1_acts", ab), ("l1_acts_sf", Float32), ("l1_topk_weights", Float32),
                ("l2_acts", ab), ("l2_acts_sf", Float32), ("token_src_metadata", Int32),
                ("w1", w), ("w1_sf", Float32), ("w2", w), ("w2_sf", Float32),
                ("pool_block_ready", Int32), ("phase_clock", Int64), ("tile_log", Int32),
                ("y", BFloat16), ("w1_group_sf", Int32), ("w2_group_sf", Int32),
                ("x", BFloat16), ("topk_idx", Int64), ("topk_weights", Float32))

    def smem_bytes(self, num_stages: int | None = None, packed_stages: int | None = None) -> int:
        """Shared memory of one CTA with ``num_stages`` ring stages and ``packed_stages``
        stages of packed FP4 weights (default: the kernel's), an upper bound: alignment padding
        included."""
        k = self.l1
        elt = k.ab_dtype.width // 8
        num_stages = num_stages or self.num_stages
        ring = num_stages * ((k.block_m + k.block_n) * k.block_k * elt
                             + 4 * (k.sfa_stride + k.sfb_stride) + 16)
        if self.fp4_weights:  # packed codes, scale words, block scales, 2 + 1 mbarriers
            packed = packed_stages or self.packed_stages
            ring += packed * (k.block_n * (k.b_load_k() + 4) + 4 * k.packed_sfb_stride + 16)
            ring += num_stages * 8 + 3 * 128
        queue = TILE_QUEUE_SLOTS * (2 * 8 + 4) + 16 if self.tickets else 0
        if self.tickets and self.sequence.band > 1:  # (`band_start`)
            queue += (self.num_local_experts + 1) * 4 + 16
        return ring + k.staging_bytes + self.dispatch.smem_bytes() + queue + 3 * 1024

    @cute.jit
    def __call__(
        self,
        peer_bases: cute.Pointer,  # Int64 [R]: every rank's buffer base address
        rank: Int32,
        num_tokens: Int32,
        expert_recv_tokens: cute.Pointer,  # Int32 [E_l], output
        stats: cute.Pointer,  # Int32 [E_l], incremented when has_stats
        l1_acts: cute.Pointer,  # the buffer's regions (their addresses, for the TMA descriptors)
        l1_acts_sf: cute.Pointer,
        l1_topk_weights: cute.Pointer,
        l2_acts: cute.Pointer,
        l2_acts_sf: cute.Pointer,
        token_src_metadata: cute.Pointer,
        w1: cute.Pointer,  # [E_l, 2I, H] and its block scales (see `expert_gemm.ExpertWeights`)
        w1_sf: cute.Pointer,
        w2: cute.Pointer,  # [E_l, H, I]
        w2_sf: cute.Pointer,
        pool_block_ready: cute.Pointer,  # Int32 [P / BLOCK_M], per-call readiness counters
        phase_clock: cute.Pointer,  # Int64 [grid, len(PHASE_STAMPS)], written with phase_clock
        tile_log: cute.Pointer,  # Int32 [tiles per CTA, grid, 4] with tile_log; tile_clock's
        y: cute.Pointer,  # BF16 [num_tokens, H]
        w1_group_sf: cute.Pointer,  # FP4 weights: UE8M0 per 32 (`ExpertWeights.w1_sf`)
        w2_group_sf: cute.Pointer,
        x: cute.Pointer,  # with stages_inputs: the caller's BF16 [num_tokens, H]
        topk_idx: cute.Pointer,  # Int64 [num_tokens, K]
        topk_weights: cute.Pointer,  # Float32 [num_tokens, K]
        num_ctas: Int32,
        stream,
    ):
        tiled_mma, a_layout, b_layout = self.l1.mma_and_stage_layouts()
        tma_a1, m_a1, tma_b1, m_b1 = self.l1.tma_loads(l1_acts, w1, a_layout, b_layout)
        tma_a2, m_a2, tma_b2, m_b2 = self.l2.tma_loads(l2_acts, w2, a_layout, b_layout)
        # NOTES: `Sm90ExpertGemmKernel.produce`'s multicast atoms: with no clusters, the weight
        # atoms again, never used to load; as kernel parameters of their own (dropping them
        # moves every later parameter by 2 x 128 bytes, a change of the build)
        tma_b1_mc, tma_b2_mc = tma_b1, tma_b2
        k = self.l1

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, self.num_stages * 2]
            sfa: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.num_stages * k.sfa_stride], 16]
            sfb: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.num_stages * k.sfb_stride], 16]
            sa: cute.struct.Align[cute.struct.MemRange[k.ab_dtype, cute.cosize(a_layout)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[k.ab_dtype, cute.cosize(b_layout)], 1024]
            staging: cute.struct.Align[cute.struct.MemRange[Uint8, k.staging_bytes], 128]
            if cutlass.const_expr(self.fp4_weights):  # the packed stages, the decode's barriers
                packed_mbar: cute.struct.MemRange[Int64, k.packed_stages * 2]
                raw_b: cute.struct.Align[cute.struct.MemRange[Uint8, k.raw_b_bytes()], 128]
                sfg: cute.struct.Align[cute.struct.MemRange[Int32, k.sfg_len()], 16]
                sfb_packed: cute.struct.Align[cute.struct.MemRange[
                    cutlass.Float32, k.packed_stages * k.packed_sfb_stride], 16]
                decoded: cute.struct.MemRange[Int64, self.num_stages]
                # the consumers' k-blocks so far (the watchdog's, `watch_consumers`)
                consumer_progress: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]
            if cutlass.const_expr(self.tickets):  # the tile queue: barriers, then positions
                queue_mbar: cute.struct.MemRange[Int64, TILE_QUEUE_SLOTS * 2]
                queue: cute.struct.Align[cute.struct.MemRange[Int32, TILE_QUEUE_SLOTS], 16]
            if cutlass.const_expr(self.tickets and self.sequence.band > 1):  # (`band_start`)
                band_start: cute.struct.Align[
                    cute.struct.MemRange[Int32, self.num_local_experts + 1], 16]

        self.shared_storage = SharedStorage
        per_expert = cute.make_layout(self.num_local_experts)
        self.kernel(tiled_mma, tma_a1, m_a1, tma_b1, tma_b1_mc, m_b1, tma_a2, m_a2, tma_b2,
                    tma_b2_mc, m_b2, a_layout, b_layout, peer_bases, rank, num_tokens,
                    cute.make_tensor(expert_recv_tokens, per_expert),
                    cute.make_tensor(stats, per_expert), l1_acts_sf, l1_topk_weights, l2_acts,
                    l2_acts_sf, token_src_metadata, w1_sf, w2_sf, pool_block_ready, phase_clock,
                    tile_log, y, w1_group_sf, w2_group_sf, x, topk_idx, topk_weights).launch(
            grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1],
            cluster=[1, 1, 1], min_blocks_per_mp=1, stream=stream,
            cooperative=True)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a1: cute.CopyAtom, m_a1: cute.Tensor,
               tma_b1: cute.CopyAtom, tma_b1_mc: cute.CopyAtom, m_b1: cute.Tensor,
               tma_a2: cute.CopyAtom, m_a2: cute.Tensor, tma_b2: cute.CopyAtom,
               tma_b2_mc: cute.CopyAtom, m_b2: cute.Tensor,
               a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
               peer_bases_ptr: cute.Pointer, rank: Int32, num_tokens: Int32,
               expert_recv_tokens: cute.Tensor, stats: cute.Tensor, l1_acts_sf: cute.Pointer,
               l1_topk_weights: cute.Pointer, l2_acts: cute.Pointer, l2_acts_sf: cute.Pointer,
               token_src_metadata: cute.Pointer, w1_sf: cute.Pointer, w2_sf: cute.Pointer,
               pool_block_ready: cute.Pointer, phase_clock: cute.Pointer,
               tile_log: cute.Pointer, y: cute.Pointer, w1_group_sf: cute.Pointer,
               w2_group_sf: cute.Pointer, x: cute.Pointer, topk_idx: cute.Pointer,
               topk_weights: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        peer_bases = cute.make_tensor(peer_bases_ptr, cute.make_layout(self.num_ranks))
        my_base = Int64(peer_bases[rank])
        barrier = self.regions.ptr(my_base, "barrier")
        stamps = phase_clock + bidx * len(PHASE_STAMPS)
        self.stamp(stamps, "start", tidx == 0)
        self.mark(peer_bases, rank, Progress.DISPATCH)
        if warp == 0:
            for atom in (tma_a1, tma_b1, tma_a2, tma_b2):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sfa, sfb = self.l1.scale_stages(storage.sfa.data_ptr(), storage.sfb.data_ptr())
        sa = storage.sa.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sb = storage.sb.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # (every consumer warp frees a stage)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.l1.num_mma_wgs * 4),
            tx_count=self.l1.ring_tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        packed_pipe, decoded, raw_b = None, None, None
        if cutlass.const_expr(self.fp4_weights):
            packed_pipe = self.l1.packed_pipeline(storage.packed_mbar.data_ptr())
            decoded = storage.decoded.data_ptr()
            self.l1.init_decoded_barriers(decoded, tidx)
            raw_b = storage.raw_b.get_tensor(self.l1.raw_b_layout())
            if tidx == 0:  # (ordered before any use by the barriers ahead of the roles)
                cute.make_tensor(storage.consumer_progress.data_ptr(),
                                 cute.make_layout(1))[0] = Int32(0)
        band_start = None  # (the ticket walk's banded blocks per expert, bands of > 1 block)
        if cutlass.const_expr(self.tickets and self.sequence.band > 1):
            band_start = cute.make_tensor(storage.band_start.data_ptr(),
                                          cute.make_layout(self.num_local_experts + 1))
        queue = None  # (`walk` "tickets": the tile queue and its positions)
        if cutlass.const_expr(self.tickets):
            queue = (pipeline.PipelineAsync.create(
                barrier_storage=storage.queue_mbar.data_ptr(), num_stages=TILE_QUEUE_SLOTS,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.l1.num_mma_wgs * 4),
                defer_sync=True),
                cute.make_tensor(storage.queue.data_ptr(), cute.make_layout(TILE_QUEUE_SLOTS)))
        cute.arch.mbarrier_init_fence()

        # this call's readiness and arrival counters start at 0: every call leaves them so
        # (step 4), and the exchanged dispatch zeroes them here too (ordered before any use by
        # its grid arrival; senders add to the arrivals only once they have this rank's counts
        # of the call, which it publishes after them). The local dispatch has no such order:
        # it relies on the previous call's step 4 (a fresh buffer is zeroed)
        rows_arrived = self.regions.ptr(my_base, "pool_block_arrivals")
        if cutlass.const_expr(not self.local_dispatch):
            self.zero_counters(pool_block_ready, rows_arrived, tidx, bidx, grid)
        # (`combine` "tokens": this call's token counts start at 0 too, and only here: a CTA
        # still reduces its tokens once another has passed the end of the call; every rank
        # that signals a token of this rank has its counts of the call first)
        if cutlass.const_expr(self.combine_tokens):
            self.zero_token_arrivals(pool_block_ready, num_tokens, tidx, bidx, grid)

        if cutlass.const_expr(self.stages_inputs and not self.local_dispatch):
            self.stage_inputs(x, topk_idx, topk_weights, my_base, num_tokens, tidx, bidx, grid,
                              lane)

        # 1. dispatch: counts, prefix sums, scatter, metadata, and the rows: "barrier": all
        # of it, then a grid barrier (the pool is complete); counted: every CTA has the pool's
        # layout, and the pool blocks count their rows and metadata in (no barrier), every
        # warp moving the rows
        dispatch = None
        preloaded = None  # (the early weights: stages of the first L1 tile loaded)
        first_ticket = None  # (the ticket walk's, taken for its early weights)
        early = (tma_b1, tma_b1_mc, m_b1, sb, sfb, w1_sf, ring, bidx, warp, lane)
        if cutlass.const_expr(self.local_dispatch):
            dispatch = self.dispatch.allocate_arrays(smem)
            batch = self.dispatch.allocate_batch(smem)
            row_start, block_start = self.dispatch.count_locally(
                my_base, topk_idx, num_tokens, expert_recv_tokens, stats, dispatch)
            self.stamp(stamps, "counts_seen", tidx == 0, fenced=False)
            self.build_band_start(block_start, band_start, warp)
            if cutlass.const_expr(self.early_weights):  # (as the exchanged dispatch's below)
                preloaded, first_ticket = self.load_early_weights(
                    early, block_start, row_start, pool_block_ready, band_start)
            self.stamp(stamps, "prefix_ready", tidx == 0)
            self.place_locally(x, topk_weights, my_base, num_tokens, dispatch, batch,
                               tidx, bidx, grid, lane)
            self.stamp(stamps, "rows_sent", tidx == 0)
            cute.arch.sync_threads()  # (as below: every warp before the setmaxnreg)
        elif cutlass.const_expr(self.rows_counted):
            dispatch = self.dispatch.allocate_arrays(smem)
            counts, row_start, block_start = self.dispatch.exchange_counts(
                peer_bases, rank, num_tokens, expert_recv_tokens, stats, dispatch,
                self.dispatch_stamp(stamps, tidx), metadata=not self.early_weights)
            self.build_band_start(block_start, band_start, warp)
            if cutlass.const_expr(self.early_weights):
                # the first L1 tile's weights stream in while this CTA writes metadata and
                # pushes rows (its rows follow in `produce`)
                preloaded, first_ticket = self.load_early_weights(
                    early, block_start, row_start, pool_block_ready, band_start)
                self.dispatch.write_metadata(peer_bases, my_base, counts, row_start,
                                             block_start)
            self.stamp(stamps, "prefix_ready", tidx == 0)
            if cutlass.const_expr(not self.rows_pulled):  # ("pulled": the pullers, below)
                num_warps = self.num_threads // 32
                self.dispatch.push_in_pool_order(peer_bases, rank, bidx * num_warps + warp,
                                                 grid * num_warps, lane, dispatch)
                self.stamp(stamps, "rows_sent", tidx == 0)
            # every warp of a warpgroup must reach its setmaxnreg below together (the warps
            # finish their metadata rows, and rows, at different times; without this a
            # two-rank call with counted rows hung)
            cute.arch.sync_threads()
        else:
            row_start, block_start = self.dispatch.run(peer_bases, rank, num_tokens,
                                                       expert_recv_tokens, stats, smem,
                                                       self.dispatch_stamp(stamps, tidx))
            self.build_band_start(block_start, band_start, warp)  # (the barrier syncs first)
            grid_barrier(barrier, grid, self.timeout_ns, self.dispatch.scope)
            self.stamp(stamps, "prefix_ready", tidx == 0)

        # 2. L1 tiles then L2 tiles, one walk, one ring
        l1_tiles = self.l1.scheduler.num_tiles(block_start)
        l2_tiles = self.l2.scheduler.num_tiles(block_start)
        wg = warp // 4
        sb_load = raw_b if cutlass.const_expr(self.fp4_weights) else sb
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.l1.producer_regs)
            self.mark(peer_bases, rank, Progress.L1_TILES)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.num_stages)
                if cutlass.const_expr(self.tickets):
                    state = self.produce_by_ticket(
                        (tma_a1, m_a1, tma_b1, tma_b1_mc, m_b1, l1_acts_sf, w1_sf),
                        (tma_a2, m_a2, tma_b2, tma_b2_mc, m_b2, l2_acts_sf, w2_sf), sa,
                        sb_load, sfa, sfb, ring, queue, pool_block_ready, block_start,
                        row_start, lane, state, barrier, rows_arrived, first_ticket, preloaded,
                        band_start)
                else:
                    log = tile_log if cutlass.const_expr(self.tile_log) else None
                    state, tile = self.l1.produce(
                        tma_a1, m_a1, tma_b1, tma_b1_mc, m_b1, sa, sb_load, sfa, sfb, l1_acts_sf,
                        w1_sf, ring, block_start, row_start, l1_tiles, bidx, grid,
                        Int32(self.l1.raster_group), Int32(0), lane, state,
                        barrier_slots=barrier, tile_log=log,
                        rows_arrived=rows_arrived if cutlass.const_expr(self.rows_counted)
                        else None, arrivals_per_row=self.dispatch.arrivals_per_row,
                        preloaded=preloaded)
                    # (the L2 tiles of the walk come after this CTA's L1 tiles)
                    self.mark(peer_bases, rank, Progress.L2_TILES)
                    l1_count = (cutlass.max(l1_tiles - bidx, 0) + grid - 1) // grid
                    state, _ = self.l2.produce(
                        tma_a2, m_a2, tma_b2, tma_b2_mc, m_b2, sa, sb_load, sfa, sfb, l2_acts_sf,
                        w2_sf, ring, block_start, row_start, l2_tiles, tile - l1_tiles, grid,
                        Int32(self.l2.raster_group), Int32(0), lane, state, pool_block_ready,
                        barrier, tile_log=log, log_first=l1_count)
                self.mark(peer_bases, rank, Progress.LOADS_TAIL)
                self.l2.producer_tail(ring, state, barrier)
                self.stamp(stamps, "loads_done", lane == 0)
            elif cutlass.const_expr(self.fp4_weights):
                if warp == 1:  # the packed weights of both walks (they wait for nothing)
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                         self.packed_stages)
                    state, tile = self.l1.produce_packed(
                        tma_b1, m_b1, raw_b, packed_pipe, w1_sf, w1_group_sf,
                        storage.sfb_packed.data_ptr(), storage.sfg.data_ptr(), block_start,
                        row_start, l1_tiles, bidx, grid, Int32(self.l1.raster_group), lane,
                        state, barrier)
                    state, _ = self.l2.produce_packed(
                        tma_b2, m_b2, raw_b, packed_pipe, w2_sf, w2_group_sf,
                        storage.sfb_packed.data_ptr(), storage.sfg.data_ptr(), block_start,
                        row_start, l2_tiles, tile - l1_tiles, grid,
                        Int32(self.l2.raster_group), lane, state, barrier)
                    self.l2.producer_tail(packed_pipe, state, barrier,
                                          "the last packed weight stages, freed (packed loads)")
                    self.stamp(stamps, "packed_done", lane == 0)
                if cutlass.const_expr(self.watchdog):
                    if warp == 2:
                        self.watch_consumers(ring, decoded,
                                             storage.consumer_progress.data_ptr(), barrier,
                                             l1_tiles, l2_tiles, bidx, grid, lane)
            elif cutlass.const_expr(self.rows_pulled):
                # warps 1-3 pull this rank's rows (GEMM roles wait for them, they wait for L1
                # tiles only: they must not share threads with the GEMMs, W4)
                self.dispatch.pull_in_pool_order(
                    peer_bases, my_base, bidx * 3 + warp - 1, grid * 3, lane,
                    dispatch[1], row_start, block_start, pool_block_ready,
                    self.l1.tile_signals(), barrier)
                self.stamp(stamps, "rows_sent", tidx == 32)
            # the registers for the combine come from the consumers' decrease: wait until the
            # consumers hold theirs for the GEMMs (`REGS_TAKEN_BARRIER`; setmaxnreg is
            # warpgroup-wide, and this also lets the four warps meet: warp 0 comes late)
            self.handover(peer_bases, rank)
        elif wg < self.num_gemm_wgs:
            if cutlass.const_expr(self.late_consumers_ns > 0):
                if bidx % 2 == 1:
                    start = cute.arch.globaltimer()
                    while cute.arch.globaltimer() - start < Int64(self.late_consumers_ns):
                        pass
            self.mark(peer_bases, rank, Progress.GEMM_REGS)
            cute.arch.setmaxregister_increase(self.l1.consumer_regs)
            cute.arch.barrier_arrive(barrier_id=REGS_TAKEN_BARRIER,
                                     number_of_threads=self.role_threads)
            self.mark(peer_bases, rank, Progress.L1_TILES)
            progress = None
            if cutlass.const_expr(self.watchdog):
                progress = storage.consumer_progress.data_ptr()
            staging = storage.staging.data_ptr() + (warp - 4) * (ROWS_PER_WARP
                                                               * self.l1.staging_stride)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.num_stages)
            if cutlass.const_expr(self.tickets):
                state = self.consume_by_ticket(
                    tiled_mma, sa, sb, sfa, sfb, ring, queue, block_start, row_start, wg - 1,
                    warp % 4, lane, l1_topk_weights, l2_acts, l2_acts_sf, peer_bases_ptr,
                    token_src_metadata, staging, state, pool_block_ready, barrier,
                    tile_log if cutlass.const_expr(self.tile_clock) else None, band_start)
            else:
                state, prev, tile = self.l1.consume(
                    tiled_mma, sa, sb, sfa, sfb, ring, block_start, row_start, l1_tiles, bidx, grid,
                    Int32(self.l1.raster_group), Int32(0), wg - 1, warp % 4, lane,
                    l1_topk_weights, l2_acts, l2_acts_sf, peer_bases_ptr, token_src_metadata,
                    staging, state, state.clone(), pool_block_ready, decoded=decoded,
                    progress=progress)
                self.stamp(stamps, "l1_done", tidx == 128)
                # (no mark for the L2 walk here: its registers made ptxas spill around it)
                state, _, _ = self.l2.consume(
                    tiled_mma, sa, sb, sfa, sfb, ring, block_start, row_start, l2_tiles,
                    tile - l1_tiles, grid, Int32(self.l2.raster_group), Int32(0), wg - 1, warp % 4,
                    lane, l1_topk_weights, l2_acts, l2_acts_sf, peer_bases_ptr,
                    token_src_metadata, staging, state, prev, decoded=decoded,
                    progress=progress)
            if cutlass.const_expr(self.watchdog):
                if tidx == 128:  # (past the last tile's epilogue: one more than the k-blocks)
                    cute.make_tensor(progress, cute.make_layout(1))[0] = state.count + 1
            self.stamp(stamps, "l2_done", tidx == 128)
            self.mark(peer_bases, rank, Progress.ROLE_END)
            cute.arch.barrier(barrier_id=REGS_BARRIER + wg, number_of_threads=128)
            cute.arch.setmaxregister_decrease(self.combine_regs)
        elif self.l1.is_decode_wg(wg):  # FP4 weights: decode both walks' weight tiles
            self.decode(ring, packed_pipe, storage, decoded, block_start, row_start, l1_tiles,
                        l2_tiles, bidx, grid, wg, tidx, lane, stamps, barrier)
            self.handover(peer_bases, rank)

        if cutlass.const_expr(self.hold_cta is not None):
            if bidx == self.hold_cta:
                self.mark(peer_bases, rank, Progress.HELD)
                start = cute.arch.globaltimer()
                while cute.arch.globaltimer() - start < Int64(2 * self.combine.timeout_ns):
                    pass
        self.mark(peer_bases, rank, Progress.COMBINE)

        # 3. combine: the rows are in the source ranks' combine buffers (the L2 epilogues
        # waited for their stores); meet the other ranks, reduce. (The buffer's base and the
        # call tag are loaded again rather than kept in registers through the roles.)
        my_base = Int64(peer_bases[rank])
        barrier = self.regions.ptr(my_base, "barrier")
        self.combine.send_and_reduce(peer_bases, my_base, barrier, warp, lane, num_tokens,
                                     l1_topk_weights, row_start, block_start, y, None)
        # 4. the counters back to 0 for the next call: past the combine's barriers every CTA
        # of every rank is done with this call's (every row arrived, every L1 tile read them,
        # every L2 tile its gate), and no rank adds to them for its next call before this rank
        # publishes that call's counts (the local dispatch: before this rank's next launch)
        self.zero_counters(pool_block_ready, self.regions.ptr(my_base, "pool_block_arrivals"),
                           tidx, bidx, grid)
        # every rank has read this rank's counts of the call (the combine's barriers needed
        # every CTA of every rank, all past their dispatch)
        if bidx == 0 and tidx == 0 and cutlass.const_expr(self.rows_counted):
            finish_call(barrier, call_tags(barrier)[0])
        self.stamp(stamps, "end", tidx == 0)

    @cute.jit
    def produce_by_ticket(self, l1_loads, l2_loads, sa, sb, sfa, sfb, ring, queue,
                          pool_block_ready: cute.Pointer, block_start: cute.Tensor,
                          row_start: cute.Tensor, lane: Int32, state, barrier: cute.Pointer,
                          rows_arrived: cute.Pointer, first_ticket: Int32 = None,
                          preloaded: Int32 = None, band_start: cute.Tensor = None):
        """Warp 0 with `walk` "tickets": take positions of the lag-ordered sequence until it
        is done, hand each to the consumers (`publish`) and load its tile's stages as
        the phase's own walk would (a walk of one tile, pool block ``b`` and n-block ``n``
        being tile ``b * n_blocks + n`` of one-block raster bands). ``l1_loads`` /
        ``l2_loads``: each phase's TMA atoms and views, its activation and weight scales.
        ``first_ticket`` / ``preloaded``: the early weights' (`load_early_weights`): lane 0's
        first ticket, and the stages of its tile's weights loaded. Returns the ring's producer
        state."""
        tma_a1, m_a1, tma_b1, tma_b1_mc, m_b1, a1_sf, w1_sf = l1_loads
        tma_a2, m_a2, tma_b2, tma_b2_mc, m_b2, a2_sf, w2_sf = l2_loads
        num_blocks = block_start[self.num_local_experts]
        num_positions = self.sequence.num_positions(
            self.sequence.num_banded(block_start, band_start, self.num_local_experts))
        ticket = pool_block_ready + self.num_pool_blocks
        slot = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                            TILE_QUEUE_SLOTS)
        if cutlass.const_expr(first_ticket is None):
            first_ticket = self.take_ticket(ticket, lane)
        position = self.skip_padding(first_ticket, num_positions, num_blocks, block_start,
                                     band_start, ticket, lane)
        position, slot = self.publish(queue, slot, position, barrier, lane)
        # each phase's positions come in pool order (inside a band, one expert's blocks): a
        # tile's owner is found from the phase's previous one (`ExpertTileScheduler.owner_of`)
        owner1, owner2 = Int32(0), Int32(0)
        while position < num_positions:
            # the next ticket's atomic runs while this tile loads (its value is read when
            # published): the consumers find their next position ready
            upcoming = self.take_ticket(ticket, lane)
            is_l2, pool_block, n_block = self.ticket_tile(position, block_start, band_start)
            if pool_block >= num_blocks:  # (a guard: warp 0 publishes no band padding)
                pass
            elif is_l2 == 0:
                tile = pool_block * self.l1.num_n_blocks + n_block
                state, _, owner1 = self.l1.produce(
                    tma_a1, m_a1, tma_b1, tma_b1_mc, m_b1, sa, sb, sfa, sfb, a1_sf, w1_sf, ring,
                    block_start, row_start, tile + 1, tile, Int32(1), Int32(1), Int32(0), lane,
                    state, barrier_slots=barrier,
                    rows_arrived=rows_arrived if cutlass.const_expr(self.rows_counted)
                    else None, arrivals_per_row=self.dispatch.arrivals_per_row,
                    preloaded=preloaded, owner_hint=owner1)
                if cutlass.const_expr(preloaded is not None):
                    preloaded = Int32(0)  # (the first tile's only)
            else:
                tile = pool_block * self.l2.num_n_blocks + n_block
                state, _, owner2 = self.l2.produce(
                    tma_a2, m_a2, tma_b2, tma_b2_mc, m_b2, sa, sb, sfa, sfb, a2_sf, w2_sf, ring,
                    block_start, row_start, tile + 1, tile, Int32(1), Int32(1), Int32(0), lane,
                    state, pool_block_ready, barrier, owner_hint=owner2)
            upcoming = self.skip_padding(upcoming, num_positions, num_blocks, block_start,
                                         band_start, ticket, lane)
            position, slot = self.publish(queue, slot, upcoming, barrier, lane)
        return state

    @cute.jit
    def ticket_tile(self, position: Int32, block_start: cute.Tensor,
                    band_start: cute.Tensor = None):
        """The tile at ``position`` of the lag-ordered sequence: ``(is_l2, pool block,
        n-block)``, the pool block the pool's block count for an expert's band padding or a
        position past the end (no tile; `DataflowSequence`)."""
        is_l2, banded, n_block = self.sequence.position(
            position, self.sequence.num_banded(block_start, band_start, self.num_local_experts))
        return is_l2, self.sequence.pool_block(banded, block_start, band_start,
                                               self.num_local_experts), n_block

    @cute.jit
    def skip_padding(self, mine: Int32, num_positions: Int32, num_blocks: Int32,
                     block_start: cute.Tensor, band_start: cute.Tensor, ticket: cute.Pointer,
                     lane: Int32) -> Int32:
        """Warp 0, bands of > 1 block: the position lane 0 took (``mine``), or past an
        expert's band padding the first position a further ticket gives that holds a tile
        (or lies past the end), so that the consumers never wait on a position without a
        tile. One-block bands have no padding: ``mine`` as it is."""
        position = mine
        if cutlass.const_expr(band_start is not None):
            position = cute.arch.shuffle_sync(mine, 0)
            _, block, _ = self.ticket_tile(position, block_start, band_start)
            padding = (position < num_positions) & (block >= num_blocks)
            while padding:
                position = cute.arch.shuffle_sync(self.take_ticket(ticket, lane), 0)
                _, block, _ = self.ticket_tile(position, block_start, band_start)
                padding = (position < num_positions) & (block >= num_blocks)
        return position

    @cute.jit
    def build_band_start(self, block_start: cute.Tensor, band_start: cute.Tensor,
                         warp: Int32):
        """Bands of > 1 block: warp 0 lays out the banded blocks (`DataflowSequence.
        build_band_start`) once the pool's prefix sums are in; the other warps read them
        after the CTA's next sync."""
        if cutlass.const_expr(band_start is not None):
            if warp == 0:
                self.sequence.build_band_start(block_start, band_start,
                                               self.num_local_experts)

    @cute.jit
    def take_ticket(self, ticket: cute.Pointer, lane: Int32) -> Int32:
        """Warp 0: lane 0 takes the next position (one atomic add on the call's ``ticket``
        counter; positions past the sequence mean its end), which `publish` reads."""
        mine = Int32(0)
        if lane == 0:
            mine = cute.arch.atomic_add(ticket, Int32(1), sem="relaxed", scope="gpu")
        return mine

    @cute.jit
    def publish(self, queue, slot, mine: Int32, barrier: cute.Pointer, lane: Int32):
        """Warp 0: the position lane 0 took (`take_ticket`) to every lane, and into the tile
        queue's next slot once the consumers have read that slot's last one. Returns
        ``(position, slot)``."""
        pipe, positions = queue
        position = cute.arch.shuffle_sync(mine, 0)
        wait_stage(barrier, pipe.sync_object_empty.get_barrier(slot.index), slot.phase,
                   slot.index, "a free tile-queue slot (loads)", self.timeout_ns)
        if lane == 0:
            positions[slot.index] = position
            pipe.producer_commit(slot)  # (the mbarrier arrive releases the store to the CTA)
        slot.advance()
        return position, slot

    @cute.jit
    def consume_by_ticket(self, tiled_mma, sa, sb, sfa, sfb, ring, queue,
                          block_start: cute.Tensor, row_start: cute.Tensor, mma_wg: Int32,
                          warp_in_wg: Int32, lane: Int32, l1_topk_weights: cute.Pointer,
                          l2_acts: cute.Pointer, l2_acts_sf: cute.Pointer,
                          peer_bases: cute.Pointer, token_src_metadata: cute.Pointer,
                          staging: cute.Pointer, state, pool_block_ready: cute.Pointer,
                          barrier: cute.Pointer, clock: cute.Pointer = None,
                          band_start: cute.Tensor = None):
        """A consumer warp with `walk` "tickets": the positions warp 0 took, in its order,
        each a walk of one tile of its phase (`produce_by_ticket`). An L1 tile signals its
        pool block's readiness one tile late, after the next L1 tile's mainloop, while its
        stores drain (as in the phase walk), but before any L2 tile's: an L2 tile (of this CTA
        or any other) never waits for a signal held behind a wait of its own; with a
        received-rows ring, neither does an L1 tile's (its rows wait for L1 signals only of
        blocks a ring back, which go out first). With `combine` "tokens" each L2 tile is
        counted once stored (`signal_tokens`: it waits for nothing). ``clock``
        (`TILE_CLOCK_TILES`): the first consumer thread records each tile's span. Returns the
        ring's consumer state."""
        num_blocks = block_start[self.num_local_experts]
        num_positions = self.sequence.num_positions(
            self.sequence.num_banded(block_start, band_start, self.num_local_experts))
        slot = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                            TILE_QUEUE_SLOTS)
        prev = state.clone()
        owed = Int32(-1)  # the pool block of this warp's last L1 tile, not signalled yet
        owner1, owner2 = Int32(0), Int32(0)  # (each phase's last owner, as warp 0's)
        clocked = Int32(0)  # (tiles recorded)
        clocks = mma_wg == 0 and warp_in_wg == 0 and lane == 0
        position, slot = self.read_position(queue, slot, barrier, lane)
        while position < num_positions:
            is_l2, pool_block, n_block = self.ticket_tile(position, block_start, band_start)
            start = Int64(0)
            if cutlass.const_expr(clock is not None):
                start = cute.arch.globaltimer()
            if pool_block >= num_blocks:  # (a guard: warp 0 publishes no band padding)
                pass
            elif is_l2 == 0:
                if cutlass.const_expr(self.rows_ring_blocks > 0):
                    # this tile's rows may wait for a ring slot, for the L1 tiles of blocks a
                    # ring back: a signal owed for a block that far back (less a band: the
                    # blocks it waits for are then in earlier bands, whose L1 tiles all come
                    # first) goes out before this tile's mainloop instead of after it
                    far = self.rows_ring_blocks - self.sequence.band
                    if owed >= 0 and pool_block - owed >= far:
                        self.l1.signal_ready(pool_block_ready, owed, lane)
                        owed = Int32(-1)
                tile = pool_block * self.l1.num_n_blocks + n_block
                state, prev, _, owed, owner1 = self.l1.consume(
                    tiled_mma, sa, sb, sfa, sfb, ring, block_start, row_start, tile + 1, tile,
                    Int32(1), Int32(1), Int32(0), mma_wg, warp_in_wg, lane, l1_topk_weights,
                    l2_acts, l2_acts_sf, peer_bases, token_src_metadata, staging, state, prev,
                    pool_block_ready, owed_block=owed, signal_last=False,
                    barrier_slots=barrier, owner_hint=owner1)
            else:
                if owed >= 0:
                    self.l1.signal_ready(pool_block_ready, owed, lane)
                    owed = Int32(-1)
                tile = pool_block * self.l2.num_n_blocks + n_block
                state, prev, _, owner2 = self.l2.consume(
                    tiled_mma, sa, sb, sfa, sfb, ring, block_start, row_start, tile + 1, tile,
                    Int32(1), Int32(1), Int32(0), mma_wg, warp_in_wg, lane, l1_topk_weights,
                    l2_acts, l2_acts_sf, peer_bases, token_src_metadata, staging, state, prev,
                    pool_block_ready, owner_hint=owner2)
                if cutlass.const_expr(self.combine_tokens):  # (its rows are stored: `consume`)
                    self.signal_tokens(pool_block, tile, owner2, block_start, row_start,
                                       peer_bases, token_src_metadata, barrier, lane)
            if cutlass.const_expr(clock is not None):
                if pool_block < num_blocks:
                    if clocks and clocked < TILE_CLOCK_TILES:
                        bidx, _, _ = cute.arch.block_idx()
                        entry = clock + (bidx * TILE_CLOCK_TILES + clocked) * 4
                        end = cute.arch.globaltimer()
                        cute.arch.store(entry, ((1 + is_l2) << 24) | n_block)
                        cute.arch.store(entry + 1, pool_block)
                        cute.arch.store(entry + 2, Int32(start & 0xFFFFFFFF))
                        cute.arch.store(entry + 3, Int32(end & 0xFFFFFFFF))
                    clocked += 1
            position, slot = self.read_position(queue, slot, barrier, lane)
        if owed >= 0:  # (waits for the stores, as a phase walk's end)
            self.l1.signal_ready(pool_block_ready, owed, lane)
        return state

    @cute.jit
    def signal_tokens(self, pool_block: Int32, tile: Int32, owner: Int32,
                      block_start: cute.Tensor, row_start: cute.Tensor, peer_bases: cute.Pointer,
                      token_src_metadata: cute.Pointer, barrier: cute.Pointer, lane: Int32):
        """A consumer warp with `combine` "tokens", after its part of L2 tile ``tile`` (pool
        block ``pool_block``, expert ``owner``), whose rows `consume` stored into the source
        ranks' combine buffers and waited for: one count in the block's `pool_block_l2_done`
        (``barrier``: this rank's barrier slots, where the region's offset is taken from). The
        warp whose count completes the block (`tile_signals`: every consumer warp of each of
        its L2 tiles) adds 1 per valid row of the block to the row's token in its source rank's
        `token_arrivals`, which that rank's reduction waits for (dataflow.md 1.6).

        Memory order, as the split barriers' (`sync.split_barrier_arrive`): every warp orders
        its row stores (bulk stores: the proxy fence; to peers: the fence at the group's scope,
        system for several ranks) before its count, a release at GPU scope (the counter is
        this GPU's); the completing count (acq_rel) acquires all of them, its fence at the
        group's scope makes them cumulative, and the warp sync hands that to every lane
        before its release add to a token. A reader that acquires the token's count then
        sees each of its rows of the block, whichever CTA stored them."""
        scope = self.dispatch.scope
        target = self.l2.tile_signals()
        l2_done = self.beside(barrier, "barrier", "pool_block_l2_done")
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_warp()
        count = Int32(0)
        if lane == 0:
            fence_acq_rel(scope)
            count = cute.arch.atomic_add(l2_done + pool_block, Int32(1), sem="acq_rel",
                                         scope="gpu")
            if count == target - 1:
                fence_acq_rel(scope)
        cute.arch.sync_warp()
        if cute.arch.shuffle_sync(count, 0) == target - 1:
            _, _, _, _, _, valid_m = self.l2.scheduler.tile(tile, owner, block_start, row_start,
                                                            Int32(1))
            peers = cute.make_tensor(peer_bases, cute.make_layout(self.num_ranks))
            row = lane
            while row < valid_m:
                meta = token_src_metadata + (pool_block * self.block_m + row) * 4
                source, token = cute.arch.load(meta, Int32), cute.arch.load(meta + 1, Int32)
                arrivals = cute.make_ptr(
                    Int32, peers[source] + self.regions.offset("token_arrivals") + Int64(token) * 4,
                    cute.AddressSpace.gmem, assumed_align=4)
                cute.arch.red(arrivals, Int32(1), op="add", dtype="s32", sem="release",
                              scope=scope)
                row += 32

    @cute.jit
    def read_position(self, queue, slot, barrier: cute.Pointer, lane: Int32):
        """A consumer warp: the next position from the tile queue (bounded wait), then the
        slot freed for warp 0 (one arrive per warp, once every lane has read it). Returns
        ``(position, slot)``."""
        pipe, positions = queue
        wait_stage(barrier, pipe.sync_object_full.get_barrier(slot.index), slot.phase,
                   slot.index, "a position in the tile queue (GEMM consumers)", self.timeout_ns)
        position = positions[slot.index]
        cute.arch.sync_warp()
        if lane == 0:
            pipe.consumer_release(slot)
        slot.advance()
        return position, slot

    @cute.jit
    def handover(self, peer_bases: cute.Tensor, rank: Int32):
        """A warpgroup of the GEMM roles other than the consumers (the loads, FP4's decode), at
        the end of its role: once every consumer warpgroup holds its GEMM registers
        (`REGS_TAKEN_BARRIER`, which they arrive at right after their setmaxnreg.inc), take
        the combine's registers. Before the handover a warpgroup with no tiles could take back
        the registers it released before the consumers took them; their increase then never
        found any."""
        self.mark(peer_bases, rank, Progress.REGS_TAKEN)
        cute.arch.barrier(barrier_id=REGS_TAKEN_BARRIER, number_of_threads=self.role_threads)
        self.mark(peer_bases, rank, Progress.COMBINE_REGS)
        cute.arch.setmaxregister_increase(self.combine_regs)

    @cute.jit
    def mark(self, peer_bases: cute.Tensor, rank: Int32, step: cutlass.Constexpr):
        """The first thread of this thread's warpgroup: its progress word in ``cta_progress``
        is ``step`` of this call (`reports.Progress`; the call: the split barriers' count, which
        changes only after the combine). The buffer's base is loaded here, relaxed, so that the
        compiler cannot keep the kernel's first load of it in registers through the GEMM roles
        (ptxas spilled the FP4 consumers' accumulators when it did)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx % 128 == 0:
            bidx, _, _ = cute.arch.block_idx()
            base = cute.arch.load(peer_bases.iterator + rank, Int64, sem="relaxed", scope="gpu")
            barrier = self.regions.ptr(base, "barrier")
            calls = cute.arch.load(barrier + BarrierSlots.SPLIT_CALLS, Int32)
            word = ((calls & 0xFF) << 24) | Int32(step << 16)
            cute.arch.store(barrier + self.progress_offset + bidx * PROGRESS_WARPGROUPS
                            + tidx // 128, word, sem="relaxed", scope="gpu")

    @cute.jit
    def load_early_weights(self, early, block_start: cute.Tensor, row_start: cute.Tensor,
                           pool_block_ready: cute.Pointer, band_start: cute.Tensor = None):
        """With the early weights, warp 0 once the pool's prefix sums are in: its first L1
        tile's first stages' weights (`Sm90ExpertGemmKernel.load_first_weights`; ``early``:
        what it loads them with). The ticket walk's first tile is its first ticket's, taken
        here (a tile ahead of the CTA's pushes: those wait for nothing). Returns how many
        stages (0 in the other warps), and with the ticket walk lane 0's first ticket (for
        `produce_by_ticket`; else None)."""
        tma_b1, tma_b1_mc, m_b1, sb, sfb, w1_sf, ring, cta, warp, lane = early
        loaded = Int32(0)
        first_ticket = None
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.num_stages)
        if cutlass.const_expr(self.tickets):
            first_ticket = Int32(0)
            if warp == 0:
                first_ticket = self.take_ticket(pool_block_ready + self.num_pool_blocks, lane)
                num_blocks = block_start[self.num_local_experts]
                is_l2, pool_block, n_block = self.ticket_tile(
                    cute.arch.shuffle_sync(first_ticket, 0), block_start, band_start)
                tile = pool_block * self.l1.num_n_blocks + n_block
                # (an L2 tile, an expert's band padding or the sequence's end: none, as past
                # the L1 tiles)
                num_tiles = cutlass.select_((is_l2 == 0) & (pool_block < num_blocks),
                                            tile + 1, Int32(0))
                loaded = self.l1.load_first_weights(
                    tma_b1, tma_b1_mc, m_b1, sb, sfb, w1_sf, ring, block_start, row_start,
                    num_tiles, tile, Int32(1), lane, state)
        elif warp == 0:
            loaded = self.l1.load_first_weights(
                tma_b1, tma_b1_mc, m_b1, sb, sfb, w1_sf, ring, block_start, row_start,
                self.l1.scheduler.num_tiles(block_start), cta, Int32(self.l1.raster_group),
                lane, state)
        return loaded, first_ticket

    @cute.jit
    def zero_counters(self, pool_block_ready: cute.Pointer, rows_arrived: cute.Pointer,
                      tidx: Int32, bidx: Int32, grid: Int32):
        """The grid's share of this call's readiness and arrival counters set to 0, and the
        pair past the pool's last block (no tile of this kernel counts there since the
        clusters and the gate on all L1 tiles went; kept so that the build stays as it was);
        with `combine` "tokens", of the L2 tiles done per block too."""
        i = bidx * self.num_threads + tidx
        while i < self.num_pool_blocks + 1:
            cute.arch.store(pool_block_ready + i, Int32(0))
            cute.arch.store(rows_arrived + i, Int32(0))
            if cutlass.const_expr(self.combine_tokens):
                if i < self.num_pool_blocks:
                    cute.arch.store(self.beside(pool_block_ready, "pool_block_ready",
                                                "pool_block_l2_done") + i, Int32(0))
            i += grid * self.num_threads

    def beside(self, ptr: cute.Pointer, region: str, other: str) -> cute.Pointer:
        """The int32 region ``other`` of the buffer in which ``ptr`` is region ``region``'s
        start (a constant offset from a pointer the caller holds: no buffer base kept in
        registers for it)."""
        return ptr + (self.regions.offset(other) - self.regions.offset(region)) // 4

    @cute.jit
    def zero_token_arrivals(self, pool_block_ready: cute.Pointer, num_tokens: Int32,
                            tidx: Int32, bidx: Int32, grid: Int32):
        """`combine` "tokens", at the call's start: the grid's share of this call's token
        counts (`token_arrivals`) set to 0. Peers add to them only once they hold this rank's
        counts of the call, which it publishes after every CTA's arrival behind this (and its
        own CTAs only after they read those counts); the previous call's adds have all landed,
        since it ended only once every token had all of its rows. (``pool_block_ready``: the
        kernel's argument, this rank's region, from which the offset is taken.)"""
        token_arrivals = self.beside(pool_block_ready, "pool_block_ready", "token_arrivals")
        t = bidx * self.num_threads + tidx
        while t < num_tokens:
            cute.arch.store(token_arrivals + t, Int32(0))
            t += grid * self.num_threads

    @cute.jit
    def place_locally(self, x: cute.Pointer, topk_weights: cute.Pointer, my_base: Int64,
                      num_tokens: Int32, dispatch, batch, tidx: Int32, bidx: Int32, grid: Int32,
                      lane: Int32):
        """Step 1 of the local dispatch after `DispatchKernel.count_locally`, every thread:
        this CTA's share of the pairs in batches of one per thread: their routing weights into
        the buffer, their slots, metadata and weights (`DispatchKernel.place_pairs`), their rows
        quantized from the caller's activations straight into the pool
        (`InputStagingKernel.stage_rows`: each token's row once per pair, the staging kernel's
        numerics), then counted into their pool blocks (`DispatchKernel.count_placed`)."""
        begin, end = self.dispatch.pair_share(num_tokens, bidx, grid)
        rows, tokens, placed = batch
        pool_sf = my_base + self.regions.offset("l1_acts_sf") if cutlass.const_expr(
            self.layout.has_sf) else my_base
        first = begin
        while first < end:
            self.dispatch.place_pairs(my_base, topk_weights, first, end, dispatch, batch)
            self.staging.stage_rows(Int64(x.toint()), tokens,
                                    my_base + self.regions.offset("l1_acts"), rows, pool_sf,
                                    self.layout.num_pool_rows, placed[0], tidx, lane)
            self.dispatch.count_placed(my_base, batch)
            first += self.num_threads

    @cute.jit
    def stage_inputs(self, x: cute.Pointer, topk_idx: cute.Pointer, topk_weights: cute.Pointer,
                     my_base: Int64, num_tokens: Int32, tidx: Int32, bidx: Int32, grid: Int32,
                     lane: Int32):
        """Step 0 with `stages_inputs`, every thread: this CTA's share of the routing (the pairs
        it counts in step 1) and of the activations into the buffer, as the staging kernel
        writes them; a CTA barrier then orders the routing before this CTA's count. A thread's
        first routing pair is loaded before the activations, so both loads are in flight
        together (at decode sizes a CTA has one pair per thread at most)."""
        begin, end = self.dispatch.token_share(num_tokens, bidx, grid)
        begin, end = begin * self.layout.num_topk, end * self.layout.num_topk
        out_idx = self.regions.ptr(my_base, "topk_idx")
        out_weights = self.regions.ptr(my_base, "topk_weights")
        p = begin + tidx
        first_idx, first_weight = Int64(0), Float32(0.0)
        if p < end:
            first_idx = cute.arch.load(topk_idx + p, Int64)
            first_weight = cute.arch.load(topk_weights + p, Float32)
        num_vectors = num_tokens * (self.layout.hidden // ELEMENTS_PER_THREAD)
        out_sf = self.regions.ptr(my_base, "x_sf") if cutlass.const_expr(
            self.layout.has_sf) else self.regions.ptr(my_base, "topk_weights")  # (unused)
        g_x, g_out, g_sf = self.staging.vector_tensors(x, self.regions.ptr(my_base, "x"),
                                                       out_sf, num_vectors)
        first = bidx * self.staging.vectors_per_cta
        while first < num_vectors:
            self.staging.stage_vectors(g_x, g_out, g_sf, first, num_vectors, tidx, lane)
            first += grid * self.staging.vectors_per_cta
        if p < end:
            cute.arch.store(out_idx + p, first_idx)
            cute.arch.store(out_weights + p, first_weight)
        p += self.num_threads
        while p < end:
            cute.arch.store(out_idx + p, cute.arch.load(topk_idx + p, Int64))
            cute.arch.store(out_weights + p, cute.arch.load(topk_weights + p, Float32))
            p += self.num_threads
        cute.arch.sync_threads()

    @cute.jit
    def decode(self, ring, packed_pipe, storage, decoded: cute.Pointer, block_start, row_start,
               l1_tiles: Int32, l2_tiles: Int32, cta: Int32, num_ctas: Int32, wg: Int32,
               tidx: Int32, lane: Int32, stamps: cute.Pointer, barrier: cute.Pointer):
        """A decode warpgroup (FP4 weights; nothing in other kernels): the weight tiles of the
        L1 walk, then of the L2 walk, then the combine's registers. (``barrier``: the rank's
        barrier slots, for stall reports.)"""
        if cutlass.const_expr(self.fp4_weights):
            cute.arch.setmaxregister_decrease(self.l1.decode_regs)
            tid = tidx - 128 * self.num_gemm_wgs
            raw_b, sb = storage.raw_b.data_ptr(), storage.sb.data_ptr()
            sfb, sfg = storage.sfb_packed.data_ptr(), storage.sfg.data_ptr()
            state, packed = self.l1.decode_states()
            state, packed, tile = self.l1.decode_weights(
                ring, packed_pipe, raw_b, sb, sfb, sfg, decoded, block_start, row_start,
                l1_tiles, cta, num_ctas, Int32(self.l1.raster_group), tid, lane, state, packed,
                barrier)
            self.l2.decode_weights(
                ring, packed_pipe, raw_b, sb, sfb, sfg, decoded, block_start, row_start,
                l2_tiles, tile - l1_tiles, num_ctas, Int32(self.l2.raster_group), tid, lane,
                state, packed, barrier)
            self.stamp(stamps, "decode_done", tid == 0)

    @cute.jit
    def watch_consumers(self, ring, decoded: cute.Pointer, progress: cute.Pointer,
                        barrier: cute.Pointer, l1_tiles: Int32, l2_tiles: Int32, cta: Int32,
                        num_ctas: Int32, lane: Int32):
        """The watchdog (`watchdog`; lane 0 of one warp): until the consumers have done every
        k-block of this CTA's L1 and L2 tiles and left their last epilogue (their ring state's
        count, which they store in ``progress`` after each k-block, and one more at the end),
        watch it grow; if it stays put for the time limit, report it against the k-blocks'
        total, naming whether their next stage's loads or decode are missing (the ring's full
        barrier, ``decoded``), neither, or that they stopped after their last k-block, and
        trap. The consumers themselves carry no bounded wait: its report's registers made
        ptxas spill their accumulators."""
        if lane == 0:
            l1_count, l2_count = walk_lengths(l1_tiles, l2_tiles, cta, num_ctas)
            total = l1_count * self.l1.num_k_blocks + l2_count * self.l2.num_k_blocks
            seen = cute.arch.atomic_add(progress, Int32(0), scope="cta")
            start = cute.arch.globaltimer()
            while seen <= total:
                now = cute.arch.atomic_add(progress, Int32(0), scope="cta")
                if now != seen:
                    seen = now
                    start = cute.arch.globaltimer()
                elif cute.arch.globaltimer() - start > Int64(self.timeout_ns):
                    stage = seen % self.num_stages
                    phase = (seen // self.num_stages) & 1
                    loaded = Int32(cute.arch.mbarrier_try_wait(
                        ring.sync_object_full.get_barrier(stage), phase))
                    name = Int32(REPORT_NAMES.index(
                        "the consumers, past a loaded and decoded stage (watchdog)"))
                    if seen == total:
                        name = Int32(REPORT_NAMES.index(
                            "the consumers, after their last k-block (watchdog)"))
                    elif loaded == 0:
                        name = Int32(REPORT_NAMES.index(
                            "the consumers' next stage, not loaded (watchdog)"))
                    elif Int32(cute.arch.mbarrier_try_wait(decoded + stage, phase)) == 0:
                        name = Int32(REPORT_NAMES.index(
                            "the consumers' next stage, not decoded (watchdog)"))
                    report(barrier, ReportKind.STALL, name, seen, total)
        cute.arch.sync_warp()  # (the warp meets its warpgroup at an aligned barrier next)

    def dispatch_stamp(self, stamps: cute.Pointer, tidx: Int32):
        """With `phase_clock`: the dispatch's own stamps (thread 0, unfenced: a fence there
        would delay the steps it times); None without."""
        if not self.phase_clock:
            return None
        return lambda name: self.stamp(stamps, name, tidx == 0, fenced=False)

    @cute.jit
    def stamp(self, stamps: cute.Pointer, name: cutlass.Constexpr, mine,
              fenced: cutlass.Constexpr = True):
        """With `phase_clock`: the global timer into stamp ``name`` of `PHASE_STAMPS` (by the
        thread where ``mine``), fenced at system scope (``fenced``)."""
        if cutlass.const_expr(self.phase_clock):
            if mine:
                cute.arch.store(stamps + PHASE_STAMPS.index(name), cute.arch.globaltimer())
                if cutlass.const_expr(fenced):
                    cute.arch.fence_acq_rel_sys()
