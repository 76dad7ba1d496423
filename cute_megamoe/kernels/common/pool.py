"""Pool bookkeeping and row movement shared by the dispatch and combine kernels.

* `build_pool_prefix`: from per-expert row counts in shared memory, the exclusive prefix sums
  of rows (`row_start`) and of BM-blocks (`block_start`, i.e. `pool_block_offset`), by one warp.
  Expert e's received row j lives at pool row `block_start[e] * BM + j`; `expert_of_row`
  inverts `row_start`.
* `copy_row_in_registers`: one warp copies a row with 16-byte loads and plain stores (to a
  peer's symmetric memory too).
* `BulkRowPipeline`: one warp moves rows chunk by chunk with 1-D bulk copies, global -> shared
  -> global, through `NUM_STAGES` staging buffers with `LOOKAHEAD` loads in flight. Lane 0
  issues everything; callers keep the chunk counter `job` in a loop variable.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8
from cutlass.experimental import primitives as prims

from .warp import warp_inclusive_sum

ROW_COPY_UNROLL = 4  # 16-byte vectors each lane loads before storing them (register copies)
NUM_STAGES = 3  # staging buffers per warp
LOOKAHEAD = NUM_STAGES - 1  # chunk loads in flight per warp
MAX_CHUNK_BYTES = 8192
STAGING_BUDGET = 200 * 1024  # shared memory the per-warp staging may take (227 KB per CTA)


@cute.jit
def ceil_div_small(n: Int32, d: Int32) -> Int32:
    """ceil(n / d) for 0 <= n < 2**24 and 1 <= d <= 2**16, d a runtime value, without an
    integer division (its subroutine call gives the kernel a stack frame and spills around
    it): an estimate through the approximate reciprocal, off by at most one (the float error
    stays below 0.5 in this range), then corrected."""
    top = n + d - 1
    q = Int32(Float32(top) * cute.arch.rcp_approx(Float32(d)))
    if q * d > top:
        q -= 1
    if (q + 1) * d <= top:
        q += 1
    return q


@cute.jit
def build_pool_prefix(expert_count: cute.Tensor, row_start: cute.Tensor,
                      block_start: cute.Tensor | None, num_experts: cutlass.Constexpr,
                      block_m: Int32 = None):
    """Call from one whole warp; the CTA must sync before reading the results. `block_m` may
    be a runtime value (a pushing dispatch lays out every destination's pool with that
    destination's BLOCK_M). `block_start` None: the row prefix sums only."""
    lane = cute.arch.lane_idx()
    row_carry = Int32(0)
    block_carry = Int32(0)
    for base in cutlass.range(0, num_experts, 32):
        e = base + lane
        count = Int32(0)
        if e < num_experts:
            count = expert_count[e]
        row_incl = warp_inclusive_sum(count)
        block_incl = Int32(0)
        if cutlass.const_expr(block_start is not None):
            block_incl = warp_inclusive_sum(ceil_div_small(count, block_m))
        if e < num_experts:
            row_start[e + 1] = row_carry + row_incl
            if cutlass.const_expr(block_start is not None):
                block_start[e + 1] = block_carry + block_incl
        row_carry += cute.arch.shuffle_sync(row_incl, 31)
        if cutlass.const_expr(block_start is not None):
            block_carry += cute.arch.shuffle_sync(block_incl, 31)
    if lane == 0:
        row_start[0] = 0
        if cutlass.const_expr(block_start is not None):
            block_start[0] = 0


@cute.jit
def expert_of_row(row_start: cute.Tensor, row: Int32, num_experts: cutlass.Constexpr) -> Int32:
    """The expert e with row_start[e] <= row < row_start[e + 1] (binary search; empty experts
    have equal bounds and are never returned)."""
    lo = Int32(0)
    hi = Int32(num_experts)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if row_start[mid] <= row:
            lo = mid
        else:
            hi = mid
    return lo


def gmem_vector(address: Int64, dtype, length: int) -> cute.Tensor:
    """`length` elements of `dtype` at a global `address` aligned to their size (one vector
    access when it is 4, 8 or 16 bytes)."""
    return cute.make_tensor(
        cute.make_ptr(dtype, address, cute.AddressSpace.gmem,
                      assumed_align=length * dtype.width // 8),
        cute.make_layout(length))


@cute.jit
def copy_row_in_registers(src_row: Int64, dst_row: Int64, lane: Int32,
                          row_bytes: cutlass.Constexpr,
                          unroll: cutlass.Constexpr = ROW_COPY_UNROLL):
    """The calling warp copies `row_bytes` (a multiple of 16, both rows 16-byte aligned): every
    lane loads `unroll` 16-byte vectors, then stores them. Plain stores: a caller writing
    a peer's memory publishes them with a barrier."""
    vecs = row_bytes // 16
    for grp in cutlass.range_constexpr(-(-vecs // (32 * unroll))):
        regs = []
        for u in cutlass.range_constexpr(unroll):
            i = (grp * unroll + u) * 32 + lane
            r = cute.make_rmem_tensor((4,), Int32)
            if i < vecs:
                cute.autovec_copy(gmem_vector(src_row + Int64(i) * 16, Int32, 4), r)
            regs.append(r)
        for u in cutlass.range_constexpr(unroll):
            i = (grp * unroll + u) * 32 + lane
            if i < vecs:
                cute.autovec_copy(regs[u], gmem_vector(dst_row + Int64(i) * 16, Int32, 4))


class BulkRowPipeline:
    """Chunked bulk copies of rows through per-warp shared-memory stages (see module doc).

    Job q (a chunk) goes through stage q % NUM_STAGES: its load is issued at `push(q)` and its
    store at `push(q + LOOKAHEAD)` (or `drain`), so LOOKAHEAD loads are in flight per warp while
    stores proceed. Each warp owns `NUM_STAGES` staging buffers, mbarriers, and a small table of
    pending destinations (`pending_dst`, `pending_bytes`), all in shared memory.
    """

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes
        self.num_chunks = -(-row_bytes // MAX_CHUNK_BYTES)
        self.chunk_bytes = -(-row_bytes // self.num_chunks // 16) * 16
        self.stage_bytes = NUM_STAGES * self.chunk_bytes

    def chunk_size(self, c: int) -> int:
        return min(self.chunk_bytes, self.row_bytes - c * self.chunk_bytes)

    def check_fits(self, num_warps: int) -> None:
        """Raise ``ValueError`` when ``num_warps`` warps' staging exceeds shared memory."""
        if num_warps * self.stage_bytes > STAGING_BUDGET:
            raise ValueError(f"num_threads: {num_warps} warps x {self.stage_bytes} bytes of "
                             f"row staging exceed {STAGING_BUDGET} bytes of shared memory")

    def allocate(self, smem, num_warps: int):
        """Every warp's mbarriers, staging buffers and pending-store table (destination, size
        per stage) in shared memory."""
        mbar = smem.allocate_array(Int64, num_warps * NUM_STAGES)
        pending_dst = smem.allocate_tensor(Int64, cute.make_layout((NUM_STAGES, num_warps)))
        pending_bytes = smem.allocate_tensor(Int32, cute.make_layout((NUM_STAGES, num_warps)))
        staging = smem.allocate_array(Uint8, num_warps * self.stage_bytes, byte_alignment=128)
        return mbar, staging, pending_dst, pending_bytes

    def for_warp(self, storage, warp: Int32):
        """This warp's (mbarriers, staging, pending destinations, pending sizes)."""
        mbar, staging, pending_dst, pending_bytes = storage
        return (mbar + warp * NUM_STAGES, staging + warp * self.stage_bytes,
                pending_dst[None, warp], pending_bytes[None, warp])

    @cute.jit
    def init_barriers(self, mbar: cute.Pointer, lane: Int32):
        """Lane 0 initializes the warp's stage barriers (`mbar` from `for_warp`); the CTA must
        fence (`mbarrier_init_fence`) and sync before use."""
        if lane == 0:
            for s in cutlass.range_constexpr(NUM_STAGES):
                cute.arch.mbarrier_init(mbar + s, 1)

    @cute.jit
    def push(self, job: Int32, src: Int64, dst: Int64, nbytes: Int32, mbar: cute.Pointer,
             staging: cute.Pointer, pending_dst: cute.Tensor, pending_bytes: cute.Tensor):
        """Lane 0: issue the load of chunk `job` (src -> its stage) and the store of chunk
        `job - LOOKAHEAD`. Returns `job + 1`."""
        stage = job % NUM_STAGES
        if job >= NUM_STAGES:
            # the last store issued is chunk job - NUM_STAGES, the previous user of this stage
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        pending_dst[stage] = dst
        pending_bytes[stage] = nbytes
        cute.arch.mbarrier_arrive_and_expect_tx(mbar + stage, nbytes)
        prims.cp_async_bulk_shared_cluster_global(
            staging + stage * self.chunk_bytes,
            cute.make_ptr(Uint8, src, cute.AddressSpace.gmem, assumed_align=16),
            mbar + stage, nbytes)
        if job >= LOOKAHEAD:
            self.store(job - LOOKAHEAD, mbar, staging, pending_dst, pending_bytes)
        return job + 1

    @cute.jit
    def push_row(self, job: Int32, src_row: Int64, dst_row: Int64, mbar: cute.Pointer,
                 staging: cute.Pointer, pending_dst: cute.Tensor, pending_bytes: cute.Tensor):
        """Lane 0: `push` every chunk of one row. Returns the new `job`."""
        for c in cutlass.range_constexpr(self.num_chunks):
            job = self.push(job, src_row + c * self.chunk_bytes, dst_row + c * self.chunk_bytes,
                            Int32(self.chunk_size(c)), mbar, staging, pending_dst,
                            pending_bytes)
        return job

    @cute.jit
    def drain(self, job: Int32, mbar: cute.Pointer, staging: cute.Pointer,
              pending_dst: cute.Tensor, pending_bytes: cute.Tensor):
        """Lane 0: store the chunks still in flight and wait until every store has completed."""
        first = job - LOOKAHEAD if job >= LOOKAHEAD else Int32(0)
        for q in cutlass.range(first, job):
            self.store(q, mbar, staging, pending_dst, pending_bytes)
        cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def store(self, job: Int32, mbar: cute.Pointer, staging: cute.Pointer,
              pending_dst: cute.Tensor, pending_bytes: cute.Tensor):
        stage = job % NUM_STAGES
        cute.arch.mbarrier_wait(mbar + stage, (job // NUM_STAGES) % 2)
        prims.cp_async_bulk_global_shared_cta(
            cute.make_ptr(Uint8, pending_dst[stage], cute.AddressSpace.gmem, assumed_align=16),
            staging + stage * self.chunk_bytes, pending_bytes[stage])
        cute.arch.cp_async_bulk_commit_group()
