"""GPU checks of the grouped-GEMM expert FFN (`expert_gemm.expert_ffn`) against the reference.

`make_pool_problem` builds a pool the way the dispatch lays it out (expert-major, each expert
padded to `block_m` rows) from fresh random BF16 tokens, quantized per recipe; pad rows hold
random garbage so a kernel that reads them into valid rows is caught. `check_expert_ffn` runs
the kernels with poisoned outputs and compares with `reference.expert_ffn_reference` per expert
(float64 GEMMs on the same dequantized operands):

* every valid output row is written and finite, every pad row still holds the poison;
* L1 (FP8): the requantization scale per (row, 128 features) equals the reference's except
  where the reference's `amax / 448` sits within float32 rounding of a power of two; the e4m3
  codes may differ by one step where the FP32 accumulation order flips a BF16 or e4m3
  rounding (counted and bounded, never hidden);
* L2: compared with the float64 product of *our* L2 input (isolates the L2 GEMM), and the
  whole FFN with the reference end to end;
* optionally (``make_pool_problem(keep_unquantized=True)``), what the recipe's quantization
  costs: the kernels' output and the reference's against the FFN in float64 on the unquantized
  BF16 tokens and weights (`reference.expert_ffn_float64`). The two should be equally far from
  it: the kernels add nothing measurable to the quantization's error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import quant, reference
from ..expert_gemm import ExpertWeights, expert_ffn
from ..scheduler.host_model import pool_block_offsets
from ..tables import activation_recipe

#: Bounds per recipe: (L1 rel. error, L2-alone rel. error, end-to-end rel. error,
#: fraction of L1 outputs allowed to differ from the reference by one rounding step).
TOLERANCE = {
    "fp8xfp8": (2e-2, 1e-2, 3e-2, 2e-2),
    "fp8xfp4_sm90": (2e-2, 1e-2, 3e-2, 2e-2),
    "bf16xbf16": (5e-3, 1e-2, 1e-2, 2e-2),
}

#: Quantized recipes: the kernels' error against the unquantized float64 FFN over the
#: reference's (``check_expert_ffn`` on a problem made with ``keep_unquantized``); measured
#: 0.9999-1.0006 at H 7168, I 2048 (bench/gemm_check_stats.py, 2026-12-04).
UNQUANTIZED_RATIO_TOL = 1.01


@dataclass
class PoolProblem:
    recipe: str
    block_m: int
    counts: list[int]
    acts: torch.Tensor
    acts_sf: torch.Tensor | None
    x_deq: torch.Tensor  # f32 [P, H] (valid rows)
    topk_weights: torch.Tensor
    weights: ExpertWeights
    w1_deq: torch.Tensor  # f32 [E, 2I, H], gate | up
    w2_deq: torch.Tensor  # f32 [E, H, I]
    row_of_expert: list[range] = field(default_factory=list)
    # bf16 tokens [P, H] and weights before quantization (`keep_unquantized`), else None
    x_unquantized: torch.Tensor | None = None
    w1_unquantized: torch.Tensor | None = None
    w2_unquantized: torch.Tensor | None = None

    @property
    def num_pool_rows(self) -> int:
        return self.acts.shape[0]


def make_pool_problem(recipe: str, counts: list[int], block_m: int, hidden: int, inter: int,
                      device, seed: int = 0, extra_blocks: int = 1,
                      keep_unquantized: bool = False) -> PoolProblem:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    e_l = len(counts)
    offsets = pool_block_offsets(counts, block_m)
    pool_rows = (offsets[-1] + extra_blocks) * block_m
    x = (torch.randn(pool_rows, hidden, generator=gen) * 2).to(torch.bfloat16)
    if recipe == "bf16xbf16":
        acts, acts_sf = x.to(device), None
        x_deq = acts.float()
    else:
        q, sf = quant.quantize_activations_for_recipe(x.to(device), recipe)
        acts = q
        acts_sf = sf.t().contiguous().t()  # [P, H/128] MN-major, as the pool holds it
        x_deq = quant.dequantize_activations_for_recipe((q, sf), recipe).float()
    topk_weights = torch.rand(pool_rows, generator=gen).to(device)
    w1 = (torch.randn(e_l, 2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e_l, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    w1, w2 = w1.to(device), w2.to(device)
    q1 = quant.quantize_weights_for_recipe(w1, recipe)
    q2 = quant.quantize_weights_for_recipe(w2, recipe)
    rows = [range(offsets[e] * block_m, offsets[e] * block_m + counts[e]) for e in range(e_l)]
    return PoolProblem(
        recipe=recipe, block_m=block_m, counts=list(counts), acts=acts, acts_sf=acts_sf,
        x_deq=x_deq, topk_weights=topk_weights,
        weights=ExpertWeights.from_quantized(q1, q2, recipe),
        w1_deq=quant.dequantize_weights_for_recipe(q1, recipe).float(),
        w2_deq=quant.dequantize_weights_for_recipe(q2, recipe).float(),
        row_of_expert=rows,
        **(dict(x_unquantized=x.to(device), w1_unquantized=w1, w2_unquantized=w2)
           if keep_unquantized else {}))


def run_fp8_ffn_poisoned(problem: PoolProblem, activation_clamp: float = 7.0,
                         config=None) -> tuple:
    """`expert_ffn` on an FP8-activation `problem` (fp8xfp8, fp8xfp4_sm90) into poisoned
    outputs: ``(L2 input bytes, its scales, the output as int16)``, read by
    `assert_same_valid_rows`. ``config``: the GEMMs' (`config.Sm90GemmConfig`; None: the
    heuristics')."""
    from ..expert_gemm import expert_ffn

    device, rows = problem.acts.device, problem.num_pool_rows
    inter, hidden = problem.weights.intermediate, problem.weights.hidden
    l2 = torch.full((rows, inter), 0x7F, dtype=torch.uint8, device=device)
    l2_sf = torch.full((inter // 128, rows), float("nan"), device=device).t()
    out = torch.full((rows, hidden), 0x7FFF, dtype=torch.int16, device=device)
    expert_ffn(problem.acts, problem.acts_sf, problem.topk_weights,
               torch.tensor(problem.counts, dtype=torch.int32, device=device), problem.weights,
               block_m=problem.block_m, activation_clamp=activation_clamp,
               l2_acts=l2.view(torch.float8_e4m3fn), l2_acts_sf=l2_sf,
               out=out.view(torch.bfloat16), config=config)
    return l2, l2_sf, out


def assert_same_valid_rows(problem: PoolProblem, results: list[tuple]) -> None:
    """Outputs of `run_fp8_ffn_poisoned` from kernel variants: every valid row written and
    equal bit for bit (L2 inputs, their scales, outputs), every pad row still poisoned."""
    torch.cuda.synchronize(problem.acts.device)
    valid = torch.zeros(problem.num_pool_rows, dtype=torch.bool, device=problem.acts.device)
    for r in problem.row_of_expert:
        valid[r.start:r.stop] = True
    for l2, _sf, out in results:
        assert bool((out[~valid] == 0x7FFF).all()), "a pad row was written"
        assert bool((l2[~valid] == 0x7F).all()), "a pad row of the L2 input was written"
        assert bool((out[valid] != 0x7FFF).all()), "a valid row was not written"
    (l2_a, sf_a, out_a) = results[0]
    for l2_b, sf_b, out_b in results[1:]:
        assert torch.equal(l2_a[valid], l2_b[valid])
        assert torch.equal(sf_a[valid].view(torch.int32), sf_b[valid].view(torch.int32))
        assert torch.equal(out_a[valid], out_b[valid])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_expert_ffn(problem: PoolProblem, activation_clamp: float | None = None,
                     fast_math: bool = True, num_sms: int | None = None) -> dict:
    """Run `expert_ffn` on `problem` with poisoned outputs; assert the bounds; return stats."""
    recipe, device = problem.recipe, problem.acts.device
    fp8 = activation_recipe(recipe) == "fp8xfp8"
    p_rows = problem.num_pool_rows
    inter, hidden = problem.weights.intermediate, problem.weights.hidden
    act_dtype = problem.acts.dtype
    # poison: NaN everywhere (0x7F is NaN in e4m3fn, 0x7FFF in bf16)
    l2_acts = torch.full((p_rows, inter), 0x7F if fp8 else 0x7FFF,
                         dtype=torch.uint8 if fp8 else torch.int16, device=device).view(act_dtype)
    l2_sf = torch.full((inter // 128, p_rows), float("nan"), device=device).t()
    out = torch.full((p_rows, hidden), 0x7FFF, dtype=torch.int16,
                     device=device).view(torch.bfloat16)
    counts = torch.tensor(problem.counts, dtype=torch.int32, device=device)
    expert_ffn(problem.acts, problem.acts_sf, problem.topk_weights, counts, problem.weights,
               block_m=problem.block_m, activation_clamp=activation_clamp, fast_math=fast_math,
               l2_acts=l2_acts, l2_acts_sf=l2_sf if fp8 else None, out=out, num_sms=num_sms)
    torch.cuda.synchronize(device)

    valid = torch.zeros(p_rows, dtype=torch.bool, device=device)
    for rows in problem.row_of_expert:
        valid[rows.start:rows.stop] = True
    assert bool(torch.isnan(out[~valid].float()).all()), "a pad row of out was written"
    assert bool(torch.isnan(l2_acts[~valid].float()).all()), "a pad row of l2_acts was written"
    l1_tol, l2_tol, e2e_tol, flip_tol = TOLERANCE[recipe]
    stats = {"rows": int(valid.sum()), "l1_err": 0.0, "l2_err": 0.0, "e2e_err": 0.0,
             "l1_flips": 0, "l1_big_flips": 0, "sf_mismatch": 0, "sf_near_tie": 0}
    unquantized = problem.x_unquantized is not None
    # squared norms over all valid rows: ours - float64, reference - float64, float64
    sq_ours = sq_ref = sq_exact = 0.0
    for e, rows in enumerate(problem.row_of_expert):
        if len(rows) == 0:
            continue
        sl = slice(rows.start, rows.stop)
        h_ref, l2_in_ref, o_ref = reference.expert_ffn_reference(
            problem.x_deq[sl], problem.topk_weights[sl], problem.w1_deq[e], problem.w2_deq[e],
            recipe, activation_clamp, fast_math)
        ours_l2 = l2_acts[sl]
        assert bool(torch.isfinite(out[sl].float()).all()), f"expert {e}: out not finite"
        if fp8:
            sf = l2_sf[sl]
            assert bool(torch.isfinite(sf).all()), f"expert {e}: l2 scales not written"
            l2_in = quant.cast_back_from_fp8(ours_l2, sf.contiguous(), 128).float()
            _, sf_ref = quant.requant_fp8_pow2(h_ref, 128)
            mismatch = sf != sf_ref
            # a scale may differ only where amax / 448 is within float32 rounding of 2^k
            amax = h_ref.abs().view(len(rows), -1, 128).amax(dim=2)
            v = amax * (1.0 / 448.0)
            near = (torch.log2(v) - torch.round(torch.log2(v))).abs() < 1e-2
            stats["sf_mismatch"] += int(mismatch.sum())
            stats["sf_near_tie"] += int((mismatch & near).sum())
            assert bool((~mismatch | near).all()), f"expert {e}: requant scale mismatch"
            # one e4m3 step: 2^-3 relative for normals, sf * 2^-9 for subnormals
            step = torch.maximum(l2_in_ref.abs() * 2.0**-3,
                                 sf.repeat_interleave(128, dim=1) * 2.0**-9)
        else:
            l2_in = ours_l2.float()
            step = l2_in_ref.abs() * 2.0 ** -7
        diff = (l2_in - l2_in_ref).abs()
        stats["l1_flips"] += int((diff > 0).sum())
        # more than one rounding step (plus slack for the accumulation order) is an error
        stats["l1_big_flips"] += int((diff > 2.01 * step.clamp_min(1e-30)).sum())
        stats["l1_err"] = max(stats["l1_err"], _rel(l2_in, l2_in_ref))
        o_from_ours = (l2_in.double() @ problem.w2_deq[e].double().T).float()
        stats["l2_err"] = max(stats["l2_err"], _rel(out[sl].float(), o_from_ours))
        stats["e2e_err"] = max(stats["e2e_err"], _rel(out[sl].float(), o_ref.float()))
        if unquantized:
            exact = reference.expert_ffn_float64(
                problem.x_unquantized[sl], problem.topk_weights[sl], problem.w1_unquantized[e],
                problem.w2_unquantized[e], activation_clamp)
            sq_ours += float((out[sl].double() - exact).square().sum())
            sq_ref += float((o_ref.double() - exact).square().sum())
            sq_exact += float(exact.square().sum())
    n_l1 = max(stats["rows"] * inter, 1)
    stats["l1_flip_frac"] = stats["l1_flips"] / n_l1
    assert stats["l1_big_flips"] <= 1e-3 * n_l1, f"L1 outputs off by > 1 step: {stats}"
    assert stats["l1_flip_frac"] <= flip_tol, f"too many L1 rounding flips: {stats}"
    assert stats["l1_err"] <= l1_tol, f"L1 error over {l1_tol}: {stats}"
    assert stats["l2_err"] <= l2_tol, f"L2 error over {l2_tol}: {stats}"
    assert stats["e2e_err"] <= e2e_tol, f"end-to-end error over {e2e_tol}: {stats}"
    if unquantized and sq_exact > 0:
        stats["unquantized_err"] = (sq_ours / sq_exact) ** 0.5
        stats["ref_unquantized_err"] = (sq_ref / sq_exact) ** 0.5
        stats["unquantized_ratio"] = stats["unquantized_err"] / stats["ref_unquantized_err"]
        if fp8:
            # the quantization's error (fp8xfp8 6.6 %, MXFP4 weights 21 %) dominates; the
            # kernels' own (the requantization's rounding flips) adds under 1 % to it
            assert stats["unquantized_ratio"] <= UNQUANTIZED_RATIO_TOL, \
                f"error against the unquantized FFN above the reference's: {stats}"
    return stats


#: Expert row-count patterns the tests and the GPU check script run (8 local experts).
COUNT_PATTERNS = {
    "random": [300, 41, 129, 1, 77, 256, 5, 200],
    "skewed": [700, 3, 0, 1, 2, 0, 9, 4],
    "sparse": [0, 1, 0, 5, 0, 0, 129, 1],
    "empty": [0] * 8,
}
