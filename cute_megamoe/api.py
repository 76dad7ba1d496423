"""Native entry points: the whole layer on our kernels, on inputs staged into the buffer.

    cm.stage_inputs(buf, x, topk_idx, topk_weights)              # quantize x into the buffer
    y = cm.mega_moe(torch.empty_like(x), weights, buf)          # collective; any recipe

``weights`` is an `expert_gemm.ExpertWeights` (our layout, prepared once per arch);
`cute_megamoe.fp8_fp4_mega_moe` / `cute_megamoe.bf16_mega_moe` (in `deepgemm_api`) take
DeepGEMM's weight tuples instead, and `cute_megamoe.MegaMoE` wraps either in a module. Every
check a user can fail raises `ValueError` / `TypeError` naming the argument, on the host,
before anything is launched, and gives the call up on this rank (`SymmBuffer.skip_call`).
"""

from __future__ import annotations

import torch

from .buffer import SymmBuffer
from .checks import check_cuda_buffer, check_layer_output, check_routing, check_sym_buffer
from .config import LayerConfig
from .expert_gemm import ExpertWeights
from .fused import choose as choose_fused
from .fused import fused_mega_moe
from .staged import gives_up_call_on_error, stage_inputs, staged_mega_moe

__all__ = ["check_routing", "fp8_mega_moe", "mega_moe", "stage_inputs"]

_FP8_RECIPES = ("fp8xfp8", "fp8xfp4", "fp8xfp4_sm90")


def mega_moe(y: torch.Tensor, weights: ExpertWeights, sym_buffer: SymmBuffer, *,
             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
             activation_clamp: float | None = None, fast_math: bool = True,
             block_m: int | None = None, num_sms: int | None = None, transfer: str = "push",
             l2_sends: bool = True, fused: bool | None = None,
             config: LayerConfig | None = None) -> torch.Tensor:
    """One MoE layer on every rank of the buffer's group (collective), any recipe.

    The inputs are what `stage_inputs` (or the caller, DeepGEMM style) put into `sym_buffer`
    (``len(y)`` tokens); the result is written to ``y`` (BF16 ``[num_tokens, hidden]``) and
    returned. Staged mode: dispatch, L1 (+ SwiGLU + requant), L2 and combine run as four
    kernels (`staged.staged_mega_moe`). ``weights`` is this rank's `expert_gemm.ExpertWeights`
    of the buffer's recipe, for this GPU's arch (Hopper: fp8xfp8, bf16xbf16, fp8xfp4_sm90;
    Blackwell: fp8xfp4, bf16xbf16, compiled but never run). ``block_m`` defaults to the heuristics'
    choice for the expected tokens per expert on this rank; ranks may differ (each lays out
    its own pool, and the kernels place a destination's rows by the BLOCK_M it published).
    ``transfer`` and ``l2_sends`` must be the same on every rank (`staged`). A check that
    fails raises before any launch and counts the call as given up on this rank
    (`SymmBuffer.skip_call`), so that it cannot pair its next call with the peers' current
    one (the kernels trap naming the call numbers instead). ``fused``: the whole layer as one
    persistent kernel (`fused.fused_mega_moe`; sm_90a, fp8xfp8 / bf16xbf16, push and L2 sends,
    bit-identical to the staged kernels): True raises before any launch where it cannot run,
    False runs the staged kernels, None (default) ``config.fused``, else `fused.choose`: the
    fused kernel for calls of at most `heuristics.FUSED_AUTO_MAX_TOKENS` tokens of one-rank
    groups on sm_90a, else the staged kernels (``CUTE_MEGAMOE_FUSED``). ``config``: the
    kernels' configuration (`config.LayerConfig`; None: the heuristics'); any value gives the
    same outputs.
    """
    return _mega_moe(None, "mega_moe", y, weights, sym_buffer,
                     cumulative_local_expert_recv_stats, activation_clamp, fast_math, block_m,
                     num_sms, transfer, l2_sends, fused, config)


def fp8_mega_moe(y: torch.Tensor, weights: ExpertWeights, sym_buffer: SymmBuffer, *,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 activation_clamp: float | None = None, fast_math: bool = True,
                 block_m: int | None = None, num_sms: int | None = None,
                 transfer: str = "push", l2_sends: bool = True,
                 fused: bool | None = None, config: LayerConfig | None = None) -> torch.Tensor:
    """`mega_moe` for the FP8-activation recipes (``fp8xfp8``, ``fp8xfp4``, ``fp8xfp4_sm90``)
    only."""
    return _mega_moe(_FP8_RECIPES, "fp8_mega_moe", y, weights, sym_buffer,
                     cumulative_local_expert_recv_stats, activation_clamp, fast_math, block_m,
                     num_sms, transfer, l2_sends, fused, config)


def _mega_moe(recipes: tuple[str, ...] | None, name: str, y, weights, sym_buffer,
              cumulative_local_expert_recv_stats, activation_clamp, fast_math, block_m, num_sms,
              transfer, l2_sends, fused=None, config=None) -> torch.Tensor:
    check_sym_buffer(sym_buffer)
    with gives_up_call_on_error(sym_buffer):
        n = _check_layer_call(recipes, name, y, weights, sym_buffer)
        check_cuda_buffer(sym_buffer)  # (before `choose_fused` asks the GPU)
        fused = choose_fused(fused, sym_buffer, weights, transfer, l2_sends, config, n)
    if fused:
        return fused_mega_moe(
            sym_buffer, None, None, None, weights, num_tokens=n, y=y,
            activation_clamp=activation_clamp, fast_math=fast_math, block_m=block_m,
            num_sms=num_sms, cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            config=config)
    # (staged_mega_moe checks the rest inside its own give-up block, before its first launch)
    return staged_mega_moe(
        sym_buffer, None, None, None, weights, num_tokens=n, y=y,
        activation_clamp=activation_clamp, fast_math=fast_math, block_m=block_m,
        num_sms=num_sms, cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
        l2_sends=l2_sends, transfer=transfer, config=config)


def _check_layer_call(recipes: tuple[str, ...] | None, name: str, y, weights,
                      sym_buffer: SymmBuffer) -> int:
    """The host checks of the native layer entry points; returns the token count."""
    if recipes is not None and sym_buffer.recipe not in recipes:
        raise ValueError(f"{name}: the buffer's recipe is {sym_buffer.recipe!r}; "
                         f"{name} takes {recipes}")
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected cute_megamoe.expert_gemm.ExpertWeights, got "
                        f"{type(weights).__name__}")
    return check_layer_output(y, sym_buffer)

