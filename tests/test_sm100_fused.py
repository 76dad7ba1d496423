"""The Blackwell fused layer kernel (`kernels/sm100_mega_moe.py`, issue 22), compile-only here.

CPU: it compiles for sm_100a at every BLOCK_M the heuristics can pick (64, 128, 256: 1-CTA and
2-CTA) for both recipes, with the block-scaled tcgen05 MMA (UTCQMMA) and its UTCCP scale
copies, or the BF16 one (UTCHMMA) and no scale traffic, tensor-memory loads (LDTM), TMA loads
of both GEMMs and no local memory; every mbarrier the kernel is built with has the arrival
count, and every stage the transaction byte count, computed here from the tile shapes; the
readiness count an L2 tile waits for; the host model of its tile walk is the Hopper kernel's.
sm100 (skips without a Blackwell GPU): bit-exact with the staged layer and near the reference,
through `fused.fused_mega_moe` (which picks it on sm_100a).
"""

import re

import pytest
import torch

from cute_megamoe.config import Sm100GemmConfig
from cute_megamoe.layout import MegaMoELayout
from cute_megamoe.tables import BLOCK_MS

RECIPES = ("fp8xfp4", "bf16xbf16")
BLOCK_M_CHOICES = BLOCK_MS["sm_100a"]
SHAPE = (2, 64, 512, 8, 7168, 2048)  # ranks, tokens, experts, top-k, hidden, intermediate


def _kernel(recipe: str, block_m: int, shape=SHAPE):
    from cute_megamoe.kernels.sm100_mega_moe import Sm100MegaMoEKernel

    return Sm100MegaMoEKernel(MegaMoELayout(*shape, recipe), Sm100GemmConfig(block_m),
                              activation_clamp=10.0,
                              has_stats=True)


def _compile(kernel):
    from cutlass import Int32

    from cute_megamoe.testing.compile import compile_for_arch, fake_ptr, fake_stream

    ptrs = [fake_ptr(dtype, 4 if name in ("expert_recv_tokens", "stats", "pool_block_ready")
                     else 16) for name, dtype in kernel.pointer_args()]
    return compile_for_arch(kernel, ptrs[0], Int32(0), Int32(0), *ptrs[1:], Int32(148),
                            fake_stream(), arch="sm_100a")


_compiled: dict = {}


def _compiled_no_timeout(recipe: str, block_m: int, monkeypatch):
    """(kernel, artifacts), compiled once per configuration with waits that never time out
    (any local-memory store would be a spill)."""
    if (recipe, block_m) not in _compiled:
        monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
        kernel = _kernel(recipe, block_m)
        _compiled[recipe, block_m] = (kernel, _compile(kernel))
    return _compiled[recipe, block_m]


def _mbarrier_inits(ptx: str) -> list[int]:
    """The arrival count of every ``mbarrier.init`` in the PTX, in program order (each count
    is a register loaded with an immediate just before)."""
    counts, regs = [], {}
    for line in ptx.splitlines():
        mov = re.match(r"\s*mov\.b32\s+(%r\d+),\s*(\d+);", line)
        if mov:
            regs[mov.group(1)] = int(mov.group(2))
        init = re.match(r"\s*mbarrier\.init\.shared\.b64\s+\[[^\]]+\],\s*(%r\d+|\d+);", line)
        if init:
            arg = init.group(1)
            counts.append(regs[arg] if arg.startswith("%") else int(arg))
    return counts


def _expect_tx(ptx: str) -> list[int]:
    """The byte count of every ``mbarrier.arrive.expect_tx`` (an immediate in a register)."""
    regs, counts = {}, []
    for line in ptx.splitlines():
        mov = re.match(r"\s*mov\.b32\s+(%r\d+),\s*(\d+);", line)
        if mov:
            regs[mov.group(1)] = int(mov.group(2))
        tx = re.search(r"mbarrier\.arrive\.expect_tx\.\S+\s+\S+,\s*\[[^\]]+\],\s*(%r\d+|\d+);",
                       line)
        if tx:
            arg = tx.group(1)
            counts.append(regs[arg] if arg.startswith("%") else int(arg))
    return counts


def _stage_tx_bytes(recipe: str, block_m: int) -> int:
    """Bytes one ring stage delivers to the MMA CTA's barrier, from the tile shapes: per CTA
    128 token rows and 128 / (CTAs per MMA) weight rows of one k-block (128 deep for fp8xfp4:
    e4m3 tokens, packed e2m1 weights, and a UE8M0 byte per 32 K of each of the 128 token rows
    and of all 128 weight rows; 64 deep for bf16); at BLOCK_M 256 both CTAs of the pair."""
    ctas = 2 if block_m == 256 else 1
    if recipe == "fp8xfp4":
        k = 128
        per_cta = 128 * k + (128 // ctas) * k // 2 + 128 * (k // 32) + 128 * (k // 32)
    else:
        k = 64
        per_cta = 128 * k * 2 + (128 // ctas) * k * 2
    return ctas * per_cta


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("block_m", BLOCK_M_CHOICES)
def test_compiles_sm100_with_tcgen05_utccp_tmem_loads_and_no_local_memory(recipe, block_m,
                                                                          monkeypatch):
    kernel, art = _compiled_no_timeout(recipe, block_m, monkeypatch)
    assert kernel.l1.use_2cta == kernel.l2.use_2cta == (block_m == 256)
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    # both GEMM phases: 4 MMAs per k-block each (K = 4 x 32 block-scaled, 4 x 16 bf16)
    if recipe == "fp8xfp4":
        assert art.count("UTCQMMA") == 8 and art.count("UTCHMMA") == 0
        assert art.count("UTCCP") == 4  # SFA and SFB of each phase into tensor memory
        assert art.count("UTMALDG") == 8  # tokens, weights, both scales; L1 and L2
    else:
        assert art.count("UTCHMMA") == 8 and art.count("UTCQMMA") == 0
        assert art.count("UTCCP") == 0
        assert art.count("UTMALDG") == 4
    # L1: 2 chunks of 64 columns; L2: 4 of 32 (one tcgen05.ld each)
    assert art.count("LDTM") == 6
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


@pytest.mark.compile
def test_compiles_sm100_with_stall_reports_and_no_local_memory():
    """With the default timeout every wait can report which counter stalled (through the
    pinned record, `reports`: no printf, no function call), without local memory."""
    art = _compile(_kernel("fp8xfp4", 128))
    assert "vprintf" not in art.ptx and "trap;" in art.ptx
    if art.sass is None:
        pytest.skip("nvdisasm not available")
    # (the only calls are ptxas's own, into its tcgen05 guardrail traps)
    assert art.resource_usage()["LOCAL"] == 0
    calls = [line for line in art.sass.splitlines() if "CALL" in line.split(";")[0]]
    assert all("tcgen05_guardrail_trap" in line for line in calls), calls


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("block_m", BLOCK_M_CHOICES)
def test_barrier_arrivals_and_transaction_bytes_match_the_tile_shapes(recipe, block_m,
                                                                      monkeypatch):
    kernel, art = _compiled_no_timeout(recipe, block_m, monkeypatch)
    ctas = 2 if block_m == 256 else 1
    s = kernel.num_stages
    # ring full (the TMA warp's one expect-tx arrival) and empty (the MMA warp's commit) per
    # stage; the two accumulators' full (the MMA commit) and empty (every epilogue thread of
    # the pair: 4 warps x 32 x CTAs); at BLOCK_M 256 the 2-CTA TMEM release (one warp)
    expected = [1] * s + [1] * s + [1, 1] + [128 * ctas] * 2 + ([32] if ctas == 2 else [])
    assert _mbarrier_inits(art.ptx) == expected
    tx = _expect_tx(art.ptx)
    assert len(tx) == 2  # one expect-tx per stage in each phase's producer loop
    assert set(tx) == {_stage_tx_bytes(recipe, block_m)}
    assert kernel.stage_tx_bytes == _stage_tx_bytes(recipe, block_m)
    # an L2 tile waits for every epilogue warp of the pair, for every L1 n-block (2I / 128)
    assert kernel.l2.waits_ready == (2 * SHAPE[5] // 128) * 4 * ctas
    assert kernel.ring_arrivals()["ready"] == kernel.l2.waits_ready
    assert kernel.ring_arrivals()["acc_consumer"] == 128 * ctas
    assert kernel.l1.signals_ready and not kernel.l2.signals_ready
    assert kernel.l1.waits_ready == 0
    assert kernel.l1.num_stages == kernel.l2.num_stages == s >= 2
    # one CTA per SM: the shared memory of two would not fit an SM (228 KB)
    assert 228 * 1024 // 2 < kernel.smem_bytes() <= 227 * 1024


def test_tile_walk_is_the_hopper_kernels():
    """The L1 then L2 walk, index carried over, is `fused_tile_walk` with the sm100 tiles (128
    columns, raster bands of 1), by CTA pairs at BLOCK_M 256: every tile once, L1 first."""
    from cute_megamoe.kernels import sm90_mega_moe
    from cute_megamoe.kernels.sm100_expert_gemm import RASTER_GROUP, TILE_N
    from cute_megamoe.scheduler import fused_tile_walk, grouped_gemm_tiles

    # the Hopper kernel's walk is this function too (its docstring names it)
    assert "fused_tile_walk" in sm90_mega_moe.__doc__
    counts = [3, 0, 130, 64, 1, 300]
    hidden, inter = 512, 256
    for block_m in BLOCK_M_CHOICES:
        k = _kernel("fp8xfp4", block_m, (1, 512, 6, 1, hidden, inter))
        assert (k.l1.scheduler.block_m, k.l1.scheduler.num_n_blocks) == (block_m,
                                                                          2 * inter // TILE_N)
        assert (k.l2.scheduler.block_m, k.l2.scheduler.num_n_blocks) == (block_m,
                                                                          hidden // TILE_N)
        l1 = grouped_gemm_tiles(counts, block_m, TILE_N, 2 * inter, RASTER_GROUP)
        l2 = grouped_gemm_tiles(counts, block_m, TILE_N, hidden, RASTER_GROUP)
        for walkers in (1, 3, 7):
            walks = [fused_tile_walk(counts, block_m, TILE_N, 2 * inter, TILE_N, hidden, walkers,
                                     c, (RASTER_GROUP, RASTER_GROUP)) for c in range(walkers)]
            seen = sorted((p, t.pool_block, t.n_block) for w in walks for p, t in w)
            assert seen == sorted([("l1", t.pool_block, t.n_block) for t in l1]
                                  + [("l2", t.pool_block, t.n_block) for t in l2])
            for c, w in enumerate(walks):
                assert [p for p, _ in w] == sorted(p for p, _ in w)
                # the kernel's hand-over: first L2 index = first index past L1, minus len(L1)
                tile = c
                while tile < len(l1):
                    tile += walkers
                assert [t for p, t in w if p == "l2"] == l2[tile - len(l1)::walkers]


def test_share_ring_pairs_l1_with_l2_only():
    from cute_megamoe.kernels.sm100_expert_gemm import Sm100ExpertGemmKernel, share_ring

    l1 = Sm100ExpertGemmKernel("l1", "fp8xfp4", 4, 1024, 512, 256, Sm100GemmConfig(128))
    l2 = Sm100ExpertGemmKernel("l2", "fp8xfp4", 4, 1024, 256, 256, Sm100GemmConfig(128))
    with pytest.raises(ValueError, match="L1 and an L2"):
        share_ring(l2, l1)
    with pytest.raises(ValueError, match="differ"):
        share_ring(l1, Sm100ExpertGemmKernel("l2", "fp8xfp4", 4, 1024, 256, 256,
                                             Sm100GemmConfig(64)))
    share_ring(l1, l2, 3)
    assert (l1.num_stages, l2.num_stages, l2.waits_ready) == (3, 3, (512 // 128) * 4)


def test_fused_sm100_kernel_rejects_what_it_cannot_run():
    from cute_megamoe.kernels.sm100_mega_moe import Sm100MegaMoEKernel

    with pytest.raises(ValueError, match="recipe"):
        Sm100MegaMoEKernel(MegaMoELayout(1, 8, 64, 2, 512, 256, "fp8xfp8"), Sm100GemmConfig(128))
    with pytest.raises(ValueError, match="block_m"):
        Sm100GemmConfig(96)
    with pytest.raises(TypeError, match="config"):
        Sm100MegaMoEKernel(MegaMoELayout(1, 8, 64, 2, 512, 256, "fp8xfp4"), 128)


# ----------------------------------------------------------------------------- sm100 GPU

@pytest.mark.sm100
@pytest.mark.parametrize("recipe", RECIPES)
def test_sm100_fused_matches_staged_one_rank(recipe):
    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.protocol_checks import Ranks

    layer = FusedLayer(Ranks.loopback(1, 16, 300, 4, 512, 256, recipe))
    layer.warm_up(BLOCK_M_CHOICES)
    cases = [(100, "random"), (300, "one_expert"), (129, "masked"), (77, "skewed"),
             (0, "random"), (1, "random")]
    for i, (n, routing) in enumerate(cases):
        for block_m in BLOCK_M_CHOICES:
            layer.check_call((n,), routing, {0: block_m}, seed=i)


@pytest.mark.sm100
@pytest.mark.parametrize("recipe", RECIPES)
def test_sm100_fused_two_ranks_on_one_gpu(recipe):
    from cute_megamoe.testing.fused_checks import FusedLayer
    from cute_megamoe.testing.protocol_checks import Ranks

    layer = FusedLayer(Ranks.loopback(2, 16, 200, 4, 512, 256, recipe))
    layer.warm_up(BLOCK_M_CHOICES)
    layer.check_call((200, 0), "random", {0: 128, 1: 64}, seed=1)
    layer.check_call((1, 130), "one_expert", {0: 256, 1: 128}, seed=2)


# ------------------------------------------------------- TMA descriptors, encoded on any GPU

@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("block_m", BLOCK_M_CHOICES)
def test_sm100_tma_descriptors_encode_on_this_gpu(recipe, block_m, monkeypatch):
    """Every TMA descriptor of the sm_100a fused kernel (both GEMMs' tokens, weights and, for
    fp8xfp4, both scale operands, including the 4-D permuted-row layouts) is encoded by the
    host code of the compiled kernel, with real buffers, on a GPU that is not a Blackwell: the
    launch itself must then fail for want of an sm_100a kernel image, not the encoding. A first
    call with the tokens' address 8 bytes off proves that an encoding error would show (else
    the test skips: the encoding is not reached on this GPU)."""
    from cute_megamoe import runtime

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("a Blackwell GPU runs the kernel itself (the sm100 tests)")
    previous = runtime.launch_path().name
    runtime.set_launch_path("cute-dsl")  # pointer arguments we can shift by hand
    try:
        _encode_or_skip(recipe, block_m, monkeypatch)
    finally:
        runtime.set_launch_path(previous)


def _encode_or_skip(recipe: str, block_m: int, monkeypatch) -> None:
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    import cute_megamoe.launch as launch_mod
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.expert_gemm import ExpertWeights

    monkeypatch.setattr(launch_mod, "get_arch", lambda *args: "sm_100a")
    buf = get_symm_buffer_for_mega_moe(None, 16, 256, 4, 512, 256, mma_type=recipe)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(16, 512, 512, generator=gen, device="cuda").to(torch.bfloat16)
    w2 = torch.randn(16, 512, 256, generator=gen, device="cuda").to(torch.bfloat16)
    weights = ExpertWeights.from_bf16(w1, w2, recipe, arch="sm_100a")
    y = torch.empty(64, 512, dtype=torch.bfloat16, device="cuda")
    call = launch_mod.fused_call(buf, weights, 64, y, 2, None, 10.0, True,
                                 Sm100GemmConfig(block_m))

    def error_of(args) -> str:
        try:
            call.fn(*args)
            torch.cuda.synchronize()
        except Exception as e:  # the DSL's runtime error names the CUDA error
            return f"{type(e).__name__}: {e}"
        return ""

    slot = 5  # l1_acts (launch.fused_call's argument order)
    good = call.args[slot]
    # the address the call passes, 8 bytes off (a TMA global address must be 16-byte aligned);
    # set on the pointer's C value, past make_ptr's own alignment assertion
    shifted = make_ptr(good.dtype, good._pointer, cute.AddressSpace.gmem, assumed_align=16)
    shifted._desc.value = good._pointer + 8
    bad_error = error_of(call.args[:slot] + (shifted,) + call.args[slot + 1:])
    good_error = error_of(call.args)
    if not bad_error or bad_error == good_error:
        pytest.skip(f"the descriptor encoding is not reached before the launch here: "
                    f"{good_error[:200]!r}")
    assert good_error, "an sm_100a kernel launched on a GPU that is not a Blackwell"
    assert "InvalidValue" not in good_error and "invalid argument" not in good_error.lower(), \
        good_error[:400]
