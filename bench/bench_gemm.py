"""Grouped GEMMs alone on one GPU: our L1 (+ SwiGLU + requant) + L2 against torch, same run.

For each (local experts, pairs per expert) and recipe: our `expert_ffn` (both kernels, at the
BLOCK_M the heuristics pick and at the other one), torch's two grouped GEMMs on the same pairs
per expert (`torch._scaled_grouped_mm` with rowwise scales for FP8, `torch._grouped_mm` for
BF16; no SwiGLU or requantization, so torch does less work), and the weight-read floor: the
weight bytes at the device-to-device copy bandwidth (bytes read + written per second of a
copy moving min(weight bytes, 2 GiB) in 256 MiB pieces, measured in the same process; torch
copies of 1 GiB or more run at 2.8 instead of 4.2 TB/s and would flatter us). All timed by
CUDA-graph replay, one graph per run, the graphs replayed in turn (`--rounds` x 5 replays,
the order rotating; `bench.common.time_cuda_graphs_interleaved`): at its power limit the GPU
lowers its clock within milliseconds, so back-to-back runs are not comparable); each time the
median of its replays.

`fp8xfp4_sm90` rows (MXFP4 weights decoded on chip, issue 19) have no torch baseline; they alternate
with our fp8xfp8 kernels on FP8 weights of the same shape instead (`fp8_us`, `ratio_to_fp8`), and
their weight floor is the FP4 bytes (codes and scales). `--quarter-ab` times the FP8 promotions
`chunk` and `quarter` of every BLOCK_M (`chunk_us`, `quarter_us`); `--transposed-ab` (FP8 recipes)
BLOCK_M 64 with the weight tile as the WGMMA's A and 16-token sub-blocks (`transposed_us`,
`transposed_ratio_to_fp8`); `--storage-ab` both BLOCK_Ms on the weights in the other storage order
(`ExpertWeights.tiled`; `storage_us`, `storage_over_default`). `--config KEY=VALUE` (repeatable):
the GEMMs' configuration of every run (`config.Sm90GemmConfig` fields, `bench.common.parse_config`);
`--config-ab KEY=VALUE[,KEY=VALUE...]` (repeatable) both BLOCK_Ms with those settings too, the i-th
as `config<i>_us`, `config<i>_over_default` of each row (and `config<i>_ratio_to_fp8`; with
`--storage-ab` also BLOCK_M 64 on the other storage order, `config<i>_storage_us`,
`config<i>_storage_over_default`), the settings in the JSON's meta. Every variant's outputs must
equal its BLOCK_M's default's bit for bit (else the run stops). `--power SECONDS` (`fp8xfp4_sm90`
rows): after the timing, the picked MXFP4 run and the faster fp8xfp8 one back to back for SECONDS
each, in turn `--power-rounds` times (`bench.common.sustained_power`): the picked row's
`sustained_ratio_to_fp8` (time over fp8xfp8's under a steady load at the power limit), `watts`,
`mhz`, `fp8_watts`, `fp8_mhz`.

    python -m bench.bench_gemm [--hidden 7168] [--inter 2048] [--configs 256x256,128x8,...]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.common import (
    Peaks,
    Results,
    copy_ceiling,
    gpu_clocks,
    parse_config,
    sustained_power,
    time_cuda_graphs_interleaved,
)
from cute_megamoe.config import Sm90GemmConfig
from cute_megamoe.expert_gemm import (
    TILEABLE_RECIPES,
    ExpertWeights,
    expert_ffn,
    tiles_weights,
)
from cute_megamoe.heuristics import DEFAULT_PROMOTION, select_block_m
from cute_megamoe.kernels.common.gemm_config import weight_sf_row_len
from cute_megamoe.utils import ceil_div

DEFAULT_CONFIGS = "256x256,64x512,32x1024,128x8,128x32,32x64"


def _random_weights(recipe: str, e: int, hidden: int, inter: int) -> ExpertWeights:
    if recipe == "fp8xfp4_sm90":
        # MXFP4 quantized from Gaussian BF16 weights, as `bench_layer`'s and trained
        # checkpoints' (uniformly random codes, which trained weights are not, draw more power)
        gen = torch.Generator(device="cuda").manual_seed(0)
        w1, w2 = ((torch.randn(e, n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16)
                  for n, k in ((2 * inter, hidden), (hidden, inter)))
        return ExpertWeights.from_bf16(w1, w2, recipe)
    if recipe == "bf16xbf16":
        return _library_storage(ExpertWeights(
            recipe, torch.randn(e, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
            torch.randn(e, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02))
    fp8 = torch.float8_e4m3fn

    def sf(*shape):
        return torch.rand(*shape, device="cuda") * 1e-3 + 1e-3

    return _library_storage(ExpertWeights(
        recipe, torch.randn(e, 2 * inter, hidden, device="cuda").to(fp8),
        torch.randn(e, hidden, inter, device="cuda").to(fp8),
        sf(e, hidden // 128, weight_sf_row_len(2 * inter)),
        sf(e, inter // 128, weight_sf_row_len(hidden))))


def _library_storage(w: ExpertWeights) -> ExpertWeights:
    """``w`` stored as the library's constructors store it (`ExpertWeights.tiled`)."""
    return w.tiled_copy() if tiles_weights(w.recipe, w.arch, w.w1, w.w2) else w


def _ours(recipe, w: ExpertWeights, m: int, block_m: int, config: Sm90GemmConfig | None = None):
    """Our expert FFN on random pools (the same for every variant of a ``block_m``: the A/Bs
    compare the outputs), with the GEMMs' ``config`` (A/B variants; None: the library's
    choices); ``run.outputs``: its L2 inputs and outputs."""
    e, hidden, inter = w.num_experts, w.hidden, w.intermediate
    p_rows = e * ceil_div(m, block_m) * block_m
    torch.manual_seed(1000 + block_m)
    fp8 = recipe != "bf16xbf16"
    acts = torch.randn(p_rows, hidden, device="cuda").to(
        torch.float8_e4m3fn if fp8 else torch.bfloat16)
    acts_sf = torch.ones(hidden // 128, p_rows, device="cuda").t() if fp8 else None
    topk = torch.rand(p_rows, device="cuda")
    counts = torch.full((e,), m, dtype=torch.int32, device="cuda")
    # (zeros: the pad rows, never written, compare equal between variants)
    l2 = torch.zeros(p_rows, inter, device="cuda", dtype=acts.dtype)
    l2_sf = torch.empty(inter // 128, p_rows, device="cuda").t() if fp8 else None
    out = torch.zeros(p_rows, hidden, device="cuda", dtype=torch.bfloat16)

    def run():
        expert_ffn(acts, acts_sf, topk, counts, w, block_m=block_m, activation_clamp=10.0,
                   l2_acts=l2, l2_acts_sf=l2_sf, out=out, validate_counts=False,
                   expected_tokens_per_expert=m, config=config)

    run.outputs = (l2, out)
    return run


def _torch(recipe, w: ExpertWeights, m: int):
    w = w.untiled_copy()  # (torch reads the weights in row order)
    e, hidden, inter = w.num_experts, w.hidden, w.intermediate
    rows = e * m
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * m
    w1t, w2t = w.w1.transpose(1, 2), w.w2.transpose(1, 2)  # [E, K, N], K-major
    if recipe == "bf16xbf16":
        a1 = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        a2 = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)

        def run():
            torch._grouped_mm(a1, w1t, offs=offs)
            torch._grouped_mm(a2, w2t, offs=offs)

        return run
    fp8 = torch.float8_e4m3fn
    a1 = torch.randn(rows, hidden, device="cuda").to(fp8)
    a2 = torch.randn(rows, inter, device="cuda").to(fp8)
    sa1, sa2 = torch.rand(rows, device="cuda"), torch.rand(rows, device="cuda")
    sb1 = torch.rand(e, 2 * inter, device="cuda")
    sb2 = torch.rand(e, hidden, device="cuda")

    def run():
        torch._scaled_grouped_mm(a1, w1t, sa1, sb1, offs=offs, out_dtype=torch.bfloat16)
        torch._scaled_grouped_mm(a2, w2t, sa2, sb2, offs=offs, out_dtype=torch.bfloat16)

    return run


def _parse_config_ab(spec: str, base: Sm90GemmConfig) -> Sm90GemmConfig:
    """``KEY=VALUE[,KEY=VALUE...]`` (`--config-ab`) on top of ``base``."""
    return parse_config(spec.split(","), base, "--config-ab")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="EXPERTSxPAIRS_PER_EXPERT,...")
    p.add_argument("--recipes", default="fp8xfp8,bf16xbf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="the GEMMs' configuration of every run (repeatable; "
                        "config.Sm90GemmConfig fields, e.g. k_unroll=1)")
    p.add_argument("--quarter-ab", action="store_true",
                   help="FP8 recipes: time both promotions, 'chunk' and 'quarter' "
                        "(interleaved, outputs checked bit-exact; ours_us: the default's)")
    p.add_argument("--storage-ab", action="store_true",
                   help="also time both BLOCK_Ms on the weights in the other storage order "
                        "(`ExpertWeights.tiled`: fp8xfp8 / bf16xbf16 default to [128 rows, "
                        "k-block] boxes, so rows; fp8xfp4_sm90 to rows, so boxes; checked "
                        "bit-exact; other_storage, storage_over_default)")
    p.add_argument("--transposed-ab", action="store_true",
                   help="FP8 recipes: also time BLOCK_M 64 transposed, the weight tile as the "
                        "WGMMA's A and 16-token sub-blocks (transposed=1; outputs checked "
                        "bit-exact; transposed_over_default: against the default build)")
    p.add_argument("--config-ab", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="also time both BLOCK_Ms with these settings (repeatable; outputs checked "
                        "bit-exact; config<i>_us, config<i>_over_default)")
    p.add_argument("--power", type=float, default=0.0, metavar="SECONDS",
                   help="fp8xfp4_sm90: also run the picked MXFP4 run and the faster fp8xfp8 run "
                        "back to back for SECONDS each, sampling power (sustained_ratio_to_fp8)")
    p.add_argument("--power-rounds", type=int, default=1, metavar="N",
                   help="with --power: the two runs N times in turn, medians")
    args = p.parse_args()
    hidden, inter = args.hidden, args.inter
    base = parse_config(args.config, Sm90GemmConfig())
    config_abs = [_parse_config_ab(spec, base) for spec in args.config_ab]
    peaks = Peaks()
    res = Results("gemm", meta={"hidden": hidden, "intermediate": inter,
                                "clocks_before": gpu_clocks(), "config": args.config,
                                "config_ab": args.config_ab,
                                "note": "torch runs only the two GEMMs (no SwiGLU/requant)"})
    for recipe in args.recipes.split(","):
        fp8 = recipe != "bf16xbf16"
        fp4 = recipe == "fp8xfp4_sm90"
        for cfg in args.configs.split(","):
            e, m = (int(v) for v in cfg.split("x"))
            w = _random_weights(recipe, e, hidden, inter)
            weight_bytes = sum(t.numel() * t.element_size() for t in (w.w1, w.w2)) + (
                (w.w1_sf.numel() + w.w2_sf.numel()) * 4 if fp4 else 0)
            floor = weight_bytes / copy_ceiling(min(weight_bytes, 2 << 30))
            flops = 6 * e * m * hidden * inter
            quarter = args.quarter_ab and fp8
            # (with --quarter-ab: both promotions forced, `ours` the one the library picks)
            runs = {bm: _ours(recipe, w, m, bm, dataclasses.replace(base, promotion="chunk")
                              if quarter else base) for bm in (64, 128)}
            if fp4:  # the baseline: our fp8xfp8 kernels on FP8 weights of the same shape
                w_fp8 = _random_weights("fp8xfp8", e, hidden, inter)
                runs["fp8_64"] = _ours("fp8xfp8", w_fp8, m, 64, base)
                runs["fp8_128"] = _ours("fp8xfp8", w_fp8, m, 128, base)
            else:
                runs["torch"] = _torch(recipe, w, m)
            variants = {}  # run key: (BLOCK_M, configuration)
            if quarter:
                variants.update({f"quarter_{bm}": (bm, dataclasses.replace(
                    base, promotion="quarter")) for bm in (64, 128)})
            transposed = args.transposed_ab and fp8
            if transposed:
                variants["transposed_64"] = (64, dataclasses.replace(base, transposed=True))
            for i, config in enumerate(config_abs):
                for bm in (64, 128):
                    variants[f"config{i}_{bm}"] = (bm, config)
            storage = args.storage_ab and recipe in TILEABLE_RECIPES
            variant_weights = {}
            if storage:  # the same weights in the other storage order (`ExpertWeights.tiled`)
                w_other = w.untiled_copy() if w.tiled else w.tiled_copy()
                for bm in (64, 128):
                    variants[f"storage_{bm}"] = (bm, base)
                    variant_weights[f"storage_{bm}"] = w_other
                for i, config in enumerate(config_abs):  # (each --config-ab variant on them)
                    variants[f"config{i}_storage_64"] = (64, config)
                    variant_weights[f"config{i}_storage_64"] = w_other
            for key, (block_m, config) in variants.items():
                runs[key] = _ours(recipe, variant_weights.get(key, w), m, block_m, config)
                for fn in (runs[block_m], runs[key]):
                    fn()
                torch.cuda.synchronize()
                for a, b in zip(runs[block_m].outputs, runs[key].outputs, strict=True):
                    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                        raise SystemExit(f"{recipe} {cfg} block_m {block_m}: {key}'s outputs "
                                         "differ")
            # (the runs' graphs replayed in turn: each run sees the same clocks and power)
            times = time_cuda_graphs_interleaved(runs, calls_per_replay=5,
                                                 replays=5 * args.rounds)
            picked = select_block_m(m, "sm90")
            sustained = {}
            if fp4 and args.power > 0:  # (after the timing rounds: at the power limit)
                fp8_key = min(("fp8_64", "fp8_128"), key=lambda key: times[key])
                sustained = sustained_power({"fp4": runs[picked], "fp8": runs[fp8_key]},
                                            args.power, args.power_rounds)
            for block_m in (64, 128):
                t = times[block_m]
                if quarter:
                    t_chunk, t_q = t, times[f"quarter_{block_m}"]
                    default = DEFAULT_PROMOTION.get((recipe, block_m), "chunk")
                    if default == "quarter":
                        t = t_q
                roof = peaks.roofline_s(flops=flops, hbm_bytes=weight_bytes, fp8=fp8)
                if fp4:
                    t_fp8 = min(times["fp8_64"], times["fp8_128"])
                    cols = dict(fp8_us=t_fp8 * 1e6, ratio_to_fp8=t / t_fp8)
                else:
                    t_torch = times["torch"]
                    cols = dict(torch_us=t_torch * 1e6, speedup=t_torch / t,
                                torch_tflops=flops / t_torch / 1e12)
                if quarter:
                    cols.update(chunk_us=t_chunk * 1e6, quarter_us=t_q * 1e6,
                                quarter_over_chunk=t_q / t_chunk,
                                promotion=default)
                if transposed and block_m == 64:
                    cols.update(transposed_us=times["transposed_64"] * 1e6,
                                transposed_over_default=times["transposed_64"] / t)
                    if fp4:
                        cols["transposed_ratio_to_fp8"] = times["transposed_64"] / t_fp8
                if storage:
                    cols.update(other_storage="rows" if w.tiled else "boxes",
                                storage_us=times[f"storage_{block_m}"] * 1e6,
                                storage_over_default=times[f"storage_{block_m}"] / t)
                    if fp4:
                        cols["storage_ratio_to_fp8"] = times[f"storage_{block_m}"] / t_fp8
                for i in range(len(config_abs)):
                    t_ab = times[f"config{i}_{block_m}"]
                    cols.update({f"config{i}_us": t_ab * 1e6,
                                 f"config{i}_over_default": t_ab / t})
                    if fp4:
                        cols[f"config{i}_ratio_to_fp8"] = t_ab / t_fp8
                    if storage and block_m == 64:
                        t_ab = times[f"config{i}_storage_64"]
                        cols.update({f"config{i}_storage_us": t_ab * 1e6,
                                     f"config{i}_storage_over_default": t_ab / t})
                if block_m == picked and len(sustained) == 2:
                    fp4_run, fp8_run = sustained["fp4"], sustained["fp8"]
                    cols.update(sustained_ratio_to_fp8=fp4_run["seconds_per_call"]
                                / fp8_run["seconds_per_call"], watts=fp4_run["watts"],
                                mhz=fp4_run["sm_mhz"], fp8_watts=fp8_run["watts"],
                                fp8_mhz=fp8_run["sm_mhz"])
                res.add(recipe=recipe, experts=e, pairs_per_expert=m, block_m=block_m,
                        picked=block_m == picked, ours_us=t * 1e6, ours_tflops=flops / t / 1e12,
                        weight_floor_us=floor * 1e6, ratio_to_floor=t / floor,
                        ratio_to_roofline=t / roof, **cols)
            del w, runs
            torch.cuda.empty_cache()
    res.meta["clocks_after"] = gpu_clocks()
    path = res.save()
    print(f"saved {path}")
    print(res.table(["recipe", "experts", "pairs_per_expert", "block_m", "picked", "ours_us",
                     "torch_us", "speedup", "fp8_us", "ratio_to_fp8", "chunk_us", "quarter_us",
                     "other_storage",
                     "storage_us", "storage_over_default", "storage_ratio_to_fp8",
                     "transposed_us",
                     "transposed_over_default", "transposed_ratio_to_fp8",
                     "quarter_over_chunk", "sustained_ratio_to_fp8",
                     *(f"config{i}_{c}" for i in range(len(config_abs))
                       for c in ("us", "over_default", "ratio_to_fp8", "storage_us",
                                 "storage_over_default")), "ours_tflops",
                     "torch_tflops", "weight_floor_us", "ratio_to_floor"]))


if __name__ == "__main__":
    main()
