"""Stall and disagreement reports: what a kernel leaves for the host when it traps.

A bounded wait that times out, or a check that finds the ranks disagreeing on a call, stops
the kernel with a trap (`kernels/common/sync.py`). The trap kills the CUDA context, so the
kernel first writes one record into pinned host memory, which the host can still read: the
first thread of the rank to report (it claims the ``STALL_REPORTED`` barrier slot) stores the
record's fields, fences at system scope, stores its kind last, fences again, then traps. The
record's address sits in the ``REPORT`` barrier slots of the rank's buffer
(`buffer.SymmBuffer` allocates the record and writes the address; 0 means no record).

No printf: a device printf is a function call, and ptxas then serializes every WGMMA of the
kernel (its C7510 note), which the fused layer kernel would pay on every call.

`format_report` turns a record into the message the entry points raise
(`SymmBuffer.report`): which counter stalled, or which setting the ranks disagree on, where,
and the values seen.
"""

from __future__ import annotations

from .layout.mega_moe import PROGRESS_WARPGROUPS
from .tables import RECIPES

#: int32 fields of a record, in order
REPORT_FIELDS = ("kind", "name", "cta", "thread", "value", "target", "source", "expert")
#: CTAs a split-barrier stall report of the fused kernel names, with their progress
PROGRESS_ENTRIES = 8
#: after the fields: how many of the rank's CTAs had not reached the stalled barrier, the
#: call's tag (low byte), the kernel's warpgroups, then the first PROGRESS_ENTRIES of those
#: CTAs, each (cta, its warpgroups' `Progress` words)
PROGRESS_OFFSET = len(REPORT_FIELDS)
PROGRESS_ENTRY_WORDS = 1 + PROGRESS_WARPGROUPS
#: after those, the routing errors (`kernels/common/routing.py`): not a trap, a record the
#: dispatch leaves for the host, which raises it after a later call's launch
#: (`SymmBuffer.raise_routing_error`): ``bad_slots`` (nonzero: a record; written last) is how
#: many slots were bad in the calls since the host last took the record, ``pair``
#: (``token * K + slot``) and ``value`` (two words) the first bad slot of the first such call
ROUTING_OFFSET = PROGRESS_OFFSET + 3 + PROGRESS_ENTRIES * PROGRESS_ENTRY_WORDS
ROUTING_FIELDS = ("bad_slots", "pair", "value_low", "value_high")
REPORT_WORDS = ROUTING_OFFSET + len(ROUTING_FIELDS)


class ReportKind:
    """The ``kind`` field (0: no report)."""

    STALL = 1  # a wait timed out: `value` seen, `target` awaited
    DISAGREE = 2  # a peer's setting `value` differs from this rank's `target`
    OUT_OF_STEP = 3  # rank `source` published call `value` of `expert`; this rank is at `target`
    NOT_PUBLISHED = 4  # timed out waiting for rank `source`'s word of `expert` for call `target`
    # a split barrier's wait timed out: `value` seen, `target` awaited, at barrier `expert`, of
    # which `source` of this rank's CTAs had arrived (0: all, the last reset the count)
    SPLIT_STALL = 5
    # the per-token combine's wait for a token's rows timed out: `value` rows arrived of
    # `target`, token `expert` (`token_arrivals`)
    TOKEN_STALL = 6


class Progress:
    """Where a warpgroup of the fused kernel is in a call: the word its first thread writes
    into the ``cta_progress`` region as it enters each step, ``tag << 24 | step << 16`` (tag:
    the call's tag, low byte). A split-barrier stall report lists the CTAs whose warpgroups
    are not all at `COMBINE` of the call (`kernels/common/sync.py`, `split_barrier_wait`):
    the step they are in names the wait they never left, unbounded ones included (named
    barriers, register handovers, the consumers' stage waits)."""

    STEPS = (
        "not started in this call",
        "the dispatch",
        "registers for the GEMM roles (setmaxnreg)",
        "the L1 tiles (the GEMM consumers: the L1 and L2 tiles)",
        "the L2 tiles",
        "the loads' last stages (ring tail)",
        "the GEMM consumers' registers taken (named barrier)",
        "the end of its role (named barrier)",
        "registers for the combine (setmaxnreg)",
        "held back (a test's injected stall)",
        "the combine",
    )
    DISPATCH = 1
    GEMM_REGS = 2
    L1_TILES = 3
    L2_TILES = 4
    LOADS_TAIL = 5
    REGS_TAKEN = 6
    ROLE_END = 7
    COMBINE_REGS = 8
    HELD = 9
    COMBINE = 10

    @staticmethod
    def word(tag: int, step: int) -> int:
        """The word of ``step`` in the call tagged ``tag`` (as the kernel writes it)."""
        word = (tag & 0xFF) << 24 | step << 16
        return word - (1 << 32) if word >= 1 << 31 else word

    @classmethod
    def describe(cls, word: int, tag: int) -> str:
        """``word``'s step, or that it is from another call than ``tag``'s."""
        step = (word >> 16) & 0xFF
        name = cls.STEPS[step] if step < len(cls.STEPS) else f"step #{step}"
        if (word >> 24) & 0xFF != tag & 0xFF:
            return cls.STEPS[0] + (f" (last: {name})" if step else "")
        return name


def _laggards(words: list[int]) -> str:
    """The part of a split-barrier stall message that names the CTAs that did not arrive."""
    count, tag, warpgroups = words[PROGRESS_OFFSET:PROGRESS_OFFSET + 3]
    if count <= 0:
        return ""
    entries = []
    for i in range(min(count, PROGRESS_ENTRIES)):
        first = PROGRESS_OFFSET + 3 + i * PROGRESS_ENTRY_WORDS
        cta, progress = words[first], words[first + 1:first + 1 + warpgroups]
        groups = ", ".join(f"warpgroup {w}: {Progress.describe(p, tag)}"
                           for w, p in enumerate(progress))
        entries.append(f"cta {cta} ({groups})")
    more = f"; and {count - PROGRESS_ENTRIES} more" if count > PROGRESS_ENTRIES else ""
    return f". CTAs that did not arrive ({count}): " + "; ".join(entries) + more


#: how a recipe disagreement names the codes of `layout.CountWord`'s recipe field
RECIPE_FIELD = "the recipe (" + ", ".join(f"{i}: {r}" for i, r in enumerate(RECIPES)) + ")"
#: how a disagreement on `layout.CountWord`'s push bit is named
PUSH_FIELD = "the dispatch transfer (1: push, 0: pull)"
#: how a disagreement on `layout.CountWord`'s rows_counted bit is named
ROWS_FIELD = ("the row protocol (1: rows counted per pool block, the fused kernel's counted "
              "row transfers; 0: rows moved before a closing cross-rank barrier)")
#: what a report names (its ``name`` field is the index); every wait and check names one
REPORT_NAMES = (
    "grid barrier",
    "cross-rank barrier signal",
    "split barrier signal",
    "expert_recv_count",
    "L1 tiles of a pool block",
    "every L1 tile",
    "rows of a pool block (pool_block_arrivals)",
    PUSH_FIELD,
    RECIPE_FIELD,
    ROWS_FIELD,
    # the fused kernel's stage waits inside a CTA (`sync.wait_stage`; value: the stage,
    # target: the phase parity awaited)
    "a free ring stage (loads)",
    "a loaded packed weight stage (decode warps)",
    "a free packed weight stage (packed loads)",
    "a free ring stage (decode warps)",
    # the FP4 experiment's watchdog over its consumers' k-blocks (value: k-blocks done,
    # target: the CTA's k-blocks; `Sm90MegaMoEKernel.watch_consumers`), by the state of the
    # stage they are at
    "the consumers' next stage, not loaded (watchdog)",
    "the consumers' next stage, not decoded (watchdog)",
    "the consumers, past a loaded and decoded stage (watchdog)",
    "the consumers, after their last k-block (watchdog)",
    # the fused kernel's loads at the end of their walk (`Sm90ExpertGemmKernel.producer_tail`;
    # value: the stage, target: the phase parity awaited)
    "the ring's last stages, freed (loads)",
    "the last packed weight stages, freed (packed loads)",
    # the ticket walk's tile queue (`Sm90MegaMoEKernel.publish`, `read_position`; value:
    # the slot, target: the phase parity awaited)
    "a free tile-queue slot (loads)",
    "a position in the tile queue (GEMM consumers)",
    # its L1-output ring (`Sm90ExpertGemmKernel.consume`: value / target, the readiness
    # counter of the block before in the slot: its L1 warps' signals and L2 tiles' loads)
    "L2 tiles of an L1-output ring slot's previous block",
    # its received-rows ring (`DispatchKernel.pull_in_pool_order`: value / target, the
    # readiness counter of the block before in the slot: its L1 warps' signals)
    "L1 tiles of a received-rows ring slot's previous block",
    # the per-token combine (`CombineKernel`, "tokens": value / target, the token's L2 rows
    # arrived and its valid slots; `ReportKind.TOKEN_STALL` names the token)
    "the L2 rows of a token (token_arrivals)",
)


def format_report(words, rank: int) -> str | None:
    """The message of the record ``words`` (``REPORT_WORDS`` ints) of rank ``rank``, or None
    when it holds no report."""
    words = [int(w) for w in words]
    f = dict(zip(REPORT_FIELDS, words[:len(REPORT_FIELDS)], strict=True))
    if f["kind"] == 0:
        return None
    name = REPORT_NAMES[f["name"]] if 0 <= f["name"] < len(REPORT_NAMES) else f"#{f['name']}"
    where = f"rank {rank}, cta {f['cta']}, thread {f['thread']}"
    if f["kind"] == ReportKind.STALL:
        return (f"cute_megamoe: wait on {name} stalled ({where}): value {f['value']}, "
                f"target {f['target']}")
    if f["kind"] == ReportKind.SPLIT_STALL:
        arrived = (f"{f['source']} of this rank's CTAs have arrived" if f["source"] else
                   "every CTA of this rank has arrived")
        return (f"cute_megamoe: wait on {name} {f['expert']} stalled ({where}): value "
                f"{f['value']}, target {f['target']}; {arrived}{_laggards(list(words))}")
    if f["kind"] == ReportKind.TOKEN_STALL:
        return (f"cute_megamoe: wait on {name} stalled ({where}): token {f['expert']} has "
                f"{f['value']} of its {f['target']} rows (a rank that owns one of its experts "
                f"did not send it, or does not signal tokens: every rank of a call must use "
                f"the same combine)")
    if f["kind"] == ReportKind.DISAGREE:
        return (f"cute_megamoe: ranks disagree on {name} ({where}): a peer's {f['value']}, "
                f"this rank's {f['target']}")
    if f["kind"] == ReportKind.OUT_OF_STEP:
        return (f"cute_megamoe: ranks are out of step ({where}): rank {f['source']} published "
                f"{name} of expert {f['expert']} for call {f['value']}, this rank is at call "
                f"{f['target']}; a rank skipped a call the others made")
    if f["kind"] == ReportKind.NOT_PUBLISHED:
        return (f"cute_megamoe: wait on {name} stalled ({where}): rank {f['source']} has not "
                f"published expert {f['expert']} for call {f['target']} (its word holds call "
                f"{f['value']})")
    return f"cute_megamoe: unknown report kind {f['kind']} ({where}): {f}"


def format_routing_error(words, num_topk: int, num_experts: int, rank: int) -> str | None:
    """The message of the routing section of the record ``words`` (`ROUTING_FIELDS`, from
    `ROUTING_OFFSET`), or None when it holds no bad slot."""
    bad_slots, pair, low, high = (int(w) for w in words[:len(ROUTING_FIELDS)])
    if bad_slots == 0:
        return None
    value = (high << 32) | (low & 0xFFFFFFFF)
    token, slot = divmod(pair, num_topk)
    why = (f"names expert {value} again (a token names an expert once; mask repeats with -1)"
           if 0 <= value < num_experts else
           f"holds expert index {value}, out of range (valid: -1 for a masked slot, or "
           f"0..{num_experts - 1})")
    more = f"; {bad_slots} bad slots in all" if bad_slots != 1 else ""
    return (f"topk_idx: token {token} slot {slot} {why} (rank {rank}, found by the dispatch "
            f"on the GPU in an earlier call, which treated the bad slots as masked{more})")
