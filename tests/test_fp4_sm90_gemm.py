"""The Hopper grouped GEMMs with MXFP4 weights (recipe ``fp8xfp4_sm90``, issue 19): the weights
stay packed e2m1 + UE8M0 per 32 in HBM and are decoded to e4m3 on chip
(`kernels/common/fp4_decode.py`), then the fp8xfp8 WGMMA path runs.

CPU: the kernels compile for sm_90a with the decode (byte permutes, 128-bit shared-memory
accesses, the e4m3 conversions of the rare path) and no spills. GPU: the outputs are bit-identical
to the fp8xfp8 kernels run on the host decode of the same weights
(`quant.fp4_weights_to_fp8_blocks`), including blocks whose per-32 scales span more than e4m3
holds, and match the reference (`testing.gemm_checks`) on the usual routings.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cute_megamoe.config import Sm90GemmConfig

RECIPE = "fp8xfp4_sm90"


def _compile(phase: str, block_m: int, config: Sm90GemmConfig | None = None,
             hidden: int = 7168, inter: int = 2048):
    from cutlass import Int32

    from cute_megamoe.testing.compile import (
        compile_for_arch,
        fake_ptr,
        fake_stream,
        gemm_kernel_for,
    )

    n, k = (2 * inter, hidden) if phase == "l1" else (hidden, inter)
    kernel, dtypes = gemm_kernel_for("sm_90a", RECIPE, phase, 32, 8192, n, k, block_m, config,
                                     activation_clamp=10.0)
    args = [fake_ptr(d, 4 if i == 4 else 16) for i, d in enumerate(dtypes)]
    return kernel, compile_for_arch(kernel, *args, Int32(132), fake_stream(), arch="sm_90a")


@pytest.mark.compile
@pytest.mark.parametrize("phase", ("l1", "l2"))
@pytest.mark.parametrize("block_m", (64, 128))
def test_compiles_sm90_with_the_decode_and_no_spills(phase, block_m):
    kernel, art = _compile(phase, block_m)
    # (BLOCK_M 64: the quarter promotion's m64n64 WGMMAs, `heuristics.DEFAULT_PROMOTION`)
    assert kernel.promotion == ("quarter" if block_m == 64 else "chunk")
    wgmma_n = 64 if block_m == 64 else 128
    assert f"wgmma.mma_async.sync.aligned.m64n{wgmma_n}k32.f32.e4m3.e4m3" in art.ptx
    assert "prmt.b32" in art.ptx and "cvt.rn.satfinite.e4m3x2.f32" in art.ptx
    # (BLOCK_M 128 with no token count: the clusters that share the decode)
    assert kernel.cluster_m == block_m // 64 and kernel.num_stages >= 3
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("QGMMA") > 0
    assert art.count("UTMALDG.2D.MULTICAST") == 0
    # per item (32 codes of a row): one 16-byte load, two 16-byte stores, 4 x 4 permutes
    assert art.count("LDS.128") >= 1 and art.count("STS.128") >= 2
    assert art.count("PRMT") >= 16
    # the upper selectors by mul.hi on the FMA pipe (the decode is ALU-bound), 4 per item;
    # the signs need no permutes in the sm_90a word order: 2 per word + 1 per scale byte
    assert art.count("IMAD.HI") >= 16
    items = kernel.chunks * 128 * 4 // (128 * kernel.decode_wgs)
    # (a cluster's decode has a second path, the shared tiles' one chunk: half the items)
    shared_items = items // 2 if kernel.cluster_m > 1 else 0
    # (+ one per k-block of the consumer loop body, `k_unroll`)
    assert art.count("PRMT") <= 9 * (items + shared_items) + kernel.k_unroll, art.count("PRMT")
    assert art.count("F2FP.SATFINITE.E4M3") > 0
    assert art.count("USETMAXREG") == 3  # producer, decode warpgroup, consumers
    # the packed weights by TMA into their own stages (warp 1), A by warp 0
    assert art.count("UTMALDG.2D") >= 2
    # producer warpgroup, consumers, decode warpgroups (two beside one consumer warpgroup)
    assert kernel.num_threads == 128 * (1 + block_m // 64 + (2 if block_m == 64 else 1))
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


def test_fp4_clusters_share_the_decode_by_expected_tokens():
    """FP4 weights at BLOCK_M 128 run in the 2-CTA clusters that share the decode where fp8xfp8
    runs clusters (256-column tiles), from `SM90_FP4_CLUSTER_MIN_TOKENS` expected tokens per
    expert on (or not knowing the count), single-CTA below and at BLOCK_M 64;
    `Sm90GemmConfig.cluster_m` sets either; clusters and the early tables (which are every
    chunk's) exclude each other."""
    from cute_megamoe.heuristics import SM90_FP4_CLUSTER_MIN_TOKENS as least
    from cute_megamoe.testing.compile import gemm_kernel_for

    def cluster_m(phase, block_m, expected, recipe=RECIPE, config=None):
        n, k = (4096, 7168) if phase == "l1" else (7168, 2048)
        return gemm_kernel_for("sm_90a", recipe, phase, 8, 4096, n, k, block_m, config,
                               expected)[0].cluster_m

    for phase in ("l1", "l2"):
        assert cluster_m(phase, 128, None) == cluster_m(phase, 128, least) == 2
        assert cluster_m(phase, 128, least - 1) == 1
        assert cluster_m(phase, 64, 1000) == 1
        assert cluster_m(phase, 128, least - 1, "fp8xfp8") == 2
    assert cluster_m("l1", 128, 1, config=Sm90GemmConfig(cluster_m=2)) == 2
    with pytest.raises(ValueError, match="cluster_m"):
        cluster_m("l1", 64, 1000, config=Sm90GemmConfig(cluster_m=2))
    # (the early tables are every chunk's: no clusters with them)
    assert cluster_m("l1", 128, None, config=Sm90GemmConfig(early_tables=True)) == 1
    assert cluster_m("l1", 128, None, config=Sm90GemmConfig(cluster_m=1)) == 1
    with pytest.raises(ValueError, match="early_tables"):
        Sm90GemmConfig(cluster_m=2, early_tables=True)


@pytest.mark.compile
@pytest.mark.parametrize("phase", ("l1", "l2"))
def test_shared_decode_compiles_with_one_bulk_copy_to_the_peer(phase):
    """``cluster_m`` 2: at BLOCK_M 128 the FP4 kernels run in 2-CTA clusters; a decode shared
    by the pair sends its chunk to the peer's stage with one shared-to-cluster bulk copy (not
    per-item ``st.async`` stores, which measured 2.4-3.0x slower elsewhere), loads no weight
    tile by TMA multicast, and spills nothing."""
    kernel, art = _compile(phase, 128, Sm90GemmConfig(cluster_m=2))
    assert kernel.cluster_m == 2 and kernel.fp4_weights
    assert "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes" in art.ptx
    assert "st.async" not in art.ptx
    # (a pair that shares the decode loads only its own chunk's codes: the other chunk's bytes
    # come off the packed stage's transaction count)
    assert "mbarrier.complete_tx" in art.ptx
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("STAS") == 0
    assert art.count("UTMALDG.2D.MULTICAST") == 0
    assert art.count("STL") == 0 and art.count("LDL") == 0
    usage = art.resource_usage()
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


def test_fp4_stage_accounting():
    """What the mbarriers expect per stage: the MMA stage A and the scale vectors, the packed
    stage the packed weight bytes, the tile rows' per-32 scale words and the block scales (the
    decode's base exponents); shared memory holds
    the decoded tile in the MMA stage on top; the packed stages take what is left (at least 2)."""
    from cute_megamoe.kernels.sm90_expert_gemm import FP4_MMA_STAGES, SMEM_BUDGET
    from cute_megamoe.testing.compile import gemm_kernel_for

    for phase, n, k in (("l1", 4096, 7168), ("l2", 7168, 2048)):
        for block_m in (64, 128):
            kern, _ = gemm_kernel_for("sm_90a", RECIPE, phase, 8, 4096, n, k, block_m)
            tx = block_m * 128 + 4 * (block_m + kern.sfb_len)
            packed_tx = 256 * 64 + 4 * 256 + 4 * kern.sfb_len
            assert (kern.stage_tx_bytes, kern.packed_tx_bytes) == (tx, packed_tx)
            assert kern.block_n == 256 and kern.b_load_k() == 64
            assert kern.raw_b_bytes() == kern.packed_stages * 256 * 64
            assert kern.sfg_len() == kern.packed_stages * 256
            assert kern.num_stages == FP4_MMA_STAGES and kern.packed_stages >= 3
            mma_ring = kern.num_stages * (tx + 256 * 128 + 64)
            packed_ring = kern.packed_stages * (packed_tx + 16)
            assert mma_ring + packed_ring + kern.staging_bytes <= SMEM_BUDGET
            # no room for one more packed stage
            assert mma_ring + packed_ring + packed_tx + 16 + kern.staging_bytes > SMEM_BUDGET \
                or kern.packed_stages == 8


# ---------------------------------------------------------------------------------- GPU checks

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm90 kernels need a Hopper GPU")
    return torch.device("cuda", torch.cuda.current_device())


def _spread_scales(q: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights whose first 128x128 block of expert 0 has groups 12, 14, 15, 20 and 40
    binades under the block's largest scale: the decode's float path (more than 11 under), exact
    down to 14, rounded onto e4m3's subnormal grid below, zero at 40."""
    w, sf = q
    e, n, words = sf.shape
    sf_bytes = sf.contiguous().view(torch.uint8).view(e, n, words * 4).clone()
    top = int(sf_bytes[0, :128, :4].max())
    for row, (group, below) in enumerate(((1, 12), (2, 14), (3, 15), (1, 20), (2, 40))):
        sf_bytes[0, row, group] = max(top - below, 0)
    return w, sf_bytes.view(torch.int32).view(e, n, words)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,variant", [(64, None), (128, None), (64, "transposed"),
                                             (128, "shared_decode_cluster")])
@pytest.mark.parametrize("spread", (False, True))
def test_bit_identical_to_fp8_kernels_on_the_host_decode(block_m, variant, spread):
    """Same activations through `expert_ffn` with the FP4 weights and with their host decode as
    fp8xfp8 weights: L2 inputs, their scales and the outputs equal bit for bit (every valid row;
    pad rows stay poisoned). ``variant``: the kernels transposed (both sides), or in 2-CTA
    clusters that share the decode (the fp8xfp8 side runs in clusters at BLOCK_M 128 anyway)."""
    from cute_megamoe import quant
    from cute_megamoe.expert_gemm import ExpertWeights, expert_ffn
    from cute_megamoe.scheduler.host_model import pool_block_offsets

    device = _gpu()
    gen = torch.Generator().manual_seed(7 + block_m + spread)
    e, hidden, inter = 5, 1024, 512
    counts = [70, 0, 1, 200, 64]
    offsets = pool_block_offsets(counts, block_m)
    rows = (offsets[-1] + 1) * block_m
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(torch.bfloat16).to(device)
    acts, acts_sf = quant.quantize_activations_for_recipe(x, "fp8xfp8")
    acts_sf = acts_sf.t().contiguous().t()
    topk = torch.rand(rows, generator=gen).to(device)
    w1 = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    q1 = quant.quantize_weights_for_recipe(w1.to(device), "fp8xfp4")
    q2 = quant.quantize_weights_for_recipe(w2.to(device), "fp8xfp4")
    if spread:
        q1, q2 = _spread_scales(q1), _spread_scales(q2)
    fp4 = ExpertWeights.from_quantized(q1, q2, RECIPE, arch="sm_90a")
    fp8 = ExpertWeights.from_quantized(quant.fp4_weights_to_fp8_blocks(q1),
                                       quant.fp4_weights_to_fp8_blocks(q2), "fp8xfp8",
                                       arch="sm_90a")
    count_t = torch.tensor(counts, dtype=torch.int32, device=device)
    results = []
    config = VARIANTS[variant][0] if variant else None
    for weights in (fp4, fp8):
        l2 = torch.full((rows, inter), 0x7F, dtype=torch.uint8, device=device)
        l2_sf = torch.full((inter // 128, rows), float("nan"), device=device).t()
        out = torch.full((rows, hidden), 0x7FFF, dtype=torch.int16, device=device)
        expert_ffn(acts, acts_sf, topk, count_t, weights, block_m=block_m, activation_clamp=7.0,
                   l2_acts=l2.view(torch.float8_e4m3fn), l2_acts_sf=l2_sf,
                   out=out.view(torch.bfloat16), config=config)
        results.append((l2, l2_sf, out))
    torch.cuda.synchronize()
    valid = torch.zeros(rows, dtype=torch.bool, device=device)
    for i, c in enumerate(counts):
        valid[offsets[i] * block_m: offsets[i] * block_m + c] = True
    (l2_a, sf_a, out_a), (l2_b, sf_b, out_b) = results
    assert bool((out_a[~valid] == 0x7FFF).all()), "a pad row was written"
    assert bool((out_a[valid] != 0x7FFF).all()), "a valid row was not written"
    assert torch.equal(l2_a[valid], l2_b[valid])
    assert torch.equal(sf_a[valid].view(torch.int32), sf_b[valid].view(torch.int32))
    assert torch.equal(out_a[valid], out_b[valid])


# variant: (its configuration, BLOCK_M)
VARIANTS = {"transposed": (Sm90GemmConfig(transposed=True), 64),
            "tables_item": (Sm90GemmConfig(decode_tables="item"), 64),
            "tables_item_128": (Sm90GemmConfig(decode_tables="item"), 128),
            "transposed_tables_item": (Sm90GemmConfig(transposed=True, decode_tables="item"),
                                       64),
            "early_tables": (Sm90GemmConfig(early_tables=True), 64),
            "early_tables_128": (Sm90GemmConfig(early_tables=True), 128),
            "transposed_late_tables": (Sm90GemmConfig(transposed=True, early_tables=False), 64),
            "shared_decode_cluster": (Sm90GemmConfig(cluster_m=2), 128)}


@pytest.mark.compile
@pytest.mark.parametrize("transposed,block_m", [(True, 64), (False, 64), (False, 128)])
@pytest.mark.parametrize("phase", ("l1", "l2"))
def test_early_tables_compile_before_the_free_stage_wait(transposed, block_m, phase,
                                                         monkeypatch):
    """``early_tables`` (the transposed kernels' default): the decode warps build a k-block's
    first tables (the vote) once the packed stage is loaded and wait for a free MMA stage after
    it, before the first decoded store; without (the staged kernels' default): that wait comes
    first. The same permutes, no spills."""
    from cute_megamoe.testing.compile import gemm_kernel_for

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    # (single-CTA builds alike)
    config = Sm90GemmConfig(transposed=transposed, cluster_m=None if transposed else 1)
    # the default: on in the transposed kernels, off in the staged ones
    kernel, _ = gemm_kernel_for("sm_90a", RECIPE, phase, 32, 8192, 4096, 7168, block_m, config)
    assert kernel.early_tables == transposed
    arts = {}
    for early in (False, True):
        kernel, arts[early] = _compile(phase, block_m,
                                       dataclasses.replace(config, early_tables=early))
        assert kernel.early_tables == early
    if arts[True].sass is None:
        pytest.skip("nvdisasm not available: PTX only")

    def waits_between_vote_and_store(sass):
        lines = sass.splitlines()
        vote = next(i for i, line in enumerate(lines) if "VOTE.ANY" in line)
        store = next(i for i in range(vote, len(lines)) if "STS.128" in lines[i])
        return sum("SYNCS.PHASECHK.TRANS64.TRYWAIT" in line for line in lines[vote:store])

    assert waits_between_vote_and_store(arts[False].sass) == 0
    assert waits_between_vote_and_store(arts[True].sass) == 1
    assert arts[True].count("PRMT") == arts[False].count("PRMT")
    assert arts[True].count("STL") == 0 and arts[True].resource_usage()["LOCAL"] == 0


@pytest.mark.compile
@pytest.mark.parametrize("transposed", (False, True))
@pytest.mark.parametrize("phase", ("l1", "l2"))
def test_vote_tables_compile_without_item_branches(transposed, phase, monkeypatch):
    """``decode_tables`` "vote" (the default; BLOCK_M 64, staged and transposed, against
    "item"): the decode
    builds a batch's tables by the integer adds and takes the float path behind one warp vote
    (no branch per item on the fast path), the codes of the first `VOTE_AHEAD` items loaded
    before the vote and each later item's while an earlier one decodes; the same permutes, no
    spills."""
    from cute_megamoe.kernels.sm90_expert_gemm import VOTE_AHEAD

    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "0")
    item, base = _compile(phase, 64, Sm90GemmConfig(transposed=transposed, decode_tables="item"))
    kernel, art = _compile(phase, 64, Sm90GemmConfig(transposed=transposed))
    assert (item.decode_tables, kernel.decode_tables) == ("item", "vote")
    assert "vote.sync.any.pred" not in base.ptx
    assert "vote.sync.any.pred" in art.ptx
    if art.sass is None:
        pytest.skip("nvdisasm not available: PTX only")
    assert art.count("VOTE.ANY") >= 1
    assert art.count("PRMT") == base.count("PRMT")
    # (one float path per item either way: four conversions each)
    assert art.count("F2FP.SATFINITE.E4M3") == base.count("F2FP.SATFINITE.E4M3")
    # the first VOTE_AHEAD items' codes load before the vote, the others after it
    lines = art.sass.splitlines()
    vote = next(i for i, line in enumerate(lines) if "VOTE.ANY" in line)
    loop = lines[vote - 80: vote + 200]
    assert sum("LDS.128" in line for line in loop[:80]) == VOTE_AHEAD
    assert sum("LDS.128" in line for line in loop[80:]) >= 1
    assert art.count("STL") == 0 and art.resource_usage()["LOCAL"] == 0
    with pytest.raises(ValueError, match="decode_tables"):
        Sm90GemmConfig(decode_tables="sometimes")


@pytest.mark.gpu
@pytest.mark.parametrize("variant,hidden,inter",
                         [(v, *shape) for shape in ((1024, 512), (1152, 384)) for v in VARIANTS
                          # (1152-column L2 tiles are 128 wide: no clusters, see below)
                          if not (v == "shared_decode_cluster" and shape[0] == 1152)])
@pytest.mark.parametrize("pattern", ("random", "skewed", "sparse", "empty", "one_expert"))
def test_variant_is_bit_identical_to_the_staged_decode(variant, pattern, hidden, inter):
    """The transposed kernels (BLOCK_M 64, loading only the 16-row boxes of received tokens),
    the decode tables' and early tables' options, and the 2-CTA clusters that share the decode
    (BLOCK_M 128: pool blocks of one expert share it, of two experts each decode their own, a
    dummy block past the pool; `Sm90GemmConfig` fields) against the single-CTA staged decode on
    the same FP4 weights and
    pools: L2 inputs, their scales and the outputs equal bit for bit on every valid row, pad
    rows stay poisoned; with routings that leave experts empty, pair pool blocks of
    different experts in a cluster or give one expert everything, and an L2 of 1152 columns
    (one 128-row weight chunk per tile: two m64 blocks transposed, no clusters)."""
    from cute_megamoe.testing.gemm_checks import (
        COUNT_PATTERNS,
        assert_same_valid_rows,
        make_pool_problem,
        run_fp8_ffn_poisoned,
    )

    device = _gpu()
    config, block_m = VARIANTS[variant]
    counts = [0, 0, 0, 389, 0, 0, 0, 0] if pattern == "one_expert" else COUNT_PATTERNS[pattern]
    problem = make_pool_problem(RECIPE, counts, block_m, hidden, inter, device,
                                seed=5 + hidden)
    results = [run_fp8_ffn_poisoned(problem, config=c)
               for c in (Sm90GemmConfig(cluster_m=1), config)]
    assert_same_valid_rows(problem, results)


@pytest.mark.gpu
def test_layer_picks_the_transposed_kernels_by_expected_tokens():
    """The staged layer with MXFP4 weights at BLOCK_M 64 runs the transposed kernels at up to 16
    expected tokens per expert and the staged ones above (`heuristics.select_sm90_transposed`),
    and matches the reference either way."""
    from cute_megamoe import runtime
    from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
    from cute_megamoe.kernels.sm90_expert_gemm import Sm90ExpertGemmKernel
    from cute_megamoe.kernels.sm90_expert_gemm_transposed import Sm90TransposedExpertGemmKernel
    from cute_megamoe.testing.dispatch_checks import Case, check_staged_layer

    _gpu()
    # 8 experts of top-4 (n / 2 expected per expert), a pool size no other test uses
    buf = get_symm_buffer_for_mega_moe(None, 8, 100, 4, 512, 256, mma_type=RECIPE)
    pool_rows = buf.layout.num_pool_rows

    def gemm_kernels():  # this pool's expert-GEMM kernels compiled so far, by class name
        return {type(plan["kernel"]).__name__ for (key, *_), plan in runtime._COMPILED.items()
                if isinstance(key, tuple) and key[:4] == ("expert_gemm", "sm_90a", "l1", RECIPE)
                and key[5] == pool_rows and key[-1] == "plan"}

    assert not gemm_kernels()
    check_staged_layer(buf, Case((16,), "random", 41), 256, 64, torch.device("cuda"),
                       experts="kernels")
    assert gemm_kernels() == {Sm90TransposedExpertGemmKernel.__name__}
    check_staged_layer(buf, Case((100,), "random", 42), 256, 64, torch.device("cuda"),
                       experts="kernels")
    assert gemm_kernels() == {Sm90TransposedExpertGemmKernel.__name__,
                              Sm90ExpertGemmKernel.__name__}


