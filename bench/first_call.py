"""Ahead-of-time compile, then a layer's first calls: no compile left in them (issue 62).

    python -m bench.first_call                      # 128 experts, H 7168, I 2048, fp8xfp8
    python -m bench.first_call --recipe fp8xfp4_sm90 --fused 0 --tokens 1 128 4096

In a fresh process: `cute_megamoe.precompile.precompile` for the shape (timed; its table), then
a `MegaMoE` of that shape (random BF16 masters, one rank), then one call per token count in
``--tokens`` (timed, synchronized) with the number of kernels each call compiled (from the
``cute_megamoe`` log: must be 0), then the same calls again (the warm time). A row per call in
``bench/results/first-call-<stamp>.json``, the precompile's total and table in ``meta``.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from bench.common import Results


class _Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += hasattr(record, "cute_megamoe_compile")


def _timed_call(layer, x, idx, w) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    layer(x, idx, w)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    import cute_megamoe as cm
    from cute_megamoe.precompile import precompile
    from cute_megamoe.runtime import LOGGER

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--recipe", default="fp8xfp8")
    parser.add_argument("--fused", type=int, choices=(0, 1), default=None,
                        help="the layer's fused argument (default: its own choice)")
    parser.add_argument("--activation-clamp", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 4096])
    args = parser.parse_args()
    e, k, h, i, t = args.experts, args.topk, args.hidden, args.intermediate, args.max_tokens
    compiles = _Compiles()
    LOGGER.addHandler(compiles)
    LOGGER.setLevel(logging.INFO)

    report = precompile(e, k, h, i, t, args.recipe, activation_clamp=args.activation_clamp)
    print(report.table(), flush=True)
    precompiled = compiles.count

    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device="cuda").normal_(
        0, h**-0.5, generator=gen)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device="cuda").normal_(
        0, i**-0.5, generator=gen)
    start = time.perf_counter()
    fused = None if args.fused is None else bool(args.fused)
    layer = cm.MegaMoE(None, e, t, k, h, i, args.recipe, w1, w2,
                       activation_clamp=args.activation_clamp, fused=fused)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    del w1, w2
    torch.cuda.empty_cache()
    print(f"layer built in {build_s:.1f} s: {layer.extra_repr()}", flush=True)

    results = Results("first-call")
    results.meta.update(precompile_seconds=report.seconds, precompiled_kernels=precompiled,
                        precompile_table=report.table(), layer=layer.extra_repr(),
                        layer_build_seconds=build_s)
    inputs = {}
    for n in args.tokens:
        x = torch.randn(n, h, generator=gen, device="cuda").to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, generator=gen, device="cuda")[:k]
                           for _ in range(n)])
        w = torch.rand(n, k, generator=gen, device="cuda")
        inputs[n] = (x, idx, w)
        before = compiles.count
        first = _timed_call(layer, x, idx, w)
        results.add(tokens=n, first_call_seconds=first, compiles_in_call=compiles.count - before,
                    path=layer.config.path, fused=layer.config.fused, recipe=args.recipe,
                    gpu=torch.cuda.get_device_name())
    for row in results.rows:
        row["warm_call_seconds"] = _timed_call(layer, *inputs[row["tokens"]])
    print(f"precompile: {precompiled} kernels, {report.seconds:.1f} s")
    print(results.table(["tokens", "first_call_seconds", "warm_call_seconds",
                         "compiles_in_call", "fused"]))
    print(results.save())


if __name__ == "__main__":
    main()
