"""Where a hung fused call stopped: the fused layer kernel's phase clock in pinned host memory.

    python -m cute_megamoe.testing.stall_probe [--recipe fp8xfp4_sm90] [--block-m 64]
        [--ranks 1] [--rounds 3] [--rows counted] [--max-tokens 300]

Runs `fused_checks.FusedLayer` (a loopback group of ``--ranks`` on one GPU, the staged layer as the
oracle) through its warm-up and ``--rounds`` rounds of checked calls, with every fused launch built
with the phase clock (`config.Sm90FusedConfig.debug`) and its stamps
(`kernels/sm90_mega_moe.PHASE_STAMPS`) written to pinned host memory: each stamp is fenced at system
scope, so after a stall has trapped and the CUDA context is gone the host still reads which CTAs
reached which phase. On a failure it prints, per rank of the failing call, how many CTAs reached
each stamp and the first CTAs that did not (a CTA with ``loads_done`` but no ``l2_done``: its
consumers are stuck; no ``decode_done``: its decode warps). A diagnostic for the fused FP4 stalls
(docs/performance.md); set ``CUTE_MEGAMOE_SPIN_TIMEOUT_S`` low (a few seconds) so that a stall traps
quickly. The stamp stores make the kernel a little slower, which may hide a race. ``--rows``: every
rank's row transfer (default: the kernel's); ``--max-tokens``: the buffer's tokens per rank (the
counted-row mixing test of `tests/test_fused.py`, which failed where this probe passed, uses 200).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="fp8xfp4_sm90")
    parser.add_argument("--block-m", type=int, default=64, choices=(64, 128))
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", choices=("barrier", "counted"), default=None)
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    if args.max_tokens < 1:
        raise SystemExit("--max-tokens: at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("stall_probe needs a CUDA GPU")

    from .. import fused
    from ..kernels.sm90_mega_moe import PHASE_STAMPS
    from .fused_checks import FusedLayer, rows_config
    from .ranks import Ranks

    clocks: dict[int, torch.Tensor] = {}  # by rank: its CTAs' stamps of the last call
    launch = fused.fused_call

    def clocked_call(sym_buffer, weights, num_tokens, y, num_ctas, stats, clamp, fast_math,
                     config, **kwargs):
        stamps = clocks.get(sym_buffer.rank)
        if stamps is None or stamps.shape[0] != num_ctas:
            stamps = torch.zeros(num_ctas, len(PHASE_STAMPS), dtype=torch.int64,
                                 pin_memory=True)
            clocks[sym_buffer.rank] = stamps
        stamps.zero_()  # (the previous call has finished: the checks synchronize)
        return launch(sym_buffer, weights, num_tokens, y, num_ctas, stats, clamp, fast_math,
                      dataclasses.replace(config, debug="phase_clock"), debug=stamps, **kwargs)

    fused.fused_call = clocked_call
    layer = FusedLayer(Ranks.loopback(args.ranks, 16, args.max_tokens, 4, 512, 256, args.recipe),
                       configs={r: rows_config(args.rows) for r in range(args.ranks)})
    cases = [(min(n, args.max_tokens), routing) for n, routing in (
        (100, "random"), (300, "one_expert"), (129, "masked"), (77, "skewed"), (0, "random"),
        (1, "random"))]
    block_ms = {b.rank: args.block_m for b in layer.ranks.buffers}
    done = 0
    try:
        layer.warm_up((args.block_m,))
        for _ in range(args.rounds):
            for i, (n, routing) in enumerate(cases):
                tokens = tuple(n if r % 2 == 0 else max(0, n - 37) for r in range(args.ranks))
                layer.check_call(tokens, routing, block_ms, seed=i, against_reference=False)
                done += 1
    except Exception as error:  # (a trap: the context is gone, the pinned stamps are not)
        print(f"{args.recipe} BLOCK_M {args.block_m}: failed after {done} checked calls: "
              f"{str(error).splitlines()[0][:120]}")
        for rank, stamps in sorted(clocks.items()):
            print(f"rank {rank}: stamp, CTAs that reached it / {stamps.shape[0]}, first missing")
            for j, name in enumerate(PHASE_STAMPS):
                missing = (stamps[:, j] == 0).nonzero().flatten().tolist()
                print(f"  {name:12s} {stamps.shape[0] - len(missing):4d}  {missing[:12]}")
        raise SystemExit(1) from None
    print(f"{args.recipe} BLOCK_M {args.block_m}, {args.ranks} rank(s): {done} checked calls "
          f"passed")


if __name__ == "__main__":
    main()
