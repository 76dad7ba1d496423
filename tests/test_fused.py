"""The fused layer kernel (`kernels/sm90_mega_moe.py`, `fused.fused_mega_moe`), issue 17.

CPU: it compiles for sm_90a with tensor cores, TMA, bulk stores and no spills; the two GEMM
phases share one ring as configured; the host model of its tile walk. GPU: bit-exact with the
staged layer (and near the reference) at R = 1 and on a loopback group of 2 ranks on one GPU,
for random, skewed, masked and one-expert routings, empty experts, 0 / 1 tokens, token counts
that are not multiples of BLOCK_M, shapes that are not powers of two; back-to-back calls with
changing token counts; CUDA-graph replays; bad inputs refused before any launch.
"""

import dataclasses

import pytest
import torch

from cute_megamoe.config import LayerConfig, Sm90FusedConfig
from cute_megamoe.layout import BarrierSlots, MegaMoELayout
from cute_megamoe.testing.compile import fused_kernel_for, ptxas_notes_or_skip
from cute_megamoe.testing.fused_checks import EXPERIMENTS, rows_config

RECIPES = ("fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")
# fp8xfp4_sm90 runs only as an experiment (`tables.EXPERIMENTAL_FUSED_RECIPES`): bit-exact on
# the H200 and all of its GPU tests passed on 12-04 once the loopback warm-ups loaded every
# token-dependent kernel, but a one-rank stall seen earlier that day is not explained, and a
# stall traps and takes the CUDA context of every later test in the process with it; so the
# GPU tests run it only when asked (``pytest --fused-fp4``, marker ``fused_fp4``; the compile
# tests always)
STABLE_RECIPES = ("fp8xfp8", "bf16xbf16")
GPU_RECIPES = (*STABLE_RECIPES, pytest.param("fp8xfp4_sm90", marks=pytest.mark.fused_fp4))


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused kernel is sm_90a only")


# ----------------------------------------------------------------------------- CPU

def _kernel(recipe: str, block_m: int, layout=None, tiled_weights: bool = False, **fields):
    """The fused kernel object of ``layout`` (default: two ranks) at ``block_m`` with the
    `Sm90FusedConfig` ``fields`` set, the heuristics' choice for the rest (calls that give
    ``x`` where ``stages_inputs`` is set)."""
    layout = layout or MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe)
    return fused_kernel_for(layout, block_m, Sm90FusedConfig(**fields),
                            given_x=bool(fields.get("stages_inputs")), activation_clamp=10.0,
                            has_stats=True, tiled_weights=tiled_weights)


def _compile(recipe: str, block_m: int, layout=None, tiled_weights: bool = False, **fields):
    from cutlass import Int32

    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    kernel = _kernel(recipe, block_m, layout, tiled_weights, **fields)
    ptrs = [fake_ptr(dtype, 4 if name in (
                "expert_recv_tokens", "stats", "pool_block_ready", "tile_log") else 16)
            for name, dtype in kernel.pointer_args()]
    art = compile_for_arch(kernel, ptrs[0], Int32(0), Int32(0), *ptrs[1:], Int32(132),
                           fake_stream(), arch="sm_90a")
    return kernel, art


def _assert_no_spills_and_async_wgmma(art) -> None:
    """No local memory (spills), and where ptxas runs here no performance note (a serialized
    WGMMA pipeline is one)."""
    assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    assert ptxas_notes_or_skip(art) == []


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("block_m", (64, 128))
def test_compiles_sm90_with_tensor_cores_and_no_spills(recipe, block_m, monkeypatch):
    # waits that never time out: any local-memory store would be a spill
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile(recipe, block_m)
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("HGMMA" if recipe == "bf16xbf16" else "QGMMA") > 0
    assert art.count("UTMALDG") > 0  # A and B of both GEMMs by TMA
    assert art.count("UBLKCP.G.S") > 0  # epilogue rows leave by bulk stores
    # producer down and up, consumers up and down (FP4 weights: the decode warpgroups too)
    fp4 = recipe == "fp8xfp4_sm90"
    assert art.count("USETMAXREG") == (6 if fp4 else 4)
    if fp4:  # the decode: byte permutes, 128-bit shared-memory accesses
        assert art.count("PRMT") >= 64 and art.count("STS.128") >= 8
        assert kernel.packed_stages >= 2 and kernel.num_threads == 512
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    assert kernel.smem_bytes() <= 227 * 1024 - 2048
    assert ptxas_notes_or_skip(art) == []  # the WGMMAs stay asynchronous (checked last: skips
    # where this machine's ptxas cannot read the PTX)


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16"))
def test_in_kernel_staging_compiles_as_the_staging_kernel(recipe, monkeypatch):
    """``stages_inputs``: step 0 adds the staging kernel's loads, conversions and stores (16-byte
    accesses, the e4m3 packs of FP8) to the kernel, no spills, WGMMAs asynchronous."""
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile(recipe, 64, stages_inputs=True)
    assert kernel.stages_inputs and kernel.staging.num_threads == kernel.num_threads
    if art.sass is None:
        pytest.skip("nvdisasm not available")
    plain = _compile(recipe, 64)[1]
    assert art.count("LDG.E.128") - plain.count("LDG.E.128") == 8  # two per vector, 4 vectors
    if recipe == "fp8xfp8":
        pack = "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"
        assert art.count(pack) - plain.count(pack) == 32
    _assert_no_spills_and_async_wgmma(art)


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16"))
@pytest.mark.parametrize("block_m", (64, 128))
def test_local_dispatch_compiles_for_one_rank(recipe, block_m, monkeypatch):
    """``local_dispatch`` (the default for one-rank groups with counted rows that stage their
    own inputs, in buffers of at most `heuristics.LOCAL_MAX_TOKENS` tokens): compiled for
    sm_90a, no spills, WGMMAs asynchronous, as many ring stages as the exchanged dispatch; the
    count exchange is gone (no 64-bit global atomics, half the 16-byte loads: no staged row is
    read back), the quantization stays (FP8: the e4m3 packs). Where it cannot run (two ranks,
    barrier rows, no in-kernel staging, FP4 weights) it is off by default and refused when
    asked for."""
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    one = MegaMoELayout(1, 64, 256, 8, 7168, 2048, recipe)
    kernel, art = _compile(recipe, block_m, layout=one, stages_inputs=True)
    # (larger buffers: off by default, on when asked)
    big = MegaMoELayout(1, 64, 257, 8, 7168, 2048, recipe)
    assert not _kernel(recipe, block_m, big, stages_inputs=True).local_dispatch
    assert _kernel(recipe, block_m, big, stages_inputs=True, local_dispatch=True).local_dispatch
    exchanged, plain = _compile(recipe, block_m, layout=one, stages_inputs=True,
                                local_dispatch=False)
    assert kernel.local_dispatch and not exchanged.local_dispatch
    assert kernel.num_stages == exchanged.num_stages
    for checked in (art, plain):  # the routing check (`kernels/common/routing.py`) in both
        assert checked.ptx.count("red.relaxed.gpu.global.max.s64") == 2
        assert checked.ptx.count("atom.global.exch.b64") == 2
    two = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe)
    fp4 = MegaMoELayout(1, 64, 512, 8, 7168, 2048, "fp8xfp4_sm90")
    for layout, options in ((two, {"stages_inputs": True}),
                            (one, {"row_transfer": "barrier", "stages_inputs": True}),
                            (one, {"stages_inputs": False}), (fp4, {"stages_inputs": True})):
        assert not _kernel(layout.recipe, block_m, layout, **options).local_dispatch, \
            (layout, options)
        with pytest.raises(ValueError, match="local_dispatch"):
            _kernel(layout.recipe, block_m, layout, local_dispatch=True, **options)
    if art.sass is None:
        pytest.skip("nvdisasm not available")
    assert art.count("ATOMG.E.ADD.64") == 0 < plain.count("ATOMG.E.ADD.64")
    assert art.count("LDG.E.128") < plain.count("LDG.E.128")
    if recipe == "fp8xfp8":
        pack = "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"
        assert art.count(pack) == plain.count(pack)
    _assert_no_spills_and_async_wgmma(art)


@pytest.mark.compile
@pytest.mark.parametrize("block_m", (64, 128))
def test_lane_row_stores_compile(block_m):
    """``row_stores="lanes"`` (the fused kernel's default): the L2's row copies into the combine
    buffers become the warp's 16 rows, each copied by the lanes with 16-byte shared loads and
    global stores (16 of each more per consumer thread than ``"bulk"``, the rows' addresses by
    shuffles), one bulk copy site fewer; no spills. The grouped GEMMs keep bulk copies by
    default and refuse lanes where rows go to ``out``."""
    from cute_megamoe.kernels.sm90_expert_gemm import Sm90ExpertGemmKernel
    from cute_megamoe.testing.compile import gemm_kernel_for

    base_kernel, base = _compile("fp8xfp8", block_m, row_stores="bulk")
    kernel, art = _compile("fp8xfp8", block_m)
    assert (base_kernel.l2.row_stores, kernel.l2.row_stores) == ("bulk", "lanes")
    assert kernel.l1.row_stores == "bulk"
    layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, "fp8xfp8")
    assert gemm_kernel_for("sm_90a", "fp8xfp8", "l2", 32, layout.num_pool_rows, 7168, 2048,
                           128, combine_layout=layout)[0].row_stores == "bulk"
    with pytest.raises(ValueError, match="row_stores"):
        Sm90ExpertGemmKernel("l2", "fp8xfp8", 8, 4096, 7168, 2048, kernel.l2.config)
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("STG.E.128") == base.count("STG.E.128") + 16
    assert art.count("LDS.128") == base.count("LDS.128") + 16
    assert art.count("UBLKCP") == base.count("UBLKCP") - 1
    _assert_no_spills_and_async_wgmma(art)


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16"))
def test_early_weights_compile(recipe, monkeypatch):
    """``weights_first`` with counted rows at BLOCK_M 64 (the default there): warp 0 loads its
    first L1 tile's first stages' weights right after the counts (more TMA load sites than
    without them), no prefetches into L2, no spills; not at BLOCK_M 128, with barrier rows,
    without ``weights_first`` or with FP4 weights."""
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile(recipe, 64, row_transfer="counted")
    assert kernel.early_weights
    without, plain = _compile(recipe, 64, row_transfer="counted", weights_first=False)
    assert not without.early_weights
    layout = MegaMoELayout(1, 8, 64, 2, 512, 256, recipe)
    for block_m, options in ((64, dict(row_transfer="barrier", weights_first=True)),
                             (128, dict(row_transfer="counted", weights_first=True))):
        assert not _kernel(recipe, block_m, layout, **options).early_weights
    assert not _kernel("fp8xfp4_sm90", 64, MegaMoELayout(1, 8, 64, 2, 512, 256, "fp8xfp4_sm90"),
                       row_transfer="counted", weights_first=True).early_weights
    if art.sass is None:
        pytest.skip("nvdisasm not available")
    assert art.count("UTMALDG") > plain.count("UTMALDG") and art.count("UTMAPF.L2") == 0
    assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0


@pytest.mark.compile
def test_one_rank_group_synchronizes_at_gpu_scope(monkeypatch):
    """A one-rank group's barriers, flags and count words use GPU scope (`sync.group_scope`):
    no system-scope acquire or release is left, and system-scope fences only in the trap
    reports (pinned host memory); groups of several ranks keep system scope."""
    import re

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")

    def counts(ranks):
        kernel, art = _compile("fp8xfp8", 64,
                               layout=MegaMoELayout(ranks, 64, 512, 8, 7168, 2048, "fp8xfp8"))
        assert kernel.dispatch.scope == kernel.combine.scope == kernel.l1.sync_scope
        return kernel.dispatch.scope, {p: len(re.findall(p, art.ptx)) for p in (
            r"fence\.acq_rel\.sys", r"\.acquire\.sys", r"\.release\.sys", r"fence\.acq_rel\.gpu")}

    one_scope, one = counts(1)
    two_scope, two = counts(2)
    assert (one_scope, two_scope) == ("gpu", "sys")
    assert one[r"\.acquire\.sys"] == one[r"\.release\.sys"] == 0
    assert 0 < one[r"fence\.acq_rel\.sys"] < two[r"fence\.acq_rel\.sys"]
    assert one[r"fence\.acq_rel\.gpu"] > 0 == two[r"fence\.acq_rel\.gpu"]
    assert two[r"\.acquire\.sys"] > 0


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ("fp8xfp8", "fp8xfp4_sm90"))
def test_compiles_with_tiled_weights(recipe, monkeypatch):
    """Weights in TMA-box order (`ExpertWeights.tiled`; MXFP4: an A/B option): both GEMM
    stages load them as 4-D boxes, the pool rows stay 2-D; no spills."""
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile(recipe, 64, tiled_weights=True)
    assert kernel.l1.tiled_weights and kernel.l2.tiled_weights
    assert "cp.async.bulk.tensor.4d" in art.ptx and "cp.async.bulk.tensor.2d" in art.ptx
    if art.sass is not None:
        assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0


@pytest.mark.compile
def test_compiles_with_unrolled_gemm_loops(monkeypatch):
    """The GEMM phases' FP8 consumer loop four k-blocks per body at BLOCK_M 128 (the grouped
    GEMMs' default, `heuristics.DEFAULT_K_UNROLL`; ``k_unroll`` sets another): four k-blocks'
    WGMMAs per phase, no spills; BLOCK_M 64 keeps one; the L1 rows go by row copies (no TMA
    store in the fused kernel)."""
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile("fp8xfp8", 128, tiled_weights=True)
    assert kernel.l1.k_unroll == kernel.l2.k_unroll == 4
    assert not kernel.l1.tma_store and not kernel.l2.tma_store
    if art.sass is not None:
        assert art.count("QGMMA") == 2 * 4 * 8  # (two phases, four k-blocks, eight WGMMAs)
        assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    assert _kernel("fp8xfp8", 128, k_unroll=1).l2.k_unroll == 1
    assert _kernel("fp8xfp8", 64).l1.k_unroll == 1


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ("fp8xfp8", "fp8xfp4_sm90"))
def test_phase_clock_variant_compiles_and_stamps_every_phase(recipe, monkeypatch):
    """The diagnostic build (`bench/fused_phases.py`) reads the global timer once more per
    stamp than the default build (FP4 weights: the packed loads' and the decode's too), each
    phase stamp fenced at system scope, the dispatch's own four not."""
    from cute_megamoe.kernels.sm90_mega_moe import PHASE_STAMPS

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    # (the default row transfer at 512 tokens per rank: counted rows stamp rows_sent and three
    # of the dispatch's four, rows_pushed being the barrier rows'; packed_done, decode_done
    # only with FP4 weights, which keep barrier rows)
    fp4 = recipe == "fp8xfp4_sm90"
    dispatch_stamps = 4 if fp4 else 3
    stamps = len(PHASE_STAMPS) - 4 - (1 if fp4 else 2)
    _, plain = _compile(recipe, 64)
    _, clocked = _compile(recipe, 64, debug="phase_clock")
    # (the spin-waits read the timer too)
    assert clocked.ptx.count("globaltimer") >= (plain.ptx.count("globaltimer") + stamps
                                                + dispatch_stamps)
    fence = "fence.acq_rel.sys"
    assert clocked.ptx.count(fence) == plain.ptx.count(fence) + stamps


@pytest.mark.compile
@pytest.mark.parametrize("block_m", (64, 128))
def test_compiles_with_stall_reports_and_asynchronous_wgmma(block_m):
    """With the default timeout every wait can report which counter stalled, without a
    function call: a printf there made ptxas serialize every WGMMA of the kernel (C7510)."""
    _, art = _compile("fp8xfp8", block_m)
    assert "vprintf" not in art.ptx and "trap;" in art.ptx
    if art.sass is not None:
        assert art.count("CALL") == 0 and art.resource_usage()["LOCAL"] == 0
        # fp8xfp8's default build spills nothing either (bf16xbf16 at BLOCK_M 64 and FP4
        # weights at 128 keep a few values across the producer's 40-register region in local
        # memory)
        assert art.count("STL") == 0 and art.count("LDL") == 0
    assert ptxas_notes_or_skip(art) == []
    if art.sass is None:
        pytest.skip("nvdisasm not available: the SASS checks did not run")


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
def test_stage_waits_are_bounded_without_spills(recipe):
    """The loads wait for their ring stages with time limits and stall reports
    (`Sm90ExpertGemmKernel.bounded_stage_wait`) in every recipe, so a CTA whose consumers stop
    names the stage instead of showing up only as the other CTAs' stall at the combine: two
    waits in each walk and the tail of the ring (at least 5 report sites). The FP4 experiment
    adds its packed loads' and decode warps' waits (three in each walk), the packed ring's tail
    and a watchdog warp over the consumers (`watch_consumers`): at least 13. At BLOCK_M 64
    the reports add no local memory (bf16xbf16: at most ten words of stack)."""
    from cutlass import Int32

    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    fp4 = recipe == "fp8xfp4_sm90"
    arts = {}
    for reports in (True, False):
        kernel = _kernel(recipe, 64)
        assert kernel.l1.stage_reports and kernel.l2.stage_reports
        assert kernel.watchdog == fp4
        kernel.l1.stage_reports = kernel.l2.stage_reports = reports
        kernel.watchdog = reports and fp4
        ptrs = [fake_ptr(dtype, 4 if name in ("expert_recv_tokens", "stats",
                                              "pool_block_ready") else 16)
                for name, dtype in kernel.pointer_args()]
        arts[reports] = compile_for_arch(kernel, ptrs[0], Int32(0), Int32(0), *ptrs[1:],
                                         Int32(132), fake_stream(), arch="sm_90a")
    # (at least: ptxas-bound PTX may carry a site twice where the compiler peeled a loop)
    assert arts[True].ptx.count("trap;") >= arts[False].ptx.count("trap;") + (13 if fp4 else 5)
    if arts[True].sass is None:
        pytest.skip("nvdisasm not available: the spill check did not run")
    usage = {r: a.resource_usage() for r, a in arts.items()}
    assert usage[False]["LOCAL"] == usage[False]["STACK"] == 0 and arts[False].count("STL") == 0
    if recipe == "bf16xbf16":
        # the loads' 40-register region keeps up to ten more words on the stack (bf16's
        # producer carries the most addresses; the buffer's base and the call's tag from the
        # dispatch since its routing check), none in the loop's hot path of the consumers
        assert usage[True]["LOCAL"] == 0 and usage[True]["STACK"] <= 40, usage
    else:
        assert arts[True].count("STL") == 0 and usage[True]["LOCAL"] == 0, usage


def test_the_fused_combine_waits_twice_as_long_as_the_rest():
    """A stalled CTA is seen first at the combine's barriers (they wait behind everything
    else): with twice the time limit there, the stalled wait itself reports."""
    kernel = _kernel("fp8xfp8", 64, MegaMoELayout(2, 8, 64, 2, 512, 256, "fp8xfp8"))
    assert kernel.timeout_ns > 0 and kernel.combine.timeout_ns == 2 * kernel.timeout_ns
    assert kernel.l1.timeout_ns == kernel.dispatch.timeout_ns == kernel.timeout_ns


def test_a_failed_launch_in_the_fused_checks_names_the_reports():
    """`FusedLayer.run`: a kernel that failed earlier surfaces at a later launch; the checks
    then raise with every rank's report, as after a synchronize."""
    from types import SimpleNamespace

    from cute_megamoe.testing.fused_checks import FusedLayer

    buffers = [SimpleNamespace(rank=0, report=lambda: "stalled here"),
               SimpleNamespace(rank=1, report=lambda: None)]

    def failing_run(step):
        raise RuntimeError("CUDA error: unspecified launch failure")

    layer = FusedLayer.__new__(FusedLayer)
    layer.ranks = SimpleNamespace(buffers=buffers, run=failing_run)
    with pytest.raises(AssertionError, match="rank 0: stalled here; rank 1: None"):
        layer.run("fused", {}, {}, {})

    def other_error(step):
        raise ValueError("bad input")

    layer.ranks.run = other_error
    with pytest.raises(ValueError, match="bad input"):
        layer.run("fused", {}, {}, {})


def test_the_two_gemm_phases_share_one_ring():
    from cute_megamoe.kernels.sm90_expert_gemm import share_ring
    from cute_megamoe.testing.compile import gemm_kernel_for

    k = _kernel("fp8xfp8", 128)
    l1, l2 = k.l1, k.l2
    assert l1.num_stages == l2.num_stages >= 2
    assert l1.staging_stride == l2.staging_stride
    assert l1.staging_bytes == l2.staging_bytes >= max(l1.staging_layout(1)[1],
                                                       l2.staging_layout(1)[1])
    assert l1.sfb_stride == l2.sfb_stride == max(l1.sfb_len, l2.sfb_len)
    # one transaction count for the ring: each phase expects exactly its stage's bytes
    for g in (l1, l2):
        assert g.ring_tx_bytes + g.extra_tx_bytes == g.stage_tx_bytes
        assert g.extra_tx_bytes >= 0 and g.wg_skew == 0 and g.cluster_m == 1
    assert l1.signals_ready and not l2.signals_ready
    # L2 waits for one arrival per consumer warp of every L1 n-block of its pool block
    assert l2.waits_ready == (2 * 2048 // 256) * 2 * 4
    # tiles of different widths cannot share a ring (hidden 384: L2 tiles of 128 columns)
    with pytest.raises(ValueError, match="multiples of 256"):
        share_ring(gemm_kernel_for("sm_90a", "fp8xfp8", "l1", 4, 1024, 512, 384, 128)[0],
                   gemm_kernel_for("sm_90a", "fp8xfp8", "l2", 4, 1024, 384, 256, 128)[0])


def test_fused_kernel_rejects_what_it_cannot_run():
    from cute_megamoe.kernels.sm90_mega_moe import Sm90MegaMoEKernel

    with pytest.raises(ValueError, match="recipe"):
        _kernel("fp8xfp4", 128, MegaMoELayout(1, 8, 64, 2, 512, 256, "fp8xfp4"))
    with pytest.raises(ValueError, match="block_m"):
        Sm90FusedConfig(block_m=96)
    with pytest.raises(ValueError, match="fields"):  # (a configuration the heuristics filled)
        Sm90MegaMoEKernel(MegaMoELayout(1, 8, 64, 2, 512, 256, "fp8xfp8"),
                          Sm90FusedConfig(block_m=64))
    with pytest.raises(ValueError, match="row_transfer"):
        Sm90FusedConfig(row_transfer="with_gemm")


@pytest.mark.compile
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
@pytest.mark.parametrize("block_m", (64, 128))
def test_ticket_walk_compiles(recipe, block_m, monkeypatch):
    """``walk="tickets"`` (the dataflow design's lag-ordered L1 / L2 sequence, a CTA's next
    position by one atomic add): compiled for sm_90a with tensor cores, exchanged and local
    dispatch, its ticket counter the pool's spare readiness counter, the tile queue in shared
    memory, the lag of a 132-SM grid; no spills where the waits never time out, WGMMAs
    asynchronous. Refused with FP4 weights and with the tile log."""
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile(recipe, block_m, walk="tickets")
    plain, plain_art = _compile(recipe, block_m)
    assert kernel.tickets and not plain.tickets and plain.config.walk == "phases"
    assert (kernel.sequence.num_n1, kernel.sequence.num_n2) == (16, 28)
    # BLOCK_M 64: one-block bands, lag ceil(2 * 132 / 44); 128: bands of 8 blocks of one
    # expert, lag_grids 16: ceil(16 * 132 / (8 * 44)) bands (`heuristics.FUSED_WALK_BAND`)
    assert (kernel.sequence.band, kernel.sequence.lag) == (1 if block_m == 64 else 8, 6)
    assert _kernel(recipe, block_m, walk="tickets", band=1, lag_grids=4).sequence.lag == 12
    banded = _kernel(recipe, block_m, walk="tickets", band=4).sequence
    assert (banded.band, banded.lag) == (4, 2)  # ceil(2 * 132 / (4 * 44))
    assert kernel.smem_bytes() <= 227 * 1024 - 2048
    # (the early weights: of the first ticket's tile, taken once the prefix sums are in)
    assert kernel.early_weights == (block_m == 64)
    add = "atom.global.add.u32"  # (relaxed, GPU scope: the ticket)
    assert art.ptx.count(add) > plain_art.ptx.count(add)
    with pytest.raises(ValueError, match="walk"):
        _kernel("fp8xfp4_sm90", block_m, MegaMoELayout(2, 64, 512, 8, 7168, 2048,
                                                      "fp8xfp4_sm90"), walk="tickets")
    with pytest.raises(ValueError, match="walk"):
        Sm90FusedConfig(walk="tickets", debug="tile_log")
    with pytest.raises(ValueError, match="walk"):
        Sm90FusedConfig(walk="static")
    with pytest.raises(ValueError, match="lag_grids"):
        Sm90FusedConfig(lag_grids=5)
    for walk in (None, "phases"):  # (the tile clock and the ring are the ticket walk's)
        with pytest.raises(ValueError, match="tile_clock"):
            Sm90FusedConfig(walk=walk, debug="tile_clock")
        with pytest.raises(ValueError, match="l1_ring_rows"):
            Sm90FusedConfig(walk=walk, l1_ring_rows=2048)
    with pytest.raises(ValueError, match="l1_ring_rows"):
        Sm90FusedConfig(walk="tickets", l1_ring_rows=1000)
    assert kernel.ring_blocks == 0 and kernel.config.l1_ring_rows == 0  # (the whole pool)
    # too few slots for the lag: 1024 rows are 8 blocks of 128 or 16 of 64; lag 12 needs 13
    with pytest.raises(ValueError, match="fewer than the 13"):
        _kernel(recipe, 128, walk="tickets", band=1, lag_grids=4, l1_ring_rows=1024)
    assert _kernel(recipe, 64, walk="tickets", lag_grids=4, l1_ring_rows=1024).ring_blocks == 16
    # (each variant in one of the four builds: the suite's time)
    variants = [art]
    if (recipe, block_m) == ("fp8xfp8", 64):
        clocked = _compile(recipe, block_m, walk="tickets", debug="tile_clock")[1]
        assert clocked.ptx.count("globaltimer") >= art.ptx.count("globaltimer") + 2
    if (recipe, block_m) == ("fp8xfp8", 128):
        variants.append(_compile(recipe, block_m, walk="tickets", band=3)[1])
    if (recipe, block_m) == ("fp8xfp8", 64):  # the L1-output ring: L1 waits for its slot,
        # L2 counts its loads (BF16's epilogue reaches its ring rows the same way)
        # (in a buffer laid out for it: the L1 outputs' rows and scale strides, 1024)
        ring_layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe, l1_output_rows=1024)
        ringed, ring_art = _compile(recipe, block_m, layout=ring_layout, walk="tickets",
                                    l1_ring_rows=1024)
        assert (ringed.ring_blocks, ringed.l1.ring_reads) == (16, 16 * 4 + 28)  # (one MMA wg)
        assert ringed.l1.out_rows == ringed.l2.a_rows == 1024
        for op in ("red.", "acquire.gpu"):  # (the L2 tiles' counts; the slot waits)
            assert ring_art.ptx.count(op) > art.ptx.count(op), op
        variants.append(ring_art)
    if recipe == "bf16xbf16":  # the one-rank default: the local dispatch
        one = MegaMoELayout(1, 64, 256, 8, 7168, 2048, recipe)
        local, local_art = _compile(recipe, block_m, layout=one, stages_inputs=True,
                                    walk="tickets")
        assert local.local_dispatch and local.tickets
        variants.append(local_art)
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    for built in variants:
        assert built.count("HGMMA" if recipe == "bf16xbf16" else "QGMMA") > 0
        assert built.count("USETMAXREG") == 4
        _assert_no_spills_and_async_wgmma(built)


@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_a_ring_buffer_takes_the_ticket_walk_with_a_ring_that_fits(recipe):
    """A buffer laid out with an L1-output ring (`MegaMoELayout.l1_output_rows`): the fused
    kernel builds on it only as the ticket walk with an L1-output ring of at most its rows
    (the L1 outputs' row stride becomes the region's), which the defaults choose there; the
    staged kernels refuse it; a whole-pool buffer keeps the pool's stride with a ring too."""
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.staged import check_whole_l1_outputs

    ring = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe, l1_output_rows=1024)
    for fields in ({"walk": "phases"}, {"walk": "tickets", "l1_ring_rows": 0},
                   {"walk": "tickets", "l1_ring_rows": 2048}):
        with pytest.raises(ValueError, match="ring of 1024 rows"):
            _kernel(recipe, 64, ring, **fields)
    assert _kernel(recipe, 64, ring).config.l1_ring_rows == 1024
    kernel = _kernel(recipe, 64, ring, walk="tickets", l1_ring_rows=1024)
    p = ring.num_pool_rows
    assert (kernel.l1.a_rows, kernel.l1.out_rows, kernel.l2.a_rows, kernel.l2.out_rows) == (
        p, 1024, 1024, p)
    whole = _kernel(recipe, 64, walk="tickets", l1_ring_rows=1024)
    assert whole.l1.out_rows == whole.l2.a_rows == p
    buf = get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 256, mma_type=recipe,
                                       device="cpu", l1_output_rows=256)
    assert buf.l2_acts.shape == (256, 256)
    with pytest.raises(ValueError, match="L1-output row per pool row"):
        check_whole_l1_outputs(buf)
    check_whole_l1_outputs(get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 256,
                                                        mma_type=recipe, device="cpu"))


def test_host_model_of_the_fused_walk():
    """Every L1 and L2 tile exactly once over the grid, L1 before L2 on every CTA, and the
    index carries from L1 into L2."""
    from cute_megamoe.scheduler import fused_tile_walk, grouped_gemm_tiles

    counts = [3, 0, 130, 64, 1]
    walks = [fused_tile_walk(counts, 64, 256, 512, 256, 768, 5, c, (2, 1)) for c in range(5)]
    l1 = grouped_gemm_tiles(counts, 64, 256, 512, 2)
    l2 = grouped_gemm_tiles(counts, 64, 256, 768, 1)
    seen = sorted((p, t.pool_block, t.n_block) for w in walks for p, t in w)
    assert seen == sorted([("l1", t.pool_block, t.n_block) for t in l1]
                          + [("l2", t.pool_block, t.n_block) for t in l2])
    for w in walks:
        phases = [p for p, _ in w]
        assert phases == sorted(phases)  # "l1" < "l2"
    # CTA c's first L2 tile is position (first index past L1) - len(L1) of the L2 walk
    for c, w in enumerate(walks):
        first = next(((i, t) for i, (p, t) in enumerate(w) if p == "l2"), None)
        if first is not None:
            i, t = first
            assert t == l2[c + 5 * i - len(l1)]


def test_the_watchdogs_tile_counts_follow_the_fused_walk():
    """`walk_lengths` (the watchdog's k-block total) counts each CTA's L1 and L2 tiles as
    the host model of the walk lays them out."""
    from cute_megamoe.kernels.sm90_mega_moe import walk_lengths
    from cute_megamoe.scheduler import fused_tile_walk, grouped_gemm_tiles

    for counts in ([3, 0, 130, 64, 1], [1, 0, 0, 0], [0, 0], [200] * 6):
        l1 = len(grouped_gemm_tiles(counts, 64, 256, 512, 2))
        l2 = len(grouped_gemm_tiles(counts, 64, 256, 768, 1))
        for grid in (1, 3, 5, 66, 132):
            for c in range(grid):
                walk = fused_tile_walk(counts, 64, 256, 512, 256, 768, grid, c, (2, 1))
                phases = [p for p, _ in walk]
                assert walk_lengths(l1, l2, c, grid) == (phases.count("l1"),
                                                         phases.count("l2")), (counts, grid, c)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_consumers_that_start_late_still_get_their_registers(recipe, monkeypatch):
    """The register handover (`sm90_mega_moe.REGS_TAKEN_BARRIER`): in the "late_consumers"
    test build the GEMM consumers of odd CTAs start 200 us late, so the loads' warpgroup of a
    CTA with no tiles is done long before they take their registers, and must not take the
    combine's back first (before the handover such a CTA's consumers waited in setmaxnreg
    forever: the one-rank stall at 0 tokens under load, docs/notes/register-handover.md).
    Bit-identical to the staged layer at 0, 1 and 200 tokens, both BLOCK_Ms (every fused
    recipe: FP4 weights' decode warpgroups hand over too)."""
    _gpu()
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "10")
    from cute_megamoe import staged
    from cute_megamoe.config import Sm90FusedConfig
    from cute_megamoe.heuristics import default_fused_config
    from cute_megamoe.launch import buffer_state, fused_call
    from cute_megamoe.testing.fused_checks import FusedLayer

    layer = FusedLayer(_one_rank(recipe, 16, 200, 4, 512, 256))
    (buf,) = layer.ranks.buffers
    for n in (0, 1, 200):
        for block_m in (64, 128):
            _, _, _, inputs = layer.inputs((n,), "random", seed=n + block_m)
            x, idx, w = inputs[0]
            want = staged.staged_mega_moe(buf, x, idx, w, layer.weights[0],
                                          activation_clamp=10.0, block_m=block_m,
                                          validate_routing=False)
            y = torch.full_like(want, float("nan"))
            config = default_fused_config(buf.layout, block_m, True, Sm90FusedConfig(
                stages_inputs=True, debug="late_consumers"))
            fused_call(buf, layer.fused_weights[0], n, y, buffer_state(buf).num_sms, None, 10.0,
                       True, config, inputs=(x, idx, w))()
            layer.synchronize(f"{n} tokens, block_m {block_m}")
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (n, block_m)


def _one_rank(recipe, num_experts, max_tokens, topk, hidden, inter):
    from cute_megamoe.testing.protocol_checks import Ranks

    return Ranks.loopback(1, num_experts, max_tokens, topk, hidden, inter, recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_fused_matches_staged_one_rank(recipe, monkeypatch):
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer

    layer = FusedLayer(_one_rank(recipe, 16, 300, 4, 512, 256))
    layer.warm_up((64, 128))
    cases = [(100, "random"), (300, "one_expert"), (129, "masked"), (77, "skewed"),
             (0, "random"), (1, "random"), (1, "masked"), (3, "skewed")]
    for i, (n, routing) in enumerate(cases):
        for block_m in (64, 128):
            layer.check_call((n,), routing, {0: block_m}, seed=i)


@pytest.mark.gpu
def test_fused_one_k_block_loops_match_staged():
    """The fused kernel with its GEMM phases' FP8 loop one k-block per body (``k_unroll`` 1;
    the default at BLOCK_M 128 is four, which the other tests run) against the staged layer
    (configured alike), BLOCK_M 128, uneven routings."""
    _gpu()
    from cute_megamoe.config import Sm90GemmConfig
    from cute_megamoe.testing.fused_checks import FusedLayer

    config = dataclasses.replace(EXPERIMENTS, gemm=Sm90GemmConfig(k_unroll=1),
                                 fused_kernel=Sm90FusedConfig(k_unroll=1))
    layer = FusedLayer(_one_rank("fp8xfp8", 16, 300, 4, 512, 256), configs={0: config})
    layer.warm_up((128,))
    for i, (n, routing) in enumerate([(300, "one_expert"), (129, "masked"), (77, "skewed"),
                                      (0, "random"), (1, "random")]):
        layer.check_call((n,), routing, {0: 128}, seed=40 + i)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_lane_row_stores_match_staged(recipe):
    """``row_stores="lanes"`` (the L2 rows into the combine buffers by the warps' 16-byte
    stores, not bulk copies; the fused kernel's default): the fused kernel against the staged
    layer at R = 1 (uneven routings, both BLOCK_Ms) and on a two-rank loopback group, where the
    staged layer's L2 writes the combine buffers the same way (different token counts and
    BLOCK_M per rank, 0 tokens on a rank, back-to-back calls)."""
    _gpu()
    from cute_megamoe.config import Sm90GemmConfig
    from cute_megamoe.testing.fused_checks import FusedLayer, check_fused_calls
    from cute_megamoe.testing.protocol_checks import Ranks

    lanes = dataclasses.replace(EXPERIMENTS, gemm=Sm90GemmConfig(row_stores="lanes"),
                                fused_kernel=Sm90FusedConfig(row_stores="lanes"))
    layer = FusedLayer(_one_rank(recipe, 16, 300, 4, 512, 256), configs={0: lanes})
    layer.warm_up((64, 128))
    for i, (n, routing) in enumerate([(300, "one_expert"), (129, "masked"), (77, "skewed"),
                                      (0, "random"), (1, "random")]):
        for block_m in (64, 128):
            layer.check_call((n,), routing, {0: block_m}, seed=60 + i)
    layer = FusedLayer(Ranks.loopback(2, 16, 200, 4, 512, 256, recipe),
                       configs={0: lanes, 1: lanes})
    layer.warm_up((64, 128))
    layer.check_call((200, 0), "random", {0: 128, 1: 64}, seed=66)
    check_fused_calls(layer, 12, 200, seed=67)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_one_rank_local_dispatch_matches_staged(recipe):
    """The one-rank local dispatch (the default at R = 1 with counted rows and in-kernel
    staging: every CTA counts all pairs itself and quantizes its own pairs' rows into the
    pool) against the staged layer, bit for bit, with the same stats: CTA shares of more pairs
    than threads (grids of 1-3 CTAs: several batches per CTA; 9: a token's pairs split between
    CTAs), 0 / 1 tokens, masked slots, one expert taking every token, both BLOCK_Ms; calls
    alternating with the exchanged dispatch (``local_dispatch=False``), which every call must
    find with its
    readiness and arrival counters at 0 (checked after each call). Which path ran shows in
    the buffer's ``x``: the local one leaves it as it was (poisoned here)."""
    _gpu()
    from cute_megamoe import fused, staged
    from cute_megamoe.testing.fused_checks import FusedLayer

    layer = FusedLayer(_one_rank(recipe, 16, 300, 4, 512, 256))
    (buf,) = layer.ranks.buffers
    e_l = buf.layout.num_local_experts
    stats = {k: torch.zeros(e_l, dtype=torch.int32, device=buf.device) for k in "fs"}
    cases = [(300, "one_expert", 64, 1, "1"), (300, "random", 128, 3, "0"),
             (77, "masked", 64, None, "1"), (1, "random", 128, 2, "1"),
             (0, "random", 64, None, "1"), (300, "skewed", 64, 2, "1"),
             (129, "masked", 128, None, "0"), (300, "random", 128, None, "1"),
             (5, "one_expert", 64, 3, "1"), (1, "masked", 64, None, "0"),
             # 134 pairs per CTA: a token's pairs split between two CTAs
             (300, "skewed", 128, 9, "1")]
    for i, (n, routing, block_m, num_sms, local) in enumerate(cases):
        config = LayerConfig(fused_kernel=Sm90FusedConfig(local_dispatch=local == "1"))
        _, _, _, inputs = layer.inputs((n,), routing, seed=200 + i)
        x, idx, w = inputs[0]
        want = staged.staged_mega_moe(buf, x, idx, w, layer.weights[0], activation_clamp=10.0,
                                      block_m=block_m, validate_routing=False,
                                      cumulative_local_expert_recv_stats=stats["s"])
        buf.x[:n].view(torch.uint8).fill_(0xFF)
        y = torch.full_like(want, float("nan"))
        fused.fused_mega_moe(buf, x, idx, w, layer.fused_weights[0], y=y,
                             activation_clamp=10.0, block_m=block_m, num_sms=num_sms,
                             validate_routing=False,
                             cumulative_local_expert_recv_stats=stats["f"], config=config)
        torch.cuda.synchronize()
        what = (n, routing, block_m, num_sms, local)
        assert not bool(y.isnan().any()), what
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), what
        assert torch.equal(stats["f"], stats["s"]), what
        untouched = bool((buf.x[:n].view(torch.uint8) == 0xFF).all())
        assert untouched == (local == "1" or n == 0), what
        assert int(buf.pool_block_arrivals.count_nonzero()) == 0, what
        assert int(buf.pool_block_ready.count_nonzero()) == 0, what


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_fused_on_tiled_weights_matches_staged(recipe, monkeypatch):
    """The fused kernel on the weights in TMA-box order (`ExpertWeights.tiled_copy`: the
    default for fp8xfp8 / bf16xbf16, an A/B option for MXFP4) against the staged layer on
    the constructors' weights: bit-exact, both BLOCK_Ms, 0 / 1 tokens, masked."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer

    layer = FusedLayer(_one_rank(recipe, 16, 300, 4, 512, 256), fused_tiled=True)
    layer.warm_up((64, 128))
    for i, (n, routing) in enumerate([(300, "random"), (129, "masked"), (0, "random"),
                                      (1, "random"), (300, "one_expert")]):
        for block_m in (64, 128):
            layer.check_call((n,), routing, {0: block_m}, seed=50 + i)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_fused_matches_staged_uneven_shape(recipe, monkeypatch):
    """Not powers of two: hidden 2560, intermediate 1536, 40 experts, top-5."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer

    layer = FusedLayer(_one_rank(recipe, 40, 200, 5, 2560, 1536))
    layer.warm_up((64, 128))
    for i, (n, routing) in enumerate([(200, "random"), (37, "masked"), (200, "one_expert")]):
        layer.check_call((n,), routing, {0: 64 if i % 2 else 128}, seed=100 + i)


def _check_pair(pair, max_tokens: int) -> None:
    """A two-rank loopback layer against the staged layer: warmed up at both BLOCK_Ms, all of
    one rank's tokens with 0 on the other (different BLOCK_Ms), 1 token against one expert
    taking everything, then 20 back-to-back random calls."""
    from cute_megamoe.testing.fused_checks import check_fused_calls

    pair.warm_up((64, 128))
    pair.check_call((max_tokens, 0), "random", {0: 128, 1: 64}, seed=1)
    pair.check_call((1, max_tokens - 12), "one_expert", {0: 64, 1: 128}, seed=2)
    check_fused_calls(pair, 20, max_tokens, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_ticket_walk_matches_staged(recipe):
    """``walk="tickets"`` against the staged layer, bit for bit: at R = 1 with routings that
    leave experts empty, mask slots, skew or give one expert everything, 0 and 1 tokens, both
    BLOCK_Ms, and blocks past the lag (H 1024, I 512: 4 + 4 n-blocks, lag 33 blocks; 2048
    tokens x 4 are 128+ blocks of 64 rows), so L2 tiles run between later blocks' L1 tiles;
    again in bands of 3 blocks with a longer lag, and with an L1-output ring the pool wraps;
    then a two-rank loopback group with different BLOCK_M and token counts per rank, 0 tokens
    on a rank, barrier rows, one rank walking in phases, and back-to-back calls."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.protocol_checks import Ranks

    tickets = dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(walk="tickets"))
    layer = FusedLayer(_one_rank(recipe, 16, 2048, 4, 1024, 512), configs={0: tickets})
    layer.warm_up((64, 128))
    cases = [(2048, "random"), (2048, "skewed"), (1500, "one_expert"), (777, "masked"),
             (0, "random"), (1, "random"), (3, "masked")]
    for i, (n, routing) in enumerate(cases):
        for block_m in (64, 128):
            layer.check_call((n,), routing, {0: block_m}, seed=200 + i)
    # bands of 3 pool blocks (the last one padded), a longer lag
    banded = dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(
        walk="tickets", band=3, lag_grids=4))
    layer.configs = {0: banded}
    layer.warm_up((64, 128))
    for i, (n, routing) in enumerate(cases[:5]):
        layer.check_call((n,), routing, {0: 64 if i % 2 else 128}, seed=300 + i)
    # an L1-output ring of 4096 rows, 64 / 32 slots at BLOCK_M 64 / 128 (lag 17 blocks at
    # lag_grids 1 needs 18): 2048 tokens x 4 wrap it twice, each L1 tile past the first
    # round waiting for the L2 tiles of its slot's previous block
    layer.configs = {0: dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(
        walk="tickets", lag_grids=1, l1_ring_rows=4096))}
    layer.warm_up((64, 128))
    for i, (n, routing) in enumerate(cases[:5]):
        for block_m in (64, 128):
            layer.check_call((n,), routing, {0: block_m}, seed=400 + i)
    barrier = dataclasses.replace(
        EXPERIMENTS, fused_kernel=Sm90FusedConfig(walk="tickets", row_transfer="barrier"))
    # (the walk is a rank's own: one rank may take tickets while the other walks in phases)
    for configs in ({0: tickets, 1: tickets}, {0: barrier, 1: barrier},
                    {0: tickets, 1: EXPERIMENTS}):
        _check_pair(FusedLayer(Ranks.loopback(2, 16, 512, 4, 1024, 512, recipe),
                               configs=configs), 512)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_ring_buffer_matches_staged(recipe):
    """A one-rank buffer laid out with an L1-output ring of 4096 rows (`l1_output_rows`, a
    third of its 12288-row pool) under the ticket walk with that ring, bit for bit against the
    staged layer on a whole-pool buffer: 2048 tokens x 4 wrap the ring twice at BLOCK_M 64;
    0 / 1 tokens, masked slots, one expert taking everything; outputs poisoned first. The
    staged layer refuses the ring buffer before any launch, and the next fused call on it is
    still exact."""
    _gpu()
    from cute_megamoe import fused, staged
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.expert_gemm import ExpertWeights
    from cute_megamoe.testing.ranks import make_call

    e, t, k, h, inter = 16, 2048, 4, 1024, 512
    ring = get_symm_buffer_for_mega_moe(None, e, t, k, h, inter, mma_type=recipe,
                                        l1_output_rows=4096)
    whole = get_symm_buffer_for_mega_moe(None, e, t, k, h, inter, mma_type=recipe)
    assert ring.layout.num_l1_output_rows == 4096 < ring.layout.num_pool_rows == 12288
    gen = torch.Generator().manual_seed(9)
    w1 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(torch.bfloat16).cuda()
    weights = ExpertWeights.from_bf16(w1, w2, recipe)
    config = dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(
        walk="tickets", lag_grids=1, l1_ring_rows=4096))

    def check(n, routing, block_m, seed):
        xs, idxs, ws = make_call(ring.layout, (n,), routing, seed)
        x, idx, w = xs[0].cuda(), idxs[0].cuda(), ws[0].cuda()
        ys = [torch.full((n, h), float("nan"), dtype=torch.bfloat16, device="cuda")
              for _ in range(2)]
        fused.fused_mega_moe(ring, x, idx, w, weights, y=ys[0], activation_clamp=10.0,
                             block_m=block_m, validate_routing=False, config=config)
        staged.staged_mega_moe(whole, x, idx, w, weights, y=ys[1], activation_clamp=10.0,
                               block_m=block_m, validate_routing=False)
        torch.cuda.synchronize()
        assert not ys[0].isnan().any() and torch.equal(ys[0].view(torch.int16),
                                                       ys[1].view(torch.int16)), (
            n, routing, block_m)
        return x, idx, w

    for i, (n, routing) in enumerate([(2048, "random"), (2048, "one_expert"), (777, "masked"),
                                      (0, "random"), (1, "random")]):
        for block_m in (64, 128):
            x, idx, w = check(n, routing, block_m, 500 + i)
    with pytest.raises(ValueError, match="L1-output row per pool row"):
        staged.staged_mega_moe(ring, x, idx, w, weights, activation_clamp=10.0,
                               validate_routing=False)
    check(2048, "random", 64, 600)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_pulled_rows_match_staged(recipe):
    """"pulled" rows (the ticket walk's pullers) on buffers whose received rows are a ring of
    2048 rows and L1 outputs a ring of 4096 (`received_rows`, `l1_output_rows`; 32 / 16 row
    slots at BLOCK_M 64 / 128), bit for bit against the staged layer on whole-pool buffers of
    the same group: R = 1 with 2048 tokens x 4 (the row ring wraps four times and more),
    skewed, masked, one expert taking everything, 0 and 1 tokens, both BLOCK_Ms; then an R = 2
    loopback group with different BLOCK_M and token counts per rank, 0 tokens on a rank and
    20 back-to-back calls; outputs poisoned first, every row checked."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.ranks import Ranks

    rings = dict(received_rows=2048, l1_output_rows=4096)
    pulled = dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(
        row_transfer="pulled", lag_grids=1))
    one = FusedLayer(Ranks.loopback(1, 16, 2048, 4, 1024, 512, recipe, **rings),
                     configs={0: pulled},
                     staged_ranks=Ranks.loopback(1, 16, 2048, 4, 1024, 512, recipe))
    assert one.ranks.layout.num_received_rows == 2048 < one.ranks.layout.num_pool_rows
    one.warm_up((64, 128))
    cases = [(2048, "random"), (2048, "skewed"), (1500, "one_expert"), (777, "masked"),
             (0, "random"), (1, "random")]
    for i, (n, routing) in enumerate(cases):
        for block_m in (64, 128):
            one.check_call((n,), routing, {0: block_m}, seed=700 + i)
    _check_pair(FusedLayer(Ranks.loopback(2, 16, 1024, 4, 1024, 512, recipe, **rings),
                           configs={0: pulled, 1: pulled},
                           staged_ranks=Ranks.loopback(2, 16, 1024, 4, 1024, 512, recipe)),
                1024)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_token_combine_matches_staged(recipe):
    """``combine="tokens"`` (each token reduced once its own rows are in) against the staged
    layer, bit for bit: at R = 1 (H 1024, I 512, 2048 tokens x 4: L2 tiles between later
    blocks' L1 tiles, tokens signalled while others still run) with random, skewed, masked and
    one-expert routings, 0, 1 and 3 tokens, both BLOCK_Ms; with pulled rows into a received-rows
    ring and an L1-output ring; then R = 2 loopback groups (counted, barrier and pulled rows)
    with different BLOCK_M and token counts per rank, 0 tokens on a rank, and 20 back-to-back
    calls (the next call's counts, zeroing and restaged inputs while a peer may still
    reduce); outputs poisoned first, every row checked."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.protocol_checks import Ranks

    def config(**fields):
        return dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(
            combine="tokens", **fields))

    tokens, barrier = config(), config(row_transfer="barrier")
    pulled = config(row_transfer="pulled", lag_grids=1)
    rings = dict(received_rows=2048, l1_output_rows=4096)
    cases = [(2048, "random"), (2048, "skewed"), (1500, "one_expert"), (777, "masked"),
             (0, "random"), (1, "random"), (3, "masked")]
    layer = FusedLayer(_one_rank(recipe, 16, 2048, 4, 1024, 512), configs={0: tokens})
    layer.warm_up((64, 128))
    for i, (n, routing) in enumerate(cases):
        for block_m in (64, 128):
            layer.check_call((n,), routing, {0: block_m}, seed=800 + i)
    one = FusedLayer(Ranks.loopback(1, 16, 2048, 4, 1024, 512, recipe, **rings),
                     configs={0: pulled},
                     staged_ranks=Ranks.loopback(1, 16, 2048, 4, 1024, 512, recipe))
    one.warm_up((64, 128))
    for i, (n, routing) in enumerate(cases):
        for block_m in (64, 128):
            one.check_call((n,), routing, {0: block_m}, seed=900 + i)
    for configs, ringed in (({0: tokens, 1: tokens}, False), ({0: barrier, 1: barrier}, False),
                            ({0: pulled, 1: pulled}, True)):
        _check_pair(FusedLayer(Ranks.loopback(2, 16, 512, 4, 1024, 512, recipe,
                                              **(rings if ringed else {})), configs=configs,
                               staged_ranks=Ranks.loopback(2, 16, 512, 4, 1024, 512, recipe)
                               if ringed else None), 512)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,band", [(64, 1), (128, 1), (64, 3)])
def test_ticket_walk_takes_every_position_once(block_m, band):
    """One ticket-walk call with its tile clock (``debug="tile_clock"``, R = 1, counted rows,
    H 1024, I 512: 4 + 4 n-blocks, 2048 tokens x 4): every L1 and L2 tile of every pool block
    recorded exactly once over the grid, each ending after it started, and each L2 tile
    ending after every L1 tile of its block (its loads waited for their signal); with bands
    of 3 blocks of one expert, warp 0 skipping the bands' padding."""
    _gpu()
    from bench.common import random_expert_weights
    from cute_megamoe import api
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.heuristics import default_fused_config
    from cute_megamoe.kernels.sm90_mega_moe import TILE_CLOCK_TILES
    from cute_megamoe.launch import buffer_state, fused_call
    from cute_megamoe.testing.dispatch_checks import make_routing
    from cute_megamoe.utils import ceil_div

    e, n, k, h, inter = 16, 2048, 4, 1024, 512
    gen = torch.Generator().manual_seed(7)
    weights = random_expert_weights(e, h, inter, "fp8xfp8")
    buf = get_symm_buffer_for_mega_moe(None, e, n, k, h, inter, mma_type="fp8xfp8")
    idx, w = make_routing(n, e, k, "skewed", gen)
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16).cuda()
    api.stage_inputs(buf, x, idx.cuda(), w.cuda(), validate_routing=False)
    grid = buffer_state(buf).num_sms
    config = default_fused_config(buf.layout, block_m, False,
                                  Sm90FusedConfig(walk="tickets", debug="tile_clock",
                                                  row_transfer="counted", band=band))
    y = torch.empty(n, h, dtype=torch.bfloat16, device="cuda")
    clock = torch.zeros(grid, TILE_CLOCK_TILES, 4, dtype=torch.int32, device="cuda")
    fused_call(buf, weights, n, y, grid, None, 10.0, True, config, debug=clock)()
    torch.cuda.synchronize()
    counts = torch.bincount(idx[idx >= 0].flatten(), minlength=e).tolist()
    blocks = sum(ceil_div(c, block_m) for c in counts)
    n1, n2 = 2 * inter // 256, h // 256
    entries = [tuple(row) for rows in clock.cpu().tolist() for row in rows if row[0]]
    seen = sorted((code >> 24, block, code & 0xFFFFFF) for code, block, _, _ in entries)
    assert seen == sorted([(1, b, j) for b in range(blocks) for j in range(n1)]
                          + [(2, b, j) for b in range(blocks) for j in range(n2)])
    ref = entries[0][2]

    def rel(t):
        return ((t - ref + 2**31) % 2**32) - 2**31

    l1_end = {}
    for code, block, t0, t1 in entries:
        assert rel(t1) >= rel(t0)
        if code >> 24 == 1:
            l1_end[block] = max(l1_end.get(block, -2**31), rel(t1))
    for code, block, _, t1 in entries:
        if code >> 24 == 2:
            assert rel(t1) > l1_end[block], block
    buf.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_fused_two_ranks_on_one_gpu(recipe):
    """A loopback group (both ranks' buffers on one GPU, each on its own stream with half the
    SMs): different token counts and BLOCK_M per rank, 0 tokens on a rank."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer, check_fused_calls
    from cute_megamoe.testing.protocol_checks import Ranks

    layer = FusedLayer(Ranks.loopback(2, 16, 200, 4, 512, 256, recipe))
    layer.warm_up((64, 128))
    layer.check_call((200, 0), "random", {0: 128, 1: 64}, seed=1)
    layer.check_call((1, 130), "one_expert", {0: 64, 1: 128}, seed=2)
    check_fused_calls(layer, 40, 200, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_fused_kernel_stages_its_inputs_itself(recipe):
    """``stages_inputs`` (one launch per call; the default): the buffer holds what the staging
    kernel writes (activations, scales, routing, bit for bit) and `y` equals the staged
    layer's, at R = 1 (0, 1, uneven and full token counts, both BLOCK_Ms, both row protocols),
    on a two-rank loopback group (back-to-back calls) and in CUDA-graph replays."""
    _gpu()
    from cute_megamoe import fused, staged
    from cute_megamoe.testing.fused_checks import FusedLayer, check_fused_calls, check_fused_graph
    from cute_megamoe.testing.protocol_checks import Ranks

    # (the local dispatch at R = 1 with counted rows: asked for, since the buffer holds more
    # than LOCAL_MAX_TOKENS tokens; the two-rank group and barrier rows cannot run it)
    local = dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(
        stages_inputs=True, local_dispatch=True))
    barrier = dataclasses.replace(EXPERIMENTS, fused_kernel=Sm90FusedConfig(
        stages_inputs=True, row_transfer="barrier"))
    layer = FusedLayer(_one_rank(recipe, 16, 300, 4, 512, 256), configs={0: local})
    (buf,) = layer.ranks.buffers
    regions = ("x", "x_sf", "topk_idx", "topk_weights") if recipe == "fp8xfp8" else \
        ("x", "topk_idx", "topk_weights")
    # (rows None / "counted" at R = 1: the local dispatch, which quantizes the rows straight
    # into the pool and leaves the buffer's x alone; "barrier": the staged rows)
    for n, block_m, rows in ((300, 128, None), (77, 64, None), (1, 64, None), (0, 64, None),
                             (300, 64, "barrier"), (129, 128, "counted")):
        _, _, _, inputs = layer.inputs((n,), "skewed", seed=n + block_m)
        x, idx, w = inputs[0]
        want = staged.staged_mega_moe(buf, x, idx, w, layer.weights[0], activation_clamp=10.0,
                                      block_m=block_m, validate_routing=False)
        staged_bytes = {r: getattr(buf, r)[:n].clone() for r in regions}
        for r in regions:  # poison what the fused kernel must write
            getattr(buf, r)[:n].view(torch.uint8).fill_(0xFF)
        y = torch.full_like(want, float("nan"))
        fused.fused_mega_moe(buf, x, idx, w, layer.weights[0], y=y, activation_clamp=10.0,
                             block_m=block_m, validate_routing=False,
                             config=barrier if rows == "barrier" else local)
        torch.cuda.synchronize()
        local_path = rows != "barrier"
        for r in regions:
            got = getattr(buf, r)[:n].view(torch.uint8)
            if local_path and r in ("x", "x_sf"):
                assert bool((got == 0xFF).all()), (r, n, block_m, "written by the local path")
            else:
                assert torch.equal(got, staged_bytes[r].view(torch.uint8)), (r, n, block_m)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (n, block_m, rows)
    check_fused_graph(layer, 100, 50, seed=7)
    two = FusedLayer(Ranks.loopback(2, 16, 200, 4, 512, 256, recipe))
    two.warm_up((64, 128))
    two.check_call((200, 0), "random", {0: 128, 1: 64}, seed=31)
    check_fused_calls(two, 20, 200, seed=32)


# (None: the default row transfer at this capacity, counted rows with the early weights;
# "barrier" the default of larger buffers)
ROWS_500 = (None, "barrier")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS_500)
def test_fused_500_back_to_back_calls(rows):
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer, check_fused_calls

    layer = FusedLayer(_one_rank("fp8xfp8", 16, 256, 4, 512, 256),
                       configs={0: rows_config(rows)})
    layer.warm_up((64, 128))
    check_fused_calls(layer, 500, 256, seed=5, reference_every=50)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS_500)
def test_fused_500_graph_replays(rows):
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer, check_fused_graph

    layer = FusedLayer(_one_rank("fp8xfp8", 16, 256, 4, 512, 256),
                       configs={0: rows_config(rows)})
    layer.warm_up((64, 128))
    check_fused_graph(layer, 100, 500, seed=6)


@pytest.mark.gpu
def test_fused_refuses_bad_input_before_launch():
    _gpu()
    from cute_megamoe import fused
    from cute_megamoe.testing.fused_checks import FusedLayer

    layer = FusedLayer(_one_rank("fp8xfp8", 16, 64, 4, 512, 256))
    (buf,) = layer.ranks.buffers
    w = layer.weights[0]
    x = torch.randn(8, 512, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(16)[:4] for _ in range(8)]).cuda()  # distinct per token
    tw = torch.rand(8, 4, device="cuda")
    bad = [
        (dict(x=x.float()), "x"),
        (dict(idx=idx.to(torch.int32)), "topk_idx"),
        (dict(block_m=96), "block_m"),
        (dict(num_sms=10**6), "num_sms"),
        (dict(y=torch.empty(8, 256, dtype=torch.bfloat16, device="cuda")), "y"),
        (dict(idx=idx + 16), "topk_idx"),  # out of range
    ]
    for change, what in bad:
        args = dict(x=x, idx=idx, tw=tw)
        kwargs = {k: v for k, v in change.items() if k not in args}
        args.update({k: v for k, v in change.items() if k in args})
        tag = int(buf.barrier[BarrierSlots.CALL_TAG])
        with pytest.raises((TypeError, ValueError), match=what):
            fused.fused_mega_moe(buf, args["x"], args["idx"], args["tw"], w,
                                 validate_routing="host", **kwargs)
        # the call was given up (counted), nothing launched
        assert int(buf.barrier[BarrierSlots.CALL_TAG]) == tag + 1, what


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fused", "staged"])
@pytest.mark.parametrize("tokens", [(77,), (77, 2)])
def test_bad_routing_is_masked_recorded_and_raised_later(kind, tokens):
    """The dispatch's routing check on the GPU (issue 64): out-of-range, negative and repeated
    experts are masked (y bit-identical to the masked routing's), recorded (first token, slot
    and value, and the count) and raised after a later call's launch or by
    `check_routing_errors`; the next clean calls are exact. One rank (the fused kernel's local
    dispatch) and a two-rank loopback group (its exchanged dispatch; rank 1 with 2 tokens
    and no bad slot)."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer, check_bad_routing
    from cute_megamoe.testing.ranks import Ranks

    layer = FusedLayer(Ranks.loopback(len(tokens), 16, 200, 4, 512, 256, "fp8xfp8"))
    if len(tokens) > 1:
        layer.warm_up((64,))  # (a loopback group's kernels load before their first call)
    check_bad_routing(layer, kind, tokens, 64, seed=70)


def test_module_refuses_fused_where_it_cannot_run():
    import cute_megamoe as cm

    w1 = torch.randn(8, 512, 512).to(torch.bfloat16)
    w2 = torch.randn(8, 512, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fused"):
        cm.MegaMoE(None, 8, 64, 2, 512, 256, "fp8xfp8", w1, w2, device="cpu", fused=True)
    with pytest.raises(ValueError, match="fused"):
        cm.MegaMoE(None, 8, 64, 2, 512, 256, "fp8xfp8", w1, w2, device="cpu", fused=True,
                   transfer="pull")
    with pytest.raises(TypeError, match="fused"):
        cm.MegaMoE(None, 8, 64, 2, 512, 256, "fp8xfp8", w1, w2, device="cpu", fused=1)


def _choose_case(monkeypatch, num_ranks=1, recipe="fp8xfp8", arch="sm_90a", reason=None,
                 env=None, max_tokens=4096):
    """A stand-in buffer and weights for `fused.choose`, with `supports` answering
    ``reason``."""
    from types import SimpleNamespace

    from cute_megamoe import fused
    from cute_megamoe.expert_gemm import ExpertWeights

    weights = object.__new__(ExpertWeights)
    object.__setattr__(weights, "arch", arch)
    buf = SimpleNamespace(layout=SimpleNamespace(num_ranks=num_ranks, recipe=recipe,
                                                 num_max_tokens_per_rank=max_tokens))
    monkeypatch.setattr(fused, "supports", lambda b, w, config=None: reason)
    if env is None:
        monkeypatch.delenv("CUTE_MEGAMOE_FUSED", raising=False)
    else:
        monkeypatch.setenv("CUTE_MEGAMOE_FUSED", env)
    return buf, weights


def test_choose_runs_the_fused_kernel_by_default_where_it_ran(monkeypatch):
    """``fused=None``: the fused kernel for one-rank groups on sm_90a with fp8xfp8 / bf16xbf16
    weights (where it was GPU-tested), the staged kernels for larger groups, on sm_100a, for
    the FP4 experiment, for the pull transfer or without L2 sends, or where `supports` says no;
    ``CUTE_MEGAMOE_FUSED`` 1 / 0 widens / turns off the default; `LayerConfig.fused` decides
    as the argument does (a different value raises); True raises where it cannot run;
    anything else than None / bool is a TypeError."""
    from cute_megamoe import fused
    from cute_megamoe.staged import TorchExpertWeights

    for recipe in ("fp8xfp8", "bf16xbf16"):
        assert fused.choose(None, *_choose_case(monkeypatch, recipe=recipe)) is True
    staged_by_default = [dict(num_ranks=2), dict(num_ranks=8), dict(arch="sm_100a"),
                         dict(recipe="fp8xfp4_sm90"), dict(reason="no"), dict(env="0")]
    for case in staged_by_default:
        assert fused.choose(None, *_choose_case(monkeypatch, **case)) is False, case
        assert fused.choose(False, *_choose_case(monkeypatch, **case)) is False, case
    for case in (dict(num_ranks=2), dict(arch="sm_100a"), dict(recipe="fp8xfp4_sm90")):
        buf, w = _choose_case(monkeypatch, env="1", **case)
        assert fused.choose(None, buf, w) is True, case  # where `supports` allows it
        assert fused.choose(None, buf, w, transfer="pull") is False
        assert fused.choose(None, buf, w, l2_sends=False) is False
    buf, w = _choose_case(monkeypatch)
    assert fused.choose(True, buf, w) is True
    assert fused.choose(None, buf, object.__new__(TorchExpertWeights)) is False
    assert fused.choose(None, buf, w, transfer="pull") is False
    for kwargs in (dict(transfer="pull"), dict(l2_sends=False)):
        with pytest.raises(ValueError, match="transfer='push', l2_sends=True"):
            fused.choose(True, buf, w, **kwargs)
    with pytest.raises(ValueError, match="fused: the reason"):
        fused.choose(True, *_choose_case(monkeypatch, reason="the reason"))
    for bad in (1, "yes"):
        with pytest.raises(TypeError, match="fused: expected None or a bool"):
            fused.choose(bad, buf, w)
    with pytest.raises(ValueError, match="CUTE_MEGAMOE_FUSED: one of"):
        fused.choose(None, *_choose_case(monkeypatch, env="sometimes"))
    buf, w = _choose_case(monkeypatch, num_ranks=2)
    assert fused.choose(None, buf, w, config=LayerConfig(fused=True)) is True
    assert fused.choose(None, *_choose_case(monkeypatch), config=LayerConfig(fused=False)) \
        is False
    with pytest.raises(ValueError, match="config.fused"):
        fused.choose(True, buf, w, config=LayerConfig(fused=False))


def test_choose_by_default_runs_the_fused_kernel_for_small_calls_only(monkeypatch):
    """``fused=None`` ("auto"): at one rank on sm_90a, calls of at most
    `heuristics.FUSED_AUTO_MAX_TOKENS` (128) tokens run the fused kernel, larger ones the
    staged kernels (where the fused kernel is slower); True, ``CUTE_MEGAMOE_FUSED=1`` and
    `LayerConfig.fused` take every call; a group of two ranks none."""
    from cute_megamoe import fused
    from cute_megamoe.heuristics import FUSED_AUTO_MAX_TOKENS

    assert FUSED_AUTO_MAX_TOKENS == 128
    buf, w = _choose_case(monkeypatch)
    assert fused.fused_max_tokens(None, buf, w) == 128
    for n, want in ((0, True), (1, True), (128, True), (129, False), (4096, False)):
        assert fused.choose(None, buf, w, num_tokens=n) is want, n
        assert fused.choose(True, buf, w, num_tokens=n) is True, n
        assert fused.choose(False, buf, w, num_tokens=n) is False, n
        assert fused.choose(None, buf, w, config=LayerConfig(fused=True), num_tokens=n), n
    assert fused.choose(None, buf, w) is True  # (some calls do)
    assert fused.fused_max_tokens(True, buf, w) == 4096
    assert fused.fused_max_tokens(False, buf, w) is None
    assert fused.fused_max_tokens(None, *_choose_case(monkeypatch, max_tokens=64)) == 64
    assert fused.fused_max_tokens(None, *_choose_case(monkeypatch, env="1")) == 4096
    assert fused.fused_max_tokens(None, *_choose_case(monkeypatch, env="0")) is None
    buf, w = _choose_case(monkeypatch, num_ranks=2)
    assert fused.fused_max_tokens(None, buf, w) is None
    assert fused.choose(None, buf, w, num_tokens=1) is False


def test_module_forward_runs_the_kernels_its_config_picks_for_the_call(monkeypatch):
    """`MegaMoE.forward` of a layer whose ``fused_max_tokens`` is 128 runs the fused layer for
    calls of up to 128 tokens and the staged layer above, on one buffer (the layer functions
    and the CUDA context stubbed: a CPU layer given the kernels path's config)."""
    import contextlib

    import cute_megamoe as cm
    from cute_megamoe import module

    w1 = torch.randn(8, 512, 512).to(torch.bfloat16)
    w2 = torch.randn(8, 512, 256).to(torch.bfloat16)
    layer = cm.MegaMoE(None, 8, 256, 2, 512, 256, "fp8xfp8", w1, w2, device="cpu")
    layer.config = dataclasses.replace(layer.config, path="kernels", arch="sm_90a",
                                       fused_max_tokens=128)
    layer.sym_buffer = cm.get_symm_buffer_for_mega_moe(None, 8, 256, 2, 512, 256,
                                                       mma_type="fp8xfp8", device="cpu")
    ran = []
    for name in ("fused_mega_moe", "staged_mega_moe"):
        monkeypatch.setattr(module, name,
                            lambda buf, x, *args, name=name, **kw: ran.append((name, len(x))))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    for n in (0, 1, 128, 129, 256):
        x = torch.zeros(n, 512, dtype=torch.bfloat16)
        layer._forward_impl(x, torch.zeros(n, 2, dtype=torch.int64), torch.zeros(n, 2))
    assert ran == [("fused_mega_moe", 0), ("fused_mega_moe", 1), ("fused_mega_moe", 128),
                   ("staged_mega_moe", 129), ("staged_mega_moe", 256)]


def test_supports_refuses_groups_of_several_gpus_outside_the_experiment(monkeypatch):
    """A group of one process per GPU (a process group, R > 1) runs the fused kernel only as an
    experiment (`LayerConfig.experimental_fused_multi_gpu`; its one-rank-per-GPU test failed
    on 2026-12-04); one-rank groups and loopback groups (no process group) are not held back
    by that; the MXFP4 experiment likewise (``experimental_fused_fp4``)."""
    from types import SimpleNamespace

    from cute_megamoe import fused
    from cute_megamoe.expert_gemm import ExpertWeights

    weights = object.__new__(ExpertWeights)
    object.__setattr__(weights, "arch", "sm_90a")
    monkeypatch.setattr(fused, "buffer_state", lambda buf: SimpleNamespace(arch="sm_90a"))

    def buffer(num_ranks, group, recipe="fp8xfp8"):
        layout = SimpleNamespace(num_ranks=num_ranks, recipe=recipe, hidden=512,
                                 intermediate_hidden=256, num_max_tokens_per_rank=64)
        return SimpleNamespace(layout=layout, group=group)

    reason = fused.supports(buffer(2, object()), weights)
    assert reason is not None and "experimental_fused_multi_gpu=True" in reason
    with pytest.raises(ValueError, match="several GPUs only as an experiment"):
        fused.choose(True, buffer(2, object()), weights)
    assert fused.supports(buffer(2, None), weights) is None  # loopback
    assert fused.supports(buffer(1, object()), weights) is None
    multi = LayerConfig(experimental_fused_multi_gpu=True)
    assert fused.supports(buffer(2, object()), weights, multi) is None
    fp4 = buffer(1, None, "fp8xfp4_sm90")
    assert "experimental_fused_fp4=True" in fused.supports(fp4, weights)
    assert fused.supports(fp4, weights, LayerConfig(experimental_fused_fp4=True)) is None


def test_module_on_the_cpu_runs_the_reference_by_default():
    """The CPU layer is the reference: ``fused`` None or False is that, not an error."""
    import cute_megamoe as cm

    w1 = torch.randn(8, 512, 512).to(torch.bfloat16)
    w2 = torch.randn(8, 512, 256).to(torch.bfloat16)
    for fused in (None, False):
        layer = cm.MegaMoE(None, 8, 64, 2, 512, 256, "fp8xfp8", w1, w2, device="cpu",
                           fused=fused)
        assert layer.config.path == "reference" and layer.config.fused is False
        assert layer.config.fused_max_tokens is None
        assert "fused_max_tokens=None" in repr(layer)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_module_and_api_run_the_fused_kernel(recipe):
    """`MegaMoE(fused=True)` and `api.mega_moe(..., fused=True)` give the staged kernels' y;
    so do the defaults (``fused=None``: the fused kernel at R = 1 for the GPU-tested recipes
    up to 128 tokens, the staged kernels above, `fused.choose`), and DeepGEMM's entry point on
    an fp8xfp8 buffer."""
    _gpu()
    import cute_megamoe as cm
    from cute_megamoe import api, quant

    gen = torch.Generator().manual_seed(3)
    w1 = (torch.randn(16, 512, 512, generator=gen) / 512**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(16, 512, 256, generator=gen) / 256**0.5).to(torch.bfloat16).cuda()
    deepgemm_weights = cm.transform_weights_for_mega_moe(
        *(quant.quantize_weights_for_recipe(t, recipe) for t in (w1, w2))) \
        if recipe in STABLE_RECIPES else None
    # (the MXFP4 experiment's fused kernel runs where the configuration asks for it)
    layers = {f: cm.MegaMoE(None, 16, 256, 4, 512, 256, recipe, w1, w2, fused=f,
                            activation_clamp=10.0, config=EXPERIMENTS)
              for f in (False, True, None)}
    assert layers[True].config.fused and not layers[False].config.fused
    assert layers[None].config.fused == (recipe in STABLE_RECIPES)
    assert layers[True].config.fused_max_tokens == 256
    assert layers[None].config.fused_max_tokens == (128 if recipe in STABLE_RECIPES else None)
    from cute_megamoe.testing.dispatch_checks import make_routing

    for n in (1, 100, 256):
        idx, w = make_routing(n, 16, 4, "masked", gen)
        x = torch.randn(n, 512, generator=gen).to(torch.bfloat16).cuda()
        ys = {f: layer(x, idx.cuda(), w.cuda()) for f, layer in layers.items()}
        for f in (True, None):
            assert torch.equal(ys[f].view(torch.int16), ys[False].view(torch.int16)), (n, f)
        for f in (True, None):
            layer = layers[True]
            api.stage_inputs(layer.sym_buffer, x, idx.cuda(), w.cuda())
            y = torch.full_like(x, float("nan"))
            api.mega_moe(y, layer.weights, layer.sym_buffer, activation_clamp=10.0, fused=f,
                         config=EXPERIMENTS)
            assert torch.equal(y.view(torch.int16), ys[False].view(torch.int16)), (n, f)
        if recipe in STABLE_RECIPES:  # DeepGEMM's entry points, on its weight tuples
            buf = layers[True].sym_buffer
            api.stage_inputs(buf, x, idx.cuda(), w.cuda())
            y = torch.full_like(x, float("nan"))
            if recipe == "fp8xfp8":
                cm.fp8_fp4_mega_moe(y, *deepgemm_weights, buf, recipe=(1, 128, 128),
                                    activation_clamp=10.0)
            else:
                cm.bf16_mega_moe(y, *deepgemm_weights, buf, activation_clamp=10.0)
            assert torch.equal(y.view(torch.int16), ys[False].view(torch.int16)), n


@pytest.mark.multigpu
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_fused_one_rank_per_gpu(num_ranks, recipe):
    """200 calls (R = 2; 50 at 4 and 8), one process per GPU, each against the staged layer
    (across GPUs the fused kernel runs only as an experiment, `fused.supports`: the checks'
    configuration, `fused_checks.EXPERIMENTS`)."""
    _gpu()
    from cute_megamoe.testing.fused_checks import run_multiprocess

    if torch.cuda.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} GPUs, {torch.cuda.device_count()} present")
    run_multiprocess(num_ranks, recipe, 200 if num_ranks == 2 else 50,
                     port=29961 + 10 * num_ranks + RECIPES.index(recipe))


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", (64, 128))
def test_fused_device_tile_walk_equals_host_model(block_m):
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer, check_tile_walk

    layer = FusedLayer(_one_rank("fp8xfp8", 16, 300, 4, 512, 256))
    for i, routing in enumerate(("random", "skewed", "one_expert")):
        assert check_tile_walk(layer, 300 - 97 * i, routing, block_m, seed=i) > 0


@pytest.mark.compile
def test_tile_log_variant_compiles(monkeypatch):
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile("fp8xfp8", 128, debug="tile_log")
    assert kernel.tile_log
    assert art.count("QGMMA") > 0 if art.sass is not None else "wgmma" in art.ptx


def test_default_row_transfer_follows_the_token_capacity():
    """Decode-sized buffers move rows counted per pool block, larger ones behind a barrier; the
    choice depends only on the layout, which every rank shares, and a configured one wins."""
    from cute_megamoe.heuristics import COUNTED_ROWS_MAX_TOKENS, default_row_transfer

    def layout(tokens):
        return MegaMoELayout(2, 16, tokens, 4, 512, 256, "fp8xfp8")

    assert default_row_transfer(layout(1)) == "counted"
    assert default_row_transfer(layout(COUNTED_ROWS_MAX_TOKENS)) == "counted"
    assert default_row_transfer(layout(COUNTED_ROWS_MAX_TOKENS + 1)) == "barrier"
    assert default_row_transfer(layout(8192)) == "barrier"
    fp4 = MegaMoELayout(2, 16, 128, 4, 512, 256, "fp8xfp4_sm90")
    assert default_row_transfer(fp4) == "barrier"  # (the FP4 experiment)
    assert _kernel("fp8xfp8", 128, layout(8192)).row_transfer == "barrier"
    assert _kernel("fp8xfp8", 64, layout(128)).rows_counted
    assert _kernel("fp8xfp8", 64, layout(128), row_transfer="barrier").row_transfer == "barrier"


@pytest.mark.compile
@pytest.mark.parametrize("recipe,block_m", [("fp8xfp8", 64), ("fp8xfp8", 128),
                                            ("fp8xfp4_sm90", 64), ("fp8xfp4_sm90", 128)])
def test_row_transfers_compile(recipe, block_m, monkeypatch):
    """The row transfers of the phase walk: "barrier" (the staged dispatch's settings, no
    arrival counts) and "counted" (its count words say so; the metadata counted into the own
    pool with GPU-scope releases, the rows with a fence per batch of rows and relaxed adds at
    system scope, R = 2 here); neither spills ("pulled": `test_pulled_rows_compile`)."""
    from cute_megamoe.layout import CountWord

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    built = {t: _compile(recipe, block_m, row_transfer=t) for t in ("barrier", "counted")}
    # (512 tokens per rank: counted rows, but "barrier" for the FP4 experiment)
    default = _compile(recipe, block_m)[0]
    assert default.row_transfer == ("barrier" if recipe == "fp8xfp4_sm90" else "counted")
    # (the GEMM phases promote as the grouped GEMMs do, but the FP4 experiment keeps chunk:
    # the grouped GEMMs' MXFP4 quarter at BLOCK_M 64 was not measured in it)
    quarter = block_m == 64 and recipe == "fp8xfp8"
    assert default.l1.promotion == default.l2.promotion == ("quarter" if quarter else "chunk")
    for t, (kernel, art) in built.items():
        counted = t != "barrier"
        assert kernel.dispatch.pool_order == kernel.rows_counted == counted
        settings = CountWord.decode(kernel.dispatch.settings << CountWord.COUNT_BITS)
        assert settings["rows_counted"] == counted
        metadata = "red.release.gpu.global.add.s32"
        rows = "red.relaxed.sys.global.add.s32"
        assert (art.ptx.count(metadata) > built["barrier"][1].ptx.count(metadata)) == counted
        assert (rows in art.ptx) == counted, t
        if art.sass is not None:
            assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0, t
    with pytest.raises(ValueError, match="row_transfer"):
        _compile(recipe, block_m, row_transfer="later")


@pytest.mark.compile
@pytest.mark.parametrize("recipe,block_m,received_rows", [("fp8xfp8", 64, 2048),
                                                         ("fp8xfp8", 128, 2048),
                                                         ("bf16xbf16", 128, None)])
def test_pulled_rows_compile(recipe, block_m, received_rows, monkeypatch):
    """"pulled" rows (R = 2): the ticket walk by default, its count words say pulled and
    counted (a pushing peer's would differ in the push bit: both trap), the metadata carries no
    scale words (the pullers copy them into the ring's MN-major scales), the pullers count
    their rows with GPU-scope adds and no system-scope ones (the rows are stored here); on a
    buffer whose received rows are a ring, its slots are the region's blocks. The pullers run
    at the loads' warpgroup's 40 registers: a few stack words there (the row count), no local
    memory elsewhere."""
    from cute_megamoe.layout import CountWord

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe, received_rows=received_rows)
    kernel, art = _compile(recipe, block_m, layout, row_transfer="pulled", stages_inputs=True)
    _, counted = _compile(recipe, block_m, walk="tickets", stages_inputs=True)
    assert kernel.config.walk == "tickets" and kernel.rows_pulled and kernel.rows_counted
    assert kernel.dispatch.pulls_in_pool_order
    settings = CountWord.decode(kernel.dispatch.settings << CountWord.COUNT_BITS)
    assert settings["rows_counted"] and not settings["push"]
    ring = received_rows // block_m if received_rows else 0
    assert kernel.rows_ring_blocks == ring and kernel.l1.a_ring_blocks == ring
    assert kernel.l1.a_rows == layout.num_received_rows
    assert "red.relaxed.gpu.global.add.s32" in art.ptx
    assert "red.relaxed.sys.global.add.s32" in counted.ptx
    assert "red.relaxed.sys.global.add.s32" not in art.ptx
    if art.sass is not None:
        assert art.resource_usage()["LOCAL"] == 0 and art.resource_usage()["STACK"] <= 16


def test_received_rows_ring_refusals():
    """A buffer whose received rows are a ring runs the fused kernel with pulled rows only,
    which the defaults choose there (with the ticket walk); every other transfer, the phase
    walk and a ring of fewer than two bands are refused before any launch, naming why."""
    from cute_megamoe.heuristics import default_fused_config

    ring = MegaMoELayout(2, 64, 512, 8, 7168, 2048, "fp8xfp8", received_rows=2048)
    config = default_fused_config(ring, 128, True)
    assert (config.row_transfer, config.walk, config.band) == ("pulled", "tickets", 8)
    assert _kernel("fp8xfp8", 128, ring).rows_ring_blocks == 16
    for transfer in ("counted", "barrier"):
        with pytest.raises(ValueError, match="received_rows 2048.*'pulled'"):
            _kernel("fp8xfp8", 128, ring, row_transfer=transfer)
    with pytest.raises(ValueError, match="'pulled' with walk='tickets' only"):
        Sm90FusedConfig(row_transfer="pulled", walk="phases")
    with pytest.raises(ValueError, match="local_dispatch"):
        Sm90FusedConfig(row_transfer="pulled", local_dispatch=True)
    small = MegaMoELayout(2, 64, 512, 8, 7168, 2048, "fp8xfp8", received_rows=1024)
    with pytest.raises(ValueError, match="8 blocks of 128 rows, fewer than the 2 bands of 8"):
        _kernel("fp8xfp8", 128, small)
    assert _kernel("fp8xfp8", 128, small, band=4).rows_ring_blocks == 8
    with pytest.raises(ValueError, match="'tickets' with FP8 / BF16 weights only"):
        _kernel("fp8xfp4_sm90", 128, MegaMoELayout(2, 64, 512, 8, 7168, 2048, "fp8xfp4_sm90",
                                                   received_rows=2048))


TOKEN_WAIT = "the L2 rows of a token (token_arrivals)"


@pytest.mark.compile
@pytest.mark.parametrize("recipe,block_m", [("fp8xfp8", 64), ("fp8xfp8", 128),
                                            ("bf16xbf16", 128)])
def test_token_combine_compiles(recipe, block_m, monkeypatch):
    """``combine="tokens"`` (docs/notes/dataflow.md, 1.6; R = 2): the ticket walk by default;
    a consumer warp counts each L2 tile into its pool block's `pool_block_l2_done` (acq_rel,
    GPU scope), and the one that completes the block signals its rows' tokens with
    system-scope release adds into their source ranks' `token_arrivals`; the reduction
    acquires each token's count at system scope before it loads the token's rows; the
    default (split-barrier) combine has none of it. No spills; with pulled rows at BLOCK_M
    64 the pullers' stack grows from 16 to 24 bytes (the loads' warpgroup at 40 registers
    keeps the arrivals' pointer there). With stall reports (the spin limit set) the token
    wait's report names the token."""
    from cute_megamoe.reports import REPORT_NAMES

    assert TOKEN_WAIT in REPORT_NAMES
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    kernel, art = _compile(recipe, block_m, combine="tokens", stages_inputs=True)
    assert kernel.config.walk == "tickets" and kernel.combine_tokens
    assert kernel.combine.per_token and kernel.combine.scope == "sys"
    assert kernel.l2.tile_signals() == 28 * (block_m // 64) * 4  # (the block's last count)
    builds = [art]
    pulled_art = None
    if (recipe, block_m) == ("fp8xfp8", 64):
        plain, plain_art = _compile(recipe, block_m, walk="tickets", stages_inputs=True)
        assert plain.config.combine == "barriers" and not plain.combine.per_token
        for op in ("red.release.sys.global.add.s32",  # (the tokens' signals)
                   "atom.global.acq_rel.add",  # (the blocks' L2 counts)
                   "ld.acquire.sys.global"):  # (the tokens' waits)
            assert art.ptx.count(op) > plain_art.ptx.count(op), op
        layout = MegaMoELayout(2, 64, 512, 8, 7168, 2048, recipe, received_rows=2048)
        pulled, pulled_art = _compile(recipe, block_m, layout, row_transfer="pulled",
                                      combine="tokens", stages_inputs=True)
        assert pulled.rows_pulled and pulled.combine_tokens
    if (recipe, block_m) == ("bf16xbf16", 128):  # (the waits' reports: traced, no spills)
        monkeypatch.delenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S")
        builds.append(_compile(recipe, block_m, combine="tokens", stages_inputs=True)[1])
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    for built in builds:
        assert built.count("HGMMA" if recipe == "bf16xbf16" else "QGMMA") > 0
        usage = built.resource_usage()
        assert built.count("STL") == 0 and usage["LOCAL"] == usage["STACK"] == 0, usage
    if pulled_art is not None:
        usage = pulled_art.resource_usage()
        assert usage["LOCAL"] == 0 and usage["STACK"] <= 24, usage


def test_token_combine_refusals():
    """``combine="tokens"`` needs the ticket walk (which the defaults then choose) and the
    exchanged dispatch (the defaults' local dispatch of small one-rank buffers is off with
    it), FP8 / BF16 weights; the combine kernel counts tokens only in its "epilogue" mode.
    The default stays "barriers"."""
    from cute_megamoe.heuristics import default_fused_config
    from cute_megamoe.kernels.combine import CombineKernel

    with pytest.raises(ValueError, match="combine: 'tokens' with walk='tickets' only"):
        Sm90FusedConfig(combine="tokens", walk="phases")
    with pytest.raises(ValueError, match="combine: 'tokens' with the exchanged dispatch"):
        Sm90FusedConfig(combine="tokens", local_dispatch=True)
    with pytest.raises(ValueError, match="combine"):
        Sm90FusedConfig(combine="rows")
    one = MegaMoELayout(1, 64, 256, 8, 7168, 2048, "fp8xfp8")
    default = default_fused_config(one, 64, True)
    assert (default.combine, default.walk, default.local_dispatch) == ("barriers", "phases", True)
    tokens = default_fused_config(one, 64, True, Sm90FusedConfig(combine="tokens"))
    assert (tokens.combine, tokens.walk, tokens.local_dispatch) == ("tokens", "tickets", False)
    assert _kernel("fp8xfp8", 64, one, combine="tokens", stages_inputs=True).combine_tokens
    with pytest.raises(ValueError, match="'tickets' with FP8 / BF16 weights only"):
        _kernel("fp8xfp4_sm90", 128, MegaMoELayout(2, 64, 512, 8, 7168, 2048, "fp8xfp4_sm90"),
                combine="tokens")
    with pytest.raises(ValueError, match="per_token"):
        CombineKernel(one, 64, send_mode="registers", per_token=True)


@pytest.mark.compile
def test_weights_first_variant_compiles(monkeypatch):
    """The variant whose tiles that find their pool block not ready load their first stages'
    weights before they wait (with counted rows, the first L1 tile's right after the counts):
    more TMA load sites (the weights-first loops), no spills with waits that never time out,
    the default build without them."""
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    plain, art = _compile("fp8xfp8", 64, row_transfer="counted", weights_first=False)
    first, art_first = _compile("fp8xfp8", 64, row_transfer="counted")  # (the default there)
    assert not plain.l1.weights_first and first.l1.weights_first and first.l2.weights_first
    assert first.early_weights and not plain.early_weights
    barrier, _ = _compile("fp8xfp8", 64, row_transfer="barrier")
    assert not barrier.l1.weights_first and not barrier.early_weights
    if art.sass is None:
        pytest.skip("nvdisasm not available")
    assert art_first.count("UTMALDG") > art.count("UTMALDG")
    assert art_first.count("STL") == 0 and art_first.resource_usage()["LOCAL"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(row_transfer="barrier"), dict(row_transfer="counted"),
                                     dict(row_transfer="counted", weights_first=False)])
def test_fused_configurations_match_staged(variant):
    """The fused kernel's configurations (each way of moving the rows; with counted rows,
    weights loaded before a tile's wait or not) give the same bits, on inputs the caller
    staged."""
    _gpu()
    from cute_megamoe import staged
    from cute_megamoe.heuristics import default_fused_config
    from cute_megamoe.launch import buffer_state, fused_call
    from cute_megamoe.testing.fused_checks import FusedLayer

    layer = FusedLayer(_one_rank("fp8xfp8", 16, 300, 4, 512, 256))
    (buf,) = layer.ranks.buffers
    for n, block_m in ((300, 128), (77, 64), (0, 64), (1, 128)):
        _, _, _, inputs = layer.inputs((n,), "skewed", seed=n)
        x, idx, w = inputs[0]
        want = staged.staged_mega_moe(buf, x, idx, w, layer.weights[0], activation_clamp=10.0,
                                      block_m=block_m, validate_routing=False)
        staged.stage_inputs(buf, x, idx, w, validate_routing=False)
        y = torch.full_like(want, float("nan"))
        config = default_fused_config(buf.layout, block_m, False, Sm90FusedConfig(**variant))
        fused_call(buf, layer.weights[0], n, y, buffer_state(buf).num_sms, None, 10.0, True,
                   config)()
        torch.cuda.synchronize()
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (n, block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", STABLE_RECIPES)
def test_fused_and_staged_ranks_mix_with_barrier_rows(recipe):
    """A fused rank moving its rows before its GEMMs ("barrier") and a staged rank run one row
    protocol (the staged dispatch's rows, its closing cross-rank barrier, L2 sending the rows,
    the combine's split barriers): the group gives the all-staged bits, whichever rank runs
    the fused kernel (different BLOCK_Ms, 0 tokens on a rank). With counted rows the two
    protocols differ and the kernels trap naming it (`test_protocol`, "fused_and_staged")."""
    _gpu()
    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.protocol_checks import Ranks

    layer = FusedLayer(Ranks.loopback(2, 16, 200, 4, 512, 256, recipe),
                       configs={0: rows_config("barrier"), 1: rows_config("barrier")})
    layer.warm_up((64, 128))
    for fused_rank, seed in ((0, 21), (1, 22)):
        layer.check_call((200, 0), "random", {0: 128, 1: 64}, seed=seed,
                         fused_ranks={fused_rank})
        layer.check_call((1, 130), "skewed", {0: 64, 1: 128}, seed=seed + 10,
                         fused_ranks={fused_rank})
        layer.check_call((77, 200), "masked", {0: 64, 1: 64}, seed=seed + 20,
                         fused_ranks={fused_rank})


def test_stall_probe_needs_a_gpu(monkeypatch):
    """`testing.stall_probe` (the fused FP4 stall diagnostic) says what it needs without one."""
    from cute_megamoe.testing import stall_probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["stall_probe", "--rounds", "1"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        stall_probe.main()
