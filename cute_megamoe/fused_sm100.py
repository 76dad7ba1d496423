"""The fused layer on Blackwell (`kernels/sm100_mega_moe.py`, launched by `launch.fused_call`
on sm_100a): NOT YET WIRED into the entry points (`fused.fused_mega_moe`, `api`, `MegaMoE` still
take the staged kernels on compute capability 10.x), and never run on a Blackwell GPU: compiled
and SASS-checked only. `fused_mega_moe_sm100` stages the inputs as `fused` does and launches it,
for the `sm100` tests.
"""

from __future__ import annotations

import torch

from .buffer import SymmBuffer
from .launch import buffer_state, fused_call, staging_call

__all__ = ["fused_mega_moe_sm100"]

def fused_mega_moe_sm100(sym_buffer: SymmBuffer, x: torch.Tensor, topk_idx: torch.Tensor,
                         topk_weights: torch.Tensor, weights, y: torch.Tensor | None = None,
                         block_m: int = 128, activation_clamp: float | None = None,
                         fast_math: bool = True, num_sms: int | None = None,
                         cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                         validate_routing: bool = True) -> torch.Tensor:
    """Stage the inputs (`launch.staging_call`, as the layer entry points do) and launch the
    sm_100a fused kernel. Collective. A test helper until the kernel is wired into `fused`: no
    plan cache, and only the checks of `checks.check_routing` on the inputs."""
    from .checks import check_activation_clamp, check_routing

    layout = sym_buffer.layout
    state = buffer_state(sym_buffer)
    n = x.shape[0]
    if validate_routing:
        check_routing(topk_idx, layout.num_experts)
    if y is None:
        y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device=x.device)
    launches = [staging_call(sym_buffer, x, topk_idx, topk_weights)] if n > 0 else []
    grid = state.num_sms if num_sms is None else num_sms
    launches.append(fused_call(sym_buffer, weights, n, block_m, y, grid,
                               cumulative_local_expert_recv_stats,
                               check_activation_clamp(activation_clamp), fast_math))
    for call in launches:
        call()
    return y
