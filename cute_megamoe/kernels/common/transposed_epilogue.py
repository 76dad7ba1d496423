"""The epilogue of the transposed Hopper grouped GEMMs (`sm90_expert_gemm_transposed`), whose
accumulators hold weight rows x tokens: a mixin for `Sm90ExpertGemmKernel` subclasses.

A consumer thread holds, for each of its m64 blocks ``b`` of the tile's weight rows, the values
of weight rows ``64 b + 16 warp + lane / 4 + 8 r`` (r = 0, 1) and tokens ``8 j + 2 (lane % 4) +
c`` (j < BLOCK_M / 8, c = 0, 1). In L1 the weight rows interleave gate and up by 8
(``quant.interleave_gate_up``): ``r = 0`` is the gate and ``r = 1`` the up row of feature ``32 b
+ 8 warp + lane / 4``. The tile's output row of each token is assembled in a shared-memory
staging row (L2: BF16 of the values; L1: SwiGLU times the routing weight, requantized to e4m3
with a power-of-two scale per token over the tile's 128 features, the token amax met over shared
memory across the consumer warps), then the first BLOCK_M consumer threads send the valid
tokens' rows with one 1-D bulk copy each. The arithmetic is the staged kernel's, bit for bit.
Only the groups of 8 tokens that hold received ones are computed (a branch per group, uniform
across the warp): at decode sizes a 64-row pool block holds a handful of tokens, and the
epilogue of all 64 took about a sixth of the consumer warps' instructions per L1 tile and a
quarter per L2 tile (ncu, 128 experts x 8 pairs).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8
from cutlass.experimental import primitives as prims

from .quant_math import FP8_E4M3_MAX, requant_exponent

EPILOGUE_BARRIER = 2  # named barrier of the consumer warps' epilogue (1: the staged skew's)


class TransposedEpilogue:
    """`epilogue_transposed` for a kernel class that also derives from `Sm90ExpertGemmKernel`
    (its `phase`, `block_m`, staging rows, `silu_mul`, `row_destination`)."""

    @cute.jit
    def epilogue_transposed(self, value, blocks, topk_weights: cute.Pointer, out: cute.Pointer,
                            out_sf: cute.Pointer, peer_bases: cute.Pointer,
                            src_metadata: cute.Pointer, staging: cute.Pointer,
                            exchange: cute.Pointer, row_base: Int32, n_block: Int32,
                            valid_m: Int32, consumer_warp: Int32,
                            num_warps: cutlass.Constexpr, lane: Int32, ctid: Int32):
        """One tile's output rows, one per token (module doc). ``value(i, j, r, c)``: the
        thread's accumulator value of its ``i``-th m64 block, token ``8 j + 2 (lane % 4) + c``,
        row ``r0 + 8 r`` (a trace-time callable); ``blocks``: the tile's m64 block of each (a
        list); ``consumer_warp`` of ``num_warps`` (the amax exchange's column, its rows and the
        features: ``16 (consumer_warp % 4)``); ``ctid``: the consumer thread's index;
        ``exchange``: ``(num_warps + 1) * BLOCK_M`` floats of shared memory (L1)."""
        threads = 32 * num_warps
        quad = lane % 4
        warp_in_wg = consumer_warp % 4
        tokens = self.block_m
        # the previous tile's bulk copies have read the staging rows
        if ctid < tokens:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        if cutlass.const_expr(self.phase == "l2"):
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
            rows = cute.make_tensor(cute.recast_ptr(staging, dtype=BFloat16),
                                    cute.make_layout((tokens, self.staging_stride // 2),
                                                     stride=(self.staging_stride // 2, 1)))
            for j in cutlass.range_constexpr(tokens // 8):
                if 8 * j < valid_m:  # (tokens 8 j .. 8 j + 7: none past the received ones)
                    for i in cutlass.range_constexpr(len(blocks)):
                        col0 = 64 * blocks[i] + 16 * warp_in_wg + lane // 4  # output column
                        for r in cutlass.range_constexpr(2):
                            for c in cutlass.range_constexpr(2):
                                rows[8 * j + 2 * quad + c, col0 + 8 * r] = BFloat16(
                                    value(i, j, r, c))
        else:
            weights = cute.make_tensor(topk_weights + row_base, cute.make_layout(tokens))
            # h of feature 32 block + 8 warp + lane / 4 (tile-local), token 8 j + 2 quad + c
            h = cute.make_rmem_tensor((len(blocks), 2, tokens // 8), Float32)
            h.fill(0.0)  # (defined on every path: the token groups below are guarded)
            for j in cutlass.range_constexpr(tokens // 8):
                if 8 * j < valid_m:
                    for i in cutlass.range_constexpr(len(blocks)):
                        for c in cutlass.range_constexpr(2):
                            gate = Float32(BFloat16(value(i, j, 0, c)))
                            up = Float32(BFloat16(value(i, j, 1, c)))
                            h[i, c, j] = self.silu_mul(gate, up) * weights[8 * j + 2 * quad + c]
            # the token's amax over the thread's blocks, the warp's features (the lanes of one
            # quad position), then the consumer warps
            warp_amax = cute.make_tensor(exchange, cute.make_layout((tokens, num_warps),
                                                                    stride=(1, tokens)))
            tile_amax = cute.make_tensor(exchange + num_warps * tokens, cute.make_layout(tokens))
            for j in cutlass.range_constexpr(tokens // 8):
                if 8 * j < valid_m:  # (uniform: the shuffles see every lane)
                    for c in cutlass.range_constexpr(2):
                        amax = cute.math.absf(h[0, c, j])
                        for i in cutlass.range_constexpr(1, len(blocks)):
                            amax = cute.arch.fmax(amax, cute.math.absf(h[i, c, j]))
                        for mask in (4, 8, 16):
                            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, mask))
                        if lane < 4:
                            warp_amax[8 * j + 2 * quad + c, consumer_warp] = amax
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
            if ctid < tokens:
                amax = Float32(0.0)
                for w in cutlass.range_constexpr(num_warps):
                    amax = cute.arch.fmax(amax, warp_amax[ctid, w])
                tile_amax[ctid] = amax  # (past the received tokens: stale, read, never sent)
                if ctid < valid_m:
                    exponent = requant_exponent(amax)
                    # 2^e as float32; a zero group (byte 0) is 2^-127, the subnormal 0x00400000
                    sf_bits = (exponent + 127) << 23
                    if exponent == -127:
                        sf_bits = Int32(0x00400000)
                    sf = cute.make_tensor(out_sf + (Int64(n_block) * self.num_pool_rows
                                                    + row_base), cute.make_layout(tokens))
                    sf[ctid] = sf_bits.bitcast(Float32)
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
            rows = cute.make_tensor(staging, cute.make_layout(
                (tokens, self.staging_stride), stride=(self.staging_stride, 1)))
            for j in cutlass.range_constexpr(tokens // 8):
                if 8 * j < valid_m:
                    sf_inv = []
                    for c in cutlass.range_constexpr(2):
                        exponent = requant_exponent(tile_amax[8 * j + 2 * quad + c])
                        sf_inv.append(((127 - exponent) << 23).bitcast(Float32))
                    for i in cutlass.range_constexpr(len(blocks)):
                        q = cute.make_rmem_tensor(2, Float32)
                        for c in cutlass.range_constexpr(2):
                            q[c] = cutlass.max(cutlass.min(h[i, c, j] * sf_inv[c],
                                                           Float32(FP8_E4M3_MAX)),
                                               Float32(-FP8_E4M3_MAX))
                        v = cute.make_rmem_tensor(2, Float8E4M3FN)
                        v.store(q.load().to(Float8E4M3FN))
                        v_bytes = cute.recast_tensor(v, Uint8)
                        feature = 32 * blocks[i] + 8 * warp_in_wg + lane // 4
                        for c in cutlass.range_constexpr(2):
                            rows[8 * j + 2 * quad + c, feature] = v_bytes[c]
        # the staging writes (generic proxy), then the bulk copies' reads (async proxy)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
        if ctid < tokens:
            if ctid < valid_m:
                dst = self.row_destination(out, peer_bases, src_metadata, row_base, ctid,
                                           valid_m, n_block, Int32(0))
                prims.cp_async_bulk_global_shared_cta(
                    cute.make_ptr(Uint8, dst, cute.AddressSpace.gmem, assumed_align=16),
                    staging + ctid * self.staging_stride, Int32(self.tile_row_bytes))
            cute.arch.cp_async_bulk_commit_group()
