"""The pure-PyTorch reference (``cute_megamoe.reference``) against an independent naive loop.

The naive implementation below loops in Python over ranks, tokens and slots, computes every dot
product as a float64 matrix-vector product on the dequantised operands, SiLU in float64, and
combines with an explicit ascending-k loop. It shares only the quantisation helpers of
``cute_megamoe.quant`` (tested bit-exactly on their own) with the reference.

Tolerances. Dispatch bookkeeping, stats, combine and every "given the previous step" relation
are compared exactly. The end-to-end output ``y`` differs between the two implementations only
through float32-vs-float64 rounding: the reference rounds the SiLU and the products
``(s * u) * w`` to float32 (the naive loop rounds once, at the end) and sums its GEMMs in another
order. That perturbs ``h`` by about one float32 ulp (measured: max 2.1e-7 of max|h|), which
rarely flips a BF16 rounding (bf16xbf16, about 2^-16 per element) or an e4m3 code (fp8
recipes, about 2^-20 per element) of the L2 input; a flip moves ``o`` and ``y`` by one such
step times a W2 entry.

Measured over CASES x both clamps with 30 seeds each (4.8 M elements of y per recipe):

    recipe     max |dy| / max |y|   elements > 1 BF16 ulp   h: max |dh| / max |h|
    fp8xfp4    0 (y bit-identical)  0                       1.9e-7
    fp8xfp8    0 (y bit-identical)  0                       1.9e-7
    bf16xbf16  4.1e-3               74 (1.5e-5)             2.1e-7

A synthetic single flip at a row's largest L2 input moves y by up to 6e-2 of max|y| for the
FP8 recipes (one e4m3 step, 2^-4 relative) and 3.3e-3 for BF16 (2^-8), so the max-error bounds
allow about two such flips (seeds, CPU kernels and torch versions change which elements sit
on a rounding boundary), while the count of elements off by more than one BF16 ulp is bounded
at 1e-4 of all elements (+2 for the smallest cases): a real semantic error (a missing BF16
rounding, a wrong clamp, a wrong scale) flips a large fraction of elements and fails it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cute_megamoe.quant import (
    cast_back_from_fp8,
    dequantize_activations_for_recipe,
    dequantize_weights_for_recipe,
    quantize_activations_for_recipe,
    quantize_weights_for_recipe,
    requant_fp8_pow2,
)
from cute_megamoe.reference import (
    MegaMoEReferenceResult,
    combine_reference,
    dispatch_reference,
    expert_ffn_float64,
    expert_ffn_reference,
    mega_moe_reference,
    swiglu_reference,
)

RECIPES = ("fp8xfp4", "fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")
L2_GRAN = {"fp8xfp4": 32, "fp8xfp8": 128, "fp8xfp4_sm90": 128}

# Bounds derived in the module docstring. max |y_ref - y_naive| / max |y_naive| per rank:
_Y_REL_BOUND = {"fp8xfp4": 0.15, "fp8xfp8": 0.15, "bf16xbf16": 1.5e-2, "fp8xfp4_sm90": 0.15}
# Fraction of y elements differing by more than 1 BF16 ulp (of the larger magnitude):
_Y_ULP_FRACTION_BOUND = {"fp8xfp4": 1e-4, "fp8xfp8": 1e-4, "bf16xbf16": 1e-4,
                         "fp8xfp4_sm90": 1e-4}
# max |h_ref - h_naive| / max |h_naive| per expert (h = L1 output before requant): ~5x measured.
_H_REL_BOUND = 1e-6


# ------------------------------------------------------------------------------------------------
# Problems
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    x: list[torch.Tensor]
    topk_idx: list[torch.Tensor]
    topk_weights: list[torch.Tensor]
    l1: list[torch.Tensor]
    l2: list[torch.Tensor]
    num_experts: int

    @property
    def num_ranks(self) -> int:
        return len(self.x)


def make_problem(
    seed: int,
    num_ranks: int,
    num_experts: int,
    num_topk: int,
    hidden: int,
    inter: int,
    tokens: list[int],
    one_expert: bool = False,
    mask_prob: float = 0.25,
) -> Problem:
    """Random inputs. Token 1 of every rank with >= 2 tokens has all its slots masked; with
    ``one_expert`` every token names the last expert only (in slot 0; a token names an expert
    once, its other slots masked)."""
    assert len(tokens) == num_ranks and num_experts % num_ranks == 0
    g = torch.Generator().manual_seed(seed)
    num_local = num_experts // num_ranks
    xs, idxs, ws, l1s, l2s = [], [], [], [], []
    for n in tokens:
        xs.append((torch.randn(n, hidden, generator=g) * 1.5).to(torch.bfloat16))
        idx = torch.empty(n, num_topk, dtype=torch.int64)
        for t in range(n):  # K distinct experts per token
            idx[t] = torch.randperm(num_experts, generator=g)[:num_topk]
        if one_expert:
            idx = torch.full_like(idx, -1)
            idx[:, 0] = num_experts - 1
        idx[torch.rand(n, num_topk, generator=g) < mask_prob] = -1
        if n >= 2:
            idx[1] = -1
        idxs.append(idx)
        # Masked slots keep random non-zero weights: they must be ignored, not multiplied by 0.
        ws.append(torch.rand(n, num_topk, generator=g) + 0.1)
    for _ in range(num_ranks):
        # Gate/up accumulators of std ~4 (so a clamp at 10 bites), outputs of order 1.
        l1s.append(
            (torch.randn(num_local, 2 * inter, hidden, generator=g) * (2.7 / hidden**0.5)).to(
                torch.bfloat16
            )
        )
        l2s.append(
            (torch.randn(num_local, hidden, inter, generator=g) * (1.0 / inter**0.5)).to(
                torch.bfloat16
            )
        )
    return Problem(xs, idxs, ws, l1s, l2s, num_experts)


# (seed, R, E, K, H, I, tokens per rank, one_expert)
CASES = [
    (0, 1, 4, 1, 128, 128, [37], False),
    (1, 2, 6, 2, 256, 128, [0, 53], False),
    (2, 3, 6, 3, 128, 128, [17, 0, 41], False),
    (3, 2, 8, 3, 256, 128, [29, 64], True),
    (4, 3, 6, 2, 128, 128, [5, 33, 1], False),
    (5, 1, 8, 3, 128, 128, [70], False),
    (6, 2, 4, 1, 256, 128, [45, 19], False),
]


def _case_id(case: tuple) -> str:
    seed, r, e, k, h, i, tokens, one = case
    return f"s{seed}-R{r}-E{e}-K{k}-H{h}-n{'_'.join(map(str, tokens))}{'-one' if one else ''}"


def run_reference(p: Problem, recipe: str, clamp: float | None, **kw) -> MegaMoEReferenceResult:
    return mega_moe_reference(
        p.x, p.topk_idx, p.topk_weights, p.l1, p.l2,
        recipe=recipe, activation_clamp=clamp, **kw,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The naive implementation
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class NaiveResult:
    y: list[torch.Tensor]
    recv_count: list[int]
    src_recv_count: list[list[int]]
    pairs: list[list[tuple[int, int, int]]]
    h: dict[tuple[int, int, int], torch.Tensor]
    o: dict[tuple[int, int, int], torch.Tensor]


def naive_moe(p: Problem, recipe: str, clamp: float | None) -> NaiveResult:
    num_ranks, num_experts = p.num_ranks, p.num_experts
    num_local = num_experts // num_ranks
    inter = p.l2[0].shape[2]

    def deq_x(x: torch.Tensor) -> torch.Tensor:
        if recipe == "bf16xbf16" or x.shape[0] == 0:
            return x.double()
        q = quantize_activations_for_recipe(x, recipe)
        return dequantize_activations_for_recipe(q, recipe).double()

    def deq_w(w: torch.Tensor) -> torch.Tensor:  # the whole rank's [E_l, N, K] at once
        if recipe == "bf16xbf16":
            return w.double()
        return dequantize_weights_for_recipe(
            quantize_weights_for_recipe(w, recipe), recipe
        ).double()

    # Quantise on the inputs' device (the FP8 weight scale amax / 448 is evaluated differently
    # by PyTorch on CPU and CUDA), then loop on the CPU.
    xd = [deq_x(x).cpu() for x in p.x]
    w1d = [deq_w(w).cpu() for w in p.l1]
    w2d = [deq_w(w).cpu() for w in p.l2]
    topk_idx = [i.cpu() for i in p.topk_idx]
    topk_weights = [w.cpu() for w in p.topk_weights]

    recv = [0] * num_experts
    src_recv = [[0] * num_ranks for _ in range(num_experts)]
    pairs: list[list[tuple[int, int, int]]] = [[] for _ in range(num_experts)]
    hs, os_ = {}, {}
    ys = []
    for s in range(num_ranks):
        n, num_topk = topk_idx[s].shape
        y = torch.empty(n, p.x[s].shape[1], dtype=torch.bfloat16)
        for t in range(n):
            acc_y = torch.zeros(p.x[s].shape[1], dtype=torch.float32)
            for k in range(num_topk):
                e = int(topk_idx[s][t, k])
                if e < 0:
                    continue
                recv[e] += 1
                src_recv[e][s] += 1
                pairs[e].append((s, t, k))
                owner, local = divmod(e, num_local)
                a = (w1d[owner][local] @ xd[s][t]).float()  # float64 dots, one f32 rounding
                gate = a[:inter].to(torch.bfloat16).double()
                up = a[inter:].to(torch.bfloat16).double()
                if clamp is not None:
                    gate = torch.minimum(gate, torch.tensor(clamp, dtype=torch.float64))
                    up = up.clamp(-clamp, clamp)
                silu = gate / (1.0 + torch.exp(-gate))
                h = (silu * up * float(topk_weights[s][t, k])).float()
                if recipe == "bf16xbf16":
                    l2_in = h.to(torch.bfloat16).double()
                else:
                    q, sf = requant_fp8_pow2(h[None], L2_GRAN[recipe])
                    l2_in = cast_back_from_fp8(q, sf, gran_k=L2_GRAN[recipe])[0].double()
                o = (w2d[owner][local] @ l2_in).float().to(torch.bfloat16)
                hs[(s, t, k)] = h
                os_[(s, t, k)] = o
                acc_y = acc_y + o.float()
            y[t] = acc_y.to(torch.bfloat16)
        ys.append(y)
    return NaiveResult(ys, recv, src_recv, pairs, hs, os_)


def bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at max(|a|, |b|) (normal range), as f32."""
    mag = torch.maximum(a.float().abs(), b.float().abs()).clamp(min=2.0**-126)
    _, e = torch.frexp(mag)
    return torch.ldexp(torch.ones_like(mag), e - 8)


def y_error_stats(ref: list[torch.Tensor], naive: list[torch.Tensor]) -> tuple[float, int, int]:
    """(max over ranks of max|d| / max|y|, elements off by > 1 ulp, element count)."""
    worst, over, total = 0.0, 0, 0
    for a, b in zip(ref, naive, strict=True):
        if b.numel() == 0:
            continue
        d = (a.float() - b.float()).abs()
        worst = max(worst, float(d.max() / b.float().abs().max()))
        over += int((d > bf16_ulp(a, b)).sum())
        total += b.numel()
    return worst, over, total


# ------------------------------------------------------------------------------------------------
# Whole call against the naive loop
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clamp", [None, 10.0], ids=["noclamp", "clamp10"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_naive_loop(case: tuple, recipe: str, clamp: float | None) -> None:
    seed, num_ranks, num_experts, num_topk, hidden, inter, tokens, one = case
    p = make_problem(seed, num_ranks, num_experts, num_topk, hidden, inter, tokens, one)
    num_local = num_experts // num_ranks
    g = torch.Generator().manual_seed(1000 + seed)
    stats_in = [
        torch.randint(0, 1000, (num_local,), dtype=torch.int32, generator=g)
        for _ in range(num_ranks)
    ]
    stats_copy = [s.clone() for s in stats_in]
    res = run_reference(p, recipe, clamp, cumulative_local_expert_recv_stats=stats_in)
    nv = naive_moe(p, recipe, clamp)

    # Dispatch bookkeeping: exact.
    assert res.expert_recv_count.dtype == torch.int64
    assert res.expert_recv_count.tolist() == nv.recv_count
    assert res.expert_src_recv_count.tolist() == nv.src_recv_count
    assert sum(nv.recv_count) == sum(int((i >= 0).sum()) for i in p.topk_idx)
    for e in range(num_experts):
        assert [tuple(r) for r in res.expert_pairs[e].tolist()] == nv.pairs[e]

    # Stats: exact, and the inputs are left alone.
    for r in range(num_ranks):
        assert torch.equal(stats_in[r], stats_copy[r])
        want = stats_copy[r] + torch.tensor(
            nv.recv_count[r * num_local : (r + 1) * num_local], dtype=torch.int32
        )
        assert res.cumulative_local_expert_recv_stats[r].dtype == torch.int32
        assert torch.equal(res.cumulative_local_expert_recv_stats[r], want)

    # Shapes and dtypes of y; all-masked tokens exactly 0; masked expert outputs exactly 0.
    for r in range(num_ranks):
        assert res.y[r].dtype == torch.bfloat16 and res.y[r].shape == (tokens[r], hidden)
        assert res.expert_outputs[r].shape == (tokens[r], num_topk, hidden)
        masked = p.topk_idx[r] < 0
        assert torch.all(res.expert_outputs[r][masked].float() == 0)
        all_masked = masked.all(dim=1)
        if tokens[r] >= 2:
            assert bool(all_masked[1])
        assert torch.all(res.y[r][all_masked].float() == 0)
        assert torch.all(nv.y[r][all_masked].float() == 0)
        assert torch.all(res.y[r][~all_masked].float().abs().amax(dim=1) > 0)

    # L1 output h: agrees to float32 rounding of the SiLU / products.
    for e in range(num_experts):
        if not nv.pairs[e]:
            assert res.l1_outputs[e].shape == (0, inter) and res.l2_inputs[e].shape == (0, inter)
            continue
        want_h = torch.stack([nv.h[pair] for pair in nv.pairs[e]])
        d = (res.l1_outputs[e] - want_h).abs().max() / want_h.abs().max()
        assert float(d) <= _H_REL_BOUND, (e, float(d))

    # Expert outputs o and y: tolerance (FP8 code / BF16 rounding flips from ~1 f32 ulp in h).
    for r in range(num_ranks):
        for t, k in (p.topk_idx[r] >= 0).nonzero().tolist():
            o_ref, o_nv = res.expert_outputs[r][t, k].float(), nv.o[(r, t, k)].float()
            assert float((o_ref - o_nv).abs().max()) <= _Y_REL_BOUND[recipe] * float(
                o_nv.abs().max()
            )
    worst, over, total = y_error_stats(res.y, nv.y)
    assert worst <= _Y_REL_BOUND[recipe], worst
    assert over <= _Y_ULP_FRACTION_BOUND[recipe] * total + 2, (over, total)

    # y is exactly the combine of the expert outputs.
    for r in range(num_ranks):
        assert torch.equal(res.y[r], combine_reference(res.expert_outputs[r], p.topk_idx[r]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_y_error_levels_over_many_seeds(recipe: str) -> None:
    """Aggregated over seeds, most of y is bit-identical to the naive loop and at most a small
    fraction is off by more than one BF16 ulp."""
    worst, over, total, identical = 0.0, 0, 0, 0
    for seed in range(4):
        p = make_problem(100 + seed, 2, 4, 2, 128, 128, [40, 24])
        res = run_reference(p, recipe, 10.0)
        nv = naive_moe(p, recipe, 10.0)
        w, o, t = y_error_stats(res.y, nv.y)
        worst, over, total = max(worst, w), over + o, total + t
        identical += sum(int((a == b).sum()) for a, b in zip(res.y, nv.y, strict=True))
    assert worst <= _Y_REL_BOUND[recipe]
    assert over <= _Y_ULP_FRACTION_BOUND[recipe] * total
    assert identical >= 0.99 * total, (identical, total)


# ------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------


def _combine_by_hand(expert_outputs: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Element by element with numpy float32 scalars, ascending k, valid slots only."""
    eo = expert_outputs.float().numpy()
    n, num_topk, hidden = eo.shape
    out = np.zeros((n, hidden), dtype=np.float32)
    for t in range(n):
        for j in range(hidden):
            acc = np.float32(0.0)
            for k in range(num_topk):
                if int(topk_idx[t, k]) >= 0:
                    acc = np.float32(acc + np.float32(eo[t, k, j]))
            out[t, j] = acc
    return torch.from_numpy(out).to(torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_combine_reference_equals_hand_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n, num_topk, hidden = 23, 4, 48
    # Wide dynamic range so float32 rounding of the adds matters and order is visible.
    eo = (torch.randn(n, num_topk, hidden, generator=g) * 2.0 ** torch.randint(
        -8, 9, (n, num_topk, 1), generator=g
    )).to(torch.bfloat16)  # fmt: skip
    idx = torch.randint(0, 8, (n, num_topk), generator=g)
    idx[torch.rand(n, num_topk, generator=g) < 0.3] = -1
    idx[3] = -1
    # Masked slots hold garbage that must never reach y: NaN, and +inf in every other one.
    eo[idx < 0] = float("nan")
    masked = (idx < 0).nonzero().tolist()
    for t, k in masked[::2]:
        eo[t, k] = float("inf")
    got = combine_reference(eo, idx)
    want = _combine_by_hand(eo, idx)
    assert got.dtype == torch.bfloat16 and got.shape == (n, hidden)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.all(got[3].float() == 0)
    assert not torch.isnan(got.float()).any()


def test_combine_reference_order_is_ascending_k() -> None:
    # In f32, ((0 + 2^24) + 1) + (-2^24) = 0 (2^24 + 1 rounds to 2^24), but
    # ((0 + 2^24) + (-2^24)) + 1 = 1: the order of the adds is visible.
    eo = torch.tensor([[[2.0**24], [1.0], [-(2.0**24)]]]).to(torch.bfloat16)
    idx = torch.tensor([[0, 1, 2]])
    assert float(combine_reference(eo, idx)[0, 0]) == 0.0
    idx_swapped = torch.tensor([[0, 2, 1]])  # same slots valid, order fixed by k, not by expert
    assert float(combine_reference(eo, idx_swapped)[0, 0]) == 0.0
    eo2 = eo[:, [0, 2, 1]]
    assert float(combine_reference(eo2, idx)[0, 0]) == 1.0


def test_dispatch_reference_counts_and_order() -> None:
    idx = [
        torch.tensor([[2, -1], [0, 2], [-1, -1]]),
        torch.empty(0, 2, dtype=torch.int64),
        torch.tensor([[2, 2], [1, 0]]),
    ]
    count, src_count, pairs = dispatch_reference(idx, 4)
    assert count.tolist() == [2, 1, 4, 0]
    assert src_count.tolist() == [[1, 0, 1], [0, 0, 1], [2, 0, 2], [0, 0, 0]]
    assert pairs[0].tolist() == [[0, 1, 0], [2, 1, 1]]
    assert pairs[1].tolist() == [[2, 1, 0]]
    assert pairs[2].tolist() == [[0, 0, 0], [0, 1, 1], [2, 0, 0], [2, 0, 1]]
    assert pairs[3].shape == (0, 3) and pairs[3].dtype == torch.int64


def test_swiglu_reference_clamp_is_asymmetric() -> None:
    inter = 4
    gate = [20.0, -50.0, 3.0, -3.0]
    up = [3.0, -50.0, 20.0, -0.5]
    acc = torch.tensor([gate + up], dtype=torch.float32)
    w = torch.tensor([0.75], dtype=torch.float32)

    def want(g: list[float], u: list[float]) -> torch.Tensor:
        gd, ud = torch.tensor(g, dtype=torch.float64), torch.tensor(u, dtype=torch.float64)
        return (gd / (1 + torch.exp(-gd)) * ud * 0.75)[None]

    clamped = swiglu_reference(acc, w, 10.0)
    # gate: only from above (20 -> 10, -50 stays); up: both sides (-50 -> -10, 20 -> 10).
    expect = want([10.0, -50.0, 3.0, -3.0], [3.0, -10.0, 10.0, -0.5])
    assert clamped.shape == (1, inter) and clamped.dtype == torch.float32
    assert torch.allclose(clamped.double(), expect, rtol=1e-6, atol=0)
    unclamped = swiglu_reference(acc, w, None)
    assert torch.allclose(unclamped.double(), want(gate, up), rtol=1e-6, atol=0)
    assert float(unclamped[0, 0]) != float(clamped[0, 0])


def test_expert_ffn_float64_is_the_unrounded_ffn() -> None:
    # one row whose gate and up hit the clamp from both sides, checked by hand in float64
    x = torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16)
    w1 = torch.tensor([[20.0, 0.0], [-1.5, 0.25], [0.0, -9.0], [2.0, 0.0]])  # [gate | up] rows
    w2 = torch.tensor([[1.0, 0.5], [-2.0, 3.0]])
    g = torch.tensor([min(20.0, 10.0), -2.0], dtype=torch.float64)
    u = torch.tensor([min(18.0, 10.0), 2.0], dtype=torch.float64)
    h = g * torch.sigmoid(g) * u * 0.75
    got = expert_ffn_float64(x, torch.tensor([0.75]), w1, w2, 10.0)
    assert got.dtype == torch.float64 and got.shape == (1, 2)
    assert torch.allclose(got[0], w2.double() @ h, rtol=1e-15, atol=0)
    # on BF16-exact operands the BF16 recipe's reference sits within its roundings of it
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(128, 256, generator=gen) / 16).to(torch.bfloat16).float()
    w2 = (torch.randn(256, 64, generator=gen) / 8).to(torch.bfloat16).float()
    tw = torch.rand(16, generator=gen)
    exact = expert_ffn_float64(x, tw, w1, w2, 7.0)
    _, _, o = expert_ffn_reference(x.float(), tw, w1, w2, "bf16xbf16", 7.0)
    err = float((o.double() - exact).norm() / exact.norm())
    assert 0 < err < 1e-2


def test_swiglu_reference_rounds_accumulator_to_bf16_first() -> None:
    # 1 + 2^-10 is not a BF16 value: it must be rounded to 1.0 before SiLU.
    acc = torch.tensor([[1.0 + 2.0**-10, 1.0 + 2.0**-10]], dtype=torch.float32)
    w = torch.tensor([1.0], dtype=torch.float32)
    got = swiglu_reference(acc, w)
    one = torch.tensor(1.0, dtype=torch.float32)
    assert float(got[0, 0]) == float((one / (1 + torch.exp(-one))) * one)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fast_math_flag_does_not_change_reference(recipe: str) -> None:
    p = make_problem(7, 2, 4, 2, 128, 128, [9, 13])
    a = run_reference(p, recipe, 10.0, fast_math=True)
    b = run_reference(p, recipe, 10.0, fast_math=False)
    for ya, yb in zip(a.y, b.y, strict=True):
        assert torch.equal(ya, yb)
        assert ya.float().abs().max() > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_building_blocks_compose_to_the_whole_call(recipe: str) -> None:
    """l2_inputs = requant(l1_outputs) exactly, and expert_ffn_reference on the gathered rows
    reproduces the call's h, L2 input and o bit for bit."""
    p = make_problem(8, 2, 4, 3, 128, 128, [21, 30])
    res = run_reference(p, recipe, 10.0)
    num_local = 2
    checked = 0
    for e in range(p.num_experts):
        pairs = res.expert_pairs[e]
        if pairs.shape[0] == 0:
            continue
        h = res.l1_outputs[e]
        if recipe == "bf16xbf16":
            l2_want = h.to(torch.bfloat16).float()
        else:
            q, sf = requant_fp8_pow2(h, L2_GRAN[recipe])
            l2_want = cast_back_from_fp8(q, sf, gran_k=L2_GRAN[recipe])
        assert torch.equal(res.l2_inputs[e], l2_want)

        owner, local = divmod(e, num_local)
        if recipe == "bf16xbf16":
            xd = [x.float() for x in p.x]
            w1 = p.l1[owner][local].float()
            w2 = p.l2[owner][local].float()
        else:
            xd = [
                dequantize_activations_for_recipe(
                    quantize_activations_for_recipe(x, recipe), recipe
                )
                for x in p.x
            ]
            w1 = dequantize_weights_for_recipe(
                quantize_weights_for_recipe(p.l1[owner], recipe), recipe
            )[local]
            w2 = dequantize_weights_for_recipe(
                quantize_weights_for_recipe(p.l2[owner], recipe), recipe
            )[local]
        rows = torch.stack([xd[s][t] for s, t, _ in pairs.tolist()])
        wts = torch.stack([p.topk_weights[s][t, k] for s, t, k in pairs.tolist()])
        h2, l2_2, o2 = expert_ffn_reference(
            rows.float(), wts, w1.float(), w2.float(), recipe, 10.0, True
        )
        assert torch.equal(h2, h) and torch.equal(l2_2, res.l2_inputs[e])
        o_call = torch.stack([res.expert_outputs[s][t, k] for s, t, k in pairs.tolist()])
        assert torch.equal(o2, o_call)
        assert o2.float().abs().max() > 0
        checked += 1
    assert checked >= 2


def test_no_stats_and_empty_ranks() -> None:
    p = make_problem(9, 2, 4, 2, 128, 128, [0, 0])
    res = run_reference(p, "fp8xfp4", None)
    assert res.cumulative_local_expert_recv_stats is None
    assert [y.shape for y in res.y] == [(0, 128), (0, 128)]
    assert res.expert_recv_count.tolist() == [0, 0, 0, 0]
    assert res.expert_src_recv_count.shape == (4, 2)


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------


def _mutations() -> list[tuple[str, object, type, str]]:
    """(id, mutate(problem kwargs) -> None, exception type, text that must appear)."""

    def set_list(name: str, r: int, value: torch.Tensor):
        def f(kw: dict) -> None:
            kw[name] = list(kw[name])
            kw[name][r] = value(kw[name][r]) if callable(value) else value

        return f

    def set_kw(name: str, value: object):
        def f(kw: dict) -> None:
            kw[name] = value

        return f

    def drop_rank(name: str):
        def f(kw: dict) -> None:
            kw[name] = list(kw[name])[:-1]

        return f

    def bad_idx(value: int):
        def f(kw: dict) -> None:
            kw["topk_idx"] = [i.clone() for i in kw["topk_idx"]]
            kw["topk_idx"][1][2, 1] = value

        return f

    return [
        ("x-dtype", set_list("x", 1, lambda t: t.float()), TypeError, "x[1]"),
        ("x-hidden", set_list("x", 0, lambda t: t[:, :64]), ValueError, "x[0]"),
        ("idx-dtype", set_list("topk_idx", 1, lambda t: t.int()), TypeError, "topk_idx[1]"),
        ("idx-rows", set_list("topk_idx", 0, lambda t: t[:-1]), ValueError, "topk_idx[0]"),
        ("idx-K", set_list("topk_idx", 1, lambda t: t[:, :1]), ValueError, "topk_idx[1]"),
        ("idx-too-big", bad_idx(4), ValueError, "topk_idx[1]"),
        ("idx-below-minus-1", bad_idx(-2), ValueError, "topk_idx[1]"),
        ("w-dtype", set_list("topk_weights", 0, lambda t: t.double()), TypeError,
         "topk_weights[0]"),
        ("w-shape", set_list("topk_weights", 1, lambda t: t[:, :1]), ValueError,
         "topk_weights[1]"),
        ("l1-dtype", set_list("l1_weights", 1, lambda t: t.float()), TypeError, "l1_weights[1]"),
        ("l1-experts", set_list("l1_weights", 1, lambda t: t[:1]), ValueError, "l1_weights[1]"),
        ("l2-hidden", set_list("l2_weights", 0, lambda t: t[:, :64]), ValueError,
         "l2_weights[0]"),
        ("l2-inter", set_list("l2_weights", 1, lambda t: torch.cat([t, t], 2)), ValueError,
         "l2_weights[1]"),
        ("len-idx", drop_rank("topk_idx"), ValueError, "topk_idx"),
        ("len-l2", drop_rank("l2_weights"), ValueError, "l2_weights"),
        ("not-a-list", set_kw("x", None), TypeError, "x"),
        ("recipe", set_kw("recipe", "fp4xfp4"), ValueError, "fp4xfp4"),
        ("clamp-negative", set_kw("activation_clamp", -1.0), ValueError, "activation_clamp"),
        ("clamp-type", set_kw("activation_clamp", "10"), TypeError, "activation_clamp"),
        ("fast-math-type", set_kw("fast_math", 1), TypeError, "fast_math"),
        ("stats-dtype", set_kw("cumulative_local_expert_recv_stats",
                               [torch.ones(2, dtype=torch.int64)] * 2), TypeError,
         "cumulative_local_expert_recv_stats[0]"),
        ("stats-shape", set_kw("cumulative_local_expert_recv_stats",
                               [torch.ones(2, dtype=torch.int32),
                                torch.ones(3, dtype=torch.int32)]),
         ValueError, "cumulative_local_expert_recv_stats[1]"),
        ("stats-len", set_kw("cumulative_local_expert_recv_stats",
                             [torch.ones(2, dtype=torch.int32)]), ValueError,
         "cumulative_local_expert_recv_stats"),
    ]  # fmt: skip


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m[0])
def test_bad_inputs_raise_with_argument_name(mutation: tuple) -> None:
    _, mutate, exc, text = mutation
    p = make_problem(10, 2, 4, 2, 128, 128, [5, 7])
    kw = dict(
        x=p.x, topk_idx=p.topk_idx, topk_weights=p.topk_weights,
        l1_weights=p.l1, l2_weights=p.l2, recipe="fp8xfp4",
    )  # fmt: skip
    mega_moe_reference(**kw)  # the unmutated problem is valid
    mutate(kw)
    with pytest.raises(exc, match=None) as info:
        mega_moe_reference(**kw)
    assert text in str(info.value)


def test_a_token_naming_one_expert_twice_is_refused() -> None:
    """As the layer (`checks.check_routing`): a token names an expert once (its buffer holds
    one slot per token per expert); the error names the rank, token, slots and expert, and
    masked slots (-1) may repeat."""
    p = make_problem(13, 2, 8, 3, 128, 128, [5, 7])
    idx = [t.clone() for t in p.topk_idx]
    idx[1][4] = torch.tensor([6, -1, 6])
    kw = dict(x=p.x, topk_weights=p.topk_weights, l1_weights=p.l1, l2_weights=p.l2,
              recipe="bf16xbf16")
    with pytest.raises(ValueError, match=r"topk_idx\[1\]: token 4 names the same expert 6 in "
                                         r"slots 0 and 2"):
        mega_moe_reference(topk_idx=idx, **kw)
    idx[1][4] = torch.tensor([6, -1, -1])
    mega_moe_reference(topk_idx=idx, **kw)


def test_fp8_recipes_need_128_aligned_dims() -> None:
    p = make_problem(11, 1, 4, 2, 64, 128, [5])
    with pytest.raises(ValueError, match="multiples of 128"):
        run_reference(p, "fp8xfp8", None)
    res = run_reference(p, "bf16xbf16", None)  # no alignment needed for BF16
    assert res.y[0].float().abs().max() > 0


def test_dispatch_reference_rejects_out_of_range_index() -> None:
    with pytest.raises(ValueError, match=r"topk_idx_list\[0\].*5"):
        dispatch_reference([torch.tensor([[5, 0]])], 4)


# ------------------------------------------------------------------------------------------------
# Device
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_on_cuda_matches_naive_loop(recipe: str) -> None:
    """On CUDA tensors: results stay on the device, bookkeeping equals the CPU run, y meets the
    CPU bounds against the naive loop fed with the same (device-quantised) operands."""
    p = make_problem(12, 2, 4, 2, 128, 128, [17, 9])
    cpu = run_reference(p, recipe, 10.0)
    dev = torch.device("cuda")
    pc = Problem(*[[t.to(dev) for t in getattr(p, f.name)] for f in dataclasses.fields(p)[:5]],
                 p.num_experts)  # fmt: skip
    gpu = run_reference(pc, recipe, 10.0)
    assert all(y.device.type == "cuda" for y in gpu.y)
    assert gpu.expert_recv_count.device.type == "cuda"
    assert gpu.expert_outputs[0].device.type == "cuda" and gpu.l2_inputs[0].device.type == "cuda"
    assert torch.equal(gpu.expert_recv_count.cpu(), cpu.expert_recv_count)
    assert torch.equal(gpu.expert_src_recv_count.cpu(), cpu.expert_src_recv_count)
    for a, b in zip(gpu.expert_pairs, cpu.expert_pairs, strict=True):
        assert torch.equal(a.cpu(), b)
    nv = naive_moe(pc, recipe, 10.0)
    worst, over, total = y_error_stats([y.cpu() for y in gpu.y], nv.y)
    assert worst <= _Y_REL_BOUND[recipe], worst
    assert over <= _Y_ULP_FRACTION_BOUND[recipe] * total + 2, (over, total)
    # CPU vs CUDA reference: fp8xfp8 differs everywhere by design of the weight scale (see
    # naive_moe); the others only through exp / GEMM rounding.
    worst, over, total = y_error_stats([y.cpu() for y in gpu.y], cpu.y)
    assert worst <= _Y_REL_BOUND[recipe], worst
    if recipe != "fp8xfp8":
        assert over <= _Y_ULP_FRACTION_BOUND[recipe] * total + 2, (over, total)
