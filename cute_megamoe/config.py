"""Kernel and layer configurations: frozen, hashable values that check their own fields.

    cfg = LayerConfig(gemm=Sm90GemmConfig(promotion="chunk"))    # the rest: the heuristics
    y = staged.staged_mega_moe(buf, x, topk_idx, topk_weights, weights, config=cfg)

A field left None is the heuristics' choice for the call (`heuristics.default_gemm_config`,
`heuristics.default_fused_config`), which fill in every None field of a config for a call's
shapes and return a complete value; a kernel is built from a complete one, and the compile
cache (`runtime.compiled_kernel`) and the layer plans are keyed by it. A field set by the
caller is kept as given, and the heuristics choose the rest around it. Each config raises
`ValueError` naming the field and its value when a field, or a pair of fields, cannot be built.

* `Sm90GemmConfig`: an sm_90a grouped GEMM (`kernels/sm90_expert_gemm.py`, transposed:
  `kernels/sm90_expert_gemm_transposed.py`); one value configures both GEMMs of the expert FFN.
* `Sm100GemmConfig`: an sm_100a grouped GEMM (`kernels/sm100_expert_gemm.py`).
* `Sm90FusedConfig`: the sm_90a fused layer kernel (`kernels/sm90_mega_moe.py`).
* `LayerConfig`: a layer call (`staged.staged_mega_moe`, `fused.fused_mega_moe`, `api.mega_moe`,
  `MegaMoE`, the DeepGEMM entry points): fused or staged, and the two above.

Settings that change the bits (the activation clamp, ``fast_math``) or that every rank must
share (``transfer``, ``l2_sends``) are call arguments, not configuration: every field here is
free per rank and gives the same outputs (row transfers: see `Sm90FusedConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = [
    "COMBINES",
    "DEBUG_MODES",
    "DEBUG_TENSOR_MODES",
    "DECODE_TABLES",
    "K_UNROLLS",
    "L1_RING_ROWS",
    "LAG_GRIDS",
    "WALK_BANDS",
    "PROMOTIONS",
    "ROW_STORES",
    "ROW_TRANSFERS",
    "WALKS",
    "LayerConfig",
    "Sm100GemmConfig",
    "Sm90FusedConfig",
    "Sm90GemmConfig",
]

#: FP8 promotion of the sm_90a GEMMs' scratch accumulators: per 128-column chunk, or per
#: 64-column quarter, each promoted while the next quarter's WGMMAs run
PROMOTIONS = ("chunk", "quarter")
#: k-blocks per body of the sm_90a FP8 consumer loop
K_UNROLLS = (1, 2, 4)
#: how an sm_90a L2 sends its rows to the combine buffers: a bulk copy per row through the
#: SM's TMA unit, or the warp's lanes 16 bytes apart
ROW_STORES = ("bulk", "lanes")
#: how the sm_90a decode of MXFP4 weights builds a batch's tables: a branch per item, or the
#: integer adds for the batch with the float path behind one warp vote
DECODE_TABLES = ("item", "vote")
#: how the sm_90a fused kernel moves the rows: every rank meets once they moved ("barrier"),
#: or each row is counted into its pool block and an L1 tile starts once its block is
#: complete, the rows pushed by their sources ("counted") or pulled by the destination's own
#: puller warps in its pool order ("pulled": with walk "tickets"; the one transfer that runs on
#: a buffer whose received rows are a ring, `MegaMoELayout.received_rows`)
ROW_TRANSFERS = ("barrier", "counted", "pulled")
#: how the sm_90a fused kernel's CTAs walk the GEMM tiles: "phases", CTA c takes tiles c,
#: c + G, ... of every L1 tile followed by every L2 tile; "tickets", the lag-ordered L1 / L2
#: sequence of the dataflow design (docs/notes/dataflow.md), each CTA taking its next position
#: with one atomic add
WALKS = ("phases", "tickets")
#: the ticket walk's lag, in grids' worth of tiles between a pool block's first L1 and first L2
#: position (`scheduler.host_model.dataflow_lag`; full bands: with bands of 8 a call of about
#: 2.5 blocks per expert needs 16 for a lag of 6 bands, the model's choice from 2048 tokens)
LAG_GRIDS = (1, 2, 3, 4, 6, 8, 16)
#: the ticket walk's bands: pool blocks whose tiles take each weight tile at neighbouring
#: positions (`scheduler.host_model.dataflow_sequence`)
WALK_BANDS = (1, 2, 3, 4, 8)
#: the ticket walk's L1-output ring, in pool rows (a multiple of both BLOCK_Ms): an L1 tile
#: stores its block's rows in slot ``block mod (rows / BLOCK_M)`` once the L2 tiles of the
#: block before in that slot have read theirs (docs/notes/dataflow.md, W2); 0: the whole pool
L1_RING_ROWS = (0, 1024, 2048, 4096, 8192)
#: how the sm_90a fused kernel reduces its tokens: every CTA once every rank's tiles are done
#: (the split barriers, "barriers"), or each token once its own L2 rows are in ("tokens": the
#: last L2 tile of a pool block signals its rows' tokens in their source ranks'
#: `token_arrivals`; with walk "tickets" and the exchanged dispatch; every rank of a call
#: must use the same, or a "tokens" rank's wait for a token times out)
COMBINES = ("barriers", "tokens")
#: the fused kernel's diagnostics: each CTA's phase boundaries (`sm90_mega_moe.PHASE_STAMPS`),
#: or every CTA's tiles (`testing.fused_checks.check_tile_walk`), or with the ticket walk each
#: tile's start and end (`sm90_mega_moe.TILE_CLOCK_TILES`), into the launch's debug tensor
DEBUG_MODES = ("phase_clock", "tile_log", "tile_clock", "hold_cta", "late_consumers")
#: the debug modes that write into a tensor the launch passes (the others are test builds with
#: an injected delay, `kernels/sm90_mega_moe.py`: "hold_cta", "late_consumers")
DEBUG_TENSOR_MODES = ("phase_clock", "tile_log", "tile_clock")


def _check_bool(cls: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{cls}.{name}: None, True or False, got {value!r}")


def _check_choice(cls: str, name: str, value: object, choices: tuple) -> None:
    if value is not None and (isinstance(value, bool) or value not in choices):
        raise ValueError(f"{cls}.{name}: None or one of {choices}, got {value!r}")


class _Config:
    """What the configs share: their fields' checks, and which fields the heuristics still have
    to choose."""

    #: the fields that take None or one of their choices, and those that take None or a bool
    _choices: dict[str, tuple] = {}
    _flags: tuple[str, ...] = ()
    #: the fields None leaves off rather than to the heuristics
    _optional: tuple[str, ...] = ()

    def _check_fields(self) -> None:
        name = type(self).__name__
        for field, choices in self._choices.items():
            _check_choice(name, field, getattr(self, field), choices)
        for flag in self._flags:
            _check_bool(name, flag, getattr(self, flag))

    def missing(self) -> tuple[str, ...]:
        """The fields left None (to the heuristics)."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is None
                     and f.name not in self._optional)

    def check_complete(self, what: str) -> None:
        """Raise `ValueError` naming the fields left None: ``what`` is built from complete
        configs only (`heuristics` fills them in)."""
        missing = self.missing()
        if missing:
            raise ValueError(f"{what}: {type(self).__name__} fields {missing} are None; "
                             f"complete it with heuristics first")


@dataclass(frozen=True)
class Sm90GemmConfig(_Config):
    """One sm_90a grouped GEMM of the expert FFN (`kernels/sm90_expert_gemm.py`). Every field
    None: the heuristics' choice (`heuristics.default_gemm_config`), per GEMM.

    block_m: pool rows per tile, 64 or 128.
    cluster_m: CTAs per cluster along M, 1 or 2 (2: the pair shares the weight tile; 256-column
        tiles).
    transposed: the weight tile as the WGMMA's A and the pool rows in 16-token sub-blocks
        (`kernels/sm90_expert_gemm_transposed.py`; FP8 activations at BLOCK_M 64).
    promotion: the FP8 scratch accumulators' promotion, `PROMOTIONS`.
    k_unroll: k-blocks per FP8 consumer loop body, `K_UNROLLS`.
    tma_store: fp8xfp8 rows into a tensor (the L2 pool, ``out``) by TMA tensor stores of
        swizzled boxes instead of a bulk copy per row; the combine buffers always take row
        stores (``row_stores``).
    row_stores: how L2 sends its rows to the combine buffers, `ROW_STORES`.
    decode_tables: MXFP4 weights: how the decode builds its tables, `DECODE_TABLES`.
    early_tables: MXFP4 weights: the decode loads a k-block's first batch and builds its
        tables before it waits for a free MMA stage (not in 2-CTA clusters).
    """

    block_m: int | None = None
    cluster_m: int | None = None
    transposed: bool | None = None
    promotion: str | None = None
    k_unroll: int | None = None
    tma_store: bool | None = None
    row_stores: str | None = None
    decode_tables: str | None = None
    early_tables: bool | None = None

    _choices = {"block_m": (64, 128), "cluster_m": (1, 2), "promotion": PROMOTIONS,
                "k_unroll": K_UNROLLS, "row_stores": ROW_STORES, "decode_tables": DECODE_TABLES}
    _flags = ("transposed", "tma_store", "early_tables")

    def __post_init__(self) -> None:
        self._check_fields()
        name = "Sm90GemmConfig"
        if self.transposed:
            # (the transposed kernel: one consumer warpgroup of 64 rows, no clusters, the
            # chunk promotion one k-block a body, rows out by bulk copies)
            for field, value, allowed in (("block_m", self.block_m, 64),
                                          ("cluster_m", self.cluster_m, 1),
                                          ("promotion", self.promotion, "chunk"),
                                          ("k_unroll", self.k_unroll, 1),
                                          ("tma_store", self.tma_store, False),
                                          ("row_stores", self.row_stores, "bulk")):
                if value is not None and value != allowed:
                    raise ValueError(f"{name}.{field}: {allowed!r} with transposed=True (the "
                                     f"transposed kernel), got {value!r}")
        if self.cluster_m == 2 and self.block_m == 64:
            raise ValueError(f"{name}.cluster_m: 2 at BLOCK_M 128 only (BLOCK_M 64: about one "
                             f"block per expert, pairs rarely share a weight tile)")
        if self.early_tables and self.cluster_m == 2:
            raise ValueError(f"{name}.early_tables: not with cluster_m 2 (a cluster's shared "
                             f"decode decodes one chunk, the early tables are every chunk's)")

    def allows_transposed(self) -> bool:
        """Whether the fields set leave the transposed kernel possible."""
        try:
            Sm90GemmConfig(**{**self.__dict__, "transposed": True})
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class Sm100GemmConfig(_Config):
    """One sm_100a grouped GEMM (`kernels/sm100_expert_gemm.py`): ``block_m`` 64, 128 or 256
    (a 2-CTA pair); None: the heuristics' (`heuristics.select_block_m`)."""

    block_m: int | None = None

    _choices = {"block_m": (64, 128, 256)}

    def __post_init__(self) -> None:
        self._check_fields()


@dataclass(frozen=True)
class Sm90FusedConfig(_Config):
    """The sm_90a fused layer kernel (`kernels/sm90_mega_moe.py`). Every field None: the
    heuristics' choice (`heuristics.default_fused_config`), except ``debug`` (None: off).

    block_m: pool rows per tile, 64 or 128.
    row_transfer: how the rows move, `ROW_TRANSFERS`. Each is a row protocol of its own: every
        rank of a call must use the same (a mismatch traps). "pulled" with walk "tickets" only.
    weights_first: tiles that find their pool block not ready load their first stages' weights
        before they wait (with counted rows, each CTA's first L1 tile's right after the counts).
    stages_inputs: the kernel quantizes the caller's activations into the buffer itself (step
        0) instead of a staging launch before it; only where the call gives ``x``.
    local_dispatch: one-rank groups with counted rows that stage their own inputs: every CTA
        counts all pairs itself and quantizes its own pairs' rows straight into the pool.
    promotion, k_unroll, row_stores, decode_tables: the GEMM phases' (`Sm90GemmConfig`).
    walk: how the CTAs take the GEMM tiles, `WALKS` (FP8 / BF16 weights for "tickets").
    lag_grids: the ticket walk's lag, `LAG_GRIDS` (unused by "phases").
    band: the ticket walk's bands of pool blocks, `WALK_BANDS` (unused by "phases").
    l1_ring_rows: the ticket walk's L1-output ring, `L1_RING_ROWS` (0: the whole pool; a ring
        with walk "tickets" only, of at least ``(lag + 1) * band`` slots).
    combine: how the tokens are reduced, `COMBINES` ("tokens": with walk "tickets", not with
        the local dispatch; every rank of a call must use the same).
    debug: a diagnostic, `DEBUG_MODES`: "phase_clock", "tile_log" and (the ticket walk's)
        "tile_clock" write into the launch's debug tensor; "hold_cta" and "late_consumers" are
        test builds with an injected delay.
    """

    block_m: int | None = None
    row_transfer: str | None = None
    weights_first: bool | None = None
    stages_inputs: bool | None = None
    local_dispatch: bool | None = None
    promotion: str | None = None
    k_unroll: int | None = None
    row_stores: str | None = None
    decode_tables: str | None = None
    walk: str | None = None
    lag_grids: int | None = None
    band: int | None = None
    l1_ring_rows: int | None = None
    combine: str | None = None
    debug: str | None = None

    _choices = {"block_m": (64, 128), "row_transfer": ROW_TRANSFERS, "promotion": PROMOTIONS,
                "k_unroll": K_UNROLLS, "row_stores": ROW_STORES, "decode_tables": DECODE_TABLES,
                "walk": WALKS, "lag_grids": LAG_GRIDS, "band": WALK_BANDS,
                "l1_ring_rows": L1_RING_ROWS, "combine": COMBINES, "debug": DEBUG_MODES}
    _flags = ("weights_first", "stages_inputs", "local_dispatch")
    _optional = ("debug",)

    def __post_init__(self) -> None:
        self._check_fields()
        name = "Sm90FusedConfig"
        if self.local_dispatch and (self.row_transfer in ("barrier", "pulled")
                                    or self.stages_inputs is False):
            raise ValueError(f"{name}.local_dispatch: with counted rows and stages_inputs "
                             f"only, got row_transfer={self.row_transfer!r}, "
                             f"stages_inputs={self.stages_inputs!r}")
        if self.walk == "tickets" and self.debug == "tile_log":
            raise ValueError(f"{name}.walk: 'tickets' has no tile log (a CTA's tiles are not "
                             f"known in advance; its 'tile_clock' records them), got "
                             f"debug='tile_log'")
        if self.l1_ring_rows and self.walk != "tickets":
            # (the phase walk runs every L1 tile before any L2 tile: a ring would wait forever)
            raise ValueError(f"{name}.l1_ring_rows: a ring with walk='tickets' only, got "
                             f"walk={self.walk!r}")
        if self.row_transfer == "pulled" and self.walk == "phases":
            # (a puller waits for the L1 tiles of its ring slot's previous block, which the
            # phase walk's static split does not order before the tiles that wait for its rows)
            raise ValueError(f"{name}.row_transfer: 'pulled' with walk='tickets' only, got "
                             f"walk={self.walk!r}")
        if self.combine == "tokens" and self.walk == "phases":
            # (the token signals go out after each L2 tile of the ticket walk's consumers; the
            # phase walk's are the staged GEMM's walk, left as it is)
            raise ValueError(f"{name}.combine: 'tokens' with walk='tickets' only, got "
                             f"walk={self.walk!r}")
        if self.combine == "tokens" and self.local_dispatch:
            # (the local dispatch zeroes nothing at the start and leaves each token's routing
            # to one CTA, with no grid-wide order before another CTA's reduction reads it)
            raise ValueError(f"{name}.combine: 'tokens' with the exchanged dispatch only, got "
                             f"local_dispatch=True")
        if self.debug == "tile_clock" and self.walk != "tickets":
            raise ValueError(f"{name}.debug: 'tile_clock' with walk='tickets' only, got "
                             f"walk={self.walk!r}")


@dataclass(frozen=True)
class LayerConfig(_Config):
    """A layer call's configuration (every field free per rank, the same outputs).

    fused: one persistent kernel for the layer (`fused.fused_mega_moe`) or the staged kernels;
        None: `fused.choose` per call (``CUTE_MEGAMOE_FUSED``).
    experimental_fused_multi_gpu: the fused kernel may run groups of several GPUs (one process
        per GPU; its test has not passed there yet).
    experimental_fused_fp4: the sm_90a fused kernel may run ``fp8xfp4_sm90`` (MXFP4 weights;
        slower than the staged layer, one-rank stalls not explained).
    gemm: the staged layer's grouped GEMMs on sm_90a (`Sm90GemmConfig`).
    fused_kernel: the sm_90a fused kernel (`Sm90FusedConfig`).
    """

    fused: bool | None = None
    experimental_fused_multi_gpu: bool = False
    experimental_fused_fp4: bool = False
    gemm: Sm90GemmConfig = Sm90GemmConfig()
    fused_kernel: Sm90FusedConfig = Sm90FusedConfig()

    _flags = ("fused",)
    _optional = ("fused",)

    def __post_init__(self) -> None:
        self._check_fields()
        name = "LayerConfig"
        for flag in ("experimental_fused_multi_gpu", "experimental_fused_fp4"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{name}.{flag}: True or False, got {getattr(self, flag)!r}")
        for field, cls in (("gemm", Sm90GemmConfig), ("fused_kernel", Sm90FusedConfig)):
            if not isinstance(getattr(self, field), cls):
                raise ValueError(f"{name}.{field}: a {cls.__name__}, got "
                                 f"{type(getattr(self, field)).__name__}")
