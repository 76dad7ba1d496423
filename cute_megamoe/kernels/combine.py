"""EP combine: send expert outputs back to their source ranks, then reduce over top-k.

What it computes, on every rank (one cooperative launch per rank, all ranks concurrently):

    for every received pool row (source rank s, token t, slot k) of this rank's experts:
        combine_s[k, t, :] = expert_out[pool_row, :]            (BF16 row, over NVLink)
    and, once token t's rows have all arrived:
    y[t, :] = bf16( sum over k ascending with 0 <= topk_idx[t, k] < E of f32(combine[k, t, :]) )

The sum starts from 0 and adds in float32 with one rounding per add, in ascending k, so `y`
depends neither on scheduling nor on where a token sat in the pool (bit-exact with
`reference.combine_reference`). A token with every slot masked gets 0.

How (`send_mode="registers"`, the default, and `"bulk"`): pool order, then one barrier.
1. Warp 0 rebuilds the pool prefix sums from `expert_recv_tokens` (as the dispatch did).
2. Send: global warp g takes received rows g, g + G, ... and moves each to its source rank's
   `combine[k, t]` (16-byte register copies, plain stores to the peer; or 1-D bulk copies
   through shared memory).
3. Grid barrier, cross-rank barrier by CTA 0 (system-scope release and acquire), grid barrier.
4. Reduce: one thread per 8 features of a token loads all K slots, then accumulates; each
   thread takes `reduce_unroll` such vectors per step, all their loads issued first.

`send_mode="epilogue"`: the rows are in place already: the L2 GEMM's epilogue wrote them into
the source ranks' `combine[k, t]` (`expert_ffn(..., combine_buffer=...)`, design step f). Steps
3 (without the first grid barrier) and 4 only. The L2 kernel, earlier on the same stream, waits
for its stores to complete before it exits; the cross-rank barrier (proxy fence, system-scope
fence and release) orders them before this rank's arrival, as it does for this kernel's own
sends in the other modes.

`send_mode="overlap"`: the reduction runs while the rows are still moving. Faster at 8192
tokens per rank (no reduction pass after the sends), about 35 us slower at 1-128 tokens (not
from walking the buffer's token range: bounding the walk did not help; likely because one warp
sends all of a token's rows one after the other; see docs/performance.md).
1. As above.
2. Every thread takes received rows and writes `combine_pool_row[s, t, k] = pool_row + 1` (the
   inverse of TokenSrcMetadata); grid barrier.
3. Global warp g owns tokens t = g, g + G, ... in ascending order (G warps in the grid, the same
   split on every rank). At step i it sends, for every source rank s, the rows of token
   g + i G that live here (16-byte register copies, plain stores to the peer), zeroes their
   table entries, then publishes their number: `__syncwarp`, `fence.acq_rel.sys`, one
   system-scope release add to `combine_token_arrivals[t]` on rank s. At the same step it
   reduces its own token g + (i - LAG) G: lane 0 waits (acquire) until that token's arrivals
   equal its valid top-k count and zeroes the counter; the warp then loads all K slots of 8
   features per lane and accumulates in ascending k. A warp only waits after sending all its
   earlier tokens and only on a token sent LAG steps earlier, so waits never form a cycle.
   Every rank must use the same mode in a call.

Constraints:
* launched cooperatively, at most one CTA per SM; every rank launches it once per call;
* `expert_out` is `[P, H]` BF16 in pool order (`P = layout.num_pool_rows`), with the pool
  offsets of the dispatch that produced `expert_recv_tokens` (same `block_m`);
* `topk_idx` in the buffer is this call's routing (the dispatch read the same rows);
* between two combines on one buffer every rank runs a dispatch (as every layer call does): its
  cross-rank barriers keep a fast rank from writing the next call's rows, or (overlap mode, which
  has no barrier of its own) the next call's arrival counts, into a rank that is still reducing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..layout.device import BufferRegions
from ..layout.mega_moe import MegaMoELayout
from .common.pool import BulkRowPipeline, build_pool_prefix
from .common.sync import (
    GRID_BARRIER_SLOT,
    cross_rank_barrier,
    grid_barrier,
    spin_timeout_ns,
    wait_eq,
)

VEC = 8  # BF16 features per thread in the reduction (16 bytes)
SEND_MODES = ("registers", "bulk", "overlap", "epilogue")  # see the module doc
SEND_UNROLL = 4  # 16-byte vectors each lane loads before storing them (register copies)
LAG = 1  # token steps a warp's reduction trails its sends (overlap mode)


class CombineKernel:
    """Send expert outputs to their source ranks and reduce over top-k (see module doc)."""

    def __init__(self, layout: MegaMoELayout, block_m: int, num_threads: int | None = None,
                 send_mode: str = "registers", reduce_unroll: int = 2):
        if send_mode not in SEND_MODES:
            raise ValueError(f"send_mode: expected one of {SEND_MODES}, got {send_mode!r}")
        if num_threads is None:  # the bulk mode's per-warp staging fits 8 warps
            num_threads = 256 if send_mode == "bulk" else 512
        self.send_mode = send_mode
        # 512 threads and two vectors per thread per reduction step: a memory-bound loop
        # needs loads in flight (one CTA per SM). Against 256 x 1, interleaved on 2 x H200:
        # the reduction alone 37 % faster, pool order 10 %, overlap 5 % at 8192 tokens
        # (docs/performance.md).
        self.reduce_unroll = reduce_unroll  # vectors per thread per step of the reduction
        self.layout = layout
        self.regions = BufferRegions(layout)
        self.block_m = block_m
        self.num_threads = num_threads
        self.num_warps = num_threads // 32
        self.num_ranks = layout.num_ranks
        self.num_experts = layout.num_experts
        self.num_local_experts = layout.num_local_experts
        self.num_topk = layout.num_topk
        self.num_tokens_max = layout.num_tokens
        self.hidden = layout.hidden
        self.row_bytes = layout.hidden * 2
        self.rows = BulkRowPipeline(self.row_bytes)
        if send_mode == "bulk":
            self.rows.check_fits(self.num_warps)
        self.timeout_ns = spin_timeout_ns()

    @cute.jit
    def __call__(
        self,
        peer_bases: cute.Pointer,  # Int64 [R]
        rank: Int32,
        num_tokens: Int32,
        expert_out: cute.Pointer,  # BF16 [P, H], pool order
        expert_recv_tokens: cute.Pointer,  # Int32 [E_l]
        y: cute.Pointer,  # BF16 [num_tokens, H]
        num_ctas: Int32,
        stream,
    ):
        self.kernel(cute.make_tensor(peer_bases, cute.make_layout(self.num_ranks)), rank,
                    num_tokens, expert_out,
                    cute.make_tensor(expert_recv_tokens, cute.make_layout(self.num_local_experts)),
                    y).launch(
            grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
            cooperative=True)

    @cute.kernel
    def kernel(self, peer_bases: cute.Tensor, rank: Int32, num_tokens: Int32,
               expert_out: cute.Pointer, expert_recv_tokens: cute.Tensor, y: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        E_l = self.num_local_experts
        my_base = Int64(peer_bases[rank])
        barrier = self.regions.ptr(my_base, "barrier")

        smem = cutlass.memory.SmemAllocator()
        expert_count = smem.allocate_tensor(Int32, cute.make_layout(E_l))
        row_start = smem.allocate_tensor(Int32, cute.make_layout(E_l + 1))
        block_start = smem.allocate_tensor(Int32, cute.make_layout(E_l + 1))
        pipe = None  # the bulk send mode's per-warp staging (see `BulkRowPipeline`)
        if cutlass.const_expr(self.send_mode == "bulk"):
            pipe = self.rows.for_warp(self.rows.allocate(smem, self.num_warps), warp)
            self.rows.init_barriers(pipe[0], lane)
        e = tidx
        while e < E_l:
            expert_count[e] = expert_recv_tokens[e]
            e += self.num_threads
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if warp == 0:
            build_pool_prefix(expert_count, row_start, block_start, E_l, self.block_m)
        cute.arch.sync_threads()

        if cutlass.const_expr(self.send_mode == "overlap"):
            self.send_and_reduce(peer_bases, my_base, barrier, warp, lane, num_tokens,
                                 expert_out, row_start, block_start, y)
        else:
            self.send_then_reduce(peer_bases, my_base, barrier, warp, lane, num_tokens,
                                  expert_out, row_start, block_start, y, pipe)

    @cute.jit
    def send_and_reduce(self, peer_bases: cute.Tensor, my_base: Int64, barrier: cute.Pointer,
                        warp: Int32, lane: Int32, num_tokens: Int32, expert_out: cute.Pointer,
                        row_start: cute.Tensor, block_start: cute.Tensor, y: cute.Pointer):
        """Overlap mode, steps 2 and 3 of the module doc."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        E_l, K, R, T = (self.num_local_experts, self.num_topk, self.num_ranks,
                        self.num_tokens_max)
        pool_row_of = self.regions.ptr(my_base, "combine_pool_row")
        metadata = self.regions.ptr(my_base, "token_src_metadata")

        # 2. the inverse table: (source rank, token, slot) -> pool row + 1
        num_rows = row_start[E_l]
        row = bidx * self.num_threads + tidx
        expert = Int32(0)
        while row < num_rows:
            while row >= row_start[expert + 1]:
                expert += 1
            pool_row = block_start[expert] * self.block_m + row - row_start[expert]
            src = cute.arch.load(metadata + pool_row * 4, Int32)
            token = cute.arch.load(metadata + pool_row * 4 + 1, Int32)
            topk = cute.arch.load(metadata + pool_row * 4 + 2, Int32)
            cute.arch.store(pool_row_of + (src * T + token) * K + topk, pool_row + 1)
            row += num_ctas * self.num_threads
        grid_barrier(barrier + GRID_BARRIER_SLOT, num_ctas, self.timeout_ns)

        # 3. token-ordered sends; each warp reduces its own tokens LAG steps behind
        num_warps_total = num_ctas * self.num_warps
        g = bidx * self.num_warps + warp
        out_base = Int64(expert_out.toint())
        combine_offset = self.regions.offset("combine")
        arrivals_offset = self.regions.offset("combine_token_arrivals")
        send_steps = (T - g + num_warps_total - 1) // num_warps_total
        step = Int32(0)
        while step < send_steps + LAG:
            t = g + step * num_warps_total
            if t < T:
                for s in cutlass.range(R):
                    entries = pool_row_of + (s * T + t) * K
                    peer = Int64(peer_bases[s])
                    count = Int32(0)
                    for k in cutlass.range(K):
                        entry = cute.arch.load(entries + k, Int32)
                        if entry != 0:
                            self.copy_row(out_base + Int64(entry - 1) * self.row_bytes,
                                          peer + combine_offset
                                          + Int64(k * T + t) * self.row_bytes, lane)
                            count += 1
                    if count > 0:
                        cute.arch.sync_warp()
                        if lane < K:
                            cute.arch.store(entries + lane, Int32(0))
                        if lane == 0:
                            cute.arch.fence_acq_rel_sys()
                            cute.arch.red(cute.make_ptr(Int32, peer + arrivals_offset + 4 * t,
                                                        cute.AddressSpace.gmem, assumed_align=4),
                                          count, op="add", dtype="s32", sem="release",
                                          scope="sys")
            if step >= LAG:
                t_own = g + (step - LAG) * num_warps_total
                if t_own < num_tokens:
                    self.reduce_token(my_base, t_own, lane, y)
            step += 1

    @cute.jit
    def copy_row(self, src_row: Int64, dst_row: Int64, lane: Int32):
        """The warp copies one row: every lane loads SEND_UNROLL 16-byte vectors, then stores
        them (plain stores; the caller publishes them)."""
        vecs = self.row_bytes // 16
        for grp in cutlass.range_constexpr(-(-vecs // (32 * SEND_UNROLL))):
            regs = []
            for u in cutlass.range_constexpr(SEND_UNROLL):
                i = (grp * SEND_UNROLL + u) * 32 + lane
                r = cute.make_rmem_tensor((VEC,), BFloat16)
                if i < vecs:
                    cute.autovec_copy(self._vec(src_row + Int64(i) * 16), r)
                regs.append(r)
            for u in cutlass.range_constexpr(SEND_UNROLL):
                i = (grp * SEND_UNROLL + u) * 32 + lane
                if i < vecs:
                    cute.autovec_copy(regs[u], self._vec(dst_row + Int64(i) * 16))

    @cute.jit
    def reduce_token(self, my_base: Int64, token: Int32, lane: Int32, y: cute.Pointer):
        """The warp waits until every valid slot of `token` has arrived, then reduces it."""
        valid = self.valid_slots(my_base, token)
        expected = Int32(0)
        for k in cutlass.range_constexpr(self.num_topk):
            expected += (valid >> k) & 1
        if lane == 0:
            arrivals = self.regions.ptr(my_base, "combine_token_arrivals", align=4) + token
            wait_eq(arrivals, expected, "sys", "combine token arrivals", self.timeout_ns)
            cute.arch.fence_acq_rel_sys()
            cute.arch.store(arrivals, Int32(0))
        cute.arch.sync_warp()
        v = lane
        while v < self.hidden // VEC:
            self.reduce_vec(my_base, token, v * VEC, Int64(y.toint()), valid)
            v += 32

    @cute.jit
    def valid_slots(self, my_base: Int64, token: Int32) -> Int32:
        """Bit k set when slot k of `token` names an expert (0 <= topk_idx < E)."""
        topk_idx = self.regions.ptr(my_base, "topk_idx")
        valid = Int32(0)
        for k in cutlass.range_constexpr(self.num_topk):
            idx = cute.arch.load(topk_idx + token * self.num_topk + k, Int64)
            if idx >= 0 and idx < self.num_experts:
                valid |= 1 << k
        return valid

    @cute.jit
    def reduce_vec(self, my_base: Int64, token: Int32, col: Int32, y_base: Int64,
                   valid: Int32):
        """`y[token, col : col + 8]` over the slots set in `valid`: all K slots loaded before
        any add (a masked slot's stale row is loaded too and replaced by +0.0, which leaves the
        sum bit-identical to skipping it: the running sum starts at +0.0 and is never -0.0)."""
        self.sum_slots(self.load_slots(my_base, token, col), valid, token, col, y_base)

    @cute.jit
    def load_slots(self, my_base: Int64, token: Int32, col: Int32) -> list:
        """`combine[k, token, col : col + 8]` of every slot k, one 16-byte load each."""
        combine = my_base + self.regions.offset("combine")
        parts = []
        for k in cutlass.range_constexpr(self.num_topk):
            part = cute.make_rmem_tensor((VEC,), BFloat16)
            cute.autovec_copy(self._vec(
                combine + (Int64(k * self.num_tokens_max + token) * self.hidden + col) * 2), part)
            parts.append(part)
        return parts

    @cute.jit
    def sum_slots(self, parts: list, valid: Int32, token: Int32, col: Int32, y_base: Int64):
        """`y[token, col : col + 8]` = the ascending-k float32 sum of the valid slots' parts."""
        K = self.num_topk
        acc = cute.make_rmem_tensor((VEC,), Float32)
        acc.fill(0.0)
        for k in cutlass.range_constexpr(K):
            values = parts[k].load().to(Float32)
            if (valid >> k) & 1 == 0:
                values = cute.full_like(values, 0.0)
            acc.store(acc.load() + values)
        out = cute.make_rmem_tensor((VEC,), BFloat16)
        out.store(acc.load().to(BFloat16))
        cute.autovec_copy(out, self._vec(y_base + (Int64(token) * self.hidden + col) * 2))

    @cute.jit
    def send_then_reduce(self, peer_bases: cute.Tensor, my_base: Int64, barrier: cute.Pointer,
                         warp: Int32, lane: Int32, num_tokens: Int32, expert_out: cute.Pointer,
                         row_start: cute.Tensor, block_start: cute.Tensor, y: cute.Pointer,
                         pipe):
        """Pool-order modes: send every row, barriers, then reduce (`pipe`: the bulk mode's
        staging, None otherwise)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        # 2. send every received row back to combine[k][t] on its source rank
        if cutlass.const_expr(self.send_mode == "bulk"):
            self.send_bulk(peer_bases, my_base, warp, lane, expert_out, row_start, block_start,
                           *pipe)
        if cutlass.const_expr(self.send_mode == "registers"):
            self.send_registers(peer_bases, my_base, warp, lane, expert_out, row_start,
                                block_start)

        # 3. every rank has sent everything it owes (in "epilogue" mode a kernel earlier on
        # this stream did)
        if cutlass.const_expr(self.send_mode != "epilogue"):
            grid_barrier(barrier + GRID_BARRIER_SLOT, num_ctas, self.timeout_ns)
        if bidx == 0:
            cross_rank_barrier(barrier, peer_bases, self.regions.offset("barrier"),
                               Int32(self.num_ranks), self.timeout_ns)
        grid_barrier(barrier + GRID_BARRIER_SLOT, num_ctas, self.timeout_ns)

        # 4. reduce over top-k in ascending k, float32, one thread per 8 features of a token
        y_base = Int64(y.toint())
        vecs_per_token = self.hidden // VEC
        num_vecs = num_tokens * vecs_per_token
        stride = num_ctas * self.num_threads
        v = bidx * self.num_threads + tidx
        while v < num_vecs:
            if cutlass.const_expr(self.reduce_unroll == 1):
                token = v // vecs_per_token
                self.reduce_vec(my_base, token, (v % vecs_per_token) * VEC, y_base,
                                self.valid_slots(my_base, token))
            else:
                # vectors v, v + stride, ...: every slot load of all of them in flight first
                # (a vector past the end loads the last one again and stores nothing)
                loads = []
                for u in cutlass.range_constexpr(self.reduce_unroll):
                    vu = cutlass.min(v + u * stride, num_vecs - 1)
                    token = vu // vecs_per_token
                    col = (vu % vecs_per_token) * VEC
                    loads.append((token, col, self.load_slots(my_base, token, col),
                                  self.valid_slots(my_base, token)))
                for u in cutlass.range_constexpr(self.reduce_unroll):
                    token, col, parts, valid = loads[u]
                    if v + u * stride < num_vecs:
                        self.sum_slots(parts, valid, token, col, y_base)
            v += stride * self.reduce_unroll

    @cute.jit
    def row_addresses(self, peer_bases: cute.Tensor, my_base: Int64, out_base: Int64,
                      pool_row: Int32):
        """(source address in `expert_out`, destination address in the source rank's
        `combine[k][t]`) of a received pool row."""
        metadata = self.regions.ptr(my_base, "token_src_metadata")
        src = cute.arch.load(metadata + pool_row * 4, Int32)
        token = cute.arch.load(metadata + pool_row * 4 + 1, Int32)
        topk = cute.arch.load(metadata + pool_row * 4 + 2, Int32)
        dst_row = (Int64(peer_bases[src]) + self.regions.offset("combine")
                   + Int64(topk * self.num_tokens_max + token) * self.row_bytes)
        return out_base + Int64(pool_row) * self.row_bytes, dst_row

    @cute.jit
    def send_registers(self, peer_bases: cute.Tensor, my_base: Int64, warp: Int32, lane: Int32,
                       expert_out: cute.Pointer, row_start: cute.Tensor,
                       block_start: cute.Tensor):
        """One warp per row: every lane loads SEND_UNROLL 16-byte vectors of the row, then
        stores them to the peer (plain stores; the cross-rank barrier publishes them)."""
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        num_rows = row_start[self.num_local_experts]
        row = bidx * self.num_warps + warp
        out_base = Int64(expert_out.toint())
        expert = Int32(0)
        while row < num_rows:
            while row >= row_start[expert + 1]:
                expert += 1
            pool_row = block_start[expert] * self.block_m + row - row_start[expert]
            src_row, dst_row = self.row_addresses(peer_bases, my_base, out_base, pool_row)
            self.copy_row(src_row, dst_row, lane)
            row += num_ctas * self.num_warps

    def _vec(self, address: Int64) -> cute.Tensor:
        return cute.make_tensor(cute.make_ptr(BFloat16, address, cute.AddressSpace.gmem,
                                              assumed_align=16), cute.make_layout(VEC))

    @cute.jit
    def send_bulk(self, peer_bases: cute.Tensor, my_base: Int64, warp: Int32, lane: Int32,
             expert_out: cute.Pointer, row_start: cute.Tensor, block_start: cute.Tensor,
             mbar: cute.Pointer, staging: cute.Pointer, pending_dst: cute.Tensor,
             pending_bytes: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        E_l = self.num_local_experts
        num_rows = row_start[E_l]
        row = bidx * self.num_warps + warp
        stride = num_ctas * self.num_warps
        out_base = Int64(expert_out.toint())

        expert = Int32(0)
        job = Int32(0)
        while row < num_rows:
            while row >= row_start[expert + 1]:
                expert += 1
            pool_row = block_start[expert] * self.block_m + row - row_start[expert]
            src_row, dst_row = self.row_addresses(peer_bases, my_base, out_base, pool_row)
            if lane == 0:
                job = self.rows.push_row(job, src_row, dst_row, mbar, staging, pending_dst,
                                         pending_bytes)
            row += stride
        if lane == 0:
            self.rows.drain(job, mbar, staging, pending_dst, pending_bytes)
