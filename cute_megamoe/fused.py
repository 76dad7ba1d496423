"""The fused layer: one persistent kernel per rank for dispatch, both grouped GEMMs and combine.

    y = fused.fused_mega_moe(buf, x, topk_idx, topk_weights, weights)   # collective

One launch per call on sm_90a: the fused kernel quantizes the caller's activations itself
(`runtime.fused_staging`; the FP4 experiment and sm_100a launch the input staging,
`kernels/staging.py`, first; with ``x=None`` the caller filled the buffer, as DeepGEMM's users
do). The fused kernel of the GPU's arch (`launch.fused_call`): `kernels/sm90_mega_moe.py`
(fp8xfp8, bf16xbf16; GPU-tested, bit-identical to `staged.staged_mega_moe(...,
l2_sends=True)` on the same inputs) or
`kernels/sm100_mega_moe.py` (fp8xfp4, bf16xbf16; compiled and SASS-checked, never run: no
Blackwell GPU here). The push transfer; `supports` says whether a buffer and weights can run
it. The entry points (`MegaMoE`, `api.mega_moe` / `fp8_mega_moe`, DeepGEMM's
`fp8_fp4_mega_moe` / `bf16_mega_moe`) run it by default where it ran on the GPU as the group
runs (`choose`: sm_90a, fp8xfp8 / bf16xbf16, one rank); ``fused=False`` keeps the staged kernels.
"""

from __future__ import annotations

import torch

from .buffer import SymmBuffer
from .checks import (
    check_activation_clamp,
    check_cuda_buffer,
    check_fast_math,
    check_gemm_block_m,
    check_routing,
    check_sym_buffer,
    check_tensor,
    routing_checks_on,
)
from .expert_gemm import ExpertWeights
from .heuristics import block_m_for_call
from .launch import (
    FUSED_INPUT_SLOTS,
    FUSED_SLOTS,
    STAGING_SLOTS,
    KernelCall,
    buffer_state,
    existing_buffer_state,
    fused_call,
)
from .runtime import env_choice, env_flag, fused_staging, kernel_variant_env, launch_path
from .staged import (
    _MAX_PLANS,
    _LayerPlan,
    _weight_addresses,
    gives_up_call_on_error,
    grid_size,
    prepare_layer_call,
)
from .tables import EXPERIMENTAL_FUSED_RECIPES, FUSED_RECIPES

__all__ = ["choose", "fused_mega_moe", "stages_inputs", "supports"]

# sm_90a runs its L1 and L2 tiles through one ring of 256-column tiles
_SM90_TILE_N = 256


def supports(sym_buffer: SymmBuffer, weights: object) -> str | None:
    """None when the fused kernel can run this buffer and these weights on the current GPU,
    else why not (for the entry points' errors). sm_90a: fp8xfp8 and bf16xbf16 (GPU-tested at
    R = 1 and on loopback groups; groups of several GPUs and fp8xfp4_sm90 only with
    ``CUTE_MEGAMOE_EXPERIMENTAL_FUSED=1``, `tables.EXPERIMENTAL_FUSED_RECIPES`);
    sm_100a: fp8xfp4 and bf16xbf16 (compiled and SASS-checked, never run)
    (`tables.FUSED_RECIPES`)."""
    layout = sym_buffer.layout
    if not isinstance(weights, ExpertWeights):
        return "the fused kernel runs our grouped-GEMM weights (ExpertWeights)"
    if (layout.num_ranks > 1 and sym_buffer.group is not None
            and not env_flag("CUTE_MEGAMOE_EXPERIMENTAL_FUSED")):
        # (one process per GPU; a loopback group, every rank's buffer in one process, has no
        # process group and runs it)
        return ("the fused kernel runs groups of several GPUs only as an experiment "
                "(CUTE_MEGAMOE_EXPERIMENTAL_FUSED=1): its one-rank-per-GPU test has not passed "
                "on two GPUs yet (it failed on 2026-12-04 by the test's CPU reference, since "
                "fixed; one-rank and loopback groups pass)")
    arch = buffer_state(sym_buffer).arch
    if layout.recipe not in FUSED_RECIPES[arch]:
        return f"the {arch} fused kernel runs {FUSED_RECIPES[arch]}, not {layout.recipe!r}"
    if (layout.recipe in EXPERIMENTAL_FUSED_RECIPES[arch]
            and not env_flag("CUTE_MEGAMOE_EXPERIMENTAL_FUSED")):
        return (f"the {arch} fused kernel runs {layout.recipe!r} only as an experiment "
                f"(CUTE_MEGAMOE_EXPERIMENTAL_FUSED=1): slower than the staged layer, and one-rank "
                f"stalls seen on the H200 are not explained")
    if weights.arch != arch:
        return f"the weights are prepared for {weights.arch}, this GPU is {arch}"
    if arch == "sm_90a" and (layout.hidden % _SM90_TILE_N
                             or (2 * layout.intermediate_hidden) % _SM90_TILE_N):
        return (f"the sm_90a fused kernel needs hidden ({layout.hidden}) and 2 * intermediate "
                f"({2 * layout.intermediate_hidden}) to be multiples of {_SM90_TILE_N}")
    return None


#: ``CUTE_MEGAMOE_FUSED``: what ``fused=None`` (the entry points' default) picks. "auto": the
#: fused kernel for one-rank groups on sm_90a (fp8xfp8, bf16xbf16: GPU-tested, bit-identical
#: to the staged kernels and as fast or faster at 1-8192 tokens, docs/performance.md), the
#: staged kernels for larger groups (across GPUs the fused kernel's test has not passed yet:
#: `supports` refuses it there without ``CUTE_MEGAMOE_EXPERIMENTAL_FUSED=1``) and
#: on sm_100a (compiled, never run); "1": the fused kernel wherever `supports` allows it;
#: "0": the staged kernels. Every
#: rank of a group should see the same value: a staged rank and a fused rank that counts its
#: rows (buffers of at most 1024 tokens per rank) run different row protocols, and trap.
FUSED_DEFAULTS = ("auto", "1", "0")


def choose(fused: bool | None, sym_buffer: SymmBuffer, weights: object,
           transfer: str = "push", l2_sends: bool = True) -> bool:
    """Whether an entry point runs the fused kernel. ``fused`` True: it must (raises
    `ValueError` naming why it cannot: push, L2 sends, `supports`); False: the staged kernels;
    None: `FUSED_DEFAULTS` (``CUTE_MEGAMOE_FUSED``), quietly staged where the fused kernel
    cannot run these arguments."""
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused: expected None or a bool, got {type(fused).__name__}")
    pushes = transfer == "push" and l2_sends is True
    if fused:
        if not pushes:
            raise ValueError("fused: the fused kernel pushes the rows and sends them back from "
                             "the L2 epilogue (transfer='push', l2_sends=True)")
        reason = supports(sym_buffer, weights)
        if reason is not None:
            raise ValueError(f"fused: {reason}")
        return True
    if fused is False or not pushes:
        return False
    mode = env_choice("CUTE_MEGAMOE_FUSED", FUSED_DEFAULTS)
    if mode == "0" or not isinstance(weights, ExpertWeights):
        return False
    if mode == "auto":
        layout = sym_buffer.layout
        if (layout.num_ranks != 1 or weights.arch != "sm_90a"
                or layout.recipe in EXPERIMENTAL_FUSED_RECIPES["sm_90a"]):
            return False
    return supports(sym_buffer, weights) is None


def stages_inputs(recipe: str, arch: str) -> bool:
    """Whether the fused kernel quantizes the caller's ``x`` itself (`runtime.fused_staging`;
    "auto": on sm_90a but for the FP4 experiment) rather than after a staging launch."""
    staging = fused_staging()
    if staging == "auto":
        staging = "launch" if recipe == "fp8xfp4_sm90" else "kernel"
    return arch == "sm_90a" and staging == "kernel"


def fused_mega_moe(sym_buffer: SymmBuffer, x: torch.Tensor | None,
                   topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                   weights: ExpertWeights, *, num_tokens: int | None = None,
                   y: torch.Tensor | None = None, activation_clamp: float | None = None,
                   fast_math: bool = True, block_m: int | None = None,
                   num_sms: int | None = None,
                   cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                   validate_routing: bool | None = None,
                   row_transfer: str | None = None) -> torch.Tensor:
    """One whole layer in one persistent kernel (see the module doc). Collective: every
    rank of the buffer's group calls it once per call, also with 0 tokens. Arguments as
    `staged.staged_mega_moe` (``x=None``: ``num_tokens`` rows were staged into the buffer
    already); ``block_m`` 64 or 128 (default: the heuristics; ranks may differ).
    ``row_transfer`` (sm_90a, for A/Bs): how the rows move, `sm90_mega_moe.ROW_TRANSFERS`
    (None: ``CUTE_MEGAMOE_FUSED_ROWS``, else the kernel's default); "barrier" and the counted
    ones are different row protocols that ranks must not mix (a mismatch traps). Every check
    runs before the first launch; one that fails gives the call up on this rank
    (`staged.gives_up_call_on_error`). No host synchronization with
    ``validate_routing=False``: CUDA-graph capturable."""
    key = _plan_key(sym_buffer, x, weights, num_tokens, y, activation_clamp, fast_math,
                    block_m, num_sms, cumulative_local_expert_recv_stats)
    if key is not None:
        key += (row_transfer,)
    state = existing_buffer_state(sym_buffer) if key is not None else None
    plan = None if state is None else state.plans.get(key)
    n = None
    if plan is not None:  # (a key exists: x is a 2-D tensor or num_tokens an int)
        n = x.shape[0] if x is not None else num_tokens
    if plan is not None and plan.accepts(x, topk_idx, topk_weights, weights, n, y,
                                         cumulative_local_expert_recv_stats):
        return plan.launch(sym_buffer, x, topk_idx, topk_weights, n, y,
                           cumulative_local_expert_recv_stats, validate_routing)
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
        arch = buffer_state(sym_buffer).arch
        in_kernel = x is not None and stages_inputs(layout.recipe, arch)
        launches, n, block_m = prepare_layer_call(
            sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m,
            cumulative_local_expert_recv_stats, validate_routing, stage=not in_kernel)
        check_gemm_block_m(block_m, arch)
        grid = grid_size(sym_buffer, num_sms)
        stats = cumulative_local_expert_recv_stats
        if y is None:
            y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device=device)
        check_tensor("y", y, torch.bfloat16, (n, layout.hidden), device)
        launches.append(fused_call(sym_buffer, weights, n, block_m, y, grid, stats,
                                   activation_clamp, fast_math, row_transfer=row_transfer,
                                   inputs=(x, topk_idx, topk_weights) if in_kernel else None))
    if key is not None and n > 0:
        plans = buffer_state(sym_buffer).plans
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[key] = _FusedPlan(sym_buffer, weights, x is not None, launches, in_kernel)
    for launch in launches:
        launch()
    return y


class _FusedPlan(_LayerPlan):
    """The launches of one fused-layer configuration on one buffer (the staging when ``x`` is
    given and the kernel does not stage it itself, then the fused kernel), kept from the call
    that made them; checks as `staged._LayerPlan`."""

    def __init__(self, sym_buffer: SymmBuffer, weights: ExpertWeights, staged: bool,
                 launches: list[KernelCall], stages_in_kernel: bool = False):
        fused = launches[-1]
        self.keep_checks(sym_buffer, weights, fused.path)
        self.staged = staged
        self.inputs_in_kernel = stages_in_kernel
        self.staging = launches[0].prepare(STAGING_SLOTS) if staged and not stages_in_kernel \
            else None
        self.fused = fused.prepare(FUSED_SLOTS + (FUSED_INPUT_SLOTS if stages_in_kernel
                                                  else ()))
        self.no_stats = fused.args[FUSED_SLOTS[1]]  # the counts stand in

    def launch(self, sym_buffer: SymmBuffer, x, topk_idx, topk_weights, n: int,
               y: torch.Tensor | None, stats: torch.Tensor | None,
               validate_routing: bool | None) -> torch.Tensor:
        if self.staged and routing_checks_on(validate_routing):
            with gives_up_call_on_error(sym_buffer):
                check_routing(topk_idx, self.num_experts)
        path = self.path
        ptr = path.ptr
        if y is None:
            y = torch.empty(n, self.hidden, dtype=torch.bfloat16, device=self.device)
        stream = path.stream()
        count = path.int32(n)
        if self.staging is not None:
            self.staging(ptr(x), ptr(topk_idx), ptr(topk_weights), count, stream)
        inputs = (ptr(x), ptr(topk_idx), ptr(topk_weights)) if self.inputs_in_kernel else ()
        self.fused(count, self.no_stats if stats is None else ptr(stats, 4), ptr(y), stream,
                   *inputs)
        return y


def _plan_key(sym_buffer, x, weights, num_tokens, y, activation_clamp, fast_math, block_m,
              num_sms, stats) -> tuple | None:
    """The configuration of a call (None where a call is too odd to have one: then the full
    checks run and name what is wrong)."""
    try:
        if not isinstance(weights, ExpertWeights) or sym_buffer.buffer is None:
            return None
        if x is not None:
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                return None
            n = x.shape[0]
        elif type(num_tokens) is int:
            n = num_tokens
        else:
            return None
        layout = sym_buffer.layout
        return ("fused", x is not None, y is not None, stats is not None, weights.recipe,
                weights.arch, *_weight_addresses(weights), type(activation_clamp),
                activation_clamp, type(fast_math), fast_math, type(block_m), block_m,
                type(num_sms), num_sms,
                block_m_for_call(n, layout.num_ranks, layout.num_topk, layout.num_experts,
                                 weights.arch) if block_m is None and n >= 0 else None,
                *kernel_variant_env(), launch_path().name)
    except (TypeError, AttributeError, ValueError, KeyError):
        return None


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
