"""Dispatch and combine kernels on R GPUs against NCCL all_to_all_single, same run.

For each payload recipe and tokens per rank (hidden 7168, top-8 of 256 experts by default):
* our dispatch kernel (count, prefix, scatter, rows pushed; inputs staged beforehand, not
  timed), also with the rows pulled (`transfer="pull"`, graph time only), and
  our combine kernel (send back + top-k reduce), each timed with CUDA events around a loop of
  eager calls (host launch cost included when it dominates) and around CUDA-graph replays of
  the same calls (device time only); median over repeats, the max over ranks;
* the combine modes: pool order with register copies in rounds as the heuristics pick them
  (the default), in one round, with bulk copies, and "reduce only" (`combine(buf, None, ...)`:
  the cross-rank barrier and the reduction, what is left of the combine in the layer when the
  L2 epilogue sends the rows);
* NCCL `all_to_all_single` moving the same bytes (each rank's routed rows, equal splits);
* NVLink GB/s per direction = bytes that crossed from the peers into (dispatch) or out of
  (combine) one rank, over the eager time (`*_nvl_gbps`) and over the graph time
  (`*_graph_nvl_gbps`).

    python -m bench.bench_dispatch [--ranks 2] [--tokens 1,128,512,4096,8192]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from bench.common import Results, gpu_clocks

HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8
BLOCK_M = 128


def _time(fn, iters: int, repeats: int = 7) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, in seconds,
    with every rank starting each repeat together; the max over ranks."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / iters)
    t = torch.tensor([statistics.median(samples)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _capture_graph(fn, iters: int) -> torch.cuda.CUDAGraph | None:
    """`iters` calls of `fn` captured in one CUDA graph (after one eager call); None when the
    capture fails."""
    try:
        fn()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(iters):
                    fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - report and fall back to eager timing
        print(f"graph capture failed: {type(exc).__name__}: {exc}")
        torch.cuda.synchronize()
        return None
    return graph


def _time_graph(fn, iters: int, repeats: int = 7) -> float | None:
    """Like `_time`, but `iters` calls captured in one CUDA graph (no host launch overhead);
    None when the capture fails."""
    graph = _capture_graph(fn, iters)
    return None if graph is None else _time(graph.replay, 1, repeats) / iters


def _time_graphs_interleaved(fns: dict, iters: int, rounds: int = 9) -> dict:
    """`_time_graph` of several callables at once (key: callable): each captured `iters` times
    in a graph of its own, then one replay of each per round, the order rotating, every rank
    starting each replay together. Seconds per call, median over rounds, max over ranks; None
    where a rank's capture failed. (A GPU at its power limit lowers its clock within milliseconds:
    timed in blocks, a variant inherits the power state of the one before it.)"""
    graphs = {key: _capture_graph(fn, iters) for key, fn in fns.items()}
    # (only what every rank captured: a rank timing a graph its peers lack would wait at the
    # barrier for ever)
    captured = torch.tensor([graphs[key] is not None for key in fns] or [0], device="cuda",
                            dtype=torch.int32)
    dist.all_reduce(captured, op=dist.ReduceOp.MIN)
    keys = [key for i, key in enumerate(fns) if captured[i]]
    for key in keys:  # (warm-up)
        graphs[key].replay()
    torch.cuda.synchronize()
    samples = {key: [] for key in keys}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds if keys else 0):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            graphs[key].replay()
            end.record()
            end.synchronize()
            samples[key].append(start.elapsed_time(end) / 1e3 / iters)
    medians = torch.tensor([statistics.median(samples[key]) for key in keys] or [0.0],
                           device="cuda", dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    out = dict.fromkeys(fns)
    out.update({key: float(medians[i]) for i, key in enumerate(keys)})
    return out


def _worker(rank: int, num_ranks: int, port: int, tokens: list[int], recipes: list[str],
            out_dir: str, peer_gbps: float | None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank))
    from cute_megamoe import staged
    from cute_megamoe.api import stage_inputs
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.heuristics import select_combine_rounds
    from cute_megamoe.testing.dispatch_checks import make_routing

    res = Results("dispatch_combine", meta={
        "ranks": num_ranks, "hidden": HIDDEN, "experts": NUM_EXPERTS, "topk": NUM_TOPK,
        "peer_copy_gbps": peer_gbps, "clocks_before": gpu_clocks(),
        "timing": "CUDA events over a loop of eager calls and over CUDA-graph replays, median of "
                  "7 repeats, max over ranks; inputs staged once before timing"})
    e_l = NUM_EXPERTS // num_ranks
    for recipe in recipes:
        buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, NUM_EXPERTS, max(tokens), NUM_TOPK,
                                           HIDDEN, 2048, mma_type=recipe)
        row_bytes = HIDDEN * (2 if recipe == "bf16xbf16" else 1)
        extra = 4 + (HIDDEN // 128 * 4 if recipe != "bf16xbf16" else 0)  # weight + scales
        for n in tokens:
            gen = torch.Generator().manual_seed(1000 * rank + n)
            idx, w = make_routing(n, NUM_EXPERTS, NUM_TOPK, "random", gen)
            x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
            idx, w = idx.cuda(), w.cuda()
            stage_inputs(buf, x, idx, w)
            result = staged.dispatch(buf, None, None, None, num_tokens=n, block_m=BLOCK_M)
            expert_out = torch.randn(buf.layout.num_pool_rows, HIDDEN, device="cuda",
                                     dtype=torch.bfloat16)
            y = torch.empty(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
            iters = 20 if n <= 512 else 10
            t_dispatch = _time(lambda b=buf, n=n: staged.dispatch(
                b, None, None, None, num_tokens=n, block_m=BLOCK_M), iters)
            t_combine = _time(lambda b=buf, o=expert_out, r=result, y=y: staged.combine(b, o, r, y),
                              iters)
            g_dispatch = _time_graph(lambda b=buf, n=n: staged.dispatch(
                b, None, None, None, num_tokens=n, block_m=BLOCK_M), iters)
            g_dispatch_pull = _time_graph(lambda b=buf, n=n: staged.dispatch(
                b, None, None, None, num_tokens=n, block_m=BLOCK_M, transfer="pull"), iters)
            g_combine = _time_graph(lambda b=buf, o=expert_out, r=result, y=y: staged.combine(
                b, o, r, y), iters)
            g_combine_bulk = _time_graph(lambda b=buf, o=expert_out, r=result, y=y: staged.combine(
                b, o, r, y, send_mode="bulk"), iters)
            g_combine_one_round = _time_graph(
                lambda b=buf, o=expert_out, r=result, y=y: staged.combine(
                    b, o, r, y, rounds=(8,)), iters)
            # what the combine costs in the layer when the L2 epilogue sent the rows: the
            # cross-rank barrier and the top-k reduction only
            g_combine_reduce = _time_graph(
                lambda b=buf, r=result, y=y: staged.combine(b, None, r, y), iters)

            # bytes that crossed NVLink: rows whose expert lives on another rank
            dest = torch.where(idx >= 0, idx // e_l, -1)
            sent = torch.bincount(dest[dest >= 0].flatten(), minlength=num_ranks).cpu()
            remote_rows = int(sent.sum() - sent[rank])
            stat = torch.tensor([remote_rows], device="cuda")
            dist.all_reduce(stat, op=dist.ReduceOp.MAX)
            remote_rows = int(stat)
            nvl_dispatch = remote_rows * (row_bytes + extra)
            nvl_combine = remote_rows * HIDDEN * 2

            # NCCL all-to-all of the same bytes (each rank's routed rows, equal splits)
            def a2a(nbytes, iters=iters):
                per = max(16, -(-nbytes // num_ranks // 16) * 16)
                src = torch.empty(per * num_ranks, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                return _time(lambda: dist.all_to_all_single(dst, src), iters)

            routed = int((idx >= 0).sum())
            t_nccl_d = a2a(routed * (row_bytes + extra))
            t_nccl_c = a2a(routed * HIDDEN * 2)
            res.add(recipe=recipe, tokens=n,
                    dispatch_us=t_dispatch * 1e6, nccl_dispatch_us=t_nccl_d * 1e6,
                    dispatch_graph_us=g_dispatch * 1e6 if g_dispatch else None,
                    dispatch_pull_graph_us=g_dispatch_pull * 1e6 if g_dispatch_pull else None,
                    dispatch_pull_graph_nvl_gbps=(nvl_dispatch / g_dispatch_pull / 1e9
                                                  if g_dispatch_pull else None),
                    combine_graph_us=g_combine * 1e6 if g_combine else None,
                    combine_bulk_graph_us=g_combine_bulk * 1e6 if g_combine_bulk else None,
                    combine_rounds=len(select_combine_rounds(n)),
                    combine_one_round_graph_us=(g_combine_one_round * 1e6
                                                if g_combine_one_round else None),
                    combine_reduce_only_graph_us=(g_combine_reduce * 1e6
                                                  if g_combine_reduce else None),
                    dispatch_nvl_gbps=nvl_dispatch / t_dispatch / 1e9,
                    dispatch_graph_nvl_gbps=(nvl_dispatch / g_dispatch / 1e9
                                             if g_dispatch else None),
                    combine_graph_nvl_gbps=nvl_combine / g_combine / 1e9 if g_combine else None,
                    combine_us=t_combine * 1e6, nccl_combine_us=t_nccl_c * 1e6,
                    combine_nvl_gbps=nvl_combine / t_combine / 1e9,
                    dispatch_vs_peer_copy=(nvl_dispatch / t_dispatch / 1e9 / peer_gbps
                                           if peer_gbps else None),
                    combine_vs_peer_copy=(nvl_combine / t_combine / 1e9 / peer_gbps
                                          if peer_gbps else None),
                    speedup_dispatch=t_nccl_d / t_dispatch,
                    speedup_combine=t_nccl_c / t_combine)
        buf.destroy()
        dist.barrier()
    res.meta["clocks_after"] = gpu_clocks()
    if rank == 0:
        path = res.save(out_dir or None)
        print(f"saved {path}")
        print(res.table(["recipe", "tokens", "dispatch_us", "dispatch_graph_us",
                         "dispatch_pull_graph_us",
                         "nccl_dispatch_us", "dispatch_nvl_gbps", "combine_us",
                         "combine_graph_us", "combine_rounds", "combine_one_round_graph_us",
                         "combine_bulk_graph_us",
                         "combine_reduce_only_graph_us", "nccl_combine_us",
                         "combine_nvl_gbps"]))
    dist.barrier()
    dist.destroy_process_group()


def peer_copy_gbps(nbytes: int = 470 << 20) -> float:
    """GB/s of one-direction copies from GPU 1 to GPU 0 (copy engine over NVLink), the ceiling
    the kernels' per-direction NVLink rates are compared with."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1").random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    times = []
    for _ in range(10):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    p.add_argument("--tokens", default="1,128,512,4096,8192")
    p.add_argument("--recipes", default="fp8xfp4,bf16xbf16")
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    out_dir = os.environ.get("CUTE_MEGAMOE_RESULTS_DIR", "")
    peer = peer_copy_gbps() if args.ranks >= 2 else None
    if peer is not None:
        print(f"peer copy GPU1 -> GPU0: {peer:.0f} GB/s")
    mp.spawn(_worker, args=(args.ranks, args.port, tokens, args.recipes.split(","), out_dir,
                            peer), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
