"""The cross-rank protocol when ranks disagree, skip calls or run for weeks (issue 20).

GPU tests run the ranks of a group on one GPU (`SymmBuffer.loopback`: every rank's buffer in one
process, each rank on a stream of its own with a share of the SMs; peer traffic stays in the
GPU's memory) and, where the GPUs exist, one rank per GPU. See
`cute_megamoe.testing.protocol_checks`.
"""

import pytest
import torch

from cute_megamoe.layout import BarrierSlots


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


# ----------------------------------------------------------------------------- CPU

def test_skip_call_advances_the_call_tag_only():
    from cute_megamoe.buffer import SymmBuffer

    bufs = SymmBuffer.loopback(2, 8, 64, 2, 256, 128, "bf16xbf16", device="cpu")
    bufs[1].skip_call()
    bufs[1].skip_call()
    assert int(bufs[1].barrier[BarrierSlots.CALL_TAG]) == 2
    assert int(bufs[1].barrier[BarrierSlots.CALL_DONE]) == 0
    assert not bool(bufs[0].barrier.any())
    assert bufs[0].peer_bases.tolist() == bufs[1].peer_bases.tolist()
    assert [b.rank for b in bufs] == [0, 1] and all(b.num_ranks == 2 for b in bufs)


def test_a_host_error_gives_the_call_up():
    """An entry point that raises before its launch counts the call as given up; one that
    raises on the buffer argument itself cannot (there is no buffer)."""
    from cute_megamoe import staged
    from cute_megamoe.buffer import SymmBuffer

    buf = SymmBuffer.loopback(1, 8, 64, 2, 256, 128, "bf16xbf16", device="cpu")[0]
    x = torch.zeros(4, 256)  # float32, not BF16, and a buffer on the CPU
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        staged.dispatch(buf, x, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2))
    assert int(buf.barrier[BarrierSlots.CALL_TAG]) == 1
    with pytest.raises(TypeError, match="sym_buffer"):
        staged.dispatch(object(), x, None, None)


def test_no_gpu_gives_our_error(monkeypatch):
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="device='cpu'"):
        get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, mma_type="bf16xbf16")
    buf = get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, mma_type="bf16xbf16",
                                       device="cpu")
    assert buf.device.type == "cpu"


def test_spin_timeout_is_part_of_the_kernel_cache_key(monkeypatch):
    from cute_megamoe import runtime

    built = []
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "7")
    first = runtime.compiled_kernel(("test-key",), lambda: built.append(1) or len(built))
    assert runtime.compiled_kernel(("test-key",), lambda: built.append(1) or len(built)) == first
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    assert runtime.compiled_kernel(("test-key",), lambda: built.append(1) or len(built)) != first
    assert len(built) == 2


def test_counters_near_wrap_are_consistent():
    """`set_counters_near_wrap` writes what that many calls leave: the cross-rank barrier's
    two signal slots alternate between R and 0, the split signals hold calls * R mod 2**32."""
    from cute_megamoe.buffer import SymmBuffer
    from cute_megamoe.testing.protocol_checks import Ranks, read_call_tag, set_counters_near_wrap

    bufs = SymmBuffer.loopback(2, 8, 64, 2, 256, 128, "bf16xbf16", device="cpu")
    ranks = Ranks(bufs, [None, None])
    for calls, signals in ((0, (0, 0)), (1, (2, 0)), (2, (2, 2)), (3, (0, 2)), (4, (0, 0)),
                           ((1 << 32) - 3, (2, 0))):  # 2**32 - 3: barrier 2**32 - 4 was +1
        set_counters_near_wrap(ranks, calls)
        slots = bufs[1].barrier
        s = BarrierSlots.RANK_BARRIER_SIGNAL
        assert (int(slots[s]), int(slots[s + 1])) == signals, calls
        assert read_call_tag(bufs[1]) == (calls % (1 << 32),) * 2
        split = int(slots[BarrierSlots.SPLIT_SIGNAL]) & 0xFFFFFFFF
        assert split == (calls * 2) % (1 << 32)
        assert int(bufs[0].expert_recv_count[1, 3]) >> 32 & 0xFFFFFFFF == calls % (1 << 32)


def test_a_loopback_rank_after_the_first_may_not_compile(monkeypatch):
    """`Ranks.run`: rank 0's step may compile a kernel, a later rank's may not (it would load
    it while rank 0's kernels of the call run, which deadlocked a loopback call on the H200
    until the spin limit, 12-04): `compiled_kernel` raises naming the rank, before building."""
    import contextlib

    from cute_megamoe import runtime
    from cute_megamoe.buffer import SymmBuffer
    from cute_megamoe.testing.protocol_checks import Ranks

    class Stream:  # (no GPU: the streams only order work)
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    bufs = SymmBuffer.loopback(2, 8, 64, 2, 256, 128, "bf16xbf16", device="cpu")
    ranks = Ranks(bufs, [Stream(), Stream()])
    built = []

    def step(buf, key):
        return runtime.compiled_kernel(key, lambda: built.append((buf.rank, key)) or key)

    assert ranks.run(lambda buf: step(buf, ("loopback-guard", 1))) == [("loopback-guard", 1)] * 2
    assert built == [(0, ("loopback-guard", 1))]  # rank 1 found it compiled
    with pytest.raises(RuntimeError, match="rank 1 of a loopback call"):
        ranks.run(lambda buf: step(buf, ("loopback-guard", 2, buf.rank)))
    assert built == [(0, ("loopback-guard", 1)), (0, ("loopback-guard", 2, 0))]
    # outside a loopback call every compile goes on
    assert step(bufs[1], ("loopback-guard", 2, 1)) == ("loopback-guard", 2, 1)


# ----------------------------------------------------------------------------- compile

@pytest.mark.compile
def test_split_barrier_arrival_has_a_warp_sync_and_the_pull_a_proxy_fence(monkeypatch):
    from test_dispatch_combine import _compile

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    combine = _compile("combine", "sm_90a", "fp8xfp8")
    assert "bar.warp.sync" in combine.ptx
    pull = _compile("dispatch", "sm_90a", "fp8xfp8", transfer="pull")
    assert "fence.proxy.async.global" in pull.ptx


# ----------------------------------------------------------------------------- one GPU

@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks,recipe,num_calls", [
    (2, "bf16xbf16", 1000), (2, "fp8xfp8", 100), (2, "fp8xfp4", 50), (1, "fp8xfp8", 50),
    (4, "bf16xbf16", 50), (8, "fp8xfp8", 20)])
def test_back_to_back_calls_with_random_counts_loopback(num_ranks, recipe, num_calls):
    """Random token counts per rank (0 included), routings, masks and a BLOCK_M per rank and
    call; every call exact (counts, pool placement, combined output)."""
    from cute_megamoe.testing.protocol_checks import Ranks, check_calls

    _gpu()
    ranks = Ranks.loopback(num_ranks, 8 * num_ranks, 300, 4, 512, 256, recipe)
    assert check_calls(ranks, num_calls, seed=num_ranks) == num_calls


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("calls_made", [(1 << 31) - 3, (1 << 32) - 3])
def test_calls_across_the_counter_wraps_loopback(num_ranks, calls_made):
    """Counters and tags just below 2**31 and 2**32, as after that many calls: six more calls
    run exactly and the tags pass the wrap."""
    from cute_megamoe.testing.protocol_checks import (
        BLOCK_MS,
        Ranks,
        check_calls,
        read_call_tag,
        set_counters_near_wrap,
    )

    _gpu()
    ranks = Ranks.loopback(num_ranks, 8 * num_ranks, 300, 4, 512, 256, "fp8xfp8")
    set_counters_near_wrap(ranks, calls_made)
    check_calls(ranks, 6, seed=calls_made % 1000)  # (after a warm-up call per BLOCK_M)
    for buf in ranks.buffers:
        assert read_call_tag(buf) == ((calls_made + len(BLOCK_MS) + 6) % (1 << 32),) * 2
        barrier = buf.barrier.cpu()
        assert int(barrier[BarrierSlots.STALL_REPORTED]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8xfp8", "bf16xbf16"])
def test_layer_with_different_block_m_per_rank_loopback(recipe):
    """The issue's example: R = 2, top-8 of 256 experts, 1000 tokens on rank 0 (BLOCK_M 64) and
    1100 on rank 1 (BLOCK_M 128), through `api.mega_moe`, against the
    reference; then 0 / 1 / 300 tokens."""
    from cute_megamoe.heuristics import expected_tokens_per_expert, select_block_m
    from cute_megamoe.testing.protocol_checks import Ranks, check_layer_calls

    _gpu()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the grouped-GEMM kernels run on Hopper")
    assert [select_block_m(expected_tokens_per_expert(n, 2, 8, 256), "sm_90a")
            for n in (1000, 1100)] == [64, 128]
    ranks = Ranks.loopback(2, 256, 1100, 8, 512, 256, recipe)
    errors = check_layer_calls(ranks, [(1000, 1100), (0, 300), (1, 77), (1100, 1000)])
    assert len(errors) == 7


@pytest.mark.gpu
@pytest.mark.parametrize("scenario,message", [
    ("transfer", "ranks disagree on the dispatch transfer"),
    ("recipe", "ranks disagree on the recipe"),
    ("skipped_call", "ranks are out of step"),
    ("row_protocol", "ranks disagree on the row protocol"),
    ("fused_and_staged", "ranks disagree on the row protocol")])
def test_disagreeing_ranks_trap_loopback(scenario, message):
    """Each ends in a kernel trap with one message naming what differs (not a silent wrong
    result, not a hang until the timeout)."""
    from cute_megamoe.testing.protocol_checks import expect_trap

    _gpu()
    out = expect_trap(scenario, timeout_s=60)
    assert message in out, out[-3000:]
    assert "stalled" not in out, out[-3000:]  # the check fired, not the timeout
    assert out.count("cute_megamoe:") <= 2, out[-3000:]  # one line per rank at most


@pytest.mark.gpu
def test_a_lost_rank_is_reported_by_the_counter_it_stalled_on():
    """A rank whose peer never launches its call gives up after the timeout and names what it
    waited for (which rank, which count word, which call), from the pinned report record, and
    the buffer refuses further launches with the same message."""
    from cute_megamoe.testing.protocol_checks import expect_trap

    _gpu()
    out = expect_trap("lost_rank", timeout_s=2)
    assert ("wait on expert_recv_count stalled (rank 0, cta" in out
            and "rank 1 has not published expert" in out), out[-3000:]


@pytest.mark.gpu
def test_an_injected_stall_names_the_held_cta_and_its_step():
    """The fused kernel with one CTA held back before its combine (a test build): the other
    CTAs' split-barrier stall report counts the CTAs that did not arrive, and names the held
    one with every warpgroup's step."""
    from cute_megamoe.kernels.sm90_mega_moe import HELD_CTA
    from cute_megamoe.testing.protocol_checks import expect_trap

    _gpu()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused kernel runs on sm_90a")
    out = expect_trap("held_cta", timeout_s=2)
    assert "wait on split barrier signal" in out, out[-3000:]
    line = f"CTAs that did not arrive (1): cta {HELD_CTA} (warpgroup 0: held back"
    assert line in out, out[-3000:]
    assert "warpgroup 2: held back (a test's injected stall))" in out, out[-3000:]


# ----------------------------------------------------------------------------- one GPU per rank

@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("recipe", ["fp8xfp8", "bf16xbf16"])
def test_protocol_one_rank_per_gpu(num_ranks, recipe):
    """1000 random calls (R = 2; 100 at 4 and 8), the counter wraps and the layer with
    different BLOCK_M per rank, one process per GPU."""
    from cute_megamoe.testing.protocol_checks import run_multiprocess

    if torch.cuda.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} GPUs, {torch.cuda.device_count()} present")
    run_multiprocess(num_ranks, recipe, 1000 if num_ranks == 2 else 100,
                     port=29931 + 10 * num_ranks + ("fp8xfp8", "bf16xbf16").index(recipe))
