"""Hopper (sm_90a) grouped GEMMs over the expert pool: L1 with the SwiGLU epilogue, and L2.

What it computes, for every local expert ``e`` and every received row ``r`` of its pool rows
``[block_start[e] * BM, block_start[e] * BM + count[e])`` (``count = expert_recv_tokens``):

* ``phase="l1"``: ``acc = A[r] @ W1[e].T`` over ``K = H`` (``W1`` rows gate/up interleaved by 8,
  see ``quant.interleave_gate_up``), then per feature ``f``: ``g, u = bf16(acc)`` of the gate and
  up row, clamp (``g <= c``, ``-c <= u <= c``), ``h = silu(g) * u * topk_weight[r]``; written
  as e4m3 with a power-of-two f32 scale per 128 features (``fp8xfp8``, bit-exact with
  ``quant.requant_fp8_pow2`` given the same ``h``) or as BF16 (``bf16xbf16``) to the L2 pool.
* ``phase="l2"``: ``out[r] = bf16(A[r] @ W2[e].T)`` over ``K = I``, BF16 rows in pool order;
  or, with ``combine_layout`` (the symmetric buffer's layout), each row straight into its source
  rank's combine buffer: ``combine_s[k, t] = bf16(A[r] @ W2[e].T)`` for ``(s, t, k)`` =
  ``token_src_metadata[r]``, written over NVLink by the epilogue's bulk copies (design step f),
  so the combine only reduces.

FP8 (``fp8xfp8``): ``A`` is e4m3 with an f32 scale per row per 128 K (``A_sf`` MN-major,
``[K/128, P]``), ``W`` is e4m3 with its 128x128 block scales (``B_sf [E, K/128, NB]`` f32,
K-block major, ``NB`` = ``N/128`` rounded up to a multiple of 4 so that rows are 16-byte
aligned; for L1 the row blocks of the weight before the gate/up interleave: gate blocks, then up
blocks, see ``expert_gemm.ExpertWeights``). Each 128-deep k-block is accumulated by WGMMA into a
scratch accumulator that is then scaled by ``sa[row] * sb[block]`` and added in FP32
("promotion", DeepGEMM's SM90 recipe). A 128-column chunk of an L1 tile holds 64 gate and 64 up
features of one gate and one up block, so it needs two weight scales (gate for the even 8-column
groups, up for the odd); an L2 chunk is one block.

How: a persistent, warp-specialized kernel. Warp 0 (the producer warpgroup keeps 32-40 registers)
walks this CTA's tiles (``scheduler.device.ExpertTileScheduler``: expert-major, then raster
bands of pool blocks with the band's blocks fastest, so that the tiles reading one weight tile
run at once and it comes from DRAM once per band; ``block_start`` rebuilt in shared memory from
the counts) and TMA-loads the A and B tiles of
every k-block into a ring of stages (plus, with 1-D bulk copies, the activation scales of the
tile's rows and the expert's row of weight block scales), on one mbarrier per stage. ``BM / 64``
consumer warpgroups each own 64 rows of the ``BM x BN`` tile (``BN`` = 256 when ``N`` allows,
else 128) as ``BN / 128`` chunks of ``m64n128`` WGMMAs. FP8 promotes chunk by chunk, so one
64-register scratch accumulator serves the whole tile, with two weight scales per chunk (one
scale per 8 weight rows, 16 loads and multiplies per chunk, cost 10-20 % of the FP8 throughput;
a global load of the scales in the consumer loop stalled the WGMMA issue); at BLOCK_M 64, whose
one consumer warpgroup has no partner to fill the tensor cores while it promotes, by 64-column
quarters into two 32-register scratch accumulators instead, each promoted while the next quarter's
m64n64 WGMMAs run (``promotion``, `heuristics.DEFAULT_PROMOTION`: both FP8 recipes); fp8xfp8 at
BLOCK_M 128 runs four k-blocks per loop body (``k_unroll``, `heuristics.DEFAULT_K_UNROLL`), so that
the next k-block's stage wait and WGMMAs are scheduled beside a promotion. BF16 keeps one k-block of
WGMMAs in flight. An L1 tile of 256 columns holds 128 features: exactly one requantization group per
row. The epilogue is asynchronous: each consumer warp writes its 16 rows of the tile's output into
its own padded shared-memory staging rows (conflict-free; whole tile rows, or for BF16 a chunk or
half a chunk at a time where that leaves room for one more pipeline stage), and 16 of its lanes send
the valid rows to global memory (or, for L2 with ``combine_layout``, to the combine buffers) with
one 1-D bulk copy each (fp8xfp8 into ``out``: whole 128-byte-swizzled boxes of 16 rows by TMA tensor
stores, ``tma_store``), so the warp goes on to the next tile's WGMMAs while the stores drain (a
direct store from the accumulator layout writes 16 bytes per row per instruction and stalled the
tensor cores for a quarter of an L2 tile). Pad rows beyond an expert's count are never written. In
L2 the second consumer warpgroup starts two k-blocks after the first (``wg_skew``), so the two
epilogues do not leave the tensor cores idle at the same time.

FP4 weights (``fp8xfp4_sm90``: Hopper has no FP4 MMA): ``W`` stays in HBM as packed e2m1
(``[E, N, K/2]`` bytes, two codes per byte) with UE8M0 scales per 32 (``B_group_sf``, int32
``[E, K/128, N]``: a word of four group scales per row and k-block) and f32 block scales
``2**b`` per 128x128 block in the ``B_sf`` layout above. Two rings: warp 0 TMA-loads A and
the scale vectors into the MMA stages (which also hold the decoded weight tile), warp 1 the
packed chunks, the tile rows' scale words and the block scales into packed stages of their own
(3-5, whatever shared memory leaves beside 3 MMA stages), so the weight loads run ahead of the
decode. Decode warpgroups (two at BLOCK_M 64, one at 128) wait for a packed stage and for the
consumers to free its MMA stage (not for A; with ``early_tables`` the first batch's scales,
codes and tables come between the two waits), write the e4m3 weight tile
``e4m3(e2m1 * 2**(s - b))`` into the stage's swizzled B slots (`common.fp4_decode`, bit-exact
with `quant.fp4_weights_to_fp8_blocks`; fixed items per thread, a batch's tables by integer
adds with the float path behind one warp vote, its later items' codes loaded while earlier ones
decode), arrive at the MMA stage's second mbarrier, which the consumers wait for besides the
TMA's, and free the packed stage; then the FP8 mainloop above runs unchanged, the promotion
applying ``2**b``. Half the weight bytes of fp8xfp8. At BLOCK_M 128 the decode bounds the
large-M kernels (with it skipped they took 0.67x the time): in 2-CTA clusters whose two pool
blocks are one expert's, each CTA decodes one 128-row chunk and copies it into the peer's stage
with one bulk shared-memory copy (`send_decoded_chunk`), half the decode per CTA.

Clusters (``cluster_m`` 2, 256-column tiles): the two CTAs of a cluster take neighbouring pool
blocks at the same n-block (``ExpertTileScheduler`` with ``cluster_m``); when both blocks
belong to one expert each CTA TMA-loads one 128-row chunk of the weight tile and multicasts it
to both (half the weight traffic from L2), else each loads its own (FP4 weights: each decodes
one chunk for both, above). Every consumer warp frees
its stage in both CTAs, so the two run in lockstep; a block past the pool's last is a dummy
that computes and writes nothing useful (``valid_m`` 0).

Constraints: ``BM`` in (64, 128); ``K`` a multiple of 128 (FP8) or 64 (BF16); ``N`` a multiple
of 128 (of 256 for FP8 L1 and for clusters); ``P`` a multiple of ``BM``; every tensor 16-byte
aligned. Launched with at most one CTA per SM and a grid that is a multiple of ``cluster_m``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental import primitives as prims
from cutlass.utils import LayoutEnum

from ..config import Sm90GemmConfig
from ..scheduler.device import ExpertTileScheduler
from .common.fp4_decode import decode_e2m1_word, e2m1_table, prmt, vote_tables
from .common.gemm_config import SF_BLOCK, check_gemm_config, combine_target, weight_sf_row_len
from .common.pool import build_pool_prefix
from .common.quant_math import FP8_E4M3_MAX, clamped_silu_mul, requant_exponent
from .common.sync import spin_timeout_ns, wait_reached, wait_stage

RECIPES = ("fp8xfp8", "fp8xfp4_sm90", "bf16xbf16")
WG_N = 128  # columns of one WGMMA chunk (m64n128) of a consumer warpgroup
QUARTER_N = 64  # columns of one WGMMA of the "quarter" promotion (m64n64)
GATE_UP_GROUP = 8  # L1 weight rows: gate, up alternate in groups of 8 (quant.interleave_gate_up)
SMEM_BUDGET = 227 * 1024 - 8192  # H100/H200 per-CTA smem, less small arrays and alignment
ROWS_PER_WARP = 16  # tile rows of one consumer warp (m64 WGMMA: 16 per warp)
STAGING_PAD = 16  # bytes after each staging row: row starts 4 banks apart, conflict-free
MAX_STAGES = 8
OUT_BOX_BYTES = 128  # bytes of a row of one TMA store box (`tma_store`): the swizzle's span
SKEW_BARRIER = 1  # named barrier of the consumer warpgroups' start offset (0: sync_threads)
DECODE_BARRIER = 3  # named barrier of the decode warps (a cluster's shared decode)
# FP4 weights: warpgroups of their own decode the weight tiles, each thread a fixed set of
# items, loaded a batch at a time before any is decoded (one item per thread in flight was
# latency-bound: 1.7x the fp8xfp8 time at decode sizes with 3 warps, 1.2x with 7).
# By consumer warpgroups: (decode warpgroups, registers of the producer warpgroup, of a decode
# warpgroup, of a consumer, items decoded per batch); BLOCK_M 64: 128 x (40 + 2 x 112 + 232)
# = 62K registers; BLOCK_M 128: 128 x (32 + 48) + 256 x 216 = 64K
FP4_WARPGROUPS = {1: (2, 40, 112, 232, 4), 2: (1, 32, 48, 216, 4)}
# FP4: stages of A + decoded weights that the MMA consumes; the rest of shared memory holds
# stages of packed weights, so the TMA runs that many k-blocks ahead of the decode
FP4_MMA_STAGES = 3
# "vote" tables: items whose codes load before the batch's vote, each later item's while the
# item VOTE_AHEAD before it decodes. Measured interleaved on an H200 (docs/performance.md): 1
# took 0.963-0.977x the time of 2 at 128 x 8 and 0.955-0.978x at 128 x 32 (BLOCK_M 64), 0.987-1.01x
# at BLOCK_M 128 and 0.999x at 256 x 256; 0 (each item's right before it) 1.05-1.13x, 3 1.01-1.06x
VOTE_AHEAD = 1
RASTER_L2_BYTES = 16 << 20  # a raster band's activation rows: a third of the H100/H200 L2

PRODUCER_REGS = 40
CONSUMER_REGS = 232


@cute.jit
def smem_words(base: cute.Pointer, offset: Int32) -> cute.Tensor:
    """Four Int32 words at byte ``offset`` (a multiple of 16) of shared memory ``base``, as a
    16-byte-aligned tensor (one 128-bit access)."""
    ptr = cute.make_ptr(Int32, base.toint() + offset, cute.AddressSpace.smem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(4))


class Sm90ExpertGemmKernel:
    """One grouped GEMM of the expert FFN over the pool (see module doc), built from its shapes
    and a complete `config.Sm90GemmConfig` (`heuristics.default_gemm_config`).
    ``combine_layout``: L2 sends its rows to the source ranks' combine buffers of a symmetric
    buffer with this `MegaMoELayout`; ``tiled_weights``: the weights are stored as
    `expert_gemm.tile_weight_rows` makes them; ``smem_reserved``: shared-memory bytes a fused
    kernel's other phases take."""

    #: the consumer of the transposed kernel (`config.Sm90GemmConfig.transposed`)
    transposed = False
    #: the epilogue's staging rows hold whole tile rows (else: in parts where that leaves room
    #: for more stages)
    whole_staging_rows = False

    def __init__(self, phase: str, recipe: str, num_experts: int, num_pool_rows: int, n: int,
                 k: int, config: Sm90GemmConfig, activation_clamp: float | None = None,
                 fast_math: bool = True, combine_layout=None, tiled_weights: bool = False,
                 smem_reserved: int = 0):
        if not isinstance(config, Sm90GemmConfig):
            raise TypeError(f"config: an Sm90GemmConfig, got {type(config).__name__}")
        config.check_complete(type(self).__name__)
        if config.transposed != self.transposed:
            raise ValueError(f"config.transposed: {config.transposed}, but this is "
                             f"{type(self).__name__} (`launch.gemm_kernel` picks the class)")
        self.config = config
        block_m, cluster_m = config.block_m, config.cluster_m
        self.phase, self.recipe = phase, recipe
        # fp8xfp4_sm90: the fp8xfp8 GEMM with MXFP4 weights decoded on chip (see the module doc)
        self.fp4_weights = recipe == "fp8xfp4_sm90"
        self.is_fp8 = recipe in ("fp8xfp8", "fp8xfp4_sm90")
        self.ab_dtype = Float8E4M3FN if self.is_fp8 else BFloat16
        self.block_m, self.block_k = block_m, (128 if self.is_fp8 else 64)
        # 256 columns when N allows (half the A reloads); an FP8 L1 tile must hold one whole
        # requantization group (128 features = 256 interleaved columns)
        self.block_n = 2 * WG_N if (n % (2 * WG_N) == 0 or (phase == "l1" and self.is_fp8)) \
            else WG_N
        self.chunks = self.block_n // WG_N
        self.num_experts, self.num_pool_rows, self.n, self.k = num_experts, num_pool_rows, n, k
        self.clamp = check_gemm_config(
            "sm90", phase, recipe, RECIPES, block_m, (64, 128),
            (("n", n, self.block_n), ("k", k, self.block_k),
             ("num_pool_rows", num_pool_rows, block_m), ("num_experts", num_experts, 1)),
            activation_clamp)
        self.num_n_blocks = n // self.block_n
        # `tiled_weights`: the weights are stored as contiguous [128 rows, k-block] boxes
        # (`expert_gemm.tile_weight_rows`), so that each TMA box of a weight load reads one
        # contiguous run of HBM (16 KB; FP4: 8 KB of packed codes) instead of 128 rows of 128
        # (FP4: 64) bytes
        self.tiled_weights = bool(tiled_weights)
        # L2 rows go to the source ranks' combine buffers (`MegaMoELayout`), not to `out`
        self.to_combine = combine_layout is not None
        # `tma_store` (fp8xfp8 into `out` or the L2 pool, `heuristics.DEFAULT_TMA_STORE`): each
        # consumer warp stages its 16 rows in 128-byte-swizzled boxes of 128-byte rows and sends
        # a warp whose rows all hold tokens with one TMA tensor store per box (L2: 4 per
        # 256-column tile; L1: 1) instead of 16 row copies; a warp with pad rows sends its valid
        # rows from the boxes itself. The tile's 128 row copies held the TMA unit from the next
        # stages' loads
        if config.tma_store and (recipe != "fp8xfp8" or self.to_combine):
            raise ValueError("config.tma_store: the fp8xfp8 GEMMs into `out` only")
        self.tma_store = config.tma_store
        # how a warp sends its staged rows to the combine buffers (L2 with `combine_layout`):
        # "bulk" (the grouped GEMMs' default), a bulk copy per row through the SM's TMA unit;
        # "lanes" (the fused kernel's default, `heuristics.FUSED_ROW_STORES`), the warp's lanes
        # copy each row 16 bytes apart with vector loads and stores, which leaves the TMA unit
        # to the next stages' loads (a tile's 128 row copies held it from them into `out`, "The
        # FP8 epilogue by TMA tensor stores"). The combine's split barrier publishes either (a
        # CTA barrier, then a release at the group's scope)
        if config.row_stores == "lanes" and not self.to_combine:
            raise ValueError("config.row_stores: 'lanes' with combine_layout only")
        self.row_stores = config.row_stores
        # `late_metadata` (set by the fused kernel with counted row transfers, where no grid
        # barrier orders the dispatch's metadata before the GEMMs): a combine target's row
        # metadata is read once the tile's first stage is in (the producer acquired the rows'
        # arrival counts, which follow the metadata, before its loads), not at the tile start
        self.late_metadata = False
        # a tile whose producer finds its pool block not ready (fused kernel) loads its first
        # stages' weights before the wait (`produce`); an A/B option, off
        self.weights_first = False
        if self.to_combine:
            self.combine_offset, self.combine_tokens, self.num_ranks = combine_target(
                phase, n, num_pool_rows, combine_layout)
        self.num_k_blocks = k // self.block_k
        self.out_cols = n // 2 if phase == "l1" else n
        self.fast_math = bool(fast_math)
        # consumer warpgroups, each on 64 rows of the tile and all its 128-column chunks
        self.num_mma_wgs = block_m // 64
        # FP8 promotion: per 128-column chunk after its WGMMAs ("chunk"), or per 64-column
        # quarter into two scratch accumulators, each quarter promoted while the next one's
        # WGMMAs run ("quarter": the tensor cores idle less; the same registers; by BLOCK_M,
        # `heuristics.DEFAULT_PROMOTION`)
        if config.promotion != "chunk" and not self.is_fp8:
            raise ValueError(f"config.promotion: 'chunk', or 'quarter' with FP8; got "
                             f"{config.promotion!r}")
        self.promotion = config.promotion
        self.quarter_promotion = config.promotion == "quarter"
        # k-blocks of the FP8 consumer loop in one loop body (`heuristics.DEFAULT_K_UNROLL`):
        # ptxas then schedules the next k-block's stage wait, scale loads and first WGMMAs
        # beside this one's last promotion (DeepGEMM's loop is unrolled by 8 likewise)
        self.k_unroll = config.k_unroll
        # shared-memory words the consumers exchange row amaxes through (the transposed
        # kernel's L1 epilogue; a placeholder here)
        self.amax_exchange_len = 4
        # (decode_regs: only FP4-weight kernels have decode warpgroups)
        self.decode_wgs = 0
        self.producer_regs, self.decode_regs, self.consumer_regs = \
            PRODUCER_REGS, PRODUCER_REGS, CONSUMER_REGS
        if self.fp4_weights:
            (self.decode_wgs, self.producer_regs, self.decode_regs, self.consumer_regs,
             self.decode_batch) = FP4_WARPGROUPS[self.num_mma_wgs]
        # FP4 weights: how the decode builds a batch's tables. "vote" (the default): the
        # integer adds for every item, the float path behind one warp vote per batch (no
        # per-item branches; the later items' codes load while earlier ones decode,
        # `VOTE_AHEAD`): with two items ahead 0.975-0.986x the time of "item" at the picked
        # BLOCK_M on an H200 (0.999x at 32 x 1024; 0.94x at BLOCK_M 128 and decode sizes), one
        # ahead 0.96-0.98x that again at decode sizes (docs/performance.md); "item": each
        # item's table behind its own branch (the float path for a group more than 5 binades
        # under its block), the fused kernel's FP4 experiment (`heuristics.FUSED_DECODE_TABLES`)
        self.decode_tables = config.decode_tables
        # FP4 weights: the decode warps load a k-block's first batch of scales and codes and
        # build its tables once the packed stage is loaded, before they wait for a free MMA
        # stage (those loads and tables need only the packed stage; after the wait they were
        # 18 % of the decode loop's stall samples, the wait itself 11 %: docs/performance.md;
        # not with clusters, `Sm90GemmConfig` checks)
        self.early_tables = config.early_tables
        self.num_threads = 128 * (1 + self.num_mma_wgs + self.decode_wgs)
        # the warpgroups' setmaxnreg counts must fit what the launch gives the CTA: registers
        # per thread in units of 8, at most 255 (`min_blocks_per_mp=1`)
        launch_regs = min(255, 65536 // self.num_threads) // 8 * 8
        wanted = 128 * (self.producer_regs + self.decode_wgs * self.decode_regs
                        + self.num_mma_wgs * self.consumer_regs)
        assert wanted <= self.num_threads * launch_regs, (wanted, self.num_threads)
        elt = self.ab_dtype.width // 8
        out_elt = elt if phase == "l1" else 2
        # bytes of one output row inside one tile; of the part one consumer warpgroup writes
        self.tile_row_bytes = (self.block_n // 2 if phase == "l1" else self.block_n) * out_elt
        self.out_row_bytes = self.out_cols * out_elt
        # activation scales of the tile's rows; the expert's weight block scales of the k-block
        self.sfa_len, self.sfb_len = block_m, weight_sf_row_len(n)
        # what the TMA brings per stage, and what the stage takes in shared memory. FP4
        # weights: the TMA brings the packed codes and their scale words into stages of their
        # own (`packed_stages`); the decode writes the e4m3 tile into the MMA's stage
        b_tile_bytes = self.block_n * self.block_k * elt
        self.stage_tx_bytes = block_m * self.block_k * elt + (0 if self.fp4_weights
                                                              else b_tile_bytes)
        if self.is_fp8:
            self.stage_tx_bytes += (self.sfa_len + self.sfb_len) * 4
        stage_bytes = self.stage_tx_bytes + (b_tile_bytes if self.fp4_weights else 0)
        # a packed stage: the codes, their rows' per-32 scale words and the k-block's weight
        # block scales (the decode's base exponents; the MMA stage has its own copy)
        self.packed_tx_bytes = (self.block_n * (self.block_k // 2 + 4) + self.sfb_len * 4
                                if self.fp4_weights else 0)

        # `smem_reserved`: bytes a fused kernel's other phases take from the budget
        self.smem_budget = SMEM_BUDGET - smem_reserved

        def stages_fit(parts):  # pipeline stages left beside staging rows of 1/parts tile row
            left = self.smem_budget - self.staging_layout(parts)[1]
            if self.fp4_weights:  # (MMA stages, packed stages), two packed stages at least
                mma = min(FP4_MMA_STAGES, (left - 2 * (self.packed_tx_bytes + 16))
                          // (stage_bytes + 64))
                left -= mma * (stage_bytes + 64)
                return mma, min(MAX_STAGES, left // (self.packed_tx_bytes + 16))
            return min(MAX_STAGES, left // (stage_bytes + 64))

        # BF16: the staging rows hold the whole tile row, or a chunk or half a chunk at a time
        # when that leaves room for more pipeline stages (L2 at BLOCK_M 128: 4 stages instead
        # of 3, +5 %; BF16 keeps a k-block of WGMMAs, so a stage, in flight). FP8: whole rows
        # (the L1 requantization needs both chunks; L2 with half-chunk parts and 4 stages lost
        # 2-7 %: the waits between parts stall the epilogue). Measured interleaved
        # (docs/performance.md). FP4 weights' L2 in parts: its stages also hold the decoded
        # tile (L2 at BLOCK_M 128: 3 stages with quarter rows, else 2). The transposed epilogue
        # writes whole rows.
        whole = self.is_fp8 and (phase == "l1" or not self.fp4_weights)
        choices = (1,) if whole or self.whole_staging_rows else (1, self.chunks, 2 * self.chunks)
        self.staging_parts = 1
        for parts in choices:
            if stages_fit(parts) > stages_fit(self.staging_parts):
                self.staging_parts = parts
        self.staging_stride, self.staging_bytes = self.staging_layout(self.staging_parts)
        fit = (self.smem_budget - self.staging_bytes) // (stage_bytes + 64)
        self.num_stages = min(MAX_STAGES, fit)
        self.packed_stages = 0
        if self.fp4_weights:
            self.num_stages, self.packed_stages = stages_fit(self.staging_parts)
            if self.packed_stages < 2:
                raise ValueError(f"{self.packed_stages} packed stages fit beside "
                                 f"{self.num_stages} stages, fewer than 2")
        if self.num_stages < 2:
            raise ValueError(f"{self.num_stages} stages fit shared memory, fewer than 2")
        # Clusters of 2 CTAs along M share the weight tile: each CTA loads one 128-row chunk and
        # multicasts it to both, when both pool blocks belong to one expert; with FP4 weights
        # each decodes one chunk and copies it into the peer's stage (`decode_weights`)
        if cluster_m == 2 and self.chunks != 2:
            raise ValueError(f"config.cluster_m: 1, or 2 with 256-column tiles, got {cluster_m} "
                             f"with {self.block_n}-column tiles")
        self.cluster_m = cluster_m
        # (the walk finds a tile's expert by galloping, `ExpertTileScheduler.owner_of`)
        self.scheduler = ExpertTileScheduler(num_experts, block_m, self.num_n_blocks, cluster_m,
                                             "gallop")
        # Tiles walk in raster bands of `raster_group` cluster groups of pool blocks (see
        # scheduler.device): the tiles of one n-block of a band are neighbours, so a weight
        # tile comes from DRAM once per band, and a band's activation rows (read once per
        # n-block) stay in L2 when they fit RASTER_L2_BYTES.
        self.raster_group = max(1, RASTER_L2_BYTES // (cluster_m * block_m * k * elt))
        # Consumer warpgroup 1 starts `wg_skew` k-blocks after warpgroup 0 (a named barrier on
        # the first tile), so that the two do not reach a tile's epilogue at the same moment
        # and leave the tensor cores idle together; the stage ring keeps the lag: 2 for L2
        # (short mainloops, a 64 KB epilogue per tile: +1-3 %), 0 for L1 (lost 4-6 % at two of
        # three shapes), measured interleaved (docs/performance.md).
        self.wg_skew = min(2 if phase == "l2" else 0, self.num_stages - 1,
                           self.num_k_blocks - 1) if self.num_mma_wgs == 2 else 0
        # What a fused kernel changes (`share_ring`): the ring's scale-vector strides, the
        # bytes of a stage the ring's mbarriers expect beyond their transaction count, and the
        # readiness of L2 tiles on L1 tiles (`ready_arrivals`: the L1 producer side signals
        # each pool block's counter once per consumer warp per n-block; L2 waits for them)
        self.sfa_stride, self.sfb_stride = self.sfa_len, self.sfb_len
        self.ring_tx_bytes = self.stage_tx_bytes
        self.extra_tx_bytes = 0
        # rows of one TMA box of the tile's A rows: the whole pool block here; the transposed
        # kernel loads 16-row boxes, only those that hold received tokens (`a_boxes`)
        self.a_box_rows = block_m
        # (the same for the packed stages of FP4 weights: their block scales' stride, the
        # stages' transaction count and what this phase expects beyond it)
        self.packed_sfb_stride = self.sfb_len
        self.packed_ring_tx_bytes = self.packed_tx_bytes
        self.extra_packed_tx_bytes = 0
        self.signals_ready = False
        self.waits_ready = 0  # arrivals an L2 tile waits for per pool block (0: no wait)
        # the fused kernel's L1-output ring (`config.Sm90FusedConfig.l1_ring_rows`), in pool
        # blocks (0: none, block b's rows at pool block b): L1 stores block b's rows and scales
        # at slot b mod ring_blocks once ``ready[b - ring_blocks]`` reaches `ring_reads` (the
        # L1 signals and one per L2 tile that loaded its rows); L2 loads them from the slot and
        # adds that one per tile once its loads are complete
        self.ring_blocks = 0
        self.ring_reads = 0
        # where the tile's rows are: pool block b's in slot b mod a_ring_blocks of ``a`` (0: at
        # b): L2's the L1-output ring's, L1's the fused kernel's received-rows ring
        # (`MegaMoELayout.received_rows`)
        self.a_ring_blocks = 0
        # rows of ``a`` and ``out`` (and the row strides of their scales): the pool's, but the
        # fused kernel's received rows and L1 outputs may live in regions of fewer
        # (`MegaMoELayout.received_rows`: L1's ``a``; `l1_output_rows`: L1's ``out``, L2's ``a``)
        self.a_rows = self.out_rows = num_pool_rows
        self.timeout_ns = spin_timeout_ns()
        # bounded stage waits with stall reports in every role (`bounded_stage_wait`; the
        # fused kernel's FP4 experiment sets it)
        self.stage_reports = False
        # the scope of the fused kernel's cross-rank flags this phase waits on (the dispatch's
        # row arrivals: `sync.group_scope`, set by the fused kernel)
        self.sync_scope = "sys"

    # ------------------------------------------------------------------------------ host side
    def tile_signals(self) -> int:
        """Arrivals at a pool block's readiness counter once all of this phase's tiles of the
        block are done (`signals_ready`): one per consumer warp per n-block."""
        return self.num_n_blocks * self.num_mma_wgs * 4

    def raw_b_bytes(self) -> int:
        """Shared-memory bytes of the packed FP4 weight chunks' stages (a token 128 else)."""
        if not self.fp4_weights:
            return 128
        return self.packed_stages * self.chunks * WG_N * self.b_load_k()

    def sfg_len(self) -> int:
        """Int32 words of the ring's per-32 weight scales: a word (four groups) per weight row
        of the tile per packed stage (FP4; a token 4 else)."""
        return self.packed_stages * self.block_n if self.fp4_weights else 4

    def staging_layout(self, parts: int) -> tuple[int, int]:
        """(row stride, total bytes) of the consumer warps' staging rows when they hold
        ``1 / parts`` of their warpgroup's part of a tile's output row (`tma_store`: whole rows,
        unpadded: the swizzled boxes)."""
        if self.tma_store:
            return self.tile_row_bytes, 4 * self.num_mma_wgs * ROWS_PER_WARP * self.tile_row_bytes
        stride = self.tile_row_bytes // parts + STAGING_PAD
        return stride, 4 * self.num_mma_wgs * ROWS_PER_WARP * stride

    def _smem_layout(self, rows: int, slots: int):
        """``slots`` swizzled K-major ``rows x BK`` tiles (B: chunk ``c`` of stage ``s`` is slot
        ``s * chunks + c``)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.ab_dtype, self.block_k),
            self.ab_dtype)
        return cute.tile_to_shape(atom, (rows, self.block_k, slots), order=(0, 1, 2))

    def mma_and_stage_layouts(self):
        """The consumer warpgroups' tiled WGMMA and the ring's A and B shared-memory layouts
        (host side of a `cute.jit` function)."""
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K, Float32, (self.block_m // 64, 1, 1),
            tiler_mn=(64, WG_N))
        a_layout = self._smem_layout(self.block_m, self.num_stages)
        b_layout = self._smem_layout(WG_N, self.num_stages * self.chunks)
        return tiled_mma, a_layout, b_layout

    def out_boxes_layout(self):
        """`tma_store`: the consumer warps' staging rows as TMA store boxes, ``[16 rows, 128
        bytes of columns, consumer warp * boxes per row + box]`` of the output dtype, 128-byte
        swizzled (a row's 16-byte unit ``u`` of a box at ``u ^ (row % 8)``; 2 KB per box)."""
        dtype = self.out_dtype()
        cols = OUT_BOX_BYTES * 8 // dtype.width
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
        boxes = 4 * self.num_mma_wgs * (self.tile_row_bytes // OUT_BOX_BYTES)
        return cute.tile_to_shape(atom, (ROWS_PER_WARP, cols, boxes), order=(0, 1, 2))

    def out_dtype(self):
        """The element type of ``out``: the L2 pool's (L1) or BF16 (L2)."""
        return self.ab_dtype if self.phase == "l1" else BFloat16

    def tma_store_out(self, out: cute.Pointer):
        """`tma_store`: the TMA atom and tensor of ``out`` ``[P, out_cols]`` in boxes of 16 rows
        x 128 bytes (host side of a `cute.jit` function)."""
        m_out = cute.make_tensor(out, cute.make_layout((self.out_rows, self.out_cols),
                                                       stride=(self.out_cols, 1)))
        box = cute.slice_(self.out_boxes_layout(), (None, None, 0))
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), m_out, box,
                                           (ROWS_PER_WARP, cute.size(box, mode=[1])))

    def b_load_k(self) -> int:
        """Elements of the TMA's weight box along K: a k-block, or its bytes of packed FP4."""
        return self.block_k // 2 if self.fp4_weights else self.block_k

    def raw_b_layout(self):
        """FP4 weights: the packed weight chunks as TMA writes them, ``[128 rows, 64 bytes,
        packed stage * chunks + chunk]`` (no swizzle: the decode reads 16 bytes per lane, rows
        of 64 bytes, conflict-free)."""
        k2 = self.b_load_k()
        return cute.make_layout((WG_N, k2, self.packed_stages * self.chunks),
                                stride=(k2, 1, WG_N * k2))

    def tma_loads(self, a: cute.Pointer, b: cute.Pointer, a_layout, b_layout):
        """TMA atoms and tensors of the A pool ``[P, K]`` and the weights ``[E * N, K]`` (FP4:
        their packed bytes ``[E * N, K / 2]`` into `raw_b_layout`) (host side of a `cute.jit`
        function): ``(tma_a, m_a, tma_b, m_b)``."""
        m_a = cute.make_tensor(a, cute.make_layout((self.a_rows, self.k),
                                                   stride=(self.k, 1)))
        m_b = self.weight_tensor(b)
        tma_a, tma_m_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_a,
            cute.slice_(self._smem_layout(self.a_box_rows, 1), (None, None, 0)),
            (self.a_box_rows, self.block_k))
        b_slot = cute.slice_(self.raw_b_layout() if self.fp4_weights else b_layout,
                             (None, None, 0))
        tma_b, tma_m_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_b, b_slot, (WG_N, self.b_load_k()))
        return tma_a, tma_m_a, tma_b, tma_m_b

    def tma_multicast_b(self, b: cute.Pointer, b_layout):
        """The TMA atom that multicasts a weight tile chunk to both CTAs of a cluster (host
        side of a `cute.jit` function)."""
        atom, _ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp(), self.weight_tensor(b),
            cute.slice_(b_layout, (None, None, 0)), (WG_N, self.block_k))
        return atom

    def weight_tensor(self, b: cute.Pointer) -> cute.Tensor:
        """The weights ``[E * N, K]`` (FP4: their packed bytes ``[E * N, K / 2]``) as a tensor
        of (row, k) coordinates: rows of K elements, or with `tiled_weights` contiguous
        ``[128 rows, k-block]`` boxes, a row block's k-blocks one after the other."""
        rows, k_b = self.num_experts * self.n, self.k // 2 if self.fp4_weights else self.k
        if self.tiled_weights:
            bk = self.b_load_k()
            return cute.make_tensor(b, cute.make_layout(
                ((WG_N, rows // WG_N), (bk, k_b // bk)),
                stride=((bk, WG_N * k_b), (1, WG_N * bk))))
        return cute.make_tensor(b, cute.make_layout((rows, k_b), stride=(k_b, 1)))

    @cute.jit
    def __call__(
        self,
        a: cute.Pointer,  # [P, K] e4m3 / bf16: the L1 or L2 pool
        a_sf: cute.Pointer,  # f32 [K/128, P] (fp8)
        b: cute.Pointer,  # [E, N, K] e4m3 / bf16
        b_sf: cute.Pointer,  # f32 [E, K/128, weight_sf_row_len(N)] (fp8)
        expert_recv_tokens: cute.Pointer,  # Int32 [E]
        topk_weights: cute.Pointer,  # f32 [P] (l1)
        out: cute.Pointer,  # l1: [P, N/2] e4m3 / bf16; l2: bf16 [P, N] (unless to_combine)
        out_sf: cute.Pointer,  # f32 [N/256, P] (l1 fp8)
        peer_bases: cute.Pointer,  # Int64 [R]: the symmetric buffers (to_combine)
        src_metadata: cute.Pointer,  # Int32 [P, 4]: (rank, token, slot, 0) (to_combine)
        b_group_sf: cute.Pointer,  # Int32 [E, K/128, N]: UE8M0 per 32 (fp8xfp4_sm90)
        num_ctas: Int32,
        stream,
    ):
        tiled_mma, a_layout, b_layout = self.mma_and_stage_layouts()
        tma_a, tma_m_a, tma_b, tma_m_b = self.tma_loads(a, b, a_layout, b_layout)
        tma_b_mc = tma_b
        if cutlass.const_expr(self.cluster_m > 1):
            tma_b_mc = self.tma_multicast_b(b, b_layout)
        tma_out, tma_m_out = tma_a, tma_m_a  # (stand-ins without `tma_store`)
        if cutlass.const_expr(self.tma_store):
            tma_out, tma_m_out = self.tma_store_out(out)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, self.num_stages * 2]
            packed_mbar: cute.struct.MemRange[Int64, max(1, self.packed_stages * 2)]
            block_start: cute.struct.MemRange[Int32, self.num_experts + 1]
            row_start: cute.struct.MemRange[Int32, self.num_experts + 1]
            sfa: cute.struct.Align[
                cute.struct.MemRange[Float32, self.num_stages * self.sfa_stride], 16]
            sfb: cute.struct.Align[
                cute.struct.MemRange[Float32, self.num_stages * self.sfb_stride], 16]
            sa: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_layout)],
                                  1024]
            sb: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_layout)],
                                  1024]
            staging: cute.struct.Align[cute.struct.MemRange[Uint8, self.staging_bytes],
                                       1024 if self.tma_store else 128]
            raw_b: cute.struct.Align[cute.struct.MemRange[Uint8, self.raw_b_bytes()], 128]
            sfg: cute.struct.Align[cute.struct.MemRange[Int32, self.sfg_len()], 16]
            sfb_packed: cute.struct.Align[cute.struct.MemRange[
                Float32, max(4, self.packed_stages * self.packed_sfb_stride)], 16]
            decoded: cute.struct.MemRange[Int64, self.num_stages]
            # (the transposed kernel's L1 token amaxes)
            amax_exchange: cute.struct.MemRange[Float32, self.amax_exchange_len]

        self.shared_storage = SharedStorage
        self.kernel(tiled_mma, tma_a, tma_m_a, tma_b, tma_b_mc, tma_m_b, a_layout, b_layout,
                    a_sf, b_sf,
                    cute.make_tensor(expert_recv_tokens, cute.make_layout(self.num_experts)),
                    topk_weights, out, out_sf, peer_bases, src_metadata, b_group_sf, tma_out,
                    tma_m_out).launch(
            grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1],
            cluster=[self.cluster_m, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ---------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, m_a: cute.Tensor,
               tma_b: cute.CopyAtom, tma_b_mc: cute.CopyAtom, m_b: cute.Tensor,
               a_layout: cute.ComposedLayout,
               b_layout: cute.ComposedLayout, a_sf: cute.Pointer, b_sf: cute.Pointer,
               expert_recv_tokens: cute.Tensor, topk_weights: cute.Pointer, out: cute.Pointer,
               out_sf: cute.Pointer, peer_bases: cute.Pointer, src_metadata: cute.Pointer,
               b_group_sf: cute.Pointer, tma_out: cute.CopyAtom, m_out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # the scheduler walks cluster tiles; rank: this CTA's pool block within the cluster's
        rank = Int32(0)
        if cutlass.const_expr(self.cluster_m > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster = bidx // self.cluster_m
        num_clusters = grid // self.cluster_m
        raster_group = Int32(self.raster_group)
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        block_start, row_start, sfa, sfb, sa = self.stage_tensors(storage, a_layout)
        sb = storage.sb.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        staging = storage.staging.data_ptr()
        # what the TMA writes the weights into: the MMA's tiles, or the packed FP4 chunks
        sb_load = sb
        if cutlass.const_expr(self.fp4_weights):
            sb_load = storage.raw_b.get_tensor(self.raw_b_layout())

        ab_pipe = self.mma_pipeline(storage.mbar.data_ptr())
        packed_pipe = self.packed_pipeline(storage.packed_mbar.data_ptr())
        if warp == 0:
            build_pool_prefix(expert_recv_tokens, row_start, block_start, self.num_experts,
                              self.block_m)
        if cutlass.const_expr(self.fp4_weights):
            self.init_decoded_barriers(storage.decoded.data_ptr(), tidx)
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.cluster_m > 1):
            cute.arch.cluster_arrive()  # the peer's barriers exist before any multicast
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        num_tiles = self.scheduler.num_tiles(block_start)
        wg = warp // 4
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self.producer_warps(warp, lane, tma_a, m_a, tma_b, tma_b_mc, m_b, sa, sb_load, sfa,
                                sfb, a_sf, b_sf, b_group_sf, storage, ab_pipe, packed_pipe,
                                block_start, row_start, num_tiles, cluster, num_clusters,
                                raster_group, rank)
        elif self.is_decode_wg(wg):  # the decode warpgroups (FP4 weights)
            cute.arch.setmaxregister_decrease(self.decode_regs)
            self.decode_weights(ab_pipe, packed_pipe, storage.raw_b.data_ptr(),
                                storage.sb.data_ptr(), storage.sfb_packed.data_ptr(),
                                storage.sfg.data_ptr(),
                                storage.decoded.data_ptr(), block_start, row_start, num_tiles,
                                cluster, num_clusters, raster_group,
                                tidx - 128 * (1 + self.num_mma_wgs), lane,
                                *self.decode_states(), rank=rank)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.num_stages)
            stores = {}
            if cutlass.const_expr(self.tma_store):
                boxes = self.out_boxes_layout()
                stores["out_store"] = (tma_out, m_out, storage.staging.get_tensor(
                    boxes.outer, swizzle=boxes.inner, dtype=self.out_dtype()))
            self.consume(tiled_mma, sa, sb, sfa, sfb, ab_pipe, block_start, row_start,
                         num_tiles, cluster, num_clusters, raster_group, rank, wg - 1,
                         warp % 4, lane,
                         topk_weights, out, out_sf, peer_bases, src_metadata,
                         self.consumer_staging(staging, warp - 4), state,
                         state.clone(), decoded=storage.decoded.data_ptr(),
                         exchange=storage.amax_exchange.data_ptr(), **stores)
        if cutlass.const_expr(self.cluster_m > 1):
            cute.arch.cluster_arrive()  # no CTA leaves while its peer may still signal it
            cute.arch.cluster_wait()

    @cute.jit
    def producer_warps(self, warp: Int32, lane: Int32, tma_a, m_a, tma_b, tma_b_mc, m_b, sa,
                       sb_load, sfa, sfb, a_sf: cute.Pointer, b_sf: cute.Pointer,
                       b_group_sf: cute.Pointer, storage, ab_pipe, packed_pipe, block_start,
                       row_start, num_tiles: Int32, first_tile: Int32, num_clusters: Int32,
                       raster_group: Int32, rank: Int32):
        """Warp 0 fills the MMA stages (`produce`), warp 1 with FP4 weights the packed stages
        (`produce_packed`, into ``sb_load``); each then waits until its last stages were
        consumed."""
        if warp == 0:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.num_stages)
            state, _ = self.produce(tma_a, m_a, tma_b, tma_b_mc, m_b, sa, sb_load, sfa, sfb,
                                    a_sf, b_sf, ab_pipe, block_start, row_start, num_tiles,
                                    first_tile, num_clusters, raster_group, rank, lane, state)
            ab_pipe.producer_tail(state)
        elif cutlass.const_expr(self.fp4_weights):
            if warp == 1:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.packed_stages)
                state, _ = self.produce_packed(
                    tma_b, m_b, sb_load, packed_pipe, b_sf, b_group_sf,
                    storage.sfb_packed.data_ptr(), storage.sfg.data_ptr(), block_start,
                    row_start, num_tiles, first_tile, num_clusters, raster_group, lane, state,
                    rank=rank)
                packed_pipe.producer_tail(state)

    def consumer_staging(self, staging: cute.Pointer, consumer_warp):
        """Consumer warp ``consumer_warp``'s staging rows (`ROWS_PER_WARP` of them)."""
        return staging + consumer_warp * (ROWS_PER_WARP * self.staging_stride)

    @cute.jit
    def stage_tensors(self, storage, a_layout: cute.ComposedLayout):
        """The pool prefix arrays (``block_start``, ``row_start``), the ring's scale vectors
        and its A tiles in shared memory."""
        block_start = storage.block_start.get_tensor(cute.make_layout(self.num_experts + 1))
        row_start = storage.row_start.get_tensor(cute.make_layout(self.num_experts + 1))
        sfa, sfb = self.scale_stages(storage.sfa.data_ptr(), storage.sfb.data_ptr())
        sa = storage.sa.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        return block_start, row_start, sfa, sfb, sa

    def mma_pipeline(self, barriers: cute.Pointer):
        """The MMA stages' pipeline: TMA in; every consumer warp frees a stage in each CTA of
        the cluster (the peer's multicast writes into this CTA's stages too)."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers, num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.cluster_m * self.num_mma_wgs * 4),
            tx_count=self.ring_tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)), defer_sync=True)

    @cute.jit
    def scale_stages(self, sfa_ptr: cute.Pointer, sfb_ptr: cute.Pointer):
        """The ring's activation and weight scale vectors in shared memory, ``[len, stage]``."""
        sfa = cute.make_tensor(sfa_ptr, cute.make_layout((self.sfa_len, self.num_stages),
                                                         stride=(1, self.sfa_stride)))
        sfb = cute.make_tensor(sfb_ptr, cute.make_layout((self.sfb_len, self.num_stages),
                                                         stride=(1, self.sfb_stride)))
        return sfa, sfb

    @cute.jit
    def produce(self, tma_a, m_a, tma_b, tma_b_mc, m_b, sa, sb, sfa, sfb, a_sf: cute.Pointer,
                b_sf: cute.Pointer, ab_pipe, block_start, row_start, num_tiles: Int32,
                first_tile: Int32, num_clusters: Int32, raster_group: Int32, rank: Int32,
                lane: Int32, state, ready: cute.Pointer = None,
                barrier_slots: cute.Pointer = None, tile_log: cute.Pointer = None,
                log_first: Int32 = 0, rows_arrived: cute.Pointer = None,
                arrivals_per_row: cutlass.Constexpr = 1, preloaded: Int32 = None,
                owner_hint: Int32 = None):
        """Warp 0: TMA-load the A/B tiles (and scale vectors) of every k-block of tiles
        ``first_tile``, ``first_tile + num_clusters``, ... ``< num_tiles`` (FP4 weights: A and
        the scale vectors; `produce_packed` loads the weights); in a cluster whose
        two pool blocks share an expert, only chunk ``rank`` of B, to both CTAs. ``state``: the
        ring's producer state. With ``rows_arrived`` (L1 of the fused kernel: the dispatch's
        `pool_block_arrivals`), a tile's loads start once its pool block's counter reaches
        ``arrivals_per_row`` per valid row. With ``waits_ready`` (L2 of the fused kernel), a
        tile's loads start once ``ready[pool_block]`` (the L1 tiles of the block done) reaches
        it. A tile that waits for its pool block loads the weights of its first stages before
        the wait (they depend on nothing; FP8 and BF16 weights, whose B this warp loads).
        ``preloaded``: the weights of that many first stages of tile ``first_tile`` were loaded
        already (`load_first_weights`, from ``state`` on); their rows follow once the block is
        ready. With ``tile_log`` (a diagnostic of the fused kernel): the CTA's ``i``-th tile of
        this walk is recorded as ``(phase 1 | 2, pool block, n-block, valid rows)`` at entry
        ``(log_first + i) * grid + CTA`` (int32 x 4). Returns ``(state, the first tile index
        past num_tiles)``; with ``owner_hint`` (an expert at or before the first tile's, as
        `ExpertTileScheduler.owner_of` takes it, instead of 0) the last tile's owner too."""
        g_a = cute.local_tile(m_a, (self.a_box_rows, self.block_k), (None, None))
        # (the stages as A boxes: box t of stage s is slot s * boxes per block + t, the same
        # bytes and swizzle atoms as `sa`)
        sa_boxes = sa
        if cutlass.const_expr(self.a_box_rows != self.block_m):
            sa_boxes = cute.make_tensor(sa.iterator, self._smem_layout(
                self.a_box_rows, self.num_stages * self.block_m // self.a_box_rows).outer)
        t_sa, t_ga = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sa_boxes, 0, 2),
                                           cute.group_modes(g_a, 0, 2))
        t_sb, t_gb, t_sb_mc, t_gb_mc = self.weight_partitions(tma_b, tma_b_mc, m_b, sb)
        b_blocks_per_expert = self.n // WG_N
        tile = first_tile
        owner = Int32(0)
        if cutlass.const_expr(owner_hint is not None):
            owner = owner_hint
        while tile < num_tiles:
            owner, multicast, expert, n_block, pool_block, valid_m = self.pair_tile(
                tile, owner, block_start, row_start, raster_group, rank)
            if cutlass.const_expr(tile_log is not None):
                self.log_tile(tile_log, log_first + (tile - first_tile) // num_clusters,
                              pool_block, n_block, valid_m, lane)
            b_block = expert * b_blocks_per_expert + n_block * self.chunks
            a_block = pool_block  # (where the block's rows are: their ring slot)
            if cutlass.const_expr(self.a_ring_blocks > 0):
                a_block = pool_block % self.a_ring_blocks
            # a dummy block may lie past the pool: TMA fills zeros, the scale copy must not read
            # past the scale tensor
            sf_block = cutlass.min(a_block, Int32(self.a_rows // self.block_m - 1))
            # `weights_first`: a tile whose pool block is not ready yet first loads the weights
            # of the stages it can take (they depend on nothing), then waits, then loads their
            # A; a ready tile loads A and B stage by stage (weights first there would delay its
            # first stage by the others' weights)
            gated = rows_arrived is not None or self.waits_ready > 0
            prefill = min(self.num_stages, self.num_k_blocks) if gated and not \
                self.fp4_weights and self.weights_first else 0
            early = preloaded is not None
            n_pre = Int32(0)  # stages loaded weights first (0 .. prefill, or `preloaded`)
            n_loaded = Int32(0)  # of them, those `load_first_weights` loaded
            a_state = None
            if cutlass.const_expr(prefill > 0 or early):
                a_state = state.clone()
            if cutlass.const_expr(early):
                if tile == first_tile:
                    n_pre = preloaded
                    n_loaded = preloaded
                    for _kb in cutlass.range(n_loaded):
                        state.advance()
            if cutlass.const_expr(prefill > 0):
                if cutlass.const_expr(rows_arrived is not None):
                    gate, target = rows_arrived + pool_block, valid_m * arrivals_per_row
                else:
                    gate, target = ready + pool_block, Int32(self.waits_ready)
                # (a hint: the wait below acquires. Lane 0 reads it and the warp takes its
                # answer, so that every lane loads the same stages)
                seen = Int32(0)
                if lane == 0:
                    seen = cute.arch.load(gate, Int32, sem="relaxed", scope="gpu")
                if n_pre == 0 and cute.arch.shuffle_sync(seen, 0) - target < 0:
                    n_pre = Int32(prefill)
                for kb in cutlass.range(n_loaded, n_pre):
                    bar = self.acquire_stage(ab_pipe, state, self.extra_tx_bytes, lane,
                                             barrier_slots)
                    self.load_weights(tma_b, tma_b_mc, t_gb, t_sb, t_gb_mc, t_sb_mc, sfb, b_sf,
                                      multicast, b_block, expert, rank, kb, state.index, bar,
                                      lane)
                    state.advance()
            if cutlass.const_expr(rows_arrived is not None):
                if valid_m > 0:
                    # senders on every rank release their rows' counts at the group's scope;
                    # the rows came through generic stores, the TMA loads read through the
                    # async proxy
                    wait_reached(barrier_slots, rows_arrived + pool_block,
                                 valid_m * arrivals_per_row, self.sync_scope,
                                 "rows of a pool block (pool_block_arrivals)", self.timeout_ns)
                    cute.arch.fence_proxy("async.global")
            if cutlass.const_expr(self.waits_ready > 0):
                wait_reached(barrier_slots, ready + pool_block, Int32(self.waits_ready), "gpu",
                             "L1 tiles of a pool block", self.timeout_ns)
                # the L1 rows came through bulk (async proxy) stores and generic stores; the
                # acquire above is generic: order the TMA loads below after it
                cute.arch.fence_proxy("async.global")
            if cutlass.const_expr(prefill > 0 or early):
                for kb in cutlass.range(n_pre):
                    self.load_rows(tma_a, t_ga, t_sa, sfa, a_sf, a_block, sf_block, kb,
                                   a_state.index, ab_pipe.producer_get_barrier(a_state), lane,
                                   valid_m)
                    ab_pipe.producer_commit(a_state)
                    a_state.advance()
            for kb in cutlass.range(n_pre, self.num_k_blocks):
                bar = self.acquire_stage(ab_pipe, state, self.extra_tx_bytes, lane,
                                         barrier_slots)
                self.load_rows(tma_a, t_ga, t_sa, sfa, a_sf, a_block, sf_block, kb,
                               state.index, bar, lane, valid_m)
                if cutlass.const_expr(not self.fp4_weights):
                    self.load_weights(tma_b, tma_b_mc, t_gb, t_sb, t_gb_mc, t_sb_mc, sfb, b_sf,
                                      multicast, b_block, expert, rank, kb, state.index, bar,
                                      lane)
                elif cutlass.const_expr(self.is_fp8):  # (FP4: warp 1 loads the weights)
                    self.load_weight_scales(sfb, b_sf, expert, kb, state.index, bar, lane)
                ab_pipe.producer_commit(state)
                state.advance()
            tile += num_clusters
        if cutlass.const_expr(owner_hint is not None):
            return state, tile, owner
        return state, tile

    @cute.jit
    def weight_partitions(self, tma_b, tma_b_mc, m_b, sb):
        """The TMA views of the weights and of the ring's weight stages, per 128-row chunk and
        k-block: ``(t_sb, t_gb, t_sb_mc, t_gb_mc)`` (the last two for the cluster multicast)."""
        g_b = cute.local_tile(m_b, (WG_N, self.b_load_k()), (None, None))
        t_sb, t_gb = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(sb, 0, 2), cute.group_modes(g_b, 0, 2))
        t_sb_mc, t_gb_mc = cpasync.tma_partition(tma_b_mc, 0, cute.make_layout(1),
                                                 cute.group_modes(sb, 0, 2),
                                                 cute.group_modes(g_b, 0, 2))
        return t_sb, t_gb, t_sb_mc, t_gb_mc

    @cute.jit
    def load_first_weights(self, tma_b, tma_b_mc, m_b, sb, sfb, b_sf: cute.Pointer, ab_pipe,
                           block_start, row_start, num_tiles: Int32, first_tile: Int32,
                           raster_group: Int32, lane: Int32, state):
        """Warp 0, before its pool block's rows can be there (the fused kernel, right after the
        counts): the weights of the first stages of tile ``first_tile`` into the ring from
        ``state`` on (FP8 and BF16 weights, no clusters). Returns how many stages (0: no tile),
        for `produce`'s ``preloaded``; ``state`` itself does not move."""
        t_sb, t_gb, t_sb_mc, t_gb_mc = self.weight_partitions(tma_b, tma_b_mc, m_b, sb)
        stages = min(self.num_stages, self.num_k_blocks)
        n = Int32(0)
        if first_tile < num_tiles:
            _o, multicast, expert, n_block, _b, _v = self.pair_tile(
                first_tile, Int32(0), block_start, row_start, raster_group, Int32(0))
            b_block = expert * (self.n // WG_N) + n_block * self.chunks
            st = state.clone()
            for kb in cutlass.range(stages):
                bar = self.acquire_stage(ab_pipe, st, self.extra_tx_bytes, lane)
                self.load_weights(tma_b, tma_b_mc, t_gb, t_sb, t_gb_mc, t_sb_mc, sfb, b_sf,
                                  multicast, b_block, expert, Int32(0), kb, st.index, bar, lane)
                st.advance()
            n = Int32(stages)
        return n

    @cute.jit
    def load_rows(self, tma_a, t_ga, t_sa, sfa, a_sf: cute.Pointer, pool_block: Int32,
                  sf_block: Int32, kb: Int32, stage: Int32, bar, lane: Int32, valid_m: Int32):
        """Warp 0: k-block ``kb`` of the tile's rows (and FP8: their scales) into ``stage``;
        in boxes of `a_box_rows`, `a_boxes` of them (the stage's barrier expects one box in
        its transaction count, the others here, before any is issued)."""
        per_block = self.block_m // self.a_box_rows
        if cutlass.const_expr(per_block == 1):
            cute.copy(tma_a, t_ga[(None, pool_block, kb)], t_sa[(None, stage)], tma_bar_ptr=bar)
        else:
            boxes = self.a_boxes(valid_m)
            if boxes > 1:
                if lane == 0:
                    cute.arch.mbarrier_expect_tx(
                        bar, (boxes - 1) * (self.a_box_rows * self.block_k
                                            * (self.ab_dtype.width // 8)))
                cute.arch.sync_warp()
            for t in cutlass.range(boxes):
                cute.copy(tma_a, t_ga[(None, pool_block * per_block + t, kb)],
                          t_sa[(None, stage * per_block + t)], tma_bar_ptr=bar)
        if cutlass.const_expr(self.is_fp8):
            if lane == 0:
                prims.cp_async_bulk_shared_cluster_global(
                    sfa.iterator + stage * self.sfa_stride,
                    a_sf + (Int64(kb) * self.a_rows + sf_block * self.block_m),
                    bar, Int32(self.sfa_len * 4))

    @cute.jit
    def a_boxes(self, valid_m: Int32) -> Int32:
        """A boxes a tile with ``valid_m`` rows loads per k-block (`a_box_rows` < BLOCK_M
        only): the boxes that hold its rows, at least one."""
        return cutlass.max((valid_m + self.a_box_rows - 1) // self.a_box_rows, Int32(1))

    @cute.jit
    def load_weight_scales(self, sfb, b_sf: cute.Pointer, expert: Int32, kb: Int32,
                           stage: Int32, bar, lane: Int32):
        """Warp 0: the expert's row of weight block scales of k-block ``kb`` into ``stage``."""
        if lane == 0:
            prims.cp_async_bulk_shared_cluster_global(
                sfb.iterator + stage * self.sfb_stride,
                b_sf + (Int64(expert) * self.num_k_blocks + kb) * self.sfb_len,
                bar, Int32(self.sfb_len * 4))

    @cute.jit
    def load_weights(self, tma_b, tma_b_mc, t_gb, t_sb, t_gb_mc, t_sb_mc, sfb,
                     b_sf: cute.Pointer, multicast, b_block: Int32, expert: Int32, rank: Int32,
                     kb: Int32, stage: Int32, bar, lane: Int32):
        """Warp 0: k-block ``kb`` of the weight tile (FP8 and BF16 weights; in a cluster whose
        blocks share the expert, chunk ``rank`` to both CTAs) and FP8: its block scales."""
        if cutlass.const_expr(self.cluster_m > 1):
            if multicast:
                cute.copy(tma_b_mc, t_gb_mc[(None, b_block + rank, kb)],
                          t_sb_mc[(None, stage * self.chunks + rank)],
                          tma_bar_ptr=bar, mcast_mask=cutlass.Int16(0b11))
            else:
                self.load_b(tma_b, t_gb, t_sb, b_block, kb, stage, bar)
        else:
            self.load_b(tma_b, t_gb, t_sb, b_block, kb, stage, bar)
        if cutlass.const_expr(self.is_fp8):
            self.load_weight_scales(sfb, b_sf, expert, kb, stage, bar, lane)

    @cute.jit
    def pair_tile(self, tile: Int32, owner: Int32, block_start, row_start, raster_group: Int32,
                  rank: Int32):
        """This CTA's part of cluster tile ``tile`` (`ExpertTileScheduler.tile` at ``rank``) and
        whether both pool blocks of the cluster belong to one expert, so that the pair shares
        the weight tile (False without clusters): ``(owner, shared, expert, n_block,
        pool_block, valid_m)``."""
        shared = cutlass.Boolean(False)
        if cutlass.const_expr(self.cluster_m > 1):
            owner, e0, _m0, _n0, _b0, _v0 = self.scheduler.tile(
                tile, owner, block_start, row_start, raster_group, Int32(0))
            _o, e1, _m1, _n1, _b1, v1 = self.scheduler.tile(
                tile, owner, block_start, row_start, raster_group, Int32(1))
            shared = v1 > 0 and e0 == e1
        owner, expert, _m, n_block, pool_block, valid_m = self.scheduler.tile(
            tile, owner, block_start, row_start, raster_group, rank)
        return owner, shared, expert, n_block, pool_block, valid_m

    @cute.jit
    def produce_packed(self, tma_b, m_b, raw_b: cute.Tensor, packed_pipe, b_sf: cute.Pointer,
                       b_group_sf: cute.Pointer, sfb: cute.Pointer, sfg: cute.Pointer,
                       block_start, row_start, num_tiles: Int32, first_tile: Int32,
                       num_clusters: Int32, raster_group: Int32, lane: Int32, state,
                       barrier_slots: cute.Pointer = None, rank: Int32 = None):
        """Warp 1 (FP4 weights): TMA-load the packed weight chunks, their rows' per-32 scale
        words and the k-block's weight block scales of every k-block of tiles ``first_tile``,
        ``first_tile + num_clusters``, ... ``< num_tiles`` (in a cluster, of this CTA's pool
        block ``rank``; of a pair that shares the decode, chunk ``rank`` only) into the packed
        stages, running up to `packed_stages` k-blocks ahead of the decode (the weights wait for
        nothing). ``state``: the packed stages' producer state; ``barrier_slots``: see
        `bounded_stage_wait`. Returns ``(state, the first tile index past num_tiles)``."""
        g_b = cute.local_tile(m_b, (WG_N, self.b_load_k()), (None, None))
        t_sb, t_gb = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(raw_b, 0, 2),
                                           cute.group_modes(g_b, 0, 2))
        b_blocks_per_expert = self.n // WG_N
        if cutlass.const_expr(rank is None):
            rank = Int32(0)
        # (a cluster's shared decode reads chunk `rank` only: the other chunk's codes are not
        # loaded, and their bytes are taken off the stage's transaction count; 0.98-0.995x the
        # time of loading both, docs/performance.md)
        chunk_bytes = WG_N * self.block_k // 2
        tile = first_tile
        owner = Int32(0)
        while tile < num_tiles:
            owner, shared, expert, n_block, _b, _v = self.pair_tile(
                tile, owner, block_start, row_start, raster_group, rank)
            b_block = expert * b_blocks_per_expert + n_block * self.chunks
            for kb in cutlass.range(self.num_k_blocks):
                bar = self.acquire_stage(packed_pipe, state, self.extra_packed_tx_bytes, lane,
                                         barrier_slots,
                                         "a free packed weight stage (packed loads)")
                if cutlass.const_expr(self.cluster_m > 1):
                    if shared:
                        cute.copy(tma_b, t_gb[(None, b_block + rank, kb)],
                                  t_sb[(None, state.index * self.chunks + rank)],
                                  tma_bar_ptr=bar)
                        if lane == 0:
                            prims.mbarrier_complete_tx(bar, Int32(chunk_bytes))
                    else:
                        self.load_b(tma_b, t_gb, t_sb, b_block, kb, state.index, bar)
                else:
                    self.load_b(tma_b, t_gb, t_sb, b_block, kb, state.index, bar)
                if lane == 0:
                    prims.cp_async_bulk_shared_cluster_global(
                        sfg + state.index * self.block_n,
                        b_group_sf + ((Int64(expert) * self.num_k_blocks + kb) * self.n
                                      + n_block * self.block_n),
                        bar, Int32(self.block_n * 4))
                    prims.cp_async_bulk_shared_cluster_global(
                        sfb + state.index * self.packed_sfb_stride,
                        b_sf + (Int64(expert) * self.num_k_blocks + kb) * self.sfb_len,
                        bar, Int32(self.sfb_len * 4))
                state.advance()
            tile += num_clusters
        return state, tile

    @cute.jit
    def acquire_stage(self, pipe, state, extra_tx_bytes: cutlass.Constexpr, lane: Int32,
                      barrier_slots: cute.Pointer = None,
                      what: cutlass.Constexpr = "a free ring stage (loads)"):
        """The producer warp acquires the stage of ``state`` and returns its mbarrier. With
        ``extra_tx_bytes`` (a fused kernel's phase whose stages carry more scale bytes than the
        ring's transaction count) it expects them before any copy of the stage can complete.
        (``barrier_slots``, ``what``: see `bounded_stage_wait`.)"""
        self.bounded_stage_wait(barrier_slots, pipe.sync_object_empty, state, what)
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        if cutlass.const_expr(extra_tx_bytes > 0):
            if lane == 0:
                cute.arch.mbarrier_expect_tx(bar, extra_tx_bytes)
            cute.arch.sync_warp()
        return bar

    @cute.jit
    def producer_tail(self, pipe, state, barrier_slots: cute.Pointer = None,
                      what: cutlass.Constexpr = "the ring's last stages, freed (loads)"):
        """The producer's end of its walk: wait until the consumers have freed every stage (as
        ``pipe.producer_tail``), with `stage_reports` each wait bounded and named
        (`bounded_stage_wait`)."""
        st = state.clone()
        for _ in cutlass.range(pipe.num_stages):  # (one report site, not one per stage)
            self.bounded_stage_wait(barrier_slots, pipe.sync_object_empty, st, what)
            st.advance()
        pipe.producer_tail(state)

    @cute.jit
    def bounded_stage_wait(self, barrier_slots: cute.Pointer, mbars, state,
                           what: cutlass.Constexpr, mbar: cute.Pointer = None):
        """With `stage_reports` and ``barrier_slots``: wait for the stage of ``state`` in the
        mbarrier array ``mbars`` (or for ``mbar``) with a time limit and a stall report naming
        ``what`` (`sync.wait_stage`), so that the role's own wait right after passes at once;
        nothing otherwise (every other build compiles no such code)."""
        if cutlass.const_expr(self.stage_reports and barrier_slots is not None):
            if cutlass.const_expr(mbar is None):
                mbar = mbars.get_barrier(state.index)
            wait_stage(barrier_slots, mbar, state.phase, state.index, what, self.timeout_ns)

    def packed_pipeline(self, barriers: cute.Pointer):
        """FP4 weights: the packed stages' pipeline (TMA in, the decode warps free them); None
        else."""
        if not self.fp4_weights:
            return None
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers, num_stages=self.packed_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.decode_wgs),
            tx_count=self.packed_ring_tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True)

    def decode_states(self):
        """The decode warps' pipeline states at the start of a launch: the MMA stages as
        their producer sees them (free once the consumers released them), the packed stages as
        their consumer."""
        return (pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.num_stages),
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.packed_stages))

    @cute.jit
    def log_tile(self, tile_log: cute.Pointer, ordinal: Int32, pool_block: Int32,
                 n_block: Int32, valid_m: Int32, lane: Int32):
        """Record this CTA's ``ordinal``-th tile (see `produce`)."""
        if lane == 0:
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            entry = cute.make_tensor(tile_log + (ordinal * grid + bidx) * 4, cute.make_layout(4))
            entry[0] = Int32(1 if self.phase == "l1" else 2)
            entry[1] = pool_block
            entry[2] = n_block
            entry[3] = valid_m

    @cute.jit
    def is_decode_wg(self, wg: Int32):
        """Whether warpgroup ``wg`` is a decode warpgroup (FP4 weights; a constant False else,
        so that other kernels compile no such branch)."""
        if cutlass.const_expr(self.fp4_weights):
            return wg > self.num_mma_wgs
        return False

    @cute.jit
    def init_decoded_barriers(self, decoded: cute.Pointer, tidx: Int32):
        """FP4 weights: one mbarrier per stage, complete once the decode warps wrote its tile."""
        if tidx == 32:
            for s in cutlass.range_constexpr(self.num_stages):
                cute.arch.mbarrier_init(decoded + s, 4 * self.decode_wgs)

    @cute.jit
    def decode_weights(self, ab_pipe, packed_pipe, raw_b: cute.Pointer, sb: cute.Pointer,
                       sfb: cute.Pointer, sfg: cute.Pointer, decoded: cute.Pointer, block_start,
                       row_start, num_tiles: Int32, first_tile: Int32, num_clusters: Int32,
                       raster_group: Int32, tid: Int32, lane: Int32, state, packed,
                       barrier_slots: cute.Pointer = None, rank: Int32 = None):
        """The decode warpgroups (FP4 weights), ``tid`` in [0, 128 x decode_wgs): for every
        k-block of tiles ``first_tile``, ``first_tile + num_clusters``, ... ``< num_tiles``
        (``state``, ``packed``: see `decode_states`; returns them and the first tile index past
        num_tiles), once the TMA has filled its packed stage and the MMA has freed its MMA stage
        (not waiting for A, whose load overlaps the decode), turn the packed weight chunks into
        the e4m3 tiles the WGMMAs read (`common.fp4_decode`), arrive at the MMA stage's
        ``decoded`` barrier and free the packed stage. See `decode_chunks` for the items
        (``barrier_slots``: `bounded_stage_wait`). In a cluster (``rank``: this CTA's) whose two
        pool blocks share the expert, each CTA decodes chunk ``rank`` only and copies it into the
        peer's stage with one bulk shared-memory copy, counted by the transaction bytes of the
        peer's ``decoded`` barrier: half the decode per CTA. (Each CTA may write the peer's stage
        once its own consumers and the peer's freed it: the MMA ring's stages are freed in both
        CTAs.)"""
        if cutlass.const_expr(self.fp4_weights):
            if cutlass.const_expr(rank is None):
                rank = Int32(0)
            tile = first_tile
            owner = Int32(0)
            while tile < num_tiles:
                owner, shared, _e, n_block, _b, _v = self.pair_tile(
                    tile, owner, block_start, row_start, raster_group, rank)
                for _kb in cutlass.range(self.num_k_blocks):
                    self.bounded_stage_wait(barrier_slots, packed_pipe.sync_object_full, packed,
                                            "a loaded packed weight stage (decode warps)")
                    packed_pipe.consumer_wait(packed)
                    first_inputs = None
                    if cutlass.const_expr(self.early_tables):
                        first_inputs = self.decode_inputs(raw_b, sfb, sfg, n_block, tid,
                                                          packed, 0)
                    self.bounded_stage_wait(barrier_slots, ab_pipe.sync_object_empty, state,
                                            "a free ring stage (decode warps)")
                    ab_pipe.sync_object_empty.wait(state.index, state.phase)
                    if cutlass.const_expr(self.cluster_m > 1):
                        if shared:
                            self.decode_chunks(raw_b, sb, sfb, sfg, n_block, tid, state,
                                               packed, first_inputs, [rank])
                        else:
                            self.decode_chunks(raw_b, sb, sfb, sfg, n_block, tid, state,
                                               packed, first_inputs)
                    else:
                        self.decode_chunks(raw_b, sb, sfb, sfg, n_block, tid, state, packed,
                                           first_inputs)
                    # the generic-proxy writes, then the WGMMAs' (async proxy) reads
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_warp()
                    if cutlass.const_expr(self.cluster_m > 1):
                        if shared:
                            self.send_decoded_chunk(sb, decoded, state, rank, tid, lane)
                        elif lane == 0:
                            cute.arch.mbarrier_arrive(decoded + state.index)
                    elif lane == 0:
                        cute.arch.mbarrier_arrive(decoded + state.index)
                    packed_pipe.consumer_release(packed)
                    state.advance()
                    packed.advance()
                tile += num_clusters
            return state, packed, tile
        return state, packed, first_tile

    @cute.jit
    def send_decoded_chunk(self, sb: cute.Pointer, decoded: cute.Pointer, state, rank: Int32,
                           tid: Int32, lane: Int32):
        """A cluster's shared decode, once every decode thread fenced its stores: thread 0 copies
        chunk ``rank`` of the MMA stage into the same place of the peer's (one bulk copy,
        complete on the peer's ``decoded`` barrier) and arrives at its own ``decoded`` barrier
        expecting the peer's chunk; the other warps arrive."""
        cute.arch.barrier(barrier_id=DECODE_BARRIER, number_of_threads=128 * self.decode_wgs)
        chunk_bytes = WG_N * self.block_k
        if tid == 0:
            peer = 1 - rank
            chunk = sb + (state.index * self.chunks + rank) * chunk_bytes
            prims.cp_async_bulk_shared_cluster_shared_cta(
                cute.arch.map_dsmem_ptr(chunk, peer),
                chunk, cute.arch.map_dsmem_ptr(decoded + state.index, peer), Int32(chunk_bytes))
            cute.arch.mbarrier_arrive_and_expect_tx(decoded + state.index, chunk_bytes)
        elif lane == 0:
            cute.arch.mbarrier_arrive(decoded + state.index)

    def decode_items(self, chunks: list = None):
        """The decode's items of a k-block, ``(chunk, pass)``, and the items per batch
        (``chunks``: the chunk indices to decode, all by default)."""
        rows_per_pass = 128 * self.decode_wgs // 4
        if chunks is None:
            chunks = list(range(self.chunks))
        items = [(c, p) for c in chunks for p in range(WG_N // rows_per_pass)]
        return items, rows_per_pass, min(len(items), self.decode_batch)

    @cute.jit
    def load_item_codes(self, raw_b: cute.Pointer, packed, tile_row: Int32, group: Int32, dst):
        """An item's 32 codes (16 bytes) from the packed stage of ``packed`` into ``dst``."""
        cute.autovec_copy(smem_words(raw_b, (packed.index * self.chunks * WG_N + tile_row)
                                     * (self.block_k // 2) + group * 16), dst)

    @cute.jit
    def decode_inputs(self, raw_b: cute.Pointer, sfb: cute.Pointer, sfg: cute.Pointer,
                      n_block: Int32, tid: Int32, packed, first: cutlass.Constexpr,
                      chunks: list = None):
        """What the batch of items from ``first`` on needs of the packed stage alone (see
        `decode_chunks`): its items' tile rows, exponent shifts, the codes of the first
        `VOTE_AHEAD` items ("vote"; all of them with "item" tables) and the tables ("vote";
        None with "item"), as ``(codes, shifts, rows, tables)``."""
        items, rows_per_pass, batch = self.decode_items(chunks)
        row0, group = tid >> 2, tid & 3
        # a permute selector that moves byte `group` of a scale word to byte 0, zeros above
        # (one ALU op instead of a shift and a mask)
        group_byte = Int32(0x4440) + group
        words = cute.make_tensor(sfg + packed.index * self.block_n,
                                 cute.make_layout(self.block_n))
        block_scales = cute.make_tensor(sfb + packed.index * self.packed_sfb_stride,
                                        cute.make_layout(self.sfb_len))
        codes, shifts, rows = [], [], []
        for chunk, p in items[first:first + batch]:
            tile_row = chunk * WG_N + row0 + rows_per_pass * p  # (the item's tile row)
            rows.append(tile_row)
            codes.append(cute.make_rmem_tensor(4, Int32))
            # ("vote": the first VOTE_AHEAD items' codes here, each later item's while the
            # item VOTE_AHEAD before it decodes; loaded all at once, ptxas issued the
            # batch's loads together and the decode ran slower, docs/performance.md)
            if cutlass.const_expr(self.decode_tables == "item" or len(codes) <= VOTE_AHEAD):
                self.load_item_codes(raw_b, packed, tile_row, group, codes[-1])
            if cutlass.const_expr(self.phase == "l1"):  # gate / up groups of 8
                block = n_block + ((row0 >> 3) & 1) * (self.n // (2 * SF_BLOCK))
            else:
                block = self.chunks * n_block + chunk
            base = (block_scales[block].bitcast(Int32) >> 23) & 0xFF
            ue8m0 = prmt(words[tile_row], Int32(0), group_byte)
            shifts.append(ue8m0 - base)
        tables = None
        if cutlass.const_expr(self.decode_tables != "item"):
            tables = vote_tables(shifts)
        return codes, shifts, rows, tables

    @cute.jit
    def decode_chunks(self, raw_b: cute.Pointer, sb: cute.Pointer, sfb: cute.Pointer,
                      sfg: cute.Pointer, n_block: Int32, tid: Int32, state, packed,
                      first_inputs=None, chunks: list = None):
        """One k-block's weight chunks from the packed stage into the MMA stage. An item
        is 32 codes of one weight row (16 bytes in, two 16-byte swizzled pieces out, one scale);
        thread ``tid`` decodes group ``tid % 4`` of rows ``tid / 4 + T / 4 * j`` of every chunk
        (``T`` decode threads; consecutive lanes read consecutive 16 bytes: conflict-free),
        `decode_batch` items a batch (their scales loaded first; `decode_tables`;
        ``first_inputs``: the first batch's `decode_inputs`, when they were made before the
        MMA stage was free). The exponent shift of a group is its UE8M0 scale over its 128x128
        block's base ``2**b`` (the block scale: L1 row groups of 8 alternate gate and up blocks,
        the same for all rows of a thread). ``chunks``: the chunks to decode (all by default; a
        list of one run-time index in a cluster's shared decode)."""
        items, _rows_per_pass, batch = self.decode_items(chunks)
        row0, group = tid >> 2, tid & 3
        # the 128-byte swizzle of the WGMMA tile: 16-byte piece j of row r lies at piece
        # j ^ (r % 8), and r % 8 = row0 % 8 for every row of the thread
        pieces = [(2 * group + half) ^ (row0 & 7) for half in range(2)]
        chunk_bytes = WG_N * self.block_k  # one decoded 128 x 128 e4m3 slot
        for first in cutlass.range_constexpr(0, len(items), batch):
            if cutlass.const_expr(first == 0 and first_inputs is not None):
                codes, shifts, rows, tables = first_inputs
            else:
                codes, shifts, rows, tables = self.decode_inputs(raw_b, sfb, sfg, n_block,
                                                                 tid, packed, first, chunks)
            for j in cutlass.range_constexpr(len(rows)):
                if cutlass.const_expr(tables is None):
                    lut_lo, lut_hi = e2m1_table(shifts[j])
                else:
                    lut_lo, lut_hi = tables[2 * j], tables[2 * j + 1]
                    if cutlass.const_expr(j + VOTE_AHEAD < len(rows)):
                        self.load_item_codes(raw_b, packed, rows[j + VOTE_AHEAD], group,
                                             codes[j + VOTE_AHEAD])
                # word q of the group: columns 4q .. 4q + 3, 16 + 4q .. (`quant.SM90_GROUP_ORDER`)
                out = [cute.make_rmem_tensor(4, Int32) for _ in range(2)]
                for q in cutlass.range_constexpr(4):
                    out[0][q], out[1][q] = decode_e2m1_word(codes[j][q], lut_lo, lut_hi)
                stage_base = state.index * self.chunks * chunk_bytes + rows[j] * self.block_k
                for half in cutlass.range_constexpr(2):
                    cute.autovec_copy(out[half],
                                      smem_words(sb, stage_base + pieces[half] * 16))

    @cute.jit
    def load_b(self, tma_b, t_gb, t_sb, b_block: Int32, kb: Int32, stage: Int32, bar):
        """This CTA loads both 128-row chunks of the weight tile itself."""
        for c in cutlass.range_constexpr(self.chunks):
            cute.copy(tma_b, t_gb[(None, b_block + c, kb)], t_sb[(None, stage * self.chunks + c)],
                      tma_bar_ptr=bar)

    @cute.jit
    def consume(self, tiled_mma, sa, sb, sfa, sfb, ab_pipe, block_start, row_start,
                num_tiles: Int32, first_tile: Int32, num_clusters: Int32, raster_group: Int32,
                rank: Int32, mma_wg: Int32, warp_in_wg: Int32,
                lane: Int32, topk_weights: cute.Pointer, out: cute.Pointer,
                out_sf: cute.Pointer, peer_bases: cute.Pointer, src_metadata: cute.Pointer,
                staging: cute.Pointer, state, prev, ready: cute.Pointer = None,
                decoded: cute.Pointer = None, exchange: cute.Pointer = None, out_store=None,
                progress: cute.Pointer = None, owed_block: Int32 = None,
                signal_last: cutlass.Constexpr = True, barrier_slots: cute.Pointer = None,
                owner_hint: Int32 = None):
        """Consumer warpgroup ``mma_wg``: rows ``[64 * mma_wg, 64 * mma_wg + 64)`` of tiles
        ``first_tile``, ``first_tile + num_clusters``, ... ``< num_tiles``; ``staging``: this
        warp's shared-memory staging rows; ``state`` / ``prev``: the ring's consumer state (BF16
        releases a stage one k-block late, from ``prev``; equal between tiles). With
        ``signals_ready`` (L1 of the fused kernel) each warp adds 1 to ``ready[pool_block]``
        once its rows of a tile are in global memory, one tile late (its stores drain while the
        next tile's WGMMAs run) and at the end. Returns ``(state, prev, the first tile index
        past num_tiles)``; all of the warp's stores are complete on return. (``exchange``: the
        transposed kernel's; ``out_store``: `tma_store`'s TMA atom, ``out`` tensor and staging
        boxes; ``progress``: a shared-memory word where the first thread stores the ring
        state's count after each k-block, for a watchdog.) With ``signals_ready``, a walk that
        continues another (the fused kernel's ticket walk): ``owed_block``, the pool block
        whose signal the previous walk still owes (-1: none), signalled after the first
        tile's mainloop; with ``signal_last`` False the last tile's block is not signalled nor
        its stores awaited, and it is returned after the state: ``(state, prev, tile,
        owed)``. With `ring_blocks` (the ticket walk's L1-output ring): L1 stores a tile's rows
        in its block's slot once the slot's previous block was read (a bounded wait, reported
        through ``barrier_slots``), L2 counts a tile's loads into ``ready`` as done. With
        ``owner_hint`` (as `produce`'s) the last tile's owner is returned last."""
        thr_mma = tiled_mma.get_slice(mma_wg * 128)
        t_ra = tiled_mma.make_fragment_A(thr_mma.partition_A(sa))
        t_rb = tiled_mma.make_fragment_B(thr_mma.partition_B(sb))
        acc_shape = thr_mma.partition_shape_C((self.block_m, WG_N))
        accs = [cute.make_rmem_tensor(acc_shape, Float32) for _ in range(self.chunks)]
        part = cute.make_rmem_tensor(acc_shape, Float32)  # FP8 scratch (dead code for BF16)
        quarter_mma = quarter_a = quarter_b = quarter_parts = None
        if cutlass.const_expr(self.quarter_promotion):
            quarter_mma, quarter_a, quarter_b, quarter_parts = self.quarter_operands(sa, sb,
                                                                                     mma_wg)
        num_k_phases = cute.size(t_ra, mode=[2])
        # The m64nNk WGMMA accumulator: value i = c + 2 * r + 4 * j of a thread is row
        # 16 * warp + lane / 4 + 8 * r, column 8 * j + 2 * (lane % 4) + c of its chunk.
        warp_row0 = 64 * mma_wg + ROWS_PER_WARP * warp_in_wg
        row0 = warp_row0 + lane // 4
        col0 = 2 * (lane % 4)
        store = None  # (`tma_store`: the atom and this warp's boxes' TMA views)
        if cutlass.const_expr(out_store is not None):
            tma_out, m_out, s_out = out_store
            t_s_out, t_g_out = cpasync.tma_partition(
                tma_out, 0, cute.make_layout(1), cute.group_modes(s_out, 0, 2),
                cute.group_modes(cute.local_tile(
                    m_out, (ROWS_PER_WARP, OUT_BOX_BYTES * 8 // self.out_dtype().width),
                    (None, None)), 0, 2))
            store = (tma_out, t_s_out, t_g_out)
        tile = first_tile
        owner = Int32(0)
        if cutlass.const_expr(owner_hint is not None):
            owner = owner_hint
        pending = Int32(-1)  # the pool block of the previous tile, not signalled yet
        if cutlass.const_expr(owed_block is not None):
            pending = owed_block
        if cutlass.const_expr(self.wg_skew > 0):
            if mma_wg == 1 and tile < num_tiles:
                cute.arch.barrier(barrier_id=SKEW_BARRIER, number_of_threads=256)
        while tile < num_tiles:
            owner, _e, _m, n_block, pool_block, valid_m = self.scheduler.tile(
                tile, owner, block_start, row_start, raster_group, rank)
            row_base = pool_block * self.block_m
            out_base = row_base  # (the rows' place in ``out``: L1, their ring slot's)
            if cutlass.const_expr(self.ring_blocks > 0 and self.phase == "l1"):
                out_base = (pool_block % self.ring_blocks) * self.block_m
            # where lane i < 16 sends the tile's row warp_row0 + i (loaded before the mainloop;
            # with `late_metadata`, once the tile's first stage is in)
            row_dst = Int64(0)
            if cutlass.const_expr(not self.late_metadata):
                row_dst = self.row_destination(out, peer_bases, src_metadata, out_base,
                                               warp_row0 + lane, valid_m, n_block, lane)
            for c in cutlass.range_constexpr(self.chunks):
                accs[c].fill(0.0)
            if cutlass.const_expr(self.is_fp8):
                for kb in cutlass.range(self.num_k_blocks, unroll=self.k_unroll):
                    self.release_skew(mma_wg, kb, tile == first_tile)
                    ab_pipe.consumer_wait(state)
                    if cutlass.const_expr(self.fp4_weights):
                        # the decode warps have written the stage's e4m3 weight tile
                        cute.arch.mbarrier_wait(decoded + state.index, state.phase)
                    if cutlass.const_expr(self.late_metadata):
                        if kb == 0:
                            row_dst = self.row_destination(out, peer_bases, src_metadata,
                                                           out_base, warp_row0 + lane, valid_m,
                                                           n_block, lane)
                    sa0 = sfa[row0, state.index]
                    sa1 = sfa[row0 + 8, state.index]
                    scale_b = self.weight_scales(sfb, state.index, n_block)
                    if cutlass.const_expr(self.quarter_promotion):
                        self.mma_quarters(quarter_mma, quarter_a, quarter_b, quarter_parts,
                                          accs, state.index, sa0, sa1, scale_b)
                        ab_pipe.consumer_release(state)
                        self.promote(accs, quarter_parts[(self.quarters - 1) % 2],
                                     self.quarters - 1, sa0, sa1, scale_b)
                    for c in cutlass.range_constexpr(0 if self.quarter_promotion
                                                     else self.chunks):
                        warpgroup.fence()
                        slot = state.index * self.chunks + c
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                        for kk in cutlass.range_constexpr(num_k_phases):
                            cute.gemm(tiled_mma, part, t_ra[(None, None, kk, state.index)],
                                      t_rb[(None, None, kk, slot)], part)
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        if cutlass.const_expr(c == self.chunks - 1):
                            ab_pipe.consumer_release(state)  # before the last promotion
                        self.promote(accs, part, 2 * c, sa0, sa1, scale_b, WG_N)
                    state.advance()
                    if cutlass.const_expr(progress is not None):
                        if mma_wg == 0 and warp_in_wg == 0 and lane == 0:
                            cute.make_tensor(progress, cute.make_layout(1))[0] = state.count
            else:
                # one k-block of WGMMAs stays in flight; its stage is released one step later
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range(self.num_k_blocks):
                    self.release_skew(mma_wg, kb, tile == first_tile)
                    ab_pipe.consumer_wait(state)
                    if cutlass.const_expr(self.late_metadata):
                        if kb == 0:
                            row_dst = self.row_destination(out, peer_bases, src_metadata,
                                                           out_base, warp_row0 + lane, valid_m,
                                                           n_block, lane)
                    warpgroup.fence()
                    for c in cutlass.range_constexpr(self.chunks):
                        for kk in cutlass.range_constexpr(num_k_phases):
                            cute.gemm(tiled_mma, accs[c], t_ra[(None, None, kk, state.index)],
                                      t_rb[(None, None, kk, state.index * self.chunks + c)],
                                      accs[c])
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                    if kb > 0:
                        ab_pipe.consumer_release(prev)
                        prev.advance()
                    state.advance()
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(prev)
                prev.advance()
            if cutlass.const_expr(self.ring_blocks > 0 and self.phase == "l2"):
                # every stage of the tile has landed (its rows left the ring slot): one count
                if mma_wg == 0 and warp_in_wg == 0 and lane == 0 and valid_m > 0:
                    cute.arch.red(ready + pool_block, Int32(1), op="add", dtype="s32",
                                  sem="release", scope="gpu")
            if cutlass.const_expr(self.signals_ready):
                if pending >= 0:
                    self.signal_ready(ready, pending, lane)
            if cutlass.const_expr(self.ring_blocks > 0 and self.phase == "l1"):
                # (after the owed signal: the slot's previous block never waits on this warp)
                if pool_block >= self.ring_blocks:
                    wait_reached(barrier_slots, ready + (pool_block - self.ring_blocks),
                                 Int32(self.ring_reads), "gpu",
                                 "L2 tiles of an L1-output ring slot's previous block",
                                 self.timeout_ns)
                    # (their TMA reads are done; order this tile's bulk stores after the acquire)
                    cute.arch.fence_proxy("async.global")
            self.epilogue(accs, topk_weights, row_dst, out_sf, staging, row_base, warp_row0,
                          row0, col0, valid_m, n_block, lane, store, out_base)
            pending = pool_block
            tile += num_clusters
        if cutlass.const_expr(not signal_last):
            if cutlass.const_expr(owner_hint is not None):
                return state, prev, tile, pending, owner
            return state, prev, tile, pending
        if cutlass.const_expr(self.signals_ready):
            if pending >= 0:
                self.signal_ready(ready, pending, lane)
        if lane < ROWS_PER_WARP:
            cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.sync_warp()
        if cutlass.const_expr(owner_hint is not None):
            return state, prev, tile, owner
        return state, prev, tile

    @property
    def quarters(self) -> int:
        """64-column quarters of a tile (``promotion`` "quarter")."""
        return self.block_n // QUARTER_N

    @cute.jit
    def quarter_operands(self, sa: cute.Tensor, sb: cute.Tensor, mma_wg: Int32):
        """``promotion`` "quarter": the m64n64 WGMMA, this warpgroup's A and B fragments (B:
        the stage's weight slots seen as 64-row halves, slot ``2 * (stage * chunks + c) + h``
        = rows ``64 h ..`` of chunk ``c``: a swizzle atom is 8 rows, so the halves are tiles of
        the same swizzle) and the two scratch accumulators."""
        mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K, Float32, (self.num_mma_wgs, 1, 1),
            tiler_mn=(64, QUARTER_N))
        thr = mma.get_slice(mma_wg * 128)
        halves = self._smem_layout(QUARTER_N, self.num_stages * self.quarters)
        sb_halves = cute.make_tensor(sb.iterator, halves.outer)
        parts = [cute.make_rmem_tensor(thr.partition_shape_C((self.block_m, QUARTER_N)),
                                       Float32) for _ in range(2)]
        return (mma, mma.make_fragment_A(thr.partition_A(sa)),
                mma.make_fragment_B(thr.partition_B(sb_halves)), parts)

    @cute.jit
    def mma_quarters(self, mma, t_ra, t_rb, parts, accs, stage: Int32, sa0, sa1, scale_b):
        """``promotion`` "quarter", one k-block: quarter ``q``'s WGMMAs into scratch
        ``q % 2``, then, while they run, the promotion of quarter ``q - 1``; returns with every
        WGMMA complete and the last quarter not promoted."""
        num_k_phases = cute.size(t_ra, mode=[2])
        for q in cutlass.range_constexpr(self.quarters):
            warpgroup.fence()
            mma.set(warpgroup.Field.ACCUMULATE, False)
            for kk in cutlass.range_constexpr(num_k_phases):
                cute.gemm(mma, parts[q % 2], t_ra[(None, None, kk, stage)],
                          t_rb[(None, None, kk, stage * self.quarters + q)], parts[q % 2])
                mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            if cutlass.const_expr(q > 0):
                warpgroup.wait_group(1)
                self.promote(accs, parts[(q - 1) % 2], q - 1, sa0, sa1, scale_b)
        warpgroup.wait_group(0)

    @cute.jit
    def promote(self, accs, part: cute.Tensor, quarter: cutlass.Constexpr, sa0, sa1, scale_b,
                cols: cutlass.Constexpr = QUARTER_N):
        """FP8 promotion of ``cols`` columns from quarter ``quarter`` of the tile on: ``acc +=
        part * sa[row] * sb[block of the 8-column group j]`` (value ``c + 2 r + 4 j`` of the
        m64nN accumulator: row ``+ 8 r``, 8-column group ``j``; gate / up groups alternate)."""
        chunk, first = quarter // 2, (quarter % 2) * (QUARTER_N // GATE_UP_GROUP) * 4
        s_even = (sa0 * scale_b[chunk][0], sa1 * scale_b[chunk][0])
        s_odd = (sa0 * scale_b[chunk][1], sa1 * scale_b[chunk][1])
        for j in cutlass.range_constexpr(cols // GATE_UP_GROUP):
            s0, s1 = s_even if j % 2 == 0 else s_odd
            for cc in cutlass.range_constexpr(2):
                accs[chunk][first + cc + 4 * j] += part[cc + 4 * j] * s0
                accs[chunk][first + cc + 2 + 4 * j] += part[cc + 2 + 4 * j] * s1

    @cute.jit
    def signal_ready(self, ready: cute.Pointer, pool_block: Int32, lane: Int32):
        """This warp's rows of pool block ``pool_block`` (an L1 tile) are in global memory:
        wait for its bulk stores to complete (not only to have read the staging rows), then
        add 1 to ``ready[pool_block]`` with a release at GPU scope. The warp sync orders the
        other lanes' scale stores before lane 0's release; the proxy fence orders the bulk
        (async-proxy) writes before it."""
        if lane < ROWS_PER_WARP:
            cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.red(ready + pool_block, Int32(1), op="add", dtype="s32", sem="release",
                          scope="gpu")

    @cute.jit
    def row_destination(self, out: cute.Pointer, peer_bases: cute.Pointer,
                        src_metadata: cute.Pointer, row_base: Int32, row: Int32, valid_m: Int32,
                        n_block: Int32, lane: Int32) -> Int64:
        """Global address of this tile's piece of pool row ``row_base + row`` (used by lanes
        < 16 for valid rows): in ``out``, or in the source rank's ``combine[slot, token]``."""
        dst = Int64(0)
        if cutlass.const_expr(self.to_combine):
            if lane < ROWS_PER_WARP and row < valid_m:
                meta = cute.make_tensor(src_metadata + (row_base + row) * 4, cute.make_layout(4))
                peers = cute.make_tensor(peer_bases, cute.make_layout(self.num_ranks))
                dst = (peers[meta[0]] + self.combine_offset
                       + Int64(meta[2] * self.combine_tokens + meta[1]) * self.out_row_bytes)
        else:
            dst = out.toint() + Int64(row_base + row) * self.out_row_bytes
        return dst + n_block * self.tile_row_bytes

    @cute.jit
    def weight_scales(self, sfb: cute.Tensor, stage: Int32, n_block: Int32):
        """The stage's weight block scales of the tile's chunks ``c``, as (scale of the even,
        scale of the odd 8-column groups): L1 (gate, up) of block ``n_block`` for every chunk,
        L2 (block, block) of block ``chunks * n_block + c``."""
        if cutlass.const_expr(self.phase == "l1"):
            gate = sfb[n_block, stage]
            up = sfb[self.n // (2 * SF_BLOCK) + n_block, stage]
            return [(gate, up)] * self.chunks
        return [(sfb[self.chunks * n_block + c, stage],) * 2
                for c in range(self.chunks)]

    @cute.jit
    def release_skew(self, mma_wg: Int32, kb: Int32, first_tile):
        """Warpgroup 0 lets warpgroup 1 start once it reaches k-block ``wg_skew`` of its first
        tile (that stage is still one of the initially filled ones)."""
        if cutlass.const_expr(self.wg_skew > 0):
            if mma_wg == 0 and first_tile and kb == self.wg_skew:
                cute.arch.barrier_arrive(barrier_id=SKEW_BARRIER, number_of_threads=256)

    @cute.jit
    def epilogue(self, accs: list, topk_weights: cute.Pointer, row_dst: Int64,
                 out_sf: cute.Pointer, staging: cute.Pointer, row_base: Int32,
                 warp_row0: Int32, row0: Int32, col0: Int32, valid_m: Int32, n_block: Int32,
                 lane: Int32, store=None, out_base: Int32 = None):
        """One tile's output from the accumulators of the warpgroup's chunks: L2 BF16, L1
        SwiGLU (BF16 or FP8 with its scales), through the staging rows (whole, or chunk by
        chunk, see ``staging_parts``; ``store``: `tma_store`'s swizzled boxes). ``row_base``:
        the tile's first pool row (its routing weights); ``out_base``: its first row in the
        outputs (default ``row_base``; L1 with `ring_blocks`, its ring slot's)."""
        if cutlass.const_expr(out_base is None):
            out_base = row_base
        self.wait_staging(lane)
        if cutlass.const_expr(store is not None and self.phase == "l2"):
            for c in cutlass.range_constexpr(self.chunks):
                vals = cute.make_rmem_tensor(accs[c].shape, BFloat16)
                vals.store(accs[c].load().to(BFloat16))
                self.stage_boxes(vals, staging, lane, c * WG_N)
            self.store_boxes(store, staging, row_dst, out_base, warp_row0, valid_m, n_block,
                             lane)
        elif cutlass.const_expr(self.phase == "l1" and self.is_fp8):
            w0, w1 = self.routing_weights(topk_weights, row_base, row0)
            self.requant_stage([self.swiglu_chunk(accs[c], w0, w1)
                                for c in range(self.chunks)], out_sf, staging, out_base,
                               row0, col0, valid_m, n_block, lane, boxes=store is not None)
            if cutlass.const_expr(store is not None):
                self.store_boxes(store, staging, row_dst, out_base, warp_row0, valid_m,
                                 n_block, lane)
            else:
                self.flush_rows(staging, row_dst, warp_row0, valid_m, lane, 0,
                                self.tile_row_bytes)
        else:
            w0, w1 = Float32(0.0), Float32(0.0)
            if cutlass.const_expr(self.phase == "l1"):
                w0, w1 = self.routing_weights(topk_weights, row_base, row0)
            chunk_cols = WG_N // 2 if cutlass.const_expr(self.phase == "l1") else WG_N
            part_bytes = self.tile_row_bytes // self.staging_parts
            parts_per_chunk = max(1, self.staging_parts // self.chunks)
            for c in cutlass.range_constexpr(self.chunks):
                vals = cute.make_rmem_tensor(accs[c].shape if self.phase == "l2"
                                             else (2, 2, WG_N // 16), BFloat16)
                if cutlass.const_expr(self.phase == "l2"):
                    vals.store(accs[c].load().to(BFloat16))
                else:
                    vals.store(self.swiglu_chunk(accs[c], w0, w1).load().to(BFloat16))
                if cutlass.const_expr(self.staging_parts == 1):
                    self.stage_rows(vals, staging, lane, c * chunk_cols + col0)
                else:
                    groups = cute.size(vals) // 4 // parts_per_chunk
                    for h in cutlass.range_constexpr(parts_per_chunk):
                        if cutlass.const_expr(c + h > 0):
                            self.wait_staging(lane)
                        self.stage_rows(vals, staging, lane, col0, h * groups, groups)
                        self.flush_rows(staging, row_dst, warp_row0, valid_m, lane,
                                        (c * parts_per_chunk + h) * part_bytes, part_bytes)
            if cutlass.const_expr(self.staging_parts == 1):
                self.flush_rows(staging, row_dst, warp_row0, valid_m, lane, 0,
                                self.tile_row_bytes)

    @cute.jit
    def wait_staging(self, lane: Int32):
        """Until the warp's previous bulk stores have read the staging rows."""
        if lane < ROWS_PER_WARP:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()

    @cute.jit
    def routing_weights(self, topk_weights: cute.Pointer, row_base: Int32, row0: Int32):
        """The routing weights of the thread's two rows."""
        w = cute.make_tensor(topk_weights + row_base, cute.make_layout(self.block_m))
        return w[row0], w[row0 + 8]

    @cute.jit
    def stage_rows(self, vals: cute.Tensor, staging: cute.Pointer, lane: Int32, col: Int32,
                   first_group: cutlass.Constexpr = 0, num_groups: cutlass.Constexpr = None):
        """Write a thread's fragment ``vals`` (value ``c + 2 r + 4 g``: warp row
        ``lane / 4 + 8 r``, column ``8 g + c`` of the fragment), groups ``first_group`` on
        (all by default), into the staging rows from column ``col``, each column pair as one
        2- or 4-byte word."""
        elt = vals.element_type.width // 8
        word = Int32 if cutlass.const_expr(elt == 2) else cutlass.Int16
        words = cute.recast_tensor(vals, word)  # word r + 2 g: the pair (c = 0, 1)
        groups = cute.size(vals) // 4 if num_groups is None else num_groups
        for r in cutlass.range_constexpr(2):
            row_ptr = staging + (lane // 4 + 8 * r) * self.staging_stride + col * elt
            dst = cute.make_tensor(cute.recast_ptr(row_ptr, dtype=word),
                                   cute.make_layout(groups, stride=4))  # pair g: 8 columns on
            for g in cutlass.range_constexpr(groups):
                dst[g] = words[r + 2 * (first_group + g)]

    @cute.jit
    def flush_rows(self, staging: cute.Pointer, row_dst: Int64, warp_row0: Int32,
                   valid_m: Int32, lane: Int32, offset, nbytes: cutlass.Constexpr):
        """Send the warp's staged rows that hold received tokens: lane ``i < 16`` bulk-copies
        row ``warp_row0 + i`` (``nbytes`` from byte ``offset`` of the tile's row piece) to
        ``row_dst + offset`` if it is valid (`row_stores` "lanes": the warp copies each valid
        row, lane ``j`` its 16-byte pieces ``j``, ``j + 32``, ...)."""
        if cutlass.const_expr(self.row_stores == "lanes"):
            cute.arch.sync_warp()  # the warp's staging writes -> its lanes' reads
            lo, hi = Int32(row_dst & 0xFFFFFFFF), Int32(row_dst >> 32)
            for i in cutlass.range_constexpr(ROWS_PER_WARP):
                dst = (Int64(cute.arch.shuffle_sync(hi, i)) << 32) | (
                    Int64(cute.arch.shuffle_sync(lo, i)) & 0xFFFFFFFF)
                if warp_row0 + i < valid_m:
                    for u in cutlass.range_constexpr((nbytes // 16 + 31) // 32):
                        piece = lane + 32 * u
                        if cutlass.const_expr(32 * (u + 1) * 16 <= nbytes):
                            self.copy_piece(staging, i, piece, dst, offset)
                        elif piece * 16 < nbytes:
                            self.copy_piece(staging, i, piece, dst, offset)
        else:
            cute.arch.fence_view_async_shared()  # staging writes -> visible to the bulk copies
            cute.arch.sync_warp()
            if lane < ROWS_PER_WARP:
                row = warp_row0 + lane
                if row < valid_m:
                    prims.cp_async_bulk_global_shared_cta(
                        cute.make_ptr(Uint8, row_dst + offset, cute.AddressSpace.gmem,
                                      assumed_align=16),
                        staging + lane * self.staging_stride, Int32(nbytes))
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def copy_piece(self, staging: cute.Pointer, row: Int32, piece: Int32, dst: Int64, offset):
        """`row_stores` "lanes": 16 bytes ``piece`` of staged row ``row`` to ``dst + offset``."""
        src = smem_words(staging, row * self.staging_stride + piece * 16)
        out = cute.make_tensor(cute.make_ptr(Int32, dst + offset + piece * 16,
                                             cute.AddressSpace.gmem, assumed_align=16),
                               cute.make_layout(4))
        cute.autovec_copy(src, out)

    @cute.jit
    def stage_boxes(self, vals: cute.Tensor, staging: cute.Pointer, lane: Int32,
                    first_col: cutlass.Constexpr):
        """`tma_store`: write a thread's fragment ``vals`` (value ``c + 2 r + 4 g``: warp row
        ``lane / 4 + 8 r``, column ``first_col + 8 g + 2 (lane % 4) + c`` of the tile's row
        piece) into the warp's swizzled boxes (`out_boxes_layout`), each column pair as one 2-
        or 4-byte word. The eight rows of a store are ``lane / 4``: their 16-byte units ``u ^
        row`` are eight distinct ones, conflict-free."""
        elt = vals.element_type.width // 8
        word = Int32 if cutlass.const_expr(elt == 2) else cutlass.Int16
        words = cute.recast_tensor(vals, word)  # word r + 2 g: the pair (c = 0, 1)
        box_bytes = ROWS_PER_WARP * OUT_BOX_BYTES
        row8 = lane // 4
        base = staging + row8 * OUT_BOX_BYTES + (lane % 4) * 2 * elt
        units = [(u ^ row8) * 16 for u in range(OUT_BOX_BYTES // 16)]  # (swizzled units)
        for r in cutlass.range_constexpr(2):
            for g in cutlass.range_constexpr(cute.size(vals) // 4):
                byte = (first_col + 8 * g) * elt  # (of the pair's group in the row piece)
                unit = byte % OUT_BOX_BYTES // 16
                offset = (byte // OUT_BOX_BYTES * box_bytes + r * 8 * OUT_BOX_BYTES
                          + byte % 16)
                dst = cute.make_tensor(cute.recast_ptr(base + offset + units[unit], dtype=word),
                                       cute.make_layout(1))
                dst[0] = words[r + 2 * g]

    @cute.jit
    def store_boxes(self, store, staging: cute.Pointer, row_dst: Int64, row_base: Int32,
                    warp_row0: Int32, valid_m: Int32, n_block: Int32, lane: Int32):
        """`tma_store`: send the warp's staged rows: all 16 hold tokens: one TMA store per box;
        else lane ``i < 16`` copies row ``warp_row0 + i``, if valid, from the boxes to
        ``row_dst`` 16 bytes at a time (no pad row is written either way)."""
        tma_out, t_s_out, t_g_out = store
        boxes = self.tile_row_bytes // OUT_BOX_BYTES
        cute.arch.fence_view_async_shared()  # staging writes -> visible to the TMA
        cute.arch.sync_warp()
        if warp_row0 + ROWS_PER_WARP <= valid_m:
            row_tile = (row_base + warp_row0) // ROWS_PER_WARP
            first_slot = (warp_row0 // ROWS_PER_WARP) * boxes
            for b in cutlass.range_constexpr(boxes):
                cute.copy(tma_out, t_s_out[(None, first_slot + b)],
                          t_g_out[(None, row_tile, n_block * boxes + b)])
        elif lane < ROWS_PER_WARP and warp_row0 + lane < valid_m:
            box_bytes = ROWS_PER_WARP * OUT_BOX_BYTES
            for u in cutlass.range_constexpr(self.tile_row_bytes // 16):
                b, j = u // 8, u % 8
                src = smem_words(staging, b * box_bytes + lane * OUT_BOX_BYTES
                                 + ((j ^ (lane % 8)) * 16))
                dst = cute.make_tensor(cute.make_ptr(Int32, row_dst + u * 16,
                                                     cute.AddressSpace.gmem, assumed_align=16),
                                       cute.make_layout(4))
                cute.autovec_copy(src, dst)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def silu_mul(self, g: Float32, u: Float32) -> Float32:
        return clamped_silu_mul(g, u, self.clamp, self.fast_math)

    @cute.jit
    def swiglu_chunk(self, acc: cute.Tensor, w0: Float32, w1: Float32) -> cute.Tensor:
        """``h [c, r, m]`` of one 128-column chunk: 64 features of the thread's two rows (gate in
        column group ``j = 2m``, up in ``j = 2m + 1``: the interleave by 8)."""
        rounded = cute.make_rmem_tensor(acc.shape, Float32)
        rounded.store(acc.load().to(BFloat16).to(Float32))
        h = cute.make_rmem_tensor((2, 2, WG_N // 16), Float32)
        for r in cutlass.range_constexpr(2):
            weight = w0 if r == 0 else w1
            for m in cutlass.range_constexpr(WG_N // 16):
                for c in cutlass.range_constexpr(2):
                    h[c, r, m] = self.silu_mul(rounded[c + 2 * r + 8 * m],
                                               rounded[c + 2 * r + 8 * m + 4]) * weight
        return h

    @cute.jit
    def requant_stage(self, hs: list, out_sf: cute.Pointer, staging: cute.Pointer,
                      row_base: Int32, row0: Int32, col0: Int32, valid_m: Int32, n_block: Int32,
                      lane: Int32, boxes: cutlass.Constexpr = False):
        """e4m3 with a power-of-two scale per row over the tile's 128 features (the chunks
        ``hs`` of the warpgroup):
        ``e = exponent(amax / 448)`` rounded up, ``q = satfinite(h * 2^-e)``."""
        amaxes = []
        for r in cutlass.range_constexpr(2):
            amax = Float32(0.0)
            for h in hs:
                for m in cutlass.range_constexpr(WG_N // 16):
                    for c in cutlass.range_constexpr(2):
                        amax = cute.arch.fmax(amax, cute.math.absf(h[c, r, m]))
            # the row's features are spread over the 4 lanes of a quad
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1))
            amaxes.append(cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 2)))
        qs = [cute.make_rmem_tensor(h.shape, Float32) for h in hs]
        for r in cutlass.range_constexpr(2):
            exponent = requant_exponent(amaxes[r])
            sf_inv = ((127 - exponent) << 23).bitcast(Float32)
            for h, q in zip(hs, qs, strict=True):
                for m in cutlass.range_constexpr(WG_N // 16):
                    for c in cutlass.range_constexpr(2):
                        q[c, r, m] = cutlass.max(cutlass.min(h[c, r, m] * sf_inv,
                                                             Float32(FP8_E4M3_MAX)),
                                                 Float32(-FP8_E4M3_MAX))
            row = row0 + 8 * r
            if row < valid_m and lane % 4 == 0:
                # 2^e as float32; a zero group (byte 0) is 2^-127, the subnormal 0x00400000
                sf_bits = (exponent + 127) << 23
                if exponent == -127:
                    sf_bits = Int32(0x00400000)
                sf = cute.make_tensor(out_sf + (Int64(n_block) * self.out_rows + row_base),
                                      cute.make_layout(self.block_m))
                sf[row] = sf_bits.bitcast(Float32)
        for c, q in enumerate(qs):
            v = cute.make_rmem_tensor(q.shape, Float8E4M3FN)
            v.store(q.load().to(Float8E4M3FN))
            if cutlass.const_expr(boxes):  # (`tma_store`)
                self.stage_boxes(v, staging, lane, c * (WG_N // 2))
            else:
                self.stage_rows(v, staging, lane, c * (WG_N // 2) + col0)


def share_ring(l1: Sm90ExpertGemmKernel, l2: Sm90ExpertGemmKernel,
               num_stages: int | None = None, packed_stages: int | None = None) -> None:
    """Configure the two phases of the fused layer kernel to run one after the other through
    one pipeline ring and one set of staging rows (`kernels/sm90_mega_moe.py`): the same stage
    count, scale-vector and staging-row strides (the larger of the two, so that a stage or a
    warp's staging rows sit at the same place in both phases and the L2 tiles may start while
    L1 stages are still in use), the ring's transaction count the smaller phase's (the larger
    one expects the difference per stage), and L2 tiles waiting for the L1 tiles of their pool
    block. Both must have the same dtype, BLOCK_M, tile width and cluster size.
    ``num_stages``: the ring's stage count (default: the smaller of the two phases' own; the
    caller checks that it fits shared memory). FP4 weights: the packed stages
    likewise (``packed_stages``, default the smaller of the two; block-scale stride, the
    transaction count the smaller phase's)."""
    if (l1.phase, l2.phase) != ("l1", "l2"):
        raise ValueError("share_ring: expected an L1 and an L2 kernel")
    if (l1.ab_dtype, l1.block_m, l1.block_k, l1.chunks) != (l2.ab_dtype, l2.block_m, l2.block_k,
                                                            l2.chunks):
        raise ValueError(
            f"share_ring: L1 and L2 tiles differ (block_n {l1.block_n} vs {l2.block_n}: the "
            f"fused kernel needs hidden and 2 * intermediate to be multiples of {2 * WG_N})")
    if l1.cluster_m != l2.cluster_m:
        raise ValueError("share_ring: both phases run in clusters of the same size")
    if l1.fp4_weights != l2.fp4_weights:
        raise ValueError("share_ring: both phases have FP4 weights or neither")
    if l1.fp4_weights:
        packed_stages = packed_stages or min(l1.packed_stages, l2.packed_stages)
        packed_tx = min(l1.packed_tx_bytes, l2.packed_tx_bytes)
        for k in (l1, l2):
            k.packed_stages = packed_stages
            k.packed_sfb_stride = max(l1.sfb_len, l2.sfb_len)
            k.packed_ring_tx_bytes = packed_tx
            k.extra_packed_tx_bytes = k.packed_tx_bytes - packed_tx
    num_stages = num_stages or min(l1.num_stages, l2.num_stages)
    stride = max(l1.staging_stride, l2.staging_stride)
    staging_bytes = max(l1.staging_bytes, l2.staging_bytes)
    ring_tx = min(l1.stage_tx_bytes, l2.stage_tx_bytes)
    for k in (l1, l2):
        k.num_stages = num_stages
        k.staging_stride, k.staging_bytes = stride, staging_bytes
        k.sfa_stride = max(l1.sfa_len, l2.sfa_len)
        k.sfb_stride = max(l1.sfb_len, l2.sfb_len)
        k.ring_tx_bytes = ring_tx
        k.extra_tx_bytes = k.stage_tx_bytes - ring_tx
        k.wg_skew = 0  # (the skew barrier counts on the CTA's first tile of a launch)
    l1.signals_ready = True
    l2.waits_ready = l1.tile_signals()
