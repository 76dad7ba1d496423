"""Tables (Markdown) and plots from `bench/results/*.json`, for docs/performance.md.

    python -m bench.report              # print the tables of the newest result of each bench
    python -m bench.report --plot DIR   # also write PNG plots there (needs matplotlib)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import RESULTS_DIR

COLUMNS = {
    "staging": [("recipe", "recipe"), ("tokens", "tokens"), ("time_us", "time (us)"),
                ("gbps", "GB/s"), ("copy_gbps", "copy GB/s (same bytes)"),
                ("ratio_to_copy", "vs copy")],
    "dispatch_combine": [
        ("recipe", "payload"), ("tokens", "tokens/rank"),
        ("dispatch_graph_us", "dispatch us (graph)"), ("dispatch_us", "dispatch us (eager)"),
        ("nccl_dispatch_us", "NCCL a2a us"), ("dispatch_nvl_gbps", "dispatch NVL GB/s"),
        ("dispatch_graph_nvl_gbps", "dispatch NVL GB/s (graph)"),
        ("dispatch_pull_graph_us", "pull us (graph)"),
        ("dispatch_pull_graph_nvl_gbps", "pull NVL GB/s (graph)"),
        ("dispatch_vs_peer_copy", "vs peer copy"), ("combine_graph_us", "combine us (graph)"),
        ("combine_rounds", "combine rounds"),
        ("combine_chunks", "combine rounds"),
        ("combine_one_round_graph_us", "one-round combine us (graph)"),
        ("combine_overlap_graph_us", "overlap-mode combine us (graph)"),
        ("combine_reduce_only_graph_us", "reduce-only combine us (graph)"),
        ("combine_us", "combine us (eager)"), ("nccl_combine_us", "NCCL a2a us"),
        ("combine_nvl_gbps", "combine NVL GB/s"),
        ("combine_graph_nvl_gbps", "combine NVL GB/s (graph)"),
        ("combine_vs_peer_copy", "vs peer copy")],
    "gemm": [("recipe", "recipe"), ("experts", "experts"), ("pairs_per_expert", "pairs/expert"),
             ("block_m", "BLOCK_M"), ("picked", "heuristic's pick"), ("ours_us", "ours us"),
             ("torch_us", "torch us"), ("speedup", "torch / ours"),
             ("ours_tflops", "ours TFLOPS"), ("torch_tflops", "torch TFLOPS"),
             ("weight_floor_us", "weight floor us"), ("ratio_to_floor", "ours / floor")],
    "gemm_accuracy": [("recipe", "recipe"), ("block_m", "BLOCK_M"), ("pattern", "routing"),
                      ("rows", "rows"), ("l1_err", "L1 rel. err"), ("l2_err", "L2 rel. err"),
                      ("e2e_err", "end-to-end rel. err"), ("l1_flip_frac", "L1 one-step flips"),
                      ("l1_big_flips", "L1 > 1 step"), ("sf_mismatch", "scale mismatches"),
                      ("sf_near_tie", "of which near-ties"),
                      ("unquantized_err", "ours vs unquantized f64"),
                      ("ref_unquantized_err", "reference vs unquantized f64"),
                      ("unquantized_ratio", "ours / reference")],
    "nvlink": [("op", "copy"), ("directions", "directions busy"), ("rank", "rank"),
               ("gbps", "GB/s per direction")],
    "layer": [("tokens", "tokens/rank"), ("block_m", "BLOCK_M"), ("ours_us", "ours us (eager)"),
              ("ours_graph_us", "ours us (graph)"),
              ("ours_pool_order_graph_us", "pool order us (graph)"),
              ("dispatch_graph_us", "dispatch alone"), ("experts_graph_us", "experts alone"),
              ("combine_graph_us", "combine alone"), ("staged_torch_us", "staged torch us"),
              ("torch_baseline_us", "torch baseline us"),
              ("speedup_vs_baseline", "baseline / ours"), ("ours_tflops", "ours TFLOPS")],
}
PLOTTED = ("staging", "dispatch_combine")  # benches `plot` knows how to draw


def newest(name: str, results_dir: Path = RESULTS_DIR) -> list[dict]:
    """The newest result of bench `name` per recipe named in its meta (one for most benches;
    `bench_layer` runs once per recipe)."""
    found: dict[object, dict] = {}
    for path in sorted(results_dir.glob(f"{name}-*.json")):
        result = json.loads(path.read_text())
        if result.get("name") == name:
            found[result["meta"].get("recipe")] = result
    return list(found.values())


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and abs(v) < 0.1:
            return f"{v:.2g}"
        return f"{v:.2f}" if v < 10 else f"{v:.0f}"
    return str(v)


def markdown_table(result: dict) -> str:
    cols = COLUMNS[result["name"]]
    lines = ["| " + " | ".join(title for _, title in cols) + " |",
             "|" + "---|" * len(cols)]
    for row in result["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(key)) for key, _ in cols) + " |")
    meta = result["meta"]
    lines.append("")
    recipe = f"recipe {meta['recipe']}, " if "recipe" in meta else ""
    lines.append(f"{recipe}{meta['date']}, {meta['gpu']} x{meta.get('ranks', 1)}, commit "
                 f"{meta['commit']}, torch {meta['torch']}, clocks before/after: "
                 f"{meta.get('clocks_before', {}).get('nvidia_smi', '?')!r} / "
                 f"{meta.get('clocks_after', {}).get('nvidia_smi', '?')!r}")
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if result["name"] == "staging":
        for recipe in sorted({r["recipe"] for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["recipe"] == recipe]
            ax.plot([r["tokens"] for r in rows], [r["ratio_to_copy"] for r in rows], "o-",
                    label=recipe)
        ax.set_ylabel("fraction of copy bandwidth")
    else:
        for recipe in sorted({r["recipe"] for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["recipe"] == recipe]
            toks = [r["tokens"] for r in rows]
            ax.plot(toks, [r["dispatch_nvl_gbps"] for r in rows], "o-", label=f"dispatch {recipe}")
            ax.plot(toks, [r["combine_nvl_gbps"] for r in rows], "s--", label=f"combine {recipe}")
        if result["meta"].get("peer_copy_gbps"):
            ax.axhline(result["meta"]["peer_copy_gbps"], color="gray", lw=1, label="peer copy")
        ax.set_ylabel("NVLink GB/s per direction")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per rank")
    ax.legend(fontsize=7)
    ax.set_title(f"{result['name']} ({result['meta']['gpu']}, {result['meta']['commit']})")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['name']}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", type=Path, default=RESULTS_DIR)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    for name in COLUMNS:
        for result in newest(name, args.results):
            print(f"### {name}\n\n{markdown_table(result)}\n")
            if args.plot and name in PLOTTED:
                print(f"plot: {plot(result, args.plot)}\n")


if __name__ == "__main__":
    main()
