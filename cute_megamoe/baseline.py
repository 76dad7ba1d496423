"""The layer composed from PyTorch ops only: the baseline the kernels are benchmarked against.

    y = torch_moe_layer(x, topk_idx, topk_weights, weights, num_experts=E, recipe=..., group=g)

What the usual pre-fused pipelines do, with the same numerics as `reference.py`:
1. quantize the activations per recipe (and dequantize to BF16, exact for FP8 values);
2. sort this rank's (token, slot) pairs by destination rank; exchange the pair counts
   (`all_to_all_single`, then one host synchronization for the split sizes); exchange rows,
   local expert ids and routing weights (`all_to_all_single`);
3. sort the received rows by expert; `torch._grouped_mm` for L1; SwiGLU with the clamp and the
   routing weight; requantization per recipe; `torch._grouped_mm` for L2 (BF16 out);
4. send the rows back (`all_to_all_single`) and sum each token's slots in ascending k in FP32.

Works on any backend with `all_to_all_single` (NCCL on GPUs, gloo on the CPU for tests);
`group=None` is one rank (no communication).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import quant, reference
from .staged import TorchExpertWeights


def _exchange(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              group) -> torch.Tensor:
    out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    if group is None:
        out.copy_(tensor)
        return out
    if tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu":
        # gloo has no BF16 all-to-all: move the bits as float16 (a plain byte copy)
        dist.all_to_all_single(out.view(torch.float16), tensor.view(torch.float16), recv_splits,
                               send_splits, group=group)
    else:
        dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=group)
    return out


def torch_moe_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    weights: TorchExpertWeights, *, num_experts: int, recipe: str = "fp8xfp4",
                    activation_clamp: float | None = None, fast_math: bool = True,
                    group=None) -> torch.Tensor:
    """One MoE layer call on this rank with torch ops and `all_to_all_single` (collective)."""
    quant.check_recipe(recipe)
    num_ranks = 1 if group is None else dist.get_world_size(group)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts: {num_experts} is not a multiple of the group size "
                         f"{num_ranks}")
    num_local = num_experts // num_ranks
    if recipe == "bf16xbf16":
        acts = x
    else:
        acts = quant.dequantize_activations_for_recipe(
            quant.quantize_activations_for_recipe(x, recipe), recipe).to(torch.bfloat16)

    # 2. dispatch: pairs sorted by destination rank
    token, slot = (topk_idx >= 0).nonzero(as_tuple=True)
    expert = topk_idx[token, slot]
    order = torch.argsort(expert // num_local, stable=True)
    token, slot, expert = token[order], slot[order], expert[order]
    send_counts = torch.bincount(expert // num_local, minlength=num_ranks)
    recv_counts = torch.empty_like(send_counts)
    if group is None:
        recv_counts.copy_(send_counts)
    else:
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    recv_x = _exchange(acts[token], send_splits, recv_splits, group)
    recv_expert = _exchange(expert % num_local, send_splits, recv_splits, group)
    recv_w = _exchange(topk_weights[token, slot], send_splits, recv_splits, group)

    # 3. experts: rows grouped by local expert
    out = torch.empty_like(recv_x)
    if recv_x.shape[0] > 0:
        by_expert = torch.argsort(recv_expert, stable=True)
        offs = torch.cumsum(torch.bincount(recv_expert, minlength=num_local), 0).to(torch.int32)
        l1 = torch._grouped_mm(recv_x[by_expert], weights.w1.transpose(1, 2), offs=offs).float()
        h = reference.swiglu_reference(l1, recv_w[by_expert], activation_clamp, fast_math)
        l2_in = reference.l2_input_reference(h, recipe).to(torch.bfloat16)
        out[by_expert] = torch._grouped_mm(l2_in, weights.w2.transpose(1, 2), offs=offs)

    # 4. combine: rows back to their tokens, ascending-k FP32 sum
    back = _exchange(out, recv_splits, send_splits, group)
    per_slot = torch.zeros(*topk_idx.shape, x.shape[1], dtype=torch.bfloat16, device=x.device)
    per_slot[token, slot] = back
    return reference.combine_reference(per_slot, topk_idx)
