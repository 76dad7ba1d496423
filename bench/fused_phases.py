"""Where the fused layer kernel's time goes, per phase (one rank, one GPU).

    python3 -m bench.fused_phases [--tokens 128 4096 8192] [--recipe fp8xfp8] [--calls 20]

Runs `kernels/sm90_mega_moe.py` compiled with its phase clock (`config.Sm90FusedConfig.debug`:
every CTA writes the global timer
at its start, once the pool's prefix sums are in place, when its first (sender) warp has pushed
its rows, when its first consumer warp finished its L1 tiles and its L2 tiles, and at its end:
`PHASE_STAMPS`), over `calls` calls on staged inputs (a host sync after each; with
`--back-to-back N` each sampled call is the last of N + 1 launched without one, as layer calls
run), and reports per phase the median over calls of the time from the grid's first start to the
median / latest CTA reaching the phase's end. The stamps cost a store per CTA per phase; the
kernel is otherwise the one the layer runs (`fused_graph_us` of `bench_layer` is the
uninstrumented time). `--config KEY=VALUE` (repeatable): the fused kernel's configuration
(`config.Sm90FusedConfig` fields, `bench.common.parse_config`; the heuristics choose the rest).
Writes `fused_phases-*.json` under `bench/results/` (or `CUTE_MEGAMOE_RESULTS_DIR`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from bench.common import Results, gpu_clocks, parse_config, random_expert_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096, 8192])
    parser.add_argument("--recipe", default="fp8xfp8")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="the fused kernel's configuration (repeatable; "
                             "config.Sm90FusedConfig fields)")
    parser.add_argument("--rows", nargs="+", default=["barrier"],
                        choices=("barrier", "counted"),
                        help="how the rows move (`config.ROW_TRANSFERS`; A/B)")
    parser.add_argument("--weights-first", type=int, nargs="+", default=[0], choices=(0, 1),
                        help="1: tiles that find their pool block not ready load their first "
                             "stages' weights before they wait (A/B)")
    parser.add_argument("--staging", nargs="+", default=["launch"], choices=("launch", "kernel"),
                        help="who stages the inputs: the staging kernel before the timed one "
                             "(its time not in the stamps) or the fused kernel's step 0 "
                             "(`Sm90FusedConfig.stages_inputs`, in the stamps)")
    parser.add_argument("--back-to-back", type=int, default=0,
                        help="calls launched without a host sync before each sampled one (the "
                             "power-limited steady state of back-to-back layer calls)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over all variants (interleaves an A/B)")
    args = parser.parse_args()
    from cute_megamoe.config import Sm90FusedConfig

    base = parse_config(args.config, Sm90FusedConfig())

    from cute_megamoe import api
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.heuristics import block_m_for_call, default_fused_config
    from cute_megamoe.kernels.sm90_mega_moe import PHASE_STAMPS
    from cute_megamoe.launch import buffer_state, fused_call
    from cute_megamoe.testing.dispatch_checks import make_routing

    gen = torch.Generator().manual_seed(0)
    e, h, inter = args.experts, args.hidden, args.intermediate
    weights = random_expert_weights(e, h, inter, args.recipe)
    buf = get_symm_buffer_for_mega_moe(None, e, max(args.tokens), args.topk, h, inter,
                                       mma_type=args.recipe)
    grid = buffer_state(buf).num_sms
    res = Results("fused_phases", meta={
        "ranks": 1, "recipe": args.recipe, "experts": e, "topk": args.topk, "hidden": h,
        "intermediate": inter, "calls": args.calls, "stamps": list(PHASE_STAMPS),
        "config": args.config, "back_to_back": args.back_to_back,
        "clocks_before": gpu_clocks()})
    variants = [(n, r, f, st) for n in args.tokens for _ in range(args.rounds)
                for r in args.rows for f in args.weights_first for st in args.staging]
    for n, rows, first, staging in variants:
        idx, w = make_routing(n, e, args.topk, "random", gen)
        x = torch.randn(n, h, generator=gen).to(torch.bfloat16).cuda()
        inputs = (x, idx.cuda(), w.cuda())
        if staging == "launch":
            api.stage_inputs(buf, *inputs, validate_routing=False)
        block_m = block_m_for_call(n, 1, args.topk, e, "sm_90a")
        config = default_fused_config(buf.layout, block_m, staging == "kernel", dataclasses.replace(
            base, row_transfer=rows, weights_first=bool(first),
            stages_inputs=staging == "kernel", debug="phase_clock"))
        y = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")
        clock = torch.zeros(grid, len(PHASE_STAMPS), dtype=torch.int64, device="cuda")
        call = fused_call(buf, weights, n, y, grid, None, 10.0, True, config, debug=clock,
                          inputs=inputs if staging == "kernel" else None)
        for _ in range(3):
            call()
        samples = []
        for _ in range(args.calls):
            for _ in range(args.back_to_back + 1):
                call()
            stamps = clock.cpu()  # (the stamps of the last call)
            # from the grid's first start; per phase end: the median and the latest CTA
            rel = (stamps - stamps[:, 0].min()).double() / 1e3
            samples.append({f"{name}_{stat}": float(fn(rel[:, i]))
                            for i, name in enumerate(PHASE_STAMPS[1:], 1)
                            if bool(stamps[:, i].any())  # (FP4 weights' stamps: only theirs)
                            for stat, fn in (("median_us", torch.median),
                                             ("last_us", torch.max))})
            samples[-1]["start_spread_us"] = float(rel[:, 0].max())
        row = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        row["l1_us"] = row["l1_done_median_us"] - row["prefix_ready_median_us"]
        row["l2_us"] = row["l2_done_median_us"] - row["l1_done_median_us"]
        row["combine_us"] = row["end_median_us"] - row["l2_done_last_us"]
        res.add(tokens=n, rows=rows, weights_first=first, staging=staging, block_m=block_m,
                local_dispatch=config.local_dispatch, **row)
    res.meta["clocks_after"] = gpu_clocks()
    print(f"saved {res.save()}")
    print(res.table(["tokens", "staging", "rows", "weights_first", "local_dispatch", "block_m",
                     "start_spread_us", "scattered_last_us", "counts_published_last_us",
                     "counts_seen_last_us", "rows_pushed_last_us", "prefix_ready_last_us",
                     "rows_sent_last_us", "l1_us",
                     "l1_done_median_us", "l2_us", "l2_done_last_us", "combine_us",
                     "end_last_us"]))
    buf.destroy()


if __name__ == "__main__":
    main()
