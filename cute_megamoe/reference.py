"""Pure-PyTorch reference of one whole Mega MoE call, on all ranks at once.

This module *defines* what the kernels compute, following DeepGEMM's Mega MoE (commit 54e2261:
``deep_gemm/mega/__init__.py``, ``impls/sm100_fp8_fp4_mega_moe.cuh``). It runs on CPU or CUDA
tensors (results stay on the inputs' device) and simulates every rank in one process: lists are
indexed by rank ``r`` in ``[0, R)``.

Problem: ``R`` ranks, ``E = R * E_l`` experts (rank ``r`` owns global experts
``[r * E_l, (r + 1) * E_l)``), top-k ``K``, hidden ``H``, intermediate ``I``.

    inputs  (rank r): x[n_r, H] bf16, topk_idx[n_r, K] int64 (-1 = masked slot),
                      topk_weights[n_r, K] f32
    weights (rank r): W1[E_l, 2I, H] bf16, rows [gate | up] (NOT interleaved), W2[E_l, H, I] bf16
    output  (rank r): y[n_r, H] bf16

Numerics, step by step. For every token ``t`` of every rank ``s`` and every slot ``k`` with
``e = topk_idx[s][t, k] >= 0`` (a "pair"), computed on the rank that owns ``e``:

1. **Dispatch** (exact). The pairs of expert ``e`` are listed as rows ``(src_rank, token, k)`` in
   lexicographic order (``dispatch_reference``). Kernels place pairs in pool slots in a
   scheduling-dependent order; only the counts and the set of pairs must match exactly.
2. **Input quantisation** (exact, bit-for-bit, ``quant.py``). ``x`` is quantised per recipe
   (``quantize_activations_for_recipe``: e4m3 with UE8M0 scales per 32 for ``fp8xfp4``, e4m3
   with a power-of-two f32 scale per 128 for ``fp8xfp8``) and dequantised to f32, which is exact.
   Weights likewise (``quantize_weights_for_recipe`` then ``dequantize_weights_for_recipe``,
   one expert at a time; the quantisation blocks are taken over the [gate | up] rows as given
   here, before any interleave). ``bf16xbf16`` uses the BF16 values as f32. Weights given as
   float32 are the dequantized weights already (quantized elsewhere, e.g. an FP8 checkpoint
   loaded as published: `expert_gemm.ExpertWeights.from_fp8_blocks`) and are used as given.
   ``fp8xfp4_sm90`` (Hopper has no FP4 MMA: its kernels keep ``fp8xfp4``'s MXFP4 weights in
   HBM and decode them on chip to ``fp8xfp8``'s format): activations and step 7 as
   ``fp8xfp8``; weights quantised as ``fp8xfp4`` and dequantised as their decode, e4m3 times a
   power-of-two scale per 128x128 block (``quant.fp4_weights_to_fp8_blocks``). That equals the
   FP4 weights exactly while a block's per-32 scales span at most 14 binades; a group further
   below its block's largest scale is rounded onto e4m3's grid (the defined behaviour).
   Caveat, ``fp8xfp8`` weights: their f32 scale per 128x128 block is ``amax / 448``, not a power
   of two, so ``q * sf`` rounds in f32 (kernels instead apply the scales after each 128-K
   block: a GEMM-level difference), and PyTorch evaluates that division differently on CPU and
   CUDA, so this recipe's reference depends on the device the weights live on (measured: y of
   a CPU run and a CUDA run differ in most elements by a few BF16 ulp, 1.0-2.3 % of ``|y|`` at
   H 512, I 256, where the kernels are within 0.2-0.8 % of the CUDA run: about 0.5 % of the
   weight codes move, and the L2 input's re-quantisation spreads that). Compare a kernel with
   the reference run on the same device as the kernel's weight quantisation.
3. **L1 GEMM** (tolerance). ``acc = x_deq[t] @ W1_deq[e]^T`` computed in float64 and rounded once
   to float32. Kernels accumulate in FP32 (FP8 wgmma even with limited-precision accumulation
   between promotions) in another order, so ``acc`` agrees only up to FP32 accumulation error.
4. **BF16 rounding before the activation**. ``g = bf16_rn(acc[:I])``, ``u = bf16_rn(acc[I:])``.
5. **Clamp** (exact given ``acc``). If ``activation_clamp = c`` is not None:
   ``g = min(g, c)``, ``u = clamp(u, -c, c)``: asymmetric, the gate is clamped only from above.
   Done in f32 on the BF16 values with ``c`` as a float32 (the kernel clamps in BF16 with
   ``bf16(c)``; the two agree whenever ``c`` is BF16-representable, e.g. 10).
6. **SiLU and routing weight** (tolerance). ``s = g / (1 + exp(-g))`` in float32, then
   ``h = (s * u) * w_{t,k}`` (two float32 multiplies, this order). The reference is the same
   for both values of ``fast_math``: the GPU's fast path uses ``ex2.approx`` / ``rcp.approx``
   (a few ulp), the precise path ``expf`` and IEEE division (``expf`` itself need not be
   correctly rounded, nor is ``torch.exp``); kernels are compared with a tolerance.
7. **L2 input** (exact given ``h``, ``quant.requant_fp8_pow2``). ``fp8xfp4``: e4m3 with a
   power-of-two scale per 32 features (``amax * f32(1/448)`` rounded up to a power of two, no
   amax floor); ``fp8xfp8``, ``fp8xfp4_sm90``: the same per 128 features; ``bf16xbf16``:
   ``bf16_rn(h)``. The L2
   input is the dequantised f32 value. A kernel that reproduces ``h`` bit-for-bit must
   reproduce the FP8 codes and scales bit-for-bit; an ulp of difference in ``h`` may flip a code.
8. **L2 GEMM** (tolerance). ``o = bf16_rn(f32(l2_in @ W2_deq[e]^T computed in float64))``.
9. **Combine** (exact given the ``o``), on the source rank:
   ``y[t] = bf16_rn(((0 + f32(o_k0)) + f32(o_k1)) + ...)`` over valid ``k`` in ascending ``k``,
   float32 adds with one RN rounding each (``combine_reference``). A token whose K slots are all
   masked gets ``y = 0``.
10. **Stats** (exact). ``cumulative_local_expert_recv_stats[r]`` (int32 ``[E_l]``) is incremented
    by the number of pairs each local expert received from all ranks in this call.

Building blocks exported for kernel tests: ``dispatch_reference``, ``swiglu_reference``,
``expert_ffn_reference``, ``combine_reference``; ``mega_moe_reference`` composes them and also
returns the per-expert L1 outputs ``h`` and L2 inputs so the L1 epilogue can be checked alone.

Cost: the work is batched per expert (one float64 matmul per expert and layer, over all of its
pairs); an expert's weights are quantised and dequantised only if it receives a pair, one
expert at a time, so memory stays at a few copies of one expert's weights. For H = 7168,
I = 2048 most of the CPU time is the weight quantisation (about 1.4 s per expert for
``fp8xfp4`` and 0.5 s for ``fp8xfp8`` on two cores) plus about 0.3 s per expert of float64
GEMMs for 256 pairs; on an H200 a call with 32 such experts and 4096 pairs takes 0.2 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import (
    check_activation_clamp,
    check_distinct_experts,
    check_fast_math,
    check_tensor,
)
from .quant import (
    cast_back_from_fp8,
    check_recipe,
    dequantize_activations_for_recipe,
    dequantize_weights_for_recipe,
    quantize_activations_for_recipe,
    quantize_weights_for_recipe,
    requant_fp8_pow2,
)
from .tables import activation_recipe

__all__ = [
    "MegaMoEReferenceResult",
    "combine_reference",
    "dispatch_reference",
    "expert_ffn_float64",
    "expert_ffn_reference",
    "l2_input_reference",
    "mega_moe_reference",
    "swiglu_reference",
]

# Features per power-of-two scale of the requantised L2 input, per FP8 activation recipe.
_L2_INPUT_GRAN_K = {"fp8xfp4": 32, "fp8xfp8": 128}
# Quantised recipes need H and I to be multiples of this (the coarsest scale granularity).
_FP8_ALIGN = 128


@dataclass
class MegaMoEReferenceResult:
    """Everything ``mega_moe_reference`` computes; lists are indexed by rank or global expert."""

    #: per rank, bf16 ``[n_r, H]``: the layer output.
    y: list[torch.Tensor]
    #: per rank, int32 ``[E_l]``: the input stats plus this call's receive counts (None if none
    #: were given).
    cumulative_local_expert_recv_stats: list[torch.Tensor] | None
    #: int64 ``[E]``: (token, slot) pairs received per global expert.
    expert_recv_count: torch.Tensor
    #: int64 ``[E, R]``: pairs received per (global expert, source rank).
    expert_src_recv_count: torch.Tensor
    #: per global expert, int64 ``[n_e, 3]``: rows ``(src_rank, token, k)``, lexicographic order.
    expert_pairs: list[torch.Tensor]
    #: per rank, bf16 ``[n_r, K, H]``: the L2 output ``o`` of every valid (t, k), 0 if masked.
    expert_outputs: list[torch.Tensor]
    #: per global expert, f32 ``[n_e, I]``: dequantised L2 input rows, ``expert_pairs`` order.
    l2_inputs: list[torch.Tensor]
    #: per global expert, f32 ``[n_e, I]``: SwiGLU * routing weight before requantisation.
    l1_outputs: list[torch.Tensor]


# ------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------


def dispatch_reference(
    topk_idx_list: Sequence[torch.Tensor], num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Dispatch bookkeeping of one call over all ranks.

    Args:
        topk_idx_list: per source rank, int64 ``[n_r, K]``; ``-1`` marks a masked slot.
        num_experts: ``E``, the number of global experts.

    Returns:
        ``(expert_recv_count int64 [E], expert_src_recv_count int64 [E, R], expert_pairs)``
        where ``expert_pairs[e]`` is int64 ``[n_e, 3]`` with rows ``(src_rank, token, k)``
        sorted lexicographically. All on the device of ``topk_idx_list[0]``.
    """
    if not isinstance(topk_idx_list, (list, tuple)) or len(topk_idx_list) == 0:
        raise TypeError("topk_idx_list must be a non-empty list of tensors, one per rank")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    num_ranks = len(topk_idx_list)
    device = topk_idx_list[0].device
    for r, idx in enumerate(topk_idx_list):
        _check_topk_idx(idx, r, num_experts, "topk_idx_list")
        if idx.device != device:
            raise ValueError(f"topk_idx_list[{r}] is on {idx.device}, expected {device}")

    rows = []
    for s, idx in enumerate(topk_idx_list):
        tk = torch.nonzero(idx >= 0)  # (token, k) pairs, row-major, i.e. lexicographic
        src = torch.full((tk.shape[0], 1), s, dtype=torch.int64, device=device)
        expert = idx[tk[:, 0], tk[:, 1]].unsqueeze(1)
        rows.append(torch.cat([src, tk.to(torch.int64), expert], dim=1))
    all_rows = torch.cat(rows, dim=0)  # [P, 4]: (src, token, k, expert), lexicographic per src

    # Rows are already lexicographic in (src, token, k); a stable sort by expert keeps that.
    order = torch.sort(all_rows[:, 3], stable=True).indices
    all_rows = all_rows[order]
    expert_recv_count = torch.bincount(all_rows[:, 3], minlength=num_experts)
    expert_src_recv_count = torch.bincount(
        all_rows[:, 3] * num_ranks + all_rows[:, 0], minlength=num_experts * num_ranks
    ).view(num_experts, num_ranks)
    pairs = all_rows[:, :3].contiguous()
    expert_pairs = [p.clone() for p in torch.split(pairs, expert_recv_count.tolist())]
    return expert_recv_count, expert_src_recv_count, expert_pairs


def swiglu_reference(
    acc: torch.Tensor,
    topk_weight: torch.Tensor,
    activation_clamp: float | None = None,
    fast_math: bool = True,
) -> torch.Tensor:
    """L1 epilogue up to the requantisation: ``h = (silu(g) * u) * w`` (steps 4-6).

    Args:
        acc: f32 ``[m, 2I]``, the L1 accumulator, columns in [gate | up] order.
        topk_weight: f32 ``[m]``, the routing weight of each row's (token, slot).
        activation_clamp: None (no clamp) or ``c >= 0``: gate clamped to ``<= c``, up to
            ``[-c, c]``, after both were rounded to BF16.
        fast_math: accepted for symmetry with the kernels; the reference is the same for both
            (the GPU fast path differs by a few ulp and is compared with a tolerance).

    Returns:
        f32 ``[m, I]``.
    """
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or acc.dim() != 2:
        raise TypeError(f"acc must be a 2-D float32 tensor, got {_describe(acc)}")
    if acc.shape[1] % 2 != 0:
        raise ValueError(f"acc must have an even number of columns (gate | up), got {acc.shape}")
    if (
        not isinstance(topk_weight, torch.Tensor)
        or topk_weight.dtype != torch.float32
        or tuple(topk_weight.shape) != (acc.shape[0],)
    ):
        raise TypeError(
            f"topk_weight must be a float32 tensor of shape ({acc.shape[0]},), "
            f"got {_describe(topk_weight)}"
        )
    clamp = check_activation_clamp(activation_clamp)
    check_fast_math(fast_math)

    inter = acc.shape[1] // 2
    gate = acc[:, :inter].to(torch.bfloat16).float()
    up = acc[:, inter:].to(torch.bfloat16).float()
    if clamp is not None:
        gate = torch.clamp(gate, max=clamp)
        up = torch.clamp(up, min=-clamp, max=clamp)
    silu = gate / (1.0 + torch.exp(-gate))
    return (silu * up) * topk_weight.unsqueeze(1)


def expert_ffn_reference(
    x_deq: torch.Tensor,
    topk_weight: torch.Tensor,
    w1_deq: torch.Tensor,
    w2_deq: torch.Tensor,
    recipe: str = "fp8xfp4",
    activation_clamp: float | None = None,
    fast_math: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's FFN over a batch of pairs (steps 3-8), on dequantised operands.

    Args:
        x_deq: f32 ``[m, H]``, dequantised activations (one row per pair).
        topk_weight: f32 ``[m]``, routing weights.
        w1_deq: f32 ``[2I, H]``, dequantised L1 weight, rows [gate | up].
        w2_deq: f32 ``[H, I]``, dequantised L2 weight.
        recipe: one of ``quant.RECIPES``; selects the L2 input quantisation.
        activation_clamp, fast_math: see ``swiglu_reference``.

    Returns:
        ``(h f32 [m, I], l2_in f32 [m, I], o bf16 [m, H])``: the L1 output before requantisation,
        the dequantised L2 input, and the L2 output.
    """
    check_recipe(recipe)
    for name, t in (("x_deq", x_deq), ("w1_deq", w1_deq), ("w2_deq", w2_deq)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D float32 tensor, got {_describe(t)}")
    m, hidden = x_deq.shape
    if w1_deq.shape[1] != hidden or w1_deq.shape[0] % 2 != 0:
        raise ValueError(f"w1_deq must have shape (2I, {hidden}), got {tuple(w1_deq.shape)}")
    inter = w1_deq.shape[0] // 2
    if tuple(w2_deq.shape) != (hidden, inter):
        raise ValueError(f"w2_deq must have shape ({hidden}, {inter}), got {tuple(w2_deq.shape)}")

    acc = (x_deq.double() @ w1_deq.double().T).float()
    h = swiglu_reference(acc, topk_weight, activation_clamp, fast_math)
    l2_in = l2_input_reference(h, recipe)
    o = (l2_in.double() @ w2_deq.double().T).float().to(torch.bfloat16)
    return h, l2_in, o


def expert_ffn_float64(
    x: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation_clamp: float | None = None,
) -> torch.Tensor:
    """One expert's FFN in float64 with no quantization and no intermediate rounding: the
    yardstick for what a recipe's quantization costs (each recipe's reference and its kernels
    are measured against it; they should be equally far from it).

    ``o = (silu(g) * u * w) @ w2.T`` with ``[g | u] = x @ w1.T``, the clamp as in
    ``swiglu_reference`` but on unrounded values. Any float dtype in, float64 ``[m, H]`` out.
    """
    clamp = check_activation_clamp(activation_clamp)
    acc = x.double() @ w1.double().T
    inter = acc.shape[1] // 2
    gate, up = acc[:, :inter], acc[:, inter:]
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    h = gate * torch.sigmoid(gate) * up * topk_weight.double()[:, None]
    return h @ w2.double().T


def combine_reference(expert_outputs: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Combine on the source rank (step 9).

    ``y[t] = bf16_rn(((0 + f32(o[t, k0])) + f32(o[t, k1])) + ...)`` over the valid slots
    (``topk_idx[t, k] >= 0``) in ascending ``k``; masked slots are skipped whatever they hold.

    Args:
        expert_outputs: bf16 ``[n, K, H]``.
        topk_idx: integer ``[n, K]``.

    Returns:
        bf16 ``[n, H]``.
    """
    if (
        not isinstance(expert_outputs, torch.Tensor)
        or expert_outputs.dtype != torch.bfloat16
        or expert_outputs.dim() != 3
    ):
        raise TypeError(
            f"expert_outputs must be a 3-D bf16 tensor, got {_describe(expert_outputs)}"
        )
    if (
        not isinstance(topk_idx, torch.Tensor)
        or topk_idx.dtype.is_floating_point
        or tuple(topk_idx.shape) != tuple(expert_outputs.shape[:2])
    ):
        raise TypeError(
            f"topk_idx must be an integer tensor of shape {tuple(expert_outputs.shape[:2])}, "
            f"got {_describe(topk_idx)}"
        )
    n, num_topk, hidden = expert_outputs.shape
    acc = torch.zeros((n, hidden), dtype=torch.float32, device=expert_outputs.device)
    valid = topk_idx >= 0
    for k in range(num_topk):
        # Adding +0 for a masked slot is exact (acc is never -0: it starts at +0 and an RN sum
        # is only -0 when both addends are), so this equals skipping the slot.
        term = torch.where(valid[:, k : k + 1], expert_outputs[:, k].float(), 0.0)
        acc = acc + term
    return acc.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# The whole call
# ------------------------------------------------------------------------------------------------


def mega_moe_reference(
    x: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    l1_weights: Sequence[torch.Tensor],
    l2_weights: Sequence[torch.Tensor],
    *,
    recipe: str = "fp8xfp4",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    cumulative_local_expert_recv_stats: Sequence[torch.Tensor] | None = None,
) -> MegaMoEReferenceResult:
    """One Mega MoE call on all ``R = len(x)`` ranks (see the module docstring for the numerics).

    Args:
        x: per rank, bf16 ``[n_r, H]`` (``n_r`` may differ per rank and be 0).
        topk_idx: per rank, int64 ``[n_r, K]``, values in ``[-1, E)``; -1 masks a slot.
        topk_weights: per rank, f32 ``[n_r, K]``.
        l1_weights: per rank, bf16 ``[E_l, 2I, H]`` with rows [gate | up] (not interleaved),
            quantized here for the recipe (step 2); or float32: the dequantized weights the
            kernels hold (e.g. `expert_gemm.ExpertWeights.dequantized`, weights loaded
            quantized from a checkpoint), used as they are.
        l2_weights: per rank, ``[E_l, H, I]``, of ``l1_weights``' dtype.
        recipe: ``'fp8xfp4'``, ``'fp8xfp8'``, ``'bf16xbf16'`` or ``'fp8xfp4_sm90'``.
        activation_clamp: None or ``c >= 0`` (gate ``<= c``, up in ``[-c, c]``).
        fast_math: the kernels' SiLU flavour; the reference is the same for both.
        cumulative_local_expert_recv_stats: optional, per rank int32 ``[E_l]``; not modified,
            the result holds incremented copies.

    Returns:
        A ``MegaMoEReferenceResult``, on the inputs' device.
    """
    check_recipe(recipe)
    clamp = check_activation_clamp(activation_clamp)
    check_fast_math(fast_math)
    dims = _check_inputs(
        x,
        topk_idx,
        topk_weights,
        l1_weights,
        l2_weights,
        recipe,
        cumulative_local_expert_recv_stats,
    )
    num_ranks, num_local_experts, num_topk, hidden, inter = dims
    num_experts = num_ranks * num_local_experts
    device = x[0].device

    expert_recv_count, expert_src_recv_count, expert_pairs = dispatch_reference(
        list(topk_idx), num_experts
    )

    # All ranks' rows and (token, slot) pairs, concatenated so one gather serves every source.
    tokens_per_rank = [xr.shape[0] for xr in x]
    row_offset = [0]
    for n in tokens_per_rank:
        row_offset.append(row_offset[-1] + n)
    row_offset_t = torch.tensor(row_offset[:-1], dtype=torch.int64, device=device)
    x_deq_all = torch.cat([_dequantized_activations(xr, recipe) for xr in x], dim=0)
    weights_all = torch.cat([w.reshape(-1) for w in topk_weights], dim=0)
    outputs_all = torch.zeros(
        (row_offset[-1] * num_topk, hidden), dtype=torch.bfloat16, device=device
    )

    l1_outputs: list[torch.Tensor] = []
    l2_inputs: list[torch.Tensor] = []
    for e in range(num_experts):
        pairs = expert_pairs[e]
        if pairs.shape[0] == 0:
            empty = torch.empty((0, inter), dtype=torch.float32, device=device)
            l1_outputs.append(empty)
            l2_inputs.append(empty.clone())
            continue
        owner, local = divmod(e, num_local_experts)
        w1_deq = _dequantized_weight(l1_weights[owner][local], recipe)
        w2_deq = _dequantized_weight(l2_weights[owner][local], recipe)
        rows = row_offset_t[pairs[:, 0]] + pairs[:, 1]
        slots = rows * num_topk + pairs[:, 2]
        h, l2_in, o = expert_ffn_reference(
            x_deq_all[rows], weights_all[slots], w1_deq, w2_deq, recipe, clamp, fast_math
        )
        outputs_all[slots] = o
        l1_outputs.append(h)
        l2_inputs.append(l2_in)

    expert_outputs = [
        outputs_all[row_offset[r] * num_topk : row_offset[r + 1] * num_topk].view(
            tokens_per_rank[r], num_topk, hidden
        )
        for r in range(num_ranks)
    ]
    y = [combine_reference(expert_outputs[r], topk_idx[r]) for r in range(num_ranks)]

    stats = None
    if cumulative_local_expert_recv_stats is not None:
        received = expert_recv_count.view(num_ranks, num_local_experts).to(torch.int32)
        stats = [
            cumulative_local_expert_recv_stats[r]
            + received[r].to(cumulative_local_expert_recv_stats[r].device)
            for r in range(num_ranks)
        ]

    return MegaMoEReferenceResult(
        y=y,
        cumulative_local_expert_recv_stats=stats,
        expert_recv_count=expert_recv_count,
        expert_src_recv_count=expert_src_recv_count,
        expert_pairs=expert_pairs,
        expert_outputs=expert_outputs,
        l2_inputs=l2_inputs,
        l1_outputs=l1_outputs,
    )


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _dequantized_activations(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """Step 2 for activations: f32 ``[n, H]`` holding exactly what the kernel's A operand holds."""
    if recipe == "bf16xbf16" or x.shape[0] == 0:
        return x.float()
    q = quantize_activations_for_recipe(x, recipe)
    return dequantize_activations_for_recipe(q, recipe).to(torch.float32)


def _dequantized_weight(w: torch.Tensor, recipe: str) -> torch.Tensor:
    """Step 2 for one expert's weight ``[N, K]`` bf16 -> f32 ``[N, K]`` (float32: dequantized
    already, used as it is)."""
    if w.dtype == torch.float32:
        return w
    if recipe == "bf16xbf16":
        return w.float()
    q = quantize_weights_for_recipe(w.unsqueeze(0), recipe)
    return dequantize_weights_for_recipe(q, recipe)[0].to(torch.float32)


def l2_input_reference(h: torch.Tensor, recipe: str) -> torch.Tensor:
    """Step 7: the dequantised L2 input (f32) from the L1 output ``h`` (f32)."""
    if recipe == "bf16xbf16":
        return h.to(torch.bfloat16).float()
    if h.shape[0] == 0:
        return h.clone()
    gran_k = _L2_INPUT_GRAN_K[activation_recipe(recipe)]
    q, sf = requant_fp8_pow2(h, gran_k)
    return cast_back_from_fp8(q, sf, gran_k=gran_k).to(torch.float32)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"Tensor(dtype={t.dtype}, shape={tuple(t.shape)}, device={t.device})"
    return type(t).__name__


def _check_topk_idx(idx: object, r: int, num_experts: int, name: str) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.dim() != 2:
        raise TypeError(f"{name}[{r}] must be a 2-D int64 tensor, got {_describe(idx)}")
    if idx.numel() > 0:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"{name}[{r}] holds expert index {bad}, expected -1 (masked) or [0, {num_experts})"
            )


def _check_list(name: str, value: object, num_ranks: int | None) -> int:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors (one per rank), got {_describe(value)}")
    if num_ranks is None:
        if len(value) == 0:
            raise ValueError(f"{name} must hold at least one rank")
    elif len(value) != num_ranks:
        raise ValueError(f"{name} has {len(value)} ranks, expected {num_ranks} (len(x))")
    for r, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{r}] must be a tensor, got {type(t).__name__}")
    return len(value)


def _check_rank_tensor(
    name: str,
    r: int,
    t: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int | None, ...],
    device: torch.device,
) -> tuple[int, ...]:
    """`checks.check_tensor` of rank ``r``'s entry of list ``name`` (None dims free; any
    strides); returns the shape."""
    return tuple(check_tensor(f"{name}[{r}]", t, dtype, shape, device, for_kernel=False).shape)


def _check_inputs(
    x: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    l1_weights: Sequence[torch.Tensor],
    l2_weights: Sequence[torch.Tensor],
    recipe: str,
    stats: Sequence[torch.Tensor] | None,
) -> tuple[int, int, int, int, int]:
    """Validates one call's inputs; returns ``(R, E_l, K, H, I)``."""
    num_ranks = _check_list("x", x, None)
    for name, value in (
        ("topk_idx", topk_idx),
        ("topk_weights", topk_weights),
        ("l1_weights", l1_weights),
        ("l2_weights", l2_weights),
    ):
        _check_list(name, value, num_ranks)
    if stats is not None:
        _check_list("cumulative_local_expert_recv_stats", stats, num_ranks)
    device = x[0].device

    # Weights fix E_l, I and H; BF16 masters or float32 weights as the kernels hold them.
    weight_dtype = torch.float32 if getattr(l1_weights[0], "dtype", None) == torch.float32 \
        else torch.bfloat16
    _, two_inter, hidden = _check_rank_tensor(
        "l1_weights", 0, l1_weights[0], weight_dtype, (None, None, None), device
    )
    num_local_experts = l1_weights[0].shape[0]
    if num_local_experts < 1:
        raise ValueError(
            f"l1_weights[0] must hold at least one expert, got shape {tuple(l1_weights[0].shape)}"
        )
    if two_inter == 0 or two_inter % 2 != 0 or hidden == 0:
        raise ValueError(
            f"l1_weights[0] must have shape (E_l, 2I, H) with I, H > 0, "
            f"got {tuple(l1_weights[0].shape)}"
        )
    inter = two_inter // 2
    if recipe != "bf16xbf16" and (hidden % _FP8_ALIGN or inter % _FP8_ALIGN):
        raise ValueError(
            f"recipe {recipe!r} needs H and I to be multiples of {_FP8_ALIGN}, "
            f"got H={hidden}, I={inter} (from l1_weights[0])"
        )
    for r in range(num_ranks):
        _check_rank_tensor(
            "l1_weights",
            r,
            l1_weights[r],
            weight_dtype,
            (num_local_experts, two_inter, hidden),
            device,
        )
        _check_rank_tensor(
            "l2_weights",
            r,
            l2_weights[r],
            weight_dtype,
            (num_local_experts, hidden, inter),
            device,
        )

    # Activations and routing fix K.
    num_topk = None
    for r in range(num_ranks):
        _check_rank_tensor("x", r, x[r], torch.bfloat16, (None, hidden), device)
        n = x[r].shape[0]
        if topk_idx[r].dtype != torch.int64:
            raise TypeError(f"topk_idx[{r}] must be torch.int64, got {topk_idx[r].dtype}")
        _check_rank_tensor("topk_idx", r, topk_idx[r], torch.int64, (n, num_topk), device)
        if num_topk is None:
            num_topk = topk_idx[r].shape[1]
            if num_topk < 1:
                raise ValueError(
                    f"topk_idx[{r}] must have K >= 1 columns, got shape {tuple(topk_idx[r].shape)}"
                )
        _check_topk_idx(topk_idx[r], r, num_ranks * num_local_experts, "topk_idx")
        # (as the layer: the buffer holds one slot per token per expert)
        check_distinct_experts(topk_idx[r], f"topk_idx[{r}]")
        _check_rank_tensor("topk_weights", r, topk_weights[r], torch.float32, (n, num_topk), device)
        if stats is not None:
            _check_rank_tensor(
                "cumulative_local_expert_recv_stats",
                r,
                stats[r],
                torch.int32,
                (num_local_experts,),
                device,
            )
    assert num_topk is not None
    return num_ranks, num_local_experts, num_topk, hidden, inter
