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

How: the staged kernel's warps, rings, decode and tile walk unchanged (the decode with
``early_tables`` on: 0.99x the layer's time at decode sizes); only the consumer warpgroup
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
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float8E4M3FN, Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .common.transposed_epilogue import TransposedEpilogue
from .sm90_expert_gemm import Sm90ExpertGemmKernel

TOKEN_N = 16  # rows of one TMA box of the pool tile (`a_rows` "received")
WEIGHT_M = 64  # weight rows of one transposed WGMMA (an m64 block of the tile)
GROUP_TOKENS = 32  # tokens of one group of WGMMAs before a wait: the pool block's two halves
# How a group's WGMMAs cover its received tokens (`token_widths`): per option, the most tokens
# it takes and (WGMMA N, sub-blocks of N tokens); a group takes the first option whose most
# is at least its tokens. "16": m64n16 sub-blocks, two in flight before one wait (17-32
# tokens: one wait per k-block instead of two; each sub-block its own scratch, so the sums and
# their promotion order are unchanged). "sized": one WGMMA per m64 block and k32 step, as
# narrow as the tokens allow (m64n8 up to 8, m64n16 up to 16, m64n32 up to 32): half the
# weight tile's shared-memory reads of two m64n16 at 17-32 tokens, half the promotion FMAs
# of m64n16 at up to 8
TOKEN_WIDTHS = {"16": ((16, (16, 1)), (32, (16, 2))),
                "sized": ((8, (8, 1)), (16, (16, 1)), (32, (32, 1)))}
DEFAULT_TOKEN_WIDTHS = "16"


class Sm90TransposedExpertGemmKernel(TransposedEpilogue, Sm90ExpertGemmKernel):
    """One grouped GEMM of the expert FFN with the weight tile as the WGMMA's A (see module
    doc)."""

    def __init__(self, phase: str, recipe: str, num_experts: int, num_pool_rows: int, n: int,
                 k: int, block_m: int, activation_clamp: float | None = None,
                 fast_math: bool = True, raster_group: int | None = None, combine_layout=None,
                 tiled_weights: bool = False, a_rows: str = "received",
                 decode_tables: str = "vote", early_tables: bool | None = None,
                 token_widths: str | None = None):
        if recipe not in ("fp8xfp8", "fp8xfp4_sm90") or block_m != 64:
            raise ValueError(f"transposed: recipes fp8xfp8 / fp8xfp4_sm90 at BLOCK_M 64 only, "
                             f"got {recipe!r} at {block_m}")
        super().__init__(phase, recipe, num_experts, num_pool_rows, n, k, block_m,
                         activation_clamp=activation_clamp, fast_math=fast_math,
                         raster_group=raster_group, combine_layout=combine_layout,
                         staging_parts=1, promotion="chunk", tma_store=False,
                         tiled_weights=tiled_weights, decode_tables=decode_tables,
                         # (FP4: the decode warps' first tables before the free-stage wait,
                         # sm90_expert_gemm.DEFAULT_EARLY_TABLES)
                         early_tables=True if early_tables is None else early_tables)
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
        token_widths = DEFAULT_TOKEN_WIDTHS if token_widths is None else token_widths
        if token_widths not in TOKEN_WIDTHS:
            raise ValueError(f"token_widths: one of {tuple(TOKEN_WIDTHS)}, got {token_widths!r}")
        self.token_widths = token_widths
        self.group_options = TOKEN_WIDTHS[token_widths]
        # L1: per-warp token amaxes, then the tile's
        self.amax_exchange_len = 5 * block_m

    # ------------------------------------------------------------------------------ host side
    def mma_and_stage_layouts(self):
        """The transposed WGMMA of the narrowest token width (m64 weight rows x N tokens, both
        from shared memory; `token_mma` makes the others) and the staged kernel's ring
        layouts."""
        _, a_layout, b_layout = super().mma_and_stage_layouts()
        return self.token_mma(self.token_n_of_widths()[0]), a_layout, b_layout

    def token_n_of_widths(self) -> list:
        """The WGMMA token widths (N) the groups use, ascending."""
        return sorted({n for _, (n, _) in self.group_options})

    @staticmethod
    def token_mma(token_n: int):
        """The transposed tiled WGMMA: m64 weight rows x ``token_n`` tokens, FP8, K-major."""
        return sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(WEIGHT_M, token_n))

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
        # its pool tiles as sub-blocks of N tokens (sub-block t of stage s: slot 64 / N s + t):
        # the same bytes as `sb` / `sa`, smaller tiles of the same swizzle atoms
        w_layout = self._smem_layout(WEIGHT_M, self.num_stages * self.weight_blocks)
        sw = cute.make_tensor(sb.iterator, w_layout.outer)
        ctid = warp_in_wg * 32 + lane
        # per token width N: the tiled WGMMA, the A (weights) and B (tokens) operands, and
        # the scratch accumulators of its sub-blocks in flight (one per m64 block)
        mmas, a_ops, b_ops, parts = {}, {}, {}, {}
        for token_n in self.token_n_of_widths():
            mma = tiled_mma if token_n == self.token_n_of_widths()[0] \
                else self.token_mma(token_n)
            thr_mma = mma.get_slice(ctid)
            t_layout = self._smem_layout(token_n, self.num_stages * self.block_m // token_n)
            st = cute.make_tensor(sa.iterator, t_layout.outer)
            mmas[token_n] = mma
            a_ops[token_n] = mma.make_fragment_A(thr_mma.partition_A(sw))  # [.., .., k32, slot]
            b_ops[token_n] = mma.make_fragment_B(thr_mma.partition_B(st))
            subs = max(count for _, (n, count) in self.group_options if n == token_n)
            acc_shape = thr_mma.partition_shape_C((WEIGHT_M, token_n))
            parts[token_n] = [[cute.make_rmem_tensor(acc_shape, Float32)
                               for _ in range(self.weight_blocks)] for _ in range(subs)]
        # the tile's sums per m64 block: value c + 2 r + 4 j is weight row r0 + 8 r and token
        # 8 j + 2 (lane % 4) + c (the m64nN accumulator's order, over the whole pool block)
        accs = [cute.make_rmem_tensor(self.block_m // 2, Float32)
                for _ in range(self.weight_blocks)]
        quad = lane % 4
        tile = first_tile
        owner = Int32(0)
        while tile < num_tiles:
            owner, _e, _m, n_block, pool_block, valid_m = self.scheduler.tile(
                tile, owner, block_start, row_start, raster_group, rank)
            row_base = pool_block * self.block_m
            for b in cutlass.range_constexpr(self.weight_blocks):
                accs[b].fill(0.0)
            for _kb in cutlass.range(self.num_k_blocks):
                ab_pipe.consumer_wait(state)
                if cutlass.const_expr(self.fp4_weights):
                    # the decode warps have written the stage's e4m3 weight tile
                    cute.arch.mbarrier_wait(decoded + state.index, state.phase)
                stage = state.index
                # the weight block scales of the thread's rows, by chunk (r = 0, 1: L1 gate, up)
                row_sb = self.weight_scales(sfb, stage, n_block)
                mmas = self.mma_token_groups(
                    mmas, a_ops, b_ops, [row_sb[b // 2] for b in range(self.weight_blocks)],
                    parts, accs, sfa, stage, valid_m, quad)
                ab_pipe.consumer_release(state)
                state.advance()
            self.epilogue_transposed(
                lambda b, j, r, c: accs[b][c + 2 * r + 4 * j],
                list(range(self.weight_blocks)), topk_weights, out, out_sf, peer_bases,
                src_metadata, staging, exchange, row_base, n_block, valid_m, warp_in_wg, 4, lane,
                ctid)
            tile += num_clusters
        if ctid < self.block_m:
            cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.sync_warp()
        return state, prev, tile

    @cute.jit
    def mma_token_groups(self, mmas: dict, a_ops: dict, b_ops: dict, block_scales: list, parts,
                         accs, sfa, stage: Int32, valid_m: Int32, quad: Int32):
        """One k-block of the thread's m64 blocks (``len(block_scales)`` of them): for each
        group of `GROUP_TOKENS` tokens that holds received ones, the WGMMAs of the group's
        option (`token_widths`: the first whose most tokens is at least the group's; a
        uniform branch per option) into the scratch ``parts``, one wait, then the promotion
        ``accs[i][v] += part[v'] * (sa[token] * block_scales[i][r])``. Returns ``mmas`` (their
        accumulate fields set)."""
        least = 0
        for t0 in cutlass.range_constexpr(0, self.block_m, GROUP_TOKENS):
            tokens = valid_m - t0
            least = 0
            for most, (token_n, subs) in self.group_options:
                if tokens > least:
                    if cutlass.const_expr(most >= GROUP_TOKENS):
                        mmas[token_n] = self.mma_group(mmas[token_n], a_ops[token_n],
                                                       b_ops[token_n], parts[token_n],
                                                       block_scales, accs, sfa, stage, t0,
                                                       token_n, subs, quad)
                    else:
                        if tokens <= most:
                            mmas[token_n] = self.mma_group(
                                mmas[token_n], a_ops[token_n], b_ops[token_n], parts[token_n],
                                block_scales, accs, sfa, stage, t0, token_n, subs, quad)
                least = most
        return mmas

    @cute.jit
    def mma_group(self, tiled_mma, t_rw, t_rt, parts, block_scales: list, accs, sfa,
                  stage: Int32, t0: cutlass.Constexpr, token_n: cutlass.Constexpr,
                  subs: cutlass.Constexpr, quad: Int32):
        """The WGMMAs of ``subs`` sub-blocks of ``token_n`` tokens from token ``t0`` into their
        scratch ``parts[h]`` (each accumulates its k32 steps in order; each m64 block's A used
        by all of them before the next block's: few A descriptors are live at once, so ptxas
        keeps them on the uniform datapath, where two-sub-block runs issued sub-block by
        sub-block held all sixteen live and ptxas built every descriptor in vector registers,
        48 R2UR per k-block), committed as one group (a commit after the paths met made ptxas
        add an empty WGMMA to carry the group's scoreboard), one wait, then their promotion.
        Returns ``tiled_mma``, whose accumulate field this sets (the caller rebinds it)."""
        nb = len(block_scales)
        slots = self.block_m // token_n
        warpgroup.fence()
        for i in cutlass.range_constexpr(nb):
            for kk in cutlass.range_constexpr(self.block_k // 32):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, kk > 0)
                for h in cutlass.range_constexpr(subs):
                    cute.gemm(tiled_mma, parts[h][i],
                              t_rw[(None, None, kk, stage * self.weight_blocks + i)],
                              t_rt[(None, None, kk, stage * slots + t0 // token_n + h)],
                              parts[h][i])
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        for h in cutlass.range_constexpr(subs):
            for jj in cutlass.range_constexpr(token_n // 8):
                j = (t0 + token_n * h) // 8 + jj  # the token group of 8 in the pool block
                for c in cutlass.range_constexpr(2):
                    sa_tok = sfa[8 * j + 2 * quad + c, stage]
                    for i in cutlass.range_constexpr(nb):
                        for r in cutlass.range_constexpr(2):
                            accs[i][c + 2 * r + 4 * j] += parts[h][i][c + 2 * r + 4 * jj] * (
                                sa_tok * block_scales[i][r])
        return tiled_mma
