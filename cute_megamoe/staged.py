"""Staged mode: the layer as separate kernels, with any expert computation between them.

    result = staged.dispatch(buf, x, topk_idx, topk_weights)   # stage + count/scatter/rows
    expert_out = my_experts(result)                             # [P, H] BF16 in pool order
    y = staged.combine(buf, expert_out, result)                 # send back + top-k reduce

`dispatch` and `combine` are collective: every rank of the buffer's group calls them, in the
same order, once per call (also with 0 tokens). `staged_mega_moe` runs a whole layer with the
expert FFN on our grouped-GEMM kernels (`kernel_experts`, `expert_gemm.ExpertWeights`; what
`api.mega_moe` / `fp8_mega_moe` call) or on torch ops (`torch_experts`,
`TorchExpertWeights`, every recipe and arch: what `MegaMoE` and `fp8_fp4_mega_moe` run where
an arch has no grouped-GEMM kernels for the recipe). It is the baseline the fused
single-launch kernel must beat.

Per-call settings: ``transfer`` (every rank must pass the same: the kernels check),
``send_mode`` and ``rounds`` (free per rank), ``l2_sends`` (every rank the same), ``block_m``
(free per rank; default: the heuristics, `heuristics.block_m_for_call`) and ``config`` (the
grouped GEMMs', `config.LayerConfig.gemm`; free per rank). `cute_megamoe.MegaMoE` fixes them
at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant, reference
from .buffer import SymmBuffer
from .checks import (
    MAX_INT32,
    check_activation_clamp,
    check_block_m,
    check_choice,
    check_cuda_buffer,
    check_fast_math,
    check_routing,
    check_sym_buffer,
    check_tensor,
    check_token_count,
    routing_check,
)
from .chunks import ALL_EXPERTS, chunk_experts_for, map_experts
from .config import LayerConfig, Sm90GemmConfig
from .expert_gemm import ExpertWeights, _prepare_expert_ffn, expert_ffn_configs, weights_recipe
from .heuristics import block_m_for_call, expected_tokens_per_expert, select_combine_rounds
from .launch import (
    COMBINE_SLOTS,
    DISPATCH_SLOTS,
    GEMM_SLOTS,
    STAGING_SLOTS,
    KernelCall,
    buffer_state,
    combine_call,
    dispatch_call,
    existing_buffer_state,
    staging_call,
)
from .runtime import launch_path, spin_timeout_ns
from .tables import check_recipe

#: How dispatched rows cross to the expert's rank (`kernels.dispatch`); ranks must agree.
TRANSFERS = ("push", "pull")
#: How the combine moves the rows back (`kernels.combine`); ranks may differ.
SEND_MODES = ("registers", "bulk")
#: Token classes of the combine's split barriers (`kernels.common.sync.SPLIT_BARRIER_COUNT`).
_TOKEN_CLASSES = 8
#: Layer plans kept per buffer (`_LayerPlan`; a few per layer configuration in practice).
_MAX_PLANS = 512

# the launch state of a buffer (`launch.buffer_state`), under its old name
_state = buffer_state


@dataclass
class DispatchResult:
    """Where `dispatch` put this rank's received tokens (views into the symmetric buffer).

    Pool rows are expert-major; local expert e owns rows
    `[pool_block_offsets[e] * block_m, pool_block_offsets[e] * block_m + expert_recv_tokens[e])`
    and the rest of its last block is padding (never written, never read back).
    """

    num_tokens: int  # tokens this rank staged (rows of its y)
    block_m: int
    expert_recv_tokens: torch.Tensor  # int32 [E_l], device
    l1_acts: torch.Tensor  # [P, H] e4m3 or bf16
    l1_acts_sf: torch.Tensor | None  # [P, H/128], MN-major
    l1_topk_weights: torch.Tensor  # f32 [P]
    token_src_metadata: torch.Tensor  # int32 [P, 4]: (source rank, token, slot, 0)

    @property
    def num_pool_rows(self) -> int:
        return self.l1_acts.shape[0]

    def pool_block_offsets(self) -> torch.Tensor:
        """int32 [E_l + 1]: first pool block of each expert (exclusive prefix, on the device)."""
        blocks = torch.div(self.expert_recv_tokens + self.block_m - 1, self.block_m,
                           rounding_mode="floor")
        return torch.nn.functional.pad(torch.cumsum(blocks, 0, dtype=torch.int32), (1, 0))

    def pool_row_ends(self) -> torch.Tensor:
        """int32 [E_l]: one past each expert's last (padded) pool row, the `offs` of
        `torch._grouped_mm`."""
        return (self.pool_block_offsets()[1:] * self.block_m).to(torch.int32)


class gives_up_call_on_error:  # noqa: N801 (a context manager, used as a function)
    """Around the host work of a collective call before its first launch: if it raises, this
    rank gives the call up (`SymmBuffer.skip_call`), so that its next call cannot pair with
    its peers' current one; the kernels then trap naming the call numbers instead. Entry
    points run all their checks inside one such block and launch only after it."""

    __slots__ = ("sym_buffer",)

    def __init__(self, sym_buffer: SymmBuffer):
        self.sym_buffer = sym_buffer

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.sym_buffer.skip_call()
        return False


# ----------------------------------------------------------------------------- staging

def stage_inputs(sym_buffer: SymmBuffer, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, *, validate_routing: bool | None = None) -> None:
    """Quantize `x` (BF16 `[n, hidden]`) into `sym_buffer.x` / `x_sf` and copy the routing.

    One GPU kernel (`kernels/staging.py`), bit-exact with `quant.quantize_activations_for_recipe`
    for the buffer's recipe. Not collective. `validate_routing` (`checks.routing_check`;
    default: the ``CUTE_MEGAMOE_CHECK_ROUTING`` setting, "device"): "host" checks every expert
    index on the host first, which synchronizes the stream; otherwise the dispatch checks
    them on the GPU.
    """
    check_sym_buffer(sym_buffer)
    launch = _prepare_staging(sym_buffer, x, topk_idx, topk_weights, validate_routing)
    if launch is not None:
        launch()


def _prepare_staging(sym_buffer: SymmBuffer, x, topk_idx, topk_weights,
                     validate_routing: bool | None, launch: bool = True) -> KernelCall | None:
    """The checks of `stage_inputs` and its launch (None for 0 tokens, or with ``launch``
    False: the checks only)."""
    layout = sym_buffer.layout
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims [num_tokens, hidden], got shape {tuple(x.shape)}")
    n = x.shape[0]
    if n > layout.num_tokens:
        raise ValueError(
            f"x: {n} tokens exceed the buffer's {layout.num_tokens} token rows per rank "
            f"(num_max_tokens_per_rank={layout.num_max_tokens_per_rank}, rounded up to a "
            f"multiple of 128)")
    device = check_cuda_buffer(sym_buffer)
    check_tensor("x", x, torch.bfloat16, (n, layout.hidden), device)
    check_tensor("topk_idx", topk_idx, torch.int64, (n, layout.num_topk), device)
    check_tensor("topk_weights", topk_weights, torch.float32, (n, layout.num_topk), device)
    if n * layout.hidden > MAX_INT32:
        raise ValueError(f"x: num_tokens * hidden = {n * layout.hidden} exceeds 2**31 - 1")
    if routing_check(validate_routing) == "host":
        check_routing(topk_idx, layout.num_experts)
    if n == 0 or not launch:
        return None
    return staging_call(sym_buffer, x, topk_idx, topk_weights)


# ----------------------------------------------------------------------------- dispatch

def dispatch(sym_buffer: SymmBuffer, x: torch.Tensor | None, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, *, num_tokens: int | None = None,
             block_m: int | None = None, num_sms: int | None = None,
             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
             validate_routing: bool | None = None, transfer: str = "push") -> DispatchResult:
    """Stage this rank's inputs (unless `x` is None: then `num_tokens` rows were staged into
    the buffer already) and route every (token, slot) to its expert's pool. Collective.
    `transfer`: how rows cross to the expert's rank, "push" (the source stores them into the
    destination's pool, the default) or "pull" (the destination loads them); every rank must
    pass the same value (the kernels check: on a mismatch they print which and trap, so the
    CUDA context reports an error instead of pools missing rows). `block_m` lays out this
    rank's pool (a multiple of 16 up to 256; default: `heuristics.block_m_for_call`) and may
    differ between ranks (pushing sources use each destination's).
    A check that fails raises before the launch and counts the call as given up on this rank
    (`SymmBuffer.skip_call`): if the peers made it, their dispatch of it and this rank's next
    one trap saying the ranks are out of step, rather than pairing different calls.

    The result views the buffer: it is valid until the next `dispatch` on the same buffer."""
    check_sym_buffer(sym_buffer)
    with gives_up_call_on_error(sym_buffer):
        launches, dispatched = _prepare_dispatch(
            sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m, num_sms,
            cumulative_local_expert_recv_stats, validate_routing, transfer)
    for launch in launches:
        launch()
    raise_routing_errors(sym_buffer, validate_routing)
    return dispatched


def raise_routing_errors(sym_buffer: SymmBuffer, validate_routing: bool | str | None) -> None:
    """After a collective call's launches (so that every rank made the call, and the ranks
    stay in step): raise the bad routing slots this rank's dispatches recorded on the GPU in
    the calls it has run so far (`SymmBuffer.raise_routing_error`), unless the call's routing
    check is "off" (`checks.routing_check`)."""
    if routing_check(validate_routing) != "off":
        sym_buffer.raise_routing_error()


def grid_size(sym_buffer: SymmBuffer, num_sms: int | None) -> int:
    """CTAs of a collective kernel: ``num_sms`` (1 up to the buffer's SMs, `launch.BufferState`)
    or, by default, all of them; one CTA per SM, so that the grid is co-resident."""
    most = buffer_state(sym_buffer).num_sms
    if num_sms is None:
        return most
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 1 <= num_sms <= most:
        raise ValueError(f"num_sms: expected 1..{most}, got {num_sms!r}")
    return num_sms


def prepare_layer_call(sym_buffer: SymmBuffer, x, topk_idx, topk_weights,
                       num_tokens: int | None, block_m: int | None,
                       stats: torch.Tensor | None, validate_routing: bool | None,
                       stage: bool = True) -> tuple[list[KernelCall], int, int]:
    """What every layer call checks and prepares before its dispatch (the staged dispatch and
    the fused kernel alike): the cumulative stats, the staging launch when ``x`` is given (else
    ``num_tokens`` staged rows; ``stage`` False: the inputs' checks only, for a kernel that
    stages them itself), and BLOCK_M (default: the heuristics). Returns (the staging launch or
    nothing, the token count, BLOCK_M)."""
    layout = sym_buffer.layout
    device = check_cuda_buffer(sym_buffer)
    routing_check(validate_routing)  # (a bad value raises, also without x)
    if stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", stats, torch.int32,
                     (layout.num_local_experts,), device)
    launches = []
    if x is not None:
        staging = _prepare_staging(sym_buffer, x, topk_idx, topk_weights, validate_routing,
                                   stage)
        launches += [staging] if staging is not None else []
        num_tokens = x.shape[0]
    elif num_tokens is None:
        raise ValueError(f"num_tokens: with x=None give the staged row count (0.."
                         f"{layout.num_tokens})")
    else:
        check_token_count("num_tokens", num_tokens, layout.num_tokens)
    if block_m is None:
        block_m = block_m_for_call(num_tokens, layout.num_ranks, layout.num_topk,
                                   layout.num_experts, buffer_state(sym_buffer).arch)
    return launches, num_tokens, block_m


def _prepare_dispatch(sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m, num_sms,
                      cumulative_local_expert_recv_stats, validate_routing, transfer
                      ) -> tuple[list[KernelCall], DispatchResult]:
    """The checks of `dispatch`; its launches (staging when `x` is given, then the dispatch),
    not made yet; and the result they will fill."""
    layout = sym_buffer.layout
    check_choice("transfer", transfer, TRANSFERS)
    check_whole_received_rows(sym_buffer)
    stats = cumulative_local_expert_recv_stats
    launches, num_tokens, block_m = prepare_layer_call(
        sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m, stats, validate_routing)
    state = buffer_state(sym_buffer)
    check_block_m(block_m, layout.block_m_max)
    num_ctas = grid_size(sym_buffer, num_sms)
    launches.append(dispatch_call(sym_buffer, num_tokens, block_m, num_ctas, stats, transfer))
    dispatched = DispatchResult(
        num_tokens=num_tokens, block_m=block_m, expert_recv_tokens=state.recv_tokens,
        l1_acts=sym_buffer.l1_acts, l1_acts_sf=sym_buffer.l1_acts_sf if layout.has_sf else None,
        l1_topk_weights=sym_buffer.l1_topk_weights,
        token_src_metadata=sym_buffer.token_src_metadata)
    return launches, dispatched


# ----------------------------------------------------------------------------- combine

def combine(sym_buffer: SymmBuffer, expert_out: torch.Tensor | None,
            dispatched: DispatchResult, y: torch.Tensor | None = None, *,
            num_sms: int | None = None, send_mode: str = "registers",
            rounds: tuple[int, ...] | None = None) -> torch.Tensor:
    """Send `expert_out` (BF16 [P, H], pool order) back to the source ranks and reduce over
    top-k into `y` (BF16 [num_tokens, H], allocated when None). Collective. `send_mode`: how
    the pool-order sends move the rows, "registers" (16-byte register copies, the default) or
    "bulk" (bulk copies through shared memory); ranks may pass different modes. `rounds`
    ("registers" only; None: by the token count, `heuristics.select_combine_rounds`): how many
    of the 8 token classes each round of sends takes, each round's reduction running while the
    next round's rows move; ranks may pass different values (see `kernels.combine`).
    `expert_out=None`: every rank's L2 GEMM wrote its rows into the combine buffers already
    (`kernel_experts(..., send_to_combine=True)`); only the barrier and the reduction run
    (`send_mode` and `rounds` are ignored). A failing check raises without giving the call up
    (the dispatch of the call was made; a corrected `combine` may still complete it), so the
    layer entry points check `y` and the settings before their dispatch."""
    check_sym_buffer(sym_buffer)
    launch, y = _prepare_combine(sym_buffer, expert_out, dispatched, y, num_sms, send_mode,
                                 rounds)
    launch()
    return y


def _combine_rounds(send_mode: str, rounds, num_tokens: int,
                    epilogue: bool) -> tuple[str, tuple[int, ...]]:
    """The send mode and rounds `combine` compiles for (checked)."""
    if epilogue:
        return "epilogue", (_TOKEN_CLASSES,)
    check_choice("send_mode", send_mode, SEND_MODES)
    if rounds is None:
        rounds = (_TOKEN_CLASSES,) if send_mode == "bulk" else select_combine_rounds(num_tokens)
    rounds = tuple(rounds)
    if (not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in rounds)
            or sum(rounds) != _TOKEN_CLASSES or (len(rounds) > 1 and send_mode != "registers")):
        raise ValueError(f"rounds: positive class counts summing to {_TOKEN_CLASSES} (several "
                         f"rounds only with send_mode='registers'), got {rounds} with "
                         f"{send_mode!r}")
    return send_mode, rounds


def _prepare_combine(sym_buffer, expert_out, dispatched, y, num_sms, send_mode, rounds
                     ) -> tuple[KernelCall, torch.Tensor]:
    layout = sym_buffer.layout
    device = check_cuda_buffer(sym_buffer)
    if not isinstance(dispatched, DispatchResult):
        raise TypeError(f"dispatched: expected a DispatchResult, got "
                        f"{type(dispatched).__name__}")
    n = dispatched.num_tokens
    if expert_out is not None:
        if send_mode == "epilogue":
            raise ValueError('send_mode="epilogue" means expert_out=None')
        check_tensor("expert_out", expert_out, torch.bfloat16,
                     (layout.num_pool_rows, layout.hidden), device)
    send_mode, rounds = _combine_rounds(send_mode, rounds, n, expert_out is None)
    if y is None:
        y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device=device)
    check_tensor("y", y, torch.bfloat16, (n, layout.hidden), device)
    num_ctas = grid_size(sym_buffer, num_sms)
    launch = combine_call(sym_buffer, n, dispatched.block_m, expert_out,
                          dispatched.expert_recv_tokens, y, num_ctas, send_mode, rounds)
    return launch, y


# ----------------------------------------------------------------------------- torch experts

#: Peak temporaries of `TorchExpertWeights.from_bf16` per master element of one expert in a
#: chunk, the chunk's result included (`chunks`; measured with `testing.memory`: 10 fp8xfp8,
#: 14.8 MXFP4, plus 2 for the result; rounded up).
TORCH_WEIGHTS_PEAK_BYTES = 20


@dataclass
class TorchExpertWeights:
    """This rank's expert weights dequantized to BF16 for `torch._grouped_mm`: `w1` [E_l, 2I, H]
    (gate | up, not interleaved) and `w2` [E_l, H, I], contiguous; the GEMMs use their
    transposed views (K-major B operands). Any recipe on any arch (FP4 x 2^k is exact in
    BF16, and so is fp8xfp4_sm90's e4m3 x 2^b; FP8 with an f32 block scale rounds once to
    BF16)."""

    w1: torch.Tensor
    w2: torch.Tensor

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
    def from_bf16(cls, w1: torch.Tensor, w2: torch.Tensor, recipe: str, *,
                  chunk_experts: int | None = None) -> TorchExpertWeights:
        """From BF16 master weights [E_l, 2I, H] / [E_l, H, I]: quantize per recipe exactly as
        the reference does, then dequantize. ``chunk_experts`` experts at a time (`chunks`;
        default: by the shapes, within a quarter of the output plus 1.5 GiB of temporaries);
        the result does not depend on it."""
        check_recipe(recipe)
        if recipe == "bf16xbf16":
            return cls(w1.contiguous(), w2.contiguous())

        def prep(w, name):
            check_tensor(name, w, for_kernel=False)
            if w.dim() != 3:
                raise ValueError(f"{name}: expected [E_l, N, K] weights, got shape "
                                 f"{tuple(w.shape)}")
            chunk = chunk_experts_for(w.shape[0], TORCH_WEIGHTS_PEAK_BYTES * w[0].numel(),
                                      2 * w.numel(), chunk_experts)
            return map_experts(lambda part: quant.dequantize_weights_for_recipe(
                quant.quantize_weights_for_recipe(part, recipe, chunk_experts=ALL_EXPERTS),
                recipe).to(torch.bfloat16), (w,), chunk)

        return cls(prep(w1, "w1").contiguous(), prep(w2, "w2").contiguous())

    @classmethod
    def from_transformed(cls, l1_weights, l2_weights) -> TorchExpertWeights:
        """From what `quant.transform_weights_for_mega_moe` returned with its default arch
        (DeepGEMM's layout: L1 rows and scales gate/up interleaved, FP4 scales in UTCCP row
        order): undo the layout, then dequantize (the recipe is the weights' own)."""
        recipe = weights_recipe(l1_weights)
        if recipe == "bf16xbf16":
            if not isinstance(l2_weights, torch.Tensor) or l2_weights.dtype != torch.bfloat16:
                raise TypeError("l2_weights: bf16xbf16 weights must be a BF16 tensor")
            return cls(quant.deinterleave_gate_up(l1_weights).contiguous(),
                       l2_weights.contiguous())
        if not (isinstance(l2_weights, tuple) and len(l2_weights) == 2
                and isinstance(l2_weights[0], torch.Tensor)
                and l2_weights[0].dtype == l1_weights[0].dtype):
            raise TypeError("l2_weights: expected a (weight, scale) tuple like l1_weights")
        (w1, sf1), (w2, sf2) = l1_weights, l2_weights
        if recipe == "fp8xfp4":
            sf1, sf2 = quant.untranspose_sf_for_utccp(sf1), quant.untranspose_sf_for_utccp(sf2)
        l1 = (quant.deinterleave_gate_up(w1), quant.deinterleave_gate_up(sf1))

        def deq(q):
            return quant.dequantize_weights_for_recipe(q, recipe).to(torch.bfloat16)

        return cls(deq(l1).contiguous(), deq((w2, sf2)).contiguous())


def torch_experts(dispatched: DispatchResult, weights: TorchExpertWeights, recipe: str,
                  activation_clamp: float | None = None, fast_math: bool = True) -> torch.Tensor:
    """The expert FFN over the pool with torch ops: BF16 [P, H] in pool order (rows past the
    last expert's blocks are zero, pad rows inside them hold garbage; neither is sent).
    Numerics follow the reference: L1 rounded to BF16, clamp, SiLU, routing weight,
    requantization per recipe, L2 rounded to BF16. Reads the pool size back to the host (a
    synchronization: this path cannot be captured in a CUDA graph)."""
    offs = dispatched.pool_row_ends()
    used = int(offs[-1]) if offs.numel() else 0  # only the blocks the dispatch filled
    out = torch.zeros(dispatched.num_pool_rows, weights.w2.shape[1], dtype=torch.bfloat16,
                      device=offs.device)
    if used == 0:
        return out
    if recipe == "bf16xbf16":
        acts = dispatched.l1_acts[:used]
    else:
        acts = quant.dequantize_activations_for_recipe(
            (dispatched.l1_acts[:used], dispatched.l1_acts_sf[:used].contiguous()),
            recipe).to(torch.bfloat16)
    l1 = torch._grouped_mm(acts, weights.w1.transpose(1, 2), offs=offs).float()
    h = reference.swiglu_reference(l1, dispatched.l1_topk_weights[:used], activation_clamp,
                                   fast_math)
    l2_in = reference.l2_input_reference(h, recipe).to(torch.bfloat16)
    out[:used] = torch._grouped_mm(l2_in, weights.w2.transpose(1, 2), offs=offs)
    return out


# ----------------------------------------------------------------------------- kernel experts

def kernel_experts(sym_buffer: SymmBuffer, dispatched: DispatchResult, weights: ExpertWeights,
                   activation_clamp: float | None = None, fast_math: bool = True,
                   send_to_combine: bool = False,
                   config: LayerConfig | None = None) -> torch.Tensor | None:
    """The expert FFN over the pool on our grouped-GEMM kernels: L1 + SwiGLU + requant into
    the buffer's L2 pool, then L2 into a per-buffer BF16 [P, H] tensor (reused by every call;
    valid until the next call). No host synchronization. `send_to_combine`: the L2 epilogue
    writes every row straight into its source rank's combine buffer over NVLink instead, and
    None is returned; follow with `combine(sym_buffer, None, ...)` on every rank. `config`:
    its ``gemm`` configures the GEMMs (None: the heuristics')."""
    check_sym_buffer(sym_buffer)
    launches, out = _prepare_kernel_experts(sym_buffer, dispatched, weights, activation_clamp,
                                            fast_math, send_to_combine,
                                            layer_config(config).gemm)
    for launch in launches:
        launch()
    return out


def _check_kernel_weights(sym_buffer: SymmBuffer, weights: ExpertWeights) -> None:
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected ExpertWeights, got {type(weights).__name__}")
    if weights.recipe != sym_buffer.recipe:
        raise ValueError(f"weights: recipe {weights.recipe!r} does not match the buffer's "
                         f"{sym_buffer.recipe!r}")


def layer_config(config: LayerConfig | None) -> LayerConfig:
    """``config``, or the default `LayerConfig` for None; anything else raises `TypeError`."""
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, LayerConfig):
        raise TypeError(f"config: None or a LayerConfig, got {type(config).__name__}")
    return config


_DEFAULT_CONFIG = LayerConfig()


def configured_block_m(block_m: int | None, configured: int | None, name: str) -> int | None:
    """The call's ``block_m`` argument, else the configuration's (``name`` names it); a
    disagreement raises `ValueError`."""
    if block_m is None:
        return configured
    if configured is not None and configured != block_m:
        raise ValueError(f"block_m: {block_m}, but {name} is {configured}")
    return block_m


def _arch_gemm_config(gemm: Sm90GemmConfig, arch: str) -> Sm90GemmConfig | None:
    """The staged layer's GEMM configuration for ``arch``: ``gemm`` on sm_90a; on sm_100a, whose
    kernels take no option but BLOCK_M, None (``gemm`` must leave the rest to the heuristics)."""
    if arch == "sm_90a":
        return gemm
    if gemm != Sm90GemmConfig(block_m=gemm.block_m):
        raise ValueError(f"config.gemm: sm_90a options ({gemm}); the {arch} GEMMs take none")
    return None


def check_whole_l1_outputs(sym_buffer: SymmBuffer) -> None:
    """The staged GEMMs keep an L1-output row per pool row: a buffer laid out with an
    L1-output ring (`MegaMoELayout.l1_output_rows`) is the fused kernel's only."""
    layout = sym_buffer.layout
    if layout.num_l1_output_rows < layout.num_pool_rows:
        raise ValueError(
            f"the staged kernels keep an L1-output row per pool row ({layout.num_pool_rows}); "
            f"this buffer holds {layout.num_l1_output_rows} (l1_output_rows "
            f"{layout.l1_output_rows}): only the fused kernel's ticket walk with an L1-output "
            f"ring of at most that many rows runs on it (Sm90FusedConfig(walk='tickets', "
            f"l1_ring_rows=...))")


def check_whole_received_rows(sym_buffer: SymmBuffer) -> None:
    """The staged dispatch writes every received row at its pool row, and the staged GEMMs
    read it there: a buffer laid out with a received-rows ring
    (`MegaMoELayout.received_rows`) is the fused kernel's only."""
    layout = sym_buffer.layout
    if layout.num_received_rows < layout.num_pool_rows:
        raise ValueError(
            f"the staged kernels keep a received row per pool row ({layout.num_pool_rows}); "
            f"this buffer holds {layout.num_received_rows} (received_rows "
            f"{layout.received_rows}): only the fused kernel with row_transfer='pulled' runs "
            f"on it")


def _prepare_kernel_experts(sym_buffer, dispatched, weights, activation_clamp, fast_math,
                            send_to_combine, gemm: Sm90GemmConfig
                            ) -> tuple[list[KernelCall], torch.Tensor | None]:
    _check_kernel_weights(sym_buffer, weights)
    check_whole_received_rows(sym_buffer)
    check_whole_l1_outputs(sym_buffer)
    state = buffer_state(sym_buffer)
    if state.expert_out is None and not send_to_combine:
        state.expert_out = torch.empty(dispatched.num_pool_rows, sym_buffer.hidden,
                                       dtype=torch.bfloat16, device=sym_buffer.device)
    layout = sym_buffer.layout
    return _prepare_expert_ffn(
        dispatched.l1_acts, dispatched.l1_acts_sf, dispatched.l1_topk_weights,
        dispatched.expert_recv_tokens, weights, dispatched.block_m, activation_clamp, fast_math,
        sym_buffer.l2_acts, sym_buffer.l2_acts_sf if layout.has_sf else None,
        None if send_to_combine else state.expert_out, state.num_sms, False,
        sym_buffer if send_to_combine else None,
        expected_tokens_per_expert(dispatched.num_tokens, layout.num_ranks, layout.num_topk,
                                   layout.num_experts), _arch_gemm_config(gemm, state.arch))


# ----------------------------------------------------------------------------- the layer

def staged_mega_moe(sym_buffer: SymmBuffer, x: torch.Tensor | None, topk_idx: torch.Tensor | None,
                    topk_weights: torch.Tensor | None,
                    weights: TorchExpertWeights | ExpertWeights, *,
                    num_tokens: int | None = None, y: torch.Tensor | None = None,
                    activation_clamp: float | None = None, fast_math: bool = True,
                    block_m: int | None = None, num_sms: int | None = None,
                    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                    validate_routing: bool | None = None, l2_sends: bool = True,
                    transfer: str = "push", send_mode: str = "registers",
                    rounds: tuple[int, ...] | None = None,
                    config: LayerConfig | None = None) -> torch.Tensor:
    """One whole layer: our dispatch and combine kernels around the expert FFN, on our
    grouped-GEMM kernels (`ExpertWeights`) or torch ops (`TorchExpertWeights`). With `x=None`
    the inputs were staged already (`num_tokens` rows). Collective. Returns `y` (BF16
    [num_tokens, H], allocated when None).

    `l2_sends` (with our GEMM kernels; measured on Hopper, compiled only on Blackwell): the L2
    epilogue sends the rows to the source ranks' combine buffers, so the combine only reduces;
    False: L2 writes pool order and the combine kernel sends (the torch experts always do
    that; `send_mode` and `rounds` apply then). Every rank must pass the same `l2_sends` and
    `transfer`; `block_m` (the pool's block; default: ``config.gemm.block_m``, else the
    heuristics), `send_mode`, `rounds` and `config` (its ``gemm``: the grouped GEMMs'
    configuration, `config.Sm90GemmConfig`; None: the heuristics') may differ.
    Every check runs before the first launch; one that fails gives the call up on this rank
    (`gives_up_call_on_error`). The torch experts read the pool size back to the host, so only
    the kernel path can be captured in a CUDA graph (unless `validate_routing` is "host":
    `checks.routing_check`; the default checks the routing on the GPU, and raises what it
    found after a later call's launches, `raise_routing_errors`).

    On our kernels, the first call of a configuration keeps its launches as a plan on the
    buffer (`_LayerPlan`); later calls with that configuration check their inputs, fill in
    what changes (the inputs' and `y`'s addresses, the token count, the stream) and launch."""
    plan, key, n = _find_plan(sym_buffer, x, topk_idx, topk_weights, weights, num_tokens, y,
                              activation_clamp, fast_math, block_m, num_sms,
                              cumulative_local_expert_recv_stats, l2_sends, transfer, send_mode,
                              rounds, config)
    if plan is not None:
        y = plan.launch(sym_buffer, x, topk_idx, topk_weights, n, y,
                        cumulative_local_expert_recv_stats, validate_routing)
        raise_routing_errors(sym_buffer, validate_routing)
        return y
    check_sym_buffer(sym_buffer)
    with gives_up_call_on_error(sym_buffer):
        config = layer_config(config)
        block_m = configured_block_m(block_m, config.gemm.block_m, "config.gemm.block_m")
        on_kernels = isinstance(weights, ExpertWeights)
        if not on_kernels and not isinstance(weights, TorchExpertWeights):
            raise TypeError(f"weights: expected ExpertWeights or TorchExpertWeights, got "
                            f"{type(weights).__name__}")
        if on_kernels:
            _check_kernel_weights(sym_buffer, weights)
        else:
            _check_torch_weights(sym_buffer, weights)
        activation_clamp = check_activation_clamp(activation_clamp)
        check_fast_math(fast_math)
        if not isinstance(l2_sends, bool):
            raise TypeError(f"l2_sends: expected a bool, got {type(l2_sends).__name__}")
        epilogue = on_kernels and l2_sends
        n = x.shape[0] if isinstance(x, torch.Tensor) else num_tokens
        if isinstance(n, int):
            _combine_rounds(send_mode, rounds, n, epilogue)
        if y is not None and isinstance(n, int):
            check_tensor("y", y, torch.bfloat16, (n, sym_buffer.hidden), sym_buffer.device)
        launches, dispatched = _prepare_dispatch(
            sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m, num_sms,
            cumulative_local_expert_recv_stats, validate_routing, transfer)
        if on_kernels:
            expert_launches, expert_out = _prepare_kernel_experts(
                sym_buffer, dispatched, weights, activation_clamp, fast_math, epilogue,
                config.gemm)
            # (checked above: cannot fail; prepared here so that nothing runs before it)
            combine_launch, y = _prepare_combine(sym_buffer, expert_out, dispatched, y, num_sms,
                                                 send_mode, rounds)
    if not on_kernels:
        for launch in launches:
            launch()
        expert_out = torch_experts(dispatched, weights, sym_buffer.recipe, activation_clamp,
                                   fast_math)
        y = combine(sym_buffer, expert_out, dispatched, y, num_sms=num_sms,
                    send_mode=send_mode, rounds=rounds)
        raise_routing_errors(sym_buffer, validate_routing)
        return y
    if key is not None and dispatched.num_tokens > 0:
        plans = buffer_state(sym_buffer).plans
        if len(plans) >= _MAX_PLANS:  # (weights at ever new addresses, say)
            plans.clear()
        plans[key] = _LayerPlan(sym_buffer, weights, x is not None, launches, expert_launches,
                                combine_launch)
    for launch in (*launches, *expert_launches, combine_launch):
        launch()
    raise_routing_errors(sym_buffer, validate_routing)
    return y


class _LayerPlan:
    """The launches of one layer configuration on one buffer, kept from the call that made
    them: `launch` checks a later call's inputs and launches them again with the per-call
    arguments filled in (`launch.PreparedCall`). Holds no tensor of the buffer or the weights
    (only their addresses), so it keeps no memory alive."""

    def __init__(self, sym_buffer: SymmBuffer, weights: ExpertWeights, staged: bool,
                 launches: list[KernelCall], expert_launches: list[KernelCall],
                 combine_launch: KernelCall):
        self.keep_checks(sym_buffer, weights, combine_launch.path)
        self.staged = staged  # the calls pass x (checked as the staging's inputs)
        staging = launches[0] if staged else None
        dispatch = launches[-1]
        self.staging = None if staging is None else staging.prepare(STAGING_SLOTS)
        self.dispatch = dispatch.prepare(DISPATCH_SLOTS)
        self.no_stats = dispatch.args[DISPATCH_SLOTS[1]]  # the counts stand in
        self.gemms = tuple(call.prepare(GEMM_SLOTS) for call in expert_launches)
        self.combine = combine_launch.prepare(COMBINE_SLOTS)

    def keep_checks(self, sym_buffer: SymmBuffer, weights: ExpertWeights, path) -> None:
        """What `accepts` compares a later call with (the buffer's shapes, the weights'
        dtypes and shapes) and the launch path the kept arguments are in."""
        layout = sym_buffer.layout
        self.path = path
        self.device = sym_buffer.device
        self.num_tokens = layout.num_tokens
        self.hidden = layout.hidden
        self.topk_shape_k = layout.num_topk
        self.num_experts = layout.num_experts
        self.stats_shape = (layout.num_local_experts,)
        self.weight_meta = tuple(None if t is None else (t.dtype, t.shape)
                                 for t in _weight_tensors(weights))

    def _fits(self, t: object, dtype: torch.dtype, shape: tuple) -> bool:
        """What `checks.check_tensor` asks of a kernel argument, as a bool."""
        return (isinstance(t, torch.Tensor) and t.dtype is dtype and t.shape == shape
                and t.device == self.device and t.is_contiguous() and t.data_ptr() % 16 == 0)

    def accepts(self, x, topk_idx, topk_weights, weights, n: int, y, stats) -> bool:
        """Whether every check of the call passes (else the full checks run and raise)."""
        if not 0 < n <= self.num_tokens:
            return False
        if self.staged:  # (x staged by a launch or by the fused kernel itself)
            k = self.topk_shape_k
            if not (self._fits(x, torch.bfloat16, (n, self.hidden))
                    and self._fits(topk_idx, torch.int64, (n, k))
                    and self._fits(topk_weights, torch.float32, (n, k))
                    and n * self.hidden <= MAX_INT32):
                return False
        if y is not None and not self._fits(y, torch.bfloat16, (n, self.hidden)):
            return False
        if stats is not None and not self._fits(stats, torch.int32, self.stats_shape):
            return False
        for t, meta in zip(_weight_tensors(weights), self.weight_meta, strict=True):
            if meta is None:
                if t is not None:
                    return False
            elif not (isinstance(t, torch.Tensor) and t.dtype is meta[0] and t.shape == meta[1]
                      and t.device == self.device and t.is_contiguous()):
                return False
        return True

    def launch(self, sym_buffer: SymmBuffer, x, topk_idx, topk_weights, n: int,
               y: torch.Tensor | None, stats: torch.Tensor | None,
               validate_routing: bool | None) -> torch.Tensor:
        with gives_up_call_on_error(sym_buffer):
            if routing_check(validate_routing) == "host" and self.staging is not None:
                check_routing(topk_idx, self.num_experts)
        path = self.path
        ptr, int32 = path.ptr, path.int32
        if y is None:
            y = torch.empty(n, self.hidden, dtype=torch.bfloat16, device=self.device)
        stream = path.stream()
        count = int32(n)
        if self.staging is not None:
            self.staging(ptr(x), ptr(topk_idx), ptr(topk_weights), count, stream)
        self.dispatch(count, self.no_stats if stats is None else ptr(stats, 4), stream)
        for gemm in self.gemms:
            gemm(stream)
        self.combine(count, ptr(y), stream)
        return y


def _weight_tensors(weights: ExpertWeights) -> tuple:
    return (weights.w1, weights.w2, weights.w1_sf, weights.w2_sf, weights.w1_block_sf,
            weights.w2_block_sf)


def _weight_addresses(weights: ExpertWeights) -> tuple:
    """The addresses of the weights' tensors (None for an absent one) and their storage order
    (``tiled``): a plan's kept launches hold them, so they are part of its configuration."""
    return (*(None if t is None else t.data_ptr() for t in _weight_tensors(weights)),
            getattr(weights, "tiled", False))


def _find_plan(sym_buffer, x, topk_idx, topk_weights, weights, num_tokens, y, activation_clamp,
               fast_math, block_m, num_sms, stats, l2_sends, transfer, send_mode, rounds, config
               ) -> tuple[_LayerPlan | None, tuple | None, int | None]:
    """The plan of this call's configuration if one exists and the call passes every check
    (else None: the full checks run), the configuration's key (None where it has none: then
    no plan is kept), and the token count."""
    if not isinstance(weights, ExpertWeights):
        return None, None, None
    try:
        if sym_buffer.buffer is None:  # destroyed: the checks say so
            return None, None, None
        if x is not None:
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                return None, None, None
            n = x.shape[0]
        elif type(num_tokens) is int:
            n = num_tokens
        else:
            return None, None, None
        if rounds is not None and not (type(rounds) is tuple
                                       and all(type(r) is int for r in rounds)):
            return None, None, n
        layout = sym_buffer.layout
        epilogue = l2_sends is True
        config = layer_config(config)
        gemm = _arch_gemm_config(config.gemm, weights.arch)
        block_m = configured_block_m(block_m, config.gemm.block_m, "config.gemm.block_m")
        if type(block_m) not in (int, type(None)) or n < 0:
            return None, None, None
        args = (n, layout.num_ranks, layout.num_topk, layout.num_experts)
        # what the heuristics choose for this token count (a plan exists only where the
        # weights' arch is the GPU's): BLOCK_M, the GEMMs' configurations, the combine's rounds
        if block_m is None:
            block_m = block_m_for_call(*args, weights.arch)
        key = (x is not None, y is not None, stats is not None, weights.recipe, weights.arch,
               *_weight_addresses(weights), type(activation_clamp), activation_clamp,
               type(fast_math), fast_math, type(l2_sends), l2_sends, transfer, send_mode,
               rounds, block_m, type(num_sms), num_sms,
               expert_ffn_configs(weights.arch, weights.recipe, block_m, weights.hidden,
                                  weights.intermediate, expected_tokens_per_expert(*args),
                                  epilogue, gemm),
               select_combine_rounds(n) if rounds is None and not epilogue
               and send_mode == "registers" else None,
               spin_timeout_ns(), launch_path().name)
        state = existing_buffer_state(sym_buffer)
        plan = None if state is None else state.plans.get(key)
        if plan is None or not plan.accepts(x, topk_idx, topk_weights, weights, n, y, stats):
            return None, key, n
    except (TypeError, AttributeError, ValueError, KeyError):  # odd arguments: the checks
        return None, None, None                                # name them
    return plan, key, n


def _check_torch_weights(sym_buffer: SymmBuffer, weights: TorchExpertWeights) -> None:
    """BF16 [E_l, 2I, H] / [E_l, H, I] on the buffer's device (I is free: the torch experts
    do not use the buffer's L2 pool)."""
    lay = sym_buffer.layout
    device = sym_buffer.device
    w1 = weights.w1
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3 or w1.shape[1] % 2 != 0:
        raise ValueError(f"weights.w1: expected a tensor [E_l, 2I, H], got "
                         f"{getattr(w1, 'shape', type(w1).__name__)}")
    inter = w1.shape[1] // 2
    check_tensor("weights.w1", w1, torch.bfloat16, (lay.num_local_experts, 2 * inter, lay.hidden),
                 device)
    check_tensor("weights.w2", weights.w2, torch.bfloat16,
                 (lay.num_local_experts, lay.hidden, inter), device)


__all__ = ["SEND_MODES", "TRANSFERS", "DispatchResult", "ExpertWeights", "TorchExpertWeights",
           "combine", "dispatch", "gives_up_call_on_error", "kernel_experts",
           "raise_routing_errors", "stage_inputs",
           "staged_mega_moe", "torch_experts"]
