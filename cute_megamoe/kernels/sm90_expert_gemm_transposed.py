"""Hopper (sm_90a) grouped GEMMs over the expert pool, transposed for decode sizes: the weight
tile is the WGMMA's A (M = 64 weight rows, from shared memory), the pool rows its B in 16-token
sub-blocks (N = 16), and only the sub-blocks that hold received tokens are computed. Recipes
``fp8xfp8`` and ``fp8xfp4_sm90``, BLOCK_M 64. The default for MXFP4 weights at up to 16
expected tokens per expert (`heuristics.select_sm90_transposed`: 0.78x the staged kernels' time
at 8 and 16 pairs per expert on an H200, 0.80x in the layer at 128 tokens); elsewhere an A/B
variant (`CUTE_MEGAMOE_SM90_TRANSPOSED`).

What it computes: exactly what `sm90_expert_gemm.Sm90ExpertGemmKernel` computes (L1 with the
SwiGLU epilogue and the FP8 requantization per 128 features, or L2 with BF16 rows into ``out``
or the source ranks' combine buffers), bit for bit: the same FP32 partial sums per 128-deep
k-block (a transposed WGMMA sums the same products), the same promotion ``acc += part * (sa[row]
* sb[block])`` and the staged epilogue's arithmetic (`common.transposed_epilogue`), GPU-checked.

Why: at decode sizes a pool block of 64 rows holds a handful of tokens. The staged kernel's
m64n256 WGMMAs compute all 64 rows, and its single consumer warpgroup waits for them and promotes
them in turn (with FP4 weights it took 0.74x the fp8xfp8 time even with the decode skipped:
docs/performance.md, FP4 section). Transposed, a k-block of a 256-row tile with up to 16 tokens is
4 x 4 m64n16k32 WGMMAs (a quarter of the tensor-core time) and 32 promotion FMAs per thread instead
of 128. The weights stay in shared memory, where the staged kernel's producer (FP8: TMA) or
decode warpgroups (FP4) put them, so the consumer decodes nothing. Decoding MXFP4 weights
into the WGMMA's register operand instead lost twice and is gone (docs/performance.md): a swap-AB
kernel (m64n64, 1.31-1.43x the staged time) and this kernel's consumers decoding their own
fragments (m64n16, two consumer warpgroups, no decode warps: 1.11-1.14x this kernel's time at
8-16 pairs per expert; both issue-bound).

How: the staged kernel's warps, rings, decode and tile walk unchanged; only the consumer warpgroup
differs, and the producer's A loads (``a_rows`` "received", the default: 16-row boxes, only those of
the sub-blocks below; "block": the staged kernel's one 64-row box). The ring's weight chunks (128
rows) are read as m64 blocks and its pool tile as 16-row sub-blocks: the same bytes, through views
of the same swizzled layout with smaller tiles (8 and 2 swizzle atoms). Per k-block, for each pair
of sub-blocks ``s < ceil(valid_m / 16)``: the four m64 blocks' WGMMAs (four k32 each) of both into
8-register scratch accumulators of their own, one wait, the promotions (so 17-32 tokens wait once
per k-block). Value ``c + 2 r + 4 j`` of an m64n16 accumulator is weight row ``16 warp + lane / 4 +
8 r`` of its block and token ``16 s + 8 j + 2 (lane % 4) + c``: in L1 the weight rows interleave
gate and up by 8 (``quant.interleave_gate_up``), so ``r = 0`` is the gate and ``r = 1`` the up row
of one feature and SwiGLU is thread-local. The epilogue writes the tile transposed into
shared-memory rows per token (L1: the token amax over the tile's 128 features meets over shared
memory across the four warps) and the first 64 threads send the valid tokens' rows with one 1-D bulk
copy each (`common.transposed_epilogue`).

Constraints: BLOCK_M 64, one consumer warpgroup, no clusters, ``N`` a multiple of 128 (256 for
L1), ``K`` a multiple of 128; not in the fused kernel.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float8E4M3FN, Float32, Int32, Int64, Uint8
from cutlass.cute.nvgpu import cpasync, warpgroup

from .common.fp4_decode import decode_e2m1_word, prmt, vote_tables
from .common.gemm_config import SF_BLOCK
from .common.pool import build_pool_prefix
from .common.transposed_epilogue import TransposedEpilogue
from .sm90_expert_gemm import MAX_STAGES, WG_N, Sm90ExpertGemmKernel

TOKEN_N = 16  # tokens of one transposed WGMMA (m64n16): a sub-block of the pool block
WEIGHT_M = 64  # weight rows of one transposed WGMMA (an m64 block of the tile)
# token sub-blocks whose WGMMAs go out together before one wait (17-32 tokens: one wait per
# k-block instead of two; each sub-block its own scratch, so the sums and their promotion
# order are unchanged)
SUBS_IN_FLIGHT = 2


class Sm90TransposedExpertGemmKernel(TransposedEpilogue, Sm90ExpertGemmKernel):
    """One grouped GEMM of the expert FFN with the weight tile as the WGMMA's A (see module
    doc)."""

    def __init__(self, phase: str, recipe: str, num_experts: int, num_pool_rows: int, n: int,
                 k: int, block_m: int, activation_clamp: float | None = None,
                 fast_math: bool = True, raster_group: int | None = None, combine_layout=None,
                 tiled_weights: bool = False, a_rows: str = "received",
                 decode_tables: str = "vote"):
        if recipe not in ("fp8xfp8", "fp8xfp4_sm90") or block_m != 64:
            raise ValueError(f"transposed: recipes fp8xfp8 / fp8xfp4_sm90 at BLOCK_M 64 only, "
                             f"got {recipe!r} at {block_m}")
        super().__init__(phase, recipe, num_experts, num_pool_rows, n, k, block_m,
                         activation_clamp=activation_clamp, fast_math=fast_math,
                         raster_group=raster_group, combine_layout=combine_layout,
                         staging_parts=1, promotion="chunk", tma_store=False,
                         tiled_weights=tiled_weights, decode_tables=decode_tables)
        assert self.num_mma_wgs == 1 and self.cluster_m == 1
        # `a_rows` "received": the tile's A rows in 16-row boxes, only those of sub-blocks
        # with received tokens (at decode sizes most of a 64-row pool block is pad rows, which
        # a whole-block box brings through L2 and shared memory for nothing: a third of the
        # L2-to-SM bytes of an FP4 tile; 0.96-0.97x the time at 8-16 pairs per expert); the
        # ring's barriers expect one box, `load_rows` the others. "block": one 64-row box, as
        # the staged kernel
        if a_rows not in ("block", "received"):
            raise ValueError(f"a_rows: 'block' or 'received', got {a_rows!r}")
        self.a_rows = a_rows
        if a_rows == "received":
            self.a_box_rows = TOKEN_N
            self.ring_tx_bytes -= ((block_m - TOKEN_N) * self.block_k
                                   * (self.ab_dtype.width // 8))
        self.weight_blocks = self.block_n // WEIGHT_M
        self.token_blocks = block_m // TOKEN_N
        # L1: per-warp token amaxes, then the tile's
        self.amax_exchange_len = 5 * block_m

    # ------------------------------------------------------------------------------ host side
    def mma_and_stage_layouts(self):
        """The transposed WGMMA (m64 weight rows x 16 tokens, both from shared memory) and the
        staged kernel's ring layouts."""
        _, a_layout, b_layout = super().mma_and_stage_layouts()
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(WEIGHT_M, TOKEN_N))
        return tiled_mma, a_layout, b_layout

    # ---------------------------------------------------------------------------- device side
    def consumer_staging(self, staging: cute.Pointer, consumer_warp):
        """All staging rows, one per token (the transposed epilogue's warps share them)."""
        return staging

    @cute.jit
    def consume(self, tiled_mma, sa, sb, sfa, sfb, ab_pipe, block_start, row_start,
                num_tiles: Int32, first_tile: Int32, num_clusters: Int32, raster_group: Int32,
                rank: Int32, mma_wg: Int32, warp_in_wg: Int32,
                lane: Int32, topk_weights: cute.Pointer, out: cute.Pointer,
                out_sf: cute.Pointer, peer_bases: cute.Pointer, src_metadata: cute.Pointer,
                staging: cute.Pointer, state, prev, ready: cute.Pointer = None,
                decoded: cute.Pointer = None, exchange: cute.Pointer = None):
        """The consumer warpgroup: tiles ``first_tile``, ``first_tile + num_clusters``, ...
        ``< num_tiles``, transposed (see module doc). Returns ``(state, prev, the first tile
        index past num_tiles)``."""
        # the ring's weight chunks as m64 blocks (block b of stage s: slot 2 chunks s + b) and
        # its pool tiles as 16-row sub-blocks (sub-block t of stage s: slot blocks s + t): the
        # same bytes as `sb` / `sa`, smaller tiles of the same swizzle atoms
        w_layout = self._smem_layout(WEIGHT_M, self.num_stages * self.weight_blocks)
        t_layout = self._smem_layout(TOKEN_N, self.num_stages * self.token_blocks)
        sw = cute.make_tensor(sb.iterator, w_layout.outer)
        st = cute.make_tensor(sa.iterator, t_layout.outer)
        thr_mma = tiled_mma.get_slice(warp_in_wg * 32 + lane)
        t_rw = tiled_mma.make_fragment_A(thr_mma.partition_A(sw))  # [.., .., k32, slot]
        t_rt = tiled_mma.make_fragment_B(thr_mma.partition_B(st))
        acc_shape = thr_mma.partition_shape_C((WEIGHT_M, TOKEN_N))
        accs = [[cute.make_rmem_tensor(acc_shape, Float32) for _ in range(self.token_blocks)]
                for _ in range(self.weight_blocks)]
        # scratch of SUBS_IN_FLIGHT sub-blocks: their WGMMAs issued together, one wait
        parts = [[cute.make_rmem_tensor(acc_shape, Float32) for _ in range(self.weight_blocks)]
                 for _ in range(SUBS_IN_FLIGHT)]
        quad = lane % 4
        ctid = warp_in_wg * 32 + lane
        tile = first_tile
        owner = Int32(0)
        while tile < num_tiles:
            owner, _e, _m, n_block, pool_block, valid_m = self.scheduler.tile(
                tile, owner, block_start, row_start, raster_group, rank)
            row_base = pool_block * self.block_m
            num_sub = (valid_m + TOKEN_N - 1) // TOKEN_N  # sub-blocks with received tokens
            for b in cutlass.range_constexpr(self.weight_blocks):
                for s in cutlass.range_constexpr(self.token_blocks):
                    accs[b][s].fill(0.0)
            for _kb in cutlass.range(self.num_k_blocks):
                ab_pipe.consumer_wait(state)
                if cutlass.const_expr(self.fp4_weights):
                    # the decode warps have written the stage's e4m3 weight tile
                    cute.arch.mbarrier_wait(decoded + state.index, state.phase)
                stage = state.index
                # the weight block scales of the thread's rows, by chunk (r = 0, 1: L1 gate, up)
                row_sb = self.weight_scales(sfb, stage, n_block)
                tiled_mma = self.mma_token_groups(
                    tiled_mma, lambda b, kk, stage=stage: t_rw[(None, None, kk,
                                                                stage * self.weight_blocks + b)],
                    [row_sb[b // 2] for b in range(self.weight_blocks)], t_rt, parts, accs,
                    sfa, stage, num_sub, quad)
                ab_pipe.consumer_release(state)
                state.advance()
            # (token 8 j + 2 quad + c of block b: sub-block j / 2, its value c + 2 r + 4 (j % 2))
            self.epilogue_transposed(
                lambda b, j, r, c: accs[b][j // 2][c + 2 * r + 4 * (j % 2)],
                list(range(self.weight_blocks)), topk_weights, out, out_sf, peer_bases,
                src_metadata, staging, exchange, row_base, n_block, valid_m, warp_in_wg, 4, lane,
                ctid)
            tile += num_clusters
        if ctid < self.block_m:
            cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.sync_warp()
        return state, prev, tile

    @cute.jit
    def mma_token_groups(self, tiled_mma, a_of, block_scales: list, t_rt, parts, accs, sfa,
                         stage: Int32, num_sub: Int32, quad: Int32):
        """One k-block of the thread's m64 blocks (``len(block_scales)`` of them; ``a_of(i,
        kk)``: block ``i``'s A operand of k32 step ``kk``): for each group of `SUBS_IN_FLIGHT`
        token sub-blocks with received tokens, their WGMMAs into the scratch ``parts`` (a
        sub-block past the tokens: nothing issued, nothing promoted), one wait, then the
        promotion ``accs[i][s][v] += parts[h][i][v] * (sa[token] * block_scales[i][r])``, value
        ``v = c + 2 r + 4 j``: row ``r0 + 8 r``, token ``16 s + 8 j + 2 quad + c``. Returns
        ``tiled_mma`` (its accumulate field set)."""
        nb = len(block_scales)
        for s0 in cutlass.range_constexpr(0, self.token_blocks, SUBS_IN_FLIGHT):
            if s0 < num_sub:
                tiled_mma = self.issue_token_group(tiled_mma, a_of, nb, t_rt, parts, stage, s0,
                                                   num_sub)
                warpgroup.wait_group(0)
                self.promote_token_group(parts, accs, block_scales, sfa, stage, s0, num_sub,
                                         quad)
        return tiled_mma

    @cute.jit
    def issue_token_group(self, tiled_mma, a_of, nb: cutlass.Constexpr, t_rt, parts, stage,
                          s0: cutlass.Constexpr, num_sub: Int32):
        """The WGMMAs of the token sub-blocks ``s0``, ``s0 + 1`` (the second only if it holds
        received tokens) into ``parts``, committed; the caller waits. Returns ``tiled_mma``."""
        warpgroup.fence()
        if s0 + 1 < num_sub:
            tiled_mma = self.issue_wgmmas(tiled_mma, a_of, nb, t_rt, parts, stage, s0,
                                          SUBS_IN_FLIGHT)
        else:
            tiled_mma = self.issue_wgmmas(tiled_mma, a_of, nb, t_rt, parts, stage, s0, 1)
        return tiled_mma

    @cute.jit
    def promote_token_group(self, parts, accs, block_scales: list, sfa, stage,
                            s0: cutlass.Constexpr, num_sub: Int32, quad: Int32):
        """``accs[i][s][v] += parts[h][i][v] * (sa[token] * block_scales[i][r])`` for the
        sub-blocks ``s = s0 + h < num_sub`` of the group (see `mma_token_groups`)."""
        for h in cutlass.range_constexpr(SUBS_IN_FLIGHT):
            if s0 + h < num_sub:
                s = s0 + h
                for j in cutlass.range_constexpr(TOKEN_N // 8):
                    for c in cutlass.range_constexpr(2):
                        sa_tok = sfa[TOKEN_N * s + 8 * j + 2 * quad + c, stage]
                        for i in cutlass.range_constexpr(len(block_scales)):
                            for r in cutlass.range_constexpr(2):
                                v = c + 2 * r + 4 * j
                                accs[i][s][v] += parts[h][i][v] * (
                                    sa_tok * block_scales[i][r])

    @cute.jit
    def issue_wgmmas(self, tiled_mma, a_of, nb: cutlass.Constexpr, t_rt, parts, stage,
                     s0: cutlass.Constexpr, subs: cutlass.Constexpr):
        """The WGMMAs of token sub-blocks ``s0 .. s0 + subs - 1`` of ``stage`` into their
        scratch ``parts[h]`` (each accumulates its k32 steps in order), each m64 block's A
        used by all of them before the next block's: few A descriptors are live at once, so
        ptxas keeps them on the uniform datapath (issued sub-block by sub-block, the
        two-sub-block runs held all sixteen A descriptors live, and ptxas built every
        descriptor in vector registers and moved it with an R2UR: 48 per k-block, about 80
        more instructions in the consumer's serial stream, for every tile). Returns
        ``tiled_mma``, whose accumulate field this sets (the caller rebinds it), with the
        WGMMAs committed as one group."""
        for i in cutlass.range_constexpr(nb):
            for kk in cutlass.range_constexpr(self.block_k // 32):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, kk > 0)
                for h in cutlass.range_constexpr(subs):
                    cute.gemm(tiled_mma, parts[h][i], a_of(i, kk),
                              t_rt[(None, None, kk, stage * self.token_blocks + s0 + h)],
                              parts[h][i])
        # (committed here, after the last WGMMA: a commit after the two paths meet made ptxas
        # add an empty WGMMA to carry the group's scoreboard)
        warpgroup.commit_group()
        return tiled_mma


# setmaxnreg of the register-decode kernel by consumer warpgroups: (producer, consumer); what
# the launch gives: 2: 384 threads at 168 registers, 128 x (40 + 2 x 232) = 64512; 4: 640
# threads at 96, 128 x (32 + 4 x 112) = 61440
RD_REGS = {2: (40, 232), 4: (32, 112)}
K_GROUPS = 4  # 32-code groups (one k32 WGMMA each) of a 128-deep k-block


class Sm90RegisterDecodeExpertGemmKernel(Sm90TransposedExpertGemmKernel):
    """The transposed grouped GEMM with MXFP4 weights decoded by the consumer threads straight
    into the WGMMA's register operand (an A/B variant of `Sm90TransposedExpertGemmKernel` for
    ``fp8xfp4_sm90``, `CUTE_MEGAMOE_SM90_TRANSPOSED_DECODE` "registers": four consumer
    warpgroups, "registers2": two).

    What it computes: what the transposed and staged kernels compute, bit for bit by
    construction: the same e4m3 weights (`common.fp4_decode`, the tables by integer adds, the
    float path behind one warp vote), the same m64n16k32 sums per k-block into 8-register
    scratch accumulators, the same promotion and the same epilogue.

    Why: at decode sizes the decode warps' shared-memory traffic bounds the transposed kernel
    together with DRAM (per k-block of a 256-row tile: 16 KB of packed codes read, 32 KB of e4m3
    written, then read again by the WGMMAs, beside the TMA's writes: about 113 KB at 128 bytes
    per clock, close to the k-block's DRAM time; docs/performance.md). Decoded into registers,
    a k-block moves about 44 KB (the packed codes written by TMA and read once, the token
    sub-blocks), there are no decode warps, no decoded tile, no fence and no barrier between
    decode and MMA, and every stage is a packed one (up to 8 k-blocks of weights in flight).
    The cost: each lane decodes the words of its own fragment, so a table per (row, 32-group)
    word (four times the decode warps' tables), about 250 instructions per consumer thread and
    k-block, two warps per scheduler (the decode warps and consumer issue about 550 per
    scheduler today). An earlier swap-AB kernel with the same idea at m64n64 (64 tokens per
    WGMMA, four consumer warpgroups, a per-item branch per table) was issue-bound.

    Two consumer warpgroups (two m64 blocks each) took 1.11-1.14x the decode warps' time at 8-16
    pairs per expert on an H200 (2026-12-03, docs/performance.md) while issuing in fewer than
    half the scheduler cycles: each scheduler had two warps, whose chains (shared loads, tables,
    permutes, WGMMAs, their wait, the promotion) run one after the other. Four (one m64 block
    each, 112 registers) give each scheduler four independent chains for the same instructions
    per k-block.

    How: warp 0 TMA-loads the tile's received 16-row A boxes, their scales and the weight block
    scales into the MMA stages; warp 1 the packed weight chunks (64-byte swizzle: the lanes'
    4-byte reads are conflict-free), their per-32 scale words and block scales into the packed
    stages (as many as the MMA stages). Consumer warpgroup ``w`` owns m64 blocks ``w B .. w B +
    B - 1`` of the tile (``B`` = blocks / warpgroups). Per k-block a thread reads, for its rows
    ``r0 = 16 warp + lane / 4`` and ``r0 + 8`` of each block, word ``lane % 4`` of each 32-code
    group (`quant.SM90_GROUP_ORDER`: the codes of the k-columns its A fragment holds), decodes
    it into the fragment, frees the packed stage, issues the m64n16k32 WGMMAs of the received token
    sub-blocks (two per wait, as the transposed kernel), waits, frees the A stage and promotes.
    The epilogue is the transposed one over all consumer warps.

    Constraints: ``fp8xfp4_sm90``, BLOCK_M 64, no clusters, not in the fused kernel; a tile of
    two m64 blocks (``N`` 128 in L2) runs two consumer warpgroups.
    """

    def __init__(self, phase: str, recipe: str, num_experts: int, num_pool_rows: int, n: int,
                 k: int, block_m: int, activation_clamp: float | None = None,
                 fast_math: bool = True, raster_group: int | None = None, combine_layout=None,
                 tiled_weights: bool = False, a_rows: str = "received",
                 num_stages: int | None = None, consumer_wgs: int = 4,
                 decode_ahead: bool = False):
        if recipe != "fp8xfp4_sm90":
            raise ValueError(f"register decode: recipe fp8xfp4_sm90 only, got {recipe!r}")
        super().__init__(phase, recipe, num_experts, num_pool_rows, n, k, block_m,
                         activation_clamp=activation_clamp, fast_math=fast_math,
                         raster_group=raster_group, combine_layout=combine_layout,
                         tiled_weights=tiled_weights, a_rows=a_rows)
        # no decode warpgroups; consumer warpgroups of an equal share of the m64 blocks each
        if consumer_wgs not in RD_REGS:
            raise ValueError(f"consumer_wgs: one of {tuple(RD_REGS)}, got {consumer_wgs}")
        consumer_wgs = min(consumer_wgs, self.weight_blocks)
        self.decode_wgs, self.num_mma_wgs = 0, consumer_wgs
        self.blocks_per_wg = self.weight_blocks // consumer_wgs
        self.num_threads = 128 * (1 + self.num_mma_wgs)
        self.producer_regs, self.consumer_regs = RD_REGS[consumer_wgs]
        launch_regs = min(255, 65536 // self.num_threads) // 8 * 8
        assert (128 * (self.producer_regs + self.num_mma_wgs * self.consumer_regs)
                <= self.num_threads * launch_regs)
        # k-block kb + 1's decode between kb's WGMMAs and their wait (`consume_registers`)
        self.decode_ahead = decode_ahead
        # L1: per-warp token amaxes of every consumer warp, then the tile's
        self.amax_exchange_len = (4 * self.num_mma_wgs + 1) * block_m
        # every stage of both rings fits: the MMA stages hold A and the scale vectors only
        left = self.smem_budget - self.staging_bytes - 4 * self.amax_exchange_len - 1024
        fit = min(MAX_STAGES, left // (self.stage_tx_bytes + 64 + self.packed_tx_bytes + 16))
        self.num_stages = fit if num_stages is None else num_stages
        if not 2 <= self.num_stages <= fit:
            raise ValueError(f"num_stages must be in [2, {fit}], got {num_stages}")
        self.packed_stages = self.num_stages

    # ------------------------------------------------------------------------------ host side
    def mma_and_stage_layouts(self):
        """The register-A WGMMA (m64 weight rows x 16 tokens, A from registers) and the pool
        tiles' layout (the MMA's B; also standing in for the staged kernel's weight layout)."""
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(WEIGHT_M, TOKEN_N),
            a_source=warpgroup.OperandSource.RMEM)
        a_layout = self._smem_layout(self.block_m, self.num_stages)
        return tiled_mma, a_layout, a_layout

    def raw_b_layout(self):
        """The packed weight chunks as TMA writes them, ``[128 rows, 64 bytes, packed stage *
        chunks + chunk]``, 64-byte swizzled (16-byte unit ``u`` of row ``r`` at ``u ^ (r / 2 %
        4)``: the eight rows of a warp's 4-byte reads of one group hit distinct banks)."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, Uint8)
        return cute.tile_to_shape(atom, (WG_N, self.b_load_k(),
                                         self.packed_stages * self.chunks), order=(0, 1, 2))

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
            amax_exchange: cute.struct.Align[
                cute.struct.MemRange[Float32, self.amax_exchange_len], 16]

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
            self.consume_registers(
                tiled_mma, sa, sfa, sfb, storage.raw_b.data_ptr(), storage.sfg.data_ptr(),
                storage.sfb_packed.data_ptr(), ab_pipe, packed_pipe, block_start, row_start,
                num_tiles, bidx, grid, raster_group, wg - 1, warp % 4, lane, topk_weights, out,
                out_sf, peer_bases, src_metadata, storage.staging.data_ptr(),
                storage.amax_exchange.data_ptr())

    @cute.jit
    def consume_registers(self, tiled_mma, sa, sfa, sfb, raw_b: cute.Pointer,
                          sfg: cute.Pointer, sfb_packed: cute.Pointer, ab_pipe, packed_pipe,
                          block_start, row_start, num_tiles: Int32, first_tile: Int32,
                          num_clusters: Int32, raster_group: Int32, mma_wg: Int32,
                          warp_in_wg: Int32, lane: Int32, topk_weights: cute.Pointer,
                          out: cute.Pointer, out_sf: cute.Pointer, peer_bases: cute.Pointer,
                          src_metadata: cute.Pointer, staging: cute.Pointer,
                          exchange: cute.Pointer):
        """Consumer warpgroup ``mma_wg``: its m64 blocks of tiles ``first_tile``, ``first_tile +
        num_clusters``, ... ``< num_tiles`` (see the class doc)."""
        nb = self.blocks_per_wg
        t_layout = self._smem_layout(TOKEN_N, self.num_stages * self.token_blocks)
        st = cute.make_tensor(sa.iterator, t_layout.outer)
        thr_mma = tiled_mma.get_slice(warp_in_wg * 32 + lane)
        t_rt = tiled_mma.make_fragment_B(thr_mma.partition_B(st))  # [.., .., k32, slot]
        # block i's fragment: word r + 2 h + 4 g is row r0 + 8 r, columns 16 h + 4 (lane % 4)
        # .. of the k-block's 32-group g. With `decode_ahead` two sets: k-block kb's in set
        # kb % 2, the next one decoded into the other while kb's WGMMAs read this one
        sets = 2 if self.decode_ahead else 1
        frags = [[thr_mma.make_fragment_A(thr_mma.partition_shape_A((WEIGHT_M, self.block_k)))
                  for _ in range(nb)] for _ in range(sets)]
        frag_words = [[cute.recast_tensor(f, Int32) for f in fs] for fs in frags]
        acc_shape = thr_mma.partition_shape_C((WEIGHT_M, TOKEN_N))
        accs = [[cute.make_rmem_tensor(acc_shape, Float32) for _ in range(self.token_blocks)]
                for _ in range(nb)]
        parts = [[cute.make_rmem_tensor(acc_shape, Float32) for _ in range(nb)]
                 for _ in range(SUBS_IN_FLIGHT)]
        quad = lane % 4
        blocks = [mma_wg * nb + i for i in range(nb)]  # the tile's m64 blocks of this warpgroup
        row0 = 16 * warp_in_wg + lane // 4
        packed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                              self.packed_stages)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.num_stages)
        ctid = mma_wg * 128 + warp_in_wg * 32 + lane
        tile = first_tile
        owner = Int32(0)
        while tile < num_tiles:
            owner, _e, _m, n_block, pool_block, valid_m = self.scheduler.tile(
                tile, owner, block_start, row_start, raster_group, Int32(0))
            row_base = pool_block * self.block_m
            num_sub = (valid_m + TOKEN_N - 1) // TOKEN_N
            for i in cutlass.range_constexpr(nb):
                for s in cutlass.range_constexpr(self.token_blocks):
                    accs[i][s].fill(0.0)
            if cutlass.const_expr(self.decode_ahead):
                # k-block 0 ahead of the loop; in the loop, k-block kb + 1's decode goes
                # between kb's WGMMAs and their wait (two k-blocks per body: set kb % 2)
                self.decode_fragments(frag_words[0], raw_b, sfg, sfb_packed, packed_pipe,
                                      packed, n_block, blocks, row0, quad)
                packed.advance()
                for kb0 in cutlass.range(0, self.num_k_blocks, 2):
                    for h in cutlass.range_constexpr(2):
                        if kb0 + h < self.num_k_blocks:
                            ab_pipe.consumer_wait(state)
                            stage = state.index
                            block_sb = self.fragment_block_scales(sfb, stage, n_block, blocks)
                            a_of = (lambda i, kk, h=h: frags[h][i][(None, None, kk)])
                            tiled_mma = self.issue_token_group(tiled_mma, a_of, nb, t_rt,
                                                               parts, stage, 0, num_sub)
                            if kb0 + h + 1 < self.num_k_blocks:
                                self.decode_fragments(frag_words[1 - h], raw_b, sfg, sfb_packed,
                                                      packed_pipe, packed, n_block, blocks,
                                                      row0, quad)
                                packed.advance()
                            warpgroup.wait_group(0)
                            self.promote_token_group(parts, accs, block_sb, sfa, stage, 0,
                                                     num_sub, quad)
                            # (33-64 tokens: the later sub-blocks without overlap)
                            for s0 in cutlass.range_constexpr(SUBS_IN_FLIGHT, self.token_blocks,
                                                              SUBS_IN_FLIGHT):
                                if s0 < num_sub:
                                    tiled_mma = self.issue_token_group(
                                        tiled_mma, a_of, nb, t_rt, parts, stage, s0, num_sub)
                                    warpgroup.wait_group(0)
                                    self.promote_token_group(parts, accs, block_sb, sfa, stage,
                                                             s0, num_sub, quad)
                            ab_pipe.consumer_release(state)
                            state.advance()
            else:
                for _kb in cutlass.range(self.num_k_blocks):
                    self.decode_fragments(frag_words[0], raw_b, sfg, sfb_packed, packed_pipe,
                                          packed, n_block, blocks, row0, quad)
                    packed.advance()
                    ab_pipe.consumer_wait(state)
                    stage = state.index
                    tiled_mma = self.mma_token_groups(
                        tiled_mma, lambda i, kk: frags[0][i][(None, None, kk)],
                        self.fragment_block_scales(sfb, stage, n_block, blocks), t_rt, parts,
                        accs, sfa, stage, num_sub, quad)
                    ab_pipe.consumer_release(state)
                    state.advance()
            self.epilogue_transposed(
                lambda i, j, r, c: accs[i][j // 2][c + 2 * r + 4 * (j % 2)], blocks,
                topk_weights, out, out_sf, peer_bases, src_metadata, staging, exchange,
                row_base, n_block, valid_m, 4 * mma_wg + warp_in_wg, 4 * self.num_mma_wgs,
                lane, ctid)
            tile += num_clusters
        if ctid < self.block_m:
            cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.sync_warp()

    @cute.jit
    def fragment_block_scales(self, sfb, stage: Int32, n_block: Int32, blocks: list):
        """The weight block scales of the thread's rows ``r`` of each of its m64 ``blocks``, as
        ``(r = 0, r = 1)`` pairs (L1: gate, up)."""
        if cutlass.const_expr(self.phase == "l1"):
            return [self.weight_scales(sfb, stage, n_block)[0]] * len(blocks)
        return [(sfb[self.chunks * n_block + b // 2, stage],) * 2 for b in blocks]

    @cute.jit
    def decode_fragments(self, frag_words: list, raw_b: cute.Pointer, sfg: cute.Pointer,
                         sfb_packed: cute.Pointer, packed_pipe, packed, n_block: Int32,
                         blocks: list, row0: Int32, quad: Int32):
        """Wait for the packed stage of ``packed``, decode the thread's words of its m64
        ``blocks`` into ``frag_words`` (one Int32 view of a fragment per block) and free the
        stage. The exponent shifts come from the packed stage's copy of the block scales, so
        that the decode needs nothing of the MMA stage."""
        packed_pipe.consumer_wait(packed)
        row_words = self.b_load_k() // 4
        # tile row 64 blocks[0] + r0 (+ 64 i + 8 r for block i, row r) of a packed stage (its
        # chunks' rows one after the other); the thread's word of group g of a packed row lies
        # at 16-byte unit g ^ (row / 2 % 4), the same for all its rows
        unit_xor = (row0 >> 1) & 3
        first_row = WEIGHT_M * blocks[0] + row0
        packed_words = cute.make_tensor(
            cute.recast_ptr(raw_b, dtype=Int32) + packed.index * self.block_n * row_words,
            cute.make_layout(self.block_n * row_words))
        group_words = cute.make_tensor(sfg + packed.index * self.block_n + first_row,
                                       cute.make_layout(self.block_n))
        block_scales = cute.make_tensor(sfb_packed + packed.index * self.packed_sfb_stride,
                                        cute.make_layout(self.sfb_len))
        shifts = []
        for i in cutlass.range_constexpr(len(blocks)):
            for r in cutlass.range_constexpr(2):
                if cutlass.const_expr(self.phase == "l1"):  # (r = 0: gate, r = 1: up)
                    block = n_block + r * (self.n // (2 * SF_BLOCK))
                else:
                    block = self.chunks * n_block + blocks[i] // 2
                base = (block_scales[block].bitcast(Int32) >> 23) & 0xFF
                scales = group_words[WEIGHT_M * i + 8 * r]
                for g in cutlass.range_constexpr(K_GROUPS):
                    shifts.append(prmt(scales, Int32(0), Int32(0x4440 + g)) - base)
        tables = vote_tables(shifts)
        for i in cutlass.range_constexpr(len(blocks)):
            for r in cutlass.range_constexpr(2):
                for g in cutlass.range_constexpr(K_GROUPS):
                    word = packed_words[(first_row + WEIGHT_M * i + 8 * r) * row_words
                                        + (g ^ unit_xor) * 4 + quad]
                    t = (i * 2 + r) * K_GROUPS + g
                    frag_words[i][r + 4 * g], frag_words[i][r + 2 + 4 * g] = \
                        decode_e2m1_word(word, tables[2 * t], tables[2 * t + 1])
        cute.arch.sync_warp()  # (every lane's packed loads before the release)
        packed_pipe.consumer_release(packed)
