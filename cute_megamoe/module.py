"""`MegaMoE`: the layer as a ``torch.nn.Module`` a model holds, built once, called per batch.

    moe = cute_megamoe.MegaMoE(group, num_experts=256, num_max_tokens_per_rank=4096,
                               num_topk=8, hidden=7168, intermediate_hidden=2048,
                               recipe="fp8xfp8", w1=w1, w2=w2, activation_clamp=10.0)
    y = moe(x, topk_idx, topk_weights)          # x BF16 [n, H] -> y BF16 [n, H]; collective

What it owns, fixed at construction (`MegaMoEConfig`): the symmetric buffer, this rank's
expert weights in the layout its path reads, the arch, the path, every setting the ranks
must agree on (``transfer``, ``l2_sends``) or that changes bits (``activation_clamp``,
``fast_math``), so ranks built alike cannot disagree per call, and the kernels'
configuration (`config.LayerConfig`). BLOCK_M is the heuristics' choice per call
(`heuristics.block_m_for_call`) unless fixed by ``block_m``.

Paths (`MegaMoEConfig.path`):

* ``"kernels"``: CUDA, an arch with grouped-GEMM kernels for the recipe (`tables.GEMM_RECIPES`):
  every step on our kernels (`staged.staged_mega_moe` with `ExpertWeights`: staging, dispatch,
  L1, L2, combine; what ``stage_inputs`` + `api.mega_moe` run). Capturable in a CUDA graph
  (unless ``validate_routing="host"``, which synchronizes). Calls of at most
  ``fused_max_tokens`` tokens run them as one persistent kernel (`fused.fused_mega_moe`).
* ``"torch"``: CUDA, other recipes (fp8xfp4 on Hopper; fp8xfp8, fp8xfp4_sm90 on Blackwell):
  our staging, dispatch and combine kernels around ``torch._grouped_mm`` experts
  (`staged.TorchExpertWeights`); one host synchronization per call, so not capturable.
* ``"reference"``: no CUDA, or ``device='cpu'``: `reference.mega_moe_reference` for one rank
  (``group`` None), the definition of the layer (slow; for tests and CPU-only development).

``forward`` is registered as the custom op ``torch.ops.cute_megamoe.mega_moe`` (with a fake
implementation), so ``torch.compile`` traces a model holding the layer as one opaque node. In
plain eager calls (nothing tracing, plain tensors, nothing for autograd to record) ``forward``
runs the op's implementation directly: the same result without the dispatcher's host time.
Inference only (no backward).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from . import reference
from .buffer import SymmBuffer
from .checks import (
    check_activation_clamp,
    check_block_m,
    check_choice,
    check_fast_math,
    check_gemm_block_m,
    check_routing,
    check_tensor,
    routing_check,
)
from .config import LayerConfig
from .deepgemm_api import get_symm_buffer_for_mega_moe
from .expert_gemm import ExpertWeights
from .fused import fused_max_tokens as fused_token_limit
from .fused import fused_mega_moe
from .layout import BLOCK_M_MAX, MegaMoELayout
from .runtime import get_arch
from .staged import TRANSFERS, TorchExpertWeights, layer_config, staged_mega_moe
from .tables import check_recipe, has_gemm_kernels

__all__ = ["PATHS", "MegaMoE", "MegaMoEConfig"]

#: How `MegaMoE.forward` computes (see the module doc).
PATHS = ("kernels", "torch", "reference")


@dataclass(frozen=True)
class MegaMoEConfig:
    """Everything a `MegaMoE` decided at construction (read-only)."""

    recipe: str
    path: str  # one of PATHS
    arch: str | None  # "sm_90a" / "sm_100a"; None on the CPU
    activation_clamp: float | None
    fast_math: bool
    transfer: str  # "push" or "pull"; every rank must build with the same
    l2_sends: bool  # the L2 epilogue sends the rows (kernels path); every rank the same
    validate_routing: str  # "device", "host" or "off" (`checks.routing_check`)
    block_m: int | None  # None: the heuristics per call
    num_sms: int | None  # None: the buffer's default
    #: the most tokens per rank for which a call runs as one persistent kernel (the fused
    #: kernel), larger calls as the staged kernels; None: every call staged
    #: (`fused.fused_max_tokens` decided)
    fused_max_tokens: int | None = None
    layer: LayerConfig = LayerConfig()  # the kernels' configuration (None fields: heuristics)

    @property
    def fused(self) -> bool:
        """Whether some calls run the fused kernel."""
        return self.fused_max_tokens is not None


_LAYERS: dict[int, weakref.ref] = {}
_IDS = itertools.count()


class MegaMoE(torch.nn.Module):
    """An expert-parallel MoE layer (dispatch, experts with SwiGLU, combine) on our kernels.

    Args:
        group: the expert-parallel process group, or None for one process and one rank (all
            experts local). With a group, every rank constructs the layer with the same
            arguments (collective) after ``torch.cuda.set_device``, passing its own experts.
        num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden: the
            shapes (as `get_symm_buffer_for_mega_moe`; ``num_experts`` counts all ranks').
        recipe: ``'fp8xfp4'`` (DeepGEMM's, the default), ``'fp8xfp8'``, ``'bf16xbf16'`` or
            ``'fp8xfp4_sm90'`` (fp8xfp4's MXFP4 weights, decoded to FP8 on chip by the Hopper
            kernels; fp8xfp8's activations: `tables.RECIPES`).
        w1, w2: this rank's BF16 master weights ``[E_l, 2I, H]`` (rows ``[gate | up]``, not
            interleaved) and ``[E_l, H, I]``; quantized here for the recipe.
        weights: instead of ``w1``/``w2``, pre-quantized weights for this GPU:
            `expert_gemm.ExpertWeights` (the kernels path; e.g. an FP8 checkpoint loaded as
            published, `ExpertWeights.from_fp8_blocks`) or `staged.TorchExpertWeights` (the
            torch path). On the CPU the reference runs on the weights they hold
            (`ExpertWeights.dequantized`; a `TorchExpertWeights`' BF16 values).
        device: where to run; None: the current CUDA device if CUDA is available, else the
            CPU. ``'cpu'`` forces the reference.
        experts: ``'kernels'`` or ``'torch'`` to force the CUDA path; None chooses by the arch.
        activation_clamp, fast_math: the SwiGLU's clamp (None or ``>= 0``) and SiLU flavour.
        transfer, l2_sends: how rows cross (`staged.dispatch`) and whether the L2 epilogue
            sends them back (`staged.staged_mega_moe`); ranks must agree.
        validate_routing: how each call checks its expert indices (`checks.routing_check`):
            "device" (True) on the GPU, no synchronization, CUDA-graph capturable: bad slots
            (out of range, an expert named twice) are masked and recorded, and a later call
            raises them after its launch, or `check_routing_errors`; "host" also checks them
            before each launch (synchronizes, not capturable); "off" (False) raises nothing.
            None: the ``CUTE_MEGAMOE_CHECK_ROUTING`` setting ("device").
        block_m, num_sms: fixed BLOCK_M (a multiple of 16; on the kernels path one the arch's
            kernels implement) and SM count; None: per call by the heuristics / all SMs.
        fused: run the layer as one persistent kernel (`fused.fused_mega_moe`: the kernels
            path, push, L2 sends; sm_90a GPU-tested and bit-identical to the staged kernels,
            sm_100a compiled only); True raises where it cannot run, False keeps the staged
            kernels. None (default): ``config.fused``, else `fused.choose`
            (``CUTE_MEGAMOE_FUSED``): the fused kernel for calls of at most
            `heuristics.FUSED_AUTO_MAX_TOKENS` tokens of one-rank groups on sm_90a with
            fp8xfp8 / bf16xbf16 weights, else the staged kernels.
            ``self.config.fused_max_tokens`` says which runs.
        config: the kernels' configuration (`config.LayerConfig`: the grouped GEMMs', the fused
            kernel's, the experimental fused paths); None: the heuristics'. Free per rank (the
            row transfer of the fused kernel aside: see `config.Sm90FusedConfig`); any value
            gives the same outputs.
    """

    def __init__(self, group: torch.distributed.ProcessGroup | None, num_experts: int,
                 num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                 intermediate_hidden: int, recipe: str = "fp8xfp4",
                 w1: torch.Tensor | None = None, w2: torch.Tensor | None = None, *,
                 weights: ExpertWeights | TorchExpertWeights | None = None,
                 device: torch.device | str | int | None = None, experts: str | None = None,
                 activation_clamp: float | None = None, fast_math: bool = True,
                 transfer: str = "push", l2_sends: bool = True,
                 validate_routing: bool | None = None, block_m: int | None = None,
                 num_sms: int | None = None, fused: bool | None = None,
                 config: LayerConfig | None = None) -> None:
        super().__init__()
        check_recipe(recipe)
        config = layer_config(config)
        activation_clamp = check_activation_clamp(activation_clamp)
        check_fast_math(fast_math)
        check_choice("transfer", transfer, TRANSFERS)
        if not isinstance(l2_sends, bool):
            raise TypeError(f"l2_sends: expected a bool, got {type(l2_sends).__name__}")
        if experts is not None:
            check_choice("experts", experts, ("kernels", "torch"))
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused: expected None or a bool, got {type(fused).__name__}")
        if fused is not None and config.fused is not None and fused != config.fused:
            raise ValueError(f"fused: {fused}, but config.fused is {config.fused}")
        fused = config.fused if fused is None else fused
        if fused and (transfer != "push" or not l2_sends):
            raise ValueError("fused: the fused kernel pushes the rows and sends them back from "
                             "the L2 epilogue (transfer='push', l2_sends=True)")
        device = _resolve_device(device)
        num_ranks = 1 if group is None else _group_size(group)
        # the shapes, checked before anything is allocated
        layout = MegaMoELayout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                               intermediate_hidden, recipe)
        if block_m is not None:
            check_block_m(block_m, BLOCK_M_MAX)
        if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int)
                                    or num_sms < 1):
            raise ValueError(f"num_sms: expected None or a positive int, got {num_sms!r}")
        if (w1 is None) != (w2 is None):
            raise ValueError("w1, w2: give both BF16 weight tensors, or neither and `weights`")
        if (w1 is None) == (weights is None):
            raise ValueError("weights: give either w1 and w2 (BF16) or weights "
                             "(ExpertWeights / TorchExpertWeights), not both or neither")
        if w1 is not None:
            _check_master_weights(layout, w1, w2)

        arch = None
        if device.type == "cpu":
            path = "reference"
            if num_ranks != 1:
                raise ValueError("group: the CPU path runs the reference for one rank; pass "
                                 "group=None (or a group of one rank)")
            if w1 is None:  # (the reference on the weights the kernels would compute with)
                _check_prepared_weights(layout, weights, recipe, None, device)
                w1, w2 = (weights.dequantized() if isinstance(weights, ExpertWeights)
                          else (weights.w1.float(), weights.w2.float()))
            if experts is not None:
                raise ValueError(f"experts={experts!r} needs CUDA; this layer runs on {device}")
            if fused:
                raise ValueError("fused: the fused kernel needs a CUDA device (this layer runs "
                                 "the reference on the CPU)")
            self.sym_buffer: SymmBuffer | None = None
            self.weights = (w1.to(device), w2.to(device))
            fused_max_tokens = None
        else:
            arch = get_arch(device)
            path = _choose_path(arch, recipe, experts, weights)
            if path == "kernels" and block_m is not None:
                check_gemm_block_m(block_m, arch)
            if weights is None:
                w1, w2 = w1.to(device), w2.to(device)
                weights = (ExpertWeights.from_bf16(w1, w2, recipe, arch=arch)
                           if path == "kernels" else TorchExpertWeights.from_bf16(w1, w2, recipe))
            else:
                _check_prepared_weights(layout, weights, recipe, arch, device)
            with torch.cuda.device(device):
                self.sym_buffer = get_symm_buffer_for_mega_moe(
                    group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                    intermediate_hidden, mma_type=recipe, device=device)
            self.weights = weights
            if path == "kernels":
                fused_max_tokens = fused_token_limit(fused, self.sym_buffer, weights, transfer,
                                                     l2_sends, config)
            elif fused:
                raise ValueError(f"fused: it runs on the kernels path, this layer on the "
                                 f"{path} path")
            else:
                fused_max_tokens = None
        self.group = group
        self.layout = layout
        self.config = MegaMoEConfig(
            recipe=recipe, path=path, arch=arch, activation_clamp=activation_clamp,
            fast_math=fast_math, transfer=transfer, l2_sends=l2_sends,
            validate_routing=routing_check(validate_routing), block_m=block_m,
            num_sms=num_sms, fused_max_tokens=fused_max_tokens, layer=config)
        self.layer_id = next(_IDS)
        _LAYERS[self.layer_id] = weakref.ref(self)
        weakref.finalize(self, _LAYERS.pop, self.layer_id, None)

    # ------------------------------------------------------------------ properties

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.sym_buffer is None else self.sym_buffer.device

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def num_local_experts(self) -> int:
        return self.layout.num_local_experts

    @property
    def hidden(self) -> int:
        return self.layout.hidden

    def extra_repr(self) -> str:
        lay, cfg = self.layout, self.config
        return (f"num_experts={lay.num_experts}, num_ranks={lay.num_ranks}, "
                f"num_max_tokens_per_rank={lay.num_max_tokens_per_rank}, "
                f"num_topk={lay.num_topk}, hidden={lay.hidden}, "
                f"intermediate_hidden={lay.intermediate_hidden}, recipe={cfg.recipe!r}, "
                f"path={cfg.path!r}, arch={cfg.arch!r}, "
                f"fused_max_tokens={cfg.fused_max_tokens}, "
                f"device={self.device}")

    def check_routing_errors(self) -> None:
        """Wait for this rank's GPU work, then raise `ValueError` naming the first bad routing
        slot (token, slot, value) the GPU found in the calls made so far, if any (the layer's
        calls raise it themselves after a later launch; after CUDA-graph replays call this).
        Nothing on the CPU path, which checks before it runs."""
        if self.sym_buffer is not None:
            self.sym_buffer.check_routing_errors()

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``y`` (BF16 ``[n, H]``) for this rank's ``x`` (BF16 ``[n, H]``, ``n`` up to
        ``num_max_tokens_per_rank``), ``topk_idx`` (int64 ``[n, K]``, global expert indices,
        -1 masks a slot, distinct per row) and ``topk_weights`` (f32 ``[n, K]``). Collective
        with a group: every rank calls it, in the same order, also with 0 tokens."""
        if _op_would_only_run_the_impl(x, topk_idx, topk_weights):
            # what the custom op's eager kernel runs, without ~15-30 us of dispatcher
            if torch.is_grad_enabled():
                with torch.no_grad():  # as below autograd, where the op runs it
                    return self._forward_impl(x, topk_idx, topk_weights)
            return self._forward_impl(x, topk_idx, topk_weights)
        return mega_moe_op(x, topk_idx, topk_weights, self.layer_id)

    def _forward_impl(self, x: torch.Tensor, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        # the layer's own limit (the buffer rounds it up to a multiple of 128)
        limit = self.layout.num_max_tokens_per_rank
        if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] > limit:
            raise ValueError(f"x: {x.shape[0]} tokens; this layer takes 0..{limit} per rank "
                             f"(num_max_tokens_per_rank={limit})")
        if cfg.path == "reference":
            self._check_inputs(x, topk_idx, topk_weights)
            if cfg.validate_routing != "off":  # (on the CPU: no synchronization to spare)
                check_routing(topk_idx, self.layout.num_experts)
            w1, w2 = self.weights
            return reference.mega_moe_reference(
                [x], [topk_idx], [topk_weights], [w1], [w2], recipe=cfg.recipe,
                activation_clamp=cfg.activation_clamp, fast_math=cfg.fast_math).y[0]
        if torch.cuda.is_current_stream_capturing():
            # (refused alike on every rank built alike; not given up: `skip_call` would be
            # captured into the graph instead of running)
            if cfg.path == "torch":
                raise RuntimeError(
                    f"MegaMoE: the torch-experts path ({cfg.recipe} on {cfg.arch}) reads the "
                    f"pool size back to the host and cannot be captured in a CUDA graph")
            if cfg.validate_routing == "host":
                raise RuntimeError("MegaMoE: validate_routing='host' synchronizes with the "
                                   "host; build the layer with validate_routing='device' (the "
                                   "default) to capture it in a CUDA graph")
        with torch.cuda.device(self.sym_buffer.device):
            n = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
            if cfg.fused_max_tokens is not None and n <= cfg.fused_max_tokens:
                return fused_mega_moe(
                    self.sym_buffer, x, topk_idx, topk_weights, self.weights,
                    activation_clamp=cfg.activation_clamp, fast_math=cfg.fast_math,
                    block_m=cfg.block_m, num_sms=cfg.num_sms,
                    validate_routing=cfg.validate_routing, config=cfg.layer)
            return staged_mega_moe(
                self.sym_buffer, x, topk_idx, topk_weights, self.weights,
                activation_clamp=cfg.activation_clamp, fast_math=cfg.fast_math,
                block_m=cfg.block_m, num_sms=cfg.num_sms,
                validate_routing=cfg.validate_routing, l2_sends=cfg.l2_sends,
                transfer=cfg.transfer, config=cfg.layer)

    def _check_inputs(self, x, topk_idx, topk_weights) -> None:
        """The reference path's checks, with the messages of the kernel paths."""
        lay = self.layout
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise TypeError("x: expected a 2-D BF16 tensor [num_tokens, hidden]")
        n = x.shape[0]
        check_tensor("x", x, torch.bfloat16, (n, lay.hidden), self.device)
        check_tensor("topk_idx", topk_idx, torch.int64, (n, lay.num_topk), self.device)
        check_tensor("topk_weights", topk_weights, torch.float32, (n, lay.num_topk), self.device)


# ----------------------------------------------------------------------------- custom op

def _layer(layer_id: int) -> MegaMoE:
    ref = _LAYERS.get(layer_id)
    layer = None if ref is None else ref()
    if layer is None:
        raise RuntimeError(f"cute_megamoe::mega_moe: no live MegaMoE with id {layer_id}")
    return layer


@torch.library.custom_op("cute_megamoe::mega_moe", mutates_args=())
def mega_moe_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                layer_id: int) -> torch.Tensor:
    """`MegaMoE.forward` of the layer ``layer_id`` (`MegaMoE.layer_id`), as a custom op: one
    opaque node for ``torch.compile``. It reads and writes the layer's symmetric buffer,
    which is not an argument; its output is always used, so it is never pruned."""
    return _layer(layer_id)._forward_impl(x, topk_idx, topk_weights)


@mega_moe_op.register_fake
def _(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
      layer_id: int) -> torch.Tensor:
    return torch.empty_like(x)


def _op_would_only_run_the_impl(x, topk_idx, topk_weights) -> bool:
    """Whether calling `mega_moe_op` would do nothing but run `MegaMoE._forward_impl` below
    autograd: plain eager (no torch.compile / export / jit tracing, no torch-function or
    dispatch mode, no functorch transform), plain tensors (not FX proxies, fake or other
    subclasses) and no input autograd would record. Then `forward` calls the implementation
    directly; otherwise it goes through the op, so tracers see one opaque node."""
    if torch.compiler.is_compiling():  # first: dynamo folds it, and stops reading here
        return False
    return (type(x) is torch.Tensor and type(topk_idx) is torch.Tensor
            and type(topk_weights) is torch.Tensor
            and not (torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad))
            and not torch._C._is_tracing()
            and torch._C._len_torch_function_stack() == 0
            and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._functorch.peek_interpreter_stack() is None)


# ----------------------------------------------------------------------------- helpers

def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a CUDA device or 'cpu', got {dev}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device: {dev} was asked for but CUDA is not available "
                               f"(device='cpu' runs the reference)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _group_size(group) -> int:
    if not (torch.distributed.is_available()
            and isinstance(group, torch.distributed.ProcessGroup)):
        raise TypeError(f"group: expected None or a torch.distributed.ProcessGroup, got "
                        f"{type(group).__name__}")
    return group.size()


def _choose_path(arch: str, recipe: str, experts: str | None, weights) -> str:
    if isinstance(weights, ExpertWeights):
        wanted = "kernels"
    elif isinstance(weights, TorchExpertWeights):
        wanted = "torch"
    elif weights is None:
        wanted = experts or ("kernels" if has_gemm_kernels(arch, recipe) else "torch")
    else:
        raise TypeError(f"weights: expected ExpertWeights or TorchExpertWeights, got "
                        f"{type(weights).__name__}")
    if experts is not None and experts != wanted:
        raise ValueError(f"experts={experts!r} contradicts weights of type "
                         f"{type(weights).__name__}")
    if wanted == "kernels" and not has_gemm_kernels(arch, recipe):
        raise ValueError(f"experts: recipe {recipe!r} has no grouped-GEMM kernels on {arch}; "
                         f"use experts='torch' (the default there)")
    return wanted


def _check_master_weights(layout: MegaMoELayout, w1, w2) -> None:
    e_l, h, i = layout.num_local_experts, layout.hidden, layout.intermediate_hidden
    for name, w, shape in (("w1", w1, (e_l, 2 * i, h)), ("w2", w2, (e_l, h, i))):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if w.dtype != torch.bfloat16:
            raise TypeError(f"{name}: expected dtype torch.bfloat16, got {w.dtype}")
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} ([E_l, 2I, H] / [E_l, H, I] of "
                             f"this rank's experts), got {tuple(w.shape)}")


def _check_prepared_weights(layout: MegaMoELayout, weights, recipe: str, arch: str | None,
                            device: torch.device) -> None:
    e_l, h, i = layout.num_local_experts, layout.hidden, layout.intermediate_hidden
    if not isinstance(weights, (ExpertWeights, TorchExpertWeights)):
        raise TypeError(f"weights: expected ExpertWeights or TorchExpertWeights, got "
                        f"{type(weights).__name__}")
    if isinstance(weights, ExpertWeights):
        if weights.recipe != recipe:
            raise ValueError(f"weights: recipe {weights.recipe!r}, the layer's is {recipe!r}")
        if arch is not None and weights.arch != arch:
            raise ValueError(f"weights: prepared for {weights.arch}, this GPU is {arch}")
    if (weights.num_experts, weights.hidden, weights.intermediate) != (e_l, h, i):
        raise ValueError(f"weights: {weights.num_experts} experts, hidden {weights.hidden}, "
                         f"intermediate {weights.intermediate}; the layer has {e_l} local "
                         f"experts, hidden {h}, intermediate {i}")
    if weights.w1.device != device:
        raise ValueError(f"weights: on {weights.w1.device}, the layer runs on {device}")
