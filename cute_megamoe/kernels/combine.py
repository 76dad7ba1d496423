"""EP combine: send expert outputs back to their source ranks, then reduce over top-k.

What it computes, on every rank (one cooperative launch per rank, all ranks concurrently):

    for every received pool row (source rank s, token t, slot k) of this rank's experts:
        combine_s[k, t, :] = expert_out[pool_row, :]            (BF16 row, over NVLink)
    then, after all ranks have sent:
    y[t, :] = bf16( sum over k ascending with topk_idx[t, k] >= 0 of f32(combine[k, t, :]) )

The sum starts from 0 and adds in float32 with one rounding per add, in ascending k, so `y`
depends neither on scheduling nor on where a token sat in the pool (bit-exact with
`reference.combine_reference`). A token with every slot masked gets 0.

How:
1. Warp 0 rebuilds the pool prefix sums from `expert_recv_tokens` (as the dispatch did).
2. Send: global warp g takes received rows g, g + G, ...; reads the row's TokenSrcMetadata and
   moves the row to the source rank's combine slot: by default with 16-byte loads into
   registers and plain 16-byte stores to the peer (every lane keeps SEND_UNROLL vectors in
   flight), or (`send_mode="bulk"`) with 1-D bulk copies through shared memory.
3. Grid barrier (every store complete), cross-rank barrier by CTA 0 (system-scope release and
   acquire, after a proxy fence so the bulk stores are ordered), grid barrier.
4. Reduce: each thread owns 8 consecutive features (16 bytes) of one token, loads all K slots
   at once, then accumulates the valid ones in ascending k in float32 and stores 16 bytes of
   `y`.

Constraints:
* launched cooperatively, at most one CTA per SM; every rank launches it once per call;
* `expert_out` is `[P, H]` BF16 in pool order (`P = layout.num_pool_rows`), with the pool
  offsets of the dispatch that produced `expert_recv_tokens` (same `block_m`);
* `topk_idx` in the buffer is this call's routing (the dispatch read the same rows).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..layout.device import BufferRegions
from ..layout.mega_moe import MegaMoELayout
from .common.pool import BulkRowPipeline, build_pool_prefix
from .common.sync import GRID_BARRIER_SLOT, cross_rank_barrier, grid_barrier, spin_timeout_ns

VEC = 8  # BF16 features per thread in the reduction (16 bytes)
SEND_MODES = ("registers", "bulk")  # how rows cross to the source rank (see `send_*`)
SEND_UNROLL = 4  # 16-byte vectors each lane loads before storing them (registers mode)


class CombineKernel:
    """Send expert outputs to their source ranks and reduce over top-k (see module doc)."""

    def __init__(self, layout: MegaMoELayout, block_m: int, num_threads: int = 256,
                 send_mode: str = "registers"):
        if send_mode not in SEND_MODES:
            raise ValueError(f"send_mode: expected one of {SEND_MODES}, got {send_mode!r}")
        self.send_mode = send_mode
        self.layout = layout
        self.regions = BufferRegions(layout)
        self.block_m = block_m
        self.num_threads = num_threads
        self.num_warps = num_threads // 32
        self.num_ranks = layout.num_ranks
        self.num_local_experts = layout.num_local_experts
        self.num_topk = layout.num_topk
        self.num_tokens_max = layout.num_tokens
        self.hidden = layout.hidden
        self.row_bytes = layout.hidden * 2
        self.rows = BulkRowPipeline(self.row_bytes)
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
        E_l, K = self.num_local_experts, self.num_topk
        my_base = Int64(peer_bases[rank])
        barrier = self.regions.ptr(my_base, "barrier")

        smem = cutlass.memory.SmemAllocator()
        expert_count = smem.allocate_tensor(Int32, cute.make_layout(E_l))
        row_start = smem.allocate_tensor(Int32, cute.make_layout(E_l + 1))
        block_start = smem.allocate_tensor(Int32, cute.make_layout(E_l + 1))
        mbar, staging, pending_dst, pending_bytes = self.rows.for_warp(
            self.rows.allocate(smem, self.num_warps), warp)
        e = tidx
        while e < E_l:
            expert_count[e] = expert_recv_tokens[e]
            e += self.num_threads
        self.rows.init_barriers(mbar, lane)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if warp == 0:
            build_pool_prefix(expert_count, row_start, block_start, E_l, self.block_m)
        cute.arch.sync_threads()

        # 2. send every received row back to combine[k][t] on its source rank
        if cutlass.const_expr(self.send_mode == "bulk"):
            self.send_bulk(peer_bases, my_base, warp, lane, expert_out, row_start, block_start,
                           mbar, staging, pending_dst, pending_bytes)
        else:
            self.send_registers(peer_bases, my_base, warp, lane, expert_out, row_start,
                                block_start)

        # 3. every rank has sent everything it owes
        grid_barrier(barrier + GRID_BARRIER_SLOT, num_ctas, self.timeout_ns)
        if bidx == 0:
            cross_rank_barrier(barrier, peer_bases, self.regions.offset("barrier"),
                               Int32(self.num_ranks), self.timeout_ns)
        grid_barrier(barrier + GRID_BARRIER_SLOT, num_ctas, self.timeout_ns)

        # 4. reduce over top-k in ascending k, float32. All K slots are loaded before any add
        # (a masked slot's stale row is loaded too and replaced by +0.0, which leaves the sum
        # bit-identical to skipping it: the running sum starts at +0.0 and is never -0.0).
        combine = my_base + self.regions.offset("combine")
        topk_idx = self.regions.ptr(my_base, "topk_idx")
        y_base = Int64(y.toint())
        vecs_per_token = self.hidden // VEC
        num_vecs = num_tokens * vecs_per_token
        v = bidx * self.num_threads + tidx
        while v < num_vecs:
            token = v // vecs_per_token
            col = (v % vecs_per_token) * VEC
            parts = []
            for k in cutlass.range_constexpr(K):
                part = cute.make_rmem_tensor((VEC,), BFloat16)
                cute.autovec_copy(self._vec(
                    combine + (Int64(k * self.num_tokens_max + token) * self.hidden + col) * 2),
                    part)
                parts.append(part)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            for k in cutlass.range_constexpr(K):
                values = parts[k].load().to(Float32)
                if cute.arch.load(topk_idx + token * K + k, Int64) < 0:
                    values = cute.full_like(values, 0.0)
                acc.store(acc.load() + values)
            out = cute.make_rmem_tensor((VEC,), BFloat16)
            out.store(acc.load().to(BFloat16))
            cute.autovec_copy(out, self._vec(y_base + (Int64(token) * self.hidden + col) * 2))
            v += num_ctas * self.num_threads

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
        vecs = self.row_bytes // 16
        groups = -(-vecs // (32 * SEND_UNROLL))
        out_base = Int64(expert_out.toint())
        expert = Int32(0)
        while row < num_rows:
            while row >= row_start[expert + 1]:
                expert += 1
            pool_row = block_start[expert] * self.block_m + row - row_start[expert]
            src_row, dst_row = self.row_addresses(peer_bases, my_base, out_base, pool_row)
            for g in cutlass.range_constexpr(groups):
                regs = []
                for u in cutlass.range_constexpr(SEND_UNROLL):
                    i = (g * SEND_UNROLL + u) * 32 + lane
                    r = cute.make_rmem_tensor((VEC,), BFloat16)
                    if i < vecs:
                        cute.autovec_copy(self._vec(src_row + Int64(i) * 16), r)
                    regs.append(r)
                for u in cutlass.range_constexpr(SEND_UNROLL):
                    i = (g * SEND_UNROLL + u) * 32 + lane
                    if i < vecs:
                        cute.autovec_copy(regs[u], self._vec(dst_row + Int64(i) * 16))
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
