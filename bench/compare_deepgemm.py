"""Same-run comparison with DeepGEMM: our expert FFN against DeepGEMM's and torch's grouped GEMMs.

For each recipe (fp8xfp8, bf16xbf16) and (local experts, pairs per expert) of `bench_gemm`'s
configurations, on one GPU, in one process:

* ours: `expert_ffn` (L1 + SwiGLU + routing weight + FP8 requant, then L2) at the BLOCK_M the
  heuristics pick (`ours_us`) and at the other one (`ours_other_us`); `bench_gemm._ours`.
* DeepGEMM (commit 54e2261): its two grouped GEMMs, L1 ``[rows, H] x [E, 2I, H] -> BF16
  [rows, 2I]`` and L2 ``[rows, I] x [E, H, I] -> BF16 [rows, H]``, with no SwiGLU or
  requantization between them (it does less work than ours), in both of its M-grouped layouts:
  contiguous (`m_grouped_{fp8,bf16}_gemm_nt_contiguous`, each expert's rows padded to its M
  alignment, 128 on SM90, a per-row expert index, -1 on pad rows) and masked
  (`m_grouped_{fp8,bf16}_gemm_nt_masked`, ``[E, align(m, 128), K]`` with
  ``masked_m = expected_m = m``).
  `deepgemm_us` is the faster of the two, `deepgemm_layout` says which. FP8: per-token
  activation scales per 128 (already MN-major and TMA-aligned, so no layout kernel runs per
  call) and 128x128 weight block scales: DeepGEMM's SM90 1D2D recipe, the one our kernels use.
* torch: `bench_gemm._torch` (`torch._scaled_grouped_mm` with rowwise scales for FP8,
  `torch._grouped_mm` for BF16; the two GEMMs only).

Same weight tensors for ours, DeepGEMM and torch. Every variant is timed by CUDA-graph replay
after a warmup (which also runs DeepGEMM's JIT compilation), their graphs replayed in turn
(`--rounds` x 5 replays, the order rotating: the GPU's clocks drift at its power limit); each
time is the median of its replays (`bench.common.time_cuda_graphs_interleaved`), as in
`bench_gemm`. TFLOPS count
the useful work, ``6 * E * m * H * I``, for all three. Writes `bench/results/deepgemm-*.json`
(one row per (recipe, experts, pairs_per_expert)) and prints the table.

Needs a Hopper GPU and an importable `deep_gemm` (on the GPU machine:
``source .device/env.sh && source .device/deepgemm/env.sh``):

`--power SECONDS`: after the timing, each of ours, DeepGEMM (its faster layout) and torch runs
back to back for SECONDS while nvidia-smi samples board power and SM clock
(`bench.common.power_during`): watts, MHz and the energy per useful GFLOP (uJ), which at the
power limit sets the speed, and the sustained TFLOPS of those runs (``<key>_sustained_tflops``,
``ours_vs_deepgemm_sustained``: the speed a server sees under a steady load at the power
limit, where the interleaved graphs above alternate short bursts). `--power-rounds N` repeats
the three runs N times in turn and keeps the medians.

    python -m bench.compare_deepgemm [--hidden 7168] [--inter 2048] [--configs 256x256,...]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.bench_gemm import DEFAULT_CONFIGS, _ours, _random_weights, _torch
from bench.common import Results, gpu_clocks, sustained_power, time_cuda_graphs_interleaved
from cute_megamoe.expert_gemm import ExpertWeights
from cute_megamoe.heuristics import select_block_m
from cute_megamoe.utils import align, ceil_div

LAYOUTS = ("contiguous", "masked")


def _import_deep_gemm():
    """`deep_gemm`, or exit with a message saying how to get it."""
    try:
        import deep_gemm
    except Exception as exc:  # ImportError, or a broken build failing in `_C.init`
        sys.exit(f"compare_deepgemm: cannot import deep_gemm ({type(exc).__name__}: {exc}).\n"
                 "Build it on the GPU machine first: source .device/env.sh && "
                 "source .device/deepgemm/env.sh (see ../shared/deepgemm/README.md).")
    return deep_gemm


def _deepgemm(dg, recipe: str, w: ExpertWeights, m: int, layout: str):
    """DeepGEMM's L1 and L2 grouped GEMMs over ``m`` pairs per expert, on ``w``'s weights."""
    w = w.untiled_copy()  # (DeepGEMM reads them in row order)
    e, hidden, inter = w.num_experts, w.hidden, w.intermediate
    fp8 = recipe == "fp8xfp8"
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16

    def acts(*shape):
        return torch.randn(*shape, device="cuda").to(dt)

    def act_sf(*shape):  # f32 per token per 128, MN-major and TMA-aligned up front
        return dg.get_mn_major_tma_aligned_tensor(torch.rand(*shape, device="cuda") + 0.5)

    if fp8:  # 128x128 block scales of [E, N, K] weights: [E, N/128, K/128]
        b1 = (w.w1, torch.rand(e, ceil_div(2 * inter, 128), ceil_div(hidden, 128),
                               device="cuda") * 1e-3 + 1e-3)
        b2 = (w.w2, torch.rand(e, ceil_div(hidden, 128), ceil_div(inter, 128),
                               device="cuda") * 1e-3 + 1e-3)
    else:
        b1, b2 = w.w1, w.w2

    if layout == "contiguous":
        rows_per_expert = align(m, dg.get_mk_alignment_for_contiguous_layout())
        rows = e * rows_per_expert
        index = torch.arange(rows_per_expert, device="cuda").repeat(e)
        expert = torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(
            rows_per_expert)
        m_indices = torch.where(index < m, expert, -1).to(torch.int32).contiguous()
        a1, a2 = acts(rows, hidden), acts(rows, inter)
        if fp8:
            a1, a2 = (a1, act_sf(rows, hidden // 128)), (a2, act_sf(rows, inter // 128))
        d1 = torch.empty(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
        d2 = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
        gemm = dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else \
            dg.m_grouped_bf16_gemm_nt_contiguous

        def run():
            gemm(a1, b1, d1, m_indices)
            gemm(a2, b2, d2, m_indices)

        return run

    # masked: [E, max_m, K] with max_m >= one 128-row block (rows past masked_m are skipped)
    max_m = align(m, 128)
    a1, a2 = acts(e, max_m, hidden), acts(e, max_m, inter)
    if fp8:
        a1, a2 = (a1, act_sf(e, max_m, hidden // 128)), (a2, act_sf(e, max_m, inter // 128))
    d1 = torch.empty(e, max_m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    d2 = torch.empty(e, max_m, hidden, device="cuda", dtype=torch.bfloat16)
    masked_m = torch.full((e,), m, device="cuda", dtype=torch.int32)
    gemm = dg.m_grouped_fp8_gemm_nt_masked if fp8 else dg.m_grouped_bf16_gemm_nt_masked

    def run():
        gemm(a1, b1, d1, masked_m, m)
        gemm(a2, b2, d2, masked_m, m)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="EXPERTSxPAIRS_PER_EXPERT,...")
    p.add_argument("--recipes", default="fp8xfp8,bf16xbf16")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="DeepGEMM layouts to time: contiguous, masked or both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--power", type=float, default=0.0, metavar="SECONDS",
                   help="also run ours, the faster DeepGEMM layout and torch back to back for "
                        "SECONDS each, alternating, sampling board power and SM clock "
                        "(nvidia-smi): <key>_watts, <key>_mhz, <key>_uj_per_gflop (energy per "
                        "useful FLOP: at the power limit it sets the speed), "
                        "<key>_sustained_tflops")
    p.add_argument("--power-rounds", type=int, default=1, metavar="N",
                   help="with --power: the three back-to-back runs N times in turn, medians")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compare_deepgemm: needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] != 9:
        sys.exit("compare_deepgemm: our fp8xfp8 / bf16xbf16 grouped GEMMs are the sm_90a ones; "
                 "run on a Hopper GPU")
    dg = _import_deep_gemm()
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        sys.exit(f"compare_deepgemm: --layouts takes {LAYOUTS}, got {args.layouts!r}")
    hidden, inter = args.hidden, args.inter
    res = Results("deepgemm", meta={
        "hidden": hidden, "intermediate": inter, "rounds": args.rounds,
        "deep_gemm": f"{getattr(dg, '__version__', '?')} (source commit 54e2261)",
        "deepgemm_m_alignment": dg.get_mk_alignment_for_contiguous_layout(),
        "clocks_before": gpu_clocks(),
        "note": "ours: L1 + SwiGLU + requant + L2; DeepGEMM and torch: the two GEMMs only"})
    for recipe in args.recipes.split(","):
        for cfg in args.configs.split(","):
            e, m = (int(v) for v in cfg.split("x"))
            w = _random_weights(recipe, e, hidden, inter)
            flops = 6 * e * m * hidden * inter
            picked = select_block_m(m, "sm90")
            other = 64 if picked == 128 else 128
            runs = {"torch": _torch(recipe, w, m), "ours": _ours(recipe, w, m, picked),
                    "ours_other": _ours(recipe, w, m, other)}
            for layout in layouts:
                runs[f"deepgemm_{layout}"] = _deepgemm(dg, recipe, w, m, layout)
            t = time_cuda_graphs_interleaved(runs, calls_per_replay=5, replays=5 * args.rounds)
            best = min(layouts, key=lambda x: t[f"deepgemm_{x}"])
            t_dg = t[f"deepgemm_{best}"]
            row = dict(recipe=recipe, experts=e, pairs_per_expert=m, ours_block_m=picked,
                       ours_us=t["ours"] * 1e6, ours_other_block_m=other,
                       ours_other_us=t["ours_other"] * 1e6, deepgemm_us=t_dg * 1e6,
                       deepgemm_layout=best, torch_us=t["torch"] * 1e6)
            for layout in layouts:
                row[f"deepgemm_{layout}_us"] = t[f"deepgemm_{layout}"] * 1e6
            row.update(ours_tflops=flops / t["ours"] / 1e12, deepgemm_tflops=flops / t_dg / 1e12,
                       torch_tflops=flops / t["torch"] / 1e12,
                       ours_vs_deepgemm=t_dg / t["ours"], ours_vs_torch=t["torch"] / t["ours"])
            if args.power > 0:  # (after the timing rounds: the GPU is at its power limit)
                power = sustained_power({"ours": runs["ours"],
                                         "deepgemm": runs[f"deepgemm_{best}"],
                                         "torch": runs["torch"]}, args.power, args.power_rounds)
                for name, got in power.items():
                    row.update({f"{name}_watts": got["watts"], f"{name}_mhz": got["sm_mhz"],
                                f"{name}_uj_per_gflop": got["watts"] * got["seconds_per_call"]
                                / flops * 1e15,
                                f"{name}_sustained_tflops": flops / got["seconds_per_call"]
                                / 1e12})
                if "ours_sustained_tflops" in row and "deepgemm_sustained_tflops" in row:
                    row["ours_vs_deepgemm_sustained"] = (row["ours_sustained_tflops"]
                                                         / row["deepgemm_sustained_tflops"])
            res.add(**row)
            print(f"{recipe} {e}x{m}: ours {row['ours_us']:.1f} us, DeepGEMM "
                  f"{row['deepgemm_us']:.1f} us ({best}), torch {row['torch_us']:.1f} us",
                  flush=True)
            del w, runs
            torch.cuda.empty_cache()
    res.meta["clocks_after"] = gpu_clocks()
    path = res.save()
    print(f"saved {path}")
    print(res.table(["recipe", "experts", "pairs_per_expert", "ours_block_m", "ours_us",
                     "ours_other_us", "deepgemm_us", "deepgemm_layout",
                     *(f"deepgemm_{x}_us" for x in layouts), "torch_us", "ours_tflops",
                     "deepgemm_tflops", "torch_tflops", "ours_vs_deepgemm", "ours_vs_torch",
                     *([f"{k}_{v}" for k in ("ours", "deepgemm", "torch")
                        for v in ("watts", "mhz", "uj_per_gflop", "sustained_tflops")]
                       + ["ours_vs_deepgemm_sustained"] if args.power > 0 else [])]))


if __name__ == "__main__":
    main()
