"""Peak memory of PyTorch code on any device, without a GPU: every storage an aten op creates.

    with TrackStorages() as track:
        weights = ExpertWeights.from_bf16(w1, w2, "fp8xfp8", arch="sm_90a")
    track.peak_bytes, track.live_bytes()   # the most alive at once, what is alive now

A `TorchDispatchMode` sees the outputs of every aten op run inside the block (composite ops
decompose into the aten ops they run) and keeps a weak reference to each new storage (not to
one an output shares with an input: a view, an in-place result); after
each op it adds the bytes of the storages still alive. So ``peak_bytes`` is the most memory the
block's tensors held at once, counted at op boundaries: the model of
`torch.cuda.max_memory_allocated` minus what was allocated before, without the allocator's
rounding and without the scratch memory an op uses inside (e.g. a CUDA reduction's workspace).
The weight-preparation budgets of `chunks` are calibrated with it (`peak_extra_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TrackStorages", "peak_extra_bytes"]


class TrackStorages(TorchDispatchMode):
    """Within: the bytes of the storages made inside, alive at once (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0

    def live_bytes(self) -> int:
        """Bytes of the storages made inside that are still alive."""
        for key in [k for k, (ref, _) in self._alive.items() if ref.expired()]:
            del self._alive[key]
        return sum(nbytes for _, nbytes in self._alive.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (a view or an in-place result shares an input's storage: not a new one)
        inputs = {t.untyped_storage()._cdata
                  for t in _tensors(list(args) + list((kwargs or {}).values()))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self._alive and key not in inputs:
                self._alive[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


def peak_extra_bytes(fn: Callable[[], object]) -> tuple[int, int, object]:
    """``(peak bytes beyond the result, the result's bytes, the result)`` of ``fn()``: the
    most memory its temporaries held at once besides the result it returns (what
    `bench/weights.py` measures on the GPU as ``peak_extra_bytes``)."""
    with TrackStorages() as track:
        result = fn()
    kept = track.live_bytes()
    return track.peak_bytes - kept, kept, result
