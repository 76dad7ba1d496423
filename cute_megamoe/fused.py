"""The fused layer: one persistent kernel per rank for dispatch, both grouped GEMMs and combine.

    y = fused.fused_mega_moe(buf, x, topk_idx, topk_weights, weights)   # collective

Two launches per call: the input staging (`kernels/staging.py`, skipped with ``x=None`` when
the caller filled the buffer, as DeepGEMM's users do) and `kernels/sm90_mega_moe.py`.
Bit-identical to `staged.staged_mega_moe(..., l2_sends=True)` on the same inputs (the tests
compare them). sm_90a, `fp8xfp8` and `bf16xbf16`, the push transfer; `supports` says whether a
buffer and weights can run it (the layer entry points fall back to the staged kernels where
not).
"""

from __future__ import annotations

import weakref

import torch

from .buffer import SymmBuffer
from .checks import (
    check_activation_clamp,
    check_cuda_buffer,
    check_fast_math,
    check_sym_buffer,
    check_tensor,
    check_token_count,
)
from .expert_gemm import ExpertWeights
from .heuristics import block_m_for_call
from .launch import KernelCall, buffer_state
from .runtime import as_ptr, compiled_kernel, current_stream
from .staged import _prepare_staging, gives_up_call_on_error

__all__ = ["FUSED_BLOCK_MS", "FUSED_RECIPES", "fused_call", "fused_mega_moe", "supports"]

FUSED_RECIPES = ("fp8xfp8", "bf16xbf16")
FUSED_BLOCK_MS = (64, 128)
_TILE_N = 256  # hidden and 2 * intermediate: whole 256-column tiles (one ring for both GEMMs)

# per buffer: the readiness counters of the pool blocks (int32, one per 64-row block)
_READY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def supports(sym_buffer: SymmBuffer, weights: object) -> str | None:
    """None when the fused kernel can run this buffer and these weights on the current GPU,
    else why not (for the entry points' fallback and their errors)."""
    layout = sym_buffer.layout
    if not isinstance(weights, ExpertWeights):
        return "the fused kernel runs our grouped-GEMM weights (ExpertWeights)"
    if buffer_state(sym_buffer).arch != "sm_90a":
        return f"the fused kernel is sm_90a only (this GPU: {buffer_state(sym_buffer).arch})"
    if layout.recipe not in FUSED_RECIPES:
        return f"the sm_90a fused kernel runs {FUSED_RECIPES}, not {layout.recipe!r}"
    if layout.hidden % _TILE_N or (2 * layout.intermediate_hidden) % _TILE_N:
        return (f"the fused kernel needs hidden ({layout.hidden}) and 2 * intermediate "
                f"({2 * layout.intermediate_hidden}) to be multiples of {_TILE_N}")
    return None


def _ready_counters(sym_buffer: SymmBuffer) -> torch.Tensor:
    ready = _READY.get(sym_buffer)
    if ready is None:
        ready = _READY[sym_buffer] = torch.zeros(
            sym_buffer.layout.num_pool_rows // min(FUSED_BLOCK_MS), dtype=torch.int32,
            device=sym_buffer.device)
    return ready


def fused_call(sym_buffer: SymmBuffer, weights: ExpertWeights, num_tokens: int, block_m: int,
               y: torch.Tensor | None, num_ctas: int, stats: torch.Tensor | None,
               activation_clamp: float | None, fast_math: bool) -> KernelCall:
    """`kernels/sm90_mega_moe.py` for ``num_tokens`` staged rows into ``y`` (collective)."""
    import cutlass.cute as cute
    from cutlass import Int32

    from .kernels.sm90_mega_moe import Sm90MegaMoEKernel

    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    has_stats = stats is not None
    key = ("mega_moe", state.arch, layout, block_m, activation_clamp, bool(fast_math),
           has_stats)
    plan = compiled_kernel(key + ("plan",), lambda: {"kernel": Sm90MegaMoEKernel(
        layout, block_m, activation_clamp=activation_clamp, fast_math=fast_math,
        has_stats=has_stats)})
    kernel = plan["kernel"]
    fp8 = layout.has_sf
    spare = sym_buffer.l1_topk_weights  # stands for an unused pointer (never dereferenced)
    tensors = {
        "peer_bases": sym_buffer.peer_bases, "expert_recv_tokens": state.recv_tokens,
        "stats": stats if has_stats else state.recv_tokens, "l1_acts": sym_buffer.l1_acts,
        "l1_acts_sf": sym_buffer.l1_acts_sf if fp8 else spare,
        "l1_topk_weights": sym_buffer.l1_topk_weights, "l2_acts": sym_buffer.l2_acts,
        "l2_acts_sf": sym_buffer.l2_acts_sf if fp8 else spare,
        "token_src_metadata": sym_buffer.token_src_metadata, "w1": weights.w1,
        "w1_sf": weights.w1_sf if fp8 else spare, "w2": weights.w2,
        "w2_sf": weights.w2_sf if fp8 else spare, "pool_block_ready": _ready_counters(sym_buffer),
        "y": y if num_tokens > 0 else spare,
    }
    ptrs = [as_ptr(tensors[name], align=16 if dtype.width != 32 or name in (
                "l1_acts_sf", "l1_topk_weights", "l2_acts_sf", "w1_sf", "w2_sf",
                "token_src_metadata") else 4, dtype=dtype)
            for name, dtype in kernel.pointer_args()]
    args = (ptrs[0], Int32(sym_buffer.rank), Int32(num_tokens), *ptrs[1:], Int32(num_ctas),
            current_stream())
    fn = compiled_kernel(key, lambda: cute.compile(kernel, *args,
                                                   options=f"--gpu-arch {state.arch}"))
    return KernelCall(fn, args)


def fused_mega_moe(sym_buffer: SymmBuffer, x: torch.Tensor | None,
                   topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                   weights: ExpertWeights, *, num_tokens: int | None = None,
                   y: torch.Tensor | None = None, activation_clamp: float | None = None,
                   fast_math: bool = True, block_m: int | None = None,
                   num_sms: int | None = None,
                   cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                   validate_routing: bool | None = None) -> torch.Tensor:
    """One whole layer in one persistent kernel (after the input staging). Collective: every
    rank of the buffer's group calls it once per call, also with 0 tokens. Arguments as
    `staged.staged_mega_moe` (``x=None``: ``num_tokens`` rows were staged into the buffer
    already); ``block_m`` 64 or 128 (default: the heuristics; ranks may differ). Every check
    runs before the first launch; one that fails gives the call up on this rank
    (`staged.gives_up_call_on_error`). No host synchronization with
    ``validate_routing=False``: CUDA-graph capturable."""
    check_sym_buffer(sym_buffer)
    with gives_up_call_on_error(sym_buffer):
        layout = sym_buffer.layout
        device = check_cuda_buffer(sym_buffer)
        reason = supports(sym_buffer, weights)
        if reason is not None:
            raise ValueError(f"fused_mega_moe: {reason}")
        _check_weights_fit(sym_buffer, weights)
        activation_clamp = check_activation_clamp(activation_clamp)
        check_fast_math(fast_math)
        launches = []
        if x is not None:
            staging = _prepare_staging(sym_buffer, x, topk_idx, topk_weights, validate_routing)
            launches += [staging] if staging is not None else []
            n = x.shape[0]
        elif num_tokens is None:
            raise ValueError(f"num_tokens: with x=None give the staged row count (0.."
                             f"{layout.num_tokens})")
        else:
            check_token_count("num_tokens", num_tokens, layout.num_tokens)
            n = num_tokens
        state = buffer_state(sym_buffer)
        if block_m is None:
            block_m = block_m_for_call(n, layout.num_ranks, layout.num_topk, layout.num_experts,
                                       state.arch)
        if block_m not in FUSED_BLOCK_MS:
            raise ValueError(f"block_m: the fused kernel runs {FUSED_BLOCK_MS}, got {block_m!r}")
        most = state.num_sms
        grid = most if num_sms is None else num_sms
        if isinstance(grid, bool) or not isinstance(grid, int) or not 1 <= grid <= most:
            raise ValueError(f"num_sms: expected 1..{most} (one CTA per SM, all resident), got "
                             f"{num_sms!r}")
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", stats, torch.int32,
                         (layout.num_local_experts,), device)
        if y is None:
            y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device=device)
        check_tensor("y", y, torch.bfloat16, (n, layout.hidden), device)
        launches.append(fused_call(sym_buffer, weights, n, block_m, y, grid, stats,
                                   activation_clamp, fast_math))
    for launch in launches:
        launch()
    return y


def _check_weights_fit(sym_buffer: SymmBuffer, weights: ExpertWeights) -> None:
    layout = sym_buffer.layout
    if weights.recipe != layout.recipe:
        raise ValueError(f"weights: recipe {weights.recipe!r} does not match the buffer's "
                         f"{layout.recipe!r}")
    want = (layout.num_local_experts, layout.hidden, layout.intermediate_hidden)
    have = (weights.num_experts, weights.hidden, weights.intermediate)
    if have != want:
        raise ValueError(f"weights: (local experts, hidden, intermediate) = {have}, the "
                         f"buffer's are {want}")
    if weights.w1.device != sym_buffer.device:
        raise ValueError(f"weights: on {weights.w1.device}, the buffer on {sym_buffer.device}")
