"""Hopper (sm_90a) grouped GEMMs over the expert pool with MXFP4 weights decoded into the WGMMA's
register operand: the weights are the MMA's A (M = 64 weight rows), the pool rows its B (N =
BLOCK_M tokens). Recipe ``fp8xfp4_sm90``, BLOCK_M 64, for decode sizes. An A/B variant
(`CUTE_MEGAMOE_SM90_SWAP_AB`): on an H200 it took 1.31-1.36x the staged kernel's time, bound by
instruction issue (docs/performance.md, FP4 section).

What it computes: exactly what `sm90_expert_gemm.Sm90ExpertGemmKernel` computes for the recipe
(L1 with the SwiGLU epilogue and the FP8 requantization per 128 features, or L2 with BF16 rows
into ``out`` or the source ranks' combine buffers), bit for bit: the same e4m3 weights
``e4m3(e2m1 * 2**(s - b))``, the same FP32 partial sums per 128-deep k-block (a transposed
WGMMA sums the same products), the same promotion ``acc += part * (sa[row] * sb[block])`` and
the same epilogue arithmetic.

Why: at decode sizes (a handful of tokens per expert) the staged kernel's m64n256 WGMMAs compute
64 rows of which a few are tokens, and its decode warps write every weight tile into shared
memory for the WGMMA to read back. Transposed, a k-block of a 256 x 64 tile is 4 x 4 m64n64k32
WGMMAs (a quarter of the tensor-core time), and each consumer thread decodes the codes of its
own A fragment in registers: no decoded tile in shared memory, no decode warps, no barrier
between decode and MMA. The cost: every lane of a quad builds its own table per (row, 32-group)
(4x the staged decode's tables) and the promotion scale is per token and row.

How: a persistent, warp-specialized kernel on the staged kernel's two rings and tile walk
(`ExpertTileScheduler`). Warp 0 TMA-loads the activation tile (64 pool rows x 128 K, the MMA's
B) and the scale vectors into the MMA stages; warp 1 the packed weight chunks (128 rows x 64
bytes each, 64-byte swizzle: the lanes' 4-byte reads are conflict-free), their per-32 scale
words and the block scales into the packed stages. Consumer warpgroup ``w`` owns weight rows
``64 w .. 64 w + 63`` of the tile (one m64 block; four warpgroups for a 256-row tile, 640
threads). Per k-block a thread reads, for its rows ``r0 = 16 * warp + lane / 4`` and ``r0 +
8``, word ``lane % 4`` of each 32-code group (`quant.SM90_GROUP_ORDER`: the codes of the
k-columns its A fragment holds), decodes it with its group's table (`common.fp4_decode`; the
integer-add tables unless a warp vote finds a group 6+ binades under its block's base) into the
fragment's registers, issues the four m64n64k32 WGMMAs, waits for them and promotes. The
m64n64 accumulator value ``c + 2 r + 4 j`` of a thread is weight row ``r0 + 8 r`` and token
``8 j + 2 (lane % 4) + c``; in L1 the weight rows interleave gate and up by 8
(``quant.interleave_gate_up``), so ``r = 0`` is the gate and ``r = 1`` the up row of one
feature: SwiGLU is thread-local. The epilogue writes the tile transposed into shared-memory rows
per token (L1: the token amax over the tile's 128 features meets over shared memory across the
consumer warps), and 64 consumer threads send the valid tokens' rows with one 1-D bulk copy
each.

Constraints: ``fp8xfp4_sm90``, BLOCK_M 64, ``N`` a multiple of 256 for L1 (of 128 for L2: a
128-row tile has two consumer warpgroups), ``K`` a multiple of 128; no clusters; not in the
fused kernel.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float8E4M3FN, Float32, Int32, Int64, Uint8
from cutlass.cute.nvgpu import cpasync, warpgroup

from .common.fp4_decode import (
    FAST_MIN_SHIFT,
    LUT_HI,
    LUT_LO,
    LUT_STEP_HI,
    LUT_STEP_LO,
    decode_e2m1_word,
    e2m1_table,
    prmt,
)
from .common.gemm_config import SF_BLOCK
from .common.pool import build_pool_prefix
from .common.transposed_epilogue import TransposedEpilogue
from .sm90_expert_gemm import (
    MAX_STAGES,
    STAGING_PAD,
    WG_N,
    Sm90ExpertGemmKernel,
)

# setmaxnreg: 640 threads launch with 96 registers each: 128 x 24 + 512 x 112 = 60416 of 61440
PRODUCER_REGS, MAX_CONSUMER_REGS = 24, 232
K_GROUPS = 4  # 32-code groups (one k32 WGMMA each) of a 128-deep k-block
PACKED_SWIZZLE = 64  # bytes: a packed row is one 64-byte swizzle row (16-byte units ^ row/2 % 4)


class Sm90SwapABExpertGemmKernel(TransposedEpilogue, Sm90ExpertGemmKernel):
    """One grouped GEMM of the expert FFN with MXFP4 weights in the WGMMA's register operand (see
    module doc)."""

    def __init__(self, phase: str, recipe: str, num_experts: int, num_pool_rows: int, n: int,
                 k: int, block_m: int, activation_clamp: float | None = None,
                 fast_math: bool = True, num_stages: int | None = None,
                 raster_group: int | None = None, combine_layout=None):
        if recipe != "fp8xfp4_sm90" or block_m != 64:
            raise ValueError(f"swap_ab: recipe fp8xfp4_sm90 at BLOCK_M 64 only, got {recipe!r} "
                             f"at {block_m}")
        super().__init__(phase, recipe, num_experts, num_pool_rows, n, k, block_m,
                         activation_clamp=activation_clamp, fast_math=fast_math,
                         raster_group=raster_group, combine_layout=combine_layout)
        # a consumer warpgroup per 64 weight rows of the tile (one m64 block); no decode
        # warpgroups
        self.num_mma_wgs, self.wg_chunks, self.decode_wgs = self.block_n // 64, 1, 0
        self.num_threads = 128 * (1 + self.num_mma_wgs)
        # what the launch gives the CTA (`min_blocks_per_mp=1`), split by setmaxnreg
        launch_regs = min(255, 65536 // self.num_threads) // 8 * 8
        self.producer_regs = PRODUCER_REGS
        self.consumer_regs = min(MAX_CONSUMER_REGS, (self.num_threads * launch_regs
                                                     - 128 * PRODUCER_REGS)
                                 // (128 * self.num_mma_wgs) // 8 * 8)
        self.wg_skew = 0
        # the epilogue's rows, one per token: the tile's part of its output row
        self.staging_stride = self.tile_row_bytes + STAGING_PAD
        self.staging_bytes = block_m * self.staging_stride
        # L1: per-warp token amaxes, then the tile's
        self.exchange_len = (4 * self.num_mma_wgs + 1) * block_m
        left = self.smem_budget - self.staging_bytes - 4 * self.exchange_len - 1024
        fit = min(MAX_STAGES, left // (self.stage_tx_bytes + 64 + self.packed_tx_bytes + 16))
        self.num_stages = fit if num_stages is None else num_stages
        if not 2 <= self.num_stages <= fit:
            raise ValueError(f"num_stages must be in [2, {fit}], got {num_stages}")
        self.packed_stages = self.num_stages

    # ------------------------------------------------------------------------------ host side
    def mma_and_stage_layouts(self):
        """The consumer warpgroups' register-A WGMMA (m64 weight rows x BLOCK_M tokens) and the
        activation tiles' layout (the MMA's B; the second value stands in for the staged
        kernel's weight layout)."""
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(64, self.block_m),
            a_source=warpgroup.OperandSource.RMEM)
        a_layout = self._smem_layout(self.block_m, self.num_stages)
        return tiled_mma, a_layout, a_layout

    def raw_b_layout(self):
        """The packed weight chunks as TMA writes them, ``[128 rows, 64 bytes, packed stage *
        chunks + chunk]``, 64-byte swizzled."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, Uint8)
        return cute.tile_to_shape(atom, (WG_N, self.b_load_k(), self.packed_stages * self.chunks),
                                  order=(0, 1, 2))

    def packed_pipeline(self, barriers: cute.Pointer):
        """The packed stages' pipeline: TMA in, every consumer warp frees them."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers, num_stages=self.packed_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     4 * self.num_mma_wgs),
            tx_count=self.packed_ring_tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True)

    @cute.jit
    def __call__(
        self,
        a: cute.Pointer,  # [P, K] e4m3: the L1 or L2 pool
        a_sf: cute.Pointer,  # f32 [K/128, P]
        b: cute.Pointer,  # [E, N, K/2] packed e2m1 (sm_90a group order)
        b_sf: cute.Pointer,  # f32 [E, K/128, weight_sf_row_len(N)]: block scales 2**b
        expert_recv_tokens: cute.Pointer,  # Int32 [E]
        topk_weights: cute.Pointer,  # f32 [P] (l1)
        out: cute.Pointer,  # l1: e4m3 [P, N/2]; l2: bf16 [P, N] (unless to_combine)
        out_sf: cute.Pointer,  # f32 [N/256, P] (l1)
        peer_bases: cute.Pointer,  # Int64 [R]: the symmetric buffers (to_combine)
        src_metadata: cute.Pointer,  # Int32 [P, 4]: (rank, token, slot, 0) (to_combine)
        b_group_sf: cute.Pointer,  # Int32 [E, K/128, N]: UE8M0 per 32
        num_ctas: Int32,
        stream,
    ):
        tiled_mma, a_layout, _ = self.mma_and_stage_layouts()
        tma_a, tma_m_a, tma_b, tma_m_b = self.tma_loads(a, b, a_layout, a_layout)
        raw_b_layout = self.raw_b_layout()

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, self.num_stages * 2]
            packed_mbar: cute.struct.MemRange[Int64, self.packed_stages * 2]
            block_start: cute.struct.MemRange[Int32, self.num_experts + 1]
            row_start: cute.struct.MemRange[Int32, self.num_experts + 1]
            sfa: cute.struct.Align[
                cute.struct.MemRange[Float32, self.num_stages * self.sfa_stride], 16]
            sfb: cute.struct.Align[
                cute.struct.MemRange[Float32, self.num_stages * self.sfb_stride], 16]
            sa: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(a_layout)],
                                  1024]
            raw_b: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(raw_b_layout)],
                                     1024]
            staging: cute.struct.Align[cute.struct.MemRange[Uint8, self.staging_bytes], 128]
            sfg: cute.struct.Align[cute.struct.MemRange[Int32, self.sfg_len()], 16]
            sfb_packed: cute.struct.Align[cute.struct.MemRange[
                Float32, self.packed_stages * self.packed_sfb_stride], 16]
            exchange: cute.struct.Align[cute.struct.MemRange[Float32, self.exchange_len], 16]

        self.shared_storage = SharedStorage
        self.kernel(tiled_mma, tma_a, tma_m_a, tma_b, tma_m_b, a_layout, raw_b_layout, a_sf,
                    b_sf, cute.make_tensor(expert_recv_tokens, cute.make_layout(self.num_experts)),
                    topk_weights, out, out_sf, peer_bases, src_metadata, b_group_sf).launch(
            grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], cluster=[1, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    # ---------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, m_a: cute.Tensor,
               tma_b: cute.CopyAtom, m_b: cute.Tensor, a_layout: cute.ComposedLayout,
               raw_b_layout: cute.ComposedLayout, a_sf: cute.Pointer, b_sf: cute.Pointer,
               expert_recv_tokens: cute.Tensor, topk_weights: cute.Pointer, out: cute.Pointer,
               out_sf: cute.Pointer, peer_bases: cute.Pointer, src_metadata: cute.Pointer,
               b_group_sf: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        raster_group = Int32(self.raster_group)
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        block_start, row_start, sfa, sfb, sa = self.stage_tensors(storage, a_layout)
        raw_b = storage.raw_b.get_tensor(raw_b_layout.outer, swizzle=raw_b_layout.inner)

        ab_pipe = self.mma_pipeline(storage.mbar.data_ptr())
        packed_pipe = self.packed_pipeline(storage.packed_mbar.data_ptr())
        if warp == 0:
            build_pool_prefix(expert_recv_tokens, row_start, block_start, self.num_experts,
                              self.block_m)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        num_tiles = self.scheduler.num_tiles(block_start)
        wg = warp // 4
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self.producer_warps(warp, lane, tma_a, m_a, tma_b, tma_b, m_b, sa, raw_b, sfa, sfb,
                                a_sf, b_sf, b_group_sf, storage, ab_pipe, packed_pipe,
                                block_start, row_start, num_tiles, bidx, grid, raster_group,
                                Int32(0))
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume_transposed(
                tiled_mma, sa, sfa, sfb, storage.raw_b.data_ptr(), storage.sfg.data_ptr(),
                ab_pipe, packed_pipe, block_start, row_start, num_tiles, bidx, grid,
                raster_group, wg - 1, warp % 4, lane, topk_weights, out, out_sf, peer_bases,
                src_metadata, storage.staging.data_ptr(), storage.exchange.data_ptr())

    @cute.jit
    def consume_transposed(self, tiled_mma, sa, sfa, sfb, raw_b: cute.Pointer,
                           sfg: cute.Pointer, ab_pipe, packed_pipe, block_start, row_start,
                           num_tiles: Int32, first_tile: Int32, num_clusters: Int32,
                           raster_group: Int32, mma_wg: Int32, warp_in_wg: Int32, lane: Int32,
                           topk_weights: cute.Pointer, out: cute.Pointer, out_sf: cute.Pointer,
                           peer_bases: cute.Pointer, src_metadata: cute.Pointer,
                           staging: cute.Pointer, exchange: cute.Pointer):
        """Consumer warpgroup ``mma_wg``: weight rows ``[64 mma_wg, 64 mma_wg + 64)`` (the m64
        block ``mma_wg % 2`` of chunk ``mma_wg / 2``) of tiles ``first_tile``, ``first_tile +
        num_clusters``, ... ``< num_tiles`` (see module doc)."""
        thr_mma = tiled_mma.get_slice(warp_in_wg * 32 + lane)
        t_rb = tiled_mma.make_fragment_B(thr_mma.partition_B(sa))  # [.., .., k32, stage]
        frag = thr_mma.make_fragment_A(thr_mma.partition_shape_A((64, self.block_k)))
        # word r + 2 h + 4 g of the fragment: row r0 + 8 r, columns 16 h + 4 (lane % 4) .. of
        # the k-block's 32-group g
        frag_words = cute.recast_tensor(frag, Int32)
        acc_shape = thr_mma.partition_shape_C((64, self.block_m))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        part = cute.make_rmem_tensor(acc_shape, Float32)
        tables = cute.make_rmem_tensor(4 * K_GROUPS, Int32)  # (lo, hi) of (row r, group g)
        quad = lane % 4
        chunk = mma_wg // 2
        row0 = 64 * (mma_wg % 2) + 16 * warp_in_wg + lane // 4  # chunk-local, and row0 + 8
        # the thread's word of group g of a packed row, 64-byte swizzle: the row's 16-byte unit
        # g lies at unit g ^ (row / 2 % 4), the same for both rows of the thread
        unit_xor = (row0 >> 1) & 3
        row_words = self.b_load_k() // 4
        packed_words = cute.make_tensor(cute.recast_ptr(raw_b, dtype=Int32), cute.make_layout(
            self.packed_stages * self.chunks * WG_N * row_words))
        up_block = self.n // (2 * SF_BLOCK)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.num_stages)
        packed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                              self.packed_stages)
        ctid = mma_wg * 128 + warp_in_wg * 32 + lane  # the consumer thread's index
        tile = first_tile
        owner = Int32(0)
        while tile < num_tiles:
            owner, _e, _m, n_block, pool_block, valid_m = self.scheduler.tile(
                tile, owner, block_start, row_start, raster_group, Int32(0))
            row_base = pool_block * self.block_m
            acc.fill(0.0)
            for _kb in cutlass.range(self.num_k_blocks):
                ab_pipe.consumer_wait(ab_state)
                packed_pipe.consumer_wait(packed)
                stage = ab_state.index
                # the weight block scales of the thread's rows (L1: r = 0 gate, r = 1 up)
                if cutlass.const_expr(self.phase == "l1"):
                    row_sb = (sfb[n_block, stage], sfb[up_block + n_block, stage])
                else:
                    blk = sfb[self.chunks * n_block + chunk, stage]
                    row_sb = (blk, blk)
                group_words = cute.make_tensor(sfg + packed.index * self.block_n + chunk * WG_N,
                                               cute.make_layout(WG_N))
                slot_word0 = (packed.index * self.chunks + chunk) * WG_N * row_words
                # the groups' exponent shifts over their block's base; the tables by two
                # integer adds unless a group of the warp lies 6+ binades under its base
                shifts = []
                lowest = Int32(0)
                for r in cutlass.range_constexpr(2):
                    base = (row_sb[r].bitcast(Int32) >> 23) & 0xFF
                    scales = group_words[row0 + 8 * r]
                    for g in cutlass.range_constexpr(K_GROUPS):
                        shifts.append(prmt(scales, Int32(0), Int32(0x4440 + g)) - base)
                        lowest = cutlass.min(lowest, shifts[-1])
                if cute.arch.vote_any_sync(lowest < FAST_MIN_SHIFT):
                    for i in cutlass.range_constexpr(2 * K_GROUPS):
                        tables[2 * i], tables[2 * i + 1] = e2m1_table(shifts[i])
                else:
                    for i in cutlass.range_constexpr(2 * K_GROUPS):
                        tables[2 * i] = Int32(LUT_LO) + shifts[i] * Int32(LUT_STEP_LO)
                        tables[2 * i + 1] = Int32(LUT_HI) + shifts[i] * Int32(LUT_STEP_HI)
                for r in cutlass.range_constexpr(2):
                    for g in cutlass.range_constexpr(K_GROUPS):
                        word = packed_words[slot_word0 + (row0 + 8 * r) * row_words
                                            + (g ^ unit_xor) * 4 + quad]
                        i = r * K_GROUPS + g
                        frag_words[r + 4 * g], frag_words[r + 2 + 4 * g] = decode_e2m1_word(
                            word, tables[2 * i], tables[2 * i + 1])
                warpgroup.fence()
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                for g in cutlass.range_constexpr(K_GROUPS):
                    cute.gemm(tiled_mma, part, frag[(None, None, g)],
                              t_rb[(None, None, g, stage)], part)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(ab_state)
                packed_pipe.consumer_release(packed)
                # promotion: value c + 2 r + 4 j is row r0 + 8 r, token 8 j + 2 quad + c
                for j in cutlass.range_constexpr(self.block_m // 8):
                    for c in cutlass.range_constexpr(2):
                        sa_tok = sfa[8 * j + 2 * quad + c, stage]
                        for r in cutlass.range_constexpr(2):
                            i = c + 2 * r + 4 * j
                            acc[i] += part[i] * (sa_tok * row_sb[r])
                ab_state.advance()
                packed.advance()
            # (acc value c + 2 r + 4 j: row r0 + 8 r, token 8 j + 2 quad + c)
            self.epilogue_transposed(
                lambda _i, j, r, c: acc[c + 2 * r + 4 * j], [mma_wg], topk_weights, out,
                out_sf, peer_bases, src_metadata, staging, exchange, row_base, n_block, valid_m,
                4 * mma_wg + warp_in_wg, 4 * self.num_mma_wgs, lane, ctid)
            tile += num_clusters
        if ctid < self.block_m:
            cute.arch.cp_async_bulk_wait_group(0)
