"""Where a kernel's warps stall, by loop: Nsight Compute's source page grouped into loop bodies.

    ncu --clock-control none --section WarpStateStats --section SourceCounters \\
        --import-source no -o REPORT python3 ...        # on the GPU machine
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python3 -m bench.ncu_stalls source.csv [--top 8]

The warps of a warp-specialized kernel (producer, decode, consumer warps) run different code, and
a kernel-wide stall breakdown mixes them. Here the SASS instructions of each kernel are grouped
by how often they executed: a straight run of a loop body executes the same number of times,
so instructions with one execution count are one loop body (or several bodies of one trip
count, which the addresses in the output tell apart). For the groups with the most warp stall
samples it prints the share of the kernel's samples, the executions per instruction, the
instruction count, the top stall reasons and the top opcodes: enough to tell which role waits
on what and which pipe its instructions load. A diagnostic: it reads the CSV, runs no GPU code.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """``(kernel name, rows)`` per kernel of an ``ncu --page source --csv`` export (a
    ``"Kernel Name"`` line, then a header and one row per SASS instruction)."""
    out: list[tuple[str, list[dict[str, str]]]] = []
    name, lines = None, []
    for line in text.splitlines() + ['"Kernel Name",""']:
        if line.startswith('"Kernel Name"'):
            if name is not None and lines:
                out.append((name, list(csv.DictReader(io.StringIO("\n".join(lines))))))
            name, lines = next(csv.reader([line]))[1], []
        elif line.strip():
            lines.append(line)
    return out


def opcode(source: str) -> str:
    """The opcode of a SASS line without predicate and modifiers (``@!P0 BRA ...`` -> BRA)."""
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", source)
    return m.group(2) if m else "?"


def loop_groups(rows: list[dict[str, str]]) -> list[dict]:
    """The kernel's instructions grouped by execution count, most stall samples first: per
    group the count, the instructions, their samples and the samples per stall reason."""
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    groups: dict[int, dict] = {}
    for index, row in enumerate(rows):
        executed = int(row[EXECUTED] or 0)
        if executed == 0:
            continue
        g = groups.setdefault(executed, {"executed": executed, "first": index, "last": index,
                                         "instructions": 0, "samples": 0,
                                         "stalls": collections.Counter(),
                                         "opcodes": collections.Counter()})
        g["last"] = index
        g["instructions"] += 1
        g["samples"] += int(row[SAMPLES] or 0)
        g["opcodes"][opcode(row["Source"])] += 1
        for k in stalls:
            g["stalls"][k[len("stall_"):]] += int(row[k] or 0)
    return sorted(groups.values(), key=lambda g: -g["samples"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=8, help="groups per kernel")
    parser.add_argument("--reasons", type=int, default=4,
                        help="stall reasons per group (the rest of a group's samples: whether a "
                             "role waits on the ring's barriers is often below the top four)")
    args = parser.parse_args()
    with open(args.csv) as f:
        text = f.read()
    for name, rows in kernels(text):
        total = sum(int(r[SAMPLES] or 0) for r in rows) or 1
        print(f"=== {name[:100]}: {len(rows)} instructions, {total} stall samples")
        print("  share  executed  instrs  lines      stalls (share of the group)  opcodes")
        for g in loop_groups(rows)[: args.top]:
            top = ", ".join(f"{k} {100 * v // max(g['samples'], 1)}%"
                            for k, v in g["stalls"].most_common(args.reasons) if v)
            ops = ", ".join(f"{k} {v}" for k, v in g["opcodes"].most_common(5))
            print(f"  {100 * g['samples'] / total:5.1f}% {g['executed']:9d} {g['instructions']:6d}"
                  f"  {g['first']:5d}-{g['last']:<5d} {top:38s} {ops}")


if __name__ == "__main__":
    main()
