"""Reliability soak: several processes on one GPU, each looping random fused layer calls,
every one checked bit for bit against the staged layer.

    python -m bench.soak --processes 4 --ranks 1 --seconds 120
    python -m bench.soak --processes 4 --ranks 2 --seconds 120 --row-transfer counted,barrier

Each process builds a loopback group of ``--ranks`` ranks on the GPU
(`testing.fused_checks.FusedLayer`: 16 experts, at most 200 tokens per rank, top-4, H 512,
I 256, ``--recipe``), warms every kernel up, then until ``--seconds`` after the soak's start
(warm-up included: every process stops at the same time, so all run together throughout) draws
calls as `testing.fused_checks.check_fused_calls` does: per rank a token count from {0, 1,
0..200, 200} and a BLOCK_M from {64, 128}, the routings in turn (`SOAK_ROUTINGS`: random,
masked, one expert, skewed, bad slots), `BATCH` at a time: the staged layer runs them back to
back, then the fused one (no host wait between two calls), and ``y``, the counts and the
statistics are compared bit for bit (`FusedLayer.check_calls`, without the reference). The
processes share
the GPU as a server's neighbours would (time-sliced contexts), which is what exposed the fused
kernel's register handover stall (docs/notes/register-handover.md).

A stall (a kernel's report after the spin limit, ``CUTE_MEGAMOE_SPIN_TIMEOUT_S``, default 20 s
here) or a mismatch ends that process; its row carries the message. A process that neither
finishes nor reports by the deadline (the end plus three spin limits) is killed and counted
as a stall ("hung"). Writes ``bench/results/soak-<stamp>.json``, one row per process:
``ranks``, ``processes``, ``row_transfer``, ``recipe``, ``seconds`` (of calls, after the
warm-up), ``calls``, ``stalls``, ``mismatches``, ``gpu``, ``error``. Exits non-zero if any
process stalled or mismatched.

``--gpus N``: instead, one group of N ranks, one process per GPU (the fused kernel across
GPUs, which `config.LayerConfig.experimental_fused_multi_gpu` gates): every process draws the
same calls, and they stop together (a flag reduced over the group every 64 calls).

``--row-transfer``: the fused kernel's row transfer on every rank (`config.ROW_TRANSFERS`, or
``default``: the buffer's); a comma list gives the processes these in turn
(``counted,barrier``: half of them each). ``--config KEY=VALUE`` (repeatable): the fused
layer's configuration on top of that (`bench.common.parse_config`, e.g.
``fused_kernel.walk=tickets``); the JSON's meta and rows carry it. ``--received-rows N``
(loopback, with ``pulled`` rows only): the fused layer's buffers keep their received rows in a
ring of N rows (`MegaMoELayout.received_rows`), the staged oracle runs on whole-pool buffers
of the same group.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROW_TRANSFERS = ("default", "counted", "barrier", "pulled")
#: the routings the calls take in turn: the checks' (`fused_checks.ROUTINGS`) and "bad" (about
#: 5 % of the slots out of range or repeated, which both layers' dispatch masks alike)
SOAK_ROUTINGS = ("random", "masked", "one_expert", "skewed", "bad")
SHAPE = dict(num_experts=16, max_tokens=200, num_topk=4, hidden=512, intermediate=256)
#: calls per check: each layer's calls run back to back, a host wait after them
#: (`FusedLayer.check_calls`)
BATCH = 8


def _configs(choice: str, num_ranks: int, settings=()) -> dict:
    """Per rank, the fused layer's configuration (`testing.fused_checks.rows_config`, with the
    ``--config`` settings)."""
    from bench.common import parse_config
    from cute_megamoe.testing.fused_checks import rows_config

    config = parse_config(settings, rows_config(None if choice == "default" else choice))
    return dict.fromkeys(range(num_ranks), config)


def worker(index: int, args, out: Path) -> None:
    """One process's loop; writes its row to ``out``."""
    import torch

    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.ranks import Ranks

    row_transfer = args.row_transfer.split(",")[index % len(args.row_transfer.split(","))]
    row = dict(process=index, ranks=args.ranks, processes=args.processes,
               row_transfer=row_transfer, config=" ".join(args.config), recipe=args.recipe,
               received_rows=args.received_rows,
               seconds=0.0, calls=0, stalls=0, mismatches=0,
               gpu=torch.cuda.get_device_name(), error=None)

    def save():
        out.write_text(json.dumps(row))

    save()
    s = SHAPE
    shape = (s["num_experts"], s["max_tokens"], s["num_topk"], s["hidden"], s["intermediate"],
             args.recipe)
    ring = dict(received_rows=args.received_rows) if args.received_rows else {}
    layer = FusedLayer(Ranks.loopback(args.ranks, *shape, **ring),
                       seed=index, configs=_configs(row_transfer, args.ranks, args.config),
                       staged_ranks=Ranks.loopback(args.ranks, *shape) if ring else None)
    layer.warm_up((64, 128))
    rng = random.Random(1000 * args.seed + index)
    start = time.monotonic()
    try:
        while time.time() < args.until:
            n = s["max_tokens"]
            calls = []
            for i in range(BATCH):
                tokens = tuple(rng.choice((0, 1, rng.randint(0, n), n))
                               for _ in range(args.ranks))
                block_ms = {b.rank: rng.choice((64, 128)) for b in layer.ranks.buffers}
                routing = SOAK_ROUTINGS[(row["calls"] + i) % len(SOAK_ROUTINGS)]
                calls.append((tokens, routing, block_ms, rng.randrange(1 << 30)))
            layer.check_calls(calls, against_reference=False)
            row["calls"] += BATCH
            if row["calls"] % (125 * BATCH) == 0:
                row["seconds"] = round(time.monotonic() - start, 1)
                save()
    except AssertionError as error:
        text = str(error)
        # a kernel that trapped (its report is in the message) is a stall; a difference from
        # the staged layer is a mismatch
        row["stalls" if "the calls failed" in text else "mismatches"] += 1
        row["error"] = text[:2000]
    row["seconds"] = round(time.monotonic() - start, 1)
    save()


def gpu_worker(rank: int, args, out: Path) -> None:
    """One rank of a group with one process per GPU (``--gpus``); writes its row to ``out``."""
    import torch
    import torch.distributed as dist

    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.ranks import Ranks, init_rank_process

    R = args.gpus
    row_transfer = args.row_transfer.split(",")[0]
    init_rank_process(rank, R, args.port)
    row = dict(process=rank, ranks=R, processes=R, gpus=R, row_transfer=row_transfer,
               config=" ".join(args.config), recipe=args.recipe, seconds=0.0, calls=0,
               stalls=0, mismatches=0,
               gpu=torch.cuda.get_device_name(), error=None)
    out.write_text(json.dumps(row))
    s = SHAPE
    buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, s["num_experts"], s["max_tokens"],
                                       s["num_topk"], s["hidden"], s["intermediate"],
                                       mma_type=args.recipe)
    layer = FusedLayer(Ranks([buf], [torch.cuda.Stream()]), seed=args.seed,
                       configs=_configs(row_transfer, R, args.config))
    layer.warm_up((64, 128))
    rng = random.Random(args.seed)  # (the same draws on every rank)
    start = time.monotonic()
    try:
        while True:
            if row["calls"] % 64 == 0:  # (every rank stops at the same call)
                stop = torch.tensor([int(time.time() >= args.until)], device="cuda")
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item():
                    break
            n = s["max_tokens"]
            tokens = tuple(rng.choice((0, 1, rng.randint(0, n), n)) for _ in range(R))
            block_ms = [rng.choice((64, 128)) for _ in range(R)]
            layer.check_call(tokens, SOAK_ROUTINGS[row["calls"] % len(SOAK_ROUTINGS)],
                             {rank: block_ms[rank]}, rng.randrange(1 << 30),
                             against_reference=False)
            row["calls"] += 1
    except AssertionError as error:
        text = str(error)
        row["stalls" if "the calls failed" in text else "mismatches"] += 1
        row["error"] = text[:2000]
    row["seconds"] = round(time.monotonic() - start, 1)
    out.write_text(json.dumps(row))
    if not (row["stalls"] or row["mismatches"]):
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2, 4))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--row-transfer", default="default",
                        help=f"one of {ROW_TRANSFERS}, or a comma list of them")
    parser.add_argument("--recipe", default="fp8xfp8", choices=("fp8xfp8", "bf16xbf16"))
    parser.add_argument("--gpus", type=int, default=0,
                        help="one group of this many ranks, one process per GPU (>= 2)")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="the fused layer's configuration (repeatable; config.LayerConfig "
                             "fields, dotted: fused_kernel.walk=tickets)")
    parser.add_argument("--received-rows", type=int, default=0, metavar="N",
                        help="loopback, pulled rows: the fused layer's buffers keep their "
                             "received rows in a ring of N rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spin-timeout-s", type=float, default=20.0,
                        help="the kernels' spin limit (CUTE_MEGAMOE_SPIN_TIMEOUT_S)")
    parser.add_argument("--no-save", action="store_true", help="print, write no JSON")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29631, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes < 1 or args.seconds <= 0:
        parser.error("--processes and --seconds must be positive")
    if not set(args.row_transfer.split(",")) <= set(ROW_TRANSFERS):
        parser.error(f"--row-transfer: one of {ROW_TRANSFERS}, or a comma list of them")
    if args.gpus and (args.gpus < 2 or args.ranks != 1 or "," in args.row_transfer):
        parser.error("--gpus: at least 2, with one --row-transfer and without --ranks")
    if args.received_rows and (args.gpus or args.row_transfer != "pulled"):
        parser.error("--received-rows: loopback groups with --row-transfer pulled only")
    if args.gpus:
        args.processes = args.gpus
    from bench.common import parse_config
    try:  # (a bad setting stops here, named, before any process)
        parse_config(args.config)
    except SystemExit as error:
        parser.error(str(error))
    if args.worker is not None:
        (gpu_worker if args.gpus else worker)(args.worker, args, args.out)
        return

    env = dict(os.environ, CUTE_MEGAMOE_SPIN_TIMEOUT_S=str(args.spin_timeout_s))
    until = time.time() + args.seconds
    with tempfile.TemporaryDirectory(prefix="cute_megamoe_soak_") as tmp:
        outs = [Path(tmp) / f"{i}.json" for i in range(args.processes)]
        procs = []
        for i, out in enumerate(outs):
            cmd = [sys.executable, "-m", "bench.soak", "--worker", str(i), "--out", str(out),
                   "--processes", str(args.processes), "--ranks", str(args.ranks),
                   "--seconds", str(args.seconds), "--row-transfer", args.row_transfer,
                   "--recipe", args.recipe, "--seed", str(args.seed), "--until", str(until),
                   "--gpus", str(args.gpus), "--port", str(args.port),
                   "--received-rows", str(args.received_rows),
                   *(a for setting in args.config for a in ("--config", setting))]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        # the end, then one call's spin limit (the combine waits twice it) and the report
        deadline = time.monotonic() + args.seconds + 3 * args.spin_timeout_s + 30
        rows = []
        for i, (proc, out) in enumerate(zip(procs, outs, strict=True)):
            try:
                log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                log, _ = proc.communicate()
                log = f"hung: killed by the soak at its deadline\n{log}"
            transfers = args.row_transfer.split(",")
            row = json.loads(out.read_text()) if out.exists() and out.stat().st_size else \
                dict(process=i, ranks=args.gpus or args.ranks, processes=args.processes,
                     row_transfer=transfers[i % len(transfers)], config=" ".join(args.config),
                     recipe=args.recipe, received_rows=args.received_rows, calls=0,
                     stalls=0, mismatches=0, error=None)
            if proc.returncode != 0 and not (row["stalls"] or row["mismatches"]):
                row["stalls"] += 1  # (it died or hung without a report of its own)
                row["error"] = log[-2000:]
            rows.append(row)
    from bench.common import Results

    results = Results("soak", meta=dict(processes=args.processes, ranks=args.gpus or args.ranks,
                                        gpus=args.gpus,
                                        row_transfer=args.row_transfer,
                                        config=" ".join(args.config), recipe=args.recipe,
                                        received_rows=args.received_rows,
                                        seconds=args.seconds,
                                        spin_timeout_s=args.spin_timeout_s))
    for row in rows:
        row.setdefault("gpu", results.meta["gpu"])
        results.add(**row)
    print(results.table(["process", "ranks", "row_transfer", "seconds", "calls", "stalls",
                         "mismatches"]))
    for row in rows:
        if row.get("error"):
            print(f"process {row['process']}: {row['error']}")
    total = sum(r["calls"] for r in rows)
    bad = sum(r["stalls"] + r["mismatches"] for r in rows)
    print(f"{total} calls, {sum(r['stalls'] for r in rows)} stalls, "
          f"{sum(r['mismatches'] for r in rows)} mismatches")
    if not args.no_save:
        print(f"wrote {results.save()}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
