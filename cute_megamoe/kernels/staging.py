"""Input staging: quantize BF16 activations straight into the symmetric buffer.

What it computes (one launch per call, arch-neutral: compiled for sm_90a and sm_100a)::

    fp8xfp4:   x_q[t, :], x_sf[t, :] = per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32,
                                                              use_packed_ue8m0=True)
    fp8xfp8:   x_q[t, :], x_sf[t, :] = per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=128)
               (also fp8xfp4_sm90, whose activations are fp8xfp8's)
    bf16xbf16: x_q[t, :] = x[t, :]
    and in every recipe: topk_idx, topk_weights copied next to the activations,

bit-exact with `cute_megamoe.quant` (which is bit-exact with DeepGEMM's `deep_gemm/utils/math.py`).
Other implementations do this on the host with several PyTorch ops per call; here it is one
memory-bound pass that reads the BF16 rows once and writes FP8 rows and scales once.

How:
1. The activations are treated as one flat array (rows are contiguous and `hidden % 128 == 0`,
   so a 128-element chunk never crosses a row and the chunk index is also the scale index).
   Each thread owns 16 consecutive elements (two 16-byte loads); 8 consecutive lanes own one
   128-element chunk, so a warp's loads cover 1 KiB of contiguous memory.
2. Per-32 group amax is a butterfly over lane pairs, per-128 over 8 lanes. The scale is
   `ceil_to_ue8m0(max(amax, 1e-4) / 448)` (a true float32 division, as the reference) and the
   inverse scale is exact because the scale is a power of two; `cvt.rn.satfinite.e4m3x2.f32`
   rounds like PyTorch's cast for every value in range (the scale keeps |x / s| <= 448).
3. For the packed per-32 scales each lane shifts its group's UE8M0 byte into place and the
   8 lanes of a chunk OR-reduce them; lane 0 of the chunk stores the int32 word.
4. Each thread handles `vectors_per_thread` vectors per CTA with all loads issued before any
   arithmetic, so enough bytes are in flight to approach the copy bandwidth.
5. The routing (`topk_idx` int64, `topk_weights` f32) is copied by a grid-stride loop in the
   same launch.

Constraints:
* `hidden % 128 == 0`; `num_tokens * hidden < 2**31`; all pointers 16-byte aligned;
  rows contiguous (`x` is `[num_tokens, hidden]` row-major). The caller (`api.py`) checks these.
* `num_tokens == 0` is not launched (nothing to do).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64

from ..tables import RECIPES, activation_recipe
from .common.quant_math import ceil_ue8m0_biased_exponent, float_from_biased_exponent

ELEMENTS_PER_THREAD = 16  # two 16-byte loads of BF16
VECTOR_ALIGN = 16  # bytes: rows are 16-byte aligned (`checks`), a vector at least that
CHUNK = 128  # elements per scale word (packed per-32) or per scale (per-128)
LANES_PER_CHUNK = CHUNK // ELEMENTS_PER_THREAD
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def _set(t, index, value) -> None:
    """``t[index] = value`` as a call (a tensor or `_MNMajorScales`: the DSL carries assigned
    names through a dynamic ``if``, which it cannot do for a Python object)."""
    t[index] = value


class _RowVectors:
    """``[None, v]``: the 16 elements of vector ``v % per_row`` of row ``rows[v // per_row]``
    (``rows``: shared memory) of a row-major array of ``row_bytes`` rows at global ``base``;
    ``stage_vectors`` indexes it as the flat arrays of the staging kernel."""

    def __init__(self, base: Int64, rows: cute.Tensor, per_row: int, row_bytes: int, dtype):
        self.base, self.rows, self.per_row = base, rows, per_row
        self.row_bytes, self.dtype = row_bytes, dtype

    def __getitem__(self, index):
        _, vec = index
        address = (self.base + Int64(self.rows[vec // self.per_row]) * self.row_bytes
                   + Int64(vec % self.per_row) * (ELEMENTS_PER_THREAD * self.dtype.width // 8))
        return cute.make_tensor(cute.make_ptr(self.dtype, address, cute.AddressSpace.gmem,
                                              assumed_align=VECTOR_ALIGN),
                                cute.make_layout(ELEMENTS_PER_THREAD))


class _MNMajorScales:
    """``[c] = value``: the scale of 128-element chunk ``c % per_row`` of row
    ``rows[c // per_row]`` into MN-major float32 scales at global ``base`` (chunk j of row r at
    ``j * stride + r``, the pool's `l1_acts_sf`)."""

    def __init__(self, base: Int64, rows: cute.Tensor, per_row: int, stride: int):
        self.base, self.rows, self.per_row, self.stride = base, rows, per_row, stride

    def __setitem__(self, chunk, value):
        word = Int64(chunk % self.per_row) * self.stride + Int64(self.rows[chunk // self.per_row])
        cute.arch.store(cute.make_ptr(Float32, self.base + word * 4, cute.AddressSpace.gmem,
                                      assumed_align=4), Float32(value))


class InputStagingKernel:
    """Quantize (or copy) `x` into the buffer's `x`/`x_sf` and copy the routing."""

    def __init__(self, recipe: str, hidden: int, num_topk: int, num_threads: int = 256,
                 vectors_per_thread: int = 4):
        if recipe not in RECIPES:
            raise ValueError(f"recipe: unsupported {recipe!r}")
        if hidden % CHUNK != 0:
            raise ValueError(f"hidden: must be a multiple of {CHUNK}, got {hidden}")
        self.recipe = recipe
        self.hidden = hidden
        self.num_topk = num_topk
        self.num_threads = num_threads
        self.vectors_per_thread = vectors_per_thread
        act_recipe = activation_recipe(recipe)
        self.quantize = act_recipe != "bf16xbf16"
        self.packed_ue8m0 = act_recipe == "fp8xfp4"
        self.out_dtype = Float8E4M3FN if self.quantize else BFloat16
        # per-32 groups span 2 lanes, per-128 groups span 8
        self.group_shuffles = 1 if self.packed_ue8m0 else 3
        self.vectors_per_cta = num_threads * vectors_per_thread

    def grid_size(self, num_tokens: int) -> int:
        num_vectors = num_tokens * self.hidden // ELEMENTS_PER_THREAD
        return max(1, -(-num_vectors // self.vectors_per_cta))

    def vector_tensors(self, x: cute.Pointer, out_x: cute.Pointer, out_sf: cute.Pointer,
                       num_vectors: Int32) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor]:
        """The flat activations as ``[16, vectors]`` views (input, output) and the chunks'
        scales (traced inside a jit function)."""
        vec_layout = cute.make_layout((ELEMENTS_PER_THREAD, num_vectors),
                                      stride=(1, ELEMENTS_PER_THREAD))
        return (cute.make_tensor(x, vec_layout), cute.make_tensor(out_x, vec_layout),
                cute.make_tensor(out_sf, cute.make_layout(num_vectors // LANES_PER_CHUNK)))

    @cute.jit
    def __call__(
        self,
        x: cute.Pointer,
        topk_idx: cute.Pointer,
        topk_weights: cute.Pointer,
        out_x: cute.Pointer,
        out_sf: cute.Pointer,
        out_topk_idx: cute.Pointer,
        out_topk_weights: cute.Pointer,
        num_tokens: Int32,
        stream,
    ):
        num_vectors = num_tokens * (self.hidden // ELEMENTS_PER_THREAD)
        num_routes = num_tokens * self.num_topk
        g_x, g_out, g_sf = self.vector_tensors(x, out_x, out_sf, num_vectors)
        route_layout = cute.make_layout(num_routes)
        g_idx = cute.make_tensor(topk_idx, route_layout)
        g_w = cute.make_tensor(topk_weights, route_layout)
        g_out_idx = cute.make_tensor(out_topk_idx, route_layout)
        g_out_w = cute.make_tensor(out_topk_weights, route_layout)
        num_ctas = (num_vectors + self.vectors_per_cta - 1) // self.vectors_per_cta
        self.kernel(g_x, g_out, g_sf, g_idx, g_w, g_out_idx, g_out_w, num_vectors,
                    num_routes).launch(
            grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        g_x: cute.Tensor,
        g_out: cute.Tensor,
        g_sf: cute.Tensor,
        g_idx: cute.Tensor,
        g_w: cute.Tensor,
        g_out_idx: cute.Tensor,
        g_out_w: cute.Tensor,
        num_vectors: Int32,
        num_routes: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        self.stage_vectors(g_x, g_out, g_sf, bidx * self.vectors_per_cta, num_vectors, tidx,
                           cute.arch.lane_idx())

        # 3. routing copy (small: num_tokens * num_topk elements)
        i = bidx * self.num_threads + tidx
        while i < num_routes:
            g_out_idx[i] = Int64(g_idx[i])
            g_out_w[i] = Float32(g_w[i])
            i += nctas * self.num_threads

    @cute.jit
    def stage_rows(self, x: Int64, tokens: cute.Tensor, out: Int64, rows: cute.Tensor,
                   out_sf: Int64, sf_stride: cutlass.Constexpr, num_rows: Int32, tidx: Int32,
                   lane: Int32):
        """Rows ``x[tokens[j]]`` (BF16, global ``x``) quantized as `stage_vectors` into rows
        ``rows[j]`` of ``out`` and their per-128 scales into the MN-major ``out_sf`` (row r's
        chunk c at ``c * sf_stride + r``), for ``j < num_rows`` (``tokens``, ``rows``: shared
        memory), by every thread of the CTA: the fused kernel's one-rank dispatch writes its
        pairs' rows straight into the pool this way. Per-128 scales (fp8xfp8 activations) or
        none (bf16xbf16)."""
        per_row = self.hidden // ELEMENTS_PER_THREAD
        elt = self.out_dtype.width // 8
        g_x = _RowVectors(x, tokens, per_row, self.hidden * 2, BFloat16)
        g_out = _RowVectors(out, rows, per_row, self.hidden * elt, self.out_dtype)
        g_sf = _MNMajorScales(out_sf, rows, self.hidden // CHUNK, sf_stride)
        num_vectors = num_rows * per_row
        first = Int32(0)
        while first < num_vectors:
            self.stage_vectors(g_x, g_out, g_sf, first, num_vectors, tidx, lane)
            first += self.vectors_per_cta

    @cute.jit
    def stage_vectors(self, g_x: cute.Tensor, g_out: cute.Tensor, g_sf: cute.Tensor,
                      first: Int32, num_vectors: Int32, tidx: Int32, lane: Int32):
        """Steps 1-2 for the vectors ``first + u * num_threads + tidx`` (``u`` <
        `vectors_per_thread`) of the flat activations (`vectors_per_cta` from ``first``): every
        load issued first, then each vector quantized (or copied) and stored with its chunk's
        scale. Every thread of the CTA calls it (the amax shuffles take whole warps; vectors
        past ``num_vectors`` load the last one again and store nothing). The fused layer
        kernel calls it too (`sm90_mega_moe`'s in-kernel staging)."""
        # 1. issue every load first (indices clamped so all lanes take part in the shuffles)
        regs = []
        vec_ids = []
        for u in cutlass.range_constexpr(self.vectors_per_thread):
            vec = first + u * self.num_threads + tidx
            r = cute.make_rmem_tensor((ELEMENTS_PER_THREAD,), BFloat16)
            cute.autovec_copy(g_x[None, cutlass.min(vec, num_vectors - 1)], r)
            regs.append(r)
            vec_ids.append(vec)

        # 2. quantize and store
        for u in cutlass.range_constexpr(self.vectors_per_thread):
            vec = vec_ids[u]
            out = cute.make_rmem_tensor((ELEMENTS_PER_THREAD,), self.out_dtype)
            if cutlass.const_expr(self.quantize):
                values = regs[u].load().to(Float32)
                amax = abs(values).reduce(cute.ReductionOp.MAX, Float32(0.0), 0)
                for k in cutlass.range_constexpr(self.group_shuffles):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1 << k))
                amax = cute.arch.fmax(amax, Float32(AMAX_FLOOR))
                exponent = ceil_ue8m0_biased_exponent(amax / Float32(FP8_MAX))
                # 2^(127 - e) = 1 / 2^(e - 127) exactly: e is in [1, 254] and never near 254
                inv_scale = float_from_biased_exponent(254 - exponent)
                out.store((values * inv_scale).to(Float8E4M3FN))
                if cutlass.const_expr(self.packed_ue8m0):
                    group = (lane % LANES_PER_CHUNK) // 2
                    word = exponent << (group * 8)
                    word = word | cute.arch.shuffle_sync_bfly(word, 2)
                    word = word | cute.arch.shuffle_sync_bfly(word, 4)
                    if lane % LANES_PER_CHUNK == 0 and vec < num_vectors:
                        _set(g_sf, vec // LANES_PER_CHUNK, word)
                else:
                    if lane % LANES_PER_CHUNK == 0 and vec < num_vectors:
                        _set(g_sf, vec // LANES_PER_CHUNK, float_from_biased_exponent(exponent))
            else:
                out.store(regs[u].load())
            if vec < num_vectors:
                cute.autovec_copy(out, g_out[None, vec])
