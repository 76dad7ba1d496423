"""A script written against DeepGEMM's Mega MoE API, run on ours by changing only the import.

The script part (``run`` and ``main``) uses nothing but DeepGEMM's names: the buffer with its
views (the caller fills ``x``, ``x_sf``, ``topk_idx``, ``topk_weights``), the weight transform,
``fp8_fp4_mega_moe`` / ``bf16_mega_moe``, and DeepGEMM's FP4/FP8 casts. To run it on DeepGEMM
(SM100 only), replace the import block below with::

    import deep_gemm
    from deep_gemm.utils import per_token_cast_to_fp4, per_token_cast_to_fp8

On ours it runs both recipes on Hopper (fp8xfp4 through the torch-experts fallback, bf16xbf16
on our kernels) and on Blackwell (both on our kernels). Standalone, on a GPU::

    python tests/test_deepgemm_api_script.py [--tokens 200]         # or under torchrun

The tests: DeepGEMM's signatures, on the CPU; the script on CUDA (``gpu``) against our
reference, with the receive statistics exact.
"""

import argparse
import gc
import inspect
import os

import pytest
import torch
import torch.distributed as dist

# --- the only lines that differ from the DeepGEMM version -------------------------------------
import cute_megamoe as deep_gemm
from cute_megamoe.quant import per_token_cast_to_fp4, per_token_cast_to_fp8

# ----------------------------------------------------------------------------------------------


def init_dist() -> tuple:
    """(group, rank, num_ranks): torchrun's group, or a one-rank NCCL group."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def fp4_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] BF16 -> (packed FP4 [E, N, K/2], UE8M0 scales per 32, packed four per int32,
    [E, N, K/128], MN-major as DeepGEMM's layout helpers lay them out)."""
    pairs = [per_token_cast_to_fp4(w[e], use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
             for e in range(w.shape[0])]
    sf = torch.stack([sf for _, sf in pairs])
    return torch.stack([q for q, _ in pairs]), sf.transpose(1, 2).contiguous().transpose(1, 2)


def run(recipe: str, num_tokens: int = 200, num_experts: int = 16, num_topk: int = 4,
        hidden: int = 1024, intermediate: int = 512, seed: int = 0, calls: int = 2) -> dict:
    """One layer as a DeepGEMM user writes it; returns its inputs and outputs (this rank's)."""
    group, rank, num_ranks = init_dist()
    e_l = num_experts // num_ranks
    gen = torch.Generator().manual_seed(seed + rank)
    w1 = (torch.randn(e_l, 2 * intermediate, hidden, generator=gen) / hidden**0.5)
    w2 = (torch.randn(e_l, hidden, intermediate, generator=gen) / intermediate**0.5)
    w1, w2 = w1.to(torch.bfloat16).cuda(), w2.to(torch.bfloat16).cuda()

    buf = deep_gemm.get_symm_buffer_for_mega_moe(group, num_experts, num_tokens, num_topk,
                                                 hidden, intermediate, mma_type=recipe)
    if recipe == "fp8xfp4":
        l1, l2 = deep_gemm.transform_weights_for_mega_moe(fp4_weights(w1), fp4_weights(w2))
        layer = deep_gemm.fp8_fp4_mega_moe
    else:
        l1, l2 = deep_gemm.transform_weights_for_mega_moe(w1, w2)
        layer = deep_gemm.bf16_mega_moe

    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    topk_weights, topk_idx = torch.topk(scores.softmax(-1), num_topk, dim=-1)
    masked = torch.rand(num_tokens, num_topk, generator=gen) < 0.1
    masked[:2] = True  # tokens with every slot masked
    topk_idx = topk_idx.masked_fill(masked, -1).cuda()
    topk_weights = topk_weights.masked_fill(masked, 0.0).float().cuda()

    stats = torch.zeros(e_l, dtype=torch.int32, device="cuda")
    for _ in range(calls):
        # the caller fills the buffer before every call
        if recipe == "fp8xfp4":
            x_fp8, x_sf = per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32,
                                                use_packed_ue8m0=True)
            buf.x[:num_tokens].copy_(x_fp8)
            buf.x_sf[:num_tokens].copy_(x_sf)
        else:
            buf.x[:num_tokens].copy_(x)
        buf.topk_idx[:num_tokens].copy_(topk_idx)
        buf.topk_weights[:num_tokens].copy_(topk_weights)
        y = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
        layer(y, l1, l2, buf, cumulative_local_expert_recv_stats=stats, activation_clamp=10.0)
    torch.cuda.synchronize()

    # what the script itself can check: every output finite, masked tokens 0, the stats
    received = torch.zeros(num_experts, dtype=torch.int64, device="cuda")
    all_idx = [torch.empty_like(topk_idx) for _ in range(num_ranks)]
    dist.all_gather(all_idx, topk_idx, group=group)
    for idx in all_idx:
        received += torch.bincount(idx[idx >= 0], minlength=num_experts)
    assert bool(torch.isfinite(y.float()).all())
    assert bool((y[masked.cuda().all(dim=1)] == 0).all())
    expected_stats = calls * received[rank * e_l:(rank + 1) * e_l]
    assert torch.equal(stats.long(), expected_stats)
    buf.destroy()
    return dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, w1=w1, w2=w2, y=y,
                stats=stats, rank=rank, num_ranks=num_ranks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args()
    for recipe in ("fp8xfp4", "bf16xbf16"):
        out = run(recipe, args.tokens)
        print(f"rank {out['rank']}: {recipe}: y {tuple(out['y'].shape)}, |y| max "
              f"{float(out['y'].float().abs().max()):.4f}, stats {out['stats'].tolist()}")


# ----------------------------------------------------------------------------------------------
# tests (ours: not part of the script)
# ----------------------------------------------------------------------------------------------

E = inspect.Parameter.empty
#: DeepGEMM's Mega MoE API (deep_gemm/mega/__init__.py at 54e2261): (name, default) in order.
DEEPGEMM_SIGNATURES = {
    "fp8_fp4_mega_moe": [("y", E), ("l1_weights", E), ("l2_weights", E), ("sym_buffer", E),
                         ("cumulative_local_expert_recv_stats", None), ("recipe", (1, 1, 32)),
                         ("activation", "swiglu"), ("activation_clamp", None),
                         ("fast_math", True)],
    "bf16_mega_moe": [("y", E), ("l1_weights", E), ("l2_weights", E), ("sym_buffer", E),
                      ("cumulative_local_expert_recv_stats", None), ("activation", "swiglu"),
                      ("activation_clamp", None), ("fast_math", True)],
    "get_symm_buffer_for_mega_moe": [
        ("group", E), ("num_experts", E), ("num_max_tokens_per_rank", E), ("num_topk", E),
        ("hidden", E), ("intermediate_hidden", E), ("use_fp8_dispatch", None),
        ("mma_type", "fp8xfp4"), ("activation", "swiglu")],
    "transform_weights_for_mega_moe": [("l1_weights", E), ("l2_weights", E),
                                       ("activation", "swiglu")],
}


def _params(fn) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


@pytest.mark.parametrize("name", sorted(DEEPGEMM_SIGNATURES))
def test_signatures_match_deepgemm(name):
    """Every DeepGEMM parameter, in DeepGEMM's order, positional-or-keyword, with DeepGEMM's
    default; the entry points have no other parameter but our keyword-only ``config``, the
    other functions only optional ones after DeepGEMM's."""
    want = DEEPGEMM_SIGNATURES[name]
    got = _params(getattr(deep_gemm, name))
    assert [(p.name, p.default) for p in got[:len(want)]] == want
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in got[:len(want)])
    extra = got[len(want):]
    if name in ("fp8_fp4_mega_moe", "bf16_mega_moe"):
        assert [(p.name, p.kind, p.default) for p in extra] == [
            ("config", inspect.Parameter.KEYWORD_ONLY, None)]
    assert all(p.default is not E for p in extra)
    assert name in deep_gemm.__all__


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ("fp8xfp4", "bf16xbf16"))
def test_script_runs_against_our_reference(recipe, monkeypatch):
    from cute_megamoe import deepgemm_api
    from cute_megamoe.reference import mega_moe_reference
    from cute_megamoe.runtime import get_arch
    from cute_megamoe.tables import has_gemm_kernels
    from cute_megamoe.testing.dispatch_checks import LAYER_TOLERANCE

    conversions = []

    class CountingCache(deepgemm_api._ConversionCache):
        def get(self, sources, what, convert):
            return super().get(sources, what, lambda: conversions.append(what) or convert())

    monkeypatch.setattr(deepgemm_api, "_CACHE", CountingCache())
    out = run(recipe, calls=3)
    if out["num_ranks"] != 1:
        pytest.skip("compared with the reference on one rank")
    ref = mega_moe_reference([out["x"]], [out["topk_idx"]], [out["topk_weights"]],
                             [out["w1"]], [out["w2"]], recipe=recipe, activation_clamp=10.0)
    want = ref.y[0].double()
    err = float((out["y"].double() - want).norm() / want.norm())
    assert err < LAYER_TOLERANCE[recipe], f"{recipe}: rel. error {err:.3g}"
    assert torch.equal(out["stats"].cpu(), 3 * ref.expert_recv_count.to(torch.int32).cpu())
    if not has_gemm_kernels(get_arch(), recipe):  # torch experts: weights dequantized once
        assert conversions == [("torch", recipe)]
    gc.collect()
    assert len(deepgemm_api._CACHE) == 0  # the entries went with the script's weights


if __name__ == "__main__":
    main()
