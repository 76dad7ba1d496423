"""The fused layer: one persistent kernel per rank for dispatch, both grouped GEMMs and combine.

    y = fused.fused_mega_moe(buf, x, topk_idx, topk_weights, weights)   # collective

One launch per call on sm_90a: the fused kernel quantizes the caller's activations itself
(`config.Sm90FusedConfig.stages_inputs`; the FP4 experiment and sm_100a launch the input staging,
`kernels/staging.py`, first; with ``x=None`` the caller filled the buffer, as DeepGEMM's users do).
The fused kernel of the GPU's arch (`launch.fused_call`): `kernels/sm90_mega_moe.py` (fp8xfp8,
bf16xbf16; GPU-tested, bit-identical to `staged.staged_mega_moe(..., l2_sends=True)` on the same
inputs) or `kernels/sm100_mega_moe.py` (fp8xfp4, bf16xbf16; compiled and SASS-checked, never run: no
Blackwell GPU here). The push transfer; `supports` says whether a buffer and weights can run it. The
entry points (`MegaMoE`, `api.mega_moe` / `fp8_mega_moe`, DeepGEMM's `fp8_fp4_mega_moe` /
`bf16_mega_moe`) run it by default where it ran on the GPU as the group runs (`choose`: sm_90a,
fp8xfp8 / bf16xbf16, one rank); ``fused=False`` keeps the staged kernels.
"""

from __future__ import annotations

import functools

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
    routing_check,
)
from .config import LayerConfig, Sm90FusedConfig, Sm100GemmConfig
from .expert_gemm import ExpertWeights
from .heuristics import FUSED_AUTO_MAX_TOKENS, block_m_for_call, default_fused_config
from .launch import (
    FUSED_INPUT_SLOTS,
    FUSED_SLOTS,
    STAGING_SLOTS,
    KernelCall,
    buffer_state,
    existing_buffer_state,
    fused_call,
    staging_call,
)
from .runtime import env_choice, launch_path, spin_timeout_ns
from .staged import (
    _MAX_PLANS,
    _LayerPlan,
    _weight_addresses,
    configured_block_m,
    gives_up_call_on_error,
    grid_size,
    layer_config,
    prepare_layer_call,
    raise_routing_errors,
)
from .tables import EXPERIMENTAL_FUSED_RECIPES, FUSED_RECIPES

__all__ = ["choose", "fused_mega_moe", "fused_max_tokens", "supports"]

# sm_90a runs its L1 and L2 tiles through one ring of 256-column tiles
_SM90_TILE_N = 256


def supports(sym_buffer: SymmBuffer, weights: object,
             config: LayerConfig | None = None) -> str | None:
    """None when the fused kernel can run this buffer and these weights on the current GPU,
    else why not (for the entry points' errors). sm_90a: fp8xfp8 and bf16xbf16 (GPU-tested at
    R = 1 and on loopback groups; groups of several GPUs and fp8xfp4_sm90 only as experiments,
    `config.LayerConfig.experimental_fused_multi_gpu` / ``experimental_fused_fp4``,
    `tables.EXPERIMENTAL_FUSED_RECIPES`); sm_100a: fp8xfp4 and bf16xbf16 (compiled and
    SASS-checked, never run) (`tables.FUSED_RECIPES`)."""
    config = layer_config(config)
    layout = sym_buffer.layout
    if not isinstance(weights, ExpertWeights):
        return "the fused kernel runs our grouped-GEMM weights (ExpertWeights)"
    if (layout.num_ranks > 1 and sym_buffer.group is not None
            and not config.experimental_fused_multi_gpu):
        # (one process per GPU; a loopback group, every rank's buffer in one process, has no
        # process group and runs it)
        return ("the fused kernel runs groups of several GPUs only as an experiment "
                "(LayerConfig(experimental_fused_multi_gpu=True)): its one-rank-per-GPU test has "
                "not passed on two GPUs yet (it failed on 2026-12-04 by the test's CPU "
                "reference, since fixed; one-rank and loopback groups pass)")
    arch = buffer_state(sym_buffer).arch
    if layout.recipe not in FUSED_RECIPES[arch]:
        return f"the {arch} fused kernel runs {FUSED_RECIPES[arch]}, not {layout.recipe!r}"
    if (layout.recipe in EXPERIMENTAL_FUSED_RECIPES[arch]
            and not config.experimental_fused_fp4):
        return (f"the {arch} fused kernel runs {layout.recipe!r} only as an experiment "
                f"(LayerConfig(experimental_fused_fp4=True)): slower than the staged layer, and "
                f"one-rank stalls seen on the H200 are not explained")
    if weights.arch != arch:
        return f"the weights are prepared for {weights.arch}, this GPU is {arch}"
    if arch != "sm_90a" and layout.num_l1_output_rows < layout.num_pool_rows:
        return (f"the {arch} fused kernel keeps an L1-output row per pool row; this buffer "
                f"holds a ring (l1_output_rows {layout.l1_output_rows})")
    if arch != "sm_90a" and layout.num_received_rows < layout.num_pool_rows:
        return (f"the {arch} fused kernel keeps a received row per pool row; this buffer "
                f"holds a ring (received_rows {layout.received_rows})")
    if arch == "sm_90a" and (layout.hidden % _SM90_TILE_N
                             or (2 * layout.intermediate_hidden) % _SM90_TILE_N):
        return (f"the sm_90a fused kernel needs hidden ({layout.hidden}) and 2 * intermediate "
                f"({2 * layout.intermediate_hidden}) to be multiples of {_SM90_TILE_N}")
    return None


#: ``CUTE_MEGAMOE_FUSED``: what ``fused=None`` (the entry points' default) picks. "auto": the
#: fused kernel for calls of at most `heuristics.FUSED_AUTO_MAX_TOKENS` tokens of one-rank
#: groups on sm_90a (fp8xfp8, bf16xbf16: GPU-tested, bit-identical to the staged kernels,
#: faster at small calls, slower at large ones), else the staged kernels: for larger calls, for
#: larger groups (across GPUs the fused kernel's test has not passed yet: `supports` refuses
#: it there unless the configuration asks for the experiment) and on sm_100a (compiled, never
#: run); "1": the fused kernel for every call wherever `supports` allows it; "0": the staged
#: kernels. Every rank of a group should see the same value: a staged rank and a fused rank
#: that counts its rows (buffers of at most 1024 tokens per rank) run different row
#: protocols, and trap.
FUSED_DEFAULTS = ("auto", "1", "0")


def fused_max_tokens(fused: bool | None, sym_buffer: SymmBuffer, weights: object,
                     transfer: str = "push", l2_sends: bool = True,
                     config: LayerConfig | None = None) -> int | None:
    """The most tokens per rank for which a call runs the fused kernel, the larger calls
    running the staged kernels; None: every call runs the staged kernels. ``fused`` (else
    ``config.fused``) True: every call (the buffer's limit; raises `ValueError` naming why it
    cannot: push, L2 sends, `supports`); False: None; None: `FUSED_DEFAULTS`
    (``CUTE_MEGAMOE_FUSED``), quietly staged where the fused kernel cannot run these
    arguments."""
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused: expected None or a bool, got {type(fused).__name__}")
    config = layer_config(config)
    if fused is None:
        fused = config.fused
    elif config.fused is not None and config.fused != fused:
        raise ValueError(f"fused: {fused}, but config.fused is {config.fused}")
    layout = sym_buffer.layout
    every_call = layout.num_max_tokens_per_rank
    pushes = transfer == "push" and l2_sends is True
    if fused:
        if not pushes:
            raise ValueError("fused: the fused kernel pushes the rows and sends them back from "
                             "the L2 epilogue (transfer='push', l2_sends=True)")
        reason = supports(sym_buffer, weights, config)
        if reason is not None:
            raise ValueError(f"fused: {reason}")
        return every_call
    if fused is False or not pushes:
        return None
    mode = env_choice("CUTE_MEGAMOE_FUSED", FUSED_DEFAULTS)
    if mode == "0" or not isinstance(weights, ExpertWeights):
        return None
    limit = every_call
    if mode == "auto":
        if (layout.num_ranks != 1 or weights.arch != "sm_90a"
                or layout.recipe in EXPERIMENTAL_FUSED_RECIPES["sm_90a"]):
            return None
        limit = min(FUSED_AUTO_MAX_TOKENS, every_call)
    return limit if supports(sym_buffer, weights, config) is None else None


def choose(fused: bool | None, sym_buffer: SymmBuffer, weights: object,
           transfer: str = "push", l2_sends: bool = True,
           config: LayerConfig | None = None, num_tokens: int | None = None) -> bool:
    """Whether a call of ``num_tokens`` tokens on this rank runs the fused kernel (None:
    whether some call does), by `fused_max_tokens` (its arguments, checks and errors)."""
    limit = fused_max_tokens(fused, sym_buffer, weights, transfer, l2_sends, config)
    return limit is not None and (num_tokens is None or num_tokens <= limit)


def fused_mega_moe(sym_buffer: SymmBuffer, x: torch.Tensor | None,
                   topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                   weights: ExpertWeights, *, num_tokens: int | None = None,
                   y: torch.Tensor | None = None, activation_clamp: float | None = None,
                   fast_math: bool = True, block_m: int | None = None,
                   num_sms: int | None = None,
                   cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                   validate_routing: bool | None = None,
                   config: LayerConfig | None = None) -> torch.Tensor:
    """One whole layer in one persistent kernel (see the module doc). Collective: every
    rank of the buffer's group calls it once per call, also with 0 tokens. Arguments as
    `staged.staged_mega_moe` (``x=None``: ``num_tokens`` rows were staged into the buffer
    already); ``block_m`` 64 or 128 (default: ``config.fused_kernel.block_m``, else the
    heuristics; ranks may differ). ``config``: its experimental flags and ``fused_kernel``
    (sm_90a, `config.Sm90FusedConfig`; None fields: `heuristics.default_fused_config`); its
    row transfer, "barrier" or "counted", must be the same on every rank (a mismatch traps).
    Every check runs before the first launch; one that fails gives the call up on this rank
    (`staged.gives_up_call_on_error`). No host synchronization unless ``validate_routing``
    is "host" (`checks.routing_check`): CUDA-graph capturable."""
    key = _plan_key(sym_buffer, x, weights, num_tokens, y, activation_clamp, fast_math,
                    block_m, num_sms, cumulative_local_expert_recv_stats, config)
    state = existing_buffer_state(sym_buffer) if key is not None else None
    plan = None if state is None else state.plans.get(key)
    n = None
    if plan is not None:  # (a key exists: x is a 2-D tensor or num_tokens an int)
        n = x.shape[0] if x is not None else num_tokens
    if plan is not None and plan.accepts(x, topk_idx, topk_weights, weights, n, y,
                                         cumulative_local_expert_recv_stats):
        y = plan.launch(sym_buffer, x, topk_idx, topk_weights, n, y,
                        cumulative_local_expert_recv_stats, validate_routing)
        raise_routing_errors(sym_buffer, validate_routing)
        return y
    check_sym_buffer(sym_buffer)
    with gives_up_call_on_error(sym_buffer):
        config = layer_config(config)
        layout = sym_buffer.layout
        device = check_cuda_buffer(sym_buffer)
        reason = supports(sym_buffer, weights, config)
        if reason is not None:
            raise ValueError(f"fused_mega_moe: {reason}")
        _check_weights_fit(sym_buffer, weights)
        activation_clamp = check_activation_clamp(activation_clamp)
        check_fast_math(fast_math)
        arch = buffer_state(sym_buffer).arch
        block_m = configured_block_m(block_m, config.fused_kernel.block_m,
                                     "config.fused_kernel.block_m")
        # (sm_90a: the kernel may stage x itself, `Sm90FusedConfig.stages_inputs`: the
        # inputs' checks here, the staging launch below where it does not)
        launches, n, block_m = prepare_layer_call(
            sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m,
            cumulative_local_expert_recv_stats, validate_routing, stage=arch != "sm_90a")
        check_gemm_block_m(block_m, arch)
        kernel_config = fused_kernel_config(arch, layout, block_m, x is not None,
                                            config.fused_kernel)
        in_kernel = bool(getattr(kernel_config, "stages_inputs", False))
        if x is not None and arch == "sm_90a" and not in_kernel and n > 0:
            launches.append(staging_call(sym_buffer, x, topk_idx, topk_weights))
        grid = grid_size(sym_buffer, num_sms)
        stats = cumulative_local_expert_recv_stats
        if y is None:
            y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device=device)
        check_tensor("y", y, torch.bfloat16, (n, layout.hidden), device)
        launches.append(fused_call(sym_buffer, weights, n, y, grid, stats, activation_clamp,
                                   fast_math, kernel_config,
                                   inputs=(x, topk_idx, topk_weights) if in_kernel else None))
    if key is not None and n > 0:
        plans = buffer_state(sym_buffer).plans
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[key] = _FusedPlan(sym_buffer, weights, x is not None, launches, in_kernel)
    for launch in launches:
        launch()
    raise_routing_errors(sym_buffer, validate_routing)
    return y


@functools.lru_cache(maxsize=4096)
def fused_kernel_config(arch: str, layout, block_m: int, given_x: bool,
                        config: Sm90FusedConfig) -> Sm90FusedConfig | Sm100GemmConfig:
    """The fused kernel's complete configuration on ``arch`` for the buffer ``layout`` at
    ``block_m``, for calls that give ``x`` or not (sm_90a: `heuristics.default_fused_config`;
    sm_100a: its GEMMs' `Sm100GemmConfig`, whose only setting is BLOCK_M: ``config`` leaves
    every other field None). Remembered: a layer call's plan lookup asks for it every call."""
    if arch == "sm_90a":
        return default_fused_config(layout, block_m, given_x, config)
    if config != Sm90FusedConfig(block_m=config.block_m):
        raise ValueError(f"config.fused_kernel: sm_90a options ({config}); the {arch} fused "
                         f"kernel takes none")
    return Sm100GemmConfig(block_m)


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
        with gives_up_call_on_error(sym_buffer):
            if routing_check(validate_routing) == "host" and self.staged:
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
              num_sms, stats, config) -> tuple | None:
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
        config = layer_config(config)
        block_m = configured_block_m(block_m, config.fused_kernel.block_m,
                                     "config.fused_kernel.block_m")
        if type(block_m) not in (int, type(None)) or n < 0:
            return None
        if block_m is None:  # (a plan exists only where the weights' arch is the GPU's)
            block_m = block_m_for_call(n, layout.num_ranks, layout.num_topk,
                                       layout.num_experts, weights.arch)
        # (the kernel's configuration follows from the buffer's layout, which the plans are
        # kept with, BLOCK_M, whether x is given and the configuration asked for:
        # `fused_kernel_config`)
        return ("fused", x is not None, y is not None, stats is not None, weights.recipe,
                weights.arch, *_weight_addresses(weights), type(activation_clamp),
                activation_clamp, type(fast_math), fast_math, type(num_sms), num_sms, block_m,
                config, spin_timeout_ns(), launch_path().name)
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
