"""The whole layer on R GPUs, same inputs, same run:

* `ours`: every step on our kernels (staging, dispatch, L1 + SwiGLU + requant, L2, combine;
  `staged_mega_moe` with `ExpertWeights`, BLOCK_M as the library picks it), eager and CUDA
  graph;
  the L2 epilogue sends the rows to the source ranks (`l2_sends`), and
  `ours_pool_order` is the same layer with L2 writing pool order and the combine kernel sending
  (graph; the two graphs alternate, median over rounds); and the steps of `ours` alone
  (graphs): staging + dispatch, the expert FFN (L1 + L2, with the sends), the combine;
* `fused`: the fused layer (`fused.fused_mega_moe`: input staging + one persistent kernel for
  dispatch, L1, L2 and combine), eager and CUDA graph, alternating with `ours` in the graph
  rounds; `weight_floor_us`: the weights' bytes at the copy ceiling (`bench.common.copy_ceiling`,
  same run), the decode floor;
* `staged_torch`: our staging/dispatch/combine kernels around torch grouped GEMMs;
* `torch_baseline`: PyTorch only (NCCL all-to-all + the same torch grouped GEMMs).

Eager calls are timed with CUDA events (the two torch paths read sizes back to the host, so
they cannot be graph-captured), median of repeats, max over ranks.

    python -m bench.bench_layer [--tokens 128,1024,4096] [--recipe fp8xfp8] [--quick]

`--quick`: only `ours` and `fused` (no steps, no torch paths). `--config KEY=VALUE`
(repeatable): the configuration of every layer run (`config.LayerConfig`, `bench.common.
parse_config`: ``gemm.promotion=chunk``, ``fused_kernel.row_transfer=barrier``,
``experimental_fused_fp4=1``). `--fused-rows barrier,counted`: the fused layer with each of
those row transfers too (graph, alternating with the rest); `--staged-config
gemm.transposed=1` / `--fused-config ...`: the staged / fused layer with those settings too
(`A=1+B=4`: both in one variant; outputs checked equal to the default's before timing).
`--rings R,Q`: the fused layer also on a buffer whose received rows and L1 outputs are rings of
R and Q rows (`MegaMoELayout.received_rows`, `l1_output_rows`; 0: the whole pool), with the
defaults that buffer chooses (pulled rows, the ticket walk), outputs checked equal (columns
fused_rings_R_Q_graph_us, ...).
`--power S` (one rank): also each layer (and variant) and each staged step back to back for
about S seconds, in turn, `--power-rounds` times (`bench.common.sustained_power`): its time,
watts, SM clock and energy per call under a steady load, and the steps' energy over the power
limit (`power_floor_us`, `bench.common.energy_columns`): at the limit, speed is energy.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist

from bench.bench_dispatch import _time, _time_graph, _time_graphs_interleaved
from bench.common import (
    Results,
    config_label,
    copy_ceiling,
    energy_columns,
    gpu_clocks,
    parse_config,
    power_limit_w,
    sustained_power,
)


def _variant(setting: str, base, option: str):
    """``A=1+B=4`` (one variant of `--staged-config` / `--fused-config`) -> (its configuration
    on top of ``base``, its column name part)."""
    settings = setting.split("+")
    return parse_config(settings, base, option), config_label(settings)


def _worker(rank, num_ranks, port, tokens, recipe, experts, topk, hidden, inter, out_dir,
            quick=False, fused_rows=(), staged_configs=(), fused_configs=(), storage_ab=False,
            settings=(), power=0.0, power_rounds=1, rings=()):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank))
    from cute_megamoe import fused, staged
    from cute_megamoe.baseline import torch_moe_layer
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.expert_gemm import ExpertWeights
    from cute_megamoe.heuristics import expected_tokens_per_expert, select_block_m
    from cute_megamoe.testing.dispatch_checks import make_routing

    base = parse_config(settings)
    staged_variants = dict(_variant(v, base, "--staged-config")[::-1] for v in staged_configs)
    fused_variants = dict(_variant(v, base, "--fused-config")[::-1] for v in fused_configs)
    rows_configs = {rows: parse_config([f"fused_kernel.row_transfer={rows}"], base,
                                       "--fused-rows") for rows in fused_rows}
    e_l = experts // num_ranks
    gen = torch.Generator().manual_seed(rank)
    wgen = torch.Generator(device="cuda").manual_seed(rank)
    w1 = (torch.randn(e_l, 2 * inter, hidden, generator=wgen, device="cuda")
          / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e_l, hidden, inter, generator=wgen, device="cuda")
          / inter**0.5).to(torch.bfloat16)
    weights = staged.TorchExpertWeights.from_bf16(w1, w2, recipe)
    kernel_weights = ExpertWeights.from_bf16(w1, w2, recipe)
    # `--storage-ab`: the same weights in the other storage order (`ExpertWeights.tiled`), for
    # the layers' A/B
    other_weights = None
    if storage_ab:
        other_weights = (kernel_weights.untiled_copy() if kernel_weights.tiled
                         else kernel_weights.tiled_copy())
    del w1, w2
    buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, experts, max(tokens), topk, hidden,
                                       inter, mma_type=recipe)
    ring_buf, ring_label = None, None  # `--rings`: the fused layer on a ring buffer too
    if rings:
        ring_buf = get_symm_buffer_for_mega_moe(
            dist.group.WORLD, experts, max(tokens), topk, hidden, inter, mma_type=recipe,
            received_rows=rings[0] or None, l1_output_rows=rings[1] or None)
        ring_label = f"rings_{rings[0]}_{rings[1]}"
    weight_bytes = sum(t.numel() * t.element_size() for t in (
        kernel_weights.w1, kernel_weights.w2, kernel_weights.w1_sf, kernel_weights.w2_sf)
        if t is not None)
    weight_floor = weight_bytes / copy_ceiling(min(weight_bytes, 2 << 30))
    # the same experts' weights in FP8 (one byte per element, the fp8xfp8 read): what the FP4
    # recipes are measured against (issue 19)
    fp8_bytes = e_l * 3 * hidden * inter
    fp8_floor = fp8_bytes / copy_ceiling(min(fp8_bytes, 2 << 30))
    # the fused kernel where it runs this recipe (else its columns stay empty)
    fused_ok = fused.supports(buf, kernel_weights, base) is None
    res = Results("layer", meta={"ranks": num_ranks, "recipe": recipe, "experts": experts,
                                 "topk": topk, "hidden": hidden, "intermediate": inter,
                                 "config": list(settings), "clocks_before": gpu_clocks()})
    if power:
        res.meta["power_limit_w"] = power_limit_w()
    for n in tokens:
        idx, w = make_routing(n, experts, topk, "random", gen)
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16).cuda()
        idx, w = idx.cuda(), w.cuda()

        block_m = select_block_m(expected_tokens_per_expert(n, num_ranks, topk, experts),
                                 "sm90")

        # (ours: the BLOCK_M the library picks, `block_m=None`; the configuration is part of
        # the layer plans' keys: a variant's call builds its kernels, and a graph captures them)
        def ours(x=x, idx=idx, w=w, block_m=None, l2_sends=True, wts=kernel_weights,
                 config=base):
            return staged.staged_mega_moe(buf, x, idx, w, wts, activation_clamp=10.0,
                                          block_m=block_m, validate_routing=False,
                                          l2_sends=l2_sends, config=config)

        def fused_layer(x=x, idx=idx, w=w, block_m=block_m, wts=kernel_weights, config=base,
                        buffer=buf):
            return fused.fused_mega_moe(buffer, x, idx, w, wts, activation_clamp=10.0,
                                        block_m=block_m, validate_routing=False, config=config)

        def ours_pool_order(x=x, idx=idx, w=w, block_m=block_m):
            ours(x, idx, w, None, l2_sends=False)

        def staged_torch(x=x, idx=idx, w=w):
            staged.staged_mega_moe(buf, x, idx, w, weights, activation_clamp=10.0,
                                   validate_routing=False)

        def torch_baseline(x=x, idx=idx, w=w):
            torch_moe_layer(x, idx, w, weights, num_experts=experts, recipe=recipe,
                            activation_clamp=10.0, group=dist.group.WORLD)

        t_ours = _time(ours, 5)
        t_fused = _time(fused_layer, 5) if fused_ok else None
        env_fns = {("ours", label): partial(ours, config=config)
                   for label, config in staged_variants.items()}
        if fused_ok:
            env_fns.update({("fused", label): partial(fused_layer, config=config)
                            for label, config in fused_variants.items()})
            if ring_buf is not None:
                env_fns[("fused", ring_label)] = partial(fused_layer, buffer=ring_buf)
        storage_fns = {}  # the layers on the weights in the other storage order
        if other_weights is not None:
            storage_fns["ours"] = partial(ours, wts=other_weights)
            if fused_ok:
                storage_fns["fused"] = partial(fused_layer, wts=other_weights)
            for default, fn in zip((ours, fused_layer), storage_fns.values(), strict=False):
                y_default = default().clone()  # (the same outputs on either storage)
                if not torch.equal(y_default.view(torch.int16), fn().view(torch.int16)):
                    raise SystemExit(f"{n} tokens: the layer on the other storage differs")
        for (layer, label), fn in env_fns.items():  # a kernel variant gives the default's bits
            y_default = (ours if layer == "ours" else fused_layer)().clone()
            if not torch.equal(y_default.view(torch.int16), fn().view(torch.int16)):
                raise SystemExit(f"{n} tokens: the {layer} layer with {label} differs")
        # every variant's graph replayed in turn, the order rotating: at the power limit the
        # clock drops within milliseconds, and a variant timed in a block after another would
        # inherit its power state (docs/performance.md, Method)
        variants = {"sends": ours}
        if fused_ok:
            variants["fused"] = fused_layer
            variants.update({("rows", rows): partial(fused_layer, config=config)
                             for rows, config in rows_configs.items()})
        variants.update({("env", key): fn for key, fn in env_fns.items()})
        variants.update({("storage", layer): fn for layer, fn in storage_fns.items()})
        if not quick:
            variants["pool"] = ours_pool_order
        times = _time_graphs_interleaved(variants, 5, rounds=9)
        t_graph, t_pool, t_fused_graph = (times.get(key) for key in ("sends", "pool", "fused"))
        flops = 2 * int((idx >= 0).sum()) * 3 * hidden * inter
        ours_best = min(t_ours, t_graph or t_ours)
        fused_cols = dict(weight_floor_us=weight_floor * 1e6, fp8_weight_floor_us=fp8_floor * 1e6,
                          ours_over_fp8_floor=ours_best / fp8_floor)
        for layer, label in env_fns:  # a layer with that configuration
            t_env = times[("env", (layer, label))]
            if t_env is not None:
                name = f"{layer}_{label}"
                fused_cols[f"{name}_graph_us"] = t_env * 1e6
                fused_cols[f"{name}_over_fp8_floor"] = t_env / fp8_floor
        for layer in storage_fns:
            t_other = times[("storage", layer)]
            if t_other is not None:
                fused_cols[f"{layer}_other_storage_graph_us"] = t_other * 1e6
                fused_cols[f"{layer}_other_storage_over_fp8_floor"] = t_other / fp8_floor
        fused_best = ours_best  # (the speedup over the torch baseline takes the better one)
        if fused_ok:
            fused_best = min(t_fused, t_fused_graph or t_fused)
            fused_cols.update(
                fused_us=t_fused * 1e6,
                fused_graph_us=None if t_fused_graph is None else t_fused_graph * 1e6,
                fused_tflops=flops / fused_best / 1e12,
                staged_over_fused=(t_graph or t_ours) / fused_best,
                fused_over_floor=fused_best / weight_floor)
            for rows in fused_rows:  # (each row transfer forced)
                t_rows = times[("rows", rows)]
                if t_rows is not None:
                    fused_cols[f"fused_{rows}_graph_us"] = t_rows * 1e6
                    fused_cols[f"fused_{rows}_over_floor"] = t_rows / weight_floor
        steps = None
        if power or not quick:
            # the steps alone (each repeated on its own; the rows the L2 epilogue re-sends are
            # the same every time and no combine reads them meanwhile)
            dispatched = staged.dispatch(buf, x, idx, w, block_m=block_m,
                                         validate_routing=False)
            y = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
            steps = {
                "dispatch": partial(staged.dispatch, buf, x, idx, w, block_m=block_m,
                                    validate_routing=False),
                "experts": partial(staged.kernel_experts, buf, dispatched, kernel_weights, 10.0,
                                   send_to_combine=True),
            }
            steps["combine"] = partial(staged.combine, buf, steps["experts"](), dispatched, y)
        if power:  # (the layers as timed above, each variant's configuration)
            runs = {"staged": ours}
            if fused_ok:
                runs["fused"] = fused_layer
                runs.update({f"fused_{label}": partial(fused_layer, config=config)
                             for label, config in fused_variants.items()})
                if ring_buf is not None:
                    runs[f"fused_{ring_label}"] = partial(fused_layer, buffer=ring_buf)
            runs.update({f"staged_{label}": partial(ours, config=config)
                         for label, config in staged_variants.items()})
            runs.update(steps)
            fused_cols.update(energy_columns(sustained_power(runs, power, power_rounds),
                                             res.meta["power_limit_w"]))
            if "staged_sustained_us" in fused_cols and "fused_sustained_us" in fused_cols:
                fused_cols["staged_over_fused_sustained"] = (fused_cols["staged_sustained_us"]
                                                             / fused_cols["fused_sustained_us"])
        if quick:
            best = min(t_ours, t_graph or t_ours)
            res.add(tokens=n, block_m=block_m, ours_us=t_ours * 1e6,
                    ours_graph_us=None if t_graph is None else t_graph * 1e6,
                    ours_tflops=flops / best / 1e12, **fused_cols)
            continue

        step_us = {}
        for name, fn in steps.items():
            t = _time_graph(fn, 5)
            step_us[f"{name}_graph_us"] = None if t is None else t * 1e6
        t_staged, t_base = _time(staged_torch, 5), _time(torch_baseline, 5)
        best = min(t_ours, t_graph or t_ours)
        res.add(tokens=n, block_m=block_m, ours_us=t_ours * 1e6,
                ours_graph_us=None if t_graph is None else t_graph * 1e6,
                ours_pool_order_graph_us=None if t_pool is None else t_pool * 1e6, **step_us,
                staged_torch_us=t_staged * 1e6, torch_baseline_us=t_base * 1e6,
                speedup_vs_baseline=t_base / min(best, fused_best),
                ours_tflops=flops / best / 1e12, **fused_cols)
    res.meta["clocks_after"] = gpu_clocks()
    if rank == 0:
        print(f"saved {res.save(out_dir or None)}")
        cols = ["tokens", "block_m", "ours_us", "ours_graph_us", "fused_us",
                "fused_graph_us", "staged_over_fused", "ours_tflops", "fused_tflops",
                "weight_floor_us", "fused_over_floor", "fp8_weight_floor_us",
                "ours_over_fp8_floor"]
        for rows in fused_rows:
            cols += [f"fused_{rows}_graph_us", f"fused_{rows}_over_floor"]
        for layer, variants in (("ours", staged_variants),
                                ("fused", [*fused_variants, *([ring_label] if rings else [])])):
            for label in variants:
                cols += [f"{layer}_{label}_graph_us", f"{layer}_{label}_over_fp8_floor"]
        if storage_ab:
            cols += ["ours_other_storage_graph_us", "ours_other_storage_over_fp8_floor",
                     "fused_other_storage_graph_us", "fused_other_storage_over_fp8_floor"]
        if not quick:
            cols += ["ours_pool_order_graph_us", "dispatch_graph_us", "experts_graph_us",
                     "combine_graph_us", "staged_torch_us", "torch_baseline_us",
                     "speedup_vs_baseline"]
        print(res.table(cols))
        if power:  # (a table of its own: per run, its time, watts, clock and energy)
            names = ["staged", "fused", *(f"fused_{v}" for v in fused_variants),
                     *([f"fused_{ring_label}"] if rings else []),
                     *(f"staged_{v}" for v in staged_variants), "dispatch", "experts", "combine"]
            print(res.table(["tokens", "power_floor_us", "staged_over_fused_sustained"]))
            for name in names:
                print(res.table(["tokens"] + [f"{name}_{col}" for col in (
                    "sustained_us", "watts", "sm_mhz", "mj", "over_power_floor")]))
    buf.destroy()
    if ring_buf is not None:
        ring_buf.destroy()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    p.add_argument("--tokens", default="128,1024,4096")
    p.add_argument("--recipe", default="fp8xfp8")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--port", type=int, default=29544)
    p.add_argument("--quick", action="store_true", help="only ours and fused")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="the configuration of every layer run (repeatable; config.LayerConfig "
                        "fields, dotted for nested ones: gemm.promotion=chunk)")
    p.add_argument("--fused-rows", default="",
                   help="row transfers of the fused kernel to time too, alternating with the "
                        "default in the graph rounds (e.g. barrier,counted; columns "
                        "fused_<rows>_graph_us)")
    p.add_argument("--staged-config", default="",
                   help="KEY=VALUE[,KEY=VALUE]: the staged layer also with each of these "
                        "settings (kernel variants; KEY=VALUE+KEY=VALUE: several in one "
                        "variant), outputs checked equal, graph, alternating in the rounds "
                        "(columns ours_<key>_<value>_graph_us, ..._over_fp8_floor)")
    p.add_argument("--fused-config", default="",
                   help="KEY=VALUE[,...]: the fused layer also with each of these settings "
                        "(columns fused_<key>_<value>_graph_us, ..._over_fp8_floor)")
    p.add_argument("--storage-ab", action="store_true",
                   help="the staged and fused layers also on the weights in the other storage "
                        "order (`ExpertWeights.tiled`: fp8xfp8 / bf16xbf16 default to TMA "
                        "boxes, fp8xfp4_sm90 to rows), alternating in the graph rounds, "
                        "outputs checked equal (columns ours_other_storage_graph_us, "
                        "fused_other_storage_graph_us)")
    p.add_argument("--rings", default="", metavar="R,Q",
                   help="the fused layer also on a buffer with a received-rows ring of R rows "
                        "and an L1-output ring of Q (0: the whole pool; columns "
                        "fused_rings_R_Q_graph_us)")
    p.add_argument("--power", type=float, default=0.0, metavar="S",
                   help="one rank: also each layer, variant and staged step back to back for "
                        "about S seconds in turn (watts, SM clock, energy per call; "
                        "power_floor_us: the steps' energy over the power limit)")
    p.add_argument("--power-rounds", type=int, default=1,
                   help="rounds of --power (medians over them)")
    a = p.parse_args()
    if a.power and a.ranks != 1:
        p.error("--power: one rank only (the watts of one GPU)")
    if a.power < 0 or a.power_rounds < 1:
        p.error("--power: seconds >= 0; --power-rounds: at least 1")
    rings = tuple(int(r) for r in a.rings.split(",")) if a.rings else ()
    if rings and (len(rings) != 2 or min(rings) < 0 or rings == (0, 0)):
        p.error("--rings: R,Q, rows of the two rings (0: none), not both 0")
    # (every setting read here first: a bad one stops before any GPU work)
    base = parse_config(a.config)
    staged = tuple(e for e in a.staged_config.split(",") if e)
    fused = tuple(e for e in a.fused_config.split(",") if e)
    for option, variants in (("--staged-config", staged), ("--fused-config", fused)):
        for variant in variants:
            _variant(variant, base, option)
    mp.spawn(_worker, args=(a.ranks, a.port, [int(t) for t in a.tokens.split(",")], a.recipe,
                            a.experts, a.topk, a.hidden, a.intermediate,
                            os.environ.get("CUTE_MEGAMOE_RESULTS_DIR", ""), a.quick,
                            tuple(r for r in a.fused_rows.split(",") if r), staged, fused,
                            a.storage_ab, tuple(a.config), a.power, a.power_rounds, rings),
             nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()
