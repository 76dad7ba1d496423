"""Dispatch (count -> prefix -> scatter -> pull) and combine kernels, and the staged layer.

CPU: both kernels compile for sm_90a and sm_100a (R = 2 and 8) with the copies and atomics
they need. GPU: bookkeeping, pool rows and combine checked exactly against the reference
(`cute_megamoe.testing.dispatch_checks`), R = 1 in-process and R = 2, 4, 8 across GPUs (each
skips without enough GPUs), with uneven, masked and degenerate routings, ten calls back to back
on one buffer.
"""

import pytest
import torch

from cute_megamoe.quant import RECIPES

ARCHS = ("sm_90a", "sm_100a")


def _compile(kind: str, arch: str, recipe: str, num_ranks: int = 2, send_mode: str = "registers",
             rounds: tuple[int, ...] = (8,), transfer: str = "push"):
    from cutlass import BFloat16, Int32, Int64

    from cute_megamoe.kernels.combine import CombineKernel
    from cute_megamoe.kernels.dispatch import DispatchKernel
    from cute_megamoe.layout import MegaMoELayout
    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    layout = MegaMoELayout(num_ranks, 256, 8192, 8, 7168, 2048, recipe)
    peers, counts = fake_ptr(Int64), fake_ptr(Int32, align=4)
    if kind == "dispatch":
        kernel = DispatchKernel(layout, 128, has_stats=True, transfer=transfer)
        args = (peers, Int32(0), Int32(1), counts, counts, Int32(132), fake_stream())
    else:
        kernel = CombineKernel(layout, 128, send_mode=send_mode, rounds=rounds)
        args = (peers, Int32(0), Int32(1), fake_ptr(BFloat16), counts, fake_ptr(BFloat16),
                Int32(132), fake_stream())
    return compile_for_arch(kernel, *args, arch=arch)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("recipe,num_ranks,transfer", [
    ("fp8xfp4", 2, "push"), ("fp8xfp8", 8, "push"), ("bf16xbf16", 2, "push"),
    ("fp8xfp4", 2, "pull"), ("fp8xfp8", 8, "pull"), ("bf16xbf16", 2, "pull")])
def test_dispatch_compiles_with_scoped_atomics_and_row_copies(arch, recipe, num_ranks, transfer,
                                                              monkeypatch):
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")  # no timed-out reports compiled in
    art = _compile("dispatch", arch, recipe, num_ranks=num_ranks, transfer=transfer)
    ptx = art.ptx
    assert "atom.shared.cta.add.u32" in ptx or "atom.shared.add.u32" in ptx  # count / slots
    assert "atom.global.add.u64" in ptx  # 64-bit (arrivals | count) prefix
    assert "st.release.sys.global.b64" in ptx  # count publication to the expert's rank
    assert "ld.acquire.sys.global.b64" in ptx  # ... read with acquire
    assert "red.release.sys.global.add.s32" in ptx  # cross-rank barrier signal
    # the routing check: bad slots counted, the first kept by two 64-bit maxima, and the call's
    # record taken (and zeroed) by the last CTA (`kernels/common/routing.py`)
    assert "red.relaxed.gpu.global.add.s32" in ptx
    assert ptx.count("red.relaxed.gpu.global.max.s64") == 2
    assert ptx.count("atom.global.exch.b64") == 2 and "atom.global.exch.b32" in ptx
    bulk = ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
            and "cp.async.bulk.global.shared::cta.bulk_group" in ptx)
    assert bulk == (transfer == "pull")  # pull: bulk copies; push: register copies
    if art.sass is not None:
        if transfer == "pull":
            assert art.count("UBLKCP.G.S") >= 1 and art.count("UBLKCP.S.G") >= 1
        else:
            assert art.count("LDG.E.128") >= 1 and art.count("STG.E.128") >= 1
        assert art.count("STL") == 0 and art.count("LDL") == 0
        assert art.resource_usage()["STACK"] == 0


def test_row_staging_must_fit_shared_memory():
    """The bulk modes stage rows per warp in shared memory: the combine's bulk mode keeps 8
    warps by default, and too many warps are refused before any compile."""
    from cute_megamoe.kernels.combine import CombineKernel
    from cute_megamoe.kernels.dispatch import DispatchKernel
    from cute_megamoe.layout import MegaMoELayout

    layout = MegaMoELayout(2, 256, 8192, 8, 7168, 2048, "bf16xbf16")
    assert CombineKernel(layout, 128, send_mode="bulk").num_threads == 256
    assert CombineKernel(layout, 128).num_threads == 512
    with pytest.raises(ValueError, match="shared memory"):
        CombineKernel(layout, 128, num_threads=512, send_mode="bulk")
    with pytest.raises(ValueError, match="shared memory"):
        DispatchKernel(layout, 128, num_threads=1024, transfer="pull")
    assert DispatchKernel(layout, 128).num_threads == 512  # push: no staging
    with pytest.raises(ValueError, match="transfer"):
        DispatchKernel(layout, 128, transfer="teleport")


def test_combine_rounds_must_cover_the_token_classes():
    from cute_megamoe.heuristics import select_combine_rounds
    from cute_megamoe.kernels.combine import CombineKernel
    from cute_megamoe.layout import MegaMoELayout

    layout = MegaMoELayout(2, 256, 8192, 8, 7168, 2048, "bf16xbf16")
    for rounds in ((8,), (4, 4), (2, 2, 2, 1, 1), (1,) * 8, [3, 5]):
        assert CombineKernel(layout, 128, rounds=rounds).rounds == tuple(rounds)
    for rounds, send_mode in (((3, 4), "registers"), ((8, 0), "registers"), ((), "registers"),
                              ((9, -1), "registers"), ((4.0, 4), "registers"),
                              ((4, 4), "bulk"), ((4, 4), "epilogue")):
        with pytest.raises(ValueError, match="rounds"):
            CombineKernel(layout, 128, send_mode=send_mode, rounds=rounds)
    # measured on 2 x H200 (docs/performance.md): one round below 2048 tokens
    assert [len(select_combine_rounds(n)) for n in (0, 1, 2047, 2048, 8191, 8192, 10**6)] == \
        [1, 1, 1, 4, 4, 5, 5]
    assert all(sum(select_combine_rounds(n)) == 8 for n in (0, 2048, 8192))
    with pytest.raises(ValueError):
        select_combine_rounds(-1)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("send_mode,rounds", [("registers", (8,)), ("registers", (2, 6)),
                                              ("bulk", (8,)), ("epilogue", (8,))])
def test_combine_compiles_with_wide_accesses(arch, send_mode, rounds, monkeypatch):
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    art = _compile("combine", arch, "fp8xfp4", send_mode=send_mode, rounds=rounds)
    has_bulk_store = "cp.async.bulk.global.shared::cta.bulk_group" in art.ptx
    assert has_bulk_store == (send_mode == "bulk")
    # split-barrier signals: released at system scope, spun on with acquire
    assert "red.release.sys.global.add.s32" in art.ptx and "ld.acquire.sys" in art.ptx
    if art.sass is not None:
        # per round (the rounds are unrolled): reduce, one 16-byte load per top-k slot (K = 8),
        # two vectors per thread per step; the register copies move a 7168-feature BF16 row
        # as 28 x 16 B per lane ("epilogue": no sends, the L2 GEMM wrote the rows); with more
        # than one round, one 16-byte load of a row's metadata
        sends = 0 if send_mode in ("bulk", "epilogue") else 28
        metadata = 1 if len(rounds) > 1 else 0
        assert art.count("LDG.E.128") == len(rounds) * (8 * 2 + sends + metadata)
        assert art.count("STG.E.128") == len(rounds) * (2 + sends)
        assert art.count("STL") == 0 and art.count("LDL") == 0


@pytest.mark.compile
@pytest.mark.parametrize("kind", ("dispatch", "combine"))
def test_stall_report_is_compiled_in_by_default(kind):
    """The waits time out and report through the pinned record (`reports`): the record's
    system-scope fence and the trap, no printf, no stack (the combine's split-barrier report
    also reads the rank's arrival count)."""
    art = _compile(kind, "sm_90a", "bf16xbf16")
    assert "trap;" in art.ptx and "globaltimer" in art.ptx and "vprintf" not in art.ptx
    if art.sass is not None:
        assert art.resource_usage()["STACK"] == 0 and art.resource_usage()["LOCAL"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_dispatch_combine_one_rank(recipe):
    from cute_megamoe.testing.dispatch_checks import default_cases, run_cases

    assert run_cases(0, 1, default_cases(1), recipe, num_experts=16, num_topk=4, hidden=1024,
                     block_m=64) == 10


@pytest.mark.gpu
def test_dispatch_combine_one_rank_deepseek_shape():
    from cute_megamoe.testing.dispatch_checks import Case, run_cases

    cases = [Case((4096,), "random", 1), Case((17,), "masked", 2), Case((8192,), "skewed", 3)]
    run_cases(0, 1, cases, "fp8xfp4", num_experts=256, num_topk=8, hidden=7168, block_m=128)


def _need_gpus(num_ranks: int) -> None:
    if torch.cuda.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} GPUs, {torch.cuda.device_count()} present")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("recipe", RECIPES)
def test_dispatch_combine_multi_rank(recipe, num_ranks):
    from cute_megamoe.testing.dispatch_checks import run_multiprocess

    _need_gpus(num_ranks)
    run_multiprocess(num_ranks, recipe, num_experts=16, num_topk=4, hidden=1024, block_m=64,
                     port=29511 + 10 * num_ranks + RECIPES.index(recipe))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_dispatch_traps_when_ranks_disagree_on_transfer(monkeypatch):
    """Rank 0 pushes, rank 1 pulls: both kernels trap (each sees the other's push bit in the
    published counts) instead of finishing with rows missing from rank 0's pool."""
    from cute_megamoe.testing.dispatch_checks import run_multiprocess

    _need_gpus(2)
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "15")  # a missed check fails, not hangs
    run_multiprocess(2, "bf16xbf16", num_experts=8, num_topk=2, hidden=256, block_m=64,
                     port=29811, mode="transfer_mismatch")


GEMM_RECIPES = ("fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")  # with Hopper grouped-GEMM kernels
LAYER_PATHS = [(r, "torch") for r in RECIPES] + [(r, "kernels") for r in GEMM_RECIPES]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,experts", LAYER_PATHS)
def test_staged_layer_matches_reference_one_rank(recipe, experts):
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.testing.dispatch_checks import Case, check_staged_layer

    if experts == "kernels" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the grouped-GEMM kernels run on Hopper")
    buf = get_symm_buffer_for_mega_moe(None, 8, 300, 4, 512, 256, mma_type=recipe)
    for block_m in (64, 128) if experts == "kernels" else (64,):
        # (16 and 13 tokens: up to 16 expected per expert, where MXFP4 weights at BLOCK_M 64
        # run the transposed kernels, `heuristics.select_sm90_transposed`)
        for case in (Case((300,), "random", 11), Case((0,), "random", 12),
                     Case((129,), "masked", 13), Case((77,), "one_expert", 14),
                     Case((16,), "random", 15), Case((13,), "masked", 16)):
            check_staged_layer(buf, case, 256, block_m, torch.device("cuda"), experts=experts)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("recipe", RECIPES)
def test_staged_layer_matches_reference_multi_rank(recipe, num_ranks):
    from cute_megamoe.testing.dispatch_checks import run_multiprocess

    _need_gpus(num_ranks)
    run_multiprocess(num_ranks, recipe, num_experts=8, num_topk=4, hidden=512, block_m=64,
                     port=29611 + 10 * num_ranks + RECIPES.index(recipe), mode="layer")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("recipe", GEMM_RECIPES)
def test_layer_on_gemm_kernels_matches_reference_multi_rank(recipe, num_ranks):
    from cute_megamoe.testing.dispatch_checks import run_multiprocess

    _need_gpus(num_ranks)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the grouped-GEMM kernels run on Hopper")
    run_multiprocess(num_ranks, recipe, num_experts=8, num_topk=4, hidden=512, block_m=128,
                     port=29711 + 10 * num_ranks + GEMM_RECIPES.index(recipe),
                     mode="layer_kernels")


@pytest.mark.gpu
def test_ceil_div_small_is_exact_over_its_range():
    """`pool.ceil_div_small` (the dispatch's per-destination BLOCK_M division, without an
    integer-division call) for every n < 2**24 and every BLOCK_M a pool may have."""
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_megamoe.kernels.common.pool import ceil_div_small
    from cute_megamoe.runtime import as_ptr, current_stream

    @cute.kernel
    def kernel(out: cute.Pointer, d: Int32, count: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n = bidx * 256 + tidx
        if n < count:
            cute.arch.store(out + n, ceil_div_small(n, d))

    @cute.jit
    def launch(out: cute.Pointer, d: Int32, count: Int32, stream):
        kernel(out, d, count).launch(grid=[(count + 255) // 256, 1, 1], block=[256, 1, 1],
                                     stream=stream)

    count = 1 << 24
    out = torch.empty(count, dtype=torch.int32, device="cuda")
    n = torch.arange(count, device="cuda", dtype=torch.int64)
    fn = None
    for d in range(16, 513, 16):
        args = (as_ptr(out, align=4), Int32(d), Int32(count), current_stream())
        fn = fn or cute.compile(launch, *args)
        fn(*args)
        want = ((n + d - 1) // d).to(torch.int32)
        assert torch.equal(out, want), f"d = {d}: first wrong n {int((out != want).nonzero()[0])}"
