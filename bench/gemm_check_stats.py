"""Accuracy statistics of the grouped GEMMs against the float64 reference (one GPU).

For each recipe, BLOCK_M and routing pattern at the DeepSeek shape (H 7168, I 2048, 8 experts):
the L1 / L2 / end-to-end relative errors and how many L1 outputs differ from the reference by a
rounding step (FP8 requantization or BF16 rounding flipped by the FP32 accumulation order), the
numbers `testing.gemm_checks` bounds; and the kernels' and the reference's error against the FFN
in float64 on the unquantized BF16 tokens and weights (what the recipe's quantization costs, and
whether the kernels add to it). Prints a table and writes JSON to bench/results/.

    python -m bench.gemm_check_stats
"""

from __future__ import annotations

import torch

from bench.common import Results, gpu_clocks
from cute_megamoe.testing.gemm_checks import COUNT_PATTERNS, check_expert_ffn, make_pool_problem


def main() -> None:
    res = Results("gemm_accuracy", meta={"hidden": 7168, "intermediate": 2048,
                                         "clocks_before": gpu_clocks()})
    device = torch.device("cuda")
    for recipe in ("fp8xfp8", "fp8xfp4_sm90", "bf16xbf16"):
        for block_m in (64, 128):
            for pattern in ("random", "skewed", "sparse"):
                problem = make_pool_problem(recipe, COUNT_PATTERNS[pattern], block_m, 7168,
                                            2048, device, seed=block_m + len(pattern),
                                            keep_unquantized=True)
                stats = check_expert_ffn(problem, activation_clamp=10.0)
                res.add(recipe=recipe, block_m=block_m, pattern=pattern, **stats)
    res.meta["clocks_after"] = gpu_clocks()
    print(f"saved {res.save()}")
    print(res.table(["recipe", "block_m", "pattern", "rows", "l1_err", "l2_err", "e2e_err",
                     "l1_flip_frac", "l1_big_flips", "sf_mismatch", "sf_near_tie",
                     "unquantized_err", "ref_unquantized_err", "unquantized_ratio"]))


if __name__ == "__main__":
    main()
