"""Grid and cross-rank barriers, call tags, and bounded spin-waits, for persistent multi-GPU
kernels.

Memory-model rules (design.md section 5):
* a flag is never read with a plain load: spins use `ld.acquire` at the flag's scope;
* data other ranks must see is published with a system-scope release;
* every barrier starts with `fence.acq_rel.sys` and a proxy fence, so that ordinary stores and
  bulk-async (TMA) stores issued before it are ordered before the release, also across GPUs.
  A one-rank group uses GPU scope instead (`group_scope`): its buffer, its flags and every
  reader of them within a call are on one GPU (the host reads results after the kernel, and
  the stall reports in pinned host memory keep their own system-scope fences).

Barrier state lives in the `barrier` workspace region (int32 slots, `layout.BarrierSlots`) and
is never reset. Every counter only grows and wraps modulo 2**32; every comparison of two counter
values is a difference taken in 32-bit arithmetic, so a server may run for any number of calls:
* grid barrier: DeepGEMM's top-bit flip. Every CTA adds to one counter; CTA 0 adds
  `2**31 - (num_ctas - 1)`, the others 1. The adds sum to 2**31, so the top bit flips once per
  barrier and the low bits come back to where they were. A CTA waits until the top bit differs
  from the value its own add returned.
* split-phase cross-rank barriers (`split_barrier_*`): SPLIT_BARRIER_COUNT barriers, every
  call passes each of them once. A CTA arrives at a run of them without waiting (the rank's
  last CTA to arrive adds 1 to their slots on every rank) and waits for a run later, so the
  work between the two overlaps the other ranks' progress. Ranks may group the barriers
  differently (one rank arrives at all of them at once, another one by one). Slots only grow:
  call u waits until they reach (u + 1) R (wrap-safe compare), u being the local count of calls
  passed, read by every CTA at the start of the call. A fast rank may already add its next
  call's 1 while a slow one still waits: the target is then passed, not missed.
* cross-rank barrier: each rank keeps a local count of barriers passed; barrier b uses signal
  slot `b & 1` and adds +1 (bit 1 of b clear) or -1 (set) to that slot on every rank, itself
  included; the slot then reads R (or 0) on every rank once all have arrived. Two alternating
  slots let a rank enter barrier b + 1 while a slower rank still reads barrier b's slot;
  signals swing between 0 and R forever. Every rank must execute the same sequence of
  cross-rank barriers.
* call tags (`call_tags`, `wait_call_tag`, `finish_call`): a call is numbered by a tag every
  rank computes alike, `CALL_TAG + 1`; the host adds 1 to `CALL_TAG` when it gives up a call
  before launching it (`SymmBuffer.skip_call`), so a rank that skipped a call its peers made
  carries a different tag from then on. Count words carry the tag of the call that wrote them:
  a reader waits while a word still holds the tag of the last call it finished (`CALL_DONE`)
  and traps on any other tag, since a peer is then running a call this rank did not make (or
  skipped one this rank made) and every later call would pair the wrong data.

Waits give up after `timeout_ns` (a compile-time setting, `CUTE_MEGAMOE_SPIN_TIMEOUT_S`, default
120 s, 0 = never; part of the compiled-kernel cache key): the first thread of the rank to time
out records which counter stalled, its value and the target in the rank's pinned host record
(`reports`; it claims `STALL_REPORTED`, so one record per rank), then every timed-out thread
traps (at a split barrier, once the record is written), so a lost rank shows up as an error
naming the counter instead of a silent hang. Checks that the ranks agree on a call's settings
and tags record what differs and trap too. No printf: its function call would make ptxas
serialize the WGMMAs of a kernel that waits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...layout.mega_moe import PROGRESS_WARPGROUPS, BarrierSlots
from ...reports import (
    PROGRESS_ENTRIES,
    PROGRESS_ENTRY_WORDS,
    PROGRESS_OFFSET,
    REPORT_FIELDS,
    REPORT_NAMES,
    Progress,
    ReportKind,
)
from ...runtime import spin_timeout_ns

__all__ = [
    "SPLIT_BARRIER_COUNT", "call_tags", "cross_rank_barrier", "fence_acq_rel", "finish_call",
    "grid_arrive", "grid_barrier", "group_scope",
    "report", "report_disagreement", "report_record_address", "spin_timeout_ns",
    "split_barrier_arrive", "split_barrier_finish", "split_barrier_target",
    "split_barrier_wait", "wait_call_tag", "wait_reached", "wait_stage",
]

# Split-phase cross-rank barriers (arrive now, wait later): every call of a kernel that uses
# them passes all SPLIT_BARRIER_COUNT of them, each exactly once
SPLIT_BARRIER_COUNT = 8

TOP_BIT = 0x80000000


# what a split-barrier stall's claimer adds to `STALL_REPORTED` once its record is written
# (every other reporter adds 1: far fewer)
REPORT_WRITTEN = 1 << 30


@cute.jit
def _claim_report(barrier_slots: cute.Pointer) -> cutlass.Boolean:
    """True for the first thread of this rank to report (one message per rank, not per
    thread)."""
    return cute.arch.atomic_add(barrier_slots + BarrierSlots.STALL_REPORTED, Int32(1),
                                scope="gpu") == 0


@cute.jit
def report_record_address(barrier_slots: cute.Pointer) -> Int64:
    """The address of the rank's pinned host record (`reports`), 0 where it has none."""
    low = cute.arch.load(barrier_slots + BarrierSlots.REPORT, Int32)
    high = cute.arch.load(barrier_slots + BarrierSlots.REPORT + 1, Int32)
    return (Int64(high) << 32) | (Int64(low) & 0xFFFFFFFF)


@cute.jit
def report(barrier_slots: cute.Pointer, kind: cutlass.Constexpr, what, value: Int32,
           target: Int32, source: Int32 = 0, expert: Int32 = 0, progress: cute.Pointer = None,
           warpgroups: cutlass.Constexpr = 0):
    """Record a report of `kind` (`reports.ReportKind`) naming `what` (one of
    `reports.REPORT_NAMES`, or its index as a runtime value) into the rank's pinned host
    record, if this thread is the rank's first to report and the buffer has a record (see
    `reports`), then trap. With ``progress`` (the fused kernel's ``cta_progress``, of
    ``warpgroups`` warpgroups per CTA): also the CTAs not at its combine (`record_laggards`),
    and the rank's other reporters trap only once the record is written."""
    if _claim_report(barrier_slots):
        address = report_record_address(barrier_slots)
        if address != 0:
            record = cute.make_ptr(Int32, address, cute.AddressSpace.gmem, assumed_align=4)
            bidx, _, _ = cute.arch.block_idx()
            tidx, _, _ = cute.arch.thread_idx()
            name = Int32(REPORT_NAMES.index(what)) if isinstance(what, str) else what
            fields = dict(name=name, cta=Int32(bidx),
                          thread=Int32(tidx), value=value, target=target, source=source,
                          expert=expert)
            for i, field in enumerate(REPORT_FIELDS[1:], 1):
                cute.arch.store(record + i, Int32(fields[field]))
            if cutlass.const_expr(progress is not None):
                record_laggards(record, progress, warpgroups)
            cute.arch.fence_acq_rel_sys()  # the fields reach host memory before the kind
            cute.arch.store(record, Int32(kind))
            cute.arch.fence_acq_rel_sys()
        if cutlass.const_expr(progress is not None):
            cute.arch.atomic_add(barrier_slots + BarrierSlots.STALL_REPORTED,
                                 Int32(REPORT_WRITTEN), sem="release", scope="gpu")
    elif cutlass.const_expr(progress is not None):
        # A trap ends every CTA of the grid at once, and the threads of a split barrier time
        # out within microseconds of each other: one that trapped at once killed the claimer
        # while it read every CTA's progress words, which left no record (an H100,
        # 2026-12-07). They wait for the record first, bounded by the claimer's code, which
        # waits for nothing and ends in a trap (also where another report claimed). (Only here:
        # the other reports write a few words, and this loop at every stage wait made ptxas
        # spill.)
        while cute.arch.load(barrier_slots + BarrierSlots.STALL_REPORTED, Int32,
                             sem="acquire", scope="gpu") < REPORT_WRITTEN:
            pass
    cute.arch.inline_ptx("trap;")


@cute.jit
def record_laggards(record: cute.Pointer, progress: cute.Pointer,
                    warpgroups: cutlass.Constexpr):
    """The reporting thread, at the fused kernel's combine: into the record after its fields
    (`reports.PROGRESS_OFFSET`), how many of the grid's CTAs have a warpgroup whose progress
    word is not at this call's combine, the call's tag (low byte: this CTA's own word's),
    the warpgroups, and the first `PROGRESS_ENTRIES` such CTAs with their words."""
    bidx, _, _ = cute.arch.block_idx()
    num_ctas, _, _ = cute.arch.grid_dim()
    W = PROGRESS_WARPGROUPS
    tag = (cute.arch.load(progress + bidx * W, Int32, sem="relaxed", scope="gpu") >> 24) & 0xFF
    at_combine = (tag << 24) | (Progress.COMBINE << 16)
    count = Int32(0)
    for cta in cutlass.range(num_ctas):
        behind = Int32(0)
        for w in cutlass.range_constexpr(warpgroups):
            word = cute.arch.load(progress + cta * W + w, Int32, sem="relaxed", scope="gpu")
            if word != at_combine:
                behind = Int32(1)
        if behind != 0:
            if count < PROGRESS_ENTRIES:
                entry = record + PROGRESS_OFFSET + 3 + count * PROGRESS_ENTRY_WORDS
                cute.arch.store(entry, cta)
                for w in cutlass.range_constexpr(warpgroups):
                    cute.arch.store(entry + 1 + w, cute.arch.load(
                        progress + cta * W + w, Int32, sem="relaxed", scope="gpu"))
            count += 1
    cute.arch.store(record + PROGRESS_OFFSET, count)
    cute.arch.store(record + PROGRESS_OFFSET + 1, tag)
    cute.arch.store(record + PROGRESS_OFFSET + 2, Int32(warpgroups))


@cute.jit
def _report_stall(barrier_slots: cute.Pointer, what: cutlass.Constexpr, value: Int32,
                  target: Int32):
    report(barrier_slots, ReportKind.STALL, what, value, target)


@cute.jit
def report_disagreement(barrier_slots: cute.Pointer, what, value: Int32, expected: Int32):
    """Ranks launched one collective kernel with different settings: record which (`what`, as
    for `report`), a peer's value and this rank's, and stop the kernel (a trap) rather than
    let it produce wrong data."""
    report(barrier_slots, ReportKind.DISAGREE, what, value, expected)


def group_scope(num_ranks: int) -> str:
    """The memory scope of a group's synchronization: "sys" for several ranks (peers' memory
    over NVLink), "gpu" for one (its buffer and every reader of it within a call are on this
    GPU; 4-5 us less per layer call at 1 token on an H200 than "sys")."""
    return "sys" if num_ranks > 1 else "gpu"


@cute.jit
def fence_acq_rel(scope: cutlass.Constexpr):
    """`fence.acq_rel` at ``scope`` ("gpu" or "sys")."""
    if cutlass.const_expr(scope == "gpu"):
        cute.arch.fence_acq_rel_gpu()
    else:
        cute.arch.fence_acq_rel_sys()


@cute.jit
def wait_eq(barrier_slots: cute.Pointer, ptr: cute.Pointer, target: Int32,
            scope: cutlass.Constexpr, what: cutlass.Constexpr, timeout_ns: cutlass.Constexpr):
    """Spin until the int32 at `ptr` equals `target` (acquire at `scope`)."""
    value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
    if value != target:
        start = cute.arch.globaltimer()
        while value != target:
            value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
            if cutlass.const_expr(timeout_ns > 0):
                if cute.arch.globaltimer() - start > Int64(timeout_ns):
                    _report_stall(barrier_slots, what, value, target)


@cute.jit
def wait_reached(barrier_slots: cute.Pointer, ptr: cute.Pointer, target: Int32,
                 scope: cutlass.Constexpr, what: cutlass.Constexpr,
                 timeout_ns: cutlass.Constexpr, arrivals: cute.Pointer = None,
                 barrier: Int32 = 0, progress: cute.Pointer = None,
                 warpgroups: cutlass.Constexpr = 0, token: Int32 = None):
    """Spin until the int32 counter at `ptr` has reached `target` (acquire at `scope`), for
    counters that only grow and may wrap: `value - target >= 0` in 32-bit arithmetic. With
    ``arrivals`` (a split barrier's: `split_barrier_wait`), a stall report also carries this
    rank's arrival count at split barrier ``barrier`` (`reports.ReportKind.SPLIT_STALL`), and
    with ``progress`` the CTAs that did not arrive (`report`); with ``token`` (the per-token
    combine's), the token (`reports.ReportKind.TOKEN_STALL`)."""
    value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
    if value - target < 0:
        start = cute.arch.globaltimer()
        while value - target < 0:
            value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
            if cutlass.const_expr(timeout_ns > 0):
                if cute.arch.globaltimer() - start > Int64(timeout_ns):
                    if cutlass.const_expr(token is not None):
                        report(barrier_slots, ReportKind.TOKEN_STALL, what, value, target,
                               expert=token)
                    elif cutlass.const_expr(arrivals is None):
                        _report_stall(barrier_slots, what, value, target)
                    else:
                        report(barrier_slots, ReportKind.SPLIT_STALL, what, value, target,
                               cute.arch.load(arrivals, Int32, sem="relaxed", scope="gpu"),
                               barrier, progress, warpgroups)


@cute.jit
def wait_stage(barrier_slots: cute.Pointer, mbar: cute.Pointer, phase: Int32, stage: Int32,
               what: cutlass.Constexpr, timeout_ns: cutlass.Constexpr):
    """Wait until phase parity ``phase`` of the shared-memory mbarrier ``mbar`` (a pipeline
    stage's) has completed, as `cute.arch.mbarrier_wait`, but give up after ``timeout_ns`` with
    a stall report naming ``what`` (value: ``stage``, target: ``phase``): a role of a
    persistent kernel whose partner never arrives then shows up as which wait, in which CTA
    and thread, instead of a hang that the other ranks only see at their next barrier."""
    done = Int32(cute.arch.mbarrier_try_wait(mbar, phase))
    if done == 0:
        start = cute.arch.globaltimer()
        while done == 0:
            done = Int32(cute.arch.mbarrier_try_wait(mbar, phase))
            if cutlass.const_expr(timeout_ns > 0):
                if cute.arch.globaltimer() - start > Int64(timeout_ns):
                    _report_stall(barrier_slots, what, stage, phase)


@cute.jit
def call_tags(barrier_slots: cute.Pointer):
    """Every CTA at the start of a call: (this call's tag, the tag of the last call this rank
    finished). See the module doc, "call tags"."""
    tag = cute.arch.load(barrier_slots + BarrierSlots.CALL_TAG, Int32) + 1
    done = cute.arch.load(barrier_slots + BarrierSlots.CALL_DONE, Int32)
    return tag, done


@cute.jit
def wait_call_tag(barrier_slots: cute.Pointer, ptr: cute.Pointer, tag: Int32, done: Int32,
                  what: cutlass.Constexpr, source: Int32, expert: Int32,
                  timeout_ns: cutlass.Constexpr, scope: cutlass.Constexpr = "sys"):
    """Spin until the int64 word at `ptr` (written by rank `source` for global `expert`) holds
    `tag` in its high half (acquire at ``scope``); returns its low half. A word still at
    `done` is last call's: wait. Any other tag: the ranks are out of step (a rank skipped or
    added a call): report and trap."""
    value = cute.arch.load(ptr, Int64, sem="acquire", scope=scope)
    seen = Int32(value >> 32)
    if seen != tag:
        start = cute.arch.globaltimer()
        while seen != tag:
            if seen != done:
                report(barrier_slots, ReportKind.OUT_OF_STEP, what, seen, tag, source, expert)
            value = cute.arch.load(ptr, Int64, sem="acquire", scope=scope)
            seen = Int32(value >> 32)
            if cutlass.const_expr(timeout_ns > 0):
                if cute.arch.globaltimer() - start > Int64(timeout_ns):
                    report(barrier_slots, ReportKind.NOT_PUBLISHED, what, seen, tag, source,
                           expert)
    return Int32(value & 0xFFFFFFFF)


@cute.jit
def finish_call(barrier_slots: cute.Pointer, tag: Int32):
    """One thread, after the call's last cross-rank barrier: this rank finished call `tag`."""
    cute.arch.store(barrier_slots + BarrierSlots.CALL_TAG, tag)
    cute.arch.store(barrier_slots + BarrierSlots.CALL_DONE, tag)


@cute.jit
def grid_barrier(barrier_slots: cute.Pointer, num_ctas: Int32, timeout_ns: cutlass.Constexpr,
                 scope: cutlass.Constexpr = "sys"):
    """All CTAs of the grid (all resident: cooperative launch) meet here; every thread calls it.
    ``scope``: of the fences around it (`group_scope`)."""
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if tidx == 0:
        counter = barrier_slots + BarrierSlots.GRID
        cute.arch.fence_proxy("async.global")
        fence_acq_rel(scope)
        add = Int32(1)
        if bidx == 0:
            add = Int32(TOP_BIT - 1) - (num_ctas - 2)  # 2**31 - (num_ctas - 1), wrapping
        old = cute.arch.atomic_add(counter, add, sem="release", scope="gpu")
        current = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        if (current ^ old) >= 0:  # top bit not flipped yet
            start = cute.arch.globaltimer()
            while (current ^ old) >= 0:
                current = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
                if cutlass.const_expr(timeout_ns > 0):
                    if cute.arch.globaltimer() - start > Int64(timeout_ns):
                        _report_stall(barrier_slots, "grid barrier", current, old)
        fence_acq_rel(scope)
    cute.arch.sync_threads()


@cute.jit
def grid_arrive(barrier_slots: cute.Pointer, num_ctas: Int32, flag: cute.Pointer,
                scope: cutlass.Constexpr = "sys"):
    """Every CTA of the grid arrives at one phase of `grid_barrier`'s counter and goes on
    without waiting; returns, in every thread, whether this CTA arrived last (the add that
    flips the top bit), which has then acquired what every CTA wrote before it arrived (the
    others' writes reach it, not them). ``flag``: one Int32 of shared memory for the answer.
    No CTA may reach another grid barrier before every CTA has arrived: each must first wait
    for something the last one does after its arrival (the dispatch: the published counts).
    ``scope``: of its fences (`group_scope`)."""
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if tidx == 0:
        cute.arch.fence_proxy("async.global")
        fence_acq_rel(scope)
        add = Int32(1)
        if bidx == 0:
            add = Int32(TOP_BIT - 1) - (num_ctas - 2)  # as in grid_barrier
        old = cute.arch.atomic_add(barrier_slots + BarrierSlots.GRID, add, sem="release",
                                   scope="gpu")
        last = Int32(0)
        if ((old + add) ^ old) < 0:  # this add flipped the top bit: every CTA has arrived
            fence_acq_rel(scope)
            last = Int32(1)
        cute.arch.store(flag, last)
    cute.arch.sync_threads()
    return cute.arch.load(flag, Int32) != 0


@cute.jit
def cross_rank_barrier(barrier_slots: cute.Pointer, peer_bases: cute.Tensor,
                       barrier_offset: cutlass.Constexpr, num_ranks: Int32,
                       timeout_ns: cutlass.Constexpr, scope: cutlass.Constexpr = "sys"):
    """All ranks meet here. Called by every thread of ONE CTA per rank (the others wait at a
    grid barrier around it). `barrier_slots` is this rank's `barrier` region; a peer's copy is at
    `peer_bases[r] + barrier_offset`. ``scope``: `group_scope`."""
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    passed = cute.arch.load(barrier_slots + BarrierSlots.RANK_BARRIER_COUNT, Int32)
    phase = passed & 1  # bit operations: the count may have wrapped past 2**31
    delta = Int32(1) - (passed & 2)
    if tidx == 0:
        cute.arch.fence_proxy("async.global")
        fence_acq_rel(scope)
    cute.arch.sync_threads()
    signal_offset = barrier_offset + 4 * BarrierSlots.RANK_BARRIER_SIGNAL
    r = tidx
    while r < num_ranks:
        peer = cute.make_ptr(Int32, Int64(peer_bases[r]) + signal_offset,
                             cute.AddressSpace.gmem, assumed_align=4)
        cute.arch.red(peer + phase, delta, op="add", dtype="s32", sem="release", scope=scope)
        r += cute.arch.block_dim()[0]
    if tidx == 0:
        target = num_ranks if delta > 0 else Int32(0)
        wait_eq(barrier_slots, barrier_slots + BarrierSlots.RANK_BARRIER_SIGNAL + phase, target,
                scope, "cross-rank barrier signal", timeout_ns)
        cute.arch.store(barrier_slots + BarrierSlots.RANK_BARRIER_COUNT, passed + 1)
        fence_acq_rel(scope)
    cute.arch.sync_threads()


@cute.jit
def split_barrier_target(barrier_slots: cute.Pointer, num_ranks: cutlass.Constexpr) -> Int32:
    """Every CTA at the start of the call: the slot value this call's split barriers wait for
    (wraps modulo 2**32 as the slots do)."""
    return (cute.arch.load(barrier_slots + BarrierSlots.SPLIT_CALLS, Int32) + 1) * num_ranks


@cute.jit
def split_barrier_arrive(barrier_slots: cute.Pointer, peer_bases: cute.Tensor,
                         barrier_offset: cutlass.Constexpr, first: Int32,
                         count: cutlass.Constexpr, num_ranks: cutlass.Constexpr, num_ctas: Int32,
                         scope: cutlass.Constexpr = "sys"):
    """Every thread of every CTA: this CTA's stores so far are published at split barriers
    first .. first + count - 1 (the rank's last CTA to arrive signals every rank); returns
    without waiting. Every CTA of a rank arrives at the same runs. ``scope``: `group_scope`."""
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    if tidx < 32:
        old = Int32(0)
        arrivals = barrier_slots + BarrierSlots.SPLIT_ARRIVAL + first
        if tidx == 0:
            cute.arch.fence_proxy("async.global")
            fence_acq_rel(scope)
            old = cute.arch.atomic_add(arrivals, Int32(1), sem="acq_rel", scope="gpu")
            if old == num_ctas - 1:
                cute.arch.store(arrivals, Int32(0))  # every CTA has arrived; next: next call
                fence_acq_rel(scope)
        # the shuffle below carries no memory ordering: the warp sync orders lane 0's fences
        # (and what they made visible) before the other lanes' releases
        cute.arch.sync_warp()
        # the last CTA's warp 0 signals, one (rank, barrier) per lane: releases in parallel
        if cute.arch.shuffle_sync(old, 0) == num_ctas - 1:
            signal = tidx
            while signal < num_ranks * count:
                peer = cute.make_ptr(Int32, Int64(peer_bases[signal // count]) + barrier_offset
                                     + 4 * (BarrierSlots.SPLIT_SIGNAL + first + signal % count),
                                     cute.AddressSpace.gmem, assumed_align=4)
                cute.arch.red(peer, Int32(1), op="add", dtype="s32", sem="release", scope=scope)
                signal += 32


@cute.jit
def split_barrier_wait(barrier_slots: cute.Pointer, first: Int32, count: cutlass.Constexpr,
                       target: Int32, timeout_ns: cutlass.Constexpr,
                       scope: cutlass.Constexpr = "sys", progress: cute.Pointer = None,
                       warpgroups: cutlass.Constexpr = 0):
    """Every thread of a CTA: wait until every rank has arrived at split barriers
    first .. first + count - 1 (`target` from `split_barrier_target`; ``scope``:
    `group_scope`). ``progress``, ``warpgroups``: the fused kernel's progress words, whose
    CTAs not at the combine a stall report names."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx < count:
        # (a stall report also says how many of this rank's CTAs have arrived at the run,
        # counted in its first barrier's slot by `split_barrier_arrive`: the rank whose count
        # is short is the one a CTA of which never reached the barrier)
        wait_reached(barrier_slots, barrier_slots + BarrierSlots.SPLIT_SIGNAL + first + tidx,
                     target, scope, "split barrier signal", timeout_ns,
                     arrivals=barrier_slots + BarrierSlots.SPLIT_ARRIVAL + first,
                     barrier=first + tidx, progress=progress, warpgroups=warpgroups)
        fence_acq_rel(scope)
    cute.arch.sync_threads()


@cute.jit
def split_barrier_finish(barrier_slots: cute.Pointer):
    """Every thread of every CTA after its last split-barrier wait: one more call passed (CTA
    0 counts; every CTA has read the target by then, since the waits needed all of them to
    arrive)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if bidx == 0 and tidx == 0:
        calls = cute.arch.load(barrier_slots + BarrierSlots.SPLIT_CALLS, Int32)
        cute.arch.store(barrier_slots + BarrierSlots.SPLIT_CALLS, calls + 1)
