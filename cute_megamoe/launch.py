"""One launcher per kernel: input staging, dispatch, the two grouped GEMMs, combine.

Each ``*_call`` function describes a kernel's arguments (raw pointers and sizes: `Ptr`, ints,
`STREAM`), compiles the kernel on first use (`runtime.compiled_kernel`, keyed by everything
baked into it: shapes and a complete configuration value, `config`; the heuristics fill one
in) and returns a `KernelCall`, the callable and its arguments in the form the
launch path (`runtime.launch_path`) takes; ``call()`` launches it on the current stream.
Launchers check nothing a user can get wrong: the entry points (`staged`, `expert_gemm`,
`api`) check their inputs with `checks` first, inside `staged.gives_up_call_on_error` for the
collective ones, and launch only once every check of the call has passed. CuTe DSL is imported
here only inside functions, so the package imports without it.

Hot path: a `KernelCall` can be kept and launched again with only the arguments that change
per call filled in (`KernelCall.prepare`; the ``*_SLOTS`` constants name them per kernel);
`staged` keeps one such plan per buffer and layer configuration.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .buffer import SymmBuffer
from .config import DEBUG_TENSOR_MODES, Sm90FusedConfig, Sm90GemmConfig, Sm100GemmConfig
from .heuristics import get_num_sms
from .runtime import LAUNCH_PATHS, LaunchPath, as_ptr, compiled_kernel, get_arch, launch_path

__all__ = [
    "COMBINE_SLOTS",
    "DISPATCH_SLOTS",
    "GEMM_SLOTS",
    "STAGING_SLOTS",
    "STREAM",
    "BufferState",
    "KernelCall",
    "PreparedCall",
    "Ptr",
    "buffer_state",
    "combine_call",
    "dispatch_call",
    "existing_buffer_state",
    "expert_gemm_calls",
    "FUSED_INPUT_SLOTS",
    "FUSED_SLOTS",
    "fused_call",
    "gemm_kernel",
    "staging_call",
]


@dataclass(frozen=True)
class KernelCall:
    """A compiled kernel and the arguments of one launch; ``call()`` launches it. ``path`` is
    the launch path the arguments are in."""

    fn: Callable
    args: tuple
    path: LaunchPath | None = None

    def __call__(self) -> None:
        self.fn(*self.args)

    def prepare(self, slots: tuple[int, ...]) -> PreparedCall:
        """This launch, to be made again with the arguments at ``slots`` replaced."""
        return PreparedCall(self.fn, self.args, slots)


class PreparedCall:
    """A launch kept for reuse: ``call(*values)`` launches with ``values`` (in the launch
    path's form) at ``slots`` and the kept arguments elsewhere."""

    __slots__ = ("args", "fn", "slots")

    def __init__(self, fn: Callable, args: tuple, slots: tuple[int, ...]):
        self.fn = fn
        self.args = list(args)
        self.slots = slots

    def __call__(self, *values) -> None:
        args = self.args.copy()
        for slot, value in zip(self.slots, values, strict=True):
            args[slot] = value
        self.fn(*args)


# Per kernel, the argument slots a layer call fills in (the rest is fixed per buffer, weights
# and configuration): staging (x, topk_idx, topk_weights, num_tokens, stream), dispatch
# (num_tokens, stats, stream), the GEMMs (stream: the last argument on every arch),
# combine (num_tokens, y, stream).
STAGING_SLOTS = (0, 1, 2, 7, 8)
DISPATCH_SLOTS = (2, 4, 6)
GEMM_SLOTS = (-1,)
COMBINE_SLOTS = (2, 5, 7)
# the fused layer kernel: (num_tokens, stats, y, stream: the last argument on every arch);
# sm_90a's staging its inputs itself also (x, topk_idx, topk_weights)
FUSED_SLOTS = (2, 4, 18, -1)
FUSED_INPUT_SLOTS = (21, 22, 23)


@dataclass(frozen=True)
class Ptr:
    """A pointer argument: ``tensor``'s first element, ``align`` bytes assumed, typed as its
    dtype or the CuTe ``dtype`` given."""

    tensor: torch.Tensor
    align: int = 16
    dtype: object = None


#: The stream argument (the current stream).
STREAM = object()

#: The argument form `cute.compile` takes as examples, whatever the launch path: the CuTe DSL
#: call path's (`cute.Pointer`, ``Int32``, ``CUstream``; TVM-FFI maps them to its pointer,
#: int32 and stream parameters).
_COMPILE_FORM = LAUNCH_PATHS["cute-dsl"]


#: Non-empty within `streamless`.
_STREAMLESS: list = []


@contextlib.contextmanager
def streamless():
    """Within: the launchers build launches without a stream argument and compile with a
    fake one (`precompile` where no GPU is: the launches are never made)."""
    _STREAMLESS.append(True)
    try:
        yield
    finally:
        _STREAMLESS.pop()


def _call_args(path: LaunchPath, specs: tuple, stream=None) -> tuple:
    """``specs`` (`Ptr`, int, `STREAM`) as ``path`` passes them; ``stream`` the current
    stream's by default (None within `streamless`)."""
    if stream is None and not _STREAMLESS:
        stream = path.stream()
    return tuple(path.ptr(s.tensor, s.align, s.dtype) if isinstance(s, Ptr)
                 else stream if s is STREAM else path.int32(s) for s in specs)


# The DSL's compiled objects whose raw TVM-FFI functions are in use: an object owns its
# module (engine, loaded CUDA library), so it lives as long as the entry (the process, like
# `runtime.compiled_kernel`'s cache).
_OWNERS: list = []


def _compile(kernel, specs: tuple, arch: str, path: LaunchPath) -> Callable:
    """Compile ``kernel`` for ``arch`` on ``path`` (with `cute.Pointer` / ``Int32`` /
    ``CUstream`` example arguments, whatever the path) and return what a launch calls."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    # (a compile reads the arguments' types only: within `streamless`, a fake stream)
    stream = make_fake_stream() if _STREAMLESS else None
    compiled = cute.compile(kernel, *_call_args(_COMPILE_FORM, specs, stream),
                            options=path.options(arch))
    entry = path.entry(compiled)
    if entry is not compiled:
        _OWNERS.append(compiled)
    return entry


def _kernel_call(key: tuple, make_kernel: Callable, specs: tuple, arch: str) -> KernelCall:
    path = launch_path()
    fn = compiled_kernel(key, lambda: _compile(make_kernel(), specs, arch, path))
    return KernelCall(fn, _call_args(path, specs), path)


class BufferState:
    """Per-buffer launch state built once: the arch, SM count, the per-expert count tensor
    (reused by every dispatch on the buffer, like the pool itself), the expert FFN's output
    and the layer plans of `staged` (one per configuration)."""

    def __init__(self, sym_buffer: SymmBuffer):
        device = sym_buffer.device
        self.arch = get_arch(device)
        # SMs this rank's kernels use by default (`SymmBuffer.num_sms`: a share of the GPU when
        # several ranks share it, see `SymmBuffer.loopback`)
        self.num_sms = sym_buffer.num_sms or get_num_sms(device)
        self.recv_tokens = torch.zeros(sym_buffer.layout.num_local_experts, dtype=torch.int32,
                                       device=device)
        # `cute.Pointer`s of the peer table and the counts, for callers that compile kernels
        # of their own (`testing.protocol_checks`)
        self.peer_bases = as_ptr(sym_buffer.peer_bases)
        self.recv_tokens_ptr = as_ptr(self.recv_tokens, align=4)
        self.expert_out: torch.Tensor | None = None  # BF16 [P, H] of `staged.kernel_experts`
        self.plans: dict = {}  # `staged`'s and `fused`'s layer plans by configuration


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def buffer_state(sym_buffer: SymmBuffer) -> BufferState:
    """The launch state of ``sym_buffer`` (built on first use; needs CUDA). Raises the report
    a kernel of the buffer left before it trapped (`SymmBuffer.report`): every launch on the
    buffer goes through here, and none may follow a trap."""
    sym_buffer.raise_if_reported()
    state = _STATES.get(sym_buffer)
    if state is None:
        state = _STATES[sym_buffer] = BufferState(sym_buffer)
    return state


def existing_buffer_state(sym_buffer: object) -> BufferState | None:
    """The launch state of ``sym_buffer`` if one was built (no CUDA needed), else None. Raises
    as `buffer_state` does after a trap (the kept plans start here)."""
    try:
        state = _STATES.get(sym_buffer)
    except TypeError:  # not weak-referenceable: not a buffer
        return None
    if state is not None:
        sym_buffer.raise_if_reported()
    return state


# ----------------------------------------------------------------------------- staging

def staging_call(sym_buffer: SymmBuffer, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> KernelCall:
    """`kernels/staging.py`: quantize ``x`` (BF16 ``[n, H]``, n > 0) into the buffer's ``x`` /
    ``x_sf`` and copy the routing."""
    from .kernels.staging import InputStagingKernel

    layout = sym_buffer.layout
    arch = buffer_state(sym_buffer).arch
    recipe = layout.recipe
    out_sf = sym_buffer.x_sf if layout.has_sf else sym_buffer.topk_weights  # unused for bf16
    specs = (Ptr(x), Ptr(topk_idx), Ptr(topk_weights), Ptr(sym_buffer.x), Ptr(out_sf),
             Ptr(sym_buffer.topk_idx), Ptr(sym_buffer.topk_weights), x.shape[0], STREAM)
    return _kernel_call(("staging", arch, recipe, layout.hidden, layout.num_topk),
                        lambda: InputStagingKernel(recipe, layout.hidden, layout.num_topk),
                        specs, arch)


# ----------------------------------------------------------------------------- dispatch

def dispatch_call(sym_buffer: SymmBuffer, num_tokens: int, block_m: int, num_ctas: int,
                  stats: torch.Tensor | None, transfer: str) -> KernelCall:
    """`kernels/dispatch.py` for ``num_tokens`` staged rows (collective)."""
    from .kernels.dispatch import DispatchKernel

    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    has_stats = stats is not None
    counts = Ptr(state.recv_tokens, align=4)
    specs = (Ptr(sym_buffer.peer_bases), sym_buffer.rank, num_tokens, counts,
             Ptr(stats, align=4) if has_stats else counts, num_ctas, STREAM)
    return _kernel_call(("dispatch", state.arch, layout, block_m, has_stats, transfer),
                        lambda: DispatchKernel(layout, block_m, has_stats=has_stats,
                                               transfer=transfer),
                        specs, state.arch)


# ----------------------------------------------------------------------------- combine

def combine_call(sym_buffer: SymmBuffer, num_tokens: int, block_m: int,
                 expert_out: torch.Tensor | None, expert_recv_tokens: torch.Tensor,
                 y: torch.Tensor, num_ctas: int, send_mode: str,
                 rounds: tuple[int, ...]) -> KernelCall:
    """`kernels/combine.py` into ``y`` (collective). ``expert_out`` None: send mode
    ``"epilogue"`` (the L2 GEMMs sent the rows; the kernel never reads ``expert_out``)."""
    from .kernels.combine import CombineKernel

    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    # any valid pointer stands for an unused argument
    out = Ptr(sym_buffer.l1_topk_weights if expert_out is None else expert_out)
    specs = (Ptr(sym_buffer.peer_bases), sym_buffer.rank, num_tokens, out,
             Ptr(expert_recv_tokens, align=4),
             Ptr(y) if num_tokens > 0 else out,  # y is not touched when n == 0
             num_ctas, STREAM)
    return _kernel_call(("combine", state.arch, layout, block_m, send_mode, rounds),
                        lambda: CombineKernel(layout, block_m, send_mode=send_mode,
                                              rounds=rounds),
                        specs, state.arch)


# ----------------------------------------------------------------------------- grouped GEMMs

def gemm_kernel(arch: str, recipe: str, phase: str, num_experts: int, num_pool_rows: int,
                n: int, k: int, config: Sm90GemmConfig | Sm100GemmConfig,
                activation_clamp: float | None = None, fast_math: bool = True,
                combine_layout=None, tiled_weights: bool = False):
    """The grouped-GEMM kernel object of ``arch`` for one phase, built from its complete
    ``config`` (`heuristics.default_gemm_config`; sm_90a: the transposed kernel where
    ``config.transposed``), and the CuTe dtypes of its pointer arguments ``(a, a_sf, b, b_sf,
    expert_recv_tokens, topk_weights, out, out_sf, peer_bases, src_metadata)``, on sm_90a then
    ``b_group_sf`` (the per-32 scales of FP4 weights; ``b_sf`` their block scales) (what
    `expert_gemm_calls` passes; the compile tests use the same plan). ``combine_layout``: L2
    sends its rows to the source ranks' combine buffers of a symmetric buffer with this
    `MegaMoELayout`. ``tiled_weights``: the weights are stored as `expert_gemm.tile_weight_rows`
    makes them (sm_90a FP8 / BF16, the staged kernel)."""
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

        if config.transposed:
            from .kernels.sm90_expert_gemm_transposed import (
                Sm90TransposedExpertGemmKernel as Kernel,
            )
        ab = BFloat16 if recipe == "bf16xbf16" else Float8E4M3FN
        b = Uint8 if recipe == "fp8xfp4_sm90" else ab
        dtypes = (ab, Float32, b, Float32, Int32, Float32, ab if phase == "l1" else BFloat16,
                  Float32, Int64, Int32, Int32)
        kernel = Kernel(phase, recipe, num_experts, num_pool_rows, n, k, config,
                        activation_clamp=clamp, fast_math=fast_math,
                        combine_layout=combine_layout, tiled_weights=tiled_weights)
    elif arch == "sm_100a":
        from .kernels.sm100_expert_gemm import Sm100ExpertGemmKernel

        if recipe == "bf16xbf16":  # no scales: a_sf, b_sf, out_sf point at topk_weights
            dtypes = (BFloat16, Float32, BFloat16, Float32, Int32, Float32, BFloat16, Float32,
                      Int64, Int32)
        else:
            dtypes = (Float8E4M3FN, Float8E8M0FNU, Float4E2M1FN, Float8E8M0FNU, Int32, Float32,
                      Float8E4M3FN if phase == "l1" else BFloat16, Uint8, Int64, Int32)
        if tiled_weights:
            raise ValueError(f"tiled_weights: sm_90a only, not {arch}")
        kernel = Sm100ExpertGemmKernel(phase, recipe, num_experts, num_pool_rows, n, k, config,
                                       activation_clamp=clamp, fast_math=fast_math,
                                       combine_layout=combine_layout)
    else:
        raise ValueError(f"arch: no grouped-GEMM kernels for {arch!r}")
    return kernel, dtypes


def expert_gemm_calls(arch: str, recipe: str, grid: int, weights, acts: torch.Tensor,
                      acts_sf: torch.Tensor | None, topk_weights: torch.Tensor,
                      expert_recv_tokens: torch.Tensor, l2_acts: torch.Tensor,
                      l2_acts_sf: torch.Tensor | None, out: torch.Tensor | None,
                      activation_clamp: float | None, fast_math: bool,
                      combine_buffer: SymmBuffer | None, configs: tuple) -> list[KernelCall]:
    """The L1 (+ SwiGLU + requant into ``l2_acts``) and L2 launches of the expert FFN over a
    pool (`expert_gemm.expert_ffn` checks their inputs). ``combine_buffer``: L2 writes every
    row into its source rank's combine buffer (``out`` unused). ``configs``: the complete
    configurations of L1 and L2 (`heuristics.default_gemm_config`)."""
    e_l, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    pool_rows = acts.shape[0]
    combine_layout = None if combine_buffer is None else combine_buffer.layout
    path = launch_path()
    calls = []
    for phase, config in zip(("l1", "l2"), configs, strict=True):
        # FP4 weights on sm_90a: the block scales go where the FP8 ones do, the per-32 scales
        # last
        fp4 = recipe == "fp8xfp4_sm90"
        if phase == "l1":
            n, k = 2 * inter, hidden
            tensors = (acts, acts_sf, weights.w1, weights.w1_block_sf if fp4 else weights.w1_sf,
                       expert_recv_tokens, topk_weights, l2_acts, l2_acts_sf)
            group_sf = weights.w1_sf if fp4 else None
        else:
            n, k = hidden, inter
            tensors = (l2_acts, l2_acts_sf, weights.w2,
                       weights.w2_block_sf if fp4 else weights.w2_sf, expert_recv_tokens, None,
                       out, None)
            group_sf = weights.w2_sf if fp4 else None
        to_combine = phase == "l2" and combine_layout is not None
        tensors += ((combine_buffer.peer_bases, combine_buffer.token_src_metadata)
                    if to_combine else (None, None))
        if arch == "sm_90a":
            tensors += (group_sf,)
        key = ("expert_gemm", arch, phase, recipe, e_l, pool_rows, n, k,
               activation_clamp if phase == "l1" else None, bool(fast_math),
               combine_layout if to_combine else None, config, weights.tiled)
        plan = {}

        def build(phase=phase, n=n, k=k, plan=plan, to_combine=to_combine, config=config):
            plan["kernel"], plan["dtypes"] = gemm_kernel(
                arch, recipe, phase, e_l, pool_rows, n, k, config, activation_clamp, fast_math,
                combine_layout=combine_layout if to_combine else None,
                tiled_weights=weights.tiled)
            return plan

        entry = compiled_kernel(key + ("plan",), build)
        # an unused pointer argument points at topk_weights (never dereferenced); a cluster
        # launch needs a whole number of clusters
        cluster_m = getattr(entry["kernel"], "cluster_m", 1)
        specs = (*(Ptr(topk_weights if t is None else t, 4 if i == 4 else 16, d)
                   for i, (t, d) in enumerate(zip(tensors, entry["dtypes"], strict=True))),
                 max(cluster_m, grid - grid % cluster_m), STREAM)
        fn = compiled_kernel(key, lambda entry=entry, specs=specs: _compile(
            entry["kernel"], specs, arch, path))
        calls.append(KernelCall(fn, _call_args(path, specs), path))
    return calls


# ----------------------------------------------------------------------------- fused layer

def fused_call(sym_buffer: SymmBuffer, weights, num_tokens: int, y: torch.Tensor | None,
               num_ctas: int, stats: torch.Tensor | None, activation_clamp: float | None,
               fast_math: bool, config: Sm90FusedConfig | Sm100GemmConfig,
               debug: torch.Tensor | None = None,
               inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> KernelCall:
    """`kernels/sm90_mega_moe.py` (sm_100a: `kernels/sm100_mega_moe.py`, compiled only, never
    run): the whole layer for ``num_tokens`` staged rows into ``y`` (collective), built from
    its complete ``config`` (sm_90a: `heuristics.default_fused_config`; sm_100a: the GEMMs'
    `Sm100GemmConfig`, its BLOCK_M). ``num_ctas`` is rounded down to whole clusters (sm_100a
    at BLOCK_M 256). ``debug`` (sm_90a, with ``config.debug``): the diagnostic's tensor,
    "phase_clock" int64 ``[num_ctas, len(PHASE_STAMPS)]`` (each CTA's phase boundaries,
    `bench/fused_phases.py`), "tile_log" int32 ``[tiles per CTA, num_ctas, 4]`` (every CTA's
    tiles, `testing.fused_checks.check_tile_walk`), "tile_clock" int32 ``[num_ctas,
    sm90_mega_moe.TILE_CLOCK_TILES, 4]`` zeroed (the ticket walk's tiles and their spans,
    `bench/timeline.py`); "hold_cta" and "late_consumers" (test builds) take none.
    ``inputs`` (sm_90a, with ``config.stages_inputs``): the caller's ``(x, topk_idx,
    topk_weights)``, which the kernel stages into the buffer itself instead of a staging
    launch before it."""
    tiled = bool(getattr(weights, "tiled", False))
    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    has_stats = stats is not None
    if state.arch == "sm_90a":
        if not isinstance(config, Sm90FusedConfig):
            raise TypeError(f"config: an Sm90FusedConfig on sm_90a, got "
                            f"{type(config).__name__}")
        if (debug is None) != (config.debug not in DEBUG_TENSOR_MODES):
            raise ValueError(f"debug: a tensor with config.debug {DEBUG_TENSOR_MODES}, none "
                             f"without; got config.debug={config.debug!r}")
        if (inputs is not None) != bool(config.stages_inputs):
            raise ValueError(f"inputs: the caller's (x, topk_idx, topk_weights) with "
                             f"config.stages_inputs, none without; got "
                             f"config.stages_inputs={config.stages_inputs!r}")
    elif not isinstance(config, Sm100GemmConfig) or debug is not None or inputs is not None:
        raise ValueError("fused_call: on sm_100a an Sm100GemmConfig, no debug tensor and no "
                         "in-kernel staging")
    key = ("mega_moe", state.arch, layout, activation_clamp, bool(fast_math), has_stats,
           tiled, config)

    def make_kernel():
        if state.arch == "sm_100a":
            from .kernels.sm100_mega_moe import Sm100MegaMoEKernel

            if tiled:
                raise ValueError("fused_call: tiled weights are sm_90a only")
            return Sm100MegaMoEKernel(layout, config, activation_clamp=activation_clamp,
                                      fast_math=fast_math, has_stats=has_stats)
        from .kernels.sm90_mega_moe import Sm90MegaMoEKernel

        return Sm90MegaMoEKernel(layout, config, activation_clamp=activation_clamp,
                                 fast_math=fast_math, has_stats=has_stats, tiled_weights=tiled)

    kernel = compiled_kernel(key + ("kernel",), make_kernel)
    debug_mode = getattr(config, "debug", None)
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
        "w2_sf": weights.w2_sf if fp8 else spare, "pool_block_ready": sym_buffer.pool_block_ready,
        # (the diagnostics' tensors: unused without them)
        "phase_clock": debug if debug_mode == "phase_clock" else sym_buffer.peer_bases,
        "tile_log": debug if debug_mode in ("tile_log", "tile_clock") else state.recv_tokens,
        "y": y if num_tokens > 0 else spare,
        "w1_group_sf": spare, "w2_group_sf": spare,  # (unused without FP4 weights)
    }
    # the caller's inputs (read only by a kernel that stages them itself)
    tensors.update(zip(("x", "topk_idx", "topk_weights"), inputs or (spare,) * 3, strict=True))
    if weights.recipe == "fp8xfp4_sm90":  # block scales where FP8's go, the per-32 ones apart
        tensors.update(w1_sf=weights.w1_block_sf, w2_sf=weights.w2_block_sf,
                       w1_group_sf=weights.w1_sf, w2_group_sf=weights.w2_sf)
    ptrs = [Ptr(tensors[name], 4 if name in ("expert_recv_tokens", "stats", "pool_block_ready",
                                             "tile_log") else 16, dtype)
            for name, dtype in kernel.pointer_args()]
    # whole clusters; at most one CTA per SM: the cooperative grid is co-resident
    num_ctas = max(kernel.cluster_m, num_ctas - num_ctas % kernel.cluster_m)
    if debug_mode == "tile_clock":
        from .kernels.sm90_mega_moe import TILE_CLOCK_TILES

        shape = (num_ctas, TILE_CLOCK_TILES, 4)
        if debug.dtype != torch.int32 or tuple(debug.shape) != shape:
            raise ValueError(f"debug: 'tile_clock' takes an int32 tensor of shape {shape}, got "
                             f"{debug.dtype} {tuple(debug.shape)}")
    specs = (ptrs[0], sym_buffer.rank, num_tokens, *ptrs[1:], num_ctas, STREAM)
    return _kernel_call(key, lambda: kernel, specs, state.arch)
