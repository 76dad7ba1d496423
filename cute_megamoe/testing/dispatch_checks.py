"""Checks of the dispatch and combine kernels against the reference, for 1..8 ranks.

Used by the GPU tests (in-process for one rank, `torch.multiprocessing` workers for several)
and runnable by hand: `python -m cute_megamoe.testing.dispatch_checks --ranks 2`.

Every rank generates the same global problem from a seed (all ranks' inputs), runs the
collective kernels on its own share, and compares with `reference.dispatch_reference` /
`reference.combine_reference`: counts and the (source rank, token, slot) multiset per expert
exactly, pool rows / scales / weights bit-exact with the source rows, combine bit-exact, stats
exact; pool padding rows and `y` are poisoned before each call and checked.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from .. import quant, reference
from .spawn import record_failure, spawn_ranks

ROUTINGS = ("random", "masked", "one_expert", "skewed")


@dataclass(frozen=True)
class Case:
    tokens: tuple[int, ...]  # tokens per rank
    routing: str = "random"
    seed: int = 0


def make_routing(n: int, num_experts: int, num_topk: int, routing: str,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.randn(n, num_experts, generator=gen)
    if routing == "one_expert":
        scores[:, 0] = float("inf")  # every token picks expert 0 (plus K - 1 others)
    elif routing == "skewed":
        scores[:, : max(1, num_experts // 16)] += 3.0
    weights, idx = torch.topk(scores, num_topk, dim=-1, sorted=False)
    weights = torch.rand(n, num_topk, generator=gen)
    if routing == "masked":
        mask = torch.rand(n, num_topk, generator=gen) < 0.3
        mask[: max(1, n // 7)] = True  # some tokens fully masked
        idx = idx.masked_fill(mask, -1)
        weights = weights.masked_fill(mask, 0.0)
    if routing == "bad" and num_topk > 1:
        # about 5 % of the slots bad, a third each: out of range, negative other than -1, and
        # a repeat of the token's slot 0 (what the dispatch's routing check masks)
        kind = torch.randint(0, 60, (n, num_topk), generator=gen)
        kind[:, 0] = 3  # (slot 0 stays: the repeats copy it)
        idx = torch.where(kind == 0, num_experts + kind.new_tensor(7), idx)
        idx = torch.where(kind == 1, kind.new_tensor(-3), idx)
        idx = torch.where(kind == 2, idx[:, :1].expand(-1, num_topk), idx)
    return idx.to(torch.int64), weights.float()


def make_problem(case: Case, num_experts: int, num_topk: int, hidden: int):
    gen = torch.Generator().manual_seed(case.seed)
    xs, idxs, ws = [], [], []
    for n in case.tokens:
        x = torch.randn(n, hidden, generator=gen)
        x *= torch.exp2(torch.randint(-8, 8, (n, 1), generator=gen).float())
        xs.append(x.to(torch.bfloat16))
        idx, w = make_routing(n, num_experts, num_topk, case.routing, gen)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


def check_case(buf, case: Case, block_m: int, device: torch.device, stats: torch.Tensor,
               stats_expected: torch.Tensor) -> None:
    from .. import staged
    from ..kernels.common.sync import SPLIT_BARRIER_COUNT
    from ..kernels.dispatch import TRANSFERS
    from ..layout import BarrierSlots

    layout = buf.layout
    rank, num_ranks = buf.rank, buf.num_ranks
    e_l, k_top, hidden = layout.num_local_experts, layout.num_topk, layout.hidden
    assert len(case.tokens) == num_ranks
    xs, idxs, ws = make_problem(case, layout.num_experts, k_top, hidden)
    n = case.tokens[rank]

    # both row transfers, one after the other on the same buffer; the combine checks below use
    # the second dispatch's pool
    for transfer in TRANSFERS:
        # poison what the kernels write
        poison = {"l1_acts": 0xFF, "l1_topk_weights": 0xFF, "token_src_metadata": 0x7F}
        if layout.has_sf:
            poison["l1_acts_sf"] = 0xFF
        for name, byte in poison.items():
            view = buf.view(name)
            view = view if view.is_contiguous() else view.t()  # MN-major scales
            view.view(torch.uint8).fill_(byte)
        buf.combine.view(torch.uint8).fill_(0xFF)

        result = staged.dispatch(buf, xs[rank].to(device), idxs[rank].to(device),
                                 ws[rank].to(device), block_m=block_m,
                                 cumulative_local_expert_recv_stats=stats, transfer=transfer)
        torch.cuda.synchronize(device)

        # --- bookkeeping: counts and the (source, token, slot) multiset per expert
        ref_count, ref_src_count, ref_pairs = reference.dispatch_reference(idxs, layout.num_experts)
        mine = slice(rank * e_l, (rank + 1) * e_l)
        recv = result.expert_recv_tokens.cpu().long()
        assert torch.equal(recv, ref_count[mine].long()), (transfer, recv, ref_count[mine])
        stats_expected += ref_count[mine].to(torch.int32)
        assert torch.equal(stats.cpu(), stats_expected), "cumulative_local_expert_recv_stats"
        offsets = result.pool_block_offsets().cpu().long()
        meta = result.token_src_metadata.cpu()
        rows_all = []
        for e in range(e_l):
            rows = offsets[e] * block_m + torch.arange(int(recv[e]))
            got = meta[rows, :3].long()
            # the sources take turns: one row each in rank order while they have rows
            per_src = torch.bincount(got[:, 0], minlength=num_ranks)
            turns = torch.cat([torch.arange(int(c)) * num_ranks + s for s, c in enumerate(per_src)])
            want_src = torch.cat([torch.full((int(c),), s) for s, c in enumerate(per_src)])
            assert torch.equal(got[:, 0], want_src[torch.argsort(turns)]), \
                f"{transfer}: expert {e}: sources do not take turns"
            got = got[torch.argsort(got[:, 0] * (1 << 40) + got[:, 1] * 64 + got[:, 2])]
            want = ref_pairs[rank * e_l + e].long()
            assert torch.equal(got, want), f"{transfer}: expert {e}: pairs differ"
            assert bool((meta[rows, 3] == 0).all())
            rows_all.append(rows)
        rows = torch.cat(rows_all) if rows_all else torch.zeros(0, dtype=torch.long)

        # --- pool rows: bit copies of the source rows, scales and weights
        token_base = torch.tensor([0] + list(case.tokens)).cumsum(0)
        src_rows = token_base[meta[rows, 0].long()] + meta[rows, 1].long()
        x_all = torch.cat(xs).to(device)
        if layout.recipe == "bf16xbf16":
            xq_all, sf_all = x_all, None
        else:
            xq_all, sf_all = quant.quantize_activations_for_recipe(x_all, layout.recipe)
        rows_d, src_d = rows.to(device), src_rows.to(device)
        assert torch.equal(result.l1_acts[rows_d].view(torch.uint8),
                           xq_all[src_d].view(torch.uint8)), f"{transfer}: pool rows"
        if sf_all is not None:
            assert torch.equal(result.l1_acts_sf[rows_d].contiguous().view(torch.int32),
                               sf_all[src_d].view(torch.int32)), f"{transfer}: pool scales"
        w_all = torch.cat(ws).to(device)
        slots = meta[rows, 2].long().to(device)
        assert torch.equal(result.l1_topk_weights[rows_d], w_all[src_d, slots]), \
            f"{transfer}: pool weights"
        # padding and unused pool rows were not written
        untouched = torch.ones(result.num_pool_rows, dtype=torch.bool, device=device)
        untouched[rows_d] = False
        assert bool((result.l1_acts[untouched].view(torch.uint8) == 0xFF).all()), \
            f"{transfer}: pool padding"

    # --- combine: random expert outputs per (source rank, token, slot), reduced exactly
    gen = torch.Generator().manual_seed(case.seed + 1)
    outs = [torch.randn(t, k_top, hidden, generator=gen).to(torch.bfloat16) for t in case.tokens]
    out_all = torch.cat(outs).to(device)
    expert_out = torch.full((layout.num_pool_rows, hidden), float("nan"), device=device,
                            dtype=torch.bfloat16)
    expert_out[rows_d] = out_all[src_d, slots]
    want_y = reference.combine_reference(outs[rank], idxs[rank]).to(device)
    # (the combine buffer was poisoned before the dispatch; it is not re-poisoned between the
    # two modes: a peer may already be sending its second-mode rows, the same values)
    # registers mode in 1, 4 and 5 uneven rounds, and with the ranks using different rounds
    modes = [("registers", (8,)), ("registers", (2, 2, 2, 2)), ("registers", (2, 2, 2, 1, 1)),
             ("registers", ((8,), (1,) * 8, (4, 4), (3, 1, 2, 2))[rank % 4]),
             ("registers", None), ("bulk", None)]
    for send_mode, rounds in modes:
        y = torch.full((n, hidden), float("nan"), device=device, dtype=torch.bfloat16)
        staged.combine(buf, expert_out, result, y, send_mode=send_mode, rounds=rounds)
        torch.cuda.synchronize(device)
        assert torch.equal(y.view(torch.int16), want_y.view(torch.int16)), \
            f"combine ({send_mode}, rounds {rounds})"
    # the combine left its per-call arrival counts zeroed for the next call
    first = BarrierSlots.SPLIT_ARRIVAL
    arrivals = buf.barrier[first:first + SPLIT_BARRIER_COUNT]
    assert not bool(arrivals.any()), "split-barrier arrival counts not reset"


def run_cases(rank: int, num_ranks: int, cases: list[Case], recipe: str, num_experts: int,
              num_topk: int, hidden: int, block_m: int, group=None) -> int:
    from ..buffer import get_symm_buffer_for_mega_moe

    device = torch.device("cuda", torch.cuda.current_device())
    max_tokens = max(max(c.tokens) for c in cases)
    buf = get_symm_buffer_for_mega_moe(group, num_experts, max_tokens, num_topk, hidden, 256,
                                       mma_type=recipe, device=device)
    e_l = num_experts // num_ranks
    stats = torch.randint(0, 100, (e_l,), dtype=torch.int32, device=device)
    stats_expected = stats.cpu().clone()
    for case in cases:
        check_case(buf, case, block_m, device, stats, stats_expected)
    buf.destroy()
    return len(cases)


_UNFREED_BUFFERS = []  # see check_transfer_mismatch


def check_transfer_mismatch(rank: int, num_ranks: int, recipe: str, group=None) -> str:
    """Ranks launching the dispatch with different `transfer`s (even ranks push, odd ones
    pull): every rank's kernel must trap, i.e. fail at the next synchronize, instead of
    finishing with pools that lack the pulling ranks' rows. Returns the error text."""
    from .. import staged
    from ..buffer import get_symm_buffer_for_mega_moe
    from ..kernels.dispatch import TRANSFERS

    device = torch.device("cuda", torch.cuda.current_device())
    num_experts, num_topk, hidden = 8, 2, 256
    buf = get_symm_buffer_for_mega_moe(group, num_experts, 64, num_topk, hidden, 256,
                                       mma_type=recipe, device=device)
    xs, idxs, ws = make_problem(Case((64,) * num_ranks, "random", 5), num_experts, num_topk,
                                hidden)
    # after the trap the CUDA context is dead and freeing symmetric memory aborts the
    # process: the buffer stays referenced until the caller's os._exit
    _UNFREED_BUFFERS.append(buf)
    try:
        staged.dispatch(buf, xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device),
                        block_m=64, transfer=TRANSFERS[rank % 2])
        torch.cuda.synchronize(device)
    except RuntimeError as err:  # the trap: a sticky CUDA error in this process
        return str(err)
    raise AssertionError(f"rank {rank}: the dispatch finished although the ranks launched it "
                         "with different transfers")


def default_cases(num_ranks: int, seed: int = 0) -> list[Case]:
    """Uneven and degenerate routings, back to back on one buffer."""
    def toks(*per_rank):
        return tuple(per_rank[r % len(per_rank)] for r in range(num_ranks))

    return [
        Case(toks(37, 129), "random", seed),
        Case(toks(0, 211), "masked", seed + 1),
        Case(toks(300, 1), "one_expert", seed + 2),
        Case(toks(1, 1), "random", seed + 3),
        Case(toks(513, 257), "skewed", seed + 4),
        Case(toks(0, 0), "random", seed + 5),
        Case(toks(1000, 999), "masked", seed + 6),
        Case(toks(64, 65), "one_expert", seed + 7),
        Case(toks(5, 300), "random", seed + 8),
        Case(toks(777, 3), "skewed", seed + 9),
    ]


def _worker(rank: int, num_ranks: int, port: int, recipe: str, num_experts: int, num_topk: int,
            hidden: int, block_m: int, seed: int, mode: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank))
    if mode == "transfer_mismatch":
        print(f"rank {rank}: {check_transfer_mismatch(rank, num_ranks, recipe, dist.group.WORLD)}")
        os._exit(0)  # the CUDA context is dead: no NCCL teardown
    try:
        with record_failure(rank):
            if mode == "dispatch":
                run_cases(rank, num_ranks, default_cases(num_ranks, seed), recipe, num_experts,
                          num_topk, hidden, block_m, group=dist.group.WORLD)
            else:
                run_layer_cases(num_ranks, recipe, num_experts, num_topk, hidden, block_m, seed,
                                group=dist.group.WORLD,
                                experts="kernels" if mode == "layer_kernels" else "torch")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_multiprocess(num_ranks: int, recipe: str, num_experts: int, num_topk: int, hidden: int,
                     block_m: int, seed: int = 0, port: int = 29517,
                     mode: str = "dispatch") -> None:
    """Spawn one process per GPU; `mode` is "dispatch" (exact kernel checks), "layer" (the
    staged layer on torch GEMMs against the reference), "layer_kernels" (the layer on our
    grouped-GEMM kernels) or "transfer_mismatch" (`check_transfer_mismatch`)."""
    spawn_ranks(_worker, num_ranks, num_ranks, port, recipe, num_experts, num_topk, hidden,
                block_m, seed, mode)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    p.add_argument("--recipe", default="fp8xfp4")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--block-m", type=int, default=64)
    args = p.parse_args()
    run_multiprocess(args.ranks, args.recipe, args.experts, args.topk, args.hidden,
                     args.block_m)
    print(f"ok: {args.ranks} ranks, {args.recipe}")


if __name__ == "__main__":
    main()


# ----------------------------------------------------------------------------- staged layer

LAYER_TOLERANCE = {"fp8xfp4": 1e-2, "fp8xfp8": 2e-2, "bf16xbf16": 1e-2, "fp8xfp4_sm90": 1e-2}


EXPERT_PATHS = ("torch", "kernels")


def check_staged_layer(buf, case: Case, intermediate: int, block_m: int, device,
                       activation_clamp: float | None = 10.0, experts: str = "torch") -> float:
    """The whole staged layer against the reference: our dispatch/combine around torch GEMMs
    (`experts="torch"`) or, through `stage_inputs` + `mega_moe`, around
    our grouped-GEMM kernels (`experts="kernels"`).

    Returns ||y - y_ref|| / ||y_ref|| for this rank; raises when over the recipe's bound (the
    torch GEMMs accumulate in FP32 in another order than the float64 reference, which can flip
    BF16 roundings and FP8 requantization decisions; fp8xfp8 also rounds its block-scaled
    weights to BF16 for torch)."""
    from .. import staged

    layout = buf.layout
    rank, e_l, hidden = buf.rank, layout.num_local_experts, layout.hidden
    xs, idxs, ws = make_problem(case, layout.num_experts, layout.num_topk, hidden)
    gen = torch.Generator().manual_seed(case.seed + 7)
    w1s = [(torch.randn(e_l, 2 * intermediate, hidden, generator=gen) / hidden**0.5)
           .to(torch.bfloat16) for _ in case.tokens]
    w2s = [(torch.randn(e_l, hidden, intermediate, generator=gen) / intermediate**0.5)
           .to(torch.bfloat16) for _ in case.tokens]
    dev = [t.to(device) for t in xs]
    ref = reference.mega_moe_reference(
        dev, [t.to(device) for t in idxs], [t.to(device) for t in ws],
        [w.to(device) for w in w1s], [w.to(device) for w in w2s], recipe=layout.recipe,
        activation_clamp=activation_clamp)
    if experts == "torch":
        weights = staged.TorchExpertWeights.from_bf16(w1s[rank].to(device),
                                                      w2s[rank].to(device), layout.recipe)
        y = staged.staged_mega_moe(buf, dev[rank], idxs[rank].to(device), ws[rank].to(device),
                                   weights, activation_clamp=activation_clamp, block_m=block_m)
    elif experts == "kernels":
        from .. import api
        from ..expert_gemm import ExpertWeights

        weights = ExpertWeights.from_bf16(w1s[rank].to(device), w2s[rank].to(device),
                                          layout.recipe)
        api.stage_inputs(buf, dev[rank], idxs[rank].to(device), ws[rank].to(device))
        y = torch.full_like(dev[rank], float("nan"))
        api.mega_moe(y, weights, buf, activation_clamp=activation_clamp, block_m=block_m)
        # the layer above had the L2 epilogue send rows to the combine buffers; the same
        # inputs with pool-order L2 output and the combine kernel's sends give the same bits
        y_sent = torch.full_like(y, float("nan"))
        staged.staged_mega_moe(buf, None, None, None, weights, num_tokens=y.shape[0],
                               y=y_sent, activation_clamp=activation_clamp, block_m=block_m,
                               l2_sends=False)
        torch.cuda.synchronize(device)
        assert torch.equal(y.view(torch.int16), y_sent.view(torch.int16)), \
            "L2 epilogue sends differ from the combine kernel's sends"
    else:
        raise ValueError(f"experts: expected one of {EXPERT_PATHS}, got {experts!r}")
    torch.cuda.synchronize(device)
    want = ref.y[rank].float()
    if want.numel() == 0:
        assert y.numel() == 0
        return 0.0
    assert bool(torch.isfinite(y).all()), "non-finite output"
    err = float((y.float() - want).norm() / want.norm().clamp_min(1e-30))
    assert err < LAYER_TOLERANCE[layout.recipe], f"staged layer rel. error {err:.3g}"
    return err


def run_layer_cases(num_ranks: int, recipe: str, num_experts: int, num_topk: int, hidden: int,
                    block_m: int, seed: int = 0, group=None, intermediate: int = 256,
                    experts: str = "torch") -> list:
    from ..buffer import get_symm_buffer_for_mega_moe

    device = torch.device("cuda", torch.cuda.current_device())

    def toks(*per_rank):
        return tuple(per_rank[r % len(per_rank)] for r in range(num_ranks))

    cases = [Case(toks(300, 41), "random", seed + 11), Case(toks(0, 129), "masked", seed + 12),
             Case(toks(77, 1), "one_expert", seed + 13)]
    buf = get_symm_buffer_for_mega_moe(group, num_experts, 300, num_topk, hidden, intermediate,
                                       mma_type=recipe, device=device)
    errors = [check_staged_layer(buf, c, intermediate, block_m, device, experts=experts)
              for c in cases]
    buf.destroy()
    return errors


# ----------------------------------------------------------------------------- torch baseline

def check_baseline_layer(rank: int, num_ranks: int, case: Case, recipe: str, num_experts: int,
                         num_topk: int, hidden: int, intermediate: int, device, group=None,
                         activation_clamp: float | None = 10.0) -> float:
    """`baseline.torch_moe_layer` against the reference (same tolerance as the staged layer)."""
    from ..baseline import torch_moe_layer
    from ..staged import TorchExpertWeights

    e_l = num_experts // num_ranks
    xs, idxs, ws = make_problem(case, num_experts, num_topk, hidden)
    gen = torch.Generator().manual_seed(case.seed + 7)
    w1s = [(torch.randn(e_l, 2 * intermediate, hidden, generator=gen) / hidden**0.5)
           .to(torch.bfloat16) for _ in case.tokens]
    w2s = [(torch.randn(e_l, hidden, intermediate, generator=gen) / intermediate**0.5)
           .to(torch.bfloat16) for _ in case.tokens]
    ref = reference.mega_moe_reference(xs, idxs, ws, w1s, w2s, recipe=recipe,
                                       activation_clamp=activation_clamp)
    weights = TorchExpertWeights.from_bf16(w1s[rank].to(device), w2s[rank].to(device), recipe)
    y = torch_moe_layer(xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device),
                        weights, num_experts=num_experts, recipe=recipe,
                        activation_clamp=activation_clamp, group=group)
    want = ref.y[rank].float()
    if want.numel() == 0:
        assert y.numel() == 0
        return 0.0
    err = float((y.float().cpu() - want).norm() / want.norm().clamp_min(1e-30))
    assert err < LAYER_TOLERANCE[recipe], f"baseline layer rel. error {err:.3g}"
    return err


def _baseline_worker(rank: int, num_ranks: int, port: int, recipe: str, backend: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=num_ranks)
    try:
        with record_failure(rank):
            cases = (Case((37,) * num_ranks, "random", 21),
                     Case((0,) + (50,) * (num_ranks - 1), "masked", 22),
                     Case((64,) * num_ranks, "one_expert", 23))
            for case in cases:
                check_baseline_layer(rank, num_ranks, case, recipe, 8, 2, 256, 128, device,
                                     group=dist.group.WORLD)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_baseline_multiprocess(num_ranks: int, recipe: str, backend: str = "gloo",
                              port: int = 29577) -> None:
    spawn_ranks(_baseline_worker, num_ranks, num_ranks, port, recipe, backend)
