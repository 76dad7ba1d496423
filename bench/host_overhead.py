"""Where the host time of an eager layer call goes (one rank, one GPU).

    python3 -m bench.host_overhead [--tokens 1] [--recipe fp8xfp8] [--calls 200]

Times, at `tokens` tokens, R = 1, 128 experts, DeepSeek-V3 expert shape: the eager layer call
(CUDA events over back-to-back calls), the same calls in one CUDA graph, the host time of one
call's submission alone (`time.perf_counter`, no synchronization; the GPU is not the bottleneck
when the host is slower than the kernels), and a cProfile of the eager calls (the functions
with the most own time). Writes `host_overhead-*.json` under `bench/results/` (or
`CUTE_MEGAMOE_RESULTS_DIR`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from bench.common import Results, gpu_clocks


def _events_us(fn, iters: int, repeats: int = 7) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def _graph_us(fn, iters: int, repeats: int = 7) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return _events_us(graph.replay, 1, repeats) / iters


def _host_us(fn, calls: int) -> float:
    """Median host time of one call's submission (synchronizing every 10 calls so that the
    launch queue never fills)."""
    samples = []
    for i in range(calls):
        if i % 10 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1])
    parser.add_argument("--recipe", default="fp8xfp8")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args()

    from cute_megamoe import staged
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.expert_gemm import ExpertWeights
    from cute_megamoe.testing.dispatch_checks import make_routing

    gen = torch.Generator().manual_seed(0)
    wgen = torch.Generator(device="cuda").manual_seed(0)
    e, h, inter = args.experts, args.hidden, args.intermediate
    w1 = (torch.randn(e, 2 * inter, h, generator=wgen, device="cuda") / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=wgen, device="cuda") / inter**0.5).to(torch.bfloat16)
    weights = ExpertWeights.from_bf16(w1, w2, args.recipe)
    del w1, w2
    buf = get_symm_buffer_for_mega_moe(None, e, max(args.tokens), args.topk, h, inter,
                                       mma_type=args.recipe)
    res = Results("host_overhead", meta={"ranks": 1, "recipe": args.recipe, "experts": e,
                                         "topk": args.topk, "hidden": h, "intermediate": inter,
                                         "clocks_before": gpu_clocks()})
    profiles = {}
    for n in args.tokens:
        idx, w = make_routing(n, e, args.topk, "random", gen)
        x = torch.randn(n, h, generator=gen).to(torch.bfloat16).cuda()
        idx, w = idx.cuda(), w.cuda()

        def layer(x=x, idx=idx, w=w):
            staged.staged_mega_moe(buf, x, idx, w, weights, activation_clamp=10.0,
                                   validate_routing=False)

        eager = _events_us(layer, 20)
        graph = _graph_us(layer, 20)
        host = _host_us(layer, args.calls)
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for i in range(args.calls):
            layer()
            if i % 10 == 9:
                torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile_rows)
        profiles[n] = text.getvalue()
        res.add(tokens=n, eager_us=eager, graph_us=graph, eager_minus_graph_us=eager - graph,
                host_submit_us=host)
    res.meta["clocks_after"] = gpu_clocks()
    res.meta["profiles"] = profiles
    print(f"saved {res.save()}")
    for n, text in profiles.items():
        print(f"--- cProfile, {n} tokens, {args.calls} calls (own time) ---")
        print("\n".join(text.splitlines()[:args.profile_rows + 12]))
    print(res.table(["tokens", "eager_us", "graph_us", "eager_minus_graph_us",
                     "host_submit_us"]))
    buf.destroy()


if __name__ == "__main__":
    main()
