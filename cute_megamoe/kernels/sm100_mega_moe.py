"""The whole Mega MoE layer on Blackwell (sm_100a) in one persistent launch per rank.

What it computes, on every rank of an R-rank group (all ranks launch it once per call, with
this rank's staged inputs in the symmetric buffer, `kernels/staging.py`):

    y = combine(L2(SwiGLU(L1(dispatch(x, topk_idx)))))

meant to be bit-identical to the staged layer on sm_100a (`staged.staged_mega_moe` with
`ExpertWeights` and `l2_sends=True`: the same dispatch, grouped GEMMs
(`sm100_expert_gemm`), epilogues and reduction, run as phases of one kernel), for `fp8xfp4`
(e4m3 tokens x e2m1 weights, UE8M0 scales per 32 K) and `bf16xbf16`. Compiled and SASS-checked
only: not run on a Blackwell GPU yet.

How: one CTA per SM (a CTA pair per two SMs at BLOCK_M 256), 192 threads (the warp roles of
`sm100_expert_gemm`: warps 0-3 epilogue, warp 4 MMA, warp 5 TMA), launched cooperatively.
1. Dispatch (every thread, `DispatchKernel.run`, push transfer): count, prefix, scatter,
   publish the counts, push the rows into the destinations' pools, meet the other ranks. It
   leaves this rank's pool prefix sums in shared memory; a grid barrier then tells every CTA
   that the pool is complete.
2. Grouped GEMMs, warp-specialized as `sm100_expert_gemm`: one walk over the L1 tiles followed
   by the L2 tiles (CTA pair c takes tiles c, c + G, ... of the concatenation, G the number of
   pairs (of CTAs at BLOCK_M 64 / 128), `scheduler.host_model.fused_tile_walk`, the same
   function as the Hopper kernel's), through one ring of stages and one pair of TMEM
   accumulators (`sm100_expert_gemm.share_ring`); each warp role carries its pipeline state
   from L1 into L2, so a CTA's first L2 tiles load while its last L1 tiles still compute.
   - warp 5 TMA-loads tokens, weights and (block-scaled) both scale chunks per k-block;
   - warp 4 copies the scales to tensor memory (UTCCP) and issues the tcgen05 MMAs
     (``kind::mxf8f6f4.block_scale`` or ``kind::f16``; 2-CTA at BLOCK_M 256) into one of the
     two accumulators;
   - warps 0-3 read the accumulator (``tcgen05.ld``) and run the L1 SwiGLU + requant (into the
     L2 pool and its scales) or the L2 BF16 cast straight into the source ranks' combine
     buffers over NVLink.
   An L2 tile waits only for the L1 tiles of its own pool block: every epilogue warp adds 1 to
   the block's counter in `pool_block_ready` once its rows of an L1 tile are stored (release
   at GPU scope after a warp sync), and the L2 TMA warp acquires it (and fences the async
   proxy) before its loads. L1 tiles wait for nothing, and every CTA walks its L1 tiles before
   its L2 tiles, so the waits always end.
3. Combine (every thread, `CombineKernel.send_and_reduce` in its "epilogue" mode): the split
   barriers meet the other ranks once every CTA's rows are delivered, then the top-k
   reduction in ascending k writes `y`.

Readiness counters are per call: every CTA zeroes its share at the start, and the grid
barriers of step 1 order that before any use; nothing else is reset.

Constraints: those of the three parts (`dispatch`: push transfer; `sm100_expert_gemm`: BLOCK_M
64, 128 or 256, `hidden` a multiple of 128 and `intermediate` of 128, `2 * intermediate` of
256 for `fp8xfp4`); the grid at most one CTA per SM (cooperative launch, and every CTA holds
its TMEM columns for the whole launch: `smem_bytes` is checked to exceed half an SM's shared
memory so that two CTAs can never share one), and at BLOCK_M 256 an even grid.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator, TmemAllocator

from ..config import Sm100GemmConfig
from ..layout.device import BufferRegions
from ..layout.mega_moe import MegaMoELayout
from .combine import CombineKernel
from .common.sync import grid_barrier, spin_timeout_ns
from .dispatch import DispatchKernel
from .sm100_expert_gemm import (
    EPILOGUE_SYNC_BARRIER,
    EPILOGUE_WARPS,
    MMA_WARP,
    NUM_ACC_STAGES,
    NUM_THREADS,
    SM_SMEM_CAPACITY,
    SMEM_CAPACITY,
    SMEM_RESERVED,
    TMA_WARP,
    TMEM_ALLOC_BARRIER,
    Sm100ExpertGemmKernel,
    share_ring,
)

RECIPES = ("fp8xfp4", "bf16xbf16")


class Sm100MegaMoEKernel:
    """The fused layer for one rank on sm_100a (see the module docstring), built from the
    buffer's ``layout`` and its GEMMs' complete `config.Sm100GemmConfig`. ``has_stats``: the
    call counts its pairs into ``stats``."""

    def __init__(self, layout: MegaMoELayout, config: Sm100GemmConfig,
                 activation_clamp: float | None = None, fast_math: bool = True,
                 has_stats: bool = False):
        if layout.recipe not in RECIPES:
            raise ValueError(f"recipe: the sm_100a fused kernel runs {RECIPES}, got "
                             f"{layout.recipe!r}")
        if not isinstance(config, Sm100GemmConfig):
            raise TypeError(f"config: an Sm100GemmConfig, got {type(config).__name__}")
        config.check_complete(type(self).__name__)
        self.config = config
        block_m = config.block_m
        self.layout = layout
        self.regions = BufferRegions(layout)
        self.block_m = block_m
        self.num_threads = NUM_THREADS
        self.num_ranks = layout.num_ranks
        self.num_local_experts = layout.num_local_experts
        self.num_pool_blocks = layout.num_pool_rows // block_m
        self.dispatch = DispatchKernel(layout, block_m, num_threads=self.num_threads,
                                       has_stats=has_stats, transfer="push")
        self.combine = CombineKernel(layout, block_m, num_threads=self.num_threads,
                                     send_mode="epilogue")
        reserved = self.dispatch.smem_bytes()
        e_l, p = layout.num_local_experts, layout.num_pool_rows
        h, inter = layout.hidden, layout.intermediate_hidden
        self.l1 = Sm100ExpertGemmKernel("l1", layout.recipe, e_l, p, 2 * inter, h, config,
                                        activation_clamp=activation_clamp, fast_math=fast_math,
                                        smem_reserved=reserved)
        self.l2 = Sm100ExpertGemmKernel("l2", layout.recipe, e_l, p, h, inter, config,
                                        fast_math=fast_math, combine_layout=layout,
                                        smem_reserved=reserved)
        share_ring(self.l1, self.l2)
        self.num_stages = self.l1.num_stages
        self.cluster_size = self.l1.cluster_size
        self.cluster_m = self.cluster_size  # (the name the launcher reads, as on sm_90a)
        self.cluster_shape_mn = self.l1.cluster_shape_mn
        if self.smem_bytes() > SMEM_CAPACITY:
            raise ValueError(f"the fused kernel needs {self.smem_bytes()} bytes of shared "
                             f"memory, more than a CTA may have ({SMEM_CAPACITY})")
        # one CTA per SM, a checked invariant (see the module docstring)
        assert self.smem_bytes() - SMEM_RESERVED > SM_SMEM_CAPACITY // 2
        self.timeout_ns = spin_timeout_ns()

    # ------------------------------------------------------------------------------ host side
    def pointer_args(self) -> tuple[tuple[str, object], ...]:
        """``(name, CuTe dtype)`` of the pointer arguments of ``__call__``, in order (the
        launcher and the compile tests build them from this; the sm_100a dtypes of
        `launch.gemm_kernel`). ``l2_acts_sf`` is both the L1 epilogue's scale output (written
        as bytes) and the L2 input's scales. The scale pointers of ``bf16xbf16`` are never
        dereferenced."""
        from cutlass import BFloat16, Float4E2M1FN, Float8E4M3FN, Float8E8M0FNU

        if self.layout.recipe == "fp8xfp4":
            act, act_sf, w, w_sf = Float8E4M3FN, Float8E8M0FNU, Float4E2M1FN, Float8E8M0FNU
        else:
            act, act_sf, w, w_sf = BFloat16, Float32, BFloat16, Float32
        return (("peer_bases", Int64), ("expert_recv_tokens", Int32), ("stats", Int32),
                ("l1_acts", act), ("l1_acts_sf", act_sf), ("l1_topk_weights", Float32),
                ("l2_acts", act), ("l2_acts_sf", act_sf), ("token_src_metadata", Int32),
                ("w1", w), ("w1_sf", w_sf), ("w2", w), ("w2_sf", w_sf),
                ("pool_block_ready", Int32), ("phase_clock", Int64), ("tile_log", Int32),
                ("y", BFloat16))

    def smem_bytes(self, num_stages: int | None = None) -> int:
        """Shared memory of one CTA with ``num_stages`` ring stages (default: the kernel's), an
        upper bound: barriers and alignment padding included (``SMEM_RESERVED``)."""
        return ((num_stages or self.num_stages) * self.l1.stage_bytes
                + self.dispatch.smem_bytes() + SMEM_RESERVED)

    def ring_arrivals(self) -> dict[str, int]:
        """The arrival counts the kernel's barriers are built with: the ring's producer and
        consumer (one elected thread each: the TMA warp's expect-tx arrival, the MMA warp's
        commit), the accumulators' (the MMA commit; every epilogue thread of the CTA pair),
        and the readiness count an L2 tile waits for."""
        return {"ab_producer": 1, "ab_consumer": 1, "acc_producer": 1,
                "acc_consumer": self.l1.acc_consumer_arrivals(),
                "ready": self.l2.waits_ready}

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
        w1: cute.Pointer,  # [E_l, 2I, H] (fp8xfp4: packed e2m1) and its scales (sm100 layout)
        w1_sf: cute.Pointer,
        w2: cute.Pointer,  # [E_l, H, I]
        w2_sf: cute.Pointer,
        pool_block_ready: cute.Pointer,  # Int32 [P / BLOCK_M], per-call readiness counters
        phase_clock: cute.Pointer,  # (the sm_90a kernel's diagnostics: the same arguments,
        tile_log: cute.Pointer,  # so that one launcher serves both; unused here)
        y: cute.Pointer,  # BF16 [num_tokens, H]
        num_ctas: Int32,
        stream,
    ):
        l1, l2 = self.l1, self.l2
        l1._setup()
        l2._setup()
        tma_a1, m_a1, tma_b1, m_b1, sf1 = l1.tma_atoms(l1_acts, l1_acts_sf, w1, w1_sf)
        tma_a2, m_a2, tma_b2, m_b2, sf2 = l2.tma_atoms(l2_acts, l2_acts_sf, w2, w2_sf)
        # one transaction count for the ring: the stages of both phases have the same shape
        assert l1.stage_tx_bytes == l2.stage_tx_bytes
        self.stage_tx_bytes = l1.stage_tx_bytes
        self.shared_storage = l1._shared_storage(prefix=False)
        per_expert = cute.make_layout(self.num_local_experts)
        self.kernel(l1.tiled_mma, l1.cluster_layout_vmnk, l1.a_smem_layout, l1.b_smem_layout,
                    tma_a1, m_a1, tma_b1, m_b1, tma_a2, m_a2, tma_b2, m_b2, *sf1, sf2[1],
                    sf2[2], sf2[3], sf2[4], peer_bases, rank, num_tokens,
                    cute.make_tensor(expert_recv_tokens, per_expert),
                    cute.make_tensor(stats, per_expert), l1_topk_weights, l2_acts, l2_acts_sf,
                    token_src_metadata, pool_block_ready, y).launch(
            grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1],
            cluster=(*self.cluster_shape_mn, 1), min_blocks_per_mp=1, stream=stream,
            cooperative=True)

    # ---------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, cluster_layout_vmnk: cute.Layout,
               a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
               tma_a1: cute.CopyAtom, m_a1: cute.Tensor, tma_b1: cute.CopyAtom, m_b1: cute.Tensor,
               tma_a2: cute.CopyAtom, m_a2: cute.Tensor, tma_b2: cute.CopyAtom, m_b2: cute.Tensor,
               # block-scaled only (None for bf16xbf16): the L1 scale operands, then L2's
               tiled_mma_sfb, tma_sfa1, m_sfa1, tma_sfb1, m_sfb1, cluster_layout_sfb_vmnk,
               sfa_smem_layout, sfb_smem_layout, tma_sfa2, m_sfa2, tma_sfb2, m_sfb2,
               peer_bases_ptr: cute.Pointer, rank: Int32, num_tokens: Int32,
               expert_recv_tokens: cute.Tensor, stats: cute.Tensor,
               l1_topk_weights: cute.Pointer, l2_acts: cute.Pointer, l2_acts_sf: cute.Pointer,
               token_src_metadata: cute.Pointer, pool_block_ready: cute.Pointer,
               y: cute.Pointer):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        if warp == TMA_WARP:
            for atom in (tma_a1, tma_b1, tma_a2, tma_b2):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.l1.block_scaled):
                for atom in (tma_sfa1, tma_sfb1, tma_sfa2, tma_sfb2):
                    cpasync.prefetch_descriptor(atom)
        # the tile walk goes by CTA pairs at BLOCK_M 256 (the 2-CTA MMA), else by CTAs
        cta_in_pair = bidx % self.cluster_size
        is_leader = cta_in_pair == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cluster_layout_vmnk.get_flat_coord(cta_rank)
        first_tile = bidx // self.cluster_size
        tile_stride = grid // self.cluster_size
        peer_bases = cute.make_tensor(peer_bases_ptr, cute.make_layout(self.num_ranks))
        my_base = Int64(peer_bases[rank])
        barrier = self.regions.ptr(my_base, "barrier")

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.stage_tx_bytes, cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(), num_stages=NUM_ACC_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.l1.acc_consumer_arrivals()),
            cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=TMEM_ALLOC_BARRIER, num_threads=32 * (1 + len(EPILOGUE_WARPS))),
            allocator_warp_id=EPILOGUE_WARPS[0], is_two_cta=self.l1.use_2cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr)
        # the barriers exist (in both CTAs of a pair) before any copy or commit signals them
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        sa = storage.sa.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sb = storage.sb.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sf_load1 = sf_load2 = sf_mma = None
        if cutlass.const_expr(self.l1.block_scaled):
            ssfa = storage.ssfa.get_tensor(sfa_smem_layout)
            ssfb = storage.ssfb.get_tensor(sfb_smem_layout)
            coord_sfb = cluster_layout_sfb_vmnk.get_flat_coord(cta_rank)
            sf_load1 = (tiled_mma_sfb, tma_sfa1, m_sfa1, tma_sfb1, m_sfb1,
                        cluster_layout_sfb_vmnk, coord_sfb, ssfa, ssfb)
            sf_load2 = (tiled_mma_sfb, tma_sfa2, m_sfa2, tma_sfb2, m_sfb2,
                        cluster_layout_sfb_vmnk, coord_sfb, ssfa, ssfb)
            sf_mma = (ssfa, ssfb)
        acc_shape = tiled_mma.partition_shape_C(self.l1.mma_tiler[:2])
        t_acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, NUM_ACC_STAGES))

        # this call's readiness counters start at 0 (ordered before any use by the grid
        # barriers of the dispatch)
        i = bidx * self.num_threads + tidx
        while i < self.num_pool_blocks:
            cute.arch.store(pool_block_ready + i, Int32(0))
            i += grid * self.num_threads

        # 1. dispatch; after the grid barrier every CTA knows that CTA 0 has met the other
        # ranks, so every rank's rows are in this rank's pool
        row_start, block_start = self.dispatch.run(peer_bases, rank, num_tokens,
                                                   expert_recv_tokens, stats, smem)
        grid_barrier(barrier, grid, self.timeout_ns)

        # 2. L1 tiles then L2 tiles, one walk, one ring, one pair of accumulators
        l1_tiles = self.l1.scheduler.num_tiles(block_start)
        l2_tiles = self.l2.scheduler.num_tiles(block_start)
        if warp == TMA_WARP:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.num_stages)
            state, tile = self.l1.produce(
                tiled_mma, tma_a1, m_a1, tma_b1, m_b1, cluster_layout_vmnk, cluster_coord, sa,
                sb, sf_load1, ab_pipe, block_start, row_start, l1_tiles, first_tile,
                tile_stride, cta_in_pair, state)
            state, _ = self.l2.produce(
                tiled_mma, tma_a2, m_a2, tma_b2, m_b2, cluster_layout_vmnk, cluster_coord, sa,
                sb, sf_load2, ab_pipe, block_start, row_start, l2_tiles, tile - l1_tiles,
                tile_stride, cta_in_pair, state, pool_block_ready, barrier)
            ab_pipe.producer_tail(state)
        if warp == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                    self.num_stages)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     NUM_ACC_STAGES)
            ab_state, acc_state, tile = self.l1.mma(
                tiled_mma, sa, sb, sf_mma, t_acc_fake, acc_ptr, ab_pipe, acc_pipe, block_start,
                row_start, l1_tiles, first_tile, tile_stride, is_leader, ab_state, acc_state)
            ab_state, acc_state, _ = self.l2.mma(
                tiled_mma, sa, sb, sf_mma, t_acc_fake, acc_ptr, ab_pipe, acc_pipe, block_start,
                row_start, l2_tiles, tile - l1_tiles, tile_stride, is_leader, ab_state,
                acc_state)
            acc_pipe.producer_tail(acc_state)
        if warp < MMA_WARP:
            tmem.allocate(self.l1.num_tmem_cols)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            t_acc = cute.make_tensor(acc_ptr, t_acc_fake.layout)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 NUM_ACC_STAGES)
            # L1: h (and its scales) into the L2 pool; L2: rows into the combine buffers
            state, tile = self.l1.epilogue(
                t_acc, acc_pipe, block_start, row_start, l1_tiles, first_tile, tile_stride,
                cta_in_pair, tidx, l1_topk_weights, l2_acts, l2_acts_sf, peer_bases_ptr,
                token_src_metadata, state, pool_block_ready)
            self.l2.epilogue(
                t_acc, acc_pipe, block_start, row_start, l2_tiles, tile - l1_tiles, tile_stride,
                cta_in_pair, tidx, l1_topk_weights, l2_acts, l2_acts_sf, peer_bases_ptr,
                token_src_metadata, state)
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=EPILOGUE_SYNC_BARRIER,
                                  num_threads=32 * len(EPILOGUE_WARPS)).arrive_and_wait()
            tmem.free(acc_ptr)

        if cutlass.const_expr(self.cluster_size > 1):
            cute.arch.cluster_arrive()  # the peer's copies and commits into this CTA are over
            cute.arch.cluster_wait()

        # 3. combine: the rows are in the source ranks' combine buffers (plain stores of the
        # L2 epilogue, ordered by the split barrier's arrival); meet the other ranks, reduce
        self.combine.send_and_reduce(peer_bases, my_base, barrier, warp, lane, num_tokens,
                                     l1_topk_weights, row_start, block_start, y, None)
