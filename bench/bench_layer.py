"""The whole layer on R GPUs: our staged layer (staging + dispatch + combine kernels around
torch grouped GEMMs) against the PyTorch-only baseline (NCCL all-to-all + the same torch
grouped GEMMs), same inputs, same run. Eager calls timed with CUDA events (the baseline needs a
host synchronization for its split sizes, so it cannot be graph-captured), median of repeats,
max over ranks.

    python -m bench.bench_layer [--tokens 128,1024,4096] [--recipe bf16xbf16]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from bench.bench_dispatch import _time
from bench.common import Results, gpu_clocks


def _worker(rank, num_ranks, port, tokens, recipe, experts, topk, hidden, inter, out_dir):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank))
    from cute_megamoe import staged
    from cute_megamoe.baseline import torch_moe_layer
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.testing.dispatch_checks import make_routing

    e_l = experts // num_ranks
    gen = torch.Generator().manual_seed(rank)
    w1 = (torch.randn(e_l, 2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e_l, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    weights = staged.TorchExpertWeights.from_bf16(w1.cuda(), w2.cuda(), recipe)
    buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, experts, max(tokens), topk, hidden,
                                       inter, mma_type=recipe)
    res = Results("layer", meta={"ranks": num_ranks, "recipe": recipe, "experts": experts,
                                 "topk": topk, "hidden": hidden, "intermediate": inter,
                                 "clocks_before": gpu_clocks()})
    for n in tokens:
        idx, w = make_routing(n, experts, topk, "random", gen)
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16).cuda()
        idx, w = idx.cuda(), w.cuda()

        def ours(x=x, idx=idx, w=w):
            staged.staged_mega_moe(buf, x, idx, w, weights, activation_clamp=10.0,
                                   validate_routing=False)

        def base(x=x, idx=idx, w=w):
            torch_moe_layer(x, idx, w, weights, num_experts=experts, recipe=recipe,
                            activation_clamp=10.0, group=dist.group.WORLD)

        t_ours, t_base = _time(ours, 5), _time(base, 5)
        flops = 2 * int((idx >= 0).sum()) * 3 * hidden * inter
        res.add(tokens=n, staged_us=t_ours * 1e6, torch_baseline_us=t_base * 1e6,
                speedup=t_base / t_ours, staged_tflops=flops / t_ours / 1e12)
    res.meta["clocks_after"] = gpu_clocks()
    if rank == 0:
        print(f"saved {res.save(out_dir or None)}")
        print(res.table(["tokens", "staged_us", "torch_baseline_us", "speedup", "staged_tflops"]))
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    p.add_argument("--tokens", default="128,1024,4096")
    p.add_argument("--recipe", default="bf16xbf16")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--port", type=int, default=29544)
    a = p.parse_args()
    mp.spawn(_worker, args=(a.ranks, a.port, [int(t) for t in a.tokens.split(",")], a.recipe,
                            a.experts, a.topk, a.hidden, a.intermediate,
                            os.environ.get("CUTE_MEGAMOE_RESULTS_DIR", "")),
             nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()
