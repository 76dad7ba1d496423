"""DeepGEMM's Mega MoE entry points, with DeepGEMM's names, signatures and semantics.

Code written against ``deep_gemm``'s Mega MoE API runs on ours by changing the import::

    buf = get_symm_buffer_for_mega_moe(group, E, T, K, H, I, mma_type="fp8xfp4")
    l1, l2 = transform_weights_for_mega_moe((w1, sf1), (w2, sf2))     # once, at load time
    buf.x[:n].copy_(x_fp8); buf.x_sf[:n].copy_(x_sf)                   # the caller fills
    buf.topk_idx[:n].copy_(topk_idx); buf.topk_weights[:n].copy_(topk_weights)
    fp8_fp4_mega_moe(y, l1, l2, buf, activation_clamp=10.0)           # y: [n, H] BF16

(DeepGEMM's ``deep_gemm/mega/__init__.py`` at commit 54e2261.) ``n`` is ``y``'s row count. The
weights are exactly what `quant.transform_weights_for_mega_moe` returns with its default arch
(DeepGEMM's layout: L1 rows gate/up interleaved by 8, FP4 scales in UTCCP row order), with
scales of any strides (DeepGEMM's MN-major ones or our contiguous ones). Where our grouped
GEMMs run the recipe, the layer is our fused kernel where `fused.choose` picks it by default
(small calls of one-rank groups on sm_90a; ``CUTE_MEGAMOE_FUSED``), else the staged kernels.

Where the GPU has no grouped-GEMM kernels for the recipe (`tables.GEMM_RECIPES`: fp8xfp4 on
Hopper; fp8xfp8 on Blackwell), the call runs our dispatch and combine kernels with the expert
GEMMs on ``torch._grouped_mm`` over the weights dequantized to BF16 (`staged.TorchExpertWeights`):
the same numerics up to FP32 accumulation order, slower, and with one host synchronization per
call (not capturable in a CUDA graph). Converted weights are cached per source tensors (their
address, version counter, shape and strides) while those tensors live, so repeated calls do
not convert again; an in-place change of the weights is seen through the version counter
(except for inference-mode tensors, which have none).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .buffer import (
    SymmBuffer,
    get_symm_buffer_for_mega_moe,  # DeepGEMM's signature
)
from .checks import (
    check_activation,
    check_cuda_buffer,
    check_layer_output,
    check_sym_buffer,
)
from .config import LayerConfig
from .expert_gemm import ExpertWeights, _block_weight_sf, weights_recipe
from .fused import choose as choose_fused
from .fused import fused_mega_moe
from .quant import transform_weights_for_mega_moe, weight_sf_for_sm100
from .runtime import get_arch
from .staged import TorchExpertWeights, gives_up_call_on_error, staged_mega_moe
from .tables import GEMM_RECIPES

__all__ = [
    "RECIPE_SF_GRANULARITY",
    "bf16_mega_moe",
    "fp8_fp4_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
]

#: DeepGEMM's ``recipe`` argument (scale granularity: per token, per channel, per K) for each
#: FP8 buffer recipe: DeepGEMM's own (1, 1, 32) for fp8xfp4; (1, 128, 128) for our fp8xfp8
#: (per-token scales per 128, weights per 128x128 block).
RECIPE_SF_GRANULARITY = {"fp8xfp4": (1, 1, 32), "fp8xfp8": (1, 128, 128)}


def fp8_fp4_mega_moe(y: torch.Tensor, l1_weights: tuple[torch.Tensor, torch.Tensor],
                     l2_weights: tuple[torch.Tensor, torch.Tensor], sym_buffer: SymmBuffer,
                     cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                     recipe: tuple[int, int, int] = (1, 1, 32), activation: str = "swiglu",
                     activation_clamp: float | None = None,
                     fast_math: bool = True, *,
                     config: LayerConfig | None = None) -> torch.Tensor:
    """DeepGEMM's ``fp8_fp4_mega_moe``: one MoE layer with FP8 activations (collective).

    Reads the ``n = len(y)`` tokens the caller copied into ``sym_buffer.x`` / ``x_sf`` /
    ``topk_idx`` / ``topk_weights``; writes ``y`` (BF16 ``[n, H]``, every row; a token with
    every slot masked gets 0) and returns it. ``l1_weights`` / ``l2_weights``: the
    ``(weight, scale)`` pairs `transform_weights_for_mega_moe` returned: packed FP4 (int8) with
    int32 UE8M0 scales for an ``fp8xfp4`` buffer, as in DeepGEMM, or e4m3 with f32 scales for
    an ``fp8xfp8`` one (ours; ``recipe=(1, 128, 128)``). ``recipe`` must be the buffer recipe's
    (`RECIPE_SF_GRANULARITY`); ``activation`` ``'swiglu'``; ``activation_clamp`` None or
    ``>= 0``; ``cumulative_local_expert_recv_stats``: optional int32 ``[E_l]``, incremented by
    this call's received tokens per local expert. ``config`` (ours, not DeepGEMM's): the
    kernels' configuration (`config.LayerConfig`; None: the heuristics').

    Runs our kernels where the GPU has grouped-GEMM kernels for the recipe (Blackwell:
    fp8xfp4; Hopper: fp8xfp8). **On Hopper, fp8xfp4 has no grouped-GEMM kernel**: the layer
    then runs our dispatch and combine kernels around ``torch._grouped_mm`` expert
    GEMMs over the weights dequantized to BF16 once (cached; see the module doc), which reads
    the pool size back to the host (no CUDA-graph capture). Every check runs before the first
    launch; one that fails gives the call up on this rank (`SymmBuffer.skip_call`).
    """
    return _layer("fp8_fp4_mega_moe", ("fp8xfp4", "fp8xfp8"), y, l1_weights, l2_weights,
                  sym_buffer, cumulative_local_expert_recv_stats, recipe, activation,
                  activation_clamp, fast_math, config)


def bf16_mega_moe(y: torch.Tensor, l1_weights: torch.Tensor, l2_weights: torch.Tensor,
                  sym_buffer: SymmBuffer,
                  cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                  activation: str = "swiglu", activation_clamp: float | None = None,
                  fast_math: bool = True, *,
                  config: LayerConfig | None = None) -> torch.Tensor:
    """DeepGEMM's ``bf16_mega_moe``: `fp8_fp4_mega_moe` for a ``bf16xbf16`` buffer, with the
    BF16 weights `transform_weights_for_mega_moe` returned (L1 ``[E_l, 2I, H]`` interleaved,
    L2 ``[E_l, H, I]``); the caller fills ``sym_buffer.x`` (BF16), ``topk_idx`` and
    ``topk_weights``. Our grouped-GEMM kernels on Hopper and Blackwell (the latter compiled,
    never run). For our weights object use `api.mega_moe`."""
    return _layer("bf16_mega_moe", ("bf16xbf16",), y, l1_weights, l2_weights, sym_buffer,
                  cumulative_local_expert_recv_stats, None, activation, activation_clamp,
                  fast_math, config)


def _layer(name: str, recipes: tuple[str, ...], y, l1_weights, l2_weights, sym_buffer,
           stats, recipe, activation, activation_clamp, fast_math, config) -> torch.Tensor:
    check_sym_buffer(sym_buffer)
    with gives_up_call_on_error(sym_buffer):
        check_activation(activation)
        buffer_recipe = sym_buffer.recipe
        if buffer_recipe not in recipes:
            raise ValueError(f"sym_buffer: {name} takes a buffer of {' or '.join(recipes)}, "
                             f"this one is {buffer_recipe!r}")
        if recipe is not None and tuple(recipe) != RECIPE_SF_GRANULARITY[buffer_recipe]:
            raise ValueError(f"recipe: a {buffer_recipe} buffer takes "
                             f"{RECIPE_SF_GRANULARITY[buffer_recipe]}, got {recipe!r}")
        found = weights_recipe(l1_weights, "l1_weights")
        if found != buffer_recipe:
            raise TypeError(f"l1_weights: {found} weights for a {buffer_recipe} buffer")
        device = check_cuda_buffer(sym_buffer)
        n = check_layer_output(y, sym_buffer)
        weights = _weights_for(l1_weights, l2_weights, buffer_recipe, get_arch(device))
        fused = choose_fused(None, sym_buffer, weights, config=config, num_tokens=n)
    # (the layers check the rest inside their own give-up blocks, before their first launch)
    layer = fused_mega_moe if fused else staged_mega_moe
    return layer(sym_buffer, None, None, None, weights, num_tokens=n, y=y,
                 activation_clamp=activation_clamp, fast_math=fast_math,
                 cumulative_local_expert_recv_stats=stats, config=config)


# ----------------------------------------------------------------------------- weight cache

def _weights_for(l1_weights, l2_weights, recipe: str, arch: str):
    """The transformed weights as this GPU's layer reads them: `ExpertWeights` where the arch
    has grouped-GEMM kernels for the recipe (only scales are converted), else
    `TorchExpertWeights` (dequantized to BF16). Conversions are cached (`_CACHE`)."""
    if recipe not in GEMM_RECIPES[arch]:
        sources = _flat(l1_weights) + _flat(l2_weights)
        (weights,) = _CACHE.get(sources, ("torch", recipe), lambda: (
            TorchExpertWeights.from_transformed(l1_weights, l2_weights),))
        return weights
    if recipe == "bf16xbf16":  # used as given: nothing to convert
        _check_pair_types(l2_weights, torch.Tensor)
        return ExpertWeights(recipe, l1_weights, l2_weights, arch=arch)
    _check_pair_types(l2_weights, tuple)
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    if recipe == "fp8xfp8":
        def convert():
            return (_block_weight_sf(sf1, "l1_weights[1]", gate_up=True),
                    _block_weight_sf(sf2, "l2_weights[1]", gate_up=False))
    else:
        def convert():
            return weight_sf_for_sm100(sf1), weight_sf_for_sm100(sf2)
    sf1_k, sf2_k = _CACHE.get((sf1, sf2), ("kernel scales", recipe, arch), convert)
    return ExpertWeights(recipe, w1, w2, sf1_k, sf2_k, arch=arch)


def _flat(weights) -> tuple[torch.Tensor, ...]:
    return tuple(weights) if isinstance(weights, tuple) else (weights,)


def _check_pair_types(l2_weights, kind: type) -> None:
    if not isinstance(l2_weights, kind):
        what = "a (weight, scale) tuple" if kind is tuple else "a tensor"
        raise TypeError(f"l2_weights: expected {what} like l1_weights, got "
                        f"{type(l2_weights).__name__}")


def _fingerprint(t: torch.Tensor) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"weights: expected tensors, got {type(t).__name__}")
    try:
        version = t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        version = None
    return (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype, t.device)


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``t``'s memory (the base of a view): while it lives, no other
    tensor can take the address."""
    while t._base is not None:
        t = t._base
    return t


def _aliases(derived: list[torch.Tensor], sources: tuple[torch.Tensor, ...]) -> bool:
    bases = {s.untyped_storage().data_ptr() for s in sources}
    return any(d.untyped_storage().data_ptr() in bases for d in derived)


class _ConversionCache:
    """Tensors derived from weight tensors, kept while the weights live and are unchanged.

    Keyed by what was converted and each source tensor's address, version counter, shape,
    strides, dtype and device; an entry holds weak references to the sources' owning tensors
    and goes when one of them is freed (so a later tensor at the same address cannot hit it).
    A result that aliases its sources (a view, e.g. scales already MN-major) is not stored:
    it costs nothing to derive again, and storing it would keep the sources alive.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[list[weakref.ref], tuple]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, sources: tuple[torch.Tensor, ...], what: tuple,
            convert: Callable[[], tuple]) -> tuple:
        key = (what, *(_fingerprint(t) for t in sources))
        entry = self._entries.get(key)
        if entry is not None and all(ref() is not None for ref in entry[0]):
            return entry[1]
        derived = convert()
        if _aliases(_tensors(derived), sources):
            return derived
        refs: list[weakref.ref] = []
        entry = (refs, derived)
        for owner in {id(o): o for o in map(_owner, sources)}.values():
            refs.append(weakref.ref(owner, lambda _ref, key=key, entry=entry:
                                    self._drop(key, entry)))
        self._entries[key] = entry
        return derived

    def _drop(self, key: tuple, entry: tuple) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()


def _tensors(derived: tuple) -> list[torch.Tensor]:
    out = []
    for d in derived:
        if isinstance(d, torch.Tensor):
            out.append(d)
        elif isinstance(d, TorchExpertWeights):
            out += [d.w1, d.w2]
    return out


_CACHE = _ConversionCache()
