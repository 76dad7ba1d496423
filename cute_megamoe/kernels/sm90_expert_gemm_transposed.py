"""Hopper (sm_90a) grouped GEMMs over the expert pool, transposed for decode sizes: the weight
tile is the WGMMA's A (M = 64 weight rows, from shared memory), the pool rows its B in 16-token
sub-blocks (N = 16), and only the sub-blocks that hold received tokens are computed. Recipes
``fp8xfp8`` and ``fp8xfp4_sm90``, BLOCK_M 64. The default for both at up to 16 expected
tokens per expert (`heuristics.select_sm90_transposed`: on an H200 MXFP4 0.78x the staged
kernels' time at 8 and 16 pairs per expert, 0.80x in the layer at 128 tokens; fp8xfp8
0.97-0.98x); elsewhere where a config asks for it (`config.Sm90GemmConfig.transposed`).

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

How: the staged kernel's warps, rings, decode and tile walk unchanged (the decode with
``early_tables`` on: 0.99x the layer's time at decode sizes); only the consumer warpgroup
differs, and the producer's A loads: 16-row boxes, only those of the sub-blocks below (the staged
kernel's one 64-row box took 1.03-1.04x the time). The ring's weight chunks (128
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
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float8E4M3FN, Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from ..config import Sm90GemmConfig
from .common.transposed_epilogue import TransposedEpilogue
from .sm90_expert_gemm import Sm90ExpertGemmKernel

TOKEN_N = 16  # tokens of one transposed WGMMA (m64n16): a sub-block of the pool block
WEIGHT_M = 64  # weight rows of one transposed WGMMA (an m64 block of the tile)
# token sub-blocks whose WGMMAs go out together before one wait (17-32 tokens: one wait per
# k-block instead of two; each sub-block its own scratch, so the sums and their promotion
# order are unchanged)
SUBS_IN_FLIGHT = 2


class Sm90TransposedExpertGemmKernel(TransposedEpilogue, Sm90ExpertGemmKernel):
    """One grouped GEMM of the expert FFN with the weight tile as the WGMMA's A (see module
    doc); arguments as `Sm90ExpertGemmKernel`, a config with ``transposed`` set (BLOCK_M 64, no
    clusters, the chunk promotion, rows out by bulk copies: `config.Sm90GemmConfig` checks)."""

    transposed = True
    whole_staging_rows = True

    def __init__(self, phase: str, recipe: str, num_experts: int, num_pool_rows: int, n: int,
                 k: int, config: Sm90GemmConfig, activation_clamp: float | None = None,
                 fast_math: bool = True, combine_layout=None, tiled_weights: bool = False):
        if recipe not in ("fp8xfp8", "fp8xfp4_sm90"):
            raise ValueError(f"transposed: recipes fp8xfp8 / fp8xfp4_sm90 only, got {recipe!r}")
        super().__init__(phase, recipe, num_experts, num_pool_rows, n, k, config,
                         activation_clamp=activation_clamp, fast_math=fast_math,
                         combine_layout=combine_layout, tiled_weights=tiled_weights)
        assert self.num_mma_wgs == 1 and self.cluster_m == 1
        # the tile's A rows in 16-row boxes, only those of sub-blocks with received tokens (at
        # decode sizes most of a 64-row pool block is pad rows, which a whole-block box brings
        # through L2 and shared memory for nothing: a third of the L2-to-SM bytes of an FP4
        # tile; 0.96-0.97x the time at 8-16 pairs per expert); the ring's barriers expect one
        # box, `load_rows` the others
        self.a_box_rows = TOKEN_N
        self.ring_tx_bytes -= ((self.block_m - TOKEN_N) * self.block_k
                               * (self.ab_dtype.width // 8))
        self.weight_blocks = self.block_n // WEIGHT_M
        self.token_blocks = self.block_m // TOKEN_N
        # L1: per-warp token amaxes, then the tile's
        self.amax_exchange_len = 5 * self.block_m

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
                warpgroup.fence()
                if s0 + 1 < num_sub:
                    tiled_mma = self.issue_wgmmas(tiled_mma, a_of, nb, t_rt, parts, stage, s0,
                                                  SUBS_IN_FLIGHT)
                else:
                    tiled_mma = self.issue_wgmmas(tiled_mma, a_of, nb, t_rt, parts, stage, s0,
                                                  1)
                warpgroup.wait_group(0)
                for h in cutlass.range_constexpr(SUBS_IN_FLIGHT):
                    if s0 + h < num_sub:
                        s = s0 + h
                        for j in cutlass.range_constexpr(TOKEN_N // 8):
                            for c in cutlass.range_constexpr(2):
                                sa_tok = sfa[TOKEN_N * s + 8 * j + 2 * quad + c, stage]
                                for i in cutlass.range_constexpr(nb):
                                    for r in cutlass.range_constexpr(2):
                                        v = c + 2 * r + 4 * j
                                        accs[i][s][v] += parts[h][i][v] * (
                                            sa_tok * block_scales[i][r])
        return tiled_mma

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

