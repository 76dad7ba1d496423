"""Staged mode: the layer as separate kernels, with any expert computation between them.

    result = staged.dispatch(buf, x, topk_idx, topk_weights)   # stage + count/scatter/rows
    expert_out = my_experts(result)                             # [P, H] BF16 in pool order
    y = staged.combine(buf, expert_out, result)                 # send back + top-k reduce

`dispatch` and `combine` are collective: every rank of the buffer's group calls them, in the
same order, once per call (also with 0 tokens). `staged_mega_moe` runs a whole layer with the
expert FFN on our grouped-GEMM kernels (`kernel_experts`, `expert_gemm.ExpertWeights`; what
`fp8_mega_moe` / `bf16_mega_moe` call) or on torch ops (`torch_experts`,
`TorchExpertWeights`, every recipe: the debugging path). It is the baseline the fused
single-launch kernel must beat.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32

from . import quant, reference
from .api import _check_tensor, stage_inputs
from .buffer import SymmBuffer
from .expert_gemm import ExpertWeights
from .heuristics import get_num_sms, select_combine_rounds
from .runtime import as_ptr, compiled_kernel, current_stream, get_arch

DEFAULT_BLOCK_M = 128


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


class _BufferState:
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
        self.expert_out: torch.Tensor | None = None  # BF16 [P, H] of `kernel_experts`


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(sym_buffer: SymmBuffer) -> _BufferState:
    state = _STATES.get(sym_buffer)
    if state is None:
        state = _STATES[sym_buffer] = _BufferState(sym_buffer)
    return state


def _grid(state: _BufferState, num_sms: int | None) -> int:
    if num_sms is None:
        return state.num_sms
    if not 1 <= num_sms <= state.num_sms:
        raise ValueError(f"num_sms: expected 1..{state.num_sms}, got {num_sms}")
    return num_sms


def dispatch(sym_buffer: SymmBuffer, x: torch.Tensor | None, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, *, num_tokens: int | None = None,
             block_m: int = DEFAULT_BLOCK_M, num_sms: int | None = None,
             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
             validate_routing: bool | None = None, transfer: str = "push") -> DispatchResult:
    """Stage this rank's inputs (unless `x` is None: then `num_tokens` rows were staged into
    the buffer already) and route every (token, slot) to its expert's pool. Collective.
    `transfer`: how rows cross to the expert's rank, "push" (the source stores them into the
    destination's pool, the default) or "pull" (the destination loads them); every rank must
    pass the same value (the kernels check: on a mismatch they print which and trap, so the
    CUDA context reports an error instead of pools missing rows). `block_m` lays out this
    rank's pool and may differ between ranks (pushing sources use each destination's).
    A check that fails raises before the launch and counts the call as given up on this rank
    (`SymmBuffer.skip_call`): if the peers made it, their dispatch of it and this rank's next
    one trap saying the ranks are out of step, rather than pairing different calls.

    The result views the buffer: it is valid until the next `dispatch` on the same buffer."""
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f"sym_buffer: expected a SymmBuffer, got {type(sym_buffer).__name__}")
    with gives_up_call_on_error(sym_buffer):
        fn, args, num_tokens = _prepare_dispatch(
            sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m, num_sms,
            cumulative_local_expert_recv_stats, validate_routing, transfer)
    fn(*args)
    layout = sym_buffer.layout
    return DispatchResult(
        num_tokens=num_tokens, block_m=block_m,
        expert_recv_tokens=_state(sym_buffer).recv_tokens, l1_acts=sym_buffer.l1_acts,
        l1_acts_sf=sym_buffer.l1_acts_sf if layout.has_sf else None,
        l1_topk_weights=sym_buffer.l1_topk_weights,
        token_src_metadata=sym_buffer.token_src_metadata)


@contextlib.contextmanager
def gives_up_call_on_error(sym_buffer: SymmBuffer):
    """Around the host work of a collective call before its first launch: if it raises, this
    rank gives the call up (`SymmBuffer.skip_call`), so that its next call cannot pair with
    its peers' current one; the kernels then trap naming the call numbers instead."""
    try:
        yield
    except BaseException:
        sym_buffer.skip_call()
        raise


def _prepare_dispatch(sym_buffer, x, topk_idx, topk_weights, num_tokens, block_m, num_sms,
                      cumulative_local_expert_recv_stats, validate_routing, transfer):
    """Checks and input staging of `dispatch`; returns the compiled kernel, its arguments and
    the token count."""
    from .kernels.dispatch import TRANSFERS, DispatchKernel

    layout = sym_buffer.layout
    state = _state(sym_buffer)
    has_stats = cumulative_local_expert_recv_stats is not None
    if has_stats:
        _check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                      torch.int32, (layout.num_local_experts,), sym_buffer.device)
    if block_m % 16 != 0 or not 16 <= block_m <= layout.block_m_max:
        raise ValueError(f"block_m: expected a multiple of 16 in [16, {layout.block_m_max}], "
                         f"got {block_m}")
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer: expected one of {TRANSFERS}, got {transfer!r}")
    num_ctas = _grid(state, num_sms)
    if x is not None:
        stage_inputs(sym_buffer, x, topk_idx, topk_weights, validate_routing=validate_routing)
        num_tokens = x.shape[0]
    elif num_tokens is None or not 0 <= num_tokens <= layout.num_tokens:
        raise ValueError(f"num_tokens: with x=None give the staged row count (0.."
                         f"{layout.num_tokens}), got {num_tokens}")
    stats = (as_ptr(cumulative_local_expert_recv_stats, align=4) if has_stats
             else state.recv_tokens_ptr)
    args = (state.peer_bases, Int32(sym_buffer.rank), Int32(num_tokens), state.recv_tokens_ptr,
            stats, Int32(num_ctas), current_stream())
    fn = compiled_kernel(
        ("dispatch", state.arch, layout, block_m, has_stats, transfer),
        lambda: cute.compile(DispatchKernel(layout, block_m, has_stats=has_stats,
                                            transfer=transfer), *args,
                             options=f"--gpu-arch {state.arch}"))
    return fn, args, num_tokens


def combine(sym_buffer: SymmBuffer, expert_out: torch.Tensor | None,
            dispatched: DispatchResult, y: torch.Tensor | None = None, *,
            num_sms: int | None = None, send_mode: str = "registers",
            rounds: tuple[int, ...] | None = None) -> torch.Tensor:
    """Send `expert_out` (BF16 [P, H], pool order) back to the source ranks and reduce over
    top-k into `y` (BF16 [num_tokens, H], allocated when None). Collective. `send_mode`: how
    the pool-order sends move the rows, "registers" (16-byte register copies, the default) or
    "bulk" (bulk copies through shared memory); every rank must pass the same mode. `rounds`
    ("registers" only; None: by the token count, `heuristics.select_combine_rounds`): how many
    of the 8 token classes each round of sends takes, each round's reduction running while the
    next round's rows move; ranks may pass different values (see `kernels.combine`).
    `expert_out=None`: every rank's L2 GEMM wrote its rows into the combine buffers already
    (`kernel_experts(..., send_to_combine=True)`); only the barrier and the reduction run
    (`send_mode` and `rounds` are ignored)."""
    from .kernels.combine import CombineKernel

    layout = sym_buffer.layout
    device = sym_buffer.device
    state = _state(sym_buffer)
    n = dispatched.num_tokens
    if expert_out is None:
        send_mode = "epilogue"
    else:
        if send_mode == "epilogue":
            raise ValueError('send_mode="epilogue" means expert_out=None')
        _check_tensor("expert_out", expert_out, torch.bfloat16,
                      (layout.num_pool_rows, layout.hidden), device)
    if y is None:
        y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device=device)
    _check_tensor("y", y, torch.bfloat16, (n, layout.hidden), device)
    if send_mode == "epilogue" or (rounds is None and send_mode == "bulk"):
        rounds = (8,)
    elif rounds is None:
        rounds = select_combine_rounds(n)
    rounds = tuple(rounds)
    num_ctas = _grid(state, num_sms)
    # (in "epilogue" mode the kernel never reads expert_out: any valid pointer does)
    out_ptr = as_ptr(sym_buffer.l1_topk_weights if expert_out is None else expert_out)
    args = (state.peer_bases, Int32(sym_buffer.rank), Int32(n), out_ptr,
            as_ptr(dispatched.expert_recv_tokens, align=4),
            as_ptr(y) if n > 0 else out_ptr,  # y is not touched when n == 0
            Int32(num_ctas), current_stream())
    fn = compiled_kernel(
        ("combine", state.arch, layout, dispatched.block_m, send_mode, rounds),
        lambda: cute.compile(CombineKernel(layout, dispatched.block_m, send_mode=send_mode,
                                           rounds=rounds), *args,
                             options=f"--gpu-arch {state.arch}"))
    fn(*args)
    return y


# ----------------------------------------------------------------------------- torch experts

@dataclass
class TorchExpertWeights:
    """This rank's expert weights dequantized to BF16 for `torch._grouped_mm`: `w1` [E_l, 2I, H]
    (gate | up, not interleaved) and `w2` [E_l, H, I], contiguous; the GEMMs use their
    transposed views (K-major B operands)."""

    w1: torch.Tensor
    w2: torch.Tensor

    @classmethod
    def from_bf16(cls, w1: torch.Tensor, w2: torch.Tensor, recipe: str) -> TorchExpertWeights:
        """From BF16 master weights [E_l, 2I, H] / [E_l, H, I]: quantize per recipe exactly as
        the reference does, then dequantize (FP4 x 2^k is exact in BF16; FP8 with an f32
        block scale rounds once to BF16)."""
        def prep(w):
            if recipe == "bf16xbf16":
                return w
            deq = quant.dequantize_weights_for_recipe(quant.quantize_weights_for_recipe(w, recipe),
                                                      recipe)
            return deq.to(torch.bfloat16)

        return cls(prep(w1).contiguous(), prep(w2).contiguous())


def torch_experts(dispatched: DispatchResult, weights: TorchExpertWeights, recipe: str,
                  activation_clamp: float | None = None, fast_math: bool = True) -> torch.Tensor:
    """The expert FFN over the pool with torch ops: BF16 [P, H] in pool order (rows past the
    last expert's blocks are zero, pad rows inside them hold garbage; neither is sent).
    Numerics follow the reference: L1 rounded to BF16, clamp, SiLU, routing weight,
    requantization per recipe, L2 rounded to BF16. Reads the pool size back to the host."""
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


def kernel_experts(sym_buffer: SymmBuffer, dispatched: DispatchResult, weights: ExpertWeights,
                   activation_clamp: float | None = None, fast_math: bool = True,
                   send_to_combine: bool = False) -> torch.Tensor | None:
    """The expert FFN over the pool on our grouped-GEMM kernels: L1 + SwiGLU + requant into
    the buffer's L2 pool, then L2 into a per-buffer BF16 [P, H] tensor (reused by every call;
    valid until the next call). No host synchronization. `send_to_combine`: the L2 epilogue
    writes every row straight into its source rank's combine buffer over NVLink instead, and
    None is returned; follow with `combine(sym_buffer, None, ...)` on every rank."""
    from .expert_gemm import expert_ffn

    if weights.recipe != sym_buffer.recipe:
        raise ValueError(f"weights: recipe {weights.recipe!r} does not match the buffer's "
                         f"{sym_buffer.recipe!r}")
    state = _state(sym_buffer)
    if state.expert_out is None and not send_to_combine:
        state.expert_out = torch.empty(dispatched.num_pool_rows, sym_buffer.hidden,
                                       dtype=torch.bfloat16, device=sym_buffer.device)
    fp8 = sym_buffer.layout.has_sf
    return expert_ffn(dispatched.l1_acts, dispatched.l1_acts_sf, dispatched.l1_topk_weights,
                      dispatched.expert_recv_tokens, weights, block_m=dispatched.block_m,
                      activation_clamp=activation_clamp, fast_math=fast_math,
                      l2_acts=sym_buffer.l2_acts,
                      l2_acts_sf=sym_buffer.l2_acts_sf if fp8 else None,
                      out=None if send_to_combine else state.expert_out,
                      num_sms=state.num_sms, validate_counts=False,
                      combine_buffer=sym_buffer if send_to_combine else None)


def staged_mega_moe(sym_buffer: SymmBuffer, x: torch.Tensor | None, topk_idx: torch.Tensor | None,
                    topk_weights: torch.Tensor | None,
                    weights: TorchExpertWeights | ExpertWeights, *,
                    num_tokens: int | None = None, y: torch.Tensor | None = None,
                    activation_clamp: float | None = None, fast_math: bool = True,
                    block_m: int = DEFAULT_BLOCK_M, num_sms: int | None = None,
                    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                    validate_routing: bool | None = None,
                    l2_sends: bool = True) -> torch.Tensor:
    """One whole layer: our dispatch and combine kernels around the expert FFN, on our
    grouped-GEMM kernels (`ExpertWeights`) or torch ops (`TorchExpertWeights`). With `x=None`
    the inputs were staged already (`num_tokens` rows). Collective. `l2_sends` (with our GEMM
    kernels; measured on Hopper, compiled only on Blackwell): the L2 epilogue sends the rows to
    the source ranks' combine buffers, so the combine only reduces; False: L2 writes pool order
    and the combine kernel sends (the torch experts always do that). Every rank must pass the
    same value."""
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f"sym_buffer: expected a SymmBuffer, got {type(sym_buffer).__name__}")
    with gives_up_call_on_error(sym_buffer):  # what the calls after the dispatch would reject
        if not isinstance(weights, (ExpertWeights, TorchExpertWeights)):
            raise TypeError(f"weights: expected ExpertWeights or TorchExpertWeights, got "
                            f"{type(weights).__name__}")
        if isinstance(weights, ExpertWeights) and weights.recipe != sym_buffer.recipe:
            raise ValueError(f"weights: recipe {weights.recipe!r} does not match the buffer's "
                             f"{sym_buffer.recipe!r}")
        if y is not None:
            n = x.shape[0] if isinstance(x, torch.Tensor) else num_tokens
            _check_tensor("y", y, torch.bfloat16, (n, sym_buffer.hidden), sym_buffer.device)
    dispatched = dispatch(sym_buffer, x, topk_idx, topk_weights, num_tokens=num_tokens,
                          block_m=block_m, num_sms=num_sms,
                          cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                          validate_routing=validate_routing)
    if isinstance(weights, ExpertWeights):
        expert_out = kernel_experts(sym_buffer, dispatched, weights, activation_clamp,
                                    fast_math, send_to_combine=l2_sends)
    else:
        expert_out = torch_experts(dispatched, weights, sym_buffer.recipe, activation_clamp,
                                   fast_math)
    return combine(sym_buffer, expert_out, dispatched, y, num_sms=num_sms)


__all__ = ["DispatchResult", "ExpertWeights", "TorchExpertWeights", "combine", "dispatch",
           "kernel_experts", "staged_mega_moe", "torch_experts"]
