"""One fused layer call's timeline: which CTA did what when, drawn to a PNG.

    python -m bench.timeline --tokens 8192 --out docs/timeline-8192.png   # a GPU: run, plot
    python -m bench.timeline --from bench/results/timeline-<stamp>.json --out t.png  # re-plot

On the GPU: the fused kernel (`kernels/sm90_mega_moe.py`) built with its phase clock
(`config.Sm90FusedConfig.debug="phase_clock"`: every CTA stamps the global timer at the
`PHASE_STAMPS` boundaries, a store each), a few warm-up calls, then one call on staged inputs;
its stamps go to ``bench/results/timeline-<stamp>.json`` (or ``CUTE_MEGAMOE_RESULTS_DIR``)
with the GPU named. `segments` turns a CTA's stamps into the phases it spent its time in
(dispatch: start to its rows sent; L1: to its consumers' L1 tiles done; L2: to their L2 tiles
done; combine: to its end), in us from the grid's first start, and `plot` draws one row per
CTA, one colour per phase (matplotlib, the ``bench`` extra). The uninstrumented kernel's time
is `bench.bench_layer`'s ``fused_graph_us``.

``--walk tickets``: the ticket walk (`config.Sm90FusedConfig.walk`), whose L1 and L2 tiles
interleave, built with its tile clock (``debug="tile_clock"``: each CTA's consumers record
every tile's position and span); `tile_spans` turns them into one bar per tile. ``--config
KEY=VALUE`` (repeatable, `bench.common.parse_config`: ``fused_kernel.row_transfer=pulled``,
``fused_kernel.combine=tokens``) and ``--rings R,Q`` (a buffer whose received rows and L1
outputs are rings of R and Q rows, 0: none) draw the dataflow kernel's variants.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

#: (phase, the stamp it starts at, the stamp it ends at), in the order a CTA runs them today
PHASES = (("dispatch", "start", "rows_sent"), ("L1", "rows_sent", "l1_done"),
          ("L2", "l1_done", "l2_done"), ("combine", "l2_done", "end"))
COLOURS = {"dispatch": "tab:orange", "L1": "tab:blue", "L2": "tab:green", "combine": "tab:red"}


def segments(stamps: Sequence[Sequence[int]], names: Sequence[str]) -> list[tuple]:
    """``(cta, phase, start_us, end_us)`` of every CTA's `PHASES` from its stamps (``stamps``:
    one row of ns timer values per CTA, in the order of ``names``; 0: not reached, so the
    phases it bounds are left out), times from the earliest start of any CTA."""
    column = {name: i for i, name in enumerate(names)}
    starts = [row[column["start"]] for row in stamps if row[column["start"]]]
    if not starts:
        raise ValueError("stamps: no CTA stamped its start")
    origin = min(starts)
    out = []
    for cta, row in enumerate(stamps):
        for phase, first, last in PHASES:
            t0, t1 = row[column[first]], row[column[last]]
            if t0 and t1:
                if t1 < t0:
                    raise ValueError(f"stamps: CTA {cta}'s {last} ({t1}) before its {first} "
                                     f"({t0})")
                out.append((cta, phase, (t0 - origin) / 1e3, (t1 - origin) / 1e3))
    return out


def tile_spans(tiles: Sequence[Sequence[Sequence[int]]]) -> list[tuple]:
    """``(cta, "L1" | "L2", start_us, end_us)`` of every recorded tile of the ticket walk's
    tile clock (``tiles[cta]``: its entries ``(code, pool block, start, end)``, the times the
    global timer's low 32 bits in ns, `sm90_mega_moe.TILE_CLOCK_TILES`; code 0: none), times
    from the earliest start (differences taken modulo 2**32: a call is far shorter)."""
    entries = [(cta, e) for cta, rows in enumerate(tiles) for e in rows if e[0]]
    if not entries:
        raise ValueError("tiles: no CTA recorded a tile")
    ref = entries[0][1][2]

    def rel(t):  # signed ns from `ref`, modulo 2**32
        return ((t - ref + 2**31) % 2**32) - 2**31

    origin = min(rel(e[2]) for _, e in entries)
    out = []
    for cta, (code, _block, t0, t1) in entries:
        phase = {1: "L1", 2: "L2"}.get(code >> 24)
        if phase is None:
            raise ValueError(f"tiles: CTA {cta} has an entry of code {code:#x}")
        start, end = rel(t0) - origin, rel(t1) - origin
        if end < start:
            raise ValueError(f"tiles: CTA {cta}'s tile ends ({t1}) before it starts ({t0})")
        out.append((cta, phase, start / 1e3, end / 1e3))
    return out


def plot(spans: list[tuple], num_ctas: int, title: str, out: Path) -> Path:
    """Draw ``spans`` (`segments`) to the PNG ``out``: one row per CTA, time in us across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 2 + num_ctas * 0.04))
    for phase in COLOURS:
        bars = [(t0, t1 - t0) for cta, p, t0, t1 in spans if p == phase]
        rows = [cta for cta, p, _, _ in spans if p == phase]
        for cta, bar in zip(rows, bars, strict=True):
            ax.broken_barh([bar], (cta - 0.4, 0.8), facecolors=COLOURS[phase])
    ax.set_xlabel("us from the first CTA's start")
    ax.set_ylabel("CTA")
    ax.set_ylim(-1, num_ctas)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=p) for p, c in COLOURS.items()],
              loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def record(args) -> tuple[dict, list, list[str]]:
    """One phase-clocked fused call on the GPU: (meta, per-CTA stamps, their names); with
    ``--walk tickets`` the tile clock's: (meta, per CTA its recorded tiles, [])."""
    from dataclasses import replace

    import torch

    from bench.common import gpu_clocks, parse_config, random_expert_weights
    from cute_megamoe import api
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.heuristics import block_m_for_call, default_fused_config
    from cute_megamoe.kernels.sm90_mega_moe import PHASE_STAMPS, TILE_CLOCK_TILES
    from cute_megamoe.launch import buffer_state, fused_call
    from cute_megamoe.testing.dispatch_checks import make_routing

    gen = torch.Generator().manual_seed(0)
    e, h, inter, n = args.experts, args.hidden, args.intermediate, args.tokens
    weights = random_expert_weights(e, h, inter, args.recipe)
    rings = [int(r) for r in args.rings.split(",")] if args.rings else [0, 0]
    buf = get_symm_buffer_for_mega_moe(None, e, n, args.topk, h, inter, mma_type=args.recipe,
                                       received_rows=rings[0] or None,
                                       l1_output_rows=rings[1] or None)
    idx, w = make_routing(n, e, args.topk, "random", gen)
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16).cuda()
    api.stage_inputs(buf, x, idx.cuda(), w.cuda(), validate_routing=False)
    grid = buffer_state(buf).num_sms
    block_m = block_m_for_call(n, 1, args.topk, e, "sm_90a")
    tickets = args.walk == "tickets"
    config = default_fused_config(buf.layout, block_m, False, replace(
        parse_config(args.config).fused_kernel,
        debug="tile_clock" if tickets else "phase_clock", walk=args.walk))
    y = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")
    clock = torch.zeros((grid, TILE_CLOCK_TILES, 4) if tickets else (grid, len(PHASE_STAMPS)),
                        dtype=torch.int32 if tickets else torch.int64, device="cuda")
    call = fused_call(buf, weights, n, y, grid, None, 10.0, True, config, debug=clock)
    for _ in range(args.warmup):
        call()
    clock.zero_()  # (the tile clock appends: the recorded call's entries only)
    call()
    torch.cuda.synchronize()
    meta = {"gpu": torch.cuda.get_device_name(), "tokens": n, "experts": e, "topk": args.topk,
            "hidden": h, "intermediate": inter, "recipe": args.recipe, "block_m": block_m,
            "ctas": grid, "walk": args.walk, "config": list(args.config), "rings": rings,
            "clocks": gpu_clocks()}
    stamps = clock.cpu().tolist()
    buf.destroy()
    if tickets:  # (each CTA's recorded tiles only)
        return meta, [[e for e in rows if e[0]] for rows in stamps], []
    return meta, stamps, list(PHASE_STAMPS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--recipe", default="fp8xfp8")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--walk", default="phases", choices=("phases", "tickets"),
                        help="the fused kernel's walk (tickets: its tile clock, a bar per tile)")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="the fused kernel's settings (repeatable: "
                             "fused_kernel.row_transfer=pulled)")
    parser.add_argument("--rings", default="", metavar="R,Q",
                        help="a buffer with a received-rows ring of R rows and an L1-output "
                             "ring of Q (0: none)")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="plot the stamps of an earlier run's JSON instead of running")
    parser.add_argument("--out", type=Path, default=None, help="the PNG (default: none)")
    args = parser.parse_args()
    if args.tokens < 1:
        parser.error("--tokens must be positive")
    if args.source is not None and args.out is None:
        parser.error("--from needs --out (the PNG to draw)")
    if args.rings and (len(args.rings.split(",")) != 2
                       or not all(r.isdigit() for r in args.rings.split(","))):
        parser.error("--rings: R,Q, rows of the two rings (0: none)")
    from bench.common import parse_config
    try:  # (a bad setting stops here, named, before any GPU work)
        parse_config(args.config)
    except SystemExit as error:
        parser.error(str(error))
    if args.source is not None:
        data = json.loads(args.source.read_text())
        meta, stamps, names = data["meta"], data["meta"]["stamps"], data["meta"]["stamp_names"]
    else:
        from bench.common import Results

        meta, stamps, names = record(args)
        res = Results("timeline", meta={**meta, "stamps": stamps, "stamp_names": names})
        spans = tile_spans(stamps) if meta["walk"] == "tickets" else segments(stamps, names)
        for phase, _, _ in PHASES:
            ends = sorted(t1 for _, p, _, t1 in spans if p == phase)
            if ends:
                res.add(phase=phase, ctas=len(ends), median_end_us=ends[len(ends) // 2],
                        last_end_us=ends[-1])
        print(f"saved {res.save()}")
        print(res.table(["phase", "ctas", "median_end_us", "last_end_us"]))
    if args.out is not None:
        settings = " ".join(c.split(".")[-1] for c in meta.get("config", []))
        title = (f"fused layer ({meta.get('walk', 'phases')} walk{', ' if settings else ''}"
                 f"{settings}), {meta['tokens']} tokens, "
                 f"{meta['experts']} experts, {meta['recipe']}, BLOCK_M {meta['block_m']}, "
                 f"{meta['gpu']}")
        spans = (tile_spans(stamps) if meta.get("walk") == "tickets"
                 else segments(stamps, names))
        print(f"wrote {plot(spans, len(stamps), title, args.out)}")


if __name__ == "__main__":
    main()
