"""Host runtime: arch detection, torch -> CuTe argument conversion, the compiled-kernel cache.

Kernels are compiled once per static configuration (recipe, shapes that are baked in, arch) and
kept in a process-wide dict; `cute.compile` itself never caches. Tensors are passed to kernels
as raw `cute.Pointer`s plus integer sizes: building a pointer costs far less per call than a
DLPack conversion, and the kernels know their layouts statically.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable

import torch

from .tables import ARCH_BY_MAJOR

_COMPILED: dict[Hashable, object] = {}


def get_arch(device: torch.device | int | None = None) -> str:
    """The CuTe DSL target for a CUDA device: `sm_90a` (Hopper) or `sm_100a` (Blackwell)."""
    if not torch.cuda.is_available():
        raise RuntimeError("a CUDA GPU is required to run the kernels (none is available)")
    if isinstance(device, int):
        return _arch_of(device)
    index = None if device is None else torch.device(device).index
    return _arch_of(torch.cuda.current_device() if index is None else index)


@functools.cache
def _arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    if major not in ARCH_BY_MAJOR:
        raise ValueError(
            f"device: compute capability {major}.{minor} is not supported "
            f"(supported: 9.0 Hopper, 10.x Blackwell)")
    return ARCH_BY_MAJOR[major]


@functools.cache
def cutlass_dtype(torch_dtype: torch.dtype):
    import cutlass

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
        torch.uint8: cutlass.Uint8,
        torch.int8: cutlass.Int8,
    }
    return table[torch_dtype]


def as_ptr(tensor: torch.Tensor, align: int = 16, dtype=None):
    """A `cute.Pointer` to the first element of `tensor` (global memory, `align` bytes assumed),
    typed as `tensor`'s dtype or as the CuTe `dtype` given (e.g. packed FP4 / UE8M0 bytes)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype or cutlass_dtype(tensor.dtype), tensor.data_ptr(),
                    cute.AddressSpace.gmem, assumed_align=align)


def current_stream():
    from cuda.bindings import driver

    return driver.CUstream(torch.cuda.current_stream().cuda_stream)


def spin_timeout_ns() -> int:
    """Compile-time limit in ns of every in-kernel wait, from `CUTE_MEGAMOE_SPIN_TIMEOUT_S`
    (default 120 s; 0 waits forever). Part of every compiled kernel's cache key."""
    return int(float(os.environ.get("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "120")) * 1e9)


def compiled_kernel(key: Hashable, build: Callable[[], object]) -> object:
    """The compiled function for `key`, compiling it with `build()` on first use. The wait
    limit is compiled into the kernels, so it is part of the key: changing
    `CUTE_MEGAMOE_SPIN_TIMEOUT_S` between calls compiles again rather than keeping the old."""
    key = (key, spin_timeout_ns())
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = build()
    return fn


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean `CUTE_MEGAMOE_*` environment switch ("1"/"true"/"yes" are true)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")
