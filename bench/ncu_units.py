"""Nsight Compute unit use of our expert FFN's two grouped GEMMs, one row per kernel variant and
GEMM: time, SM clock, tensor-pipe use per active cycle, instructions, DRAM and L2 throughput.

Each variant runs in a process of its own under ``ncu --clock-control none`` (the clocks as the
power state sets them, as in the timed runs) with its GEMM configuration: two warm-up
calls of `expert_ffn` on random pools (the `bench_gemm` pools, every expert with the same pairs),
then one profiled call (between ``cudaProfilerStart`` / ``Stop``), so the profile holds exactly
its L1 and its L2 launch. A diagnostic beside the interleaved timers (Method in
docs/performance.md): one launch per GEMM and build, not a speed comparison.

    python -m bench.ncu_units [--recipe fp8xfp8] [--shape 32x1024] [--block-m 128] \\
        [--config KEY=VALUE]... [--variant NAME[:KEY=VALUE[,KEY=VALUE...]]]...

(on the GPU machine, ncu on PATH). ``--config`` (repeatable): every variant's GEMM configuration
(`config.Sm90GemmConfig` fields, `bench.common.parse_config`); ``--variant default`` (the
default) runs it as it is; ``--variant unroll1:k_unroll=1`` one with that setting too;
``--stalls`` adds the issue-slot
share and the warps stalled per issued instruction by reason (`STALL_METRICS`; e.g. an
instruction-cache miss shows as ``no_instruction``). Writes ``ncu_units-<date>.json``.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys

#: JSON key: (ncu metric, factor to the key's unit)
METRICS = {
    "us": ("gpu__time_duration.sum", 1e-3),
    "sm_ghz": ("sm__cycles_elapsed.avg.per_second", 1e-9),
    "tensor_pct": ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", 1.0),
    "minst": ("smsp__inst_executed.sum", 1e-6),
    "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "lts_pct": ("lts__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
}
#: `--stalls`: the share of issue slots taken, and per stall reason the warps stalled on it per
#: issue-active cycle (Nsight Compute's WarpStateStats ratios; their sum is the warps waiting
#: per issued instruction)
STALL_REASONS = ("no_instruction", "barrier", "long_scoreboard", "short_scoreboard", "wait",
                 "mio_throttle", "math_pipe_throttle", "dispatch_stall", "branch_resolving",
                 "sleeping", "membar", "lg_throttle", "selected", "not_selected", "misc")
STALL_METRICS = {
    "issue_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", 1.0),
    **{f"stall_{r}": (f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio", 1.0)
       for r in STALL_REASONS},
}
PHASES = ("l1", "l2")  # the profiled call's launches, in order


def parse_ncu_csv(text: str, metrics: dict | None = None) -> list[dict[str, float]]:
    """The ``metrics`` (`METRICS` unless given: JSON key -> (ncu metric, factor)) of each
    kernel launch in ``ncu --csv --metrics ...`` output (one row per launch and metric; ncu's
    own ``==PROF==`` lines and the program's output skipped), in launch order."""
    metrics = METRICS if metrics is None else metrics
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return []
    launches: dict[int, dict[str, float]] = {}
    names = {metric: key for key, (metric, _f) in metrics.items()}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        key = names.get(row["Metric Name"])
        if key is not None:
            value = float(row["Metric Value"].replace(",", "")) * metrics[key][1]
            launches.setdefault(int(row["ID"]), {})[key] = value
    return [launches[i] for i in sorted(launches)]


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``NAME[:KEY=VALUE[,KEY=VALUE...]]`` -> (name, settings), the settings checked
    (`config.Sm90GemmConfig` fields)."""
    from bench.common import parse_config
    from cute_megamoe.config import Sm90GemmConfig

    name, _, settings = spec.partition(":")
    if not name:
        raise SystemExit(f"--variant: a name first, got {spec!r}")
    pairs = [pair for pair in settings.split(",") if pair]
    parse_config(pairs, Sm90GemmConfig(), "--variant")
    return name, pairs


def _profiled_call(recipe: str, experts: int, pairs: int, block_m: int,
                   settings: list[str]) -> None:
    """The child process: two warm-up calls, then one between the profiler's start and stop."""
    import torch

    from bench.bench_gemm import _ours, _random_weights
    from bench.common import parse_config
    from cute_megamoe.config import Sm90GemmConfig

    config = parse_config(settings, Sm90GemmConfig())
    run = _ours(recipe, _random_weights(recipe, experts, 7168, 2048), pairs, block_m, config)
    run()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="fp8xfp8")
    p.add_argument("--shape", default="32x1024", help="EXPERTSxPAIRS_PER_EXPERT")
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="every variant's GEMM configuration (repeatable)")
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--stalls", action="store_true",
                   help="also the issue-slot share and the warps stalled per issued "
                        "instruction by reason (STALL_METRICS)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    experts, pairs = (int(v) for v in args.shape.split("x"))
    if args.child:
        _profiled_call(args.recipe, experts, pairs, args.block_m, args.config)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on PATH")
    from bench.common import Results, gpu_clocks

    parse_variant("config:" + ",".join(args.config))  # (checked before any GPU work)
    variants = [parse_variant(v) for v in (args.variant or ["default"])]
    wanted = {**METRICS, **(STALL_METRICS if args.stalls else {})}
    res = Results("ncu_units", meta={"recipe": args.recipe, "shape": args.shape,
                                     "config": args.config,
                                     "block_m": args.block_m, "hidden": 7168,
                                     "intermediate": 2048, "clocks_before": gpu_clocks(),
                                     "variants": dict(variants),
                                     "metrics": {k: m for k, (m, _f) in wanted.items()}})
    metrics = ",".join(m for m, _f in wanted.values())
    for name, settings in variants:
        config_args = [arg for setting in (*args.config, *settings)
                       for arg in ("--config", setting)]
        out = subprocess.run(
            [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv",
             "--metrics", metrics, sys.executable, "-m", "bench.ncu_units", "--child",
             "--recipe", args.recipe, "--shape", args.shape, "--block-m", str(args.block_m),
             *config_args], capture_output=True, text=True, timeout=600)
        launches = parse_ncu_csv(out.stdout, wanted)
        if len(launches) != len(PHASES):
            raise SystemExit(f"{name}: expected {len(PHASES)} profiled launches, got "
                             f"{len(launches)}\n{out.stderr[-2000:]}")
        for phase, values in zip(PHASES, launches, strict=True):
            res.add(variant=name, phase=phase, **values)
    res.meta["clocks_after"] = gpu_clocks()
    print(f"saved {res.save()}")
    print(res.table(["variant", "phase", *wanted]))


if __name__ == "__main__":
    main()
