"""Grid and cross-rank barriers, and bounded spin-waits, for persistent multi-GPU kernels.

Memory-model rules (design.md section 5):
* a flag is never read with a plain load: spins use `ld.acquire` at the flag's scope;
* data other ranks must see is published with a system-scope release;
* every barrier starts with `fence.acq_rel.sys` and a proxy fence, so that ordinary stores and
  bulk-async (TMA) stores issued before it are ordered before the release, also across GPUs.

Barrier state lives in the `barrier` workspace region (int32 slots, below) and is never reset:
* grid barrier: DeepGEMM's top-bit flip. Every CTA adds to one counter; CTA 0 adds
  `2**31 - (num_ctas - 1)`, the others 1. The adds sum to 2**31, so the top bit flips once per
  barrier and the low bits come back to where they were. A CTA waits until the top bit differs
  from the value its own add returned.
* cross-rank barrier: each rank keeps a local count of barriers passed; barrier b uses signal
  slot `b % 2` and adds +1 (b // 2 even) or -1 (odd) to that slot on every rank, itself included;
  the slot then reads R (or 0) on every rank once all have arrived. Two alternating slots let a
  rank enter barrier b + 1 while a slower rank still reads barrier b's slot; signals swing between
  0 and R forever. Every rank must execute the same sequence of cross-rank barriers.

Waits give up after `timeout_ns` (a compile-time setting, `CUTE_MEGAMOE_SPIN_TIMEOUT_S`, default
120 s, 0 = never): the first thread to time out prints which counter stalled, its value and the
target, then traps, so a lost rank shows up as an error instead of a silent hang.
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

# Slots of the `barrier` region (int32 each)
GRID_BARRIER_SLOT = 0
RANK_BARRIER_COUNT_SLOT = 4  # local: cross-rank barriers passed so far
RANK_BARRIER_SIGNAL_SLOT = 5  # two slots (5, 6), added to by every rank

TOP_BIT = 0x80000000


def spin_timeout_ns() -> int:
    """Compile-time wait limit in ns from `CUTE_MEGAMOE_SPIN_TIMEOUT_S` (0 disables)."""
    return int(float(os.environ.get("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "120")) * 1e9)


@cute.jit
def _report_stall(what: cutlass.Constexpr, value: Int32, target: Int32):
    bidx, _, _ = cute.arch.block_idx()
    tidx, _, _ = cute.arch.thread_idx()
    cute.printf("cute_megamoe: wait on " + what + " stalled (cta %d, thread %d): value %d, "
                "target %d", bidx, tidx, value, target)
    cute.arch.inline_ptx("trap;")


@cute.jit
def wait_geq(ptr: cute.Pointer, target: Int32, scope: cutlass.Constexpr,
             what: cutlass.Constexpr, timeout_ns: cutlass.Constexpr):
    """Spin until the int32 at `ptr` is >= `target` (acquire at `scope`); returns the value."""
    value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
    if value < target:
        start = cute.arch.globaltimer()
        while value < target:
            value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
            if cutlass.const_expr(timeout_ns > 0):
                if cute.arch.globaltimer() - start > Int64(timeout_ns):
                    _report_stall(what, value, target)
    return value


@cute.jit
def wait_eq(ptr: cute.Pointer, target: Int32, scope: cutlass.Constexpr,
            what: cutlass.Constexpr, timeout_ns: cutlass.Constexpr):
    """Spin until the int32 at `ptr` equals `target` (acquire at `scope`)."""
    value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
    if value != target:
        start = cute.arch.globaltimer()
        while value != target:
            value = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
            if cutlass.const_expr(timeout_ns > 0):
                if cute.arch.globaltimer() - start > Int64(timeout_ns):
                    _report_stall(what, value, target)


@cute.jit
def wait_published(ptr: cute.Pointer, what: cutlass.Constexpr, timeout_ns: cutlass.Constexpr):
    """Spin until the int64 at `ptr` has non-zero high bits (a `(1 << 32) | value` publication,
    acquire at system scope); returns its low 32 bits."""
    value = cute.arch.load(ptr, Int64, sem="acquire", scope="sys")
    if (value >> 32) == 0:
        start = cute.arch.globaltimer()
        while (value >> 32) == 0:
            value = cute.arch.load(ptr, Int64, sem="acquire", scope="sys")
            if cutlass.const_expr(timeout_ns > 0):
                if cute.arch.globaltimer() - start > Int64(timeout_ns):
                    _report_stall(what, Int32(0), Int32(1))
    return Int32(value & 0xFFFFFFFF)


@cute.jit
def grid_barrier(counter: cute.Pointer, num_ctas: Int32, timeout_ns: cutlass.Constexpr):
    """All CTAs of the grid (all resident: cooperative launch) meet here; every thread calls it."""
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if tidx == 0:
        cute.arch.fence_proxy("async.global")
        cute.arch.fence_acq_rel_sys()
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
                        _report_stall("grid barrier", current, old)
        cute.arch.fence_acq_rel_sys()
    cute.arch.sync_threads()


@cute.jit
def cross_rank_barrier(barrier_slots: cute.Pointer, peer_bases: cute.Tensor,
                       barrier_offset: cutlass.Constexpr, num_ranks: Int32,
                       timeout_ns: cutlass.Constexpr):
    """All ranks meet here. Called by every thread of ONE CTA per rank (the others wait at a
    grid barrier around it). `barrier_slots` is this rank's `barrier` region; a peer's copy is at
    `peer_bases[r] + barrier_offset`."""
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    passed = cute.arch.load(barrier_slots + RANK_BARRIER_COUNT_SLOT, Int32)
    phase = passed % 2
    delta = Int32(1) - 2 * ((passed // 2) % 2)
    if tidx == 0:
        cute.arch.fence_proxy("async.global")
        cute.arch.fence_acq_rel_sys()
    cute.arch.sync_threads()
    signal_offset = barrier_offset + 4 * RANK_BARRIER_SIGNAL_SLOT
    r = tidx
    while r < num_ranks:
        peer = cute.make_ptr(Int32, Int64(peer_bases[r]) + signal_offset,
                             cute.AddressSpace.gmem, assumed_align=4)
        cute.arch.red(peer + phase, delta, op="add", dtype="s32", sem="release", scope="sys")
        r += cute.arch.block_dim()[0]
    if tidx == 0:
        target = num_ranks if delta > 0 else Int32(0)
        wait_eq(barrier_slots + RANK_BARRIER_SIGNAL_SLOT + phase, target, "sys",
                "cross-rank barrier signal", timeout_ns)
        cute.arch.store(barrier_slots + RANK_BARRIER_COUNT_SLOT, passed + 1)
        cute.arch.fence_acq_rel_sys()
    cute.arch.sync_threads()
