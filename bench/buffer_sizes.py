"""Symmetric memory per rank: our buffer against DeepGEMM's size formula, for the same shapes.

    python3 -m bench.buffer_sizes [--ranks 2 8] [--tokens 4096 8192]

Ours: `layout.MegaMoELayout.num_bytes`, also with both pools as rings, built: the fused
ticket walk's L1-output ring of `OUT_RING_ROWS` rows (`l1_output_rows`) and the pulled rows'
received-rows ring of `ROW_RING_ROWS` rows (`received_rows`); the dataflow design's (issue 65):
`layout.dataflow.dataflow_buffer_bytes` (both pools as rings; now the same size).
DeepGEMM's: the formula of its FP8xFP4 / BF16 buffer (reference doc section 2: a workspace,
the inputs, L1 / L2 activation rings of `Rg` tokens with their scale rings, the combine
buffer; section 1.1 and 7.4 for `T` and `Rg`), evaluated here without DeepGEMM (its sizing
entry point is registered only where its SM100 kernels build).
`deepgemm_buffer_bytes` reproduces the doc's own table (section 2.4; `tests/test_buffer_sizes.py`).
Nothing runs on a GPU; the JSON goes to `bench/results/` (or `CUTE_MEGAMOE_RESULTS_DIR`).
"""

from __future__ import annotations

import argparse

from bench.common import Results

TOKEN_ALIGNMENT = 384  # DeepGEMM: the LCM of its candidate BLOCK_Ms
PREFILL_RING = 768 * 1024  # DeepGEMM's ring for T >= 6144 tokens
PREFILL_TOKENS = 6144


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _wave_pool(num_ranks: int, topk: int, tokens: int, experts_per_wave: int,
               block_m: int) -> int:
    if experts_per_wave == 1:
        return num_ranks * tokens
    return min(num_ranks * tokens * experts_per_wave,
               _align(num_ranks * tokens * topk + experts_per_wave * (block_m - 1), block_m))


def deepgemm_ring_tokens(num_ranks: int, num_local_experts: int, topk: int,
                         tokens: int) -> int:
    """DeepGEMM's L1/L2 ring capacity `Rg` for `tokens` (already aligned to 384)."""
    lo = _wave_pool(num_ranks, topk, tokens, 1, TOKEN_ALIGNMENT)
    hi = _wave_pool(num_ranks, topk, tokens, num_local_experts, TOKEN_ALIGNMENT)
    if tokens >= PREFILL_TOKENS:
        ring = _align(PREFILL_RING, TOKEN_ALIGNMENT)
    else:  # its fixed decode reference configuration
        ring = _wave_pool(72, 6, _align(4096, TOKEN_ALIGNMENT), 6, TOKEN_ALIGNMENT)
    return min(max(ring, lo), hi)


def deepgemm_buffer_bytes(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int,
                          topk: int, hidden: int, intermediate: int,
                          fp8: bool = True) -> dict[str, int]:
    """DeepGEMM's symmetric buffer per rank, by part (bytes): FP8xFP4 (``fp8``) or BF16."""
    r, e, k, h, i = num_ranks, num_experts, topk, hidden, intermediate
    e_l = e // r
    t = _align(num_max_tokens_per_rank, TOKEN_ALIGNMENT)
    ring = deepgemm_ring_tokens(r, e_l, k, t)
    sf_ring = 16 * ring if fp8 else 0
    pool = _align(r * t * min(k, e_l) + e_l * (192 - 1), TOKEN_ALIGNMENT)
    workspace = (32 + 8 * e + 8 * e + 8 * e_l + 4 * 4 * (ring // 8) + 4 * e_l * r * r * t
                 + 12 * pool)
    eb = 1 if fp8 else 2
    parts = {
        "workspace": _align(workspace, 16),
        "inputs": t * h * eb + (t * h // 32 if fp8 else 0) + t * 8 * k + t * 4 * k,
        "l1_ring": ring * h * eb + sf_ring * h // 32 + ring * 4,
        "l2_ring": ring * i * eb + sf_ring * i // 32,
        "combine": k * t * 2 * h,
    }
    parts["total"] = sum(parts.values())
    parts["ring_tokens"] = ring
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096, 8192])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    args = parser.parse_args()

    from cute_megamoe.layout import MegaMoELayout
    from cute_megamoe.layout.dataflow import OUT_RING_ROWS, ROW_RING_ROWS, dataflow_buffer_bytes

    gib = float(1 << 30)
    res = Results("buffer_sizes", meta={"experts": args.experts, "topk": args.topk,
                                        "hidden": args.hidden, "intermediate": args.intermediate,
                                        "note": "computed (no GPU): ours from the layout, "
                                                "DeepGEMM's from its size formula"})
    for r in args.ranks:
        for t in args.tokens:
            shape = (r, args.experts, t, args.topk, args.hidden, args.intermediate)
            ours = {recipe: MegaMoELayout(*shape, recipe).num_bytes
                    for recipe in ("fp8xfp8", "fp8xfp4", "bf16xbf16")}
            theirs = deepgemm_buffer_bytes(*shape, fp8=True)
            theirs_bf16 = deepgemm_buffer_bytes(*shape, fp8=False)
            dataflow = dataflow_buffer_bytes(*shape, "fp8xfp8")["total"]
            ring = MegaMoELayout(*shape, "fp8xfp8", l1_output_rows=OUT_RING_ROWS).num_bytes
            rings = MegaMoELayout(*shape, "fp8xfp8", l1_output_rows=OUT_RING_ROWS,
                                  received_rows=ROW_RING_ROWS).num_bytes
            res.add(ranks=r, tokens=t, ours_fp8xfp8_gib=ours["fp8xfp8"] / gib,
                    ours_l1_ring_fp8xfp8_gib=ring / gib,
                    ours_rings_fp8xfp8_gib=rings / gib,
                    dataflow_fp8xfp8_gib=dataflow / gib,
                    ours_fp8xfp4_gib=ours["fp8xfp4"] / gib,
                    deepgemm_fp8xfp4_gib=theirs["total"] / gib,
                    ours_bf16_gib=ours["bf16xbf16"] / gib,
                    deepgemm_bf16_gib=theirs_bf16["total"] / gib,
                    deepgemm_ring_tokens=theirs["ring_tokens"],
                    ours_pool_rows=MegaMoELayout(*shape, "fp8xfp8").num_pool_rows,
                    ours_over_deepgemm_fp8=ours["fp8xfp4"] / theirs["total"])
    print(f"saved {res.save()}")
    print(res.table(["ranks", "tokens", "ours_fp8xfp8_gib", "ours_l1_ring_fp8xfp8_gib",
                     "ours_rings_fp8xfp8_gib", "dataflow_fp8xfp8_gib",
                     "ours_fp8xfp4_gib",
                     "deepgemm_fp8xfp4_gib", "ours_bf16_gib", "deepgemm_bf16_gib",
                     "ours_pool_rows", "deepgemm_ring_tokens", "ours_over_deepgemm_fp8"]))


if __name__ == "__main__":
    main()
