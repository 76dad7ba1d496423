"""Public entry points: input checks, kernel choice per arch, compiled-kernel cache.

Every check a user can fail raises `ValueError`/`TypeError` naming the argument, on the host,
before anything is launched.
"""

from __future__ import annotations

import torch

from .buffer import SymmBuffer
from .runtime import as_ptr, compiled_kernel, current_stream, env_flag, get_arch

MAX_INT32 = 2**31 - 1


def _check_tensor(name: str, t: object, dtype: torch.dtype, shape: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {t.stride()})")
    if t.numel() > 0 and t.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: data pointer must be 16-byte aligned")
    return t


def check_routing(topk_idx: torch.Tensor, num_experts: int, name: str = "topk_idx") -> None:
    """Raise if a top-k index is outside [-1, num_experts) or a token names one expert twice
    (the buffer holds one slot per token per expert). Synchronizes with the GPU."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"{name}: expert index {bad} is out of range (valid: -1 for a masked slot, "
            f"or 0..{num_experts - 1})")
    ordered = topk_idx.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        token = int(repeated.any(dim=1).nonzero()[0])
        raise ValueError(f"{name}: token {token} names the same expert in two slots "
                         f"({topk_idx[token].tolist()}); mask repeats with -1")


def stage_inputs(sym_buffer: SymmBuffer, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, *, validate_routing: bool | None = None) -> None:
    """Quantize `x` (BF16 `[n, hidden]`) into `sym_buffer.x` / `x_sf` and copy the routing.

    One GPU kernel (`kernels/staging.py`), bit-exact with `quant.quantize_activations_for_recipe`
    for the buffer's recipe. `validate_routing` (default: the `CUTE_MEGAMOE_CHECK_ROUTING`
    switch, on unless set to 0) checks every expert index on the host first; it synchronizes
    the stream, so hot loops that trust their router turn it off.
    """
    from .kernels.staging import InputStagingKernel

    layout = sym_buffer.layout
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims [num_tokens, hidden], got shape {tuple(x.shape)}")
    n = x.shape[0]
    if n > layout.num_tokens:
        raise ValueError(
            f"x: {n} tokens exceed the buffer's num_max_tokens_per_rank ({layout.num_tokens})")
    device = sym_buffer.buffer.device
    if device.type != "cuda":
        raise ValueError(f"sym_buffer: must live on a CUDA device, not {device}")
    _check_tensor("x", x, torch.bfloat16, (n, layout.hidden), device)
    _check_tensor("topk_idx", topk_idx, torch.int64, (n, layout.num_topk), device)
    _check_tensor("topk_weights", topk_weights, torch.float32, (n, layout.num_topk), device)
    if n * layout.hidden > MAX_INT32:
        raise ValueError(f"x: num_tokens * hidden = {n * layout.hidden} exceeds 2**31 - 1")
    if validate_routing is None:
        validate_routing = env_flag("CUTE_MEGAMOE_CHECK_ROUTING", default=True)
    if validate_routing:
        check_routing(topk_idx, layout.num_experts)
    if n == 0:
        return

    import cutlass.cute as cute
    from cutlass import Int32

    arch = get_arch(device)
    recipe = layout.recipe
    out_sf = sym_buffer.x_sf if recipe != "bf16xbf16" else sym_buffer.topk_weights  # unused
    args = (as_ptr(x), as_ptr(topk_idx), as_ptr(topk_weights), as_ptr(sym_buffer.x),
            as_ptr(out_sf), as_ptr(sym_buffer.topk_idx), as_ptr(sym_buffer.topk_weights),
            Int32(n), current_stream())
    fn = compiled_kernel(
        ("staging", arch, recipe, layout.hidden, layout.num_topk),
        lambda: cute.compile(InputStagingKernel(recipe, layout.hidden, layout.num_topk), *args,
                             options=f"--gpu-arch {arch}"))
    fn(*args)


def _mega_moe(recipes: tuple[str, ...], name: str, y: torch.Tensor, weights,
              sym_buffer: SymmBuffer, cumulative_local_expert_recv_stats, activation_clamp,
              fast_math: bool, block_m: int | None) -> torch.Tensor:
    from . import staged

    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f"sym_buffer: expected a SymmBuffer, got {type(sym_buffer).__name__}")
    with staged.gives_up_call_on_error(sym_buffer):
        n, block_m = _check_layer_call(recipes, name, y, weights, sym_buffer, block_m)
    return staged.staged_mega_moe(
        sym_buffer, None, None, None, weights, num_tokens=n, y=y,
        activation_clamp=activation_clamp, fast_math=fast_math, block_m=block_m,
        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats)


def _check_layer_call(recipes: tuple[str, ...], name: str, y: torch.Tensor, weights,
                      sym_buffer: SymmBuffer, block_m: int | None) -> tuple[int, int]:
    """The host checks of `fp8_mega_moe` / `bf16_mega_moe`; returns (tokens, BLOCK_M)."""
    from .expert_gemm import SUPPORTED_RECIPES, ExpertWeights
    from .heuristics import expected_tokens_per_expert, select_block_m

    if sym_buffer.recipe not in recipes:
        raise ValueError(f"{name}: the buffer's recipe is {sym_buffer.recipe!r}; "
                         f"{name} takes {recipes}")
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected cute_megamoe.expert_gemm.ExpertWeights, got "
                        f"{type(weights).__name__}")
    layout = sym_buffer.layout
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise TypeError("y: expected a 2-D BF16 tensor [num_tokens, hidden]")
    n = y.shape[0]
    if n > layout.num_tokens:
        raise ValueError(f"y: {n} tokens exceed the buffer's num_max_tokens_per_rank "
                         f"({layout.num_tokens})")
    _check_tensor("y", y, torch.bfloat16, (n, layout.hidden), sym_buffer.device)
    arch = get_arch(sym_buffer.device)
    if sym_buffer.recipe not in SUPPORTED_RECIPES.get(arch, ()):
        raise ValueError(f"{name}: recipe {sym_buffer.recipe!r} has no grouped-GEMM kernels on "
                         f"{arch} (supported: {SUPPORTED_RECIPES})")
    if block_m is None:
        expected = expected_tokens_per_expert(n, layout.num_ranks, layout.num_topk,
                                              layout.num_experts)
        block_m = select_block_m(expected, arch)
    return n, block_m


def fp8_mega_moe(y: torch.Tensor, weights, sym_buffer: SymmBuffer, *,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 activation_clamp: float | None = None, fast_math: bool = True,
                 block_m: int | None = None) -> torch.Tensor:
    """One MoE layer with FP8 activations, on every rank of the buffer's group (collective).

    The inputs are what `stage_inputs` put into `sym_buffer` (``len(y)`` tokens); the result
    is written to ``y`` (BF16 ``[num_tokens, hidden]``) and returned. Staged mode: dispatch,
    L1 (+ SwiGLU + requant), L2 and combine run as four kernels. ``weights`` is this rank's
    `expert_gemm.ExpertWeights` (recipe ``fp8xfp8`` on Hopper; ``fp8xfp4`` on Blackwell, whose
    kernels are compiled but were never run). ``block_m`` defaults to the heuristics' choice
    for the expected tokens per expert on this rank; ranks may differ (each lays out its own
    pool, and the kernels place a destination's rows by the BLOCK_M it published). A check
    that fails raises before any launch and counts the call as given up on this rank
    (`SymmBuffer.skip_call`), so that it cannot pair its next call with the peers' current
    one (the kernels trap naming the call numbers instead).
    """
    return _mega_moe(("fp8xfp8", "fp8xfp4"), "fp8_mega_moe", y, weights, sym_buffer,
                     cumulative_local_expert_recv_stats, activation_clamp, fast_math, block_m)


def bf16_mega_moe(y: torch.Tensor, weights, sym_buffer: SymmBuffer, *,
                  cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                  activation_clamp: float | None = None, fast_math: bool = True,
                  block_m: int | None = None) -> torch.Tensor:
    """`fp8_mega_moe` for the ``bf16xbf16`` recipe (BF16 activations and weights)."""
    return _mega_moe(("bf16xbf16",), "bf16_mega_moe", y, weights, sym_buffer,
                     cumulative_local_expert_recv_stats, activation_clamp, fast_math, block_m)
