"""Blackwell (sm_100a) grouped GEMMs over the expert pool: L1 with the SwiGLU epilogue, and L2;
FP8 x FP4 block-scaled (``fp8xfp4``) or BF16 x BF16 (``bf16xbf16``).

What it computes (same pool conventions and epilogue math as ``sm90_expert_gemm``), for every
local expert ``e`` and every received row ``r`` of its pool rows
``[block_start[e] * BM, block_start[e] * BM + count[e])`` (``count = expert_recv_tokens``):

* ``phase="l1"``: ``acc = A[r] @ W1[e].T`` over ``K = H``; ``W1`` rows gate/up interleaved by 8
  (``quant.interleave_gate_up``). Per feature ``f``: ``g, u = bf16(acc)`` of the gate and up
  row, clamp (``g <= c``, ``-c <= u <= c``), ``h = silu(g) * u * topk_weight[r]``; written
  as e4m3 with a UE8M0 scale per 32 features (``fp8xfp4``: bit-exact with
  ``quant.requant_fp8_pow2(h, 32, use_packed_ue8m0=True)`` given the same ``h``) or as BF16
  (``bf16xbf16``).
* ``phase="l2"``: ``out[r] = bf16(A[r] @ W2[e].T)`` over ``K = I``, BF16 rows in pool order;
  or, with ``combine_layout``, each row straight into its source rank's ``combine[k, t]`` over
  NVLink (``(s, t, k)`` = ``token_src_metadata[r]``; design step f), as on sm_90a.

``fp8xfp4`` (the DeepGEMM recipe): ``A`` e4m3 and ``W`` e2m1, both scaled by UE8M0 factors per
32 K. Operands in global memory (``P`` pool rows, ``N`` weight rows, ``K`` reduction, ``E``
experts):

* ``a`` e4m3 ``[P, K]`` row-major (the L1 or L2 pool), ``a_sf`` int32 ``[K/128, P]``: the pool's
  packed UE8M0 scales, MN-major (byte ``g % 4`` of word ``[g // 4, r]`` scales K-group ``g`` of
  row ``r``), exactly the ``l1_acts_sf`` / ``l2_acts_sf`` regions of ``layout.MegaMoELayout``.
* ``b`` e2m1 ``[E, N, K/2]`` (two codes per byte, ``quant.pack_fp4``), ``b_sf`` int32
  ``[E, K/128, N]``: the weight scales after ``transform_weights_for_mega_moe(arch="sm100")``
  (interleaved for L1, UTCCP 4x32 transpose inside every 128 rows) stored MN-major
  (``quant.weight_sf_for_sm100``).
* l1 outputs: ``out`` e4m3 ``[P, N/2]``, ``out_sf`` int32 ``[N/256, P]`` (MN-major, the L2
  input's ``a_sf``); l2 output: ``out`` bf16 ``[P, N]``. ``topk_weights`` f32 ``[P]``.

``bf16xbf16``: ``a`` bf16 ``[P, K]``, ``b`` bf16 ``[E, N, K]`` (what
``transform_weights_for_mega_moe`` returns for BF16 weights), l1 ``out`` bf16 ``[P, N/2]`` (the
L2 pool ``h``), l2 ``out`` bf16 ``[P, N]``; no scales: ``a_sf``, ``b_sf`` and ``out_sf`` are
never read or written.

How (a persistent, warp-specialized kernel; 6 warps; ``tcgen05`` everywhere):

1. Warp 5 (TMA) walks this CTA's (cluster's) tiles with ``scheduler.device.ExpertTileScheduler``
   (``block_start`` rebuilt in shared memory by ``build_pool_prefix``) and TMA-loads per k-block
   (128 deep for ``fp8xfp4``, 64 for ``bf16xbf16``: 128 bytes of a row either way) the token
   tile, the weight tile (e2m1 unpacked to one byte per code in shared memory by the TMA) and,
   block-scaled only, both scale tiles into a ring of stages.
2. Warp 4 (MMA) issues ``tcgen05.mma`` into one of two FP32 accumulators in tensor memory (128
   lanes x 128 columns each), so the epilogue of a tile overlaps the MMAs of the next:
   ``fp8xfp4`` first copies the stage's scales to tensor memory (``tcgen05.cp`` 32x128b.warpx4,
   i.e. UTCCP), then ``kind::mxf8f6f4.block_scale`` (4 x K=32); ``bf16xbf16`` ``kind::f16``
   (4 x K=16). ``tcgen05.commit`` releases stages and publishes accumulators.
3. Warps 0-3 (epilogue) read the accumulator with ``tcgen05.ld`` (32x32b: thread = one tile row,
   all columns) and do the SwiGLU (L1; 32 features = 64 interleaved columns sit in one thread,
   so no shuffles; then the requant or the BF16 cast) or the BF16 cast (L2), then store rows
   straight to global memory, predicated on the row being valid: pad rows are never written.

Row permutation (why the pool's plain MN-major scales can be TMA-loaded): the block-scaled MMA
wants the scales of 128 tile rows as one 512-byte chunk in which row ``m`` sits at word
``4 * (m % 32) + m // 32``. Instead of transposing the scales, the token tile is loaded with its
rows permuted: tile row ``m`` of a 128-row group is pool row ``4 * (m % 32) + m // 32`` of that
group, so the group's plain scale words (pool row order) are already that chunk. Accumulator
lane ``m`` therefore holds pool row ``4 * (m % 32) + m // 32``; the epilogue maps it back.
``bf16xbf16`` keeps the same permutation (it costs nothing: the TMA box is the same 128 rows of
128 bytes) so both recipes share the load addressing and the epilogue.

Configurations: ``BM = 128`` (1 CTA, MMA 128x128), ``BM = 256`` (2-CTA pair, cluster 2x1,
``cta_group::2`` MMA 256x128, each CTA loads 128 token rows and 64 weight rows), ``BM = 64``
(1 CTA: the block-scaled MMA has no M = 64, so the MMA runs on the 128-row group holding the
block and half of its rows are discarded; only worth it for small experts, where the weight
reads dominate; ``bf16xbf16`` does the same, to keep one accumulator layout).

Constraints: ``K`` a multiple of 128 (``fp8xfp4``) or 64 (``bf16xbf16``); ``N`` a multiple of 128
(``fp8xfp4`` L1: of 256, ``N = 2I``, I/128 scale words); ``P`` a multiple of 128 and of ``BM``;
every tensor 16-byte aligned and ``out`` 64-byte aligned (32- / 64-byte row-chunk stores;
``layout`` regions are 128-byte aligned). Launched with at most one CTA per SM (the kernel
allocates 512 / 256 TMEM columns) and, for ``BM = 256``, an even grid.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import (
    BFloat16,
    Float4E2M1FN,
    Float8E4M3FN,
    Float8E8M0FNU,
    Float32,
    Int32,
    Int64,
    Uint8,
)
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.experimental import primitives as prims
from cutlass.memory import SmemAllocator, TmemAllocator

from ..config import Sm100GemmConfig
from ..scheduler.device import ExpertTileScheduler
from .common.gemm_config import check_gemm_config, combine_target
from .common.pool import build_pool_prefix
from .common.quant_math import FP8_E4M3_MAX, clamped_silu_mul, requant_exponent
from .common.sync import spin_timeout_ns, wait_reached

RECIPES = ("fp8xfp4", "bf16xbf16")
BLOCK_MS = (64, 128, 256)
TILE_N = 128  # weight rows per tile (L1: 64 features = two requant groups)
BLOCK_K = 128  # fp8xfp4 K per stage: one packed scale word (4 x 32) per row
BLOCK_K_BF16 = 64  # bf16xbf16 K per stage: 128 bytes per row (one 128B swizzle atom)
SF_VEC = 32
ROW_GROUP = 128  # token rows per CTA-level MMA tile / scale chunk
SMEM_CAPACITY = 232448  # sm_100 per-CTA shared memory (227 KB)
SM_SMEM_CAPACITY = 233472  # sm_100 shared memory per SM (228 KB), shared by resident CTAs
SMEM_RESERVED = 8192  # barriers, TMEM pointer, 1 KB static, 1024-byte alignment of each buffer
# (on sm90 a 2 KB margin overflowed the 227 KB limit by 2 KB once the buffers were aligned)
MAX_STAGES = 8
NUM_ACC_STAGES = 2
# tile walk block-major, n fastest (scheduler raster bands of 1): the sm90 kernels' L2-sized
# bands were measured on Hopper only
RASTER_GROUP = 1

# warp roles
EPILOGUE_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
TMA_WARP = 5
NUM_THREADS = 32 * 6
EPILOGUE_SYNC_BARRIER = 1
TMEM_ALLOC_BARRIER = 2


def lane_to_group_row(m: int) -> int:
    """Pool row (within its 128-row group) that MMA row / accumulator lane ``m`` holds."""
    return 4 * (m % 32) + m // 32


def gmem_layouts(p: int, k: int, n: int, e: int):
    """``(shape, stride)`` of the four operands as the kernel's TMA sees them, in elements
    (A: e4m3 or bf16, SFA / SFB: UE8M0 bytes, B: e2m1 codes or bf16; ``bf16xbf16`` uses only A
    and B). Coordinates: A / SFA ``(m, k, 1)`` with ``m = i + 32 j + 128 q`` the permuted tile
    row; B / SFB ``(n, k, expert)``.

    * A: tile row ``i + 32 j`` of group ``q`` is pool row ``128 q + 4 i + j`` of ``[P, K]``.
    * SFA: its scale, byte ``g % 4`` of word ``[g // 4, 128 q + 4 i + j]`` of int32
      ``[K/128, P]``; these byte offsets (``16 i + 4 j + g % 4`` inside a 512-byte chunk) are the
      block-scaled MMA's scale-chunk order, so no transpose is needed.
    * B: packed e2m1 ``[E, N, K/2]`` (code ``2 c + h`` of byte ``c``: low nibble first), or
      bf16 ``[E, N, K]``.
    * SFB: int32 ``[E, K/128, N]`` with the UTCCP row order (weight row ``i + 32 j`` of group
      ``q`` at ``128 q + 4 i + j``, as ``quant.transpose_sf_for_utccp`` leaves it).
    """
    words = k // BLOCK_K
    groups = p // ROW_GROUP
    a = ((((32, 4), groups), k, 1), (((4 * k, k), ROW_GROUP * k), 1, 0))
    sfa = ((((32, 4), groups), ((SF_VEC, 4), words), 1),
           (((16, 4), 4 * ROW_GROUP), ((0, 1), 4 * p), 0))
    b = ((n, k, e), (k, 1, n * k))
    sfb = ((((32, 4), n // ROW_GROUP), ((SF_VEC, 4), words), e),
           (((16, 4), 4 * ROW_GROUP), ((0, 1), 4 * n), 4 * n * words))
    return a, sfa, b, sfb


class Sm100ExpertGemmKernel:
    """One grouped GEMM of the expert FFN over the pool, tcgen05 (see module doc), built from
    its shapes and a complete `config.Sm100GemmConfig`. ``combine_layout``: L2 sends its rows
    to the source ranks' combine buffers of a symmetric buffer with this `MegaMoELayout`;
    ``smem_reserved``: shared-memory bytes a fused kernel's other phases take."""

    def __init__(self, phase: str, recipe: str, num_experts: int, num_pool_rows: int, n: int,
                 k: int, config: Sm100GemmConfig, activation_clamp: float | None = None,
                 fast_math: bool = True, combine_layout=None, smem_reserved: int = 0):
        if not isinstance(config, Sm100GemmConfig):
            raise TypeError(f"config: an Sm100GemmConfig, got {type(config).__name__}")
        config.check_complete(type(self).__name__)
        self.config = config
        block_m = config.block_m
        self.phase, self.recipe = phase, recipe
        self.block_scaled = recipe == "fp8xfp4"
        self.ab_dtype = Float8E4M3FN if self.block_scaled else BFloat16
        self.block_k = BLOCK_K if self.block_scaled else BLOCK_K_BF16
        self.block_m = block_m
        self.use_2cta = block_m == 256
        self.cta_group = tcgen05.CtaGroup.TWO if self.use_2cta else tcgen05.CtaGroup.ONE
        self.cluster_shape_mn = (2, 1) if self.use_2cta else (1, 1)
        self.cluster_size = 2 if self.use_2cta else 1
        self.mma_tiler_mn = (2 * ROW_GROUP if self.use_2cta else ROW_GROUP, TILE_N)
        self.num_experts, self.num_pool_rows, self.n, self.k = num_experts, num_pool_rows, n, k
        self.clamp = check_gemm_config(
            "sm100", phase, recipe, RECIPES, block_m, BLOCK_MS,
            (("n", n, TILE_N), ("k", k, self.block_k),
             ("num_pool_rows", num_pool_rows, max(block_m, ROW_GROUP))), activation_clamp)
        if self.block_scaled and phase == "l1" and n % 256 != 0:
            raise ValueError(f"l1: n = 2I ({n}) must be a multiple of 256 (I/128 scale words)")
        if num_experts <= 0:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        self.num_n_blocks = n // TILE_N
        self.num_k_blocks = k // self.block_k
        # L2 rows go to the source ranks' combine buffers (`MegaMoELayout`), not to `out`
        self.to_combine = combine_layout is not None
        if self.to_combine:
            self.combine_offset, self.combine_tokens, self.num_ranks = combine_target(
                phase, n, num_pool_rows, combine_layout)
        self.out_cols = n // 2 if phase == "l1" else n
        self.fast_math = bool(fast_math)
        # epilogue sub-tile: L1 reads 64 columns (one requant group of 32 features), L2 32
        self.epi_cols = 64 if phase == "l1" else 32
        # one stage: fp8xfp4 A 128 x 128 e4m3, B (128 or 64) x 128 codes (a byte each), scale
        # chunks; bf16xbf16 A 128 x 64 and B (128 or 64) x 64 bf16
        b_rows = TILE_N // self.cluster_size
        if self.block_scaled:
            stage_bytes = ROW_GROUP * BLOCK_K + b_rows * BLOCK_K + 2 * 512
        else:
            stage_bytes = (ROW_GROUP + b_rows) * BLOCK_K_BF16 * 2
        self.stage_bytes = stage_bytes
        # `smem_reserved`: what a fused kernel's other phases take (they replace the prefix
        # arrays: the dispatch leaves its own)
        prefix_bytes = 2 * 4 * (num_experts + 1) if smem_reserved == 0 else smem_reserved
        fit = (SMEM_CAPACITY - SMEM_RESERVED - prefix_bytes) // stage_bytes
        # one CTA per SM, a checked invariant: the grid is persistent (one CTA per SM) and
        # every CTA allocates its TMEM columns for the whole run; a second CTA on an SM could
        # wait for TMEM forever. Fewer stages than this would let two CTAs' shared memory
        # (its lower bound: the stages and the prefix arrays) fit on one SM.
        fewest = max(2, (SM_SMEM_CAPACITY // 2 - prefix_bytes) // stage_bytes + 1)
        self.num_stages = min(MAX_STAGES, fit)
        if not fewest <= self.num_stages:
            raise ValueError(f"{self.num_stages} stages fit shared memory, fewer than {fewest} "
                             f"(two CTAs could share an SM)")
        self.scheduler = ExpertTileScheduler(num_experts, block_m, self.num_n_blocks)
        # What a fused kernel changes (`share_ring`): L1 epilogue warps signal a pool block's
        # readiness counter once per tile after its rows are stored; L2 loads wait for
        # `waits_ready` arrivals per pool block (0: no wait)
        self.signals_ready = False
        self.waits_ready = 0
        self.timeout_ns = spin_timeout_ns()

    # ------------------------------------------------------------------------------ host side
    def tile_signals(self) -> int:
        """Arrivals at a pool block's readiness counter once all of this phase's tiles of the
        block are done (`signals_ready`): one per epilogue warp of each CTA per n-block."""
        return self.num_n_blocks * len(EPILOGUE_WARPS) * self.cluster_size

    def acc_consumer_arrivals(self) -> int:
        """Arrivals that free an accumulator stage: every epilogue thread of the CTA pair."""
        return 32 * len(EPILOGUE_WARPS) * self.cluster_size

    def _setup(self):
        """Tiled MMAs, shared-memory layouts and TMEM column budget (needs the traced dtypes)."""
        k_major = OperandMajorMode.K
        self.mma_tiler = (*self.mma_tiler_mn, self.block_k)
        if not self.block_scaled:
            self.tiled_mma = sm100_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, k_major, k_major, Float32, self.cta_group, self.mma_tiler_mn)
            self.a_smem_layout = sm100_utils.make_smem_layout_a(
                self.tiled_mma, self.mma_tiler, BFloat16, self.num_stages)
            self.b_smem_layout = sm100_utils.make_smem_layout_b(
                self.tiled_mma, self.mma_tiler, BFloat16, self.num_stages)
            self.num_acc_tmem_cols = TILE_N * NUM_ACC_STAGES
            self.num_tmem_cols = self.num_acc_tmem_cols
        else:
            self.tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
                Float8E4M3FN, Float4E2M1FN, k_major, k_major, Float8E8M0FNU, SF_VEC,
                self.cta_group, self.mma_tiler_mn)
            # SFB is always a whole 128-row chunk per CTA, copied by a 1-CTA view of the MMA
            self.mma_tiler_mn_sfb = (self.mma_tiler_mn[0] // self.cluster_size, TILE_N)
            self.tiled_mma_sfb = sm100_utils.make_blockscaled_trivial_tiled_mma(
                Float8E4M3FN, Float4E2M1FN, k_major, k_major, Float8E8M0FNU, SF_VEC,
                tcgen05.CtaGroup.ONE, self.mma_tiler_mn_sfb)
            self.mma_tiler_sfb = (*self.mma_tiler_mn_sfb, BLOCK_K)
            self.cluster_layout_sfb_vmnk = cute.tiled_divide(
                cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma_sfb.thr_id.shape,))
            self.a_smem_layout = sm100_utils.make_smem_layout_a(
                self.tiled_mma, self.mma_tiler, Float8E4M3FN, self.num_stages)
            # mixed FP8 x FP4: the FP4 operand lives as one byte per code in shared memory
            self.b_smem_layout = sm100_utils.make_smem_layout_b(
                self.tiled_mma, self.mma_tiler, cutlass.Int8, self.num_stages)
            self.sfa_smem_layout = blockscaled_utils.make_smem_layout_sfa(
                self.tiled_mma, self.mma_tiler, SF_VEC, self.num_stages)
            self.sfb_smem_layout = blockscaled_utils.make_smem_layout_sfb(
                self.tiled_mma, self.mma_tiler, SF_VEC, self.num_stages)
            k_atoms = BLOCK_K // (SF_VEC * 4)
            self.num_sfa_tmem_cols = (ROW_GROUP // 32) * 4 * k_atoms
            self.num_sfb_tmem_cols = (TILE_N // 32) * 4 * k_atoms
            self.num_acc_tmem_cols = TILE_N * NUM_ACC_STAGES
            self.num_tmem_cols = 512
        mma_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        assert self.block_k % mma_k == 0
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma.thr_id.shape,))

    def _global_tensors(self, a, a_sf, b, b_sf):
        """Token, weight and scale tensors with the (row-permuted) layouts of ``gmem_layouts``
        (``bf16xbf16``: the scale tensors are None)."""
        specs = gmem_layouts(self.num_pool_rows, self.k, self.n, self.num_experts)
        ptrs = (a, a_sf, b, b_sf) if self.block_scaled else (a, None, b, None)
        return tuple(None if ptr is None else cute.make_tensor(
            ptr, cute.make_layout(shape, stride=stride))
            for ptr, (shape, stride) in zip(ptrs, specs, strict=True))

    @cute.jit
    def __call__(
        self,
        a: cute.Pointer,  # [P, K] e4m3 / bf16: the L1 or L2 pool
        a_sf: cute.Pointer,  # fp8xfp4: int32 [K/128, P] packed UE8M0 (pass as Float8E8M0FNU)
        b: cute.Pointer,  # fp8xfp4: e2m1 [E, N, K/2] packed (Float4E2M1FN); bf16 [E, N, K]
        b_sf: cute.Pointer,  # fp8xfp4: int32 [E, K/128, N] packed UE8M0, UTCCP rows
        expert_recv_tokens: cute.Pointer,  # Int32 [E]
        topk_weights: cute.Pointer,  # f32 [P] (l1)
        out: cute.Pointer,  # l1: e4m3 / bf16 [P, N/2]; l2: bf16 [P, N]
        out_sf: cute.Pointer,  # fp8xfp4 l1: int32 [N/256, P] (pass as Uint8 bytes)
        peer_bases: cute.Pointer,  # Int64 [R]: the symmetric buffers (to_combine)
        src_metadata: cute.Pointer,  # Int32 [P, 4]: (rank, token, slot, 0) (to_combine)
        num_ctas: Int32,
        stream,
    ):
        self._setup()
        tma_a, tma_m_a, tma_b, tma_m_b, sf_args = self.tma_atoms(a, a_sf, b, b_sf)
        self.shared_storage = self._shared_storage()
        self.kernel(self.tiled_mma, tma_a, tma_m_a, tma_b, tma_m_b, self.cluster_layout_vmnk,
                    self.a_smem_layout, self.b_smem_layout, *sf_args,
                    cute.make_tensor(expert_recv_tokens, cute.make_layout(self.num_experts)),
                    topk_weights, out, out_sf, peer_bases, src_metadata).launch(
            grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1],
            cluster=(*self.cluster_shape_mn, 1), min_blocks_per_mp=1, stream=stream)

    def tma_atoms(self, a: cute.Pointer, a_sf: cute.Pointer, b: cute.Pointer,
                  b_sf: cute.Pointer):
        """TMA atoms and tensors of the tokens, weights and (block-scaled) both scale operands
        (host side of a `cute.jit` function, after `_setup`); sets ``stage_tx_bytes``, the bytes
        one stage's loads deliver to the MMA CTA's barrier: ``(tma_a, m_a, tma_b, m_b,
        sf_args)``, ``sf_args`` the block-scaled arguments of ``kernel`` (all None for bf16)."""
        m_a, m_sfa, m_b, m_sfb = self._global_tensors(a, a_sf, b, b_sf)
        a_smem_one = cute.slice_(self.a_smem_layout, (None, None, None, 0))
        b_smem_one = cute.slice_(self.b_smem_layout, (None, None, None, 0))
        cluster_shape = self.cluster_layout_vmnk.shape
        b_internal = cutlass.Int8 if self.block_scaled else None
        tma_a, tma_m_a = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn,
                                                    self.tiled_mma.thr_id),
            m_a, a_smem_one, self.mma_tiler, self.tiled_mma, cluster_shape)
        tma_b, tma_m_b = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn,
                                                    self.tiled_mma.thr_id),
            m_b, b_smem_one, self.mma_tiler, self.tiled_mma, cluster_shape,
            internal_type=b_internal)
        # block-scaled only: the scale operands (None for bf16xbf16, never traced)
        sf_args = (None, None, None, None, None, None, None, None)
        if self.block_scaled:
            sfa_smem_one = cute.slice_(self.sfa_smem_layout, (None, None, None, 0))
            sfb_smem_one = cute.slice_(self.sfb_smem_layout, (None, None, None, 0))
            tma_sfa, tma_m_sfa = cute.nvgpu.make_tiled_tma_atom_A(
                sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn,
                                                        self.tiled_mma.thr_id),
                m_sfa, sfa_smem_one, self.mma_tiler, self.tiled_mma, cluster_shape,
                internal_type=cutlass.Int16)
            tma_sfb, tma_m_sfb = cute.nvgpu.make_tiled_tma_atom_B(
                sm100_utils.cluster_shape_to_tma_atom_SFB(self.cluster_shape_mn,
                                                          self.tiled_mma.thr_id),
                m_sfb, sfb_smem_one, self.mma_tiler_sfb, self.tiled_mma_sfb,
                self.cluster_layout_sfb_vmnk.shape, internal_type=cutlass.Int16)
            sf_args = (self.tiled_mma_sfb, tma_sfa, tma_m_sfa, tma_sfb, tma_m_sfb,
                       self.cluster_layout_sfb_vmnk, self.sfa_smem_layout, self.sfb_smem_layout)
            # bytes landing per stage, over the CTA pair (the FP4 tile counts its packed size)
            self.stage_tx_bytes = (cute.size_in_bytes(Float8E4M3FN, a_smem_one)
                                   + cute.size_in_bytes(Float4E2M1FN, b_smem_one)
                                   + cute.size_in_bytes(Float8E8M0FNU, sfa_smem_one)
                                   + cute.size_in_bytes(Float8E8M0FNU, sfb_smem_one)
                                   ) * self.cluster_size
        else:
            self.stage_tx_bytes = (cute.size_in_bytes(BFloat16, a_smem_one)
                                   + cute.size_in_bytes(BFloat16, b_smem_one)
                                   ) * self.cluster_size
        return tma_a, tma_m_a, tma_b, tma_m_b, sf_args

    def _shared_storage(self, prefix: bool = True):
        """The shared-memory struct: barriers, TMEM pointer, scheduler prefix arrays (unless
        ``prefix`` is False: a fused kernel's dispatch leaves its own) and the stage rings
        (operand tiles 1024-byte aligned for the 128B swizzle; scale tiles only when
        block-scaled)."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        a_type, b_type = (Float8E4M3FN, cutlass.Int8) if self.block_scaled else (BFloat16,
                                                                                  BFloat16)
        fields = {
            "ab_full": mem[Int64, self.num_stages],
            "ab_empty": mem[Int64, self.num_stages],
            "acc_full": mem[Int64, NUM_ACC_STAGES],
            "acc_empty": mem[Int64, NUM_ACC_STAGES],
            "tmem_dealloc_mbar": Int64,
            "tmem_holding_buf": Int32,
            **({"block_start": mem[Int32, self.num_experts + 1],
                "row_start": mem[Int32, self.num_experts + 1]} if prefix else {}),
            "sa": align[mem[a_type, cute.cosize(self.a_smem_layout.outer)], 1024],
            "sb": align[mem[b_type, cute.cosize(self.b_smem_layout.outer)], 1024],
        }
        if self.block_scaled:
            fields["ssfa"] = align[mem[Float8E8M0FNU, cute.cosize(self.sfa_smem_layout)], 1024]
            fields["ssfb"] = align[mem[Float8E8M0FNU, cute.cosize(self.sfb_smem_layout)], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, m_a: cute.Tensor,
               tma_b: cute.CopyAtom, m_b: cute.Tensor, cluster_layout_vmnk: cute.Layout,
               a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
               # block-scaled only (None for bf16xbf16):
               tiled_mma_sfb, tma_sfa, m_sfa, tma_sfb, m_sfb, cluster_layout_sfb_vmnk,
               sfa_smem_layout, sfb_smem_layout,
               expert_recv_tokens: cute.Tensor, topk_weights: cute.Pointer, out: cute.Pointer,
               out_sf: cute.Pointer, peer_bases: cute.Pointer, src_metadata: cute.Pointer):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        if warp == TMA_WARP:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.block_scaled):
                cpasync.prefetch_descriptor(tma_sfa)
                cpasync.prefetch_descriptor(tma_sfb)
        cta_in_pair = bidx % self.cluster_size
        is_leader = cta_in_pair == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cluster_layout_vmnk.get_flat_coord(cta_rank)
        first_tile = bidx // self.cluster_size
        tile_stride = grid // self.cluster_size

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        block_start = storage.block_start.get_tensor(cute.make_layout(self.num_experts + 1))
        row_start = storage.row_start.get_tensor(cute.make_layout(self.num_experts + 1))
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.stage_tx_bytes, cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(), num_stages=NUM_ACC_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.acc_consumer_arrivals()),
            cta_layout_vmnk=cluster_layout_vmnk, defer_sync=True)
        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=TMEM_ALLOC_BARRIER, num_threads=32 * (1 + len(EPILOGUE_WARPS))),
            allocator_warp_id=EPILOGUE_WARPS[0], is_two_cta=self.use_2cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr)
        if warp == MMA_WARP:
            build_pool_prefix(expert_recv_tokens, row_start, block_start, self.num_experts,
                              self.block_m)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sa = storage.sa.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sb = storage.sb.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        # the scale operands of the TMA warp and of the MMA warp (block-scaled only)
        sf_load = sf_mma = None
        if cutlass.const_expr(self.block_scaled):
            ssfa = storage.ssfa.get_tensor(sfa_smem_layout)
            ssfb = storage.ssfb.get_tensor(sfb_smem_layout)
            sf_load = (tiled_mma_sfb, tma_sfa, m_sfa, tma_sfb, m_sfb, cluster_layout_sfb_vmnk,
                       cluster_layout_sfb_vmnk.get_flat_coord(cta_rank), ssfa, ssfb)
            sf_mma = (ssfa, ssfb)

        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        t_acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, NUM_ACC_STAGES))

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)
        cute.arch.sync_threads()  # the prefix arrays are visible to every warp
        num_tiles = self.scheduler.num_tiles(block_start)

        if warp == TMA_WARP:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.num_stages)
            state, _ = self.produce(tiled_mma, tma_a, m_a, tma_b, m_b, cluster_layout_vmnk,
                                    cluster_coord, sa, sb, sf_load, ab_pipe, block_start,
                                    row_start, num_tiles, first_tile, tile_stride, cta_in_pair,
                                    state)
            ab_pipe.producer_tail(state)
        if warp == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                    self.num_stages)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     NUM_ACC_STAGES)
            ab_state, acc_state, _ = self.mma(
                tiled_mma, sa, sb, sf_mma, t_acc_fake, acc_ptr, ab_pipe, acc_pipe, block_start,
                row_start, num_tiles, first_tile, tile_stride, is_leader, ab_state, acc_state)
            acc_pipe.producer_tail(acc_state)
        if warp < MMA_WARP:
            tmem.allocate(self.num_tmem_cols)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            t_acc = cute.make_tensor(acc_ptr, t_acc_fake.layout)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                     NUM_ACC_STAGES)
            self.epilogue(t_acc, acc_pipe, block_start, row_start, num_tiles, first_tile,
                          tile_stride, cta_in_pair, tidx, topk_weights, out, out_sf,
                          peer_bases, src_metadata, acc_state)
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=EPILOGUE_SYNC_BARRIER,
                                  num_threads=32 * len(EPILOGUE_WARPS)).arrive_and_wait()
            tmem.free(acc_ptr)

    @cute.jit
    def group_of_tile(self, pool_block: Int32, cta_in_pair: Int32) -> Int32:
        """Index of the 128-row pool group this CTA's MMA rows come from (the TMA M tile for
        1-CTA; 2-CTA tiles count in pairs of groups and the TMA picks the CTA's half)."""
        group = pool_block * self.block_m // ROW_GROUP
        if cutlass.const_expr(self.use_2cta):
            group = 2 * pool_block + cta_in_pair
        return group

    @cute.jit
    def produce(self, tiled_mma, tma_a, m_a, tma_b, m_b, cluster_layout_vmnk, cluster_coord, sa,
                sb, sf_load, ab_pipe, block_start, row_start, num_tiles: Int32,
                first_tile: Int32, tile_stride: Int32, cta_in_pair: Int32, state,
                ready: cute.Pointer = None, barrier_slots: cute.Pointer = None):
        """Warp ``TMA_WARP``: the TMA loads (tokens, weights and, block-scaled, their two scale
        tiles) of every k-block of tiles ``first_tile``, ``first_tile + tile_stride``, ...
        ``< num_tiles`` of this CTA; ``state``: the ring's producer state. With ``waits_ready``
        (L2 of the fused kernel) a tile's loads start once ``ready[pool_block]`` (the L1 tiles
        of the block stored) reaches it. Returns ``(state, the first tile index past
        num_tiles)``."""
        g_a = cute.local_tile(m_a, cute.slice_(self.mma_tiler, (None, 0, None)),
                              (None, None, None))
        g_b = cute.local_tile(m_b, cute.slice_(self.mma_tiler, (0, None, None)),
                              (None, None, None))
        thr_mma = tiled_mma.get_slice(cluster_coord[0])
        a_cta = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
        b_cta = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape)
        t_sa, t_ga = cpasync.tma_partition(tma_a, cluster_coord[2], a_cta,
                                           cute.group_modes(sa, 0, 3),
                                           cute.group_modes(thr_mma.partition_A(g_a), 0, 3))
        t_sb, t_gb = cpasync.tma_partition(tma_b, cluster_coord[1], b_cta,
                                           cute.group_modes(sb, 0, 3),
                                           cute.group_modes(thr_mma.partition_B(g_b), 0, 3))
        # 2-CTA: the copies signal the leader's barrier
        mask_a = mask_b = None
        if cutlass.const_expr(self.use_2cta):
            mask_a = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord,
                                                       mcast_mode=2)
            mask_b = cpasync.create_tma_multicast_mask(cluster_layout_vmnk, cluster_coord,
                                                       mcast_mode=1)
        if cutlass.const_expr(self.block_scaled):
            (tiled_mma_sfb, tma_sfa, m_sfa, tma_sfb, m_sfb, cluster_layout_sfb_vmnk,
             cluster_coord_sfb, ssfa, ssfb) = sf_load
            g_sfa = cute.local_tile(m_sfa, cute.slice_(self.mma_tiler, (None, 0, None)),
                                    (None, None, None))
            g_sfb = cute.local_tile(m_sfb, cute.slice_(self.mma_tiler_sfb, (0, None, None)),
                                    (None, None, None))
            thr_mma_sfb = tiled_mma_sfb.get_slice(cluster_coord[0])
            sfb_cta = cute.make_layout(
                cute.slice_(cluster_layout_sfb_vmnk, (0, None, 0, 0)).shape)
            t_ssfa, t_gsfa = cpasync.tma_partition(
                tma_sfa, cluster_coord[2], a_cta, cute.group_modes(ssfa, 0, 3),
                cute.group_modes(thr_mma.partition_A(g_sfa), 0, 3))
            t_ssfb, t_gsfb = cpasync.tma_partition(
                tma_sfb, cluster_coord_sfb[1], sfb_cta, cute.group_modes(ssfb, 0, 3),
                cute.group_modes(thr_mma_sfb.partition_B(g_sfb), 0, 3))
            t_ssfa, t_gsfa = cute.filter_zeros(t_ssfa), cute.filter_zeros(t_gsfa)
            t_ssfb, t_gsfb = cute.filter_zeros(t_ssfb), cute.filter_zeros(t_gsfb)
            # SFB goes to both CTAs of a pair (multicast)
            mask_sfb = None
            if cutlass.const_expr(self.use_2cta):
                mask_sfb = cpasync.create_tma_multicast_mask(cluster_layout_sfb_vmnk,
                                                             cluster_coord_sfb, mcast_mode=1)

        tile = first_tile
        expert = Int32(0)
        while tile < num_tiles:
            _o, expert, _m, n_block, pool_block, _v = self.scheduler.tile(
                tile, expert, block_start, row_start, RASTER_GROUP)
            if cutlass.const_expr(self.waits_ready > 0):
                wait_reached(barrier_slots, ready + pool_block, Int32(self.waits_ready), "gpu",
                             "L1 tiles of a pool block", self.timeout_ns)
                # the L1 rows and scales came through generic stores; the acquire above is
                # generic: order the TMA (async proxy) loads below after it
                cute.arch.fence_proxy("async.global")
            # 1-CTA: the 128-row group; 2-CTA: the 256-row MMA tile (= the pool block)
            m_tile = pool_block
            if cutlass.const_expr(not self.use_2cta):
                m_tile = self.group_of_tile(pool_block, cta_in_pair)
            ga = t_ga[(None, m_tile, None, 0)]
            gb = t_gb[(None, n_block, None, expert)]
            if cutlass.const_expr(self.block_scaled):
                gsfa = t_gsfa[(None, m_tile, None, 0)]
                gsfb = t_gsfb[(None, n_block, None, expert)]
            for kb in cutlass.range(self.num_k_blocks, unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, ga[(None, kb)], t_sa[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=mask_a)
                cute.copy(tma_b, gb[(None, kb)], t_sb[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=mask_b)
                if cutlass.const_expr(self.block_scaled):
                    cute.copy(tma_sfa, gsfa[(None, kb)], t_ssfa[(None, state.index)],
                              tma_bar_ptr=bar, mcast_mask=mask_a)
                    cute.copy(tma_sfb, gsfb[(None, kb)], t_ssfb[(None, state.index)],
                              tma_bar_ptr=bar, mcast_mask=mask_sfb)
                state.advance()
            tile += tile_stride
        return state, tile

    @cute.jit
    def mma(self, tiled_mma, sa, sb, sf_mma, t_acc_fake, acc_ptr, ab_pipe, acc_pipe,
            block_start, row_start, num_tiles: Int32, first_tile: Int32, tile_stride: Int32,
            is_leader, ab_state, acc_state):
        """Warp ``MMA_WARP`` (leader CTA issues): block-scaled, UTCCP the scales then the
        ``kind::mxf8f6f4`` MMAs; BF16, the ``kind::f16`` MMAs. ``ab_state`` / ``acc_state``:
        the ring's consumer and the accumulators' producer state. Returns ``(ab_state,
        acc_state, the first tile index past num_tiles)``."""
        t_acc_base = cute.make_tensor(acc_ptr, t_acc_fake.layout)
        if cutlass.const_expr(self.block_scaled):
            ssfa, ssfb = sf_mma
            sfa_ptr = cute.recast_ptr(acc_ptr + self.num_acc_tmem_cols, dtype=Float8E8M0FNU)
            t_sfa = cute.make_tensor(sfa_ptr, blockscaled_utils.make_tmem_layout_sfa(
                tiled_mma, self.mma_tiler, SF_VEC,
                cute.slice_(ssfa.layout, (None, None, None, 0))))
            sfb_ptr = cute.recast_ptr(
                acc_ptr + self.num_acc_tmem_cols + self.num_sfa_tmem_cols, dtype=Float8E8M0FNU)
            t_sfb = cute.make_tensor(sfb_ptr, blockscaled_utils.make_tmem_layout_sfb(
                tiled_mma, self.mma_tiler, SF_VEC,
                cute.slice_(ssfb.layout, (None, None, None, 0))))
            s2t_sfa, s_sfa, d_sfa = self.s2t_partition(ssfa, t_sfa)
            s2t_sfb, s_sfb, d_sfb = self.s2t_partition(ssfb, t_sfb)
        r_a = tiled_mma.make_fragment_A(sa)
        r_b = tiled_mma.make_fragment_B(sb)

        tile = first_tile
        expert = Int32(0)
        while tile < num_tiles:
            _o, expert, _m, _n, _pb, _v = self.scheduler.tile(tile, expert, block_start,
                                                              row_start, RASTER_GROUP)
            t_acc = t_acc_base[(None, None, None, acc_state.index)]
            if is_leader:
                acc_pipe.producer_acquire(acc_state)
                # the epilogue's TMEM loads of this stage (ordered before its release by its
                # before-fence) complete before these MMAs overwrite it
                prims.tcgen05_fence("after_thread_sync")
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for _kb in cutlass.range(self.num_k_blocks, unroll=1):
                    ab_pipe.consumer_wait(ab_state)
                    crd = (None, None, None, ab_state.index)
                    if cutlass.const_expr(self.block_scaled):
                        stage = (None, None, None, None, ab_state.index)
                        cute.copy(s2t_sfa, s_sfa[stage], d_sfa)
                        cute.copy(s2t_sfb, s_sfb[stage], d_sfb)
                        cute.gemm(tiled_mma, t_acc, [r_a[crd], t_sfa], [r_b[crd], t_sfb], t_acc)
                    else:
                        cute.gemm(tiled_mma, t_acc, r_a[crd], r_b[crd], t_acc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    ab_pipe.consumer_release(ab_state)
                    ab_state.advance()
                acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            tile += tile_stride
        return ab_state, acc_state, tile

    def s2t_partition(self, s_sf: cute.Tensor, t_sf: cute.Tensor):
        """UTCCP (``tcgen05.cp`` 4x32x128b) copy of a scale chunk, and its smem/TMEM views."""
        s_compact = cute.filter_zeros(s_sf)
        t_compact = cute.filter_zeros(t_sf)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), Float8E8M0FNU)
        tiled = tcgen05.make_s2t_copy(atom, t_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(s_compact))
        return tiled, src, thr.partition_D(t_compact)

    # ------------------------------------------------------------------------------- epilogue
    @cute.jit
    def epilogue(self, t_acc: cute.Tensor, acc_pipe, block_start, row_start, num_tiles: Int32,
                 first_tile: Int32, tile_stride: Int32, cta_in_pair: Int32, tidx: Int32,
                 topk_weights: cute.Pointer, out: cute.Pointer, out_sf: cute.Pointer,
                 peer_bases: cute.Pointer, src_metadata: cute.Pointer, state,
                 ready: cute.Pointer = None):
        """Warps 0-3: thread ``m`` owns accumulator lane ``m`` (one tile row, all columns).
        ``state``: the accumulators' consumer state. With ``signals_ready`` (L1 of the fused
        kernel) each warp adds 1 to ``ready[pool_block]`` once its rows of a tile are stored.
        Returns ``(state, the first tile index past num_tiles)``."""
        epi_tile = (ROW_GROUP, self.epi_cols)
        t_acc_epi = cute.flat_divide(t_acc[((None, None), 0, 0, None)], epi_tile)
        atom = cute.make_copy_atom(
            tcgen05.Ld32x32bOp(tcgen05.Repetition(self.epi_cols)), Float32)
        t2r = tcgen05.make_tmem_copy(atom, t_acc_epi[(None, None, 0, 0, 0)])
        thr = t2r.get_slice(tidx)
        src = thr.partition_S(t_acc_epi)  # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, STAGE)
        frag_shape = thr.partition_D(cute.make_identity_tensor(epi_tile)).shape
        acc = cute.make_rmem_tensor(frag_shape, Float32)
        num_chunks = TILE_N // self.epi_cols
        # lane m holds pool row 4 (m % 32) + m // 32 of its 128-row group (see module doc)
        lane_row = 4 * (tidx % 32) + tidx // 32  # lane_to_group_row
        tile = first_tile
        expert = Int32(0)
        while tile < num_tiles:
            _o, expert, _m, n_block, pool_block, valid_m = self.scheduler.tile(
                tile, expert, block_start, row_start, RASTER_GROUP)
            pool_row = self.group_of_tile(pool_block, cta_in_pair) * ROW_GROUP + lane_row
            row = pool_row - pool_block * self.block_m
            valid = (row >= 0) & (row < valid_m)
            weight = Float32(0.0)
            if cutlass.const_expr(self.phase == "l1"):
                if valid:
                    weight = cute.make_tensor(topk_weights, cute.make_layout(
                        self.num_pool_rows))[pool_row]
            row_dst = Int64(0)  # L2: where this thread's row goes
            if cutlass.const_expr(self.phase == "l2"):
                row_dst = self.row_destination(out, peer_bases, src_metadata, pool_row, valid)
            acc_pipe.consumer_wait(state)
            prims.tcgen05_fence("after_thread_sync")  # the MMAs' results, then our TMEM loads
            for c in cutlass.range_constexpr(num_chunks):
                cute.copy(t2r, src[(None, None, None, 0, c, state.index)], acc)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before using acc
                if valid:
                    if cutlass.const_expr(self.phase == "l1" and self.block_scaled):
                        self.swiglu_requant_store(acc, weight, out, out_sf, pool_row,
                                                  2 * n_block + c)
                    elif cutlass.const_expr(self.phase == "l1"):
                        self.swiglu_store_bf16(acc, weight, out, pool_row, 2 * n_block + c)
                    else:
                        self.store_bf16(acc, row_dst, n_block * TILE_N + c * 32)
            prims.tcgen05_fence("before_thread_sync")  # our TMEM loads, then the MMA's reuse
            acc_pipe.consumer_release(state)
            if cutlass.const_expr(self.signals_ready):
                self.signal_ready(ready, pool_block, tidx % 32)
            state.advance()
            tile += tile_stride
        return state, tile

    @cute.jit
    def signal_ready(self, ready: cute.Pointer, pool_block: Int32, lane: Int32):
        """This warp's rows of pool block ``pool_block`` (one L1 tile) are in global memory: add
        1 to ``ready[pool_block]`` with a release at GPU scope. The warp sync orders the other
        lanes' (generic) row and scale stores before lane 0's release."""
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.red(ready + pool_block, Int32(1), op="add", dtype="s32", sem="release",
                          scope="gpu")

    @cute.jit
    def silu_mul(self, g: Float32, u: Float32) -> Float32:
        return clamped_silu_mul(g, u, self.clamp, self.fast_math)

    @cute.jit
    def swiglu(self, acc: cute.Tensor, weight: Float32) -> cute.Tensor:
        """64 interleaved columns (gate 8, up 8, ...) -> ``h`` of their 32 features: BF16
        rounding of the accumulator, clamp, SwiGLU, times the routing weight."""
        rounded = cute.make_rmem_tensor(acc.shape, Float32)
        rounded.store(acc.load().to(BFloat16).to(Float32))
        h = cute.make_rmem_tensor((32,), Float32)
        for b in cutlass.range_constexpr(4):
            for r in cutlass.range_constexpr(8):
                h[8 * b + r] = self.silu_mul(rounded[16 * b + r], rounded[16 * b + 8 + r]) * weight
        return h

    @cute.jit
    def swiglu_store_bf16(self, acc: cute.Tensor, weight: Float32, out: cute.Pointer,
                          pool_row: Int32, group: Int32):
        """``bf16xbf16`` L1: features ``32 group ..`` of one row of ``h`` as BF16 (64 bytes)."""
        h = self.swiglu(acc, weight)
        vals = cute.make_rmem_tensor((32,), BFloat16)
        vals.store(h.load().to(BFloat16))
        dst = cute.make_ptr(BFloat16, out.toint() + (Int64(pool_row) * self.out_cols
                                                     + group * 32) * 2,
                            cute.AddressSpace.gmem, assumed_align=64)
        cute.autovec_copy(vals, cute.make_tensor(dst, cute.make_layout(32)))

    @cute.jit
    def swiglu_requant_store(self, acc: cute.Tensor, weight: Float32, out: cute.Pointer,
                             out_sf: cute.Pointer, pool_row: Int32, group: Int32):
        """``fp8xfp4`` L1: 64 interleaved columns -> 32 features of requant group ``group``:
        ``h`` (``swiglu``), UE8M0 scale, e4m3."""
        h = self.swiglu(acc, weight)
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(32):
            amax = cute.arch.fmax(amax, cute.math.absf(h[i]))
        exponent = requant_exponent(amax)
        sf_inv = ((127 - exponent) << 23).bitcast(Float32)
        q = cute.make_rmem_tensor((32,), Float32)
        for i in cutlass.range_constexpr(32):
            q[i] = cutlass.max(cutlass.min(h[i] * sf_inv, Float32(FP8_E4M3_MAX)),
                               Float32(-FP8_E4M3_MAX))
        codes = cute.make_rmem_tensor((32,), Float8E4M3FN)
        codes.store(q.load().to(Float8E4M3FN))
        dst = cute.make_ptr(Float8E4M3FN, out.toint() + Int64(pool_row) * self.out_cols
                            + group * 32, cute.AddressSpace.gmem, assumed_align=32)
        cute.autovec_copy(codes, cute.make_tensor(dst, cute.make_layout(32)))
        # scale byte (e + 127) of K-group `group` of the L2 input: word group // 4, byte group % 4
        sf_byte = cute.make_ptr(Uint8, out_sf.toint() + (Int64(group // 4) * self.num_pool_rows
                                                         + pool_row) * 4 + group % 4,
                                cute.AddressSpace.gmem, assumed_align=1)
        cute.make_tensor(sf_byte, cute.make_layout(1))[0] = ((exponent + 127) & 0xFF).to(Uint8)

    @cute.jit
    def row_destination(self, out: cute.Pointer, peer_bases: cute.Pointer,
                        src_metadata: cute.Pointer, pool_row: Int32, valid) -> Int64:
        """Address of L2 output row ``pool_row`` (used for valid rows only): in ``out``, or the
        source rank's ``combine[slot, token]`` (design step f)."""
        dst = Int64(0)
        if cutlass.const_expr(self.to_combine):
            if valid:
                meta = cute.make_tensor(src_metadata + pool_row * 4, cute.make_layout(4))
                peers = cute.make_tensor(peer_bases, cute.make_layout(self.num_ranks))
                dst = (peers[meta[0]] + self.combine_offset
                       + Int64(meta[2] * self.combine_tokens + meta[1]) * (self.out_cols * 2))
        else:
            dst = out.toint() + Int64(pool_row) * (self.out_cols * 2)
        return dst

    @cute.jit
    def store_bf16(self, acc: cute.Tensor, row_dst: Int64, col: Int32):
        """32 consecutive columns of one row as BF16 (round to nearest), at ``row_dst``."""
        vals = cute.make_rmem_tensor((32,), BFloat16)
        vals.store(acc.load().to(BFloat16))
        dst = cute.make_ptr(BFloat16, row_dst + col * 2, cute.AddressSpace.gmem,
                            assumed_align=64)
        cute.autovec_copy(vals, cute.make_tensor(dst, cute.make_layout(32)))


def share_ring(l1: Sm100ExpertGemmKernel, l2: Sm100ExpertGemmKernel,
               num_stages: int | None = None) -> None:
    """Configure the two phases of the fused layer kernel (`kernels/sm100_mega_moe.py`) to run
    one after the other through one ring of stages and one pair of TMEM accumulators: the same
    stage count (default: the smaller of the two phases' own), and L2 tiles waiting for the L1
    tiles of their pool block (`tile_signals` arrivals). A stage of either phase has the same
    shape (128 token rows, ``TILE_N / cluster`` weight rows, one k-block, the same scale
    chunks), so one transaction count serves both. Both must have the same recipe and BLOCK_M."""
    if (l1.phase, l2.phase) != ("l1", "l2"):
        raise ValueError("share_ring: expected an L1 and an L2 kernel")
    if (l1.recipe, l1.block_m) != (l2.recipe, l2.block_m):
        raise ValueError(f"share_ring: L1 ({l1.recipe}, BLOCK_M {l1.block_m}) and L2 "
                         f"({l2.recipe}, BLOCK_M {l2.block_m}) differ")
    assert l1.stage_bytes == l2.stage_bytes
    num_stages = num_stages or min(l1.num_stages, l2.num_stages)
    for k in (l1, l2):
        k.num_stages = num_stages
    l1.signals_ready = True
    l2.waits_ready = l1.tile_signals()
