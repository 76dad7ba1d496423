"""The symmetric buffer one Mega MoE layer works in, and the user-visible views into it.

Each rank allocates one uint8 buffer laid out by :class:`~cute_megamoe.layout.MegaMoELayout`.
With several ranks it comes from ``torch.distributed._symmetric_memory`` so that every rank can
load from and store into every peer's copy over NVLink: the kernels get one base pointer per
rank (:attr:`SymmBuffer.buffer_ptrs`) and add a region's offset, which is the same on every rank.
With one rank (``group=None`` or a group of size 1) it is a plain ``torch.zeros`` tensor, which
may live on the CPU for host-side tests.

The user copies each call's inputs into ``x[:n]``, ``x_sf[:n]``, ``topk_idx[:n]`` and
``topk_weights[:n]`` before the call (as with DeepGEMM's ``SymmBuffer``). The buffer is zeroed
once here and the host never resets it: the kernels' counters only grow (wrap-safe) and their
count words carry the number of the call that wrote them (`kernels/common/sync.py`).
:meth:`SymmBuffer.zero_workspace_` restores a clean workspace after a failed call, and
:meth:`SymmBuffer.skip_call` keeps the call numbers right when a rank gives up a call on the
host. :meth:`SymmBuffer.loopback` builds the buffers of a whole group on one GPU, for tests of
the cross-rank protocol without several GPUs.
"""

from __future__ import annotations

import torch

from .heuristics import get_num_sms
from .layout import RECIPES, REGION_NAMES, BarrierSlots, MegaMoELayout
from .reports import (
    REPORT_WORDS,
    ROUTING_FIELDS,
    ROUTING_OFFSET,
    format_report,
    format_routing_error,
)

__all__ = ["SymmBuffer", "get_symm_buffer_for_mega_moe"]


def _region_property(name: str) -> property:
    def getter(self: SymmBuffer) -> torch.Tensor:
        return self.view(name)

    getter.__name__ = name
    getter.__doc__ = f"View of the ``{name}`` region (see :mod:`cute_megamoe.layout.mega_moe`)."
    return property(getter)


def _is_process_group(group: object) -> bool:
    if not torch.distributed.is_available():
        return False
    return isinstance(group, torch.distributed.ProcessGroup)


def _format_bytes(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / (1 << 20):.2f} MiB"


class SymmBuffer:
    """One rank's Mega MoE buffer: the allocation, peer pointers and typed region views.

    Prefer :func:`get_symm_buffer_for_mega_moe`. Attributes: ``layout``, ``rank``,
    ``num_ranks``, ``group`` (None for one process), ``buffer`` (1-D uint8 tensor of
    ``layout.num_bytes`` bytes), ``buffer_ptrs`` (base address of the buffer on every rank,
    indexed by rank), ``handle`` (the symmetric-memory handle; None with one rank), and one
    view property per region (``x``, ``x_sf``, ..., ``combine`` and the workspace regions).
    A region the recipe lacks (``x_sf`` and friends for ``bf16xbf16``) raises
    :class:`~cute_megamoe.layout.AbsentRegionError` on access. ``l1_output_rows`` and
    ``received_rows`` (keyword only) lay out the L1 outputs or the received rows as rings
    (`get_symm_buffer_for_mega_moe`).
    """

    def __init__(
        self,
        group: torch.distributed.ProcessGroup | None,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        mma_type: str = "fp8xfp4",
        device: torch.device | str | int | None = None,
        *,
        l1_output_rows: int | None = None,
        received_rows: int | None = None,
    ) -> None:
        if group is not None and not _is_process_group(group):
            raise TypeError(
                f"group must be None or a torch.distributed.ProcessGroup, got "
                f"{type(group).__name__}"
            )
        if group is None:
            rank, num_ranks = 0, 1
        else:
            rank, num_ranks = group.rank(), group.size()
        if isinstance(num_experts, int) and not isinstance(num_experts, bool):
            if num_experts % num_ranks != 0:
                raise ValueError(
                    f"num_experts ({num_experts}) must be a multiple of the group size "
                    f"({num_ranks})"
                )
        # The layout calls it `recipe`; this API (DeepGEMM's) calls it `mma_type`.
        if not isinstance(mma_type, str):
            raise TypeError(f"mma_type must be a str, got {type(mma_type).__name__}")
        if mma_type not in RECIPES:
            raise ValueError(f"mma_type must be one of {RECIPES}, got {mma_type!r}")
        layout = MegaMoELayout(
            num_ranks=num_ranks,
            num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_topk=num_topk,
            hidden=hidden,
            intermediate_hidden=intermediate_hidden,
            recipe=mma_type,
            l1_output_rows=l1_output_rows,
            received_rows=received_rows,
        )

        self.layout: MegaMoELayout = layout
        self.group = group
        self.rank: int = rank
        self.num_ranks: int = num_ranks
        self.handle: object | None = None
        # SMs this rank's kernels take by default (None: all of the GPU's)
        self.num_sms: int | None = None
        if num_ranks == 1:
            if device is None and not torch.cuda.is_available():
                raise RuntimeError(
                    "get_symm_buffer_for_mega_moe: no CUDA GPU is available; pass device='cpu' "
                    "for a host-side buffer (one rank: layout, staging and reference checks)")
            dev = torch.device("cuda" if device is None else device)
            buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8, device=dev)
            buffer_ptrs = [buffer.data_ptr()]
        else:
            buffer, self.handle, buffer_ptrs = self._alloc_symmetric(device)
        self._attach(buffer, buffer_ptrs)

    def _attach(self, buffer: torch.Tensor, buffer_ptrs: list[int]) -> None:
        self.buffer: torch.Tensor | None = buffer
        self.buffer_ptrs: list[int] = buffer_ptrs
        self._views: dict[str, torch.Tensor] = {
            name: self.layout.view(buffer, name) for name in REGION_NAMES
            if self.layout.has(name)
        }
        # Every rank's base address, on the buffer's device: the kernels' peer table.
        self.peer_bases: torch.Tensor = torch.tensor(buffer_ptrs, dtype=torch.int64,
                                                     device=buffer.device)
        # The pinned host record a trapping kernel leaves (`reports`; a CPU buffer has none)
        self.report_record: torch.Tensor | None = None
        self._report_words = None  # (a numpy view of it: a check costs ~0.1 us)
        if buffer.device.type == "cuda":
            self.report_record = torch.zeros(REPORT_WORDS, dtype=torch.int32, pin_memory=True)
            self._report_words = self.report_record.numpy()
            self._publish_report_record()

    def _publish_report_record(self) -> None:
        """Write the record's address into this rank's ``REPORT`` barrier slots (the kernels
        find it there; `zero_workspace_` clears them)."""
        address = self.report_record.data_ptr()
        words = [address & 0xFFFFFFFF, address >> 32]
        words = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
        slot = BarrierSlots.REPORT
        self.barrier[slot:slot + 2].copy_(torch.tensor(words, dtype=torch.int32))
        torch.cuda.synchronize(self.buffer.device)  # before any kernel on any stream

    def report(self) -> str | None:
        """The message of the stall or disagreement report a kernel of this rank left before
        it trapped (`reports`), or None. A trap leaves the CUDA context unusable; the entry
        points raise this message instead of launching on the buffer again."""
        if self.report_record is None:
            return None
        return format_report(self.report_record.tolist(), self.rank)

    def raise_if_reported(self) -> None:
        """Raise `report`'s message if a kernel of this rank left one (every launch path
        checks first: nothing may run on a context a trap has lost)."""
        if self._report_words is not None and self._report_words[0] != 0:
            raise RuntimeError(f"{self.report()} (a kernel trapped; the CUDA context is lost)")

    def raise_routing_error(self) -> None:
        """Raise `ValueError` naming the first bad routing slot (token, slot, value) and how
        many there were, if a dispatch of this rank recorded one (`kernels/common/routing.py`)
        since the last raise, and take the record. No synchronization: it sees the calls the
        GPU has run so far (~0.1 us); the layer entry points call it after their launches."""
        words = self._report_words
        if words is None or words[ROUTING_OFFSET] == 0:
            return
        fields = words[ROUTING_OFFSET:ROUTING_OFFSET + len(ROUTING_FIELDS)].tolist()
        words[ROUTING_OFFSET:ROUTING_OFFSET + len(ROUTING_FIELDS)] = 0
        layout = self.layout
        raise ValueError(format_routing_error(fields, layout.num_topk, layout.num_experts,
                                              self.rank))

    def check_routing_errors(self) -> None:
        """Wait for the buffer's device, then `raise_routing_error`: every call made so far
        has been checked (after CUDA-graph replays, say, which no host code follows)."""
        if self.report_record is not None:
            torch.cuda.synchronize(self.device)
            self.raise_routing_error()

    @classmethod
    def loopback(cls, num_ranks: int, num_experts: int, num_max_tokens_per_rank: int,
                 num_topk: int, hidden: int, intermediate_hidden: int,
                 mma_type: str = "fp8xfp8",
                 device: torch.device | str | int | None = None, *,
                 l1_output_rows: int | None = None,
                 received_rows: int | None = None) -> list[SymmBuffer]:
        """The buffers of all ``num_ranks`` ranks of a group, on one GPU, each one's peer table
        pointing at the others: a whole expert-parallel group in one process, for testing the
        cross-rank protocol (counts, tags, barriers, the agreement checks) where only one GPU
        is at hand. Peer traffic then stays in the GPU's memory (no NVLink). Every rank's
        collective kernels must run at the same time: launch rank r's calls on a stream of its
        own, with at most SMs / ``num_ranks`` CTAs each (``num_sms``), and synchronize with
        the host only once every rank's call is launched: the buffers' ``num_sms`` is set to
        that share, which the entry points use when not told otherwise. ``l1_output_rows``
        and ``received_rows``: the rings, as for `get_symm_buffer_for_mega_moe`."""
        layout = MegaMoELayout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk,
                               hidden, intermediate_hidden, mma_type, l1_output_rows,
                               received_rows)
        dev = torch.device("cuda" if device is None else device)
        allocations = [torch.zeros(layout.num_bytes, dtype=torch.uint8, device=dev)
                       for _ in range(num_ranks)]
        bases = [allocation.data_ptr() for allocation in allocations]
        buffers = []
        for rank, allocation in enumerate(allocations):
            buf = cls.__new__(cls)
            buf.layout, buf.group, buf.handle = layout, None, None
            buf.rank, buf.num_ranks = rank, num_ranks
            buf.num_sms = max(1, get_num_sms(dev) // num_ranks)
            buf._attach(allocation, bases)
            buffers.append(buf)
        return buffers

    # ------------------------------------------------------------------ allocation

    def _cuda_device(self, device: torch.device | str | int | None) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError("a multi-rank SymmBuffer needs CUDA (symmetric memory)")
        current = torch.device("cuda", torch.cuda.current_device())
        if device is None:
            return current
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device with several ranks, got {dev}")
        if dev.index is not None and dev.index != current.index:
            raise ValueError(
                f"device ({dev}) must be the current CUDA device ({current}); call "
                f"torch.cuda.set_device first"
            )
        return current

    def _barrier(self) -> None:
        import torch.distributed as dist

        backend = str(dist.get_backend(self.group))
        if "nccl" in backend:
            # Name the device so NCCL does not guess it (and does not warn).
            dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=self.group)

    def _alloc_symmetric(
        self, device: torch.device | str | int | None
    ) -> tuple[torch.Tensor, object, list[int]]:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        dev = self._cuda_device(device)
        group = self.group
        assert group is not None
        # Every rank must lay the buffer out alike (peers address it by their own layout):
        # check before allocating, so every rank raises the same error.
        layouts: list[object] = [None] * self.num_ranks
        dist.all_gather_object(layouts, self.layout, group=group)
        if any(other != self.layout for other in layouts):
            differ = sorted({r for r, other in enumerate(layouts) if other != self.layout})
            raise ValueError(
                f"get_symm_buffer_for_mega_moe: the ranks passed different arguments (rank "
                f"{self.rank}: {self.layout!r}; ranks {differ} differ from it); every rank "
                f"must pass the same shapes and mma_type")
        buffer = symm_mem.empty(self.layout.num_bytes, dtype=torch.uint8, device=dev)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        handle_rank = getattr(handle, "rank", self.rank)
        handle_size = getattr(handle, "world_size", self.num_ranks)
        if handle_rank != self.rank or handle_size != self.num_ranks:
            raise RuntimeError(
                f"symmetric-memory handle says rank {handle_rank}/{handle_size}, the group says "
                f"{self.rank}/{self.num_ranks}"
            )
        # `handle.buffer_ptrs` are the bases of the symmetric *allocation* on each rank. Since
        # torch 2.9 `symm_mem.empty` may carve the tensor out of a pooled allocation, so the
        # tensor can start `handle.offset` bytes in; peers find it at the same offset only if
        # every rank's offset agrees, which we check rather than assume.
        bases = [int(p) for p in handle.buffer_ptrs]
        local_offset = buffer.data_ptr() - bases[self.rank]
        reported = getattr(handle, "offset", local_offset)
        if reported != local_offset:
            raise RuntimeError(
                f"symmetric-memory offset mismatch: handle.offset={reported}, "
                f"data_ptr - buffer_ptrs[rank]={local_offset}"
            )
        offsets: list[object] = [None] * self.num_ranks
        dist.all_gather_object(offsets, local_offset, group=group)
        if any(o != local_offset for o in offsets):
            raise RuntimeError(
                f"the buffer sits at different offsets inside the symmetric allocation on "
                f"different ranks ({offsets}); allocate it on every rank in the same order, or "
                f"set TORCH_SYMMMEM_IMPLICIT_POOL=0"
            )
        buffer_ptrs = [base + local_offset for base in bases]

        buffer.zero_()
        # Every rank's zero-fill must land before any peer's first kernel writes into it.
        torch.cuda.synchronize(dev)
        self._barrier()
        torch.cuda.synchronize(dev)
        return buffer, handle, buffer_ptrs

    # ------------------------------------------------------------------ views

    def view(self, name: str) -> torch.Tensor:
        """The typed view of region ``name`` (the same tensor the property returns)."""
        if self.buffer is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        v = self._views.get(name)
        if v is None:
            self.layout.region(name)  # raises AbsentRegionError / KeyError
            raise AssertionError(name)  # pragma: no cover - every present region has a view
        return v

    def has(self, name: str) -> bool:
        """Whether region ``name`` exists for this buffer's recipe."""
        return self.layout.has(name)

    # Workspace regions.
    barrier = _region_property("barrier")
    expert_send_count = _region_property("expert_send_count")
    expert_recv_count = _region_property("expert_recv_count")
    src_token_topk_idx = _region_property("src_token_topk_idx")
    dispatch_pair_slot = _region_property("dispatch_pair_slot")
    token_src_metadata = _region_property("token_src_metadata")
    pool_block_arrivals = _region_property("pool_block_arrivals")
    pool_block_ready = _region_property("pool_block_ready")
    pool_block_l2_done = _region_property("pool_block_l2_done")
    token_arrivals = _region_property("token_arrivals")
    cta_progress = _region_property("cta_progress")
    # Data regions.
    x = _region_property("x")
    x_sf = _region_property("x_sf")
    topk_idx = _region_property("topk_idx")
    topk_weights = _region_property("topk_weights")
    l1_acts = _region_property("l1_acts")
    l1_acts_sf = _region_property("l1_acts_sf")
    l1_topk_weights = _region_property("l1_topk_weights")
    l2_acts = _region_property("l2_acts")
    l2_acts_sf = _region_property("l2_acts_sf")
    combine = _region_property("combine")

    # ------------------------------------------------------------------ shape parameters

    @property
    def recipe(self) -> str:
        return self.layout.recipe

    mma_type = recipe

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def num_local_experts(self) -> int:
        return self.layout.num_local_experts

    @property
    def num_max_tokens_per_rank(self) -> int:
        """The value asked for; the views hold ``num_tokens`` (aligned) rows."""
        return self.layout.num_max_tokens_per_rank

    @property
    def num_tokens(self) -> int:
        """Token rows of ``x`` and friends: ``num_max_tokens_per_rank`` aligned to 128."""
        return self.layout.num_tokens

    @property
    def num_topk(self) -> int:
        return self.layout.num_topk

    @property
    def hidden(self) -> int:
        return self.layout.hidden

    @property
    def intermediate_hidden(self) -> int:
        return self.layout.intermediate_hidden

    @property
    def num_bytes(self) -> int:
        return self.layout.num_bytes

    @property
    def device(self) -> torch.device:
        if self.buffer is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        return self.buffer.device

    # ------------------------------------------------------------------ lifecycle

    def skip_call(self) -> None:
        """This rank gives up the current collective call before launching it (an entry point
        raised on the host): count it as made, on the stream, so that the kernels of the next
        call on this rank carry a different call tag than its peers' if they made this one,
        and trap saying the ranks are out of step instead of pairing one rank's call with
        another call of its peers. (If every rank skips the call, the tags stay equal.) The
        entry points call it; a caller that gives up a call in its own code calls it too."""
        if self.buffer is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        slot = BarrierSlots.CALL_TAG
        self.barrier[slot:slot + 1].add_(1)

    def zero_workspace_(self) -> SymmBuffer:
        """Zero every workspace region (recovery after a failed or interrupted call).

        Data regions are left alone. Call it only while no kernel uses the buffer. With several
        ranks it is collective: every rank must call it, and it returns after all have zeroed,
        so no peer's next call can write into a workspace that is still being cleared.
        """
        if self.buffer is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        self.buffer[: self.layout.workspace_nbytes].zero_()
        if self.report_record is not None:
            self._publish_report_record()
        if self.num_ranks > 1 and self.group is not None:
            torch.cuda.synchronize(self.buffer.device)
            self._barrier()
            torch.cuda.synchronize(self.buffer.device)
        return self

    def destroy(self) -> None:
        """Drop the buffer, views, handle and group references (the memory is freed once no
        other reference remains). Any later view access raises ``RuntimeError``."""
        self._views = {}
        self.handle = None
        self.buffer = None
        self.buffer_ptrs = []
        self.group = None

    def __repr__(self) -> str:
        lay = self.layout
        state = "" if self.buffer is not None else ", destroyed"
        device = f", device={self.buffer.device}" if self.buffer is not None else ""
        return (
            f"SymmBuffer(rank={self.rank}, num_ranks={self.num_ranks}, recipe={lay.recipe!r}, "
            f"num_experts={lay.num_experts}, num_max_tokens_per_rank="
            f"{lay.num_max_tokens_per_rank} (T={lay.num_tokens}), num_topk={lay.num_topk}, "
            f"hidden={lay.hidden}, intermediate_hidden={lay.intermediate_hidden}, "
            f"size={_format_bytes(lay.num_bytes)}{device}{state})"
        )


def get_symm_buffer_for_mega_moe(
    group: torch.distributed.ProcessGroup | None,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    use_fp8_dispatch: bool | None = None,
    mma_type: str = "fp8xfp4",
    activation: str = "swiglu",
    *,
    device: torch.device | str | int | None = None,
    l1_output_rows: int | None = None,
    received_rows: int | None = None,
) -> SymmBuffer:
    """Allocate (collectively, with several ranks) and zero the buffer for a Mega MoE layer.

    DeepGEMM's function, name and signature. ``group=None`` means one process and one rank
    (all experts local); ``device`` (ours, keyword only) defaults to CUDA and may be ``'cpu'``
    then. With a process group of several ranks every rank must call this with the same
    arguments (checked: different ones raise on every rank), after ``torch.cuda.set_device``;
    the buffer lives on the current CUDA device. ``mma_type`` is one of ``'fp8xfp4'``,
    ``'fp8xfp8'``, ``'bf16xbf16'``, ``'fp8xfp4_sm90'`` (laid out as ``'fp8xfp8'``: only its
    weights differ, `tables.activation_recipe`). ``use_fp8_dispatch`` is deprecated in
    DeepGEMM and only checked against ``mma_type`` (FP8 activations for the fp8 recipes);
    ``activation`` must be ``'swiglu'``. ``l1_output_rows`` (ours, keyword only): keep the L1
    outputs in a ring of that many rows instead of a row per pool row (`MegaMoELayout`); only
    the fused kernel's ticket walk with an L1-output ring that fits it runs on such a buffer.
    ``received_rows`` (ours, keyword only): likewise the received rows (the L1 inputs and
    their scales) in a ring of that many rows; only the fused kernel with
    ``row_transfer='pulled'`` runs on such a buffer.
    """
    if activation != "swiglu":
        raise ValueError(f"activation: only 'swiglu' is implemented, got {activation!r}")
    if use_fp8_dispatch is not None:
        if not isinstance(use_fp8_dispatch, bool):
            raise TypeError(f"use_fp8_dispatch: expected None or a bool (DeepGEMM's 7th "
                            f"argument; pass mma_type by keyword), got {use_fp8_dispatch!r}")
        if use_fp8_dispatch != (mma_type != "bf16xbf16"):
            raise ValueError(f"use_fp8_dispatch={use_fp8_dispatch} contradicts "
                             f"mma_type={mma_type!r}")
    return SymmBuffer(
        group,
        num_experts,
        num_max_tokens_per_rank,
        num_topk,
        hidden,
        intermediate_hidden,
        mma_type=mma_type,
        device=device,
        l1_output_rows=l1_output_rows,
        received_rows=received_rows,
    )
