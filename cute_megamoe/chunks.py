"""Weight preparation in chunks of experts, in bounded device memory (issue 62).

The quantizers and layout transforms of `quant` hold several full-size float32 temporaries of
their input at once: at a model's scale (192 experts, H 7168, I 3072: 25 GiB of BF16 masters)
that is tens of GiB more than the GPU has. Every preparation step is independent per expert,
so the entry points (`quant.quantize_weights_for_recipe`, `quant.transform_weights_for_mega_moe`,
`expert_gemm.ExpertWeights.from_bf16` / `from_quantized` / `from_fp8_blocks`,
`staged.TorchExpertWeights.from_bf16`) run it on a chunk of experts at a time and copy each
chunk's result into outputs allocated once, at the first chunk (`map_experts`). The results
are bit-identical to one pass over all experts (the same operations on the same values).

How many experts per chunk (`chunk_experts`): as many as keep the step's peak temporaries
under ``PREP_BUDGET_FRACTION * output bytes + PREP_BUDGET_BYTES``, from a per-recipe model
of one expert's peak temporaries in a chunk (`quant.QUANTIZE_PEAK_BYTES`,
`quant.TRANSFORM_PEAK_FACTOR`, `expert_gemm.FROM_BF16_PEAK_BYTES`,
`expert_gemm.FROM_QUANTIZED_PEAK_FACTOR`, `expert_gemm.FROM_FP8_BLOCKS_PEAK_FACTOR`,
`staged.TORCH_WEIGHTS_PEAK_BYTES`: measured on the CPU with `testing.memory.peak_extra_bytes`
and rounded up; `tests/test_weight_prep.py` checks them; `bench/weights.py` measures the GPU). The
issue's bound on the extra device memory is ``0.25 * output + 2 GiB``; the budget keeps
0.5 GiB of it for the allocator's rounding and the small per-chunk tensors the model leaves
out. A single expert larger than the budget allows still runs alone (the bound then does not
hold: one expert's temporaries are the floor).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

__all__ = [
    "ALL_EXPERTS",
    "PREP_BUDGET_BYTES",
    "PREP_BUDGET_FRACTION",
    "chunk_experts_for",
    "map_experts",
    "num_experts_of",
]

#: The preparation's budget of temporaries: this fraction of its output's bytes plus
#: `PREP_BUDGET_BYTES` (the issue's bound is 0.25 x output + 2 GiB; 0.5 GiB of margin).
PREP_BUDGET_FRACTION = 0.25
PREP_BUDGET_BYTES = 3 << 29  # 1.5 GiB
#: ``chunk_experts`` for one chunk of all experts (a step inside a chunk of a larger one).
ALL_EXPERTS = sys.maxsize


def chunk_experts_for(num_experts: int, peak_bytes_per_expert: int, output_bytes: int,
                      chunk_experts: int | None = None) -> int:
    """Experts per chunk: ``chunk_experts`` if given (checked: a positive int), else the most
    whose modelled peak (``peak_bytes_per_expert`` each) fits the budget (module doc), at least
    one and at most ``num_experts``."""
    if chunk_experts is not None:
        if isinstance(chunk_experts, bool) or not isinstance(chunk_experts, int) \
                or chunk_experts < 1:
            raise ValueError(f"chunk_experts: expected None or a positive int, got "
                             f"{chunk_experts!r}")
        return min(chunk_experts, max(num_experts, 1))
    budget = int(PREP_BUDGET_FRACTION * output_bytes) + PREP_BUDGET_BYTES
    fits = budget // max(peak_bytes_per_expert, 1)
    return int(max(1, min(num_experts, fits)))


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _only_tensors(tree: object) -> bool:
    """Whether ``tree`` holds tensors and None only (else ``fn``'s checks name the rest)."""
    if isinstance(tree, (tuple, list)):
        return all(_only_tensors(item) for item in tree)
    return tree is None or isinstance(tree, torch.Tensor)


def _map(fn: Callable, tree: object) -> object:
    """``fn`` on every tensor of ``tree`` (a tensor, None, or tuples / lists of them)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, item) for item in tree)
    if tree is None:
        return None
    raise TypeError(f"expected tensors, None or tuples of them, got {type(tree).__name__}")


def _map2(fn: Callable, a: object, b: object) -> None:
    """``fn(x, y)`` on the tensors of two trees of one structure."""
    if isinstance(a, torch.Tensor):
        fn(a, b)
    elif isinstance(a, (tuple, list)):
        for x, y in zip(a, b, strict=True):
            _map2(fn, x, y)


def num_experts_of(tree: object) -> int:
    """The leading (expert) dim every tensor of ``tree`` shares; ValueError if they differ."""
    sizes = {t.shape[0] if t.dim() else None for t in _tensors(tree)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"expected tensors with one leading (expert) dim, got leading dims "
                         f"{sorted(str(s) for s in sizes)}")
    return sizes.pop()


def _empty_for_all(part: torch.Tensor, num_experts: int) -> torch.Tensor:
    """An empty tensor for all ``num_experts`` experts laid out as ``part`` (one chunk's
    result): expert dim outermost, the other dims in ``part``'s stride order."""
    rest = sorted(range(1, part.dim()), key=lambda d: -part.stride(d))
    order = [0, *rest]
    shape = [num_experts if d == 0 else part.shape[d] for d in order]
    full = torch.empty(shape, dtype=part.dtype, device=part.device)
    return full.permute([order.index(d) for d in range(part.dim())])


def map_experts(fn: Callable, args: tuple, chunk_experts: int) -> object:
    """``fn(*args)`` computed ``chunk_experts`` experts at a time (dim 0 of every tensor in
    ``args``, nested tuples allowed) into outputs for all experts allocated at the first chunk.
    ``fn`` must treat every expert independently and return a tensor, or tuples / lists of
    tensors and None, each with the experts on dim 0. One chunk of all experts: ``fn(*args)``
    itself (no copy; ``fn`` checks the arguments)."""
    tensors = _tensors(args)
    if (not _only_tensors(args) or not tensors or min(t.dim() for t in tensors) == 0
            or chunk_experts >= tensors[0].shape[0]):
        return fn(*args)
    num = num_experts_of(args)
    out = None
    for start in range(0, num, chunk_experts):
        stop = min(start + chunk_experts, num)
        part = fn(*_map(lambda t, a=start, b=stop: t[a:b], args))
        if out is None:
            out = _map(lambda p: _empty_for_all(p, num), part)
        _map2(lambda o, p, a=start, b=stop: o[a:b].copy_(p), out, part)
        del part  # (before the next chunk's temporaries)
    return out
