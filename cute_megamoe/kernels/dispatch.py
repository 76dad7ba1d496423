"""EP dispatch: count -> prefix sum -> scatter, then move every routed token into the expert pool.

What it computes, on every rank of an R-rank group (one cooperative launch per rank; ranks run
the same kernel concurrently):

    for every local expert e and every (source rank s, token t, slot k) with topk_idx_s[t, k]
    routed to e (= global expert rank * E_l + e):
        l1_acts[pool_row]         = x_s[t]              (FP8 or BF16 row, bit copy)
        l1_acts_sf[:, pool_row]   = x_sf_s[t]           (FP8 recipes; MN-major pool scales)
        l1_topk_weights[pool_row] = topk_weights_s[t, k]
        token_src_metadata[pool_row] = (s, t, k, 0)
    expert_recv_tokens[e] = number of such rows; stats[e] += the same (optional)

with pool rows expert-major, expert e's first row at `pool_block_offset(e) * BM`, where
`pool_block_offset(e) = sum over e' < e of ceil(count(e') / BM)` (padding rows are not written),
and inside an expert the sources taking turns, one row each in rank order (the combine then
sends consecutive rows to different ranks). The order of one source's rows is not deterministic
(slots come from atomics); everything downstream is row-local, so results are.

How (the seed analysis' count -> prefix -> scatter):
1. Check and count: each CTA walks its contiguous share of the tokens, checks their top-k
   rows (`common.routing`: a slot outside [-1, E) or naming an expert twice is bad; it
   becomes -1 in the buffer's routing and is recorded for the host) and counts the pairs per
   global expert in shared memory (block-scope atomics).
2. Prefix: per expert one 64-bit global atomic add of `(1 << 32) | count` on
   `expert_send_count`; the old value's low half is this CTA's first slot for the expert.
3. Scatter: a second walk takes slots (shared atomics from the CTA's first slot) and stores
   `t * K + k` into the destination rank's `src_token_topk_idx[e_l][my_rank][slot]` through its
   symmetric address (and, when pushing, the slot into the local `dispatch_pair_slot`).
4. Every CTA arrives at the grid barrier's counter without waiting (`sync.grid_arrive`); the
   last to arrive publishes the call's bad routing slots into the rank's pinned record
   (`common.routing.publish_bad_slots`), reads the totals, zeroes `expert_send_count` for the
   next call, and publishes a `layout.CountWord` `tag << 32 | settings << 24 | count` into every
   rank's `expert_recv_count[my_rank][e]` with system-scope release stores (all experts to all
   ranks: a pushing rank needs its destinations' counts from every source, and spinning on local
   memory is cheaper than on a peer's). The tag numbers the call (`sync.call_tags`: the same on
   every rank unless one skipped a call, which traps), so counts left from the previous call
   never pass for this one's; nothing is reset. The settings carry the publisher's `block_m`,
   recipe, push bit and row protocol (`pool_order`). Ranks may choose different `block_m`s (each
   lays out its own pool; a pushing source places a destination's rows with the `block_m` that
   destination published). The recipe, the transfer and the row protocol must agree (a rank
   pushing to a pulling peer would itself receive that peer's rows from nobody; a rank counting
   rows into pool blocks would wait for counts a staged peer never sends, which would wait at a
   cross-rank barrier the other never enters): every reader compares them with its own and, on a
   mismatch, reports which setting and both values (`reports`), and traps.
5. Every CTA acquires the R x E_l counts of its own experts (when pushing: of every rank's) and
   builds the row and pool-block prefix sums in shared memory, one warp per rank.
6. Metadata: one thread per received row finds its source (token, k) in `src_token_topk_idx`,
   loads the routing weight and the FP8 scale row from the source rank, and stores them and
   TokenSrcMetadata into the pool (consecutive threads take consecutive pool rows, so the
   MN-major scale stores coalesce).
7. Rows, `transfer="push"` (the default): global warp g takes this rank's (token, k) pairs
   g, g + G, ...; a lane finds the destination of one pair of a batch of 32 (its expert, its
   kept slot, the destination's pool prefix and counts) and the warp copies the batch's rows
   one by one with 16-byte register copies, plain stores into the destination rank's pool.
   `transfer="pull"`: global warp g takes received rows g, g + G, ...; lane 0 moves each row
   with 1-D bulk copies, peer global -> shared -> local pool, the load of a chunk overlapping
   the store of the previous one (DeepGEMM's pull).
   `pool_order` (the fused layer kernel, `sm90_mega_moe`): steps 1-6 only
   (`exchange_counts`; step 6 counts every row's metadata into this rank's
   `pool_block_arrivals`); the fused kernel then pushes the rows in each destination's pool
   order, counting every row into the destination's `pool_block_arrivals`
   (`push_in_pool_order`), and step 8 is left to the fused kernel: a pool block is ready when
   its counter reaches `arrivals_per_row` per valid row, with no barrier in between. With
   `pool_order` and transfer "pull" (the fused kernel's "pulled" rows) no rank sends rows: the
   destination's puller warps pull them in its own pool order (`pull_in_pool_order`), with
   their scale words (step 6 then writes none), into a ring where the buffer keeps its
   received rows in one (`MegaMoELayout.received_rows`), each slot refilled once every L1
   tile of its previous block is done.
8. Grid barrier (all rows moved); CTA 0 enters the cross-rank barrier (system-scope release and
   acquire) and records the call as finished. After it every rank's pool is complete, and no
   peer reads this rank's inputs or counts for this call any more: the next call may restage
   inputs and start over.

Why push by default: with both GPUs moving rows at once, loads from a peer top out at 321-323
GB/s per direction on 2 x H200, stores to a peer at 348 (docs/performance.md,
"Dispatch and combine").

Constraints:
* launched cooperatively with at most one CTA per SM (`num_ctas` <= SMs); every rank launches
  it once per call, also with 0 tokens (the barriers and counts need every rank), with the same
  `transfer` and recipe (checked: a mismatch traps); `block_m` may differ between ranks;
* a pushing peer writes this rank's `l1_acts` during the call; it starts only after it has
  every rank's counts of the call, which this rank publishes once its dispatch runs, i.e.
  after its earlier work on the stream (the previous call's GEMMs) has finished;
* the routing is checked here (step 1): bad slots are masked and recorded, never used;
* `hidden * element_size % 16 == 0` (true since `hidden % 128 == 0`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..layout.device import BufferRegions
from ..layout.mega_moe import CountWord, MegaMoELayout
from ..reports import PUSH_FIELD, RECIPE_FIELD, REPORT_NAMES, ROWS_FIELD
from .common.pool import (
    BulkRowPipeline,
    build_pool_prefix,
    ceil_div_small,
    copy_row_in_registers,
    expert_of_row,
    gmem_vector,
)
from .common.routing import checked_row, publish_bad_slots
from .common.sync import (
    call_tags,
    cross_rank_barrier,
    fence_acq_rel,
    finish_call,
    grid_arrive,
    grid_barrier,
    group_scope,
    report_disagreement,
    spin_timeout_ns,
    wait_call_tag,
    wait_reached,
)

TRANSFERS = ("push", "pull")  # how the rows cross (module doc, step 7)
SF_GROUP_WORDS = 64  # scale words a metadata thread loads before it stores them


def _part(t: cute.Tensor, start, length: int) -> cute.Tensor:
    """`length` elements of the 1-D shared-memory tensor `t` from `start`."""
    return cute.make_tensor(t.iterator + start, cute.make_layout(length))


class DispatchKernel:
    """Count, prefix, scatter and row transfer for one rank (see the module docstring)."""

    def __init__(self, layout: MegaMoELayout, block_m: int, num_threads: int | None = None,
                 has_stats: bool = False, transfer: str = "push", pool_order: bool = False,
                 local: bool = False):
        if block_m % 16 != 0 or not 16 <= block_m <= layout.block_m_max:
            raise ValueError(f"block_m: expected a multiple of 16 in [16, "
                             f"{layout.block_m_max}], got {block_m}")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer: expected one of {TRANSFERS}, got {transfer!r}")
        if num_threads is None:  # register copies want many warps; bulk staging fits 8
            num_threads = 512 if transfer == "push" else 256
        if num_threads % 32 != 0 or not 32 <= num_threads <= 1024:
            raise ValueError(f"num_threads: expected a multiple of 32 in [32, 1024], got "
                             f"{num_threads}")
        self.layout = layout
        self.regions = BufferRegions(layout)
        self.block_m = block_m
        self.num_threads = num_threads
        self.num_warps = num_threads // 32
        self.has_stats = has_stats
        self.scope = group_scope(layout.num_ranks)  # of its barriers, flags and count words
        self.transfer = transfer
        self.push = transfer == "push"
        # `pool_order` (the fused kernel): steps 1-6 by `exchange_counts`, then the rows moved
        # in each destination's pool order with arrival counts: pushed by their sources
        # (`push_in_pool_order`) or, transfer "pull", pulled by the destination's puller warps
        # (`pull_in_pool_order`), into its received-rows ring where the buffer has one, with
        # their scale words (step 6 then writes none)
        self.pool_order = pool_order
        self.pulls_in_pool_order = pool_order and not self.push
        if layout.num_received_rows < layout.num_pool_rows and not self.pulls_in_pool_order:
            raise ValueError(
                f"the buffer keeps the received rows in a ring of {layout.num_received_rows} "
                f"rows (received_rows {layout.received_rows}): only the fused kernel's pulled "
                f"rows fill it (row_transfer='pulled')")
        # `local` (the fused kernel, one-rank groups): every CTA counts all pairs itself and
        # places its own share (`count_locally`, `place_pairs`), with no other CTA in between
        if local and (layout.num_ranks != 1 or not pool_order):
            raise ValueError("local: one-rank groups with pool_order only")
        self.local = local
        # `pool_order`: a pool block's rows are ready once its counter in
        # `pool_block_arrivals` reaches this many per valid row (the row from its source, and
        # its metadata, weight and scales from this rank's step 6)
        self.arrivals_per_row = 2
        # published in every count word: this rank's block_m, and what every rank must launch
        # the call with (the recipe, the transfer and the row protocol, compared by every
        # reader)
        self.settings = CountWord.settings(block_m, layout.recipe, self.push, pool_order)
        self.block_m_mask = (1 << CountWord.BLOCK_M_BITS) - 1
        self.num_ranks = layout.num_ranks
        self.num_experts = layout.num_experts
        self.num_local_experts = layout.num_local_experts
        self.num_topk = layout.num_topk
        self.num_slots = layout.num_tokens  # T slots per (expert, source rank)
        # ranks whose counts and pool prefix a CTA needs: its own; every rank's when pushing
        self.num_dests = self.num_ranks if self.push else 1
        self.num_pool_rows = layout.num_pool_rows
        self.has_sf = layout.has_sf
        self.sf_words = layout.hidden // 128
        # scale words per vector load (16 bytes when the token's scale row is 16-byte aligned)
        self.sf_vec = next(w for w in (4, 2, 1) if self.sf_words % w == 0)
        self.row_bytes = layout.hidden * layout.region("x").element_size
        self.rows = BulkRowPipeline(self.row_bytes)
        if not self.push and not pool_order:
            self.rows.check_fits(self.num_warps)
        self.timeout_ns = spin_timeout_ns()

    def smem_bytes(self) -> int:
        """Shared memory `run` allocates (push: the pull's row staging is not counted), with
        room for each array's alignment."""
        D, R, E_l = self.num_dests, self.num_ranks, self.num_local_experts
        words = self.num_experts + D * R * E_l + D * E_l + (2 + self.pool_order) * D * (E_l + 1) + D
        if self.local:  # `allocate_batch`
            words += 2 * self.num_threads + 1
        return 4 * words + 10 * 16

    @cute.jit
    def __call__(
        self,
        peer_bases: cute.Pointer,  # Int64 [R]: every rank's buffer base address
        rank: Int32,
        num_tokens: Int32,
        expert_recv_tokens: cute.Pointer,  # Int32 [E_l], output
        stats: cute.Pointer,  # Int32 [E_l], incremented when has_stats
        num_ctas: Int32,
        stream,
    ):
        per_expert = cute.make_layout(self.num_local_experts)
        self.kernel(cute.make_tensor(peer_bases, cute.make_layout(self.num_ranks)), rank,
                    num_tokens, cute.make_tensor(expert_recv_tokens, per_expert),
                    cute.make_tensor(stats, per_expert)).launch(
            grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
            # (one CTA per SM, cooperative: told so, ptxas does not spill to fit three)
            cooperative=True, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, peer_bases: cute.Tensor, rank: Int32, num_tokens: Int32,
               expert_recv_tokens: cute.Tensor, stats: cute.Tensor):
        self.run(peer_bases, rank, num_tokens, expert_recv_tokens, stats,
                 cutlass.memory.SmemAllocator())

    @cute.jit
    def run(self, peer_bases: cute.Tensor, rank: Int32, num_tokens: Int32,
            expert_recv_tokens: cute.Tensor, stats: cute.Tensor, smem, stamp=None):
        """The whole dispatch (steps 1-8) by every thread of every CTA of a cooperative grid of
        `num_threads`-thread CTAs, with shared memory from the allocator `smem`. Returns this
        rank's pool prefix sums in shared memory, `(row_start, block_start)` (`E_l + 1` each,
        `block_m` rows per block). Only CTA 0 has passed the final cross-rank barrier on
        return. ``stamp``: as `exchange_counts`', also after the rows (step 7)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        arrays = self.allocate_arrays(smem)
        pipe = None  # the pull's per-warp staging (see `BulkRowPipeline`)
        if cutlass.const_expr(not self.push):
            pipe = self.rows.for_warp(self.rows.allocate(smem, self.num_warps), warp)
            self.rows.init_barriers(pipe[0], lane)
            cute.arch.mbarrier_init_fence()
        own_count, own_row_start, own_block_start = self.exchange_counts(
            peer_bases, rank, num_tokens, expert_recv_tokens, stats, arrays, stamp)
        _slots, recv_count, _totals, _rows, block_start, dest_block_m, _sends = arrays

        # 7. the rows
        my_base = Int64(peer_bases[rank])
        if cutlass.const_expr(self.push):
            self.push_rows(peer_bases, my_base, rank, num_tokens, warp, lane, recv_count,
                           block_start, dest_block_m)
        else:
            self.pull_rows(peer_bases, my_base, warp, lane, own_count, own_row_start,
                           own_block_start, pipe)
        if cutlass.const_expr(stamp is not None):
            stamp("rows_pushed")

        # 8. all rows moved -> meet the other ranks. (The call tag is read again rather than
        # kept in a register through the copies: only `finish_call` changes it.)
        barrier = self.regions.ptr(my_base, "barrier")
        grid_barrier(barrier, num_ctas, self.timeout_ns, self.scope)
        if bidx == 0:
            tag = call_tags(barrier)[0]
            cross_rank_barrier(barrier, peer_bases, self.regions.offset("barrier"),
                               Int32(self.num_ranks), self.timeout_ns, self.scope)
            if tidx == 0:
                finish_call(barrier, tag)
        return own_row_start, own_block_start

    @cute.jit
    def allocate_arrays(self, smem):
        """The shared-memory arrays of steps 1-7: per global expert the count, then the next
        slot; per destination d (own rank only when pulling) `[d][src][expert]` counts,
        `[d][expert]` totals, `[d][expert + 1]` row and block prefix sums, each pool's BLOCK_M,
        and with `pool_order` `[d][expert + 1]` prefix sums of this rank's rows to d."""
        E, E_l, R, D = self.num_experts, self.num_local_experts, self.num_ranks, self.num_dests
        expert_slot = smem.allocate_tensor(Int32, cute.make_layout(E))
        recv_count = smem.allocate_tensor(Int32, cute.make_layout(D * R * E_l))
        expert_count = smem.allocate_tensor(Int32, cute.make_layout(D * E_l))
        row_start = smem.allocate_tensor(Int32, cute.make_layout(D * (E_l + 1)))
        block_start = smem.allocate_tensor(Int32, cute.make_layout(D * (E_l + 1)))
        dest_block_m = smem.allocate_tensor(Int32, cute.make_layout(D))
        send_start = None
        if cutlass.const_expr(self.pool_order):
            send_start = smem.allocate_tensor(Int32, cute.make_layout(D * (E_l + 1)))
        return (expert_slot, recv_count, expert_count, row_start, block_start, dest_block_m,
                send_start)

    @cute.jit
    def allocate_batch(self, smem):
        """`local`: per pair of a batch (one per thread) its pool row and token, and how many
        of the batch are placed (`place_pairs`)."""
        rows = smem.allocate_tensor(Int32, cute.make_layout(self.num_threads))
        tokens = smem.allocate_tensor(Int32, cute.make_layout(self.num_threads))
        placed = smem.allocate_tensor(Int32, cute.make_layout(1))
        return rows, tokens, placed

    def token_share(self, num_tokens: Int32, cta: Int32, num_ctas: Int32) -> tuple:
        """``[begin, end)``: the contiguous share of this rank's tokens whose (token, slot)
        pairs CTA ``cta`` checks, counts and scatters (steps 1 and 3; the fused kernel's
        in-kernel staging copies the same share of the routing, so the CTA reads only what it
        wrote itself). Whole tokens: the routing check compares a token's slots."""
        share = (num_tokens + num_ctas - 1) // num_ctas
        begin = cutlass.min(cta * share, num_tokens)
        return begin, cutlass.min(begin + share, num_tokens)

    def pair_share(self, num_tokens: Int32, cta: Int32, num_ctas: Int32) -> tuple:
        """``[begin, end)``: the contiguous share of this rank's (token, slot) pairs that CTA
        ``cta`` places in the `local` dispatch (`count_locally` checks every token in every
        CTA, so its shares need not hold whole tokens; finer than `token_share` at decode
        sizes, where each pair's row is quantized by its CTA)."""
        num_pairs = num_tokens * self.num_topk
        share = (num_pairs + num_ctas - 1) // num_ctas
        begin = cutlass.min(cta * share, num_pairs)
        return begin, cutlass.min(begin + share, num_pairs)

    @cute.jit
    def exchange_counts(self, peer_bases: cute.Tensor, rank: Int32, num_tokens: Int32,
                        expert_recv_tokens: cute.Tensor, stats: cute.Tensor, arrays,
                        stamp=None, metadata: cutlass.Constexpr = True):
        """Steps 1-6 by every thread of every CTA, into the shared-memory `arrays`
        (`allocate_arrays`). Returns `(own_count, own_row_start, own_block_start)`:
        this rank's `[src][expert]` received counts and pool prefix sums in shared memory.
        The metadata stores of step 6 are this thread's own: a reader meets the grid first.
        ``stamp``: None, or a trace-time callable ``stamp(name)`` (the fused kernel's phase
        clock) called after steps 3, 4 and 5. ``metadata`` False: without step 6 (the caller
        runs `write_metadata` itself)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        E, E_l, R = self.num_experts, self.num_local_experts, self.num_ranks
        D = self.num_dests
        my_base = Int64(peer_bases[rank])
        barrier = self.regions.ptr(my_base, "barrier")
        tag, done = call_tags(barrier)
        (expert_slot, recv_count, expert_count, row_start, block_start, dest_block_m,
         send_start) = arrays
        e = tidx
        while e < E:
            expert_slot[e] = 0
            e += self.num_threads
        cute.arch.sync_threads()

        # 1. check and count this CTA's contiguous share of the tokens' (token, slot) pairs
        # (bad slots become -1 in the buffer's routing, `routing.checked_row`)
        topk_idx = self.regions.ptr(my_base, "topk_idx")
        token_begin, token_end = self.token_share(num_tokens, bidx, num_ctas)
        t = token_begin + tidx
        while t < token_end:
            experts = checked_row(topk_idx, t, self.num_topk, E, barrier, rewrite=True)
            for k in cutlass.range_constexpr(self.num_topk):
                if experts[k] >= 0:
                    cute.arch.atomic_add(expert_slot.iterator + experts[k], Int32(1),
                                         scope="cta")
            t += self.num_threads
        cute.arch.sync_threads()

        # 2. prefix: one 64-bit atomic per expert allocates this CTA's slots
        send_count = self.regions.ptr(my_base, "expert_send_count")
        # (experts this CTA does not send to skip the atomic: the grid's arrival after step 3,
        # not the count in the high word, tells when every CTA has reported)
        e = tidx
        while e < E:
            if expert_slot[e] > 0:
                old = cute.arch.atomic_add(send_count + e,
                                           Int64(expert_slot[e]) | (Int64(1) << 32),
                                           sem="relaxed", scope="gpu")
                expert_slot[e] = Int32(old & 0xFFFFFFFF)
            e += self.num_threads
        cute.arch.sync_threads()

        # 3. scatter token * K + k into the destination rank's source index table
        pair_slot = self.regions.ptr(my_base, "dispatch_pair_slot")
        p = token_begin * self.num_topk + tidx
        pair_end = token_end * self.num_topk
        while p < pair_end:
            expert = Int32(cute.arch.load(topk_idx + p, Int64))
            if expert >= 0 and expert < E:
                slot = cute.arch.atomic_add(expert_slot.iterator + expert, Int32(1), scope="cta")
                if cutlass.const_expr(self.push):
                    cute.arch.store(pair_slot + p, slot)
                if slot < self.num_slots:
                    dst = expert // E_l
                    table = self.regions.ptr(Int64(peer_bases[dst]), "src_token_topk_idx")
                    cute.arch.store(
                        table + ((expert % E_l) * R + rank) * self.num_slots + slot, p)
            p += self.num_threads

        if cutlass.const_expr(stamp is not None):
            stamp("scattered")
        # 4. the last CTA to finish the scatter publishes this rank's per-expert counts to
        # every rank (no grid barrier: every CTA waits for the published counts next, its own
        # rank's among them)
        if grid_arrive(barrier, num_ctas, expert_slot.iterator, self.scope):
            if tidx == 0:  # (every CTA has checked its share)
                publish_bad_slots(barrier)
            e = tidx
            while e < E:
                total = cute.arch.load(send_count + e, Int64) & 0xFFFFFFFF
                cute.arch.store(send_count + e, Int64(0))
                published = (cutlass.min(total, Int64(self.num_slots)) | (Int64(tag) << 32)
                             | Int64(self.settings << CountWord.COUNT_BITS))
                for dst in cutlass.range(R):
                    recv = self.regions.ptr(Int64(peer_bases[dst]), "expert_recv_count")
                    cute.arch.store(recv + rank * E + e, published, sem="release",
                                    scope=self.scope)
                e += self.num_threads

        if cutlass.const_expr(stamp is not None):
            stamp("counts_published")

        # 5. every CTA gathers the counts of its own experts (every rank's experts when
        # pushing) and builds the prefix sums, one warp per rank
        recv = self.regions.ptr(my_base, "expert_recv_count")
        i = tidx
        while i < D * R * E_l:
            dest = rank
            if cutlass.const_expr(self.push):
                dest = i // (R * E_l)
            src = (i // E_l) % R
            expert = dest * E_l + i % E_l
            word = wait_call_tag(barrier, recv + src * E + expert, tag, done,
                                 "expert_recv_count", src, expert, self.timeout_ns, self.scope)
            settings = (word >> CountWord.COUNT_BITS) & CountWord.SETTINGS_MASK
            self.check_settings(barrier, settings)
            if src == dest and i % E_l == 0:  # the destination's own word: its BLOCK_M
                dest_block_m[i // (R * E_l)] = 16 * ((settings & self.block_m_mask) + 1)
            recv_count[i] = word & CountWord.COUNT_MASK
            i += self.num_threads
        cute.arch.sync_threads()
        if cutlass.const_expr(stamp is not None):
            stamp("counts_seen")
        i = tidx
        while i < D * E_l:
            total = Int32(0)
            for src in cutlass.range(R):
                total += recv_count[((i // E_l) * R + src) * E_l + i % E_l]
            expert_count[i] = total
            i += self.num_threads
        cute.arch.sync_threads()
        d = warp
        while d < D:
            build_pool_prefix(_part(expert_count, d * E_l, E_l),
                              _part(row_start, d * (E_l + 1), E_l + 1),
                              _part(block_start, d * (E_l + 1), E_l + 1), E_l, dest_block_m[d])
            if cutlass.const_expr(self.pool_order):
                build_pool_prefix(_part(recv_count, (d * R + rank) * E_l, E_l),
                                  _part(send_start, d * (E_l + 1), E_l + 1), None, E_l)
            d += self.num_warps
        cute.arch.sync_threads()
        own = Int32(0)  # this rank's index among the destinations above
        if cutlass.const_expr(self.push):
            own = rank
        own_count = _part(recv_count, own * R * E_l, R * E_l)
        own_row_start = _part(row_start, own * (E_l + 1), E_l + 1)
        own_block_start = _part(block_start, own * (E_l + 1), E_l + 1)
        if bidx == 0:
            e = tidx
            while e < E_l:
                total = expert_count[own * E_l + e]
                expert_recv_tokens[e] = total
                if cutlass.const_expr(self.has_stats):
                    stats[e] = stats[e] + total
                e += self.num_threads

        # 6. weights, scales and metadata of the received rows
        if cutlass.const_expr(metadata):
            self.write_metadata(peer_bases, my_base, own_count, own_row_start, own_block_start)
        return own_count, own_row_start, own_block_start

    @cute.jit
    def count_locally(self, my_base: Int64, topk_idx: cute.Pointer, num_tokens: Int32,
                      expert_recv_tokens: cute.Tensor, stats: cute.Tensor, arrays):
        """`local`, every thread of every CTA, alone: steps 1-5 of a one-rank group without
        the other CTAs. The CTA checks and counts all of this rank's pairs (``topk_idx``: the
        caller's int64 ``[num_tokens, K]``; `routing.checked_row`), per expert in all and
        before its own share (`pair_share`), stores its share's checked routing into the
        buffer (for `place_pairs` and the combine), and builds the pool prefix sums from the
        counts (at most ``T`` per expert, as the scatter keeps); CTA 0 records the bad slots
        and reports the counts. Every CTA gets the same pool layout, so no counts are
        exchanged (CTA 0 still writes this rank's count words, tagged with the call, as step 4
        would). Returns ``(row_start, block_start)`` in shared memory; ``expert_slot[e]`` is
        left at this CTA's first slot of expert ``e`` (slots in `place_pairs`)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        E = self.num_experts
        barrier = self.regions.ptr(my_base, "barrier")
        routing = self.regions.ptr(my_base, "topk_idx")
        expert_slot, _, expert_count, row_start, block_start, _, _ = arrays
        e = tidx
        while e < E:
            expert_slot[e] = 0
            expert_count[e] = 0
            e += self.num_threads
        cute.arch.sync_threads()
        begin, end = self.pair_share(num_tokens, bidx, num_ctas)
        t = tidx
        while t < num_tokens:  # (a token's K loads in flight per thread)
            experts = checked_row(topk_idx, t, self.num_topk, E, barrier, note=bidx == 0)
            for k in cutlass.range_constexpr(self.num_topk):
                p = t * self.num_topk + k
                if p >= begin and p < end:
                    cute.arch.store(routing + p, Int64(experts[k]))
                if experts[k] >= 0:
                    cute.arch.atomic_add(expert_count.iterator + experts[k], Int32(1),
                                         scope="cta")
                    if p < begin:
                        cute.arch.atomic_add(expert_slot.iterator + experts[k], Int32(1),
                                             scope="cta")
            t += self.num_threads
        cute.arch.sync_threads()
        e = tidx
        while e < E:
            expert_count[e] = cutlass.min(expert_count[e], Int32(self.num_slots))
            e += self.num_threads
        cute.arch.sync_threads()
        if warp == 0:
            build_pool_prefix(_part(expert_count, 0, E), _part(row_start, 0, E + 1),
                              _part(block_start, 0, E + 1), E, Int32(self.block_m))
        cute.arch.sync_threads()
        if bidx == 0:
            if tidx == 0:  # (CTA 0 checked every pair; its notes are ordered by the barriers)
                publish_bad_slots(barrier)
            # (the count words too, tagged with this call as step 4 does: nobody waits for
            # them in this call, but the next call's readers take an older tag for a skipped
            # call)
            tag = call_tags(barrier)[0]
            recv = self.regions.ptr(my_base, "expert_recv_count")
            e = tidx
            while e < E:
                expert_recv_tokens[e] = expert_count[e]
                if cutlass.const_expr(self.has_stats):
                    stats[e] = stats[e] + expert_count[e]
                cute.arch.store(recv + e, Int64(expert_count[e]) | (Int64(tag) << 32)
                                | Int64(self.settings << CountWord.COUNT_BITS))
                e += self.num_threads
        return _part(row_start, 0, E + 1), _part(block_start, 0, E + 1)

    @cute.jit
    def place_pairs(self, my_base: Int64, topk_weights: cute.Pointer, first: Int32, end: Int32,
                    arrays, batch):
        """`local`, every thread of the CTA, after `count_locally`: the pairs ``first + tidx``
        (< ``end``, one per thread) of this CTA's share: the routing weight into the buffer
        (for the combine), and for each kept pair (of the checked routing `count_locally` left
        in the buffer) a slot of its expert (shared atomics from this CTA's
        first), its pool row's metadata and routing weight, and its pool row and token into
        ``batch`` (`allocate_batch`, in any order; ``placed`` counts them). The rows and
        their arrivals follow (`InputStagingKernel.stage_rows`, `count_placed`)."""
        tidx, _, _ = cute.arch.thread_idx()
        K = self.num_topk
        expert_slot, _, _, _, block_start, _, _ = arrays
        rows, tokens, placed = batch
        if tidx == 0:
            placed[0] = 0
        cute.arch.sync_threads()
        p = first + tidx
        if p < end:
            # (the checked routing `count_locally` stored: bad slots are -1 there)
            e = Int32(cute.arch.load(self.regions.ptr(my_base, "topk_idx") + p, Int64))
            weight = cute.arch.load(topk_weights + p, Float32)
            cute.arch.store(self.regions.ptr(my_base, "topk_weights") + p, weight)
            if e >= 0:
                slot = cute.arch.atomic_add(expert_slot.iterator + e, Int32(1), scope="cta")
                if slot < self.num_slots:
                    pool_row = block_start[e] * self.block_m + slot
                    meta = cute.make_rmem_tensor((4,), Int32)  # (source rank, token, k, 0)
                    meta[0] = Int32(0)
                    meta[1] = p // K
                    meta[2] = p % K
                    meta[3] = Int32(0)
                    cute.autovec_copy(meta, gmem_vector(
                        my_base + self.regions.offset("token_src_metadata")
                        + Int64(pool_row) * 16, Int32, 4))
                    cute.arch.store(self.regions.ptr(my_base, "l1_topk_weights") + pool_row,
                                    weight)
                    j = cute.arch.atomic_add(placed.iterator, Int32(1), scope="cta")
                    rows[j] = pool_row
                    tokens[j] = p // K
        cute.arch.sync_threads()

    @cute.jit
    def count_placed(self, my_base: Int64, batch):
        """`local`, every thread of the CTA, once the batch's rows are stored: each thread's
        stores fenced, then +`arrivals_per_row` per placed row on its pool block (the row and
        its metadata are in, as a sender and step 6 count them in the exchanged dispatch)."""
        tidx, _, _ = cute.arch.thread_idx()
        rows, _, placed = batch
        fence_acq_rel(self.scope)
        cute.arch.sync_threads()
        if tidx < placed[0]:
            arrivals = self.regions.ptr(my_base, "pool_block_arrivals")
            cute.arch.red(arrivals + rows[tidx] // self.block_m, Int32(self.arrivals_per_row),
                          op="add", dtype="s32", sem="release", scope=self.scope)
        cute.arch.sync_threads()

    @cute.jit
    def check_settings(self, barrier: cute.Pointer, seen: Int32):
        """Trap, naming the setting and both values, when a peer's published row protocol,
        transfer or recipe differs from this rank's (step 4; BLOCK_M may differ)."""
        agreed = ~self.block_m_mask & CountWord.SETTINGS_MASK
        if (seen & agreed) != (self.settings & agreed):
            # one report names the first field that differs (one report site: each costs
            # registers in every kernel that runs the dispatch)
            field = Int32(REPORT_NAMES.index(RECIPE_FIELD))
            shift = Int32(CountWord.RECIPE_SHIFT)
            mask = Int32(3)
            for name, bit in ((ROWS_FIELD, CountWord.ROWS_COUNTED_SHIFT),
                              (PUSH_FIELD, CountWord.PUSH_SHIFT)):
                if ((seen ^ self.settings) >> bit) & 1 != 0 and field == REPORT_NAMES.index(
                        RECIPE_FIELD):
                    field, shift, mask = Int32(REPORT_NAMES.index(name)), Int32(bit), Int32(1)
            report_disagreement(barrier, field, (seen >> shift) & mask,
                                (Int32(self.settings) >> shift) & mask)

    @cute.jit
    def received_row(self, row: Int32, recv_count: cute.Tensor, row_start: cute.Tensor,
                     block_start: cute.Tensor, table: cute.Pointer):
        """(pool row, source rank, token * K + k) of this rank's `row`-th received row."""
        E_l = self.num_local_experts
        expert = expert_of_row(row_start, row, E_l)
        index = row - row_start[expert]
        src, slot = self.source_of_index(index, recv_count, expert)
        packed = cute.arch.load(
            table + (expert * self.num_ranks + src) * self.num_slots + slot, Int32)
        return block_start[expert] * self.block_m + index, src, packed

    @cute.jit
    def index_of_source(self, src: Int32, slot: Int32, recv_count: cute.Tensor,
                        expert: Int32) -> Int32:
        """Where a source's `slot`-th row sits among an expert's rows: the sources take turns,
        one row each in rank order, the ones that ran out dropping out (so consecutive rows
        come from different ranks, which spreads the combine's sends over the peers):
        rows of smaller slots, sum over s of min(count_s, slot), then this slot's rows of
        smaller ranks. `recv_count`: [source][expert] counts."""
        index = Int32(0)
        for s in cutlass.range(self.num_ranks):
            count = recv_count[s * self.num_local_experts + expert]
            index += cutlass.min(count, slot)
            if s < src and count > slot:
                index += 1
        return index

    @cute.jit
    def source_of_index(self, index: Int32, recv_count: cute.Tensor, expert: Int32):
        """(source rank, slot) of an expert's `index`-th row, the inverse of
        `index_of_source`: peel depth by depth, each depth holding one row of every source
        with more rows than that, until the source with the fewest left runs out. Each depth
        retires a source, so R peels find it; an index past the counts (which their writer
        never leaves) traps instead of peeling forever."""
        E_l, R = self.num_local_experts, self.num_ranks
        depth = Int32(0)  # rows already taken from every still-active rank
        src = Int32(-1)
        slot = Int32(0)
        peels = Int32(0)
        while src < 0 and peels <= R:
            peels += 1
            active = Int32(0)
            fewest = Int32(0x7FFFFFFF)
            for s in cutlass.range(R):
                c = recv_count[s * E_l + expert]
                if c > depth:
                    active += 1
                    fewest = cutlass.min(fewest, c)
            span = (fewest - depth) * active
            if index < span:
                slot = depth + index // active
                pick = index % active
                for s in cutlass.range(R):
                    if recv_count[s * E_l + expert] > depth:
                        if pick == 0 and src < 0:
                            src = s
                        pick -= 1
            else:
                index -= span
                depth = fewest
        if src < 0:
            # (a trap, no report record: its registers made ptxas spill in the push loop)
            cute.arch.inline_ptx("trap;")
        return src, slot

    @cute.jit
    def write_metadata(self, peer_bases: cute.Tensor, my_base: Int64, recv_count: cute.Tensor,
                       row_start: cute.Tensor, block_start: cute.Tensor):
        """Thread j of the grid: received rows j, j + threads, ... (step 6); with `pool_order`
        the grid's threads counted from its last CTA, so that at small counts the CTAs that
        push the rows next (`push_in_pool_order`, from CTA 0 on) are not the ones that write
        their metadata (both count into the same pool blocks)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        K = self.num_topk
        num_rows = row_start[self.num_local_experts]
        cta = bidx
        if cutlass.const_expr(self.pool_order):
            cta = num_ctas - 1 - bidx
        row = cta * self.num_threads + tidx
        table = self.regions.ptr(my_base, "src_token_topk_idx")
        pool_weights = self.regions.ptr(my_base, "l1_topk_weights")
        metadata = my_base + self.regions.offset("token_src_metadata")
        while row < num_rows:
            pool_row, src, packed = self.received_row(row, recv_count, row_start, block_start,
                                                      table)
            src_base = Int64(peer_bases[src])
            token = packed // K
            weight = cute.arch.load(self.regions.ptr(src_base, "topk_weights") + packed, Float32)
            if cutlass.const_expr(not self.pulls_in_pool_order):  # (the pullers copy them)
                self.copy_scales(src_base, token, my_base, pool_row)
            meta = cute.make_rmem_tensor((4,), Int32)  # (source rank, token, k, 0)
            meta[0] = src
            meta[1] = token
            meta[2] = packed % K
            meta[3] = Int32(0)
            cute.autovec_copy(meta, gmem_vector(metadata + Int64(pool_row) * 16, Int32, 4))
            cute.arch.store(pool_weights + pool_row, weight)
            if cutlass.const_expr(self.pool_order):  # (no grid barrier orders them for readers)
                self.count_arrival(my_base, pool_row // self.block_m, fenced=False)
            row += num_ctas * self.num_threads

    @cute.jit
    def copy_scales(self, src_base: Int64, token: Int32, my_base: Int64, pool_row: Int32,
                    group: cutlass.Constexpr = SF_GROUP_WORDS):
        """The source token's scale words into the MN-major pool scales (row stride: the
        region's rows, `MegaMoELayout.num_received_rows`), ``group`` at a time, all loads of a
        group issued before its stores (which would otherwise wait for each load in turn)."""
        if cutlass.const_expr(self.has_sf):
            row = src_base + self.regions.offset("x_sf") + Int64(token) * (self.sf_words * 4)
            pool_sf = self.regions.ptr(my_base, "l1_acts_sf", dtype=Int32)
            for first in cutlass.range_constexpr(0, self.sf_words, group):
                num_vecs = min(group, self.sf_words - first) // self.sf_vec
                vecs = []
                for v in cutlass.range_constexpr(num_vecs):
                    r = cute.make_rmem_tensor((self.sf_vec,), Int32)
                    cute.autovec_copy(gmem_vector(row + (first + v * self.sf_vec) * 4, Int32,
                                                  self.sf_vec), r)
                    vecs.append(r)
                for v in cutlass.range_constexpr(num_vecs):
                    for j in cutlass.range_constexpr(self.sf_vec):
                        word = first + v * self.sf_vec + j
                        cute.arch.store(pool_sf + word * self.layout.num_received_rows
                                        + pool_row, vecs[v][j])

    @cute.jit
    def push_rows(self, peer_bases: cute.Tensor, my_base: Int64, rank: Int32,
                  num_tokens: Int32, warp: Int32, lane: Int32, recv_count: cute.Tensor,
                  block_start: cute.Tensor, dest_block_m: cute.Tensor):
        """Global warp g: this rank's (token, k) pairs g, g + G, ... into their destination
        pools (step 7, push), each laid out with its destination's BLOCK_M."""
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        E, E_l, R, K = self.num_experts, self.num_local_experts, self.num_ranks, self.num_topk
        num_pairs = num_tokens * K
        topk_idx = self.regions.ptr(my_base, "topk_idx")
        pair_slot = self.regions.ptr(my_base, "dispatch_pair_slot")
        x = my_base + self.regions.offset("x")
        pool_offset = self.regions.offset("l1_acts")
        first = bidx * self.num_warps + warp
        stride = num_ctas * self.num_warps
        while first < num_pairs:
            mine = first + lane * stride
            pool_row = Int32(-1)  # -1: no pair, masked, or past the slots
            dest = Int32(0)
            if mine < num_pairs:
                expert = Int32(cute.arch.load(topk_idx + mine, Int64))
                if expert >= 0 and expert < E:
                    slot = cute.arch.load(pair_slot + mine, Int32)
                    if slot < self.num_slots:
                        dest = expert // E_l
                        local_expert = expert % E_l
                        pool_row = (block_start[dest * (E_l + 1) + local_expert]
                                    * dest_block_m[dest]
                                    + self.index_of_source(
                                        rank, slot, _part(recv_count, dest * R * E_l, R * E_l),
                                        local_expert))
            for j in cutlass.range(32):
                row_j = cute.arch.shuffle_sync(pool_row, j)
                dest_j = cute.arch.shuffle_sync(dest, j)
                if row_j >= 0:
                    token = (first + j * stride) // K
                    copy_row_in_registers(x + Int64(token) * self.row_bytes,
                                          Int64(peer_bases[dest_j]) + pool_offset
                                          + Int64(row_j) * self.row_bytes, lane, self.row_bytes)
            first += 32 * stride

    @cute.jit
    def push_in_pool_order(self, peer_bases: cute.Tensor, rank: Int32, sender: Int32,
                           num_senders: Int32, lane: Int32, arrays):
        """Step 7 for the fused kernel (`pool_order`), by sender warp `sender` of `num_senders`
        (every warp of every CTA, after `exchange_counts`): this rank's rows to each
        destination in that destination's pool order, each batch of 32 rows followed by +1 per
        row on its pool block's `pool_block_arrivals` there (one fence per batch,
        `count_arrival`), so the destination's L1 tiles start block by block while later rows
        are still on the way.

        The rows to all destinations are merged, destination-fastest (merged row i: row
        i // R to destination i % R), so every destination's pool fills front to back at the
        same pace; sender v takes merged rows v, v + V, ... (V senders), a lane looking up one
        row of each batch of 32: its expert (binary search of `send_start`), its slot, the
        (token, k) pair the scatter left in the destination's `src_token_topk_idx`, and the
        pool row (`index_of_source`, the destination's BLOCK_M)."""
        E_l, R, K = self.num_local_experts, self.num_ranks, self.num_topk
        (_slots, recv_count, _totals, _rows, block_start, dest_block_m, send_start) = arrays
        most = Int32(0)  # rows to the destination that gets the most
        for d in cutlass.range_constexpr(R):
            most = cutlass.max(most, send_start[d * (E_l + 1) + E_l])
        first = sender
        while first < most * R:
            mine = first + lane * num_senders
            dest = mine % R
            index = mine // R  # of this rank's rows to dest
            pool_row = Int32(-1)  # -1: past this rank's rows to dest
            token = Int32(0)
            starts = _part(send_start, dest * (E_l + 1), E_l + 1)
            if index < starts[E_l]:
                expert = expert_of_row(starts, index, E_l)
                slot = index - starts[expert]
                table = self.regions.ptr(Int64(peer_bases[dest]), "src_token_topk_idx")
                token = cute.arch.load(table + (expert * R + rank) * self.num_slots + slot,
                                       Int32) // K
                row = self.index_of_source(rank, slot,
                                           _part(recv_count, dest * R * E_l, R * E_l), expert)
                pool_row = block_start[dest * (E_l + 1) + expert] * dest_block_m[dest] + row
            for j in cutlass.range(32):
                row_j = cute.arch.shuffle_sync(pool_row, j)
                if row_j >= 0:
                    token_j = cute.arch.shuffle_sync(token, j)
                    dest_j = (first + j * num_senders) % R
                    x = Int64(peer_bases[rank]) + self.regions.offset("x")
                    copy_row_in_registers(x + Int64(token_j) * self.row_bytes,
                                          Int64(peer_bases[dest_j])
                                          + self.regions.offset("l1_acts")
                                          + Int64(row_j) * self.row_bytes, lane,
                                          self.row_bytes)
            # the warp's stores of the batch, then every lane fences once and counts its own
            # row: one fence per batch of 32 rows, not a release per row
            cute.arch.sync_warp()
            if pool_row >= 0:
                # (BLOCK_M is a multiple of 16: the quotient by BLOCK_M / 16 of row / 16,
                # within `ceil_div_small`'s range)
                block = ceil_div_small((pool_row >> 4) + 1, dest_block_m[dest] >> 4) - 1
                self.count_arrival(Int64(peer_bases[dest]), block, fenced=True)
            first += 32 * num_senders

    @cute.jit
    def pull_in_pool_order(self, peer_bases: cute.Tensor, my_base: Int64, puller: Int32,
                           num_pullers: Int32, lane: Int32, recv_count: cute.Tensor,
                           row_start: cute.Tensor, block_start: cute.Tensor,
                           ready: cute.Pointer, slot_reads: cutlass.Constexpr,
                           barrier: cute.Pointer):
        """Step 7 for the fused kernel with pulled rows (`pulls_in_pool_order`), by puller warp
        ``puller`` of ``num_pullers``: this rank's received rows in its pool order, batch j of
        32 received rows by puller j mod V. A lane finds one row's pool row, source and token
        (`received_row`); where the received rows are a ring (`MegaMoELayout.received_rows`:
        pool block b in slot b mod S) it waits until its slot is free, every L1 tile of the
        slot's previous block b - S done (``ready[b - S]`` reached ``slot_reads``, acquired).
        The warp copies the batch's rows from their sources' ``x`` (16-byte register copies),
        each lane its row's scale words into the MN-major ring scales, and every lane counts
        its row into its pool block's `pool_block_arrivals` after one fence (step 6 counts the
        row's metadata, the block's other arrival per row). A puller waits for nothing else
        and takes its rows in pool order, so with the ticket walk (an L1 tile of block b after
        every L1 tile of block b - S) the waits always end (docs/notes/dataflow.md, W4)."""
        E_l, K = self.num_local_experts, self.num_topk
        ring_blocks = self.layout.num_received_rows // self.block_m
        num_rows = row_start[E_l]
        table = self.regions.ptr(my_base, "src_token_topk_idx")
        pool = my_base + self.regions.offset("l1_acts")
        first = puller * 32
        while first < num_rows:
            row = first + lane
            slot_row = Int32(-1)  # -1: past the received rows
            block = Int32(0)
            src = Int32(0)
            token = Int32(0)
            if row < num_rows:
                pool_row, src, packed = self.received_row(row, recv_count, row_start,
                                                          block_start, table)
                token = packed // K
                block = pool_row // self.block_m
                slot_row = pool_row - (block - block % ring_blocks) * self.block_m
                previous = block - ring_blocks  # (the slot's previous block)
                if cutlass.const_expr(ring_blocks < self.num_pool_rows // self.block_m):
                    if previous >= 0:
                        wait_reached(
                            barrier, ready + previous, Int32(slot_reads), "gpu",
                            "L1 tiles of a received-rows ring slot's previous block",
                            self.timeout_ns)
                        # (their TMA reads of the slot are done: the stores below come after)
                        cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()
            for j in cutlass.range(32):
                row_j = cute.arch.shuffle_sync(slot_row, j)
                if row_j >= 0:
                    src_j = cute.arch.shuffle_sync(src, j)
                    token_j = cute.arch.shuffle_sync(token, j)
                    copy_row_in_registers(
                        Int64(peer_bases[src_j]) + self.regions.offset("x")
                        + Int64(token_j) * self.row_bytes,
                        pool + Int64(row_j) * self.row_bytes, lane, self.row_bytes)
            if slot_row >= 0:  # (a vector at a time: the pullers hold 40 registers)
                self.copy_scales(Int64(peer_bases[src]), token, my_base, slot_row,
                                 group=self.sf_vec)
            # the warp's stores of the batch, then one fence and a count per row (GPU scope:
            # the rows are stored here, and only this rank's L1 tiles read them)
            cute.arch.sync_warp()
            if slot_row >= 0:
                self.count_arrival(my_base, block, fenced=True, scope="gpu")
            first += 32 * num_pullers

    @cute.jit
    def count_arrival(self, dest_base: Int64, pool_block: Int32, fenced: cutlass.Constexpr,
                      scope: cutlass.Constexpr = None):
        """+1 on ``pool_block``'s counter in the `pool_block_arrivals` at ``dest_base``, after
        this thread's (and, through a warp barrier before, its warp's) stores: with a fence
        first at ``scope`` (default the group's, `sync.group_scope`) and a relaxed add when
        ``fenced``, else a release add at GPU scope (this rank's own pool)."""
        arrivals = self.regions.ptr(dest_base, "pool_block_arrivals")
        if cutlass.const_expr(not fenced):
            cute.arch.red(arrivals + pool_block, Int32(1), op="add", dtype="s32",
                          sem="release", scope="gpu")
        else:
            if cutlass.const_expr(scope is None):
                scope = self.scope
            fence_acq_rel(scope)
            cute.arch.red(arrivals + pool_block, Int32(1), op="add", dtype="s32",
                          sem="relaxed", scope=scope)

    @cute.jit
    def pull_rows(self, peer_bases: cute.Tensor, my_base: Int64, warp: Int32, lane: Int32,
                  recv_count: cute.Tensor, row_start: cute.Tensor, block_start: cute.Tensor,
                  pipe):
        """Global warp g: received rows g, g + G, ... from their source ranks (step 7, pull);
        a lane finds one row of a batch of 32, lane 0 moves them."""
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        mbar, staging, pending_dst, pending_bytes = pipe
        # the counts were acquired through the generic proxy; the bulk loads of the peers'
        # `x` go through the async proxy, which that acquire does not order by itself
        cute.arch.fence_proxy("async.global")
        num_rows = row_start[self.num_local_experts]
        table = self.regions.ptr(my_base, "src_token_topk_idx")
        x_offset = self.regions.offset("x")
        pool = my_base + self.regions.offset("l1_acts")
        first = bidx * self.num_warps + warp
        stride = num_ctas * self.num_warps
        job = Int32(0)  # chunks issued by this warp so far
        while first < num_rows:
            mine = first + lane * stride
            pool_row = Int32(-1)  # -1: no row
            src = Int32(0)
            token = Int32(0)
            if mine < num_rows:
                pool_row, src, packed = self.received_row(mine, recv_count, row_start,
                                                          block_start, table)
                token = packed // self.num_topk
            for j in cutlass.range(32):
                row_j = cute.arch.shuffle_sync(pool_row, j)
                src_j = cute.arch.shuffle_sync(src, j)
                token_j = cute.arch.shuffle_sync(token, j)
                if row_j >= 0 and lane == 0:
                    job = self.rows.push_row(
                        job, Int64(peer_bases[src_j]) + x_offset + Int64(token_j) * self.row_bytes,
                        pool + Int64(row_j) * self.row_bytes, mbar, staging, pending_dst,
                        pending_bytes)
            first += 32 * stride
        if lane == 0:
            self.rows.drain(job, mbar, staging, pending_dst, pending_bytes)
