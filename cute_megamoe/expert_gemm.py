"""The expert FFN over the pool on our grouped-GEMM kernels (Hopper: `kernels/sm90_expert_gemm`).

    weights = ExpertWeights.from_bf16(w1, w2, "fp8xfp8")        # once, at load time
    out = expert_ffn(acts, acts_sf, topk_weights, expert_recv_tokens, weights, block_m=128)

`acts` is the L1 pool `[P, H]` in the layout the dispatch fills (expert-major, expert `e` from
pool block `pool_block_offsets(counts, block_m)[e]`, pad rows to a multiple of `block_m`);
`expert_ffn` runs L1 (gate/up GEMM + SwiGLU + routing weight + FP8 requantization into the L2
pool) then L2, and returns BF16 `[P, H]` in pool order, pad rows unwritten. Everything is
checked on the host before the first launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant
from .api import _check_tensor
from .heuristics import get_num_sms
from .runtime import as_ptr, compiled_kernel, current_stream, get_arch

#: Recipes with grouped-GEMM kernels, per arch.
SUPPORTED_RECIPES = {"sm_90a": ("fp8xfp8", "bf16xbf16")}
BLOCK_MS = (64, 128)
SF_N = 8  # weight rows per FP8 weight-scale entry the kernels read


def _compact_weight_sf(rows_sf: torch.Tensor, name: str) -> torch.Tensor:
    """Per-row f32 scales ``[E, N, K/128]`` -> the kernels' ``[E, K/128, N/8]`` (one entry per 8
    rows; raises if the 8 rows of a group disagree, i.e. the scales were not 128x128 blocks)."""
    num_experts, n, kb = rows_sf.shape
    groups = rows_sf.view(num_experts, n // SF_N, SF_N, kb)
    if not bool((groups == groups[:, :, :1]).all()):
        raise ValueError(f"{name}: scales must be equal within every group of {SF_N} rows "
                         f"(per-128x128-block scales)")
    return groups[:, :, 0].transpose(1, 2).contiguous()


@dataclass
class ExpertWeights:
    """One rank's expert weights as the grouped GEMMs read them.

    ``w1`` ``[E_l, 2I, H]`` with gate/up rows interleaved by 8, ``w2`` ``[E_l, H, I]`` (e4m3 or
    bf16, contiguous); for ``fp8xfp8`` ``w1_sf`` ``[E_l, H/128, 2I/8]`` and ``w2_sf``
    ``[E_l, I/128, H/8]`` f32 (the 128x128 block scales, one entry per 8 rows, K-block major).
    """

    recipe: str
    w1: torch.Tensor
    w2: torch.Tensor
    w1_sf: torch.Tensor | None = None
    w2_sf: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2

    @classmethod
    def from_quantized(cls, l1_weights, l2_weights, recipe: str) -> ExpertWeights:
        """From `quant.quantize_weights_for_recipe` outputs (gate | up rows, not interleaved)."""
        if recipe not in ("fp8xfp8", "bf16xbf16"):
            raise ValueError(f"recipe: grouped GEMMs implement fp8xfp8 and bf16xbf16, "
                             f"got {recipe!r}")
        l1, l2 = quant.transform_weights_for_mega_moe(l1_weights, l2_weights, arch="sm90")
        if recipe == "bf16xbf16":
            if not isinstance(l1, torch.Tensor) or l1.dtype != torch.bfloat16:
                raise TypeError("bf16xbf16 weights must be bf16 tensors")
            return cls(recipe, l1.contiguous(), l2.contiguous())
        if not isinstance(l1, tuple) or l1[0].dtype != torch.float8_e4m3fn:
            raise TypeError("fp8xfp8 weights must be (e4m3, f32 scale) pairs")
        return cls(recipe, l1[0].contiguous(), l2[0].contiguous(),
                   _compact_weight_sf(l1[1], "l1_weights[1]"),
                   _compact_weight_sf(l2[1], "l2_weights[1]"))

    @classmethod
    def from_bf16(cls, w1: torch.Tensor, w2: torch.Tensor, recipe: str) -> ExpertWeights:
        """Quantize BF16 master weights ``[E_l, 2I, H]`` / ``[E_l, H, I]`` as the reference does."""
        return cls.from_quantized(quant.quantize_weights_for_recipe(w1, recipe),
                                  quant.quantize_weights_for_recipe(w2, recipe), recipe)


def _check_weights(weights: ExpertWeights, device: torch.device) -> tuple[int, int, int]:
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected ExpertWeights, got {type(weights).__name__}")
    e_l, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    fp8 = weights.recipe == "fp8xfp8"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    _check_tensor("weights.w1", weights.w1, dtype, (e_l, 2 * inter, hidden), device)
    _check_tensor("weights.w2", weights.w2, dtype, (e_l, hidden, inter), device)
    if fp8:
        _check_tensor("weights.w1_sf", weights.w1_sf, torch.float32,
                      (e_l, hidden // 128, 2 * inter // SF_N), device)
        _check_tensor("weights.w2_sf", weights.w2_sf, torch.float32,
                      (e_l, inter // 128, hidden // SF_N), device)
    return e_l, hidden, inter


def _check_mn_major(name: str, t: torch.Tensor, rows: int, cols: int, device) -> None:
    """A ``[rows, cols]`` f32 view of a contiguous ``[cols, rows]`` tensor (strides (1, rows))."""
    _check_tensor(name, t.t(), torch.float32, (cols, rows), device)


def _sf_view(rows: int, cols: int, device) -> torch.Tensor:
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def expert_ffn(acts: torch.Tensor, acts_sf: torch.Tensor | None, topk_weights: torch.Tensor,
               expert_recv_tokens: torch.Tensor, weights: ExpertWeights, *, block_m: int,
               activation_clamp: float | None = None, fast_math: bool = True,
               l2_acts: torch.Tensor | None = None, l2_acts_sf: torch.Tensor | None = None,
               out: torch.Tensor | None = None, num_sms: int | None = None) -> torch.Tensor:
    """L1 + SwiGLU + L2 over the pool on our kernels; returns BF16 ``[P, H]`` (see module doc).

    Args:
        acts: ``[P, H]`` e4m3 (fp8xfp8) or bf16 pool rows, ``P`` a multiple of ``block_m``.
        acts_sf: f32 ``[P, H/128]`` with strides ``(1, P)`` (fp8xfp8), else None.
        topk_weights: f32 ``[P]``, the routing weight of each pool row.
        expert_recv_tokens: int32 ``[E_l]`` rows per expert (on the device).
        weights: `ExpertWeights` of the same recipe as ``acts``.
        l2_acts, l2_acts_sf, out: optional outputs (the L2 pool ``[P, I]``, its f32 scales
            ``[P, I/128]`` strides ``(1, P)``, and ``[P, H]`` bf16); allocated when None.
    """
    from .kernels.sm90_expert_gemm import Sm90ExpertGemmKernel

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
    e_l, hidden, inter = _check_weights(weights, device)
    if block_m not in BLOCK_MS:
        raise ValueError(f"block_m: expected one of {BLOCK_MS}, got {block_m}")
    fp8 = recipe == "fp8xfp8"
    act_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if acts.dim() != 2 or acts.shape[1] != hidden:
        raise ValueError(f"acts: expected shape [P, {hidden}], got {tuple(acts.shape)}")
    pool_rows = acts.shape[0]
    if pool_rows % block_m != 0:
        raise ValueError(f"acts: pool rows ({pool_rows}) must be a multiple of block_m "
                         f"({block_m})")
    _check_tensor("acts", acts, act_dtype, (pool_rows, hidden), device)
    _check_tensor("topk_weights", topk_weights, torch.float32, (pool_rows,), device)
    _check_tensor("expert_recv_tokens", expert_recv_tokens, torch.int32, (e_l,), device)
    if fp8:
        if acts_sf is None:
            raise ValueError("acts_sf: required for fp8xfp8")
        _check_mn_major("acts_sf", acts_sf, pool_rows, hidden // 128, device)
    elif acts_sf is not None:
        raise ValueError("acts_sf: must be None for bf16xbf16")
    if l2_acts is None:
        l2_acts = torch.empty(pool_rows, inter, dtype=act_dtype, device=device)
    _check_tensor("l2_acts", l2_acts, act_dtype, (pool_rows, inter), device)
    if fp8:
        if l2_acts_sf is None:
            l2_acts_sf = _sf_view(pool_rows, inter // 128, device)
        _check_mn_major("l2_acts_sf", l2_acts_sf, pool_rows, inter // 128, device)
    if out is None:
        out = torch.empty(pool_rows, hidden, dtype=torch.bfloat16, device=device)
    _check_tensor("out", out, torch.bfloat16, (pool_rows, hidden), device)
    grid = get_num_sms(device) if num_sms is None else num_sms

    counts = as_ptr(expert_recv_tokens, align=4)
    stream = current_stream()
    dummy = as_ptr(topk_weights)
    for phase in ("l1", "l2"):
        if phase == "l1":
            n, k = 2 * inter, hidden
            args = (as_ptr(acts), as_ptr(acts_sf) if fp8 else dummy, as_ptr(weights.w1),
                    as_ptr(weights.w1_sf) if fp8 else dummy, counts, as_ptr(topk_weights),
                    as_ptr(l2_acts), as_ptr(l2_acts_sf) if fp8 else dummy)
        else:
            n, k = hidden, inter
            args = (as_ptr(l2_acts), as_ptr(l2_acts_sf) if fp8 else dummy, as_ptr(weights.w2),
                    as_ptr(weights.w2_sf) if fp8 else dummy, counts, dummy, as_ptr(out), dummy)
        clamp = activation_clamp if phase == "l1" else None
        args = (*args, _int32(grid), stream)
        key = ("sm90_expert_gemm", phase, recipe, e_l, pool_rows, n, k, block_m, clamp,
               bool(fast_math))

        def build(phase=phase, n=n, k=k, clamp=clamp, args=args):
            import cutlass.cute as cute

            kernel = Sm90ExpertGemmKernel(phase, recipe, e_l, pool_rows, n, k, block_m,
                                          activation_clamp=clamp, fast_math=fast_math)
            return cute.compile(kernel, *args, options=f"--gpu-arch {arch}")

        compiled_kernel(key, build)(*args)
    return out


def _int32(value: int):
    from cutlass import Int32

    return Int32(value)


__all__ = ["BLOCK_MS", "SUPPORTED_RECIPES", "ExpertWeights", "expert_ffn"]
