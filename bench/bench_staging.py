"""Input staging kernel against the copy ceiling measured in the same run.

For each recipe and token count: the kernel's time (CUDA-graph replay, median), its bytes
(BF16 read + FP8/BF16 written + scales + routing), GB/s, and the ratio to a device-to-device
copy that moves the same bytes, timed the same way in the same process. Inputs rotate over
several buffers-worth of activations so small sizes are not served from L2.

    python -m bench.bench_staging [--hidden 7168] [--tokens 1,128,...]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import Results, copy_ceiling, gpu_clocks, time_cuda_graph
from cute_megamoe.api import stage_inputs
from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
from cute_megamoe.tables import RECIPES, activation_recipe

NUM_TOPK, NUM_EXPERTS = 8, 256


def staged_bytes(recipe: str, n: int, hidden: int) -> tuple[int, int]:
    read = n * hidden * 2 + n * NUM_TOPK * 12
    out = 2 if recipe == "bf16xbf16" else 1
    sf = 0 if recipe == "bf16xbf16" else n * (hidden // 128) * 4
    return read, n * hidden * out + sf + n * NUM_TOPK * 12


def _rotating_stage(buf, xs, idx, w):
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(xs)
        stage_inputs(buf, xs[state["i"]], idx, w, validate_routing=False)

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", default="1,128,512,4096,8192,16384")
    # (one recipe per activation format: the staging is the activations')
    p.add_argument("--recipes", default=",".join(r for r in RECIPES if activation_recipe(r) == r))
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    res = Results("staging", meta={"hidden": args.hidden, "num_topk": NUM_TOPK,
                                    "clocks_before": gpu_clocks()})
    for recipe in args.recipes.split(","):
        buf = get_symm_buffer_for_mega_moe(None, NUM_EXPERTS, max(tokens), NUM_TOPK,
                                           args.hidden, 2048, mma_type=recipe)
        for n in tokens:
            rotate = max(1, min(8, (256 << 20) // max(1, n * args.hidden * 2)))
            xs = [torch.randn(n, args.hidden, device="cuda", dtype=torch.bfloat16)
                  for _ in range(rotate)]
            idx = torch.randint(0, NUM_EXPERTS, (n, NUM_TOPK), device="cuda")
            w = torch.rand(n, NUM_TOPK, device="cuda")
            t = time_cuda_graph(_rotating_stage(buf, xs, idx, w))
            rd, wr = staged_bytes(recipe, n, args.hidden)
            copy_bw = copy_ceiling(rd + wr, rotate=rotate)
            bw = (rd + wr) / t
            res.add(recipe=recipe, tokens=n, time_us=t * 1e6, bytes=rd + wr,
                    gbps=bw / 1e9, copy_gbps=copy_bw / 1e9, ratio_to_copy=bw / copy_bw)
        buf.destroy()
    res.meta["clocks_after"] = gpu_clocks()
    path = res.save()
    print(f"saved {path}")
    print(res.table(["recipe", "tokens", "time_us", "gbps", "copy_gbps", "ratio_to_copy"]))


if __name__ == "__main__":
    main()
