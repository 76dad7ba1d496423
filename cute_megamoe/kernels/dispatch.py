"""EP dispatch: count -> prefix sum -> scatter, then pull every routed token into the expert pool.

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
`pool_block_offset(e) = sum over e' < e of ceil(count(e') / BM)` (padding rows are not written).
The order of an expert's rows is not deterministic (slots come from atomics); everything
downstream is row-local, so results are.

How (the seed analysis' count -> prefix -> scatter, then DeepGEMM's pull):
1. Count: each CTA walks its contiguous share of the (token, slot) pairs and counts pairs per
   global expert in shared memory (block-scope atomics).
2. Prefix: per expert one 64-bit global atomic add of `(1 << 32) | count` on
   `expert_send_count`; the old value's low half is this CTA's first slot for the expert.
3. Scatter: a second walk takes slots (shared atomics from the CTA's first slot) and stores
   `t * K + k` into the destination rank's `src_token_topk_idx[e_l][my_rank][slot]` through its
   symmetric address.
4. Grid barrier; CTA 0 reads the totals, zeroes `expert_send_count` for the next call, and
   publishes `(1 << 32) | count` into each destination rank's `expert_recv_count[my_rank][e_l]`
   with a system-scope release store (the high half says "published", so a zeroed slot never
   passes for a count of 0).
5. Every CTA acquires the R x E_l counts of its own rank, and warp 0 builds the row and pool-block
   prefix sums in shared memory.
6. Pull: global warp g takes received rows g, g + G, ... (expert-major). Inside an expert the
   rows alternate over source ranks (a row index is peeled round by round over the ranks that
   still have rows), so concurrent warps read from all peers at once. One lane moves the row
   with 1-D bulk copies, peer global -> shared -> local pool, double-buffered so the load of a
   chunk overlaps the store of the previous one; the lanes copy scales, weight and metadata.
7. Grid barrier (all pulls done); CTA 0 zeroes this rank's `expert_recv_count` and enters the
   cross-rank barrier, after which no peer reads this rank's inputs or writes its counters for
   this call any more: the next call may restage inputs and start over.

Constraints:
* launched cooperatively with at most one CTA per SM (`num_ctas` <= SMs); every rank launches
  it once per call, also with 0 tokens (the barriers and counts need every rank);
* the routing has been validated (indices in [-1, E), distinct experts per token); indices out
  of range or slots past T are skipped instead of corrupting memory;
* `hidden * element_size % 16 == 0` (true since `hidden % 128 == 0`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..layout.device import BufferRegions
from ..layout.mega_moe import MegaMoELayout
from .common.pool import BulkRowPipeline, build_pool_prefix
from .common.sync import (
    GRID_BARRIER_SLOT,
    cross_rank_barrier,
    grid_barrier,
    spin_timeout_ns,
    wait_published,
)


class DispatchKernel:
    """Count, prefix, scatter and pull for one rank (see the module docstring)."""

    def __init__(self, layout: MegaMoELayout, block_m: int, num_threads: int = 256,
                 has_stats: bool = False):
        if block_m % 16 != 0 or not 16 <= block_m <= layout.block_m_max:
            raise ValueError(f"block_m: expected a multiple of 16 in [16, "
                             f"{layout.block_m_max}], got {block_m}")
        self.layout = layout
        self.regions = BufferRegions(layout)
        self.block_m = block_m
        self.num_threads = num_threads
        self.num_warps = num_threads // 32
        self.has_stats = has_stats
        self.num_ranks = layout.num_ranks
        self.num_experts = layout.num_experts
        self.num_local_experts = layout.num_local_experts
        self.num_topk = layout.num_topk
        self.num_slots = layout.num_tokens  # T slots per (expert, source rank)
        self.num_pool_rows = layout.num_pool_rows
        self.has_sf = layout.has_sf
        self.sf_words = layout.hidden // 128
        self.row_bytes = layout.hidden * layout.region("x").element_size
        self.rows = BulkRowPipeline(self.row_bytes)
        self.rows.check_fits(self.num_warps)
        self.timeout_ns = spin_timeout_ns()

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
            cooperative=True)

    @cute.kernel
    def kernel(self, peer_bases: cute.Tensor, rank: Int32, num_tokens: Int32,
               expert_recv_tokens: cute.Tensor, stats: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        E, E_l, R, K = self.num_experts, self.num_local_experts, self.num_ranks, self.num_topk
        my_base = Int64(peer_bases[rank])
        barrier = self.regions.ptr(my_base, "barrier")

        smem = cutlass.memory.SmemAllocator()
        expert_slot = smem.allocate_tensor(Int32, cute.make_layout(E))  # count, then next slot
        recv_count = smem.allocate_tensor(Int32, cute.make_layout(R * E_l))  # [src][expert]
        expert_count = smem.allocate_tensor(Int32, cute.make_layout(E_l))  # all sources
        row_start = smem.allocate_tensor(Int32, cute.make_layout(E_l + 1))
        block_start = smem.allocate_tensor(Int32, cute.make_layout(E_l + 1))
        mbar, staging, pending_dst, pending_bytes = self.rows.for_warp(
            self.rows.allocate(smem, self.num_warps), warp)

        e = tidx
        while e < E:
            expert_slot[e] = 0
            e += self.num_threads
        self.rows.init_barriers(mbar, lane)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # 1. count this CTA's contiguous share of the (token, slot) pairs
        topk_idx = self.regions.ptr(my_base, "topk_idx")
        num_pairs = num_tokens * K
        share = (num_pairs + num_ctas - 1) // num_ctas
        pair_begin = cutlass.min(bidx * share, num_pairs)
        pair_end = cutlass.min(pair_begin + share, num_pairs)
        p = pair_begin + tidx
        while p < pair_end:
            expert = Int32(cute.arch.load(topk_idx + p, Int64))
            if expert >= 0 and expert < E:
                cute.arch.atomic_add(expert_slot.iterator + expert, Int32(1), scope="cta")
            p += self.num_threads
        cute.arch.sync_threads()

        # 2. prefix: one 64-bit atomic per expert allocates this CTA's slots
        send_count = self.regions.ptr(my_base, "expert_send_count")
        # (experts this CTA does not send to skip the atomic: the grid barrier, not the
        # arrival count, tells when every CTA has reported)
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
        p = pair_begin + tidx
        while p < pair_end:
            expert = Int32(cute.arch.load(topk_idx + p, Int64))
            if expert >= 0 and expert < E:
                slot = cute.arch.atomic_add(expert_slot.iterator + expert, Int32(1), scope="cta")
                if slot < self.num_slots:
                    dst = expert // E_l
                    table = self.regions.ptr(Int64(peer_bases[dst]), "src_token_topk_idx")
                    cute.arch.store(
                        table + ((expert % E_l) * R + rank) * self.num_slots + slot, p)
            p += self.num_threads

        grid_barrier(barrier + GRID_BARRIER_SLOT, num_ctas, self.timeout_ns)

        # 4. CTA 0 publishes the per-(expert, source) counts to the destination ranks
        if bidx == 0:
            e = tidx
            while e < E:
                total = cute.arch.load(send_count + e, Int64) & 0xFFFFFFFF
                cute.arch.store(send_count + e, Int64(0))
                dst = e // E_l
                recv = self.regions.ptr(Int64(peer_bases[dst]), "expert_recv_count")
                cute.arch.store(recv + rank * E_l + e % E_l,
                                cutlass.min(total, Int64(self.num_slots)) | (Int64(1) << 32),
                                sem="release", scope="sys")
                e += self.num_threads

        # 5. every CTA gathers this rank's received counts; warp 0 builds the prefix sums
        my_recv = self.regions.ptr(my_base, "expert_recv_count")
        i = tidx
        while i < R * E_l:
            recv_count[i] = wait_published(my_recv + i, "expert_recv_count", self.timeout_ns)
            i += self.num_threads
        cute.arch.sync_threads()
        e = tidx
        while e < E_l:
            total = Int32(0)
            for src in cutlass.range(R):
                total += recv_count[src * E_l + e]
            expert_count[e] = total
            e += self.num_threads
        cute.arch.sync_threads()
        if warp == 0:
            build_pool_prefix(expert_count, row_start, block_start, E_l, self.block_m)
        cute.arch.sync_threads()
        if bidx == 0:
            e = tidx
            while e < E_l:
                total = expert_count[e]
                expert_recv_tokens[e] = total
                if cutlass.const_expr(self.has_stats):
                    stats[e] = stats[e] + total
                e += self.num_threads

        # 6. pull the received rows into the pool
        self.pull(peer_bases, my_base, warp, lane, recv_count, row_start, block_start,
                  mbar, staging, pending_dst, pending_bytes)

        # 7. all pulls done -> reset the received counts, then meet the other ranks
        grid_barrier(barrier + GRID_BARRIER_SLOT, num_ctas, self.timeout_ns)
        if bidx == 0:
            i = tidx
            while i < R * E_l:
                cute.arch.store(my_recv + i, Int64(0))
                i += self.num_threads
            cross_rank_barrier(barrier, peer_bases, self.regions.offset("barrier"), Int32(R),
                               self.timeout_ns)

    @cute.jit
    def pull(self, peer_bases: cute.Tensor, my_base: Int64, warp: Int32, lane: Int32,
             recv_count: cute.Tensor, row_start: cute.Tensor, block_start: cute.Tensor,
             mbar: cute.Pointer, staging: cute.Pointer, pending_dst: cute.Tensor,
             pending_bytes: cute.Tensor):
        """Rows g, g + G, ... of the received rows (g = this warp's global index)."""
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        E_l, R, K = self.num_local_experts, self.num_ranks, self.num_topk
        num_rows = row_start[E_l]
        row = bidx * self.num_warps + warp
        stride = num_ctas * self.num_warps
        table = self.regions.ptr(my_base, "src_token_topk_idx")
        pool_weights = self.regions.ptr(my_base, "l1_topk_weights")
        metadata = self.regions.ptr(my_base, "token_src_metadata")

        expert = Int32(0)
        job = Int32(0)  # chunks issued by this warp so far
        while row < num_rows:
            while row >= row_start[expert + 1]:
                expert += 1
            index_in_expert = row - row_start[expert]
            src, slot = self.peel_source(index_in_expert, recv_count, expert)
            packed = cute.arch.load(table + (expert * R + src) * self.num_slots + slot, Int32)
            token = packed // K
            topk = packed % K
            pool_row = block_start[expert] * self.block_m + index_in_expert
            src_base = Int64(peer_bases[src])

            # scales, routing weight and metadata: plain loads/stores by the lanes
            if cutlass.const_expr(self.has_sf):
                src_sf = self.regions.ptr(src_base, "x_sf", dtype=Int32)
                pool_sf = self.regions.ptr(my_base, "l1_acts_sf", dtype=Int32)
                w = lane
                while w < self.sf_words:
                    value = cute.arch.load(src_sf + token * self.sf_words + w, Int32)
                    cute.arch.store(pool_sf + w * self.num_pool_rows + pool_row, value)
                    w += 32
            if lane == 0:
                weight = cute.arch.load(self.regions.ptr(src_base, "topk_weights") + packed,
                                        Float32)
                cute.arch.store(pool_weights + pool_row, weight)
            if lane < 4:
                value = src
                if lane == 1:
                    value = token
                if lane == 2:
                    value = topk
                if lane == 3:
                    value = Int32(0)
                cute.arch.store(metadata + pool_row * 4 + lane, value)

            # the row itself: bulk copies peer -> shared -> pool
            src_row = src_base + self.regions.offset("x") + Int64(token) * self.row_bytes
            dst_row = my_base + self.regions.offset("l1_acts") + Int64(pool_row) * self.row_bytes
            if lane == 0:
                job = self.rows.push_row(job, src_row, dst_row, mbar, staging, pending_dst,
                                         pending_bytes)
            row += stride
        if lane == 0:
            self.rows.drain(job, mbar, staging, pending_dst, pending_bytes)

    @cute.jit
    def peel_source(self, index: Int32, recv_count: cute.Tensor, expert: Int32):
        """(source rank, slot) of an expert's `index`-th received row.

        Rows alternate over the source ranks: round by round, every rank that still has rows
        gives one, in rank order, until the rank with the fewest remaining runs out (then the
        next round starts with fewer ranks). Consecutive rows thus come from different peers.
        """
        E_l, R = self.num_local_experts, self.num_ranks
        depth = Int32(0)  # rows already taken from every still-active rank
        src = Int32(-1)
        slot = Int32(0)
        while src < 0:
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
        return src, slot
