"""One launcher per kernel: input staging, dispatch, the two grouped GEMMs, combine.

Each ``*_call`` function describes a kernel's arguments (raw pointers and sizes: `Ptr`, ints,
`STREAM`), compiles the kernel on first use (`runtime.compiled_kernel`, keyed by everything
baked into it) and returns a `KernelCall`, the callable and its arguments in the form the
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
from .heuristics import (
    get_num_sms,
    select_cluster_m,
    select_sm90_fp4_cluster,
    select_sm90_transposed,
)
from .runtime import (
    LAUNCH_PATHS,
    LaunchPath,
    as_ptr,
    compiled_kernel,
    fused_local_dispatch,
    fused_rows,
    fused_weights_first,
    get_arch,
    launch_path,
    sm90_fp4_cluster,
    sm90_fp4_early_tables,
    sm90_fp4_tables,
    sm90_k_unroll,
    sm90_promotion,
    sm90_row_stores,
    sm90_tma_store,
    sm90_transposed,
    sm90_transposed_a_rows,
    tile_owner_search,
)

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
    "sm90_runs_transposed",
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

def sm90_runs_transposed(arch: str, recipe: str, block_m: int,
                         expected_tokens_per_expert: float | None) -> bool:
    """Whether a grouped GEMM runs on the transposed sm_90a kernel: FP8 weights (fp8xfp8,
    fp8xfp4_sm90) at BLOCK_M 64, as ``CUTE_MEGAMOE_SM90_TRANSPOSED`` forces it or else as
    `heuristics.select_sm90_transposed` chooses for the call's expected tokens per expert."""
    if arch != "sm_90a" or recipe == "bf16xbf16" or block_m != 64:
        return False
    forced = sm90_transposed()
    if forced is not None:
        return forced
    return select_sm90_transposed(recipe, block_m, expected_tokens_per_expert)


def sm90_shares_decode(block_m: int, expected_tokens_per_expert: float | None) -> bool:
    """Whether an sm_90a grouped GEMM with MXFP4 weights runs in 2-CTA clusters that share the
    decode: as ``CUTE_MEGAMOE_SM90_FP4_CLUSTER`` forces it, else as
    `heuristics.select_sm90_fp4_cluster` chooses for the call's expected tokens per expert; not
    with the early tables forced on (``CUTE_MEGAMOE_SM90_FP4_EARLY_TABLES=1``: they are every
    chunk's, a shared decode decodes one)."""
    forced, early = sm90_fp4_cluster(), sm90_fp4_early_tables()
    if forced and early:
        raise ValueError("CUTE_MEGAMOE_SM90_FP4_CLUSTER=1 and CUTE_MEGAMOE_SM90_FP4_EARLY_TABLES=1"
                         ": a decode shared by a cluster has no early tables")
    if forced is not None:
        return forced and block_m == 128
    return not early and select_sm90_fp4_cluster("fp8xfp4_sm90", block_m,
                                                 expected_tokens_per_expert)


def gemm_kernel(arch: str, recipe: str, phase: str, num_experts: int, num_pool_rows: int,
                n: int, k: int, block_m: int, activation_clamp: float | None = None,
                fast_math: bool = True, combine_layout=None, tiled_weights: bool = False,
                expected_tokens_per_expert: float | None = None, pool_block_m: int | None = None):
    """The grouped-GEMM kernel object of ``arch`` for one phase, and the CuTe dtypes of its
    pointer arguments ``(a, a_sf, b, b_sf, expert_recv_tokens, topk_weights, out, out_sf,
    peer_bases, src_metadata)``, on sm_90a then ``b_group_sf`` (the per-32 scales of FP4
    weights; ``b_sf`` their block scales) (what `expert_gemm_calls` passes; the compile tests
    use the same plan). ``combine_layout``: L2 sends its rows to the source ranks' combine
    buffers of a symmetric buffer with this `MegaMoELayout`. ``tiled_weights``: the weights are
    stored as `expert_gemm.tile_weight_rows` makes them (sm_90a FP8 / BF16, the staged kernel).
    ``expected_tokens_per_expert``: the call's, for the choice of the sm_90a mainloop
    (`sm90_runs_transposed`). ``pool_block_m``: the pool's block when it is not BLOCK_M (sm_90a
    staged kernels: 2 x BLOCK_M, each expert's rows starting at a multiple of it)."""
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

        ab = BFloat16 if recipe == "bf16xbf16" else Float8E4M3FN
        b = Uint8 if recipe == "fp8xfp4_sm90" else ab
        dtypes = (ab, Float32, b, Float32, Int32, Float32, ab if phase == "l1" else BFloat16,
                  Float32, Int64, Int32, Int32)
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
    if arch == "sm_90a" and recipe == "fp8xfp4_sm90":  # (an A/B option of the decode)
        extra["decode_tables"] = sm90_fp4_tables()
        extra["early_tables"] = sm90_fp4_early_tables()
    if pool_block_m not in (None, block_m) and (
            arch != "sm_90a" or pool_block_m != 2 * block_m or block_m != 128
            or recipe not in ("fp8xfp4_sm90", "fp8xfp8")):
        # (where the GPU tests ran it: the MXFP4 layer's clusters that share the decode, the
        # fp8xfp8 layer's multicast clusters)
        raise ValueError(f"pool_block_m: BLOCK_M, or 256 with BLOCK_M 128 for fp8xfp4_sm90 or "
                         f"fp8xfp8 on sm_90a; got {pool_block_m} at BLOCK_M {block_m}, {recipe} "
                         f"on {arch}")
    # (a pool in blocks of two tiles: the staged kernels, whose walk skips the empty tiles)
    if pool_block_m in (None, block_m) and sm90_runs_transposed(arch, recipe, block_m,
                                                                expected_tokens_per_expert):
        from .kernels.sm90_expert_gemm_transposed import Sm90TransposedExpertGemmKernel

        kernel = Sm90TransposedExpertGemmKernel(phase, recipe, num_experts, num_pool_rows, n, k,
                                                block_m, activation_clamp=clamp,
                                                fast_math=fast_math,
                                                tiled_weights=tiled_weights,
                                                a_rows=sm90_transposed_a_rows(), **extra)
        return kernel, dtypes
    if arch == "sm_90a":  # (FP4 weights: clusters only as the shared-decode A/B option)
        extra["cluster_m"] = select_cluster_m(arch, phase, block_m, n)
        if recipe == "fp8xfp4_sm90" and not sm90_shares_decode(block_m,
                                                               expected_tokens_per_expert):
            extra["cluster_m"] = 1
        if recipe != "bf16xbf16":
            extra["promotion"] = sm90_promotion()
            extra["k_unroll"] = sm90_k_unroll()
        if recipe == "fp8xfp8" and combine_layout is None:
            extra["tma_store"] = sm90_tma_store()
        if combine_layout is not None:
            extra["row_stores"] = sm90_row_stores()
        extra["owner_search"] = tile_owner_search()
        if tiled_weights:
            extra["tiled_weights"] = True
        if pool_block_m not in (None, block_m):
            if extra["cluster_m"] != 2:
                raise ValueError("pool_block_m 256: with the 2-CTA clusters that share the "
                                 "decode only (CUTE_MEGAMOE_SM90_FP4_CLUSTER forced off, or too "
                                 "few expected tokens per expert)")
            extra["pool_block_m"] = pool_block_m
    elif tiled_weights:
        raise ValueError(f"tiled_weights: sm_90a only, not {arch}")
    kernel = Kernel(phase, recipe, num_experts, num_pool_rows, n, k, block_m,
                    activation_clamp=clamp, fast_math=fast_math, **extra)
    return kernel, dtypes


def expert_gemm_calls(arch: str, recipe: str, block_m: int, grid: int, weights,
                      acts: torch.Tensor, acts_sf: torch.Tensor | None,
                      topk_weights: torch.Tensor, expert_recv_tokens: torch.Tensor,
                      l2_acts: torch.Tensor, l2_acts_sf: torch.Tensor | None,
                      out: torch.Tensor | None, activation_clamp: float | None,
                      fast_math: bool, combine_buffer: SymmBuffer | None,
                      expected_tokens_per_expert: float | None = None,
                      pool_block_m: int | None = None) -> list[KernelCall]:
    """The L1 (+ SwiGLU + requant into ``l2_acts``) and L2 launches of the expert FFN over a
    pool (`expert_gemm.expert_ffn` checks their inputs). ``combine_buffer``: L2 writes every
    row into its source rank's combine buffer (``out`` unused). ``expected_tokens_per_expert``:
    the call's (the sm_90a mainloop, `sm90_runs_transposed`); None: not known.
    ``pool_block_m``: the pool's block (`gemm_kernel`); None: BLOCK_M."""
    pool_block_m = block_m if pool_block_m is None else pool_block_m
    e_l, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    pool_rows = acts.shape[0]
    combine_layout = None if combine_buffer is None else combine_buffer.layout
    path = launch_path()
    transposed = pool_block_m == block_m and sm90_runs_transposed(
        arch, recipe, block_m, expected_tokens_per_expert)
    calls = []
    for phase in ("l1", "l2"):
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
        key = ("expert_gemm", arch, phase, recipe, e_l, pool_rows, n, k, block_m,
               activation_clamp if phase == "l1" else None, bool(fast_math),
               combine_layout if to_combine else None,
               (sm90_promotion(),
                transposed, sm90_transposed_a_rows() if transposed else None,
                tile_owner_search(),
                (sm90_fp4_tables(), sm90_fp4_early_tables(),
                 sm90_shares_decode(block_m, expected_tokens_per_expert)) if fp4
                else None, sm90_k_unroll(),
                sm90_tma_store() if not to_combine else sm90_row_stores())
               if arch == "sm_90a" else None, weights.tiled, pool_block_m)
        plan = {}

        def build(phase=phase, n=n, k=k, plan=plan, to_combine=to_combine):
            plan["kernel"], plan["dtypes"] = gemm_kernel(
                arch, recipe, phase, e_l, pool_rows, n, k, block_m, activation_clamp, fast_math,
                combine_layout=combine_layout if to_combine else None,
                tiled_weights=weights.tiled, expected_tokens_per_expert=expected_tokens_per_expert,
                pool_block_m=pool_block_m)
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

def fused_call(sym_buffer: SymmBuffer, weights, num_tokens: int, block_m: int,
               y: torch.Tensor | None, num_ctas: int, stats: torch.Tensor | None,
               activation_clamp: float | None, fast_math: bool,
               phase_clock: torch.Tensor | None = None,
               tile_log: torch.Tensor | None = None, l2_gate: str = "pool_block",
               extra_warpgroups: int = 0, row_transfer: str | None = None,
               weights_first: bool | None = None,
               inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               cluster_m: int = 1, hold_cta: int | None = None,
               late_consumers_ns: int = 0) -> KernelCall:
    """`kernels/sm90_mega_moe.py` (sm_100a: `kernels/sm100_mega_moe.py`, compiled only, not
    wired into the entry points yet): the whole layer for ``num_tokens`` staged rows into ``y``
    (collective). ``num_ctas`` is rounded down to whole clusters. ``phase_clock`` (int64
    ``[num_ctas, len(PHASE_STAMPS)]``, a diagnostic): a kernel that writes each CTA's phase
    boundaries there (`bench/fused_phases.py`). ``tile_log`` (int32 ``[tiles per CTA, num_ctas,
    4]``, a diagnostic): a kernel that records every CTA's tiles there
    (`testing.fused_checks.check_tile_walk`). ``l2_gate``: "all_l1" builds the variant whose
    L2 tiles wait for every L1 tile (an A/B against the per-pool-block gate);
    ``extra_warpgroups`` 1 the variant with a warpgroup more for the dispatch and combine
    phases (BLOCK_M 64); ``row_transfer`` how the rows move (`sm90_mega_moe.ROW_TRANSFERS`;
    None: `runtime.fused_rows`, else the kernel's default; every rank of the call must use one
    of the same row protocol); ``weights_first`` (None: ``CUTE_MEGAMOE_FUSED_WEIGHTS_FIRST``,
    else the kernel's default, on with counted rows): tiles that find their pool block not
    ready load their first stages' weights before they wait (with counted rows, the first L1
    tile's right after the counts). ``inputs`` (sm_90a): the caller's ``(x, topk_idx,
    topk_weights)``, which the kernel stages into the buffer itself (`sm90_mega_moe`'s
    ``stages_inputs``) instead of a staging launch before it. ``cluster_m`` 2 (sm_90a, BLOCK_M
    128, FP8 or BF16 weights; tests only): 2-CTA clusters multicasting the weight tile,
    bit-identical but 1.20x the fused layer's time at 4096 / 8192 tokens on an H200
    (docs/performance.md). ``hold_cta`` (sm_90a, tests only): that CTA waits before its
    combine until the others' stall report (an injected stall); ``late_consumers_ns`` (sm_90a,
    tests only): the GEMM consumers of odd CTAs start their role that late."""
    tiled = bool(getattr(weights, "tiled", False))
    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    has_stats = stats is not None
    clocked, logged = phase_clock is not None, tile_log is not None
    promotion = sm90_promotion() if state.arch == "sm_90a" and layout.has_sf else None
    k_unroll = sm90_k_unroll() if state.arch == "sm_90a" and layout.has_sf else None
    row_stores = sm90_row_stores() if state.arch == "sm_90a" else None
    if row_transfer is None and state.arch == "sm_90a":
        row_transfer = fused_rows()
    if weights_first is None and state.arch == "sm_90a":
        weights_first = fused_weights_first()
    stages = inputs is not None
    search = tile_owner_search() if state.arch == "sm_90a" else "linear"
    local = fused_local_dispatch() if state.arch == "sm_90a" else None
    if local:  # (forced on: only where the kernel can run it)
        from .kernels.sm90_mega_moe import default_row_transfer

        rows = row_transfer or default_row_transfer(layout)
        if not (stages and layout.num_ranks == 1 and rows == "counted"
                and layout.recipe != "fp8xfp4_sm90"):
            local = None
    key = ("mega_moe", state.arch, layout, block_m, activation_clamp, bool(fast_math),
           has_stats, clocked, logged, l2_gate, extra_warpgroups, promotion, k_unroll, row_transfer,
           weights_first, tiled, stages, local, search, row_stores, cluster_m, hold_cta,
           late_consumers_ns)

    def make_kernel():
        if state.arch == "sm_100a":
            from .kernels.sm100_mega_moe import Sm100MegaMoEKernel

            if (clocked or logged or l2_gate != "pool_block" or extra_warpgroups
                    or row_transfer is not None or weights_first is not None or tiled
                    or stages or hold_cta is not None or late_consumers_ns):
                raise ValueError("fused_call: the phase clock, tile log, L2 gate, extra "
                                 "warpgroups, row transfer, tiled weights and in-kernel "
                                 "staging are sm_90a only")
            return Sm100MegaMoEKernel(layout, block_m, activation_clamp=activation_clamp,
                                      fast_math=fast_math, has_stats=has_stats)
        from .kernels.sm90_mega_moe import Sm90MegaMoEKernel

        return Sm90MegaMoEKernel(layout, block_m, activation_clamp=activation_clamp,
                                 fast_math=fast_math, has_stats=has_stats, phase_clock=clocked,
                                 tile_log=logged, l2_gate=l2_gate,
                                 extra_warpgroups=extra_warpgroups, promotion=promotion,
                                 row_transfer=row_transfer, weights_first=weights_first,
                                 tiled_weights=tiled, stages_inputs=stages,
                                 local_dispatch=local, owner_search=search,
                                 k_unroll=k_unroll, row_stores=row_stores,
                                 cluster_m=cluster_m, hold_cta=hold_cta,
                                 late_consumers_ns=late_consumers_ns)

    kernel = compiled_kernel(key + ("kernel",), make_kernel)
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
        "phase_clock": phase_clock if clocked else sym_buffer.peer_bases,  # (unused)
        "tile_log": tile_log if logged else state.recv_tokens,  # (unused)
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
    # whole clusters (with `cluster_m` 2); at most one CTA per SM: the cooperative grid is
    # co-resident
    num_ctas = max(kernel.cluster_m, num_ctas - num_ctas % kernel.cluster_m)
    specs = (ptrs[0], sym_buffer.rank, num_tokens, *ptrs[1:], num_ctas, STREAM)
    return _kernel_call(key, lambda: kernel, specs, state.arch)
