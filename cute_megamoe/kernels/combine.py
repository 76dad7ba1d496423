"""EP combine: send expert outputs back to their source ranks, then reduce over top-k.

What it computes, on every rank (one cooperative launch per rank, all ranks concurrently):

    for every received pool row (source rank s, token t, slot k) of this rank's experts:
        combine_s[k, t, :] = expert_out[pool_row, :]            (BF16 row, over NVLink)
    and, once token t's rows have all arrived:
    y[t, :] = bf16( sum over k ascending with 0 <= topk_idx[t, k] < E of f32(combine[k, t, :]) )

The sum starts from 0 and adds in float32 with one rounding per add, in ascending k, so `y`
depends neither on scheduling nor on where a token sat in the pool (bit-exact with
`reference.combine_reference`). A token with every slot masked gets 0.

How (`send_mode="registers"`, the default): pool order, in rounds.
1. Warp 0 rebuilds the pool prefix sums from `expert_recv_tokens` (as the dispatch did).
2. Token t is in class t % 8 (one class per split barrier, `common/sync.py`); `rounds` lists
   how many classes each round takes, in order (e.g. (8,): one round; (2, 2, 2, 1, 1): five,
   the last ones small so that little reduction is left after the sends). Per round: send,
   global warp g taking received rows g, g + G, ... of the round's classes (when a round
   takes fewer than all classes, a lane reads the metadata of one row of a batch of 32, and
   the warp sends the batch's rows of the round) to the source rank's `combine[k, t]` with
   16-byte register copies, plain stores to the peer; arrive at the round's split barriers
   (no wait); then wait for the previous round's barriers and reduce its tokens, while this
   round's stores drain and other CTAs still send.
   One round = send everything, one barrier, reduce. Barrier i means "every row of class i is
   in place" however a rank groups the classes, so ranks may use different `rounds`.
3. Reduce (per round): one thread per 8 features of a token loads all K slots, then
   accumulates; each thread takes `reduce_unroll` such vectors per step, all their loads
   issued first.

`send_mode="bulk"`: as one round, the rows moved with 1-D bulk copies through shared memory,
then the split barriers and the reduction.

`send_mode="epilogue"`: the rows are in place already: the L2 GEMM's epilogue wrote them into
the source ranks' `combine[k, t]` (`expert_ffn(..., combine_buffer=...)`, design step f). The
split barriers and the reduction only. The L2 kernel, earlier on the same stream, waits for its
stores to complete before it exits; the split barriers' arrival (proxy fence, system-scope
fence and release; GPU scope in a one-rank group that opts in) orders them before this rank's
signal, as it does for this kernel's own sends in the other modes.

`per_token` (the fused kernel's ticket walk, "epilogue" only): each token is reduced once
its own rows are in. They are counted in this rank's `token_arrivals[t]`: the last warp to
finish an L2 tile of a pool block adds 1 per row of the block to the row's token on its source
rank, a release at the group's scope once every row of the block is stored
(`Sm90MegaMoEKernel.signal_tokens`); a thread acquires the token's count until it reaches the
token's valid slots, then loads and sums them as above. The split barriers stay, out of the
reduction's way: every CTA arrives once its rows are stored (as above) and waits after its
reduction, so that when the call ends every CTA of every rank is past its walk (it has read
this rank's counts, which the next call overwrites, and this rank's counters are free).

Ranks may use different modes and `rounds` in one call: every mode delivers all of a rank's
rows before its arrival at the barrier of their token class, and the barriers are the same.
Not `per_token`: it needs the token counts of every rank that owns one of its experts (a rank
that does not send them leaves its tokens' waits to time out).

Constraints:
* launched cooperatively, at most one CTA per SM; every rank launches it once per call;
* `expert_out` is `[P, H]` BF16 in pool order (`P = layout.num_pool_rows`), with the pool
  offsets of the dispatch that produced `expert_recv_tokens` (same `block_m`);
* `topk_idx` in the buffer is this call's routing (the dispatch read the same rows);
* between two combines on one buffer every rank runs a dispatch (as every layer call does): its
  cross-rank barriers keep a fast rank from writing the next call's rows into a rank that is
  still reducing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..layout.device import BufferRegions
from ..layout.mega_moe import MegaMoELayout
from .common.pool import (
    BulkRowPipeline,
    build_pool_prefix,
    copy_row_in_registers,
    expert_of_row,
    gmem_vector,
)
from .common.sync import (
    SPLIT_BARRIER_COUNT,
    group_scope,
    spin_timeout_ns,
    split_barrier_arrive,
    split_barrier_finish,
    split_barrier_target,
    split_barrier_wait,
    wait_reached,
)

VEC = 8  # BF16 features per thread in the reduction (16 bytes)
SEND_MODES = ("registers", "bulk", "epilogue")  # see the module doc


class CombineKernel:
    """Send expert outputs to their source ranks and reduce over top-k (see module doc)."""

    def __init__(self, layout: MegaMoELayout, block_m: int, num_threads: int | None = None,
                 send_mode: str = "registers", reduce_unroll: int = 2,
                 rounds: tuple[int, ...] = (SPLIT_BARRIER_COUNT,), per_token: bool = False):
        if send_mode not in SEND_MODES:
            raise ValueError(f"send_mode: expected one of {SEND_MODES}, got {send_mode!r}")
        if per_token and send_mode != "epilogue":
            raise ValueError(f"per_token: with send_mode='epilogue' only (the rows' senders "
                             f"count them per token), got {send_mode!r}")
        # each token reduced once its rows are counted in `token_arrivals` (module doc)
        self.per_token = per_token
        rounds = tuple(rounds)
        if (not all(isinstance(r, int) and r > 0 for r in rounds)
                or sum(rounds) != SPLIT_BARRIER_COUNT
                or (len(rounds) > 1 and send_mode != "registers")):
            raise ValueError(f"rounds: positive class counts summing to {SPLIT_BARRIER_COUNT}, "
                             f"more than one round only with send_mode='registers'; got "
                             f"{rounds} with {send_mode!r}")
        self.rounds = rounds  # token classes per round
        if num_threads is None:  # the bulk mode's per-warp staging fits 8 warps
            num_threads = 256 if send_mode == "bulk" else 512
        self.send_mode = send_mode
        # 512 threads and two vectors per thread per reduction step: a memory-bound loop
        # needs loads in flight (one CTA per SM). Against 256 x 1, interleaved on 2 x H200:
        # the reduction alone 37 % faster, the whole combine 10 % at 8192 tokens
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
        self.scope = group_scope(self.num_ranks)  # of its barriers and flags
        # the fused kernel's warpgroups per CTA, whose progress words (``cta_progress``) a
        # split-barrier stall report then scans for the CTAs that did not arrive; 0: none
        self.progress_warpgroups = 0

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

        self.send_and_reduce(peer_bases, my_base, barrier, warp, lane, num_tokens, expert_out,
                             row_start, block_start, y, pipe)

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
        """`y[token, col : col + 8]` = the ascending-k float32 sum of the valid slots' parts (a
        masked slot's stale row was loaded too and is replaced by +0.0, which leaves the sum
        bit-identical to skipping it: the running sum starts at +0.0 and is never -0.0)."""
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
    def wait_for_rows(self, my_base: Int64, token: Int32, valid: Int32):
        """`per_token`: until this rank's `token_arrivals[token]` has counted a row per valid
        slot of the token (acquire at the group's scope: the rows, stored before the count's
        release, are then visible to the loads that follow)."""
        count = Int32(0)
        for k in cutlass.range_constexpr(self.num_topk):
            count += (valid >> k) & 1
        barrier = self.regions.ptr(my_base, "barrier")
        arrivals = self.regions.ptr(my_base, "token_arrivals") + token
        wait_reached(barrier, arrivals, count, self.scope,
                     "the L2 rows of a token (token_arrivals)", self.timeout_ns, token=token)

    @cute.jit
    def reduce_tokens(self, my_base: Int64, num_tokens: Int32, first: Int32,
                      classes: cutlass.Constexpr, y_base: Int64):
        """The grid reduces the tokens t < num_tokens with first <= t % CLASSES < first +
        classes (CLASSES = SPLIT_BARRIER_COUNT; all tokens when classes == CLASSES): one
        thread per 8 features, `reduce_unroll` vectors per thread per step (`per_token`: each
        vector's slots loaded once its token's rows are in, `wait_for_rows`)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        CLASSES = SPLIT_BARRIER_COUNT
        count = ((num_tokens // CLASSES) * classes
                 + cutlass.min(cutlass.max(num_tokens % CLASSES - first, 0), classes))
        vecs_per_token = self.hidden // VEC
        num_vecs = count * vecs_per_token
        stride = num_ctas * self.num_threads
        v = bidx * self.num_threads + tidx
        while v < num_vecs:
            # vectors v, v + stride, ...: every slot load of all of them in flight first
            # (a vector past the end loads the last one again and stores nothing)
            loads = []
            for u in cutlass.range_constexpr(self.reduce_unroll):
                vu = cutlass.min(v + u * stride, num_vecs - 1)
                j = vu // vecs_per_token  # the j-th token of the classes
                token = (j // classes) * CLASSES + first + j % classes
                col = (vu % vecs_per_token) * VEC
                if cutlass.const_expr(self.per_token):
                    valid = self.valid_slots(my_base, token)
                    self.wait_for_rows(my_base, token, valid)
                    loads.append((token, col, self.load_slots(my_base, token, col), valid))
                else:
                    loads.append((token, col, self.load_slots(my_base, token, col),
                                  self.valid_slots(my_base, token)))
            for u in cutlass.range_constexpr(self.reduce_unroll):
                token, col, parts, valid = loads[u]
                if v + u * stride < num_vecs:
                    self.sum_slots(parts, valid, token, col, y_base)
            v += stride * self.reduce_unroll

    @cute.jit
    def send_and_reduce(self, peer_bases: cute.Tensor, my_base: Int64, barrier: cute.Pointer,
                        warp: Int32, lane: Int32, num_tokens: Int32, expert_out: cute.Pointer,
                        row_start: cute.Tensor, block_start: cute.Tensor, y: cute.Pointer,
                        pipe):
        """The rounds (one in the bulk and epilogue modes; unrolled: at most 8). Round c takes
        the next `rounds[c]` token classes: send the rows of its tokens, arrive at its split
        barriers, then wait for round c - 1's and reduce its tokens while round c's stores
        drain and the other CTAs still send (`per_token`: reduce each token once its rows are
        in, then wait). `pipe`: the bulk mode's staging."""
        target = split_barrier_target(barrier, self.num_ranks)
        progress = None
        if cutlass.const_expr(self.progress_warpgroups > 0):
            progress = self.regions.ptr(my_base, "cta_progress")
        num_ctas, _, _ = cute.arch.grid_dim()
        y_base = Int64(y.toint())
        rounds = self.rounds
        firsts = [sum(rounds[:i]) for i in range(len(rounds))]
        for c in cutlass.range_constexpr(len(rounds) + 1):
            if cutlass.const_expr(c < len(rounds)):
                if cutlass.const_expr(self.send_mode == "registers"):
                    self.send_registers(peer_bases, my_base, warp, lane, expert_out, row_start,
                                        block_start, Int32(firsts[c]), rounds[c])
                if cutlass.const_expr(self.send_mode == "bulk"):
                    self.send_bulk(peer_bases, my_base, warp, lane, expert_out, row_start,
                                   block_start, *pipe)
                # ("epilogue": a kernel earlier on this stream sent the rows)
                split_barrier_arrive(barrier, peer_bases, self.regions.offset("barrier"),
                                     Int32(firsts[c]), rounds[c], self.num_ranks, num_ctas,
                                     self.scope)
            if cutlass.const_expr(c > 0 and self.per_token):
                self.reduce_tokens(my_base, num_tokens, Int32(firsts[c - 1]), rounds[c - 1],
                                   y_base)
                split_barrier_wait(barrier, Int32(firsts[c - 1]), rounds[c - 1], target,
                                   self.timeout_ns, self.scope, progress,
                                   self.progress_warpgroups)
            elif cutlass.const_expr(c > 0):
                split_barrier_wait(barrier, Int32(firsts[c - 1]), rounds[c - 1], target,
                                   self.timeout_ns, self.scope, progress,
                                   self.progress_warpgroups)
                self.reduce_tokens(my_base, num_tokens, Int32(firsts[c - 1]), rounds[c - 1],
                                   y_base)
        split_barrier_finish(barrier)

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
                       block_start: cute.Tensor, first_class: Int32,
                       classes: cutlass.Constexpr):
        """One warp per row: every lane loads ROW_COPY_UNROLL 16-byte vectors of the row, then
        stores them to the peer (plain stores; a barrier publishes them). In a round of fewer
        than all classes, only the rows of its classes (`classes` from `first_class` on): lane
        l reads the metadata
        of the warp's row l of a batch of 32, and the warp sends the round's rows one by one."""
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        num_rows = row_start[self.num_local_experts]
        row = bidx * self.num_warps + warp
        stride = num_ctas * self.num_warps
        out_base = Int64(expert_out.toint())
        expert = Int32(0)
        if cutlass.const_expr(classes == SPLIT_BARRIER_COUNT):
            while row < num_rows:
                while row >= row_start[expert + 1]:
                    expert += 1
                pool_row = block_start[expert] * self.block_m + row - row_start[expert]
                src_row, dst_row = self.row_addresses(peer_bases, my_base, out_base, pool_row)
                copy_row_in_registers(src_row, dst_row, lane, self.row_bytes)
                row += stride
        else:
            metadata = my_base + self.regions.offset("token_src_metadata")
            combine_offset = self.regions.offset("combine")
            while row < num_rows:
                mine = row + lane * stride
                pool_row = Int32(-1)  # -1: not a row of this round
                src = Int32(0)
                slot_row = Int32(0)  # k * T + t: the row's place in the source's `combine`
                if mine < num_rows:
                    expert = expert_of_row(row_start, mine, self.num_local_experts)
                    candidate = block_start[expert] * self.block_m + mine - row_start[expert]
                    meta = cute.make_rmem_tensor((4,), Int32)  # (source rank, token, k, 0)
                    cute.autovec_copy(gmem_vector(metadata + Int64(candidate) * 16, Int32, 4),
                                      meta)
                    token_class = meta[1] % SPLIT_BARRIER_COUNT
                    if token_class >= first_class and (
                            token_class < first_class + classes):
                        pool_row = candidate
                        src = meta[0]
                        slot_row = meta[2] * self.num_tokens_max + meta[1]
                for j in cutlass.range(32):
                    row_j = cute.arch.shuffle_sync(pool_row, j)
                    src_j = cute.arch.shuffle_sync(src, j)
                    slot_j = cute.arch.shuffle_sync(slot_row, j)
                    if row_j >= 0:
                        copy_row_in_registers(out_base + Int64(row_j) * self.row_bytes,
                                              Int64(peer_bases[src_j]) + combine_offset
                                              + Int64(slot_j) * self.row_bytes, lane,
                                              self.row_bytes)
                row += 32 * stride

    def _vec(self, address: Int64) -> cute.Tensor:
        return gmem_vector(address, BFloat16, VEC)

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
