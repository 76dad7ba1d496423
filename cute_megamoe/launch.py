"""One launcher per kernel: input staging, dispatch, the two grouped GEMMs, combine.

Each ``*_call`` function builds a kernel's arguments (raw pointers and sizes), compiles the
kernel on first use (`runtime.compiled_kernel`, keyed by everything baked into it) and returns
a `KernelCall`, the compiled function and its arguments; ``call()`` launches it on the current
stream. Launchers check nothing a user can get wrong: the entry points (`staged`,
`expert_gemm`, `api`) check their inputs with `checks` first, inside
`staged.gives_up_call_on_error` for the collective ones, and launch only once every check of
the call has passed. CuTe DSL is imported here only inside functions, so the package imports
without it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .buffer import SymmBuffer
from .heuristics import get_num_sms, select_cluster_m
from .runtime import as_ptr, compiled_kernel, current_stream, get_arch

__all__ = [
    "BufferState",
    "KernelCall",
    "buffer_state",
    "combine_call",
    "dispatch_call",
    "expert_gemm_calls",
    "gemm_kernel",
    "staging_call",
]


@dataclass(frozen=True)
class KernelCall:
    """A compiled kernel and the arguments of one launch; ``call()`` launches it."""

    fn: Callable
    args: tuple

    def __call__(self) -> None:
        self.fn(*self.args)


class BufferState:
    """Per-buffer launch state built once: the arch, SM count, pointer arguments and the
    per-expert count tensor (reused by every dispatch on the buffer, like the pool itself)."""

    def __init__(self, sym_buffer: SymmBuffer):
        device = sym_buffer.device
        self.arch = get_arch(device)
        # SMs this rank's kernels use by default (`SymmBuffer.num_sms`: a share of the GPU when
        # several ranks share it, see `SymmBuffer.loopback`)
        self.num_sms = sym_buffer.num_sms or get_num_sms(device)
        self.peer_bases = as_ptr(sym_buffer.peer_bases)
        self.recv_tokens = torch.zeros(sym_buffer.layout.num_local_experts, dtype=torch.int32,
                                       device=device)
        self.recv_tokens_ptr = as_ptr(self.recv_tokens, align=4)
        self.expert_out: torch.Tensor | None = None  # BF16 [P, H] of `staged.kernel_experts`


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def buffer_state(sym_buffer: SymmBuffer) -> BufferState:
    """The launch state of ``sym_buffer`` (built on first use; needs CUDA)."""
    state = _STATES.get(sym_buffer)
    if state is None:
        state = _STATES[sym_buffer] = BufferState(sym_buffer)
    return state


# ----------------------------------------------------------------------------- staging

def staging_call(sym_buffer: SymmBuffer, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> KernelCall:
    """`kernels/staging.py`: quantize ``x`` (BF16 ``[n, H]``, n > 0) into the buffer's ``x`` /
    ``x_sf`` and copy the routing."""
    import cutlass.cute as cute
    from cutlass import Int32

    from .kernels.staging import InputStagingKernel

    layout = sym_buffer.layout
    arch = get_arch(sym_buffer.device)
    recipe = layout.recipe
    out_sf = sym_buffer.x_sf if layout.has_sf else sym_buffer.topk_weights  # unused for bf16
    args = (as_ptr(x), as_ptr(topk_idx), as_ptr(topk_weights), as_ptr(sym_buffer.x),
            as_ptr(out_sf), as_ptr(sym_buffer.topk_idx), as_ptr(sym_buffer.topk_weights),
            Int32(x.shape[0]), current_stream())
    fn = compiled_kernel(
        ("staging", arch, recipe, layout.hidden, layout.num_topk),
        lambda: cute.compile(InputStagingKernel(recipe, layout.hidden, layout.num_topk), *args,
                             options=f"--gpu-arch {arch}"))
    return KernelCall(fn, args)


# ----------------------------------------------------------------------------- dispatch

def dispatch_call(sym_buffer: SymmBuffer, num_tokens: int, block_m: int, num_ctas: int,
                  stats: torch.Tensor | None, transfer: str) -> KernelCall:
    """`kernels/dispatch.py` for ``num_tokens`` staged rows (collective)."""
    import cutlass.cute as cute
    from cutlass import Int32

    from .kernels.dispatch import DispatchKernel

    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    has_stats = stats is not None
    stats_ptr = as_ptr(stats, align=4) if has_stats else state.recv_tokens_ptr
    args = (state.peer_bases, Int32(sym_buffer.rank), Int32(num_tokens), state.recv_tokens_ptr,
            stats_ptr, Int32(num_ctas), current_stream())
    fn = compiled_kernel(
        ("dispatch", state.arch, layout, block_m, has_stats, transfer),
        lambda: cute.compile(DispatchKernel(layout, block_m, has_stats=has_stats,
                                            transfer=transfer), *args,
                             options=f"--gpu-arch {state.arch}"))
    return KernelCall(fn, args)


# ----------------------------------------------------------------------------- combine

def combine_call(sym_buffer: SymmBuffer, num_tokens: int, block_m: int,
                 expert_out: torch.Tensor | None, expert_recv_tokens: torch.Tensor,
                 y: torch.Tensor, num_ctas: int, send_mode: str,
                 rounds: tuple[int, ...]) -> KernelCall:
    """`kernels/combine.py` into ``y`` (collective). ``expert_out`` None: send mode
    ``"epilogue"`` (the L2 GEMMs sent the rows; the kernel never reads ``expert_out``)."""
    import cutlass.cute as cute
    from cutlass import Int32

    from .kernels.combine import CombineKernel

    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    # any valid pointer stands for an unused argument
    out_ptr = as_ptr(sym_buffer.l1_topk_weights if expert_out is None else expert_out)
    args = (state.peer_bases, Int32(sym_buffer.rank), Int32(num_tokens), out_ptr,
            as_ptr(expert_recv_tokens, align=4),
            as_ptr(y) if num_tokens > 0 else out_ptr,  # y is not touched when n == 0
            Int32(num_ctas), current_stream())
    fn = compiled_kernel(
        ("combine", state.arch, layout, block_m, send_mode, rounds),
        lambda: cute.compile(CombineKernel(layout, block_m, send_mode=send_mode,
                                           rounds=rounds), *args,
                             options=f"--gpu-arch {state.arch}"))
    return KernelCall(fn, args)


# ----------------------------------------------------------------------------- grouped GEMMs

def gemm_kernel(arch: str, recipe: str, phase: str, num_experts: int, num_pool_rows: int,
                n: int, k: int, block_m: int, activation_clamp: float | None = None,
                fast_math: bool = True, combine_layout=None):
    """The grouped-GEMM kernel object of ``arch`` for one phase, and the CuTe dtypes of its ten
    pointer arguments ``(a, a_sf, b, b_sf, expert_recv_tokens, topk_weights, out, out_sf,
    peer_bases, src_metadata)`` (what `expert_gemm_calls` passes; the compile tests use the same
    plan). ``combine_layout``: L2 sends its rows to the source ranks' combine buffers of a
    symmetric buffer with this `MegaMoELayout`."""
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


def expert_gemm_calls(arch: str, recipe: str, block_m: int, grid: int, weights,
                      acts: torch.Tensor, acts_sf: torch.Tensor | None,
                      topk_weights: torch.Tensor, expert_recv_tokens: torch.Tensor,
                      l2_acts: torch.Tensor, l2_acts_sf: torch.Tensor | None,
                      out: torch.Tensor | None, activation_clamp: float | None,
                      fast_math: bool, combine_buffer: SymmBuffer | None) -> list[KernelCall]:
    """The L1 (+ SwiGLU + requant into ``l2_acts``) and L2 launches of the expert FFN over a
    pool (`expert_gemm.expert_ffn` checks their inputs). ``combine_buffer``: L2 writes every
    row into its source rank's combine buffer (``out`` unused)."""
    import cutlass.cute as cute
    from cutlass import Int32

    e_l, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    pool_rows = acts.shape[0]
    combine_layout = None if combine_buffer is None else combine_buffer.layout
    stream = current_stream()
    calls = []
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
            return cute.compile(entry["kernel"], *args, options=f"--gpu-arch {arch}")

        calls.append(KernelCall(compiled_kernel(key, compile_it), args))
    return calls
