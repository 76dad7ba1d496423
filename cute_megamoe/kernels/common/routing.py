"""The routing check every dispatch runs on the GPU: bad top-k slots are masked and recorded.

A slot of a token's top-k row is *bad* when its expert index is outside ``[-1, E)`` or names
an expert an earlier slot of the same token names (the pool holds one row per token and
expert). The dispatch treats a bad slot as masked (-1) everywhere: it stores -1 over it in the
buffer's routing copy before anything else reads it, so the scatter, the row transfer and the
combine see a masked slot, and the other rows of the call are what they would be with that
slot masked. It counts the bad slots and keeps the first (smallest ``token * K + slot``) in
the rank's ``barrier`` slots (`layout.BarrierSlots.BAD_SLOTS`, ``FIRST_BAD_*``), and once every
check of the call is done one thread publishes them into the routing section of the rank's
pinned host record (`reports.ROUTING_OFFSET`) and zeroes the slots. The host raises that
record after a later call's launch, or when asked (`SymmBuffer.raise_routing_error`); nothing
traps, so the context lives on. No host synchronization: the check costs a compare per slot
pair of a token and works inside CUDA graphs.

Why a bad duplicate is the later slot: the first slot naming an expert is kept, so whether a
slot is bad does not depend on which other bad slots were already overwritten with -1 (a -1
never equals a valid index), and CTAs may check neighbouring tokens concurrently.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...layout.mega_moe import BarrierSlots
from ...reports import ROUTING_FIELDS, ROUTING_OFFSET
from .sync import report_record_address

__all__ = ["checked_row", "publish_bad_slots"]

_PAIR_KEY = 0x7FFFFFFF  # the keys hold this minus the pair: the largest key is the first pair


@cute.jit
def checked_row(topk_idx: cute.Pointer, token: Int32, num_topk: cutlass.Constexpr,
                num_experts: cutlass.Constexpr, barrier_slots: cute.Pointer,
                rewrite: cutlass.Constexpr = False, note: cutlass.Boolean = True) -> list:
    """Token ``token``'s experts from the int64 routing at ``topk_idx`` (``[tokens, K]``), -1
    for every masked or bad slot (module doc), as K Int32. ``rewrite``: -1 is stored over the
    bad slots in place; ``note``: the bad slots are counted into ``barrier_slots``
    (`note_bad_slots`, once per token)."""
    values = []
    for k in cutlass.range_constexpr(num_topk):
        values.append(cute.arch.load(topk_idx + token * num_topk + k, Int64))
    experts = []
    num_bad = Int32(0)
    first_bad = Int32(0)  # (its slot and value, valid once num_bad > 0)
    first_value = Int64(0)
    for k in cutlass.range_constexpr(num_topk):
        value = values[k]
        bad = Int32(0)
        if value < -1 or value >= num_experts:
            bad = Int32(1)
        for j in cutlass.range_constexpr(k):
            if value >= 0 and value == values[j]:
                bad = Int32(1)
        expert = Int32(value)
        if bad != 0:
            expert = Int32(-1)
            if cutlass.const_expr(rewrite):
                cute.arch.store(topk_idx + token * num_topk + k, Int64(-1))
            if num_bad == 0:
                first_bad = Int32(k)
                first_value = value
            num_bad += 1
        experts.append(expert)
    if num_bad != 0 and note:
        note_bad_slots(barrier_slots, num_bad, token * num_topk + first_bad, first_value)
    return experts


@cute.jit
def note_bad_slots(barrier_slots: cute.Pointer, num_bad: Int32, pair: Int32, value: Int64):
    """Count ``num_bad`` bad slots of this call, and keep ``pair`` (one of them) if it is the
    first so far (two atomic maxima whose keys order by the pair first, so both keep the same
    slot's value words)."""
    cute.arch.red(barrier_slots + BarrierSlots.BAD_SLOTS, num_bad, op="add", dtype="s32",
                  sem="relaxed", scope="gpu")
    key = Int64(_PAIR_KEY - pair) << 32
    cute.arch.red(_int64(barrier_slots, BarrierSlots.FIRST_BAD_LOW), key | (value & 0xFFFFFFFF),
                  op="max", dtype="s64", sem="relaxed", scope="gpu")
    cute.arch.red(_int64(barrier_slots, BarrierSlots.FIRST_BAD_HIGH),
                  key | ((value >> 32) & 0xFFFFFFFF), op="max", dtype="s64", sem="relaxed",
                  scope="gpu")


@cute.jit
def publish_bad_slots(barrier_slots: cute.Pointer):
    """One thread, once every `note_bad_slot` of the call is ordered before it: the call's bad
    slots into the pinned record's routing section (the first one only if the record holds
    none the host has not taken yet; the count adds up), and the barrier slots back to 0."""
    bad = cute.arch.atomic_exch(barrier_slots + BarrierSlots.BAD_SLOTS, Int32(0), scope="gpu")
    if bad != 0:
        low = cute.arch.atomic_exch(_int64(barrier_slots, BarrierSlots.FIRST_BAD_LOW), Int64(0),
                                    scope="gpu")
        high = cute.arch.atomic_exch(_int64(barrier_slots, BarrierSlots.FIRST_BAD_HIGH),
                                     Int64(0), scope="gpu")
        address = report_record_address(barrier_slots)
        if address != 0:
            record = cute.make_ptr(Int32, address + ROUTING_OFFSET * 4, cute.AddressSpace.gmem,
                                   assumed_align=4)
            earlier = cute.arch.load(record, Int32, sem="relaxed", scope="sys")
            if earlier == 0:
                cute.arch.store(record + ROUTING_FIELDS.index("pair"),
                                Int32(_PAIR_KEY - (low >> 32)))
                cute.arch.store(record + ROUTING_FIELDS.index("value_low"), Int32(low))
                cute.arch.store(record + ROUTING_FIELDS.index("value_high"), Int32(high))
                cute.arch.fence_acq_rel_sys()  # the fields reach host memory before the count
            total = cutlass.min(Int64(earlier) + Int64(bad), Int64(0x7FFFFFFF))
            cute.arch.store(record, Int32(total), sem="relaxed", scope="sys")


def _int64(barrier_slots: cute.Pointer, slot: int) -> cute.Pointer:
    """The int64 at int32 slot ``slot`` (even) of the barrier region."""
    return cute.recast_ptr(barrier_slots + slot, dtype=Int64)
