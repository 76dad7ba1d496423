"""Host runtime: arch detection, the launch path, torch -> kernel arguments, the compiled-kernel
cache.

Kernels are compiled once per static configuration (recipe, shapes that are baked in, arch) and
kept in a process-wide dict; `cute.compile` itself never caches. Tensors are passed to kernels
as raw pointers plus integer sizes: the kernels know their layouts statically.

Launch paths (`LaunchPath`, chosen once at import; `CUTE_MEGAMOE_TVM_FFI`):

* ``"tvm-ffi"`` (when ``apache-tvm-ffi`` imports): kernels are compiled with
  ``--enable-tvm-ffi`` and launched through the raw positional ``tvm_ffi.Function``
  (``compiled._tvm_ffi_function``; CuTe DSL 4.8.1's keyword wrapper around it costs what the
  path saves). Its C stub takes a pointer argument as a Python int (the address), an ``Int32``
  as an int and the stream as an int (``cudaStream_t``), and checks them itself.
* ``"cute-dsl"``: CuTe DSL's own call path (a `cute.Pointer` per pointer, `cutlass.Int32`,
  a `cuda.CUstream`; ~10-17 us of Python per launch in the DSL).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Hashable

import torch

from .tables import ARCH_BY_MAJOR

__all__ = [
    "LAUNCH_PATHS",
    "LOGGER",
    "LaunchPath",
    "as_ptr",
    "compiled_kernel",
    "current_raw_stream",
    "current_stream",
    "cutlass_dtype",
    "env_choice",
    "env_flag",
    "compiles_refused",
    "get_arch",
    "launch_path",
    "set_launch_path",
    "spin_timeout_ns",
    "tvm_ffi_available",
]

_COMPILED: dict[Hashable, object] = {}
# why a compile now would deadlock (`compiles_refused`), innermost last
_NO_COMPILES: list[str] = []


@contextlib.contextmanager
def compiles_refused(why: str):
    """Within: `compiled_kernel` raises (naming ``why``) instead of compiling a kernel it has not
    compiled yet. For several ranks in one process (`testing.protocol_checks.Ranks`): a kernel's
    first launch loads its module, which waits for every running kernel, so a rank that loads
    one after another rank's collective kernels of the same call were launched deadlocks until
    their spin limit (and the trap takes the CUDA context); this names the kernel instead."""
    _NO_COMPILES.append(why)
    try:
        yield
    finally:
        _NO_COMPILES.pop()


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
    """The current CUDA stream as a `cuda.CUstream` (what `cute.compile` and the CuTe DSL call
    path take)."""
    from cuda.bindings import driver

    return driver.CUstream(torch.cuda.current_stream().cuda_stream)


# `cudaStream_t` of the current stream of a device as an int, without building a torch Stream
# (what inductor's generated code uses); None in CPU builds of torch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream() -> int:
    """The current CUDA stream of the current device, as an int (``cudaStream_t``)."""
    if _raw_stream is None:
        return torch.cuda.current_stream().cuda_stream
    return _raw_stream(torch.cuda.current_device())


def spin_timeout_ns() -> int:
    """Compile-time limit in ns of every in-kernel wait, from `CUTE_MEGAMOE_SPIN_TIMEOUT_S`
    (seconds, a number >= 0; default 120; 0 waits forever). Part of every compiled kernel's
    cache key and of the layer plans' keys."""
    name = "CUTE_MEGAMOE_SPIN_TIMEOUT_S"
    value = os.environ.get(name, "").strip()
    if not value:
        return 120 * 10**9
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"{name}: seconds, a number >= 0 (0 waits forever), got {value!r}")
    return int(seconds * 1e9)


def compiled_kernel(key: Hashable, build: Callable[[], object]) -> object:
    """The compiled function for `key` (which names the kernel, its shapes and its complete
    configuration value), compiling it with `build()` on first use. The wait limit is compiled
    into the kernels, so it is part of the key: changing `CUTE_MEGAMOE_SPIN_TIMEOUT_S` between
    calls compiles again rather than keeping the old. So is the launch path (`launch_path`;
    its kernels are compiled differently)."""
    key = (key, spin_timeout_ns(), _PATH.name)
    fn = _COMPILED.get(key)
    if fn is None:
        if _NO_COMPILES:
            raise RuntimeError(f"compiled_kernel: {key[0]!r} is not compiled yet, and compiling "
                               f"(and loading) it now would deadlock: {_NO_COMPILES[-1]}")
        start = time.perf_counter()
        fn = _COMPILED[key] = build()
        _log_build(key, time.perf_counter() - start)
    return fn


#: The package's logger: `compiled_kernel` says what each first use of a kernel build compiled,
#: for which key, in how long and where it is kept (INFO; the kernel objects built before a
#: compile, DEBUG). ``logging.basicConfig(level=logging.INFO)`` shows them.
LOGGER = logging.getLogger("cute_megamoe")


def _log_build(key: tuple, seconds: float) -> None:
    what = key[0]
    name = what[0] if isinstance(what, tuple) and what else what
    record = {"name": name, "key": what, "seconds": seconds}
    # (the launchers key the kernel object a compile takes by the compile's key plus "plan" /
    # "kernel": built in milliseconds, compiled by the next entry)
    if isinstance(what, tuple) and what[-1] in ("plan", "kernel"):
        LOGGER.debug("built the %s kernel object in %.3f s, key %r", name,
                     seconds, what, extra={"cute_megamoe_build": record})
        return
    LOGGER.info("compiled %s in %.1f s, key %r (launch path %s); kept in this "
                "process's compiled-kernel cache (cute_megamoe.runtime, %d entries; not on "
                "disk: another process compiles again)", name, seconds, what, key[2],
                len(_COMPILED), extra={"cute_megamoe_compile": record})


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """A boolean `CUTE_MEGAMOE_*` deployment switch: one of `_TRUE` / `_FALSE` (any case),
    ``default`` when unset or empty; anything else raises `ValueError` naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name}: one of {_TRUE + _FALSE}, got {os.environ[name]!r}")
    return value in _TRUE


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """A `CUTE_MEGAMOE_*` deployment setting that takes one of ``choices`` (the first one when
    unset or empty); anything else raises `ValueError` naming the variable."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}: one of {choices}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- launch paths

class LaunchPath:
    """How compiled kernels are called: the compile option, the form of each argument and the
    callable (see the module doc). Every method converts one argument of one launch."""

    def __init__(self, name: str, tvm_ffi: bool):
        self.name = name
        self.tvm_ffi = tvm_ffi

    def __repr__(self) -> str:
        return f"LaunchPath({self.name!r})"

    def options(self, arch: str) -> str:
        """The `cute.compile` options of a kernel for ``arch`` on this path."""
        return f"--gpu-arch {arch} --enable-tvm-ffi" if self.tvm_ffi else f"--gpu-arch {arch}"

    def entry(self, compiled) -> Callable:
        """What a launch calls: the raw positional `tvm_ffi.Function` (when the compile built
        one: a kernel compiled for another arch than the GPU's has none, and the DSL's object
        then says so when called), or the DSL's compiled object."""
        if self.tvm_ffi:
            raw = getattr(compiled, "_tvm_ffi_function", None)
            return compiled if raw is None else raw
        return compiled

    def ptr(self, tensor: torch.Tensor, align: int = 16, dtype=None):
        """A pointer argument to ``tensor``'s first element (``align``, ``dtype``: as
        `as_ptr`; the TVM-FFI stub takes the address alone)."""
        if self.tvm_ffi:
            return tensor.data_ptr()
        return as_ptr(tensor, align, dtype)

    def int32(self, value: int):
        """An ``Int32`` argument."""
        if self.tvm_ffi:
            return int(value)
        from cutlass import Int32

        return Int32(value)

    def stream(self):
        """The current CUDA stream as a stream argument."""
        if self.tvm_ffi:
            return current_raw_stream()
        return current_stream()


#: The launch paths by name.
LAUNCH_PATHS = {"tvm-ffi": LaunchPath("tvm-ffi", True), "cute-dsl": LaunchPath("cute-dsl", False)}


def _import_tvm_ffi() -> str | None:
    """None if `tvm_ffi` imports, else why not."""
    try:
        import tvm_ffi  # noqa: F401
    except Exception as exc:  # ImportError, or a wheel for another Python / glibc
        return f"{type(exc).__name__}: {exc}"
    return None


_TVM_FFI_MISSING = _import_tvm_ffi()


def tvm_ffi_available() -> bool:
    """Whether `apache-tvm-ffi` imported (checked once, at import)."""
    return _TVM_FFI_MISSING is None


def _default_path() -> LaunchPath:
    """`CUTE_MEGAMOE_TVM_FFI` (`env_flag`): false the CuTe DSL path, true TVM-FFI (an error
    without it), unset TVM-FFI where `tvm_ffi` imports."""
    name = "CUTE_MEGAMOE_TVM_FFI"
    if not env_flag(name, default=tvm_ffi_available()):
        return LAUNCH_PATHS["cute-dsl"]
    if not tvm_ffi_available():
        raise ImportError(f"{name}={os.environ[name]} asks for the TVM-FFI launch path, but "
                          f"tvm_ffi does not import ({_TVM_FFI_MISSING}); pip install "
                          f"apache-tvm-ffi, or set {name}=0")
    return LAUNCH_PATHS["tvm-ffi"]


_PATH: LaunchPath = _default_path()


def launch_path() -> LaunchPath:
    """The launch path in use (chosen at import, see `_default_path`)."""
    return _PATH


def set_launch_path(name: str) -> LaunchPath:
    """Use launch path ``name`` from now on (tests and benchmarks compare the two); returns the
    previous one. Compiled kernels and launch plans are kept per path."""
    global _PATH
    if name not in LAUNCH_PATHS:
        raise ValueError(f"name: expected one of {tuple(LAUNCH_PATHS)}, got {name!r}")
    if LAUNCH_PATHS[name].tvm_ffi and not tvm_ffi_available():
        raise RuntimeError(f"the TVM-FFI launch path needs tvm_ffi ({_TVM_FFI_MISSING})")
    previous, _PATH = _PATH, LAUNCH_PATHS[name]
    return previous
