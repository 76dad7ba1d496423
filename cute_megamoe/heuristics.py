"""Launch heuristics: SM count, BLOCK_M and experts per wave. PROVISIONAL.

These follow DeepGEMM's Mega MoE heuristics (``csrc/jit_kernels/heuristics/mega_moe.hpp`` at
commit 54e2261: a config struct that is the compile key) in spirit, restricted to the block
sizes our kernels implement. The BLOCK_M thresholds are starting points; the kernel
defaults below are measured (docs/performance.md). `default_gemm_config` and
`default_fused_config` fill in the fields a caller's config (`config`) leaves None for a
call's shapes: the complete value a kernel is built from. All functions are pure except
:func:`get_num_sms`, which reads the CUDA device when there is one (the arch comes from
`runtime.get_arch`). Architectures may be given in any spelling `tables.normalize_arch`
takes; the block sizes come from `tables.BLOCK_MS`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .config import L1_RING_ROWS, Sm90FusedConfig, Sm90GemmConfig, Sm100GemmConfig
from .tables import BLOCK_MS, normalize_arch
from .utils import ceil_div

__all__ = [
    "BLOCK_M_CANDIDATES",
    "DEFAULT_NUM_SMS",
    "FUSED_AUTO_MAX_TOKENS",
    "block_m_for_call",
    "default_fused_config",
    "default_gemm_config",
    "default_row_transfer",
    "expected_tokens_per_expert",
    "experts_per_wave",
    "get_num_sms",
    "normalize_arch",
    "select_block_m",
    "select_combine_rounds",
    "select_sm90_transposed",
    "warm_up_token_counts",
]

#: SMs of an H100 / H200 SXM, the default when no GPU is visible.
DEFAULT_NUM_SMS = 132

#: BLOCK_M values each architecture's grouped-GEMM kernels implement (`tables.BLOCK_MS`).
BLOCK_M_CANDIDATES: dict[str, tuple[int, ...]] = BLOCK_MS

# select_block_m thresholds: (largest expected tokens per expert, BLOCK_M), first match wins;
# above the last threshold the largest candidate is used. The +0.5 keeps an exact integer
# expectation (e.g. 16 tokens) on the smaller block, as DeepGEMM does.
#
# sm100 (our tcgen05 kernel: BM 64 runs a 128-row MMA and keeps half, BM 256 is a 2-CTA pair;
# DeepGEMM's 16/32/96/192 blocks are not implemented): 64 up to 64.5, 128 up to 128.5, else 256.
# sm90 (wgmma, 64 rows per consumer warpgroup): 64 up to 64.5, else 128 (measured: BM 64 wins
# up to 64 pairs per expert, BM 128 from 256, docs/performance.md).
_BLOCK_M_THRESHOLDS: dict[str, tuple[tuple[float, int], ...]] = {
    "sm_90a": ((64.5, 64),),
    "sm_100a": ((64.5, 64), (128.5, 128)),
}


def get_num_sms(
    device: torch.device | str | int | None = None, default: int = DEFAULT_NUM_SMS
) -> int:
    """Number of SMs of ``device`` (the current CUDA device if None); ``default`` without CUDA."""
    if not torch.cuda.is_available():
        return default
    if device is None:
        device = torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def expected_tokens_per_expert(
    num_tokens: int, num_ranks: int, num_topk: int, num_experts: int
) -> float:
    """Expected (token, slot) pairs per expert under uniform routing: ``n * R * K / E``.

    ``num_tokens`` is this call's tokens per rank. Equivalently ``n * K / E_l``.
    """
    if num_experts < 1 or num_ranks < 1:
        raise ValueError("num_experts and num_ranks must be >= 1")
    if num_tokens < 0 or num_topk < 0:
        raise ValueError("num_tokens and num_topk must be >= 0")
    return num_tokens * num_ranks * num_topk / num_experts


def select_block_m(expected_tokens_per_expert: float, arch: str) -> int:
    """BLOCK_M for a call with this many expected tokens per expert (see the thresholds above).

    Small experts get small blocks (less padding, more tiles to spread over the SMs); large
    experts get the largest block (fewer weight re-reads per token).
    """
    key = normalize_arch(arch)
    if expected_tokens_per_expert < 0 or math.isnan(expected_tokens_per_expert):
        raise ValueError(
            f"expected_tokens_per_expert must be >= 0, got {expected_tokens_per_expert}"
        )
    for limit, block_m in _BLOCK_M_THRESHOLDS[key]:
        if expected_tokens_per_expert <= limit:
            return block_m
    return BLOCK_M_CANDIDATES[key][-1]


def block_m_for_call(
    num_tokens: int, num_ranks: int, num_topk: int, num_experts: int, arch: str
) -> int:
    """The BLOCK_M of a call with ``num_tokens`` tokens on this rank when none is given: what
    every entry point (`staged.dispatch`, `staged.staged_mega_moe`, `api.mega_moe`,
    `cute_megamoe.MegaMoE`) uses by default. Ranks may choose differently."""
    return select_block_m(
        expected_tokens_per_expert(num_tokens, num_ranks, num_topk, num_experts), arch
    )


def select_cluster_m(arch: str, phase: str, block_m: int, n: int) -> int:
    """CTAs per cluster along M for a grouped GEMM of output width ``n`` on ``arch``.

    sm90: 2 at BLOCK_M 128 with 256-column tiles (the two CTAs of a cluster work on
    neighbouring pool blocks and multicast the weight tile when both blocks are one expert's),
    in both GEMMs, else 1. The pair runs in lockstep, so the weight tile it shares is read
    from DRAM once; without it, CTAs drift apart and L1 read 1.35-2.2x the minimum DRAM bytes
    (ncu, 2026-11-30; the GPU is power-bound, so DRAM traffic costs clock speed). Measured
    interleaved on an H200 (docs/performance.md). At BLOCK_M 64 (decode sizes, about one
    block per expert) neighbouring blocks rarely share an expert. sm100 pairs CTAs through
    its 2-CTA MMA at BLOCK_M 256 instead: 1 here.
    """
    if normalize_arch(arch) == "sm_90a" and block_m == 128 and n % 256 == 0:
        return 2
    return 1



#: Largest expected tokens per expert at which the sm_90a FP8 grouped GEMMs run transposed
#: (`select_sm90_transposed`); +0.5 as in `_BLOCK_M_THRESHOLDS`.
SM90_TRANSPOSED_MAX_TOKENS = 16.5


def select_sm90_transposed(recipe: str, block_m: int,
                           expected_tokens_per_expert: float | None) -> bool:
    """Whether the sm_90a grouped GEMMs run transposed (`sm90_expert_gemm_transposed`: the
    weight tile as the WGMMA's A, the pool rows in 16-token sub-blocks) rather than staged.

    For FP8 activations (``fp8xfp8``, ``fp8xfp4_sm90``) at BLOCK_M 64 with at most 16 expected
    tokens per expert. Interleaved A/Bs on an H200 (docs/performance.md): MXFP4 weights, since
    the transposed consumer's uniform WGMMA descriptors (2026-12-02): the expert FFN took 0.78x
    the staged kernels' time at 128 experts x 16 pairs, 1.04x at x 32; the layer 0.935x at 16
    expected tokens per expert (random routing), 1.23x at 32. fp8xfp8 since the received-row
    boxes (2026-12-04, three runs): 0.970-0.979x at 128 x 8 and x 16 (a pool block's A rows
    come in 16-row boxes of received tokens only: about 15 % fewer bytes per k-block into
    shared memory), 1.04x at x 32. None (the caller does not know its token count): staged.
    `Sm90GemmConfig.transposed` overrides this. Ranks may choose differently: the expert GEMMs
    are rank-local and both kernels write the same bits (GPU-tested).
    """
    return (recipe in ("fp8xfp8", "fp8xfp4_sm90") and block_m == 64
            and expected_tokens_per_expert is not None
            and expected_tokens_per_expert <= SM90_TRANSPOSED_MAX_TOKENS)

#: Smallest expected tokens per expert at which the sm_90a MXFP4 grouped GEMMs at BLOCK_M 128
#: share the decode in 2-CTA clusters (`select_sm90_fp4_cluster`).
SM90_FP4_CLUSTER_MIN_TOKENS = 192


def select_sm90_fp4_cluster(recipe: str, block_m: int,
                            expected_tokens_per_expert: float | None) -> bool:
    """Whether the sm_90a grouped GEMMs with MXFP4 weights (``fp8xfp4_sm90``) run in 2-CTA
    clusters that share the decode of a weight tile (`Sm90ExpertGemmKernel`, ``cluster_m`` 2):
    at BLOCK_M 128 (256-column tiles) with at least `SM90_FP4_CLUSTER_MIN_TOKENS` expected
    tokens per expert, or when the caller does not know its count (None: BLOCK_M 128 is a
    large-M choice). The pair shares only the tiles whose two pool blocks are one expert's;
    with fewer tokens per expert most pairs hold two experts, decode both chunks each and only
    add the pair's lockstep. Interleaved A/Bs on an H200 (docs/performance.md, 2026-12-04): the
    expert FFN with experts of 192-1024 tokens took 0.79-0.94x the single-CTA time, with one
    pool block per expert (96, 128 tokens) 1.04-1.05x; the layer with random routing 0.883x at
    192 expected tokens per expert (every expert two blocks; a tie in another process),
    0.989-1.003x at 256-512 (pairs straddle experts after one with an odd block count; 0.978x /
    0.942x at 256 / 512 in a later process). Laying the pool out in 256-row blocks, so that no
    pair straddles, took 1.19x / 1.07x the layer's time at 256 / 512 (12-04T13:10Z: the empty
    tiles cost more than the pairs gain; deleted, in git before the configuration values).
    `Sm90GemmConfig.cluster_m` overrides this. Ranks may choose differently: rank-local, the
    same bits (GPU-tested)."""
    return (recipe == "fp8xfp4_sm90" and block_m == 128
            and (expected_tokens_per_expert is None
                 or expected_tokens_per_expert >= SM90_FP4_CLUSTER_MIN_TOKENS))


# ----------------------------------------------------------------------------- kernel defaults
# (measured on an H200: docs/performance.md; each table's variants lost their A/B or are the
# defaults of another kernel or shape)

#: sm_90a FP8 promotion by (recipe, BLOCK_M); "chunk" where not listed. Measured interleaved
#: (expert FFN, H 7168, I 2048): fp8xfp8 "quarter" 0.93-0.97x the time of "chunk" at BLOCK_M 64
#: (one consumer warpgroup: nothing else fills the tensor cores while it promotes), 0.98-1.06x
#: at 128 (the second warpgroup already does; m64n64 WGMMAs cost more issue); fp8xfp4_sm90 at
#: 64 (the staged kernels, 32-64 pairs per expert; the transposed ones at decode sizes keep
#: chunk) 0.940-0.972x the time in two processes on 2026-12-04, the layer at 512 / 1024 tokens
#: 0.984-0.991x / 0.987x: there the consumer paces the kernel, the decode warps waiting for its
#: free stages (on 12-01, with a slower decode that set the pace, quarter took 1.20-1.29x: its
#: issue slots were the decode's). The fused kernel's MXFP4 experiment keeps chunk (quarter is
#: not measured there).
DEFAULT_PROMOTION = {("fp8xfp8", 64): "quarter", ("fp8xfp4_sm90", 64): "quarter"}
#: k-blocks per body of the sm_90a FP8 consumer loop by (recipe, BLOCK_M) with the chunk
#: promotion; 1 where not listed and with quarters. Measured interleaved (expert FFN, H 7168,
#: I 2048): fp8xfp8 at BLOCK_M 128, 4: 0.908-0.951x the time of 1 at 256 x 256, 0.920-0.986x at
#: 32 x 1024 (ncu L1 at 32 x 1024: tensor pipe 82.5 % busy against 75.8 %); 8 took about 2x
#: (ncu L1: 28 % busy, not diagnosed); at BLOCK_M 64 (the quarter promotion) 4 took
#: 1.02-1.19x, and with MXFP4 weights 1.03-1.09x. The fused kernel takes the same (its layer at
#: R = 1: 0.968-0.971x the time of 1 at 4096-8192 tokens, BLOCK_M 128).
DEFAULT_K_UNROLL = {("fp8xfp8", 128): 4}
#: MXFP4 weights in the 2-CTA clusters that share the decode (BLOCK_M 128): 2, measured in
#: three processes: 0.955-0.975x the time of 1 at 256 x 256, 0.963-1.009x at 64 x 512 and
#: 0.977-1.009x at 32 x 1024 (4: 1.04-1.10x).
SHARED_DECODE_K_UNROLL = 2
#: fp8xfp8 rows into a tensor by TMA tensor stores of swizzled boxes (the grouped GEMMs; the
#: fused kernel's L1 sends rows). Measured interleaved (expert FFN, H 7168, I 2048):
#: 0.952-0.960x the time of the row copies at 256 x 256, 0.956-0.977x at 32 x 1024 (BLOCK_M 128
#: and 64); ncu L2 at 32 x 1024: tensor pipe 76.8 % busy against 71.6 %.
DEFAULT_TMA_STORE = True
#: MXFP4 weights: the decode's first batch of a k-block before the wait for a free MMA stage,
#: in the staged kernel. Measured interleaved: at BLOCK_M 128 0.994-0.997x the time at decode
#: sizes but 1.025x / 1.085x at 256 x 256 / 32 x 1024, at BLOCK_M 64 staged 0.994-1.001x; on
#: in the transposed kernel (0.981-1.006x at 128 x 8 / 16 in two runs, the layer 0.989-0.993x
#: at 32 / 128 tokens).
DEFAULT_EARLY_TABLES = False
#: the sm_90a fused kernel's decode tables (its MXFP4 experiment): a branch per item, as it was
#: measured (the grouped GEMMs' "vote" is not measured in the fused kernel).
FUSED_DECODE_TABLES = "item"
#: how the fused kernel's L2 sends its rows to the combine buffers (the grouped GEMMs keep
#: "bulk"): the lanes' 16-byte stores, which leave the TMA unit to the ring's loads. Measured
#: against bulk row copies (fused layer, R = 1, graph time): FP8 0.975-0.992x at 4096 tokens
#: and 0.986-0.989x at 8192 in four runs, BF16 0.959x / 0.994x.
FUSED_ROW_STORES = "lanes"
#: the most tokens per rank for which ``CUTE_MEGAMOE_FUSED=auto`` runs a one-rank call as the
#: fused kernel; larger calls run the staged kernels. Fused / staged graph time, DeepSeek-V3
#: shape, R = 1: 1 x H200 0.83-0.99x at 1 token, 0.99-1.00x at 128, 1.00-1.02x at 512-8192
#: (`layer-20261202T095203.json`, `layer-20261203T110451.json`, `layer-20261207T180425.json`);
#: 1 x H100 1.15x at 8192 (`layer-20261207T222459.json`). The fused kernel gains only where
#: its one launch saves the staged layer's launch gaps.
FUSED_AUTO_MAX_TOKENS = 128

#: how the fused kernel's CTAs take their GEMM tiles: "phases" (every L1 tile, then every L2
#: tile) until the ticket walk of the dataflow design has been measured against it on a GPU.
FUSED_WALK = "phases"
#: how the fused kernel reduces its tokens (`config.COMBINES`): once every rank's tiles are
#: done ("barriers"), until the per-token combine has run on a GPU
FUSED_COMBINE = "barriers"
#: the ticket walk's bands of pool blocks by BLOCK_M (`config.WALK_BANDS`): at 128, bands of 8
#: blocks of one expert, each weight tile read once (the dataflow model); at 8192 tokens on an
#: H100 they took 0.70x the time of one-block bands (6835 / 9818 us, graph,
#: `layer-20261207T222459.json`). At 64 (about a block per expert) one block, not measured.
FUSED_WALK_BAND = {64: 1, 128: 8}
#: the ticket walk's lag in grids of tiles (`config.LAG_GRIDS`) by band: `dataflow_lag` counts
#: full bands, and a call of 2048-4096 tokens has 1.5-2.5 blocks per expert, so bands of 8
#: take 16 (6 bands; the model: within 1.005x of the bound from 2048 tokens), others 2
FUSED_LAG_GRIDS = {8: 16}
FUSED_LAG_GRIDS_OTHERWISE = 2
#: the ticket walk's L1-output ring (`config.L1_RING_ROWS`): none, the whole pool, until a ring
#: has been measured against it on a GPU
FUSED_L1_RING_ROWS = 0
#: The fused kernel's row transfer follows the buffer's token capacity, which every rank shares
#: (the two protocols must not mix): "counted" up to this many tokens per rank (decode
#: buffers), "barrier" above. At R = 1, layer calls back to back in one process (CUDA graphs),
#: "counted" against "barrier": 0.96x at 1 token, 0.99x at 128 and 512, 0.97x at 1024, 1.01x
#: at 2048, 1.02-1.03x at 4096-8192. (Moving the rows during the GEMMs, by the producer
#: warpgroup's spare warps, took 1.01-1.04x at 4096-8192: its senders slow the tensor-bound L1
#: tiles; deleted.) The MXFP4 experiment keeps "barrier": its loopback test mixing the counted
#: rows failed on 2026-12-02 and passed on 12-04 after the test warm-up fix, and counted rows
#: are not measured there.
COUNTED_ROWS_MAX_TOKENS = 1024
#: The fused kernel's local dispatch (one rank) is the default for buffers of at most this
#: many tokens: each CTA quantizes its pairs' rows itself (a token's once per pair), which
#: pays at decode sizes and costs beyond. At 128 experts, top-8, H 7168 (graph, against the
#: exchanged dispatch in the same run): 0.95x at 1 token, 0.99x at 8, 1.00x at 128, 1.01x at
#: 512, 1.02x at 1024.
LOCAL_MAX_TOKENS = 256


def default_row_transfer(layout) -> str:
    """The fused kernel's row transfer on the buffer ``layout`` (a `MegaMoELayout`) when none
    is configured (see `COUNTED_ROWS_MAX_TOKENS`); "pulled" on a buffer whose received rows
    are a ring (`MegaMoELayout.received_rows`), the one transfer that runs on it."""
    if layout.num_received_rows < layout.num_pool_rows:
        return "pulled"
    if layout.recipe == "fp8xfp4_sm90":
        return "barrier"
    return "counted" if layout.num_max_tokens_per_rank <= COUNTED_ROWS_MAX_TOKENS else "barrier"


def _check_block_m(config, block_m: int) -> None:
    if config.block_m is not None and config.block_m != block_m:
        raise ValueError(f"{type(config).__name__}.block_m: {config.block_m}, but the call runs "
                         f"BLOCK_M {block_m}")


def default_gemm_config(arch: str, recipe: str, phase: str, n: int, block_m: int,
                        expected_tokens_per_expert: float | None, to_combine: bool,
                        config: Sm90GemmConfig | Sm100GemmConfig | None = None
                        ) -> Sm90GemmConfig | Sm100GemmConfig:
    """The complete configuration of one grouped GEMM of ``arch`` (``phase`` "l1" / "l2", ``n``
    output columns, rows to the combine buffers with ``to_combine``) at ``block_m`` for a call
    with this many expected tokens per expert (None: unknown): the fields ``config`` sets, the
    heuristics' choice for the rest. A field that does not apply to this GEMM takes its fixed
    value: the MXFP4 fields without MXFP4 weights, ``promotion`` and ``k_unroll`` with BF16,
    ``tma_store`` but for fp8xfp8 rows into a tensor, ``row_stores`` but for the combine
    buffers."""
    if normalize_arch(arch) == "sm_100a":
        config = config or Sm100GemmConfig()
        if not isinstance(config, Sm100GemmConfig):
            raise ValueError(f"config: an Sm100GemmConfig on sm_100a, got "
                             f"{type(config).__name__}")
        _check_block_m(config, block_m)
        return Sm100GemmConfig(block_m)
    config = config or Sm90GemmConfig()
    if not isinstance(config, Sm90GemmConfig):
        raise ValueError(f"config: an Sm90GemmConfig on sm_90a, got {type(config).__name__}")
    _check_block_m(config, block_m)
    config = replace(config, block_m=block_m)
    fp4 = recipe == "fp8xfp4_sm90"
    fp8 = recipe != "bf16xbf16"
    decode_tables = (config.decode_tables or "vote") if fp4 else "vote"
    transposed = config.transposed
    if transposed is None:
        transposed = (config.allows_transposed()
                      and select_sm90_transposed(recipe, block_m, expected_tokens_per_expert))
    if transposed:
        early = True if config.early_tables is None or not fp4 else config.early_tables
        return replace(config, cluster_m=1, transposed=True, promotion="chunk", k_unroll=1,
                       tma_store=False, row_stores="bulk", decode_tables=decode_tables,
                       early_tables=early)
    early = DEFAULT_EARLY_TABLES if not fp4 or config.early_tables is None \
        else config.early_tables
    cluster_m = config.cluster_m
    if cluster_m is None:
        cluster_m = select_cluster_m("sm_90a", phase, block_m, n)
        if fp4 and (early or not select_sm90_fp4_cluster(recipe, block_m,
                                                          expected_tokens_per_expert)):
            cluster_m = 1  # (MXFP4: clusters only where they share the decode)
    promotion = (config.promotion or DEFAULT_PROMOTION.get((recipe, block_m), "chunk")) \
        if fp8 else "chunk"
    k_unroll = config.k_unroll if fp8 else None
    if k_unroll is None:
        k_unroll = DEFAULT_K_UNROLL.get((recipe, block_m), 1) if promotion == "chunk" else 1
        if fp4 and cluster_m == 2 and promotion == "chunk":
            k_unroll = SHARED_DECODE_K_UNROLL
    into_tensor = recipe == "fp8xfp8" and not to_combine
    tma_store = (DEFAULT_TMA_STORE if config.tma_store is None else config.tma_store) \
        if into_tensor else False
    row_stores = (config.row_stores or "bulk") if to_combine else "bulk"
    return replace(config, cluster_m=cluster_m, transposed=False, promotion=promotion,
                   k_unroll=k_unroll, tma_store=tma_store, row_stores=row_stores,
                   decode_tables=decode_tables, early_tables=early)


def default_fused_config(layout, block_m: int, given_x: bool,
                         config: Sm90FusedConfig | None = None) -> Sm90FusedConfig:
    """The complete configuration of the sm_90a fused kernel on the buffer ``layout`` (a
    `MegaMoELayout`) at ``block_m``, for calls that give ``x`` (``given_x``; else the caller
    staged the rows): the fields ``config`` sets, the heuristics' choice for the rest.

    The defaults: the row transfer by the buffer's token capacity and rings
    (`default_row_transfer`); the combine `FUSED_COMBINE`; the walk `FUSED_WALK`, but
    "tickets" where the rows are pulled, the tokens combined one by one or the buffer keeps
    the L1 outputs in a ring (`MegaMoELayout.l1_output_rows`; the ring then the region's
    rows); the kernel stages the caller's ``x`` itself (the MXFP4 experiment launches the
    staging, as it was measured); the local dispatch for one-rank buffers of at most
    `LOCAL_MAX_TOKENS` tokens with counted rows that stage their inputs (not with the
    per-token combine); ``weights_first`` with counted rows at BLOCK_M 64 (1 token 108 us
    graph against 114 at R = 1; with barrier rows, loading the weights first for every
    waiting tile delayed the ready tiles' first stages, 1.02-1.04x at 4096-8192; at
    BLOCK_M 128 the producer warp's 40 registers spill 3 with it); the grouped GEMMs'
    promotion and loop unroll (MXFP4: chunk), `FUSED_ROW_STORES`, `FUSED_DECODE_TABLES`."""
    config = config or Sm90FusedConfig()
    if not isinstance(config, Sm90FusedConfig):
        raise ValueError(f"config: an Sm90FusedConfig, got {type(config).__name__}")
    _check_block_m(config, block_m)
    recipe = layout.recipe
    fp4 = recipe == "fp8xfp4_sm90"
    fp8 = recipe != "bf16xbf16"
    row_transfer = config.row_transfer or default_row_transfer(layout)
    stages = given_x and (not fp4 if config.stages_inputs is None else config.stages_inputs)
    combine = config.combine or FUSED_COMBINE
    local = config.local_dispatch
    if local is None:
        local = (layout.num_ranks == 1 and row_transfer == "counted" and stages and not fp4
                 and layout.num_max_tokens_per_rank <= LOCAL_MAX_TOKENS
                 and combine != "tokens")
    out_ring = layout.num_l1_output_rows < layout.num_pool_rows
    walk = config.walk or ("tickets" if row_transfer == "pulled" or out_ring
                           or combine == "tokens" else FUSED_WALK)
    l1_ring_rows = config.l1_ring_rows
    if l1_ring_rows is None and walk != "tickets":
        l1_ring_rows = FUSED_L1_RING_ROWS  # (a ring buffer then refuses the walk, naming why)
    elif l1_ring_rows is None:
        # (the largest ring of `config.L1_RING_ROWS` the buffer's region holds)
        l1_ring_rows = max((r for r in L1_RING_ROWS if 0 < r <= layout.num_l1_output_rows),
                           default=0) if out_ring else FUSED_L1_RING_ROWS
    band = config.band or FUSED_WALK_BAND[block_m]
    weights_first = config.weights_first
    if weights_first is None:
        weights_first = row_transfer == "counted" and block_m == 64
    promotion = (config.promotion or ("chunk" if fp4 else
                                      DEFAULT_PROMOTION.get((recipe, block_m), "chunk"))) \
        if fp8 else "chunk"
    k_unroll = config.k_unroll if fp8 else None
    if k_unroll is None:
        k_unroll = DEFAULT_K_UNROLL.get((recipe, block_m), 1) if promotion == "chunk" else 1
    return replace(config, block_m=block_m, row_transfer=row_transfer,
                   weights_first=weights_first, stages_inputs=stages, local_dispatch=local,
                   promotion=promotion, k_unroll=k_unroll,
                   row_stores=config.row_stores or FUSED_ROW_STORES,
                   decode_tables=(config.decode_tables or FUSED_DECODE_TABLES) if fp4
                   else FUSED_DECODE_TABLES, walk=walk,
                   lag_grids=config.lag_grids or FUSED_LAG_GRIDS.get(
                       band, FUSED_LAG_GRIDS_OTHERWISE), band=band, l1_ring_rows=l1_ring_rows,
                   combine=combine)


#: Rounds of the pool-order combine (token classes per round, of 8) by tokens on the rank:
#: (fewest tokens, rounds), last match wins. Interleaved A/Bs on 2 x H200
#: (docs/performance.md): one round fastest up to 1024 tokens; 4 equal rounds at 2048 and 4096;
#: at 8192, 5 rounds with two small last ones 3 % faster than 4 (less reduction after the sends).
_COMBINE_ROUNDS = ((0, (8,)), (2048, (2, 2, 2, 2)), (8192, (2, 2, 2, 1, 1)))


def select_combine_rounds(num_tokens: int) -> tuple[int, ...]:
    """Rounds of the pool-order combine for a rank with `num_tokens` tokens (see
    `kernels.combine`): reducing round c - 1 while round c's rows move hides the reduction at
    large batches; at small ones each round's barrier costs more than it hides. Ranks may
    choose differently."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return [rounds for least, rounds in _COMBINE_ROUNDS if num_tokens >= least][-1]


def warm_up_token_counts(max_tokens: int) -> tuple[int, ...]:
    """Token counts per rank whose calls, at one BLOCK_M, load every kernel that a call of 0 to
    ``max_tokens`` tokens per rank can pick (for a loopback group's warm-up, where a kernel's
    first launch waits for the running ones: `testing.protocol_checks.Ranks`). The choices
    that follow the token count are steps over it: the sm_90a FP8 GEMMs run transposed up to
    `SM90_TRANSPOSED_MAX_TOKENS` per expert (`select_sm90_transposed`), the combine's rounds
    change at the counts of `select_combine_rounds`; so one token, each step's count in range
    and ``max_tokens`` cover them all."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    steps = {least for least, _ in _COMBINE_ROUNDS if 1 < least <= max_tokens}
    return tuple(sorted({1, max_tokens} | steps))


def experts_per_wave(
    num_tokens: int,
    num_topk: int,
    num_local_experts: int,
    intermediate_hidden: int,
    block_m: int,
    num_sms: int,
    block_n: int = 128,
    max_experts_per_wave: int | None = None,
) -> int:
    """How many local experts one wave covers (DeepGEMM's rule, reference doc section 7.3).

    A wave's L2 tiles may start as soon as their rows' L1 tiles finish, so a wave must hold
    enough L1 tiles to keep every SM busy, but a smaller wave keeps the weights of fewer experts
    hot in L2 cache. With ``e = n * K / E_l`` expected tokens per local expert and
    ``l1 = max(ceil(ceil(e) / BM), 1) * (2I / BN)`` expected L1 tiles per expert:

    * ``m_min = ceil(2 * S / l1)`` experts fill all SMs twice (imbalance factor 2); with fewer
      than one expected token per expert, ``m_min = E_l`` (one wave of everything);
    * ``m_max = max_experts_per_wave`` (a pool capacity cap; our pool holds every expert, so it
      defaults to ``E_l``); if ``m_min >= m_max`` return ``m_max``;
    * if one expert alone fills the GPU (``l1 >= S``) return ``m_min``;
    * otherwise pick ``E_w`` in ``[m_min, min(m_max, 2 * m_min)]`` maximising the last wave's
      fill ``tail = 1 if E_l % E_w == 0 else (E_l % E_w) / E_w`` (first maximum wins).
    """
    for name, value in (
        ("num_topk", num_topk),
        ("num_local_experts", num_local_experts),
        ("intermediate_hidden", intermediate_hidden),
        ("block_m", block_m),
        ("num_sms", num_sms),
        ("block_n", block_n),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if (2 * intermediate_hidden) % block_n != 0:
        raise ValueError(
            f"2 * intermediate_hidden ({2 * intermediate_hidden}) must be a multiple of "
            f"block_n ({block_n})"
        )
    m_max = num_local_experts if max_experts_per_wave is None else max_experts_per_wave
    if not 1 <= m_max <= num_local_experts:
        raise ValueError(
            f"max_experts_per_wave must be in [1, {num_local_experts}], got {max_experts_per_wave}"
        )

    e = num_tokens * num_topk / num_local_experts
    l1 = max(ceil_div(math.ceil(e), block_m), 1) * (2 * intermediate_hidden // block_n)
    m_min = num_local_experts if e < 1 else ceil_div(2 * num_sms, l1)
    if m_min >= m_max:
        return m_max
    if l1 >= num_sms:
        return m_min

    def tail(ew: int) -> float:
        rem = num_local_experts % ew
        return 1.0 if rem == 0 else rem / ew

    best, best_tail = m_min, -1.0
    for ew in range(m_min, min(m_max, 2 * m_min) + 1):
        t = tail(ew)
        if t > best_tail:
            best, best_tail = ew, t
    return best
