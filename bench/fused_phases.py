"""Where the fused layer kernel's time goes, per phase (one rank, one GPU).

    python3 -m bench.fused_phases [--tokens 128 4096 8192] [--recipe fp8xfp8] [--calls 20]

Runs `kernels/sm90_mega_moe.py` compiled with `phase_clock` (every CTA writes the global timer
at its start, once the pool's prefix sums are in place, when its first (sender) warp has pushed
its rows, when its first consumer warp finished its L1 tiles and its L2 tiles, and at its end:
`PHASE_STAMPS`), over `calls` calls on staged inputs (a host sync after each; with
`--back-to-back N` each sampled call is the last of N + 1 launched without one, as layer calls
run), and reports per phase the median over calls of the time from the grid's first start to the
median / latest CTA reaching the phase's end. The stamps cost a store per CTA per phase; the
kernel is otherwise the one the layer runs (`fused_graph_us` of `bench_layer` is the
uninstrumented time). Writes `fused_phases-*.json` under `bench/results/` (or
`CUTE_MEGAMOE_RESULTS_DIR`).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import Results, gpu_clocks, random_expert_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096, 8192])
    parser.add_argument("--recipe", default="fp8xfp8")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--l2-gates", nargs="+", default=["pool_block"],
                        choices=("pool_block", "all_l1"),
                        help="L2 tiles wait for their pool block's L1 tiles, or for all")
    parser.add_argument("--extra-warpgroups", type=int, nargs="+", default=[0], choices=(0, 1),
                        help="1: a warpgroup more for dispatch and combine (BLOCK_M 64 only)")
    parser.add_argument("--rows", nargs="+", default=["barrier"],
                        choices=("barrier", "counted", "with_gemm"),
                        help="how the rows move (`sm90_mega_moe.ROW_TRANSFERS`; A/B)")
    parser.add_argument("--weights-first", type=int, nargs="+", default=[0], choices=(0, 1),
                        help="1: tiles that find their pool block not ready load their first "
                             "stages' weights before they wait (A/B)")
    parser.add_argument("--staging", nargs="+", default=["launch"], choices=("launch", "kernel"),
                        help="who stages the inputs: the staging kernel before the timed one "
                             "(its time not in the stamps) or the fused kernel's step 0 "
                             "(`CUTE_MEGAMOE_FUSED_STAGING=kernel`, in the stamps)")
    parser.add_argument("--back-to-back", type=int, default=0,
                        help="calls launched without a host sync before each sampled one (the "
                             "power-limited steady state of back-to-back layer calls)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over all variants (interleaves an A/B)")
    args = parser.parse_args()

    from cute_megamoe import api
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.heuristics import block_m_for_call
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
        "l2_gates": args.l2_gates, "extra_warpgroups": args.extra_warpgroups,
        "back_to_back": args.back_to_back,
        "clocks_before": gpu_clocks()})
    variants = [(n, g, x, r, f, st) for n in args.tokens for _ in range(args.rounds)
                for g in args.l2_gates for x in args.extra_warpgroups
                for r in args.rows for f in args.weights_first for st in args.staging]
    for n, gate, extra, rows, first, staging in variants:
        idx, w = make_routing(n, e, args.topk, "random", gen)
        x = torch.randn(n, h, generator=gen).to(torch.bfloat16).cuda()
        inputs = (x, idx.cuda(), w.cuda())
        if staging == "launch":
            api.stage_inputs(buf, *inputs, validate_routing=False)
        block_m = block_m_for_call(n, 1, args.topk, e, "sm_90a")
        if extra and block_m != 64:
            continue
        y = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")
        clock = torch.zeros(grid, len(PHASE_STAMPS), dtype=torch.int64, device="cuda")
        call = fused_call(buf, weights, n, block_m, y, grid, None, 10.0, True, phase_clock=clock,
                          l2_gate=gate, extra_warpgroups=extra,
                          row_transfer=rows, weights_first=bool(first),
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
        res.add(tokens=n, l2_gate=gate, extra_warpgroups=extra, rows=rows, weights_first=first,
                staging=staging,
                block_m=block_m, **row)
    res.meta["clocks_after"] = gpu_clocks()
    print(f"saved {res.save()}")
    print(res.table(["tokens", "staging", "rows", "weights_first", "l2_gate",
                     "extra_warpgroups", "block_m",
                     "start_spread_us", "scattered_last_us", "counts_published_last_us",
                     "counts_seen_last_us", "rows_pushed_last_us", "prefix_ready_last_us",
                     "rows_sent_last_us", "l1_us",
                     "l1_done_median_us", "l2_us", "l2_done_last_us", "combine_us",
                     "end_last_us"]))
    buf.destroy()


if __name__ == "__main__":
    main()
