"""Where every warp of a hung process is: cuda-gdb attached to it, the warps grouped by PC.

    python -m cute_megamoe.testing.gpu_snapshot [--busy-s 20] [--wait-s 600] -- COMMAND ...
    python -m cute_megamoe.testing.gpu_snapshot --pid PID

Starts COMMAND (e.g. a GPU test with ``CUTE_MEGAMOE_SPIN_TIMEOUT_S=0``, so that a stall spins
instead of trapping), waits until the GPU has been busy for ``--busy-s`` seconds in a row,
attaches ``cuda-gdb`` to the process (three batch passes: the kernels and the SMs with warps,
every such SM's warps, one warp's instructions per group), prints the kernels on the GPU and
the warps grouped by (kernel, warp slot in its SM, PC), fewest first (a stopped CTA's warps
stand out against the many spinning at a barrier), and kills COMMAND (which must be the
process that runs the kernels, not a launcher of other processes). A kernel missing from
the list is as telling: on 2026-12-04 a "stalled" two-rank loopback showed only rank 0's
combine, so rank 1's host thread had not launched its call
(docs/notes/loopback-warmup-deadlock.md). ``--pid``: attach to a process that is already hung
(a job of yours), leaving it running. Needs the CUDA toolkit's ``cuda-gdb`` (``--gdb``) and
permission to attach (ptrace).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time

_SM_HEADER = re.compile(r"^\s*Device\s+(\d+)\s+SM\s+(\d+)\s*$")
# `info cuda warps`: [*] warp, active mask, divergent mask, PC, kernel, block, first thread
_WARP = re.compile(r"^\*?\s*(\d+)\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(\d+)\s+"
                   r"(\(\d+,\d+,\d+\))\s+(\(\d+,\d+,\d+\))")
# `info cuda sms`: [*] SM, active warps mask (under a "Device N" line)
_SM = re.compile(r"^\*?\s*(\d+)\s+(0x[0-9a-f]+)\s*$")
# `info cuda kernels`: [*] kernel, parent, device, grid, status, SM mask, grid dim, block dim,
# invocation
_KERNEL = re.compile(r"^\*?\s*(\d+)\s+\S+\s+(\d+)\s+(\d+)\s+(\w+)\s+(0x[0-9a-f]+)\s+"
                     r"(\(\d+,\d+,\d+\))\s+(\(\d+,\d+,\d+\))\s+(\S.*?)\s*$")


def parse_kernels(text: str) -> dict[int, str]:
    """``info cuda kernels`` -> {kernel id: "name, grid dim, block dim, SM mask"}."""
    kernels = {}
    for line in text.splitlines():
        m = _KERNEL.match(line)
        if m:
            kernels[int(m.group(1))] = (f"{m.group(8)[:160]} grid {m.group(6)} block "
                                        f"{m.group(7)} SMs {m.group(5)}")
    return kernels


def parse_sms(text: str) -> list[tuple[int, int]]:
    """``info cuda sms`` -> [(device, SM)] of the SMs with active warps."""
    device, sms = 0, []
    for line in text.splitlines():
        m = re.match(r"^\s*Device\s+(\d+)\s*$", line)
        if m:
            device = int(m.group(1))
            continue
        m = _SM.match(line)
        if m and int(m.group(2), 16):
            sms.append((device, int(m.group(1))))
    return sms


def parse_warps(text: str) -> dict[tuple[int, int, str], list[tuple[int, int, str]]]:
    """``info cuda warps`` of several SMs -> {(kernel, warp slot, PC): [(device, SM, block)]}
    (an SM listed twice, e.g. after a focus change that failed, counts once)."""
    groups = collections.defaultdict(list)
    seen, where = set(), None
    for line in text.splitlines():
        m = _SM_HEADER.match(line)
        if m:
            where = (int(m.group(1)), int(m.group(2)))
            where = None if where in seen else where
            if where:
                seen.add(where)
            continue
        m = _WARP.match(line)
        if m and where is not None:
            warp, pc, kernel, block = int(m.group(1)), m.group(4), int(m.group(5)), m.group(6)
            groups[(kernel, warp, pc)].append((*where, block))
    return dict(groups)


def _gdb(gdb: str, pid: int, commands: list[str], timeout: float) -> str:
    args = [gdb, "-q", "-batch", "-p", str(pid), "-ex", "set pagination off"]
    for command in commands:
        args += ["-ex", command]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    return done.stdout + done.stderr


def _gpu_busy() -> bool:
    out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=False).stdout.split()
    return any(int(u) > 50 for u in out if u.isdigit())


def snapshot(pid: int, gdb: str, timeout: float = 300.0) -> str:
    """The report of the process ``pid``'s GPU warps (see the module doc)."""
    first = _gdb(gdb, pid, ["info cuda kernels", "info cuda sms"], timeout)
    kernels, sms = parse_kernels(first), parse_sms(first)
    lines = [f"{len(kernels)} kernel(s) on the GPU:"]
    lines += [f"  kernel {k}: {v}" for k, v in sorted(kernels.items())]
    # (focusing on an SM without warps is an error, which ends a batch: only SMs with warps)
    warps_text = _gdb(gdb, pid, [c for device, sm in sms for c in
                                 (f"cuda device {device} sm {sm}", "info cuda warps")], timeout)
    groups = parse_warps(warps_text)
    if not groups:  # (a cuda-gdb whose output these parsers do not know: show it)
        return "\n".join(lines + ["no warps parsed; cuda-gdb said:", first, warps_text])
    order = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[0]))
    lines.append(f"{sum(len(v) for v in groups.values())} warps on {len(sms)} SMs in "
                 f"{len(groups)} (kernel, warp slot, PC) groups, fewest first:")
    for (kernel, warp, pc), where in order:
        lines.append(f"  kernel {kernel} warp {warp:2d} pc {pc}: {len(where):5d} warp(s), "
                     f"e.g. (device, SM, block) {where[:3]}")
    shown = order[:40]
    text = _gdb(gdb, pid, [c for (_kernel, warp, _pc), where in shown for c in
                           (f"cuda device {where[0][0]} sm {where[0][1]} warp {warp} lane 0",
                            "x/3i $pc")], timeout)
    lines.append("instructions at each group's PC (the first 40 groups):")
    lines += [f"  {line.strip()}" for line in text.splitlines()
              if re.search(r"0x[0-9a-f]+ <", line)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-s", type=float, default=20.0,
                        help="seconds of a busy GPU in a row before attaching")
    parser.add_argument("--wait-s", type=float, default=600.0,
                        help="give up when the GPU was not busy that long by then")
    parser.add_argument("--gdb", default=shutil.which("cuda-gdb")
                        or "/usr/local/cuda/bin/cuda-gdb")
    parser.add_argument("--pid", type=int, default=None,
                        help="a running process to read (no COMMAND; it is left running)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if bool(command) == (args.pid is not None):
        raise SystemExit("gpu_snapshot: give either --pid or the command to run after --")
    if not os.path.exists(args.gdb):
        raise SystemExit(f"gpu_snapshot: no cuda-gdb at {args.gdb} (--gdb)")
    if args.pid is not None:
        print(snapshot(args.pid, args.gdb), flush=True)
        return
    process = subprocess.Popen(command)
    try:
        start = busy_since = time.monotonic()
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            if process.poll() is not None:
                raise SystemExit(f"gpu_snapshot: the command ended (exit {process.returncode}) "
                                 f"before the GPU was busy for {args.busy_s} s")
            if not _gpu_busy():
                busy_since = now
            elif now - busy_since >= args.busy_s:
                break
            if now - start > args.wait_s:
                raise SystemExit(f"gpu_snapshot: the GPU was not busy for {args.busy_s} s "
                                 f"in a row within {args.wait_s} s")
        print(snapshot(process.pid, args.gdb), flush=True)
    finally:
        process.kill()
        process.wait()
    sys.exit(0)


if __name__ == "__main__":
    main()
