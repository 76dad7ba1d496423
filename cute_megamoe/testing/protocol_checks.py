"""Checks of the cross-rank protocol: ranks that disagree, skip calls, or run for a long time.

Each check runs the ranks of a group that live in this process: all of them on one GPU
(`SymmBuffer.loopback`, each rank on a stream of its own with a share of the SMs), or one per
process on its own GPU (`run_multiprocess`). Every process builds the same global problem from a
seed, so a check is written once for both.

* `check_calls`: many back-to-back calls with random token counts per rank (0 included),
  routings, masks and a BLOCK_M drawn per rank and call; every call's counts, pool placement
  and combined output are checked exactly (the expert of a pool row is the row scaled by its
  routing weight, so `y` has one exact value).
* `check_layer_calls`: the whole layer (`api.mega_moe`) with different token
  counts per rank, i.e. different BLOCK_M choices, against the reference.
* `set_counters_near_wrap`: puts every barrier counter and call tag of a group's buffers just
  below 2**31 or 2**32, as after that many calls, so that `check_calls` runs across the wrap.
* `expect_trap`: a check that must end in a kernel trap (a disagreement, a skipped call), run
  in a fresh process: the trap kills the CUDA context.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import torch

from .. import quant, reference
from .ranks import Ranks, init_rank_process, make_call
from .spawn import record_failure, spawn_ranks

BLOCK_MS = (32, 64, 96, 128)  # BLOCK_M drawn per rank and call by `check_calls`


def _pool_values(result, recipe: str) -> torch.Tensor:
    """What the pool rows hold, as float32 (dequantized as the reference does)."""
    if recipe == "bf16xbf16":
        return result.l1_acts.float()
    return quant.dequantize_activations_for_recipe(
        (result.l1_acts, result.l1_acts_sf.contiguous()), recipe)


def scaled_rows(result, recipe: str) -> torch.Tensor:
    """The "expert" of `check_calls`: every pool row times its routing weight, in BF16. Row
    local and exact, so the combined output has one right value, and a row that lands in the
    wrong place or with the wrong slot's weight changes it."""
    return (_pool_values(result, recipe) * result.l1_topk_weights[:, None]).to(torch.bfloat16)


def _check_one_rank(buf, result, y, xs, idxs, ws, recipe: str, call: int) -> None:
    """Counts, pool placement and the combined output of one rank, exactly."""
    layout = buf.layout
    rank, e_l = buf.rank, layout.num_local_experts
    device = y.device
    counts, _, _ = reference.dispatch_reference(idxs, layout.num_experts)
    mine = counts[rank * e_l:(rank + 1) * e_l].to(torch.int32)
    got = result.expert_recv_tokens.cpu()
    assert torch.equal(got, mine), f"call {call}, rank {rank}: counts {got} != {mine}"
    # every row of expert e in its range of the pool came from a (token, slot) routed to e
    offsets = result.pool_block_offsets().cpu().long() * result.block_m
    meta = result.token_src_metadata.cpu().long()
    token_base = torch.tensor([0] + [len(i) for i in idxs]).cumsum(0)
    idx_all = torch.cat(idxs)
    for e in range(e_l):
        rows = meta[offsets[e]:offsets[e] + int(mine[e])]
        named = idx_all[token_base[rows[:, 0]] + rows[:, 1], rows[:, 2]]
        assert bool((named == rank * e_l + e).all()), \
            f"call {call}, rank {rank}: expert {e} holds rows routed elsewhere"
    # y: the routing-weighted rows summed over the valid slots in ascending k
    x = xs[rank].to(device)
    if recipe == "bf16xbf16":
        values = x.float()
    else:
        values = quant.dequantize_activations_for_recipe(
            quant.quantize_activations_for_recipe(x, recipe), recipe)
    outs = (values[:, None, :] * ws[rank].to(device)[:, :, None]).to(torch.bfloat16)
    want = reference.combine_reference(outs, idxs[rank].to(device))
    assert torch.equal(y.view(torch.int16), want.view(torch.int16)), \
        f"call {call}, rank {rank}: combined output differs"


def run_call(ranks: Ranks, xs, idxs, ws, block_ms: list[int], call: int,
             transfer: str = "push") -> None:
    """One dispatch + `scaled_rows` + combine call on the local ranks (phased, see `Ranks`),
    checked exactly."""
    from .. import staged

    layout = ranks.layout
    device = ranks.buffers[0].device
    inputs = {buf.rank: (xs[buf.rank].to(device), idxs[buf.rank].to(device),
                         ws[buf.rank].to(device)) for buf in ranks.buffers}
    ys = {buf.rank: torch.full((len(xs[buf.rank]), layout.hidden), float("nan"),
                               dtype=torch.bfloat16, device=device) for buf in ranks.buffers}
    results = ranks.run(lambda buf: staged.dispatch(
        buf, *inputs[buf.rank], block_m=block_ms[buf.rank], validate_routing=False,
        transfer=transfer))
    by_rank = {buf.rank: result for buf, result in zip(ranks.buffers, results, strict=True)}
    ranks.run(lambda buf: staged.combine(buf, scaled_rows(by_rank[buf.rank], layout.recipe),
                                         by_rank[buf.rank], ys[buf.rank]))
    torch.cuda.synchronize(device)
    for buf in ranks.buffers:
        _check_one_rank(buf, by_rank[buf.rank], ys[buf.rank], xs, idxs, ws, layout.recipe,
                        call)


def check_calls(ranks: Ranks, num_calls: int, seed: int = 0, transfer: str = "push",
                max_tokens: int | None = None) -> int:
    """`num_calls` back-to-back dispatch + combine calls with random token counts per rank (0
    included), routings, masks and per-rank BLOCK_M; every call checked exactly (after one
    warm-up call per BLOCK_M, every rank using it). Returns the number of random calls."""
    layout = ranks.layout
    num_ranks = layout.num_ranks
    max_tokens = max_tokens or layout.num_max_tokens_per_rank
    rng = random.Random(seed)
    routings = ("random", "masked", "one_expert", "skewed")
    for i, block_m in enumerate(BLOCK_MS):
        xs, idxs, ws = make_call(layout, (max_tokens,) * num_ranks, "random", seed + i)
        run_call(ranks, xs, idxs, ws, [block_m] * num_ranks, -1 - i, transfer)
    for call in range(num_calls):
        tokens = tuple(rng.choice((0, 1, rng.randint(0, max_tokens), max_tokens))
                       for _ in range(num_ranks))
        block_ms = [rng.choice(BLOCK_MS) for _ in range(num_ranks)]
        xs, idxs, ws = make_call(layout, tokens, rng.choice(routings), seed * 100003 + call)
        run_call(ranks, xs, idxs, ws, block_ms, call, transfer)
    return num_calls


def check_layer_calls(ranks: Ranks, tokens_per_call: list[tuple[int, ...]], seed: int = 0,
                      intermediate: int | None = None) -> list[float]:
    """The whole layer on our kernels (`api.mega_moe`, BLOCK_M chosen per
    rank from its own token count) for each entry of `tokens_per_call`, against the reference
    (the tolerance of `dispatch_checks.check_staged_layer`). Returns the relative errors."""
    from .. import api, staged
    from ..expert_gemm import ExpertWeights
    from ..heuristics import expected_tokens_per_expert, select_block_m, warm_up_token_counts
    from ..runtime import get_arch
    from .dispatch_checks import LAYER_TOLERANCE

    layout = ranks.layout
    recipe, e_l, hidden = layout.recipe, layout.num_local_experts, layout.hidden
    inter = intermediate or layout.intermediate_hidden
    device = ranks.buffers[0].device
    gen = torch.Generator().manual_seed(seed + 7)
    w1s = [(torch.randn(e_l, 2 * inter, hidden, generator=gen) / hidden**0.5)
           .to(torch.bfloat16).to(device) for _ in range(layout.num_ranks)]
    w2s = [(torch.randn(e_l, hidden, inter, generator=gen) / inter**0.5)
           .to(torch.bfloat16).to(device) for _ in range(layout.num_ranks)]
    weights = {buf.rank: ExpertWeights.from_bf16(w1s[buf.rank], w2s[buf.rank], recipe)
               for buf in ranks.buffers}
    layer = api.mega_moe
    # warm-up (see `Ranks`): every BLOCK_M the layer will pick, every rank using it, phased,
    # at every token count that picks other kernels (`heuristics.warm_up_token_counts`)
    arch = get_arch(device)
    most = max([1, *(n for tokens in tokens_per_call for n in tokens)])
    for block_m, n in itertools.product(sorted({select_block_m(expected_tokens_per_expert(
            n, layout.num_ranks, layout.num_topk, layout.num_experts), arch)
            for tokens in tokens_per_call for n in tokens}), warm_up_token_counts(most)):
        xs, idxs, ws = make_call(layout, (n,) * layout.num_ranks, "random", seed + block_m + n)
        results = ranks.run(lambda buf, xs=xs, idxs=idxs, ws=ws, block_m=block_m:
                            staged.dispatch(buf, xs[buf.rank].to(device),
                                            idxs[buf.rank].to(device), ws[buf.rank].to(device),
                                            block_m=block_m, validate_routing=False))
        by_rank = {b.rank: r for b, r in zip(ranks.buffers, results, strict=True)}
        ranks.run(lambda buf, by_rank=by_rank: staged.kernel_experts(
            buf, by_rank[buf.rank], weights[buf.rank], 10.0, send_to_combine=True))
        ranks.run(lambda buf, by_rank=by_rank: staged.combine(buf, None, by_rank[buf.rank]))
    torch.cuda.synchronize(device)
    errors = []
    for call, tokens in enumerate(tokens_per_call):
        xs, idxs, ws = make_call(layout, tokens, ("random", "masked", "skewed")[call % 3],
                                 seed * 1009 + call)
        xs, idxs, ws = ([t.to(device) for t in ts] for ts in (xs, idxs, ws))
        ys = {buf.rank: torch.full_like(xs[buf.rank], float("nan")) for buf in ranks.buffers}
        for buf in ranks.buffers:
            api.stage_inputs(buf, xs[buf.rank], idxs[buf.rank], ws[buf.rank])
        ranks.run(lambda buf, ys=ys: layer(ys[buf.rank], weights[buf.rank], buf,
                                           activation_clamp=10.0))
        torch.cuda.synchronize(device)
        ref = reference.mega_moe_reference(xs, idxs, ws, w1s, w2s, recipe=recipe,
                                           activation_clamp=10.0)
        for buf in ranks.buffers:
            y, want = ys[buf.rank].float(), ref.y[buf.rank].float()
            if want.numel() == 0:
                continue
            assert bool(torch.isfinite(y).all()), f"call {call}, rank {buf.rank}: non-finite"
            err = float((y - want).norm() / want.norm().clamp_min(1e-30))
            assert err < LAYER_TOLERANCE[recipe], \
                f"call {call} (tokens {tokens}), rank {buf.rank}: rel. error {err:.3g}"
            errors.append(err)
    return errors


def set_counters_near_wrap(ranks: Ranks, calls_made: int) -> None:
    """Put every counter of the local ranks' barrier regions where `calls_made` calls (mod
    2**32) of dispatch + combine would have left it, and every published count word at that
    call's tag: the state of a group that has run that long. All ranks of the group must be
    set alike, before any call (a later call starts from there)."""
    from ..kernels.common.sync import SPLIT_BARRIER_COUNT
    from ..layout import BarrierSlots as S

    def int32(v: int) -> int:
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= 1 << 31 else v

    num_ranks = ranks.layout.num_ranks
    for buf in ranks.buffers:
        slots = buf.barrier.cpu()
        slots[S.GRID] = int32(1 << 31)  # a multiple of 2**31: each grid barrier adds 2**31
        slots[S.CALL_TAG] = slots[S.CALL_DONE] = int32(calls_made)
        slots[S.STALL_REPORTED] = 0
        # one cross-rank barrier per call: barrier b signalled slot b & 1 with +1 (bit 1 of b
        # clear) or -1, so after it that slot holds R or 0
        slots[S.RANK_BARRIER_COUNT] = int32(calls_made)
        for phase in (0, 1):
            last = [b for b in (calls_made - 1, calls_made - 2) if b >= 0 and b & 1 == phase]
            slots[S.RANK_BARRIER_SIGNAL + phase] = (
                num_ranks if last and last[0] & 2 == 0 else 0)
        slots[S.SPLIT_CALLS] = int32(calls_made)
        slots[S.SPLIT_ARRIVAL:S.SPLIT_ARRIVAL + SPLIT_BARRIER_COUNT] = 0
        slots[S.SPLIT_SIGNAL:S.SPLIT_SIGNAL + SPLIT_BARRIER_COUNT] = int32(calls_made * num_ranks)
        buf.barrier.copy_(slots)
        # the count words a peer published in the last call: stale for the next one
        words = buf.expert_recv_count
        words.copy_((words & 0xFFFFFFFF) | (int32(calls_made) << 32))
        if buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)


def read_call_tag(buf) -> tuple[int, int]:
    """(CALL_TAG, CALL_DONE) of a buffer, as unsigned 32-bit numbers."""
    from ..layout import BarrierSlots as S

    slots = buf.barrier.cpu()
    return int(slots[S.CALL_TAG]) & 0xFFFFFFFF, int(slots[S.CALL_DONE]) & 0xFFFFFFFF


# ----------------------------------------------------------------------------- traps

def _trap_scenario(scenario: str) -> None:
    """Run in a fresh process (`expect_trap`): two loopback ranks (one for "held_cta") that
    must end in a trap; prints the ranks' reports after it."""
    ranks = Ranks.loopback(1 if scenario == "held_cta" else 2, 8, 64, 2, 256, 128,
                           "bf16xbf16")
    try:
        _run_trap_scenario(scenario, ranks)
    except RuntimeError:  # (the trap: print what the kernels reported, as a user would see)
        for buf in ranks.buffers:
            print(buf.report(), flush=True)
        raise


def _run_trap_scenario(scenario: str, ranks) -> None:
    from .. import staged

    layout = ranks.layout
    xs, idxs, ws = make_call(layout, (64, 64), "random", 5)
    device = ranks.buffers[0].device
    inputs = [(x.to(device), i.to(device), w.to(device)) for x, i, w in zip(xs, idxs, ws,
                                                                            strict=True)]
    if scenario == "transfer":
        for transfers in (("push", "push"), ("pull", "pull"), ("push", "pull")):
            # (the agreeing calls load both kernels first, see `Ranks`)
            ranks.run(lambda buf, t=transfers: staged.dispatch(
                buf, *inputs[buf.rank], block_m=64, transfer=t[buf.rank],
                validate_routing=False))
            if transfers[0] == transfers[1]:
                torch.cuda.synchronize(device)
                print(f"{transfers}: ok", flush=True)
    elif scenario == "recipe":
        # a peer's count words claiming another recipe (as a buffer laid out for another
        # recipe would publish): rank 1's published settings are rewritten before the call
        _run_with_foreign_recipe(ranks, inputs)
    elif scenario == "skipped_call":
        ranks.run(lambda buf: staged.dispatch(buf, *inputs[buf.rank], block_m=64,
                                              validate_routing=False))
        torch.cuda.synchronize(device)
        print("first call: ok", flush=True)
        # rank 1 rejects its next call on the host (a bad input) and goes on with the one
        # after: rank 0's second call meets rank 1's third
        try:
            staged.dispatch(ranks.buffers[1], inputs[1][0].float(), *inputs[1][1:])
        except TypeError as err:
            print(f"rank 1 gave up a call: {err}", flush=True)
        ranks.run(lambda buf: staged.dispatch(buf, *inputs[buf.rank], block_m=64,
                                              validate_routing=False))
    elif scenario == "row_protocol":
        _run_with_row_transfers(ranks, inputs)
    elif scenario == "fused_and_staged":
        _run_fused_against_staged(ranks, inputs)
    elif scenario == "held_cta":
        _run_with_a_held_cta(ranks, inputs)
    elif scenario == "lost_rank":
        # rank 1 never launches its call: rank 0 waits for its counts until the timeout
        staged.dispatch(ranks.buffers[0], *inputs[0], block_m=64, validate_routing=False)
    else:
        raise ValueError(scenario)
    torch.cuda.synchronize(device)
    print("FINISHED WITHOUT A TRAP", flush=True)


def _run_with_a_held_cta(ranks: Ranks, inputs) -> None:
    """One rank's fused call whose CTA `sm90_mega_moe.HELD_CTA` is held back before its combine
    (the "hold_cta" test build, an injected stall): the other CTAs' split-barrier report must
    name it and its step."""
    from ..config import Sm90FusedConfig
    from ..expert_gemm import ExpertWeights
    from ..heuristics import default_fused_config
    from ..launch import buffer_state, fused_call
    from ..staged import stage_inputs

    (buf,) = ranks.buffers
    layout = buf.layout
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(layout.num_local_experts, 2 * layout.intermediate_hidden, layout.hidden,
                     generator=gen).to(torch.bfloat16).to(buf.device)
    w2 = torch.randn(layout.num_local_experts, layout.hidden, layout.intermediate_hidden,
                     generator=gen).to(torch.bfloat16).to(buf.device)
    weights = ExpertWeights.from_bf16(w1, w2, layout.recipe)
    stage_inputs(buf, *inputs[0], validate_routing=False)
    n = inputs[0][0].shape[0]
    y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device=buf.device)
    config = default_fused_config(layout, 128, False, Sm90FusedConfig(debug="hold_cta"))
    fused_call(buf, weights, n, y, buffer_state(buf).num_sms, None, None, True, config)()


def _run_with_row_transfers(ranks: Ranks, inputs) -> None:
    """Fused-kernel calls whose ranks move the rows alike, then "barrier" against "counted",
    which must trap."""
    from .. import fused
    from ..expert_gemm import ExpertWeights
    from .fused_checks import rows_config

    layout = ranks.layout
    e_l, h, inter = layout.num_local_experts, layout.hidden, layout.intermediate_hidden
    gen = torch.Generator().manual_seed(3)
    weights = {buf.rank: ExpertWeights.from_bf16(
        (torch.randn(e_l, 2 * inter, h, generator=gen) / h**0.5).to(torch.bfloat16).to(
            buf.device),
        (torch.randn(e_l, h, inter, generator=gen) / inter**0.5).to(torch.bfloat16).to(
            buf.device), layout.recipe) for buf in ranks.buffers}
    for transfers in (("barrier", "barrier"), ("counted", "counted"), ("barrier", "counted")):
        ranks.run(lambda buf, t=transfers: fused.fused_mega_moe(
            buf, *inputs[buf.rank], weights[buf.rank], block_m=64, validate_routing=False,
            config=rows_config(t[buf.rank])))
        if transfers != ("barrier", "counted"):
            torch.cuda.synchronize(ranks.buffers[0].device)
            print(f"{transfers}: ok", flush=True)


def _run_fused_against_staged(ranks: Ranks, inputs) -> None:
    """Rank 0 runs the fused layer with counted rows (the default of this buffer's capacity),
    rank 1 the staged layer, as ranks whose ``CUTE_MEGAMOE_FUSED`` differ in a group of several
    GPUs would: two row protocols, which must trap (after agreeing calls that load every
    kernel)."""
    from .fused_checks import FusedLayer, rows_config

    layer = FusedLayer(ranks, configs={0: rows_config("counted"), 1: rows_config("counted")})
    layer.warm_up((64,))
    print("agreeing calls: ok", flush=True)
    ys = {b.rank: torch.empty(inputs[b.rank][0].shape[0], ranks.layout.hidden,
                              dtype=torch.bfloat16, device=b.device) for b in ranks.buffers}
    layer.run({0: "fused", 1: "staged"}, dict(enumerate(inputs)), {0: 64, 1: 64}, ys,
              stats="fused")


def _run_with_foreign_recipe(ranks: Ranks, inputs) -> None:
    """Rank 1 launches a dispatch kernel whose published settings name fp8xfp8 on bf16xbf16
    buffers (what a peer with another recipe would publish)."""
    import cutlass.cute as cute
    from cutlass import Int32

    from .. import api
    from ..kernels.dispatch import DispatchKernel
    from ..launch import buffer_state as _state
    from ..layout import CountWord
    from ..runtime import current_stream

    def args(buf):
        state = _state(buf)
        return (state.peer_bases, Int32(buf.rank), Int32(inputs[buf.rank][0].shape[0]),
                state.recv_tokens_ptr, state.recv_tokens_ptr, Int32(state.num_sms),
                current_stream())

    state = _state(ranks.buffers[0])
    kernels = []
    for recipe in (ranks.layout.recipe, "fp8xfp8"):
        kernel = DispatchKernel(ranks.layout, 64)
        kernel.settings = CountWord.settings(64, recipe, True)
        kernels.append(cute.compile(kernel, *args(ranks.buffers[0]),
                                    options=f"--gpu-arch {state.arch}"))
    for choice in ((0, 0), (1, 1), (0, 1)):  # agreeing calls first: they load both kernels
        def launch(buf, choice=choice):
            api.stage_inputs(buf, *inputs[buf.rank], validate_routing=False)
            kernels[choice[buf.rank]](*args(buf))

        ranks.run(launch)
        if choice[0] == choice[1]:
            torch.cuda.synchronize(ranks.buffers[0].device)
            print(f"kernels {choice}: ok", flush=True)


def expect_trap(scenario: str, timeout_s: float = 20, env: dict | None = None) -> str:
    """Run `_trap_scenario(scenario)` in a fresh Python process; assert that a kernel trapped
    (a CUDA error) and return what the process printed."""
    code = ("from cute_megamoe.testing.protocol_checks import _trap_scenario; "
            f"_trap_scenario({scenario!r})")
    proc_env = dict(os.environ, CUTE_MEGAMOE_SPIN_TIMEOUT_S=str(timeout_s), **(env or {}))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=proc_env, timeout=600)
    out = proc.stdout + proc.stderr
    assert "FINISHED WITHOUT A TRAP" not in out, out[-4000:]
    assert proc.returncode != 0 and ("CUDA" in out or "cuda" in out), out[-4000:]
    return out


# ----------------------------------------------------------------------------- one GPU per rank

def _worker(rank: int, num_ranks: int, port: int, recipe: str, num_calls: int) -> None:
    import torch.distributed as dist

    from ..buffer import get_symm_buffer_for_mega_moe

    init_rank_process(rank, num_ranks, port)
    try:
        with record_failure(rank):
            buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, 8 * num_ranks, 300, 4, 512, 256,
                                               mma_type=recipe)
            ranks = Ranks([buf], [torch.cuda.Stream()])
            check_calls(ranks, num_calls, seed=3)
            for calls_made in ((1 << 31) - 3, (1 << 32) - 3):
                dist.barrier()  # no peer is still in a call while the counters are rewritten
                set_counters_near_wrap(ranks, calls_made)
                dist.barrier()
                check_calls(ranks, 6, seed=calls_made % 1000)
            layer = [(1000, 1100), (0, 300), (1, 77)]
            if recipe != "fp8xfp4" and torch.cuda.get_device_capability()[0] == 9:
                big = get_symm_buffer_for_mega_moe(dist.group.WORLD, 256, 1100, 8, 512, 256,
                                                   mma_type=recipe)
                check_layer_calls(Ranks([big], [torch.cuda.Stream()]),
                                  [tuple(t[r % 2] for r in range(num_ranks)) for t in layer])
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_multiprocess(num_ranks: int, recipe: str, num_calls: int, port: int = 29917) -> None:
    """`check_calls` (random calls, then across the counter wraps) and `check_layer_calls`
    with one process per GPU (needs `num_ranks` GPUs)."""
    spawn_ranks(_worker, num_ranks, num_ranks, port, recipe, num_calls)
