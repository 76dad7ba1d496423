"""The expert FFN over the pool on our grouped-GEMM kernels.

    weights = ExpertWeights.from_bf16(w1, w2, "fp8xfp8")        # once, at load time
    out = expert_ffn(acts, acts_sf, topk_weights, expert_recv_tokens, weights, block_m=128)

`acts` is the L1 pool `[P, H]` in the layout the dispatch fills (expert-major, expert `e` from
pool block `pool_block_offsets(counts, block_m)[e]`, pad rows to a multiple of `block_m`);
`expert_ffn` runs L1 (gate/up GEMM + SwiGLU + routing weight + FP8 requantization into the L2
pool) then L2, and returns BF16 `[P, H]` in pool order, pad rows unwritten. Everything is
checked on the host before the first launch.

Kernels per arch (`SUPPORTED_RECIPES`): Hopper `kernels/sm90_expert_gemm.py` (fp8xfp8,
bf16xbf16; GPU-tested); Blackwell `kernels/sm100_expert_gemm.py` (fp8xfp4, bf16xbf16; compiled
and SASS-checked for sm_100a, never run: no Blackwell GPU was available).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant
from .api import _check_tensor
from .heuristics import get_num_sms, select_cluster_m
from .kernels.common.gemm_config import SF_BLOCK, weight_sf_row_len
from .runtime import as_ptr, compiled_kernel, current_stream, env_flag, get_arch
from .utils import ceil_div

#: Recipes with grouped-GEMM kernels, per arch.
SUPPORTED_RECIPES = {"sm_90a": ("fp8xfp8", "bf16xbf16"), "sm_100a": ("fp8xfp4", "bf16xbf16")}
#: BLOCK_M values the kernels implement, per arch.
BLOCK_MS = {"sm_90a": (64, 128), "sm_100a": (64, 128, 256)}

_ACT_DTYPE = {"fp8xfp8": torch.float8_e4m3fn, "fp8xfp4": torch.float8_e4m3fn,
              "bf16xbf16": torch.bfloat16}
_ACT_SF_DTYPE = {"fp8xfp8": torch.float32, "fp8xfp4": torch.int32}  # per 128 K / 4 x UE8M0


def _block_weight_sf(rows_sf: torch.Tensor, name: str, gate_up: bool) -> torch.Tensor:
    """Per-row f32 scales ``[E, N, K/128]`` (L1: rows gate/up interleaved, as the transform
    returns them) -> the sm90 kernels' 128x128 block scales ``[E, K/128, N/128]`` (L1: row
    blocks of ``[gate | up]``), each row padded to ``weight_sf_row_len(N)`` entries. Raises
    unless the rows of every 128-row block agree."""
    num_experts, n, kb = rows_sf.shape
    if gate_up:
        rows_sf = quant.deinterleave_gate_up(rows_sf)
    blocks = rows_sf.reshape(num_experts, n // SF_BLOCK, SF_BLOCK, kb)
    if not bool((blocks == blocks[:, :, :1]).all()):
        raise ValueError(f"{name}: scales must be equal within every block of {SF_BLOCK} rows "
                         f"(per-{SF_BLOCK}x{SF_BLOCK}-block scales)")
    block_sf = blocks[:, :, 0].transpose(1, 2)  # [E, K/128, N/128]
    return torch.nn.functional.pad(block_sf, (0, weight_sf_row_len(n) - n // SF_BLOCK),
                                   value=1.0).contiguous()


@dataclass
class ExpertWeights:
    """One rank's expert weights as the grouped GEMMs of ``arch`` read them.

    ``w1`` ``[E_l, 2I, H]`` with gate/up rows interleaved by 8 and ``w2`` ``[E_l, H, I]``:

    * ``fp8xfp8`` (sm_90a): e4m3, with ``w1_sf`` ``[E_l, H/128, 2I/128]`` and ``w2_sf``
      ``[E_l, I/128, H/128]`` f32: the 128x128 block scales, K-block major (``w1_sf`` row blocks
      in ``[gate | up]`` order, i.e. before the interleave), the last dim padded up to a multiple
      of 4 (16-byte rows; the pad is never read);
    * ``bf16xbf16`` (sm_90a, sm_100a): bf16, no scales;
    * ``fp8xfp4`` (sm_100a): e2m1 packed two per byte (int8, last dim halved), with ``w1_sf``
      ``[E_l, H/128, 2I]`` and ``w2_sf`` ``[E_l, I/128, H]`` int32 (UE8M0 per 32, packed four per
      word, UTCCP row order, MN-major: ``quant.weight_sf_for_sm100``).
    """

    recipe: str
    w1: torch.Tensor
    w2: torch.Tensor
    w1_sf: torch.Tensor | None = None
    w2_sf: torch.Tensor | None = None
    arch: str = "sm_90a"

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2] * (2 if self.recipe == "fp8xfp4" else 1)

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2

    @classmethod
    def from_quantized(cls, l1_weights, l2_weights, recipe: str,
                       arch: str = "sm_90a") -> ExpertWeights:
        """From `quant.quantize_weights_for_recipe` outputs (gate | up rows, not interleaved)."""
        if arch not in SUPPORTED_RECIPES or recipe not in SUPPORTED_RECIPES[arch]:
            raise ValueError(f"recipe {recipe!r} has no grouped-GEMM kernels on {arch!r} "
                             f"(supported: {SUPPORTED_RECIPES})")
        l1, l2 = quant.transform_weights_for_mega_moe(l1_weights, l2_weights, arch=arch)
        if recipe == "bf16xbf16":
            if not isinstance(l1, torch.Tensor) or l1.dtype != torch.bfloat16:
                raise TypeError("bf16xbf16 weights must be bf16 tensors")
            return cls(recipe, l1.contiguous(), l2.contiguous(), arch=arch)
        want = torch.float8_e4m3fn if recipe == "fp8xfp8" else torch.int8
        if not isinstance(l1, tuple) or l1[0].dtype != want:
            raise TypeError(f"{recipe} weights must be ({want}, scale) pairs")
        if recipe == "fp8xfp8":
            sf1 = _block_weight_sf(l1[1], "l1_weights[1]", gate_up=True)
            sf2 = _block_weight_sf(l2[1], "l2_weights[1]", gate_up=False)
        else:
            sf1, sf2 = quant.weight_sf_for_sm100(l1[1]), quant.weight_sf_for_sm100(l2[1])
        return cls(recipe, l1[0].contiguous(), l2[0].contiguous(), sf1, sf2, arch=arch)

    @classmethod
    def from_bf16(cls, w1: torch.Tensor, w2: torch.Tensor, recipe: str,
                  arch: str = "sm_90a") -> ExpertWeights:
        """Quantize BF16 master weights ``[E_l, 2I, H]`` / ``[E_l, H, I]`` as the reference does."""
        return cls.from_quantized(quant.quantize_weights_for_recipe(w1, recipe),
                                  quant.quantize_weights_for_recipe(w2, recipe), recipe, arch)


def gemm_kernel(arch: str, recipe: str, phase: str, num_experts: int, num_pool_rows: int,
                n: int, k: int, block_m: int, activation_clamp: float | None = None,
                fast_math: bool = True, combine_layout=None):
    """The grouped-GEMM kernel object of ``arch`` for one phase, and the CuTe dtypes of its ten
    pointer arguments ``(a, a_sf, b, b_sf, expert_recv_tokens, topk_weights, out, out_sf,
    peer_bases, src_metadata)`` (what `expert_ffn` passes; the compile tests use the same plan).
    ``combine_layout``: L2 sends its rows to the source ranks' combine buffers of a symmetric
    buffer with this `MegaMoELayout`."""
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

    clamp = activation_clamp if phase == "l1" else None
    if arch == "sm_90a":
        from .kernels.sm90_expert_gemm import Sm90ExpertGemmKernel as Kernel

        ab = Float8E4M3FN if recipe == "fp8xfp8" else BFloat16
        dtypes = (ab, Float32, ab, Float32, Int32, Float32, ab if phase == "l1" else BFloat16,
                  Float32, Int64, Int32)
    elif arch == "sm_100a":
        from .kernels.sm100_expert_gemm import Sm100ExpertGemmKernel as Kernel

        if recipe == "bf16xbf16":  # no scales: a_sf, b_sf, out_sf point at topk_weights
            dtypes = (BFloat16, Float32, BFloat16, Float32, Int32, Float32, BFloat16, Float32,
                      Int64, Int32)
        else:
            dtypes = (Float8E4M3FN, Float8E8M0FNU, Float4E2M1FN, Float8E8M0FNU, Int32, Float32,
                      Float8E4M3FN if phase == "l1" else BFloat16, Uint8, Int64, Int32)
    else:
        raise ValueError(f"arch: no grouped-GEMM kernels for {arch!r}")
    extra = {"combine_layout": combine_layout}
    if arch == "sm_90a":
        extra["cluster_m"] = select_cluster_m(arch, phase, block_m, n)
    kernel = Kernel(phase, recipe, num_experts, num_pool_rows, n, k, block_m,
                    activation_clamp=clamp, fast_math=fast_math, **extra)
    return kernel, dtypes


def _check_weights(weights: ExpertWeights, device: torch.device) -> tuple[int, int, int]:
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected ExpertWeights, got {type(weights).__name__}")
    e_l, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    recipe = weights.recipe
    if recipe == "fp8xfp4":
        _check_tensor("weights.w1", weights.w1, torch.int8, (e_l, 2 * inter, hidden // 2), device)
        _check_tensor("weights.w2", weights.w2, torch.int8, (e_l, hidden, inter // 2), device)
        _check_tensor("weights.w1_sf", weights.w1_sf, torch.int32,
                      (e_l, hidden // 128, 2 * inter), device)
        _check_tensor("weights.w2_sf", weights.w2_sf, torch.int32, (e_l, inter // 128, hidden),
                      device)
        return e_l, hidden, inter
    dtype = _ACT_DTYPE[recipe]
    _check_tensor("weights.w1", weights.w1, dtype, (e_l, 2 * inter, hidden), device)
    _check_tensor("weights.w2", weights.w2, dtype, (e_l, hidden, inter), device)
    if recipe == "fp8xfp8":
        _check_tensor("weights.w1_sf", weights.w1_sf, torch.float32,
                      (e_l, hidden // SF_BLOCK, weight_sf_row_len(2 * inter)), device)
        _check_tensor("weights.w2_sf", weights.w2_sf, torch.float32,
                      (e_l, inter // SF_BLOCK, weight_sf_row_len(hidden)), device)
    return e_l, hidden, inter


def check_pool_capacity(expert_recv_tokens: torch.Tensor, block_m: int, pool_rows: int) -> None:
    """Raise unless every count is >= 0 and the experts' padded blocks fit in the pool
    (``sum(ceil(count / block_m)) * block_m <= pool_rows``); the kernels would write past the
    pool otherwise. Reads the counts back to the host (synchronizes)."""
    counts = [int(c) for c in expert_recv_tokens.tolist()]
    if any(c < 0 for c in counts):
        raise ValueError(f"expert_recv_tokens: counts must be >= 0, got {counts}")
    need = sum(ceil_div(c, block_m) for c in counts) * block_m
    if need > pool_rows:
        raise ValueError(f"expert_recv_tokens: the experts need {need} pool rows in blocks of "
                         f"{block_m}, the pool has {pool_rows}")


def _check_mn_major(name: str, t: torch.Tensor, dtype: torch.dtype, rows: int, cols: int,
                    device) -> None:
    """A ``[rows, cols]`` view of a contiguous ``[cols, rows]`` tensor (strides (1, rows))."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _check_tensor(name, t.t(), dtype, (cols, rows), device)


def _sf_view(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(cols, rows, dtype=dtype, device=device).t()


def expert_ffn(acts: torch.Tensor, acts_sf: torch.Tensor | None, topk_weights: torch.Tensor,
               expert_recv_tokens: torch.Tensor, weights: ExpertWeights, *, block_m: int,
               activation_clamp: float | None = None, fast_math: bool = True,
               l2_acts: torch.Tensor | None = None, l2_acts_sf: torch.Tensor | None = None,
               out: torch.Tensor | None = None, num_sms: int | None = None,
               validate_counts: bool | None = None,
               combine_buffer=None) -> torch.Tensor | None:
    """L1 + SwiGLU + L2 over the pool on our kernels; returns BF16 ``[P, H]`` (see module doc),
    or None with ``combine_buffer``.

    Args:
        acts: ``[P, H]`` e4m3 (fp8 recipes) or bf16 pool rows, ``P`` a multiple of ``block_m``.
        acts_sf: the activation scales, ``[P, H/128]`` with strides ``(1, P)``: f32
            (fp8xfp8) or int32 with four UE8M0 bytes (fp8xfp4); None for bf16xbf16.
        topk_weights: f32 ``[P]``, the routing weight of each pool row.
        expert_recv_tokens: int32 ``[E_l]`` rows per expert (on the device).
        weights: `ExpertWeights` of the same recipe as ``acts``, prepared for this GPU's arch.
        l2_acts, l2_acts_sf, out: optional outputs (the L2 pool ``[P, I]``, its scales
            ``[P, I/128]`` strides ``(1, P)``, and ``[P, H]`` bf16); allocated when None.
        validate_counts: check that the counts fit the pool (`check_pool_capacity`; a host
            synchronization, so not inside CUDA-graph capture). Default: the
            ``CUTE_MEGAMOE_CHECK_ROUTING`` switch (on). The staged layer skips it: the dispatch
            sizes the pool for the worst case.
        combine_buffer: the `SymmBuffer` whose pool this is: L2 writes each row
            straight into its source rank's ``combine[slot, token]`` over NVLink, as the
            buffer's ``token_src_metadata`` (filled by the dispatch) says; ``out`` is not used.
            Collective in effect: the source ranks' combine reads these rows after its
            cross-rank barrier (`staged.combine` with ``expert_out=None``).
    """
    if not isinstance(acts, torch.Tensor):
        raise TypeError(f"acts: expected a torch.Tensor, got {type(acts).__name__}")
    device = acts.device
    if device.type != "cuda":
        raise ValueError(f"acts: expected a CUDA tensor, got device {device}")
    arch = get_arch(device)
    recipe = weights.recipe if isinstance(weights, ExpertWeights) else None
    if arch not in SUPPORTED_RECIPES or recipe not in SUPPORTED_RECIPES[arch]:
        raise ValueError(f"expert_ffn: no grouped-GEMM kernels for recipe {recipe!r} on {arch} "
                         f"(supported: {SUPPORTED_RECIPES})")
    if weights.arch != arch:
        raise ValueError(f"weights: prepared for {weights.arch}, this GPU is {arch}")
    e_l, hidden, inter = _check_weights(weights, device)
    if block_m not in BLOCK_MS[arch]:
        raise ValueError(f"block_m: expected one of {BLOCK_MS[arch]} on {arch}, got {block_m}")
    act_dtype, sf_dtype = _ACT_DTYPE[recipe], _ACT_SF_DTYPE.get(recipe)
    if acts.dim() != 2 or acts.shape[1] != hidden:
        raise ValueError(f"acts: expected shape [P, {hidden}], got {tuple(acts.shape)}")
    pool_rows = acts.shape[0]
    if pool_rows % block_m != 0:
        raise ValueError(f"acts: pool rows ({pool_rows}) must be a multiple of block_m "
                         f"({block_m})")
    _check_tensor("acts", acts, act_dtype, (pool_rows, hidden), device)
    _check_tensor("topk_weights", topk_weights, torch.float32, (pool_rows,), device)
    _check_tensor("expert_recv_tokens", expert_recv_tokens, torch.int32, (e_l,), device)
    if validate_counts is None:
        validate_counts = env_flag("CUTE_MEGAMOE_CHECK_ROUTING", default=True)
    if validate_counts:
        check_pool_capacity(expert_recv_tokens, block_m, pool_rows)
    if sf_dtype is not None:
        if acts_sf is None:
            raise ValueError(f"acts_sf: required for {recipe}")
        _check_mn_major("acts_sf", acts_sf, sf_dtype, pool_rows, hidden // 128, device)
    elif acts_sf is not None:
        raise ValueError("acts_sf: must be None for bf16xbf16")
    if l2_acts is None:
        l2_acts = torch.empty(pool_rows, inter, dtype=act_dtype, device=device)
    _check_tensor("l2_acts", l2_acts, act_dtype, (pool_rows, inter), device)
    if sf_dtype is not None:
        if l2_acts_sf is None:
            l2_acts_sf = _sf_view(pool_rows, inter // 128, sf_dtype, device)
        _check_mn_major("l2_acts_sf", l2_acts_sf, sf_dtype, pool_rows, inter // 128, device)
    combine_layout = None
    if combine_buffer is not None:
        combine_layout = combine_buffer.layout
        if out is not None:
            raise ValueError("out: must be None with combine_buffer (rows go to the combine "
                             "buffers)")
        if combine_buffer.device != device or combine_layout.num_pool_rows != pool_rows \
                or combine_layout.hidden != hidden or combine_layout.recipe != recipe:
            raise ValueError("combine_buffer: must be the symmetric buffer of this pool (same "
                             "device, pool rows, hidden size and recipe)")
    else:
        if out is None:
            out = torch.empty(pool_rows, hidden, dtype=torch.bfloat16, device=device)
        _check_tensor("out", out, torch.bfloat16, (pool_rows, hidden), device)
    if arch == "sm_100a":
        # the sm100 epilogue stores 32- / 64-byte row chunks (`out` is None with a
        # combine_buffer, whose rows are 128-byte aligned)
        for name, t in (("l2_acts", l2_acts), ("out", out)):
            if t is not None and t.data_ptr() % 64 != 0:
                raise ValueError(f"{name}: data pointer must be 64-byte aligned on {arch}")
    grid = get_num_sms(device) if num_sms is None else num_sms
    if block_m == 256:
        grid -= grid % 2  # 2-CTA clusters

    from cutlass import Int32

    stream = current_stream()
    for phase in ("l1", "l2"):
        if phase == "l1":
            n, k = 2 * inter, hidden
            tensors = (acts, acts_sf, weights.w1, weights.w1_sf, expert_recv_tokens,
                       topk_weights, l2_acts, l2_acts_sf)
        else:
            n, k = hidden, inter
            tensors = (l2_acts, l2_acts_sf, weights.w2, weights.w2_sf, expert_recv_tokens,
                       None, out, None)
        to_combine = phase == "l2" and combine_layout is not None
        tensors += ((combine_buffer.peer_bases, combine_buffer.token_src_metadata)
                    if to_combine else (None, None))
        key = ("expert_gemm", arch, phase, recipe, e_l, pool_rows, n, k, block_m,
               activation_clamp if phase == "l1" else None, bool(fast_math),
               combine_layout if to_combine else None)
        plan = {}

        def build(phase=phase, n=n, k=k, plan=plan, to_combine=to_combine):
            plan["kernel"], plan["dtypes"] = gemm_kernel(
                arch, recipe, phase, e_l, pool_rows, n, k, block_m, activation_clamp, fast_math,
                combine_layout=combine_layout if to_combine else None)
            return plan

        entry = compiled_kernel(key + ("plan",), build)
        # an unused pointer argument points at topk_weights (never dereferenced); a cluster
        # launch needs a whole number of clusters
        cluster_m = getattr(entry["kernel"], "cluster_m", 1)
        args = (*(as_ptr(topk_weights if t is None else t, align=4 if i == 4 else 16, dtype=d)
                  for i, (t, d) in enumerate(zip(tensors, entry["dtypes"], strict=True))),
                Int32(max(cluster_m, grid - grid % cluster_m)), stream)

        def compile_it(entry=entry, args=args):
            import cutlass.cute as cute

            return cute.compile(entry["kernel"], *args, options=f"--gpu-arch {arch}")

        compiled_kernel(key, compile_it)(*args)
    return out  # None with combine_buffer


__all__ = ["BLOCK_MS", "SUPPORTED_RECIPES", "ExpertWeights", "check_pool_capacity", "expert_ffn",
           "gemm_kernel"]
