"""Byte layout of the Mega MoE symmetric buffer: every region's offset, size, dtype and shape.

One call of the Mega MoE layer works inside a single uint8 allocation per rank. With several
ranks the allocation is *symmetric*: every rank allocates the same number of bytes and lays them
out identically, so a peer's copy of any region lives at ``peer_base + region.offset``. This
module is the one place that decides where each byte lives (design.md section 3: "a kernel file
never computes an address by hand that ``layout`` owns"). It is pure host-side arithmetic: no
GPU, no allocation. :class:`MegaMoELayout` computes the regions from the shape parameters and
:meth:`MegaMoELayout.view` turns a region into a torch view of a uint8 buffer.

Notation: ``R`` ranks, ``E`` experts (``E_l = E / R`` local to each rank), top-k ``K``, hidden
``H``, intermediate ``I``, ``T = align(num_max_tokens_per_rank, 128)`` token slots per rank,
``P`` pool rows (below).

Pool sizing. Tokens routed to this rank's experts are pulled into a *pool*: expert-major, each
expert padded to a multiple of the GEMM block size ``BM``. At most ``R * T`` tokens reach this
rank and each names at most ``min(K, E_l)`` of its local experts (the valid entries of one token's
top-k row name distinct experts, as ``torch.topk`` guarantees), so there are at most
``R * T * min(K, E_l)`` routed rows; padding adds at most ``BM - 1`` rows per expert. Sizing the
padding for ``block_m_max = 256``, the largest ``BM`` any kernel may use, lets one buffer serve
every block size::

    P = align(R * T * min(K, E_l) + E_l * (block_m_max - 1), block_m_max)

and since ``BM >= 16`` always, the pool never has more than ``P // 16`` blocks.

Regions, back to back in this order, each starting at a multiple of 128 bytes (TMA needs 128 B
aligned global addresses; padding is only ever *between* regions). "Local" means only this rank
touches it; "remote-written" means peers store into it over NVLink through their symmetric
pointers; "read by peers" means peers load from it.

Workspace (zeroed once at allocation and never reset by the host: counters only grow, with
wrap-safe comparisons, and count words carry the number of the call that wrote them, so the
next call needs no host memset; :meth:`SymmBuffer.zero_workspace_` is for recovery only):

``barrier`` int32 [64]
    Grid-barrier counters, cross-rank-barrier counters and signals (split-phase ones too), and
    the call tags; slot numbers in :class:`BarrierSlots`. Written and read by all CTAs of this
    rank; the cross-rank signal slots are remote-written by peers.
``expert_send_count`` int64 [E]
    Per *global* expert: every CTA of this rank atomically adds ``(1 << 32) | its_count``; the
    returned old value's low 32 bits are the CTA's first slot for that expert (an exclusive
    prefix over CTAs in atomic order). Local; CTA 0 zeroes it once it has read the totals.
``expert_recv_count`` int64 [R, E]
    Row ``r`` is written by source rank ``r`` with system-scope release stores:
    ``(call tag << 32) | settings << 24 | count`` for every global expert (each rank gets every
    rank's counts; :class:`CountWord` gives the fields). The tag numbers the call (the same on
    every rank), so a count left from an earlier call is never taken for this one's and nothing
    needs resetting; the settings let every reader check that all ranks launched the call
    alike. Remote-written; read by this rank's dispatch (its own experts' columns; all of them
    when it pushes rows, to address the destination pools).
``src_token_topk_idx`` int32 [E_l, R, T]
    For each (local expert, source rank, slot): ``token * K + k`` on the source rank. Written by
    the *source* rank's dispatch warps through the symmetric pointer (remote-written), read by
    this rank's dispatch (metadata; the rows when it pulls them). ``T`` slots per (expert,
    source rank) suffice: the slots for one (expert, source rank) pair hold that source rank's
    (token, k) pairs routed to that expert; a source rank has at most ``T`` tokens and a token
    names a given expert at most once, so at most ``T`` slots are ever used. (DeepGEMM
    allocates ``R * T`` slots here, ``R`` times more than needed: 8x the bytes for EP8.)
``dispatch_pair_slot`` int32 [T, K]
    Per (token, k) of this rank: its slot in ``src_token_topk_idx[e_l][my_rank]`` on the expert's
    rank, kept by the scatter for a dispatch that pushes the rows. Local.
``token_src_metadata`` int32 [P, 4]
    Per pool row ``{source rank, token, topk slot, unused}``: where the row's L2 result goes back
    to. Written by this rank's dispatch, read by the L2 epilogue. Local. Indexed by pool row, so
    it is never overwritten within a call.
``pool_block_arrivals`` int32 [P / 16]
    Per pool block (this rank's BLOCK_M), with the fused kernel's counted row transfers: 1 per
    row of the call that has landed in ``l1_acts`` (the senders add with relaxed system-scope
    atomics after a fence per batch of rows; remote-written) and 1 per row whose metadata,
    routing weight and scales this rank's dispatch has written (release, GPU scope); its L1
    producer acquires it until 2 per valid row before loading the block's rows. Zeroed by this
    rank at the start of each call, before it publishes its counts (no sender writes a
    destination's pool before it has the destination's counts of the call).
``pool_block_ready`` int32 [P / 16 + 1]
    Per pool block, the fused kernel's L1 tiles done (every consumer warp adds 1 once its rows
    of the block are stored; the block's L2 tiles wait for all of them), and one counter past
    them. Local. Every fused call leaves it at 0 (its last step).
``pool_block_l2_done`` int32 [P / 16]
    Per pool block, with the fused kernel's per-token combine (``Sm90FusedConfig.combine``
    "tokens"): its L2 tiles done (every consumer warp adds 1 once its rows of a tile are
    stored in the source ranks' combine buffers; the last add signals the block's tokens in
    ``token_arrivals``). Local. Zeroed by this rank at the start of each call and at its end.
``token_arrivals`` int32 [T]
    Per token of this rank, with the per-token combine: 1 per L2 row of the token stored in
    this rank's ``combine`` (release adds by the rank that owns the expert; remote-written);
    the token is reduced once it reaches its valid slots. Zeroed by this rank at the start of
    each call, before it publishes its counts (no peer signals a token before it has this
    rank's counts of the call).
``cta_progress`` int32 [MAX_PROGRESS_CTAS, 4]
    Per CTA and warpgroup of the fused kernel, where it is in the call (`reports.Progress`):
    written by each warpgroup's first thread as it enters a step, read only by a stall
    report, which names the CTAs that did not reach the stalled barrier. Local.

Data:

``x`` [T, H] (float8_e4m3fn, or bfloat16 for ``bf16xbf16``)
    Input tokens, copied in by the user before each call (only the first ``n`` rows are read).
    Read by this rank's dispatch (push) or by peers' (pull).
``x_sf`` [T, H / 128] (absent for ``bf16xbf16``)
    Input scales, token-major. ``fp8xfp4``: int32, four UE8M0 bytes per int32 (per-32 scales,
    byte ``g % 4`` of word ``g // 4`` holds K-group ``g``). ``fp8xfp8``: float32, one per 128
    features. User-filled, read by peers. ``fp8xfp4_sm90`` lays out every region as
    ``fp8xfp8`` (`tables.activation_recipe`: only its weights differ).
``topk_idx`` int64 [T, K]
    Routing (-1 = masked). User-filled, read locally by the dispatch warps.
``topk_weights`` float32 [T, K]
    Routing weights. User-filled, read by peers (their dispatch copies each weight into its pool).
``l1_acts`` [Pr, H] (dtype of ``x``)
    L1 GEMM input pool: rows written by the source ranks' dispatch (push, remote-written) or by
    this rank's (pull); read by the L1 GEMM. ``Pr = P`` (a row per pool row), or with
    ``received_rows`` a ring of ``Pr = min(received_rows, P)`` rows that only the fused kernel
    with ``row_transfer='pulled'`` can use (pool block ``b``'s rows in slot
    ``b mod (Pr / BM)``, each slot refilled once every L1 tile of its previous block is done;
    docs/notes/dataflow.md, W4).
``l1_acts_sf`` [Pr, H / 128] strides (1, Pr) (dtype of ``x_sf``; absent for ``bf16xbf16``)
    Pool scales, MN-major (pool row fastest) as the GEMM's scale loads want. Local.
``l1_topk_weights`` float32 [P]
    Routing weight of each pool row, written by the dispatch, read by the L1 epilogue. Local.
``l2_acts`` [Q, I] (dtype of ``x``)
    L2 GEMM input pool, written by the L1 epilogue (SwiGLU, weight, requantization). Local.
    ``Q = P`` (a row per pool row), or with ``l1_output_rows`` a ring of
    ``Q = min(l1_output_rows, P)`` rows that only the fused kernel's ticket walk with an
    L1-output ring of at most ``Q`` rows can use (``Sm90FusedConfig.l1_ring_rows``: pool block
    ``b`` in slot ``b mod (ring rows / BM)``; docs/notes/dataflow.md, W2).
``l2_acts_sf`` [Q, I / 128] strides (1, Q) (dtype of ``x_sf``; absent for ``bf16xbf16``)
    Written by the L1 epilogue. Local.
``combine`` bfloat16 [K, T, H]
    ``combine[k, t]`` is the L2 output of this rank's token ``t``, slot ``k``. Remote-written by
    the L2 epilogue of the rank that owns the expert; read locally by the combine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..tables import RECIPES, activation_recipe  # the package's one recipe table (re-exported)
from ..utils import align

__all__ = [
    "BLOCK_M_MAX",
    "DATA_REGION_NAMES",
    "MAX_NUM_RANKS",
    "MAX_NUM_TOKENS_PER_RANK",
    "MAX_NUM_TOPK",
    "MIN_BLOCK_M",
    "NUM_BARRIER_SLOTS",
    "RECIPES",
    "REGION_ALIGNMENT",
    "REGION_NAMES",
    "TOKEN_ALIGNMENT",
    "WORKSPACE_REGION_NAMES",
    "AbsentRegionError",
    "BarrierSlots",
    "CountWord",
    "MegaMoELayout",
    "Region",
]

#: Token slots per rank are rounded up to this (the largest power of two the kernels tile by).
TOKEN_ALIGNMENT = 128
#: The largest BLOCK_M any kernel may use; the pool's per-expert padding is sized for it.
BLOCK_M_MAX = 256
#: The smallest BLOCK_M any kernel may use; bounds the number of pool blocks.
MIN_BLOCK_M = 16
#: Every region starts at a multiple of this many bytes (TMA global addresses).
REGION_ALIGNMENT = 128
#: int32 slots of the ``barrier`` region.
NUM_BARRIER_SLOTS = 64
#: Ranks of one group: the kernels keep per-rank tables in shared memory and signal every
#: (rank, barrier) pair from one warp (8 ranks x 8 split barriers = 64 lanes' worth, two
#: passes); one NVLink domain of 8 GPUs is what they were written and sized for.
MAX_NUM_RANKS = 8
#: One warp's lanes over top-k (DeepGEMM's limit).
MAX_NUM_TOPK = 32
#: Token slots per rank: a published count has COUNT_BITS bits (see `CountWord`).
MAX_NUM_TOKENS_PER_RANK = 1 << 20
#: CTAs of one kernel whose progress a stall report can name (`cta_progress`): one per SM, and
#: no GPU has more than this many SMs
MAX_PROGRESS_CTAS = 256
#: warpgroups per CTA whose progress is kept (the fused kernel has at most four)
PROGRESS_WARPGROUPS = 4

WORKSPACE_REGION_NAMES = (
    "barrier",
    "expert_send_count",
    "expert_recv_count",
    "src_token_topk_idx",
    "dispatch_pair_slot",
    "token_src_metadata",
    "pool_block_arrivals",
    "pool_block_ready",
    "pool_block_l2_done",
    "token_arrivals",
    "cta_progress",
)
DATA_REGION_NAMES = (
    "x",
    "x_sf",
    "topk_idx",
    "topk_weights",
    "l1_acts",
    "l1_acts_sf",
    "l1_topk_weights",
    "l2_acts",
    "l2_acts_sf",
    "combine",
)
#: Every region name a layout may have, in layout order (SF regions are absent for bf16xbf16).
REGION_NAMES = WORKSPACE_REGION_NAMES + DATA_REGION_NAMES


class BarrierSlots:
    """int32 slots of the ``barrier`` region (what each holds: `kernels/common/sync.py`)."""

    GRID = 0  # grid barrier: top-bit flip counter
    CALL_TAG = 1  # local: tag of the last call this rank started or skipped
    CALL_DONE = 2  # local: tag of the last call this rank finished (its dispatch's barrier)
    STALL_REPORTED = 3  # local: set by the first thread that reports a stall or disagreement
    RANK_BARRIER_COUNT = 4  # local: cross-rank barriers passed so far
    RANK_BARRIER_SIGNAL = 5  # two slots (5, 6), added to by every rank
    SPLIT_CALLS = 8  # local: calls that have passed the split barriers
    # local, int64 in two slots (10, 11): the address of this rank's pinned host record of a
    # stall or disagreement (`reports`), 0 for none; written by the host
    REPORT = 10
    SPLIT_ARRIVAL = 16  # local, one per split barrier: CTAs of this rank arrived in this call
    SPLIT_SIGNAL = 24  # one per split barrier: +1 per rank per call, added to by every rank
    # local: the routing slots of this call the dispatch found bad (`kernels/common/routing`),
    # until the call publishes them into the pinned record and zeroes these
    BAD_SLOTS = 32
    # local, two int64 in slots (34, 35) and (36, 37): the first bad slot's key, by atomic max:
    # ``(2**31 - 1 - pair) << 32`` with the low, then the high word of its value
    FIRST_BAD_LOW = 34
    FIRST_BAD_HIGH = 36


class CountWord:
    """The int64 word a source rank publishes per (destination, global expert) into
    ``expert_recv_count``: ``tag << 32 | settings << COUNT_BITS | count``.

    ``tag`` numbers the call; ``settings`` are what every rank must launch the call with
    (readers compare them with their own and trap on a difference, naming the field):
    ``rows_counted << 8 | push << 7 | recipe << 5 | (block_m // 16 - 1)``; ``rows_counted``: the
    senders count every row into the destination's ``pool_block_arrivals`` and the call ends
    without the dispatch's closing cross-rank barrier (the fused kernel's "counted" row
    transfer), which a rank that waits for that barrier, or for the counts, would never see.
    """

    COUNT_BITS = 23  # (a count is at most MAX_NUM_TOKENS_PER_RANK = 2**20)
    COUNT_MASK = (1 << COUNT_BITS) - 1
    SETTINGS_MASK = 0x1FF
    BLOCK_M_BITS = 5  # block_m // 16 - 1: block_m in 16..512
    RECIPE_SHIFT = 5
    PUSH_SHIFT = 7
    ROWS_COUNTED_SHIFT = 8

    @staticmethod
    def settings(block_m: int, recipe: str, push: bool, rows_counted: bool = False) -> int:
        """The settings field (9 bits) of a call launched with these values."""
        if block_m % 16 != 0 or not 16 <= block_m <= 16 << CountWord.BLOCK_M_BITS:
            raise ValueError(f"block_m: expected a multiple of 16 in [16, "
                             f"{16 << CountWord.BLOCK_M_BITS}], got {block_m}")
        return ((int(rows_counted) << CountWord.ROWS_COUNTED_SHIFT)
                | (int(push) << CountWord.PUSH_SHIFT)
                | (RECIPES.index(recipe) << CountWord.RECIPE_SHIFT) | (block_m // 16 - 1))

    @staticmethod
    def decode(word: int) -> dict[str, int | str | bool]:
        """The fields of a published word (host side: tests and error reports)."""
        word &= (1 << 64) - 1
        settings = (word >> CountWord.COUNT_BITS) & CountWord.SETTINGS_MASK
        return {"tag": word >> 32, "count": word & CountWord.COUNT_MASK,
                "block_m": 16 * ((settings & ((1 << CountWord.BLOCK_M_BITS) - 1)) + 1),
                "recipe": RECIPES[(settings >> CountWord.RECIPE_SHIFT) & 3],
                "push": bool((settings >> CountWord.PUSH_SHIFT) & 1),
                "rows_counted": bool(settings >> CountWord.ROWS_COUNTED_SHIFT)}


def _ring_rows(name: str, rows: int | None, pool_rows: int) -> int:
    """The rows of a pool region laid out as a ring of ``rows`` (None: the whole pool), capped
    at the pool: whole blocks of every BLOCK_M."""
    if rows is None:
        return pool_rows
    ring = _check_int(name, rows)
    if ring < 1 or ring % BLOCK_M_MAX != 0:
        raise ValueError(f"{name} must be None or a positive multiple of {BLOCK_M_MAX} (whole "
                         f"blocks of every BLOCK_M), got {ring}")
    return min(ring, pool_rows)


class AbsentRegionError(LookupError):
    """Raised when a region that exists for other recipes is absent from this layout."""


@dataclass(frozen=True)
class Region:
    """One contiguous byte range of the buffer and the tensor it holds.

    ``strides`` are in elements (torch convention); ``nbytes`` is exactly the bytes the tensor
    spans (no padding). ``workspace`` tells workspace regions from data regions.
    """

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    workspace: bool = False

    @property
    def end(self) -> int:
        """One past the region's last byte."""
        return self.offset + self.nbytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    return value


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class MegaMoELayout:
    """Where every region of one rank's Mega MoE buffer lives (see the module docstring).

    Construct with the shape parameters; all other fields are derived. Two layouts built from
    the same parameters are equal, and every rank of a group builds the same one.
    """

    num_ranks: int
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    recipe: str = "fp8xfp4"
    l1_output_rows: int | None = None
    received_rows: int | None = None

    # Derived (filled in by __post_init__).
    num_local_experts: int = field(init=False)
    num_tokens: int = field(init=False)
    block_m_max: int = field(init=False)
    num_pool_rows: int = field(init=False)
    num_l1_output_rows: int = field(init=False)
    num_received_rows: int = field(init=False)
    num_pool_blocks_max: int = field(init=False)
    act_dtype: torch.dtype = field(init=False)
    sf_dtype: torch.dtype | None = field(init=False)
    regions: tuple[Region, ...] = field(init=False, repr=False)
    workspace_nbytes: int = field(init=False)
    num_bytes: int = field(init=False)
    _index: dict[str, Region] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        r = _check_int("num_ranks", self.num_ranks)
        e = _check_int("num_experts", self.num_experts)
        m = _check_int("num_max_tokens_per_rank", self.num_max_tokens_per_rank)
        k = _check_int("num_topk", self.num_topk)
        h = _check_int("hidden", self.hidden)
        i = _check_int("intermediate_hidden", self.intermediate_hidden)
        if not isinstance(self.recipe, str):
            raise TypeError(f"recipe must be a str, got {type(self.recipe).__name__}")
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {self.recipe!r}")
        if not 1 <= r <= MAX_NUM_RANKS:
            raise ValueError(f"num_ranks must be in [1, {MAX_NUM_RANKS}], got {r}")
        if e < 1:
            raise ValueError(f"num_experts must be >= 1, got {e}")
        if e % r != 0:
            raise ValueError(f"num_experts ({e}) must be a multiple of num_ranks ({r})")
        if not 1 <= m <= MAX_NUM_TOKENS_PER_RANK:
            raise ValueError(f"num_max_tokens_per_rank must be in [1, "
                             f"{MAX_NUM_TOKENS_PER_RANK}], got {m}")
        if not 1 <= k <= MAX_NUM_TOPK:
            raise ValueError(f"num_topk must be in [1, {MAX_NUM_TOPK}], got {k}")
        if k > e:
            raise ValueError(f"num_topk ({k}) must not exceed num_experts ({e})")
        if h < 1 or h % 128 != 0:
            raise ValueError(f"hidden must be a positive multiple of 128, got {h}")
        if i < 1 or i % 128 != 0:
            raise ValueError(f"intermediate_hidden must be a positive multiple of 128, got {i}")

        e_l = e // r
        t = align(m, TOKEN_ALIGNMENT)
        p = align(r * t * min(k, e_l) + e_l * (BLOCK_M_MAX - 1), BLOCK_M_MAX)
        num_pool_blocks = p // MIN_BLOCK_M
        q = _ring_rows("l1_output_rows", self.l1_output_rows, p)  # the L1 outputs' rows
        pr = _ring_rows("received_rows", self.received_rows, p)  # the received rows'

        act_recipe = activation_recipe(self.recipe)
        if act_recipe == "bf16xbf16":
            act_dtype, sf_dtype = torch.bfloat16, None
        elif act_recipe == "fp8xfp4":
            act_dtype, sf_dtype = torch.float8_e4m3fn, torch.int32
        else:
            act_dtype, sf_dtype = torch.float8_e4m3fn, torch.float32

        # (name, dtype, shape, strides or None for row-major); None dtype = absent.
        specs: list[tuple[str, torch.dtype | None, tuple[int, ...], tuple[int, ...] | None]] = [
            ("barrier", torch.int32, (NUM_BARRIER_SLOTS,), None),
            ("expert_send_count", torch.int64, (e,), None),
            ("expert_recv_count", torch.int64, (r, e), None),
            ("src_token_topk_idx", torch.int32, (e_l, r, t), None),
            ("dispatch_pair_slot", torch.int32, (t, k), None),
            ("token_src_metadata", torch.int32, (p, 4), None),
            ("pool_block_arrivals", torch.int32, (num_pool_blocks,), None),
            ("pool_block_ready", torch.int32, (num_pool_blocks + 1,), None),
            ("pool_block_l2_done", torch.int32, (num_pool_blocks,), None),
            ("token_arrivals", torch.int32, (t,), None),
            ("cta_progress", torch.int32, (MAX_PROGRESS_CTAS, PROGRESS_WARPGROUPS), None),
            ("x", act_dtype, (t, h), None),
            ("x_sf", sf_dtype, (t, h // 128), None),
            ("topk_idx", torch.int64, (t, k), None),
            ("topk_weights", torch.float32, (t, k), None),
            ("l1_acts", act_dtype, (pr, h), None),
            ("l1_acts_sf", sf_dtype, (pr, h // 128), (1, pr)),
            ("l1_topk_weights", torch.float32, (p,), None),
            ("l2_acts", act_dtype, (q, i), None),
            ("l2_acts_sf", sf_dtype, (q, i // 128), (1, q)),
            ("combine", torch.bfloat16, (k, t, h), None),
        ]
        regions: list[Region] = []
        cursor = 0
        workspace_end = 0
        for name, dtype, shape, strides in specs:
            if dtype is None:
                continue
            offset = align(cursor, REGION_ALIGNMENT)
            itemsize = torch.empty((), dtype=dtype).element_size()
            nbytes = math.prod(shape) * itemsize
            is_ws = name in WORKSPACE_REGION_NAMES
            regions.append(
                Region(
                    name=name,
                    offset=offset,
                    nbytes=nbytes,
                    dtype=dtype,
                    shape=shape,
                    strides=strides if strides is not None else _contiguous_strides(shape),
                    workspace=is_ws,
                )
            )
            cursor = offset + nbytes
            if is_ws:
                workspace_end = cursor

        sets = object.__setattr__
        sets(self, "num_local_experts", e_l)
        sets(self, "num_tokens", t)
        sets(self, "block_m_max", BLOCK_M_MAX)
        sets(self, "num_pool_rows", p)
        sets(self, "num_l1_output_rows", q)
        sets(self, "num_received_rows", pr)
        sets(self, "num_pool_blocks_max", num_pool_blocks)
        sets(self, "act_dtype", act_dtype)
        sets(self, "sf_dtype", sf_dtype)
        sets(self, "regions", tuple(regions))
        # The workspace is the prefix [0, workspace_nbytes): it ends where the first data region
        # starts, so zeroing that prefix clears the workspace (and only inter-region padding).
        sets(self, "workspace_nbytes", align(workspace_end, REGION_ALIGNMENT))
        sets(self, "num_bytes", align(cursor, REGION_ALIGNMENT))
        sets(self, "_index", {reg.name: reg for reg in regions})

    # ------------------------------------------------------------------ lookups

    @property
    def has_sf(self) -> bool:
        """True when the recipe carries scale factors (the ``*_sf`` regions exist)."""
        return self.sf_dtype is not None

    @property
    def workspace_regions(self) -> tuple[Region, ...]:
        return tuple(reg for reg in self.regions if reg.workspace)

    @property
    def data_regions(self) -> tuple[Region, ...]:
        return tuple(reg for reg in self.regions if not reg.workspace)

    def has(self, name: str) -> bool:
        """Whether this layout has region ``name`` (SF regions are absent for bf16xbf16)."""
        return name in self._index

    def region(self, name: str) -> Region:
        """The region called ``name``.

        Raises :class:`AbsentRegionError` for a known region this recipe lacks and ``KeyError``
        for an unknown name.
        """
        reg = self._index.get(name)
        if reg is not None:
            return reg
        if name in REGION_NAMES:
            raise AbsentRegionError(
                f"region {name!r} is absent from a layout with recipe {self.recipe!r}"
            )
        raise KeyError(f"unknown region {name!r}; known: {', '.join(REGION_NAMES)}")

    def offset(self, name: str) -> int:
        """Byte offset of region ``name`` from the buffer start."""
        return self.region(name).offset

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """A typed view of region ``name`` inside ``buffer`` (1-D contiguous uint8, this layout).

        The view aliases the buffer's bytes: writes through it land in the buffer.
        """
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if buffer.dtype != torch.uint8:
            raise TypeError(f"buffer must have dtype torch.uint8, got {buffer.dtype}")
        if buffer.dim() != 1 or (buffer.numel() > 1 and buffer.stride(0) != 1):
            raise ValueError(
                f"buffer must be 1-D and contiguous, got shape {tuple(buffer.shape)} "
                f"strides {tuple(buffer.stride())}"
            )
        if buffer.numel() < self.num_bytes:
            raise ValueError(
                f"buffer has {buffer.numel()} bytes, this layout needs {self.num_bytes}"
            )
        reg = self.region(name)
        typed = buffer.narrow(0, reg.offset, reg.nbytes).view(reg.dtype)
        return typed.as_strided(reg.shape, reg.strides)

    # ------------------------------------------------------------------ printing

    def summary(self) -> str:
        """A table of every region (offset, shape, dtype, MiB) with workspace and total sizes."""
        mib = 1 << 20
        head = (
            f"MegaMoELayout(recipe={self.recipe}, R={self.num_ranks}, E={self.num_experts}, "
            f"E_l={self.num_local_experts}, T={self.num_tokens} "
            f"(from {self.num_max_tokens_per_rank}), K={self.num_topk}, H={self.hidden}, "
            f"I={self.intermediate_hidden}, P={self.num_pool_rows}"
            + ("" if self.l1_output_rows is None else f", Q={self.num_l1_output_rows}")
            + ("" if self.received_rows is None else f", Pr={self.num_received_rows}") + ")"
        )
        rows = [head, f"  {'region':<22} {'offset':>14} {'shape':<24} {'dtype':<14} {'MiB':>11}"]
        for reg in self.regions:
            dtype = str(reg.dtype).removeprefix("torch.")
            shape = "x".join(str(s) for s in reg.shape)
            if reg.strides != _contiguous_strides(reg.shape):
                shape += " (MN-major)"
            rows.append(
                f"  {reg.name:<22} {reg.offset:>14} {shape:<24} {dtype:<14} "
                f"{reg.nbytes / mib:>11.3f}"
            )
        rows.append(
            f"  {'workspace':<22} {'':>14} {'':<24} {'':<14} {self.workspace_nbytes / mib:>11.3f}"
        )
        rows.append(
            f"  {'total':<22} {'':>14} {'':<24} {'':<14} {self.num_bytes / mib:>11.3f}"
            f"  ({self.num_bytes / (1 << 30):.3f} GiB)"
        )
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.summary()
