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
    "env_flag",
    "kernel_variant_env",
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
    (default 120 s; 0 waits forever). Part of every compiled kernel's cache key."""
    return int(float(os.environ.get("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "120")) * 1e9)


def one_rank_scope() -> str:
    """``CUTE_MEGAMOE_ONE_RANK_SCOPE``: the memory scope of a one-rank group's barriers, flags
    and count words (`kernels.common.sync.group_scope`): "gpu" (the default: its buffer and
    every reader of it within a call are on this GPU; 4-5 us less per layer call at 1 token on
    an H200) or "sys" (as groups of several ranks, which always use it; for A/B runs). Part of
    every compiled kernel's cache key."""
    value = os.environ.get("CUTE_MEGAMOE_ONE_RANK_SCOPE", "gpu").strip().lower() or "gpu"
    if value not in ("gpu", "sys"):
        raise ValueError(f"CUTE_MEGAMOE_ONE_RANK_SCOPE: 'gpu' or 'sys', got {value!r}")
    return value


def compiled_kernel(key: Hashable, build: Callable[[], object]) -> object:
    """The compiled function for `key`, compiling it with `build()` on first use. The wait
    limit is compiled into the kernels, so it is part of the key: changing
    `CUTE_MEGAMOE_SPIN_TIMEOUT_S` between calls compiles again rather than keeping the old.
    So are the launch path (`launch_path`; its kernels are compiled differently) and
    `one_rank_scope`."""
    key = (key, spin_timeout_ns(), _PATH.name, one_rank_scope())
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


SM90_PROMOTIONS = ("auto", "chunk", "quarter")


def sm90_promotion() -> str | None:
    """``CUTE_MEGAMOE_SM90_PROMOTION``: how the sm_90a FP8 grouped GEMMs promote their
    scratch accumulators (`Sm90ExpertGemmKernel`'s ``promotion``), forced for A/B runs; None
    ("auto", the default): by BLOCK_M (`sm90_expert_gemm.DEFAULT_PROMOTION`). Part of the
    grouped GEMMs' and the fused kernel's cache keys."""
    value = env_choice("CUTE_MEGAMOE_SM90_PROMOTION", SM90_PROMOTIONS)
    return None if value == "auto" else value


def sm90_k_unroll() -> int | None:
    """``CUTE_MEGAMOE_SM90_K_UNROLL``: "1" / "2" / "4" force the k-blocks per loop body of the
    sm_90a FP8 grouped GEMMs' consumer loop (`Sm90ExpertGemmKernel`'s ``k_unroll``), for A/B
    runs; unset or "auto": None, by recipe and BLOCK_M (`sm90_expert_gemm.DEFAULT_K_UNROLL`).
    Part of the grouped GEMMs' cache keys. Ranks may
    differ: it changes how a rank computes its own tiles, not the bits or the protocol."""
    value = env_choice("CUTE_MEGAMOE_SM90_K_UNROLL", ("auto", "1", "2", "4"))
    return None if value == "auto" else int(value)


def sm90_tma_store() -> bool | None:
    """``CUTE_MEGAMOE_SM90_TMA_STORE``: how the sm_90a fp8xfp8 grouped GEMMs send their rows into
    ``out`` (L1: the L2 pool; L2: ``out``; `Sm90ExpertGemmKernel`'s ``tma_store``): unset or
    "auto": None, the default (TMA tensor stores of swizzled boxes of 16 rows x 128 bytes,
    `sm90_expert_gemm.DEFAULT_TMA_STORE`); "0": a bulk copy per row, "1": the TMA stores, for
    A/B runs (the combine buffers as destination always take the row copies). Part of the
    grouped GEMMs' cache keys; ranks may differ."""
    value = env_choice("CUTE_MEGAMOE_SM90_TMA_STORE", ("auto", "0", "1"))
    return None if value == "auto" else value == "1"


def sm90_fp4_early_tables() -> bool | None:
    """``CUTE_MEGAMOE_SM90_FP4_EARLY_TABLES``: whether the decode warps of the sm_90a grouped
    GEMMs with MXFP4 weights load a k-block's first batch of scales and codes and build its
    tables before they wait for a free MMA stage (`Sm90ExpertGemmKernel`'s ``early_tables``):
    unset or "auto": None, the default (on in the transposed kernels, off in the staged ones:
    `sm90_expert_gemm.DEFAULT_EARLY_TABLES`); "1" / "0" force it on / off, for A/B runs. Part of
    the grouped GEMMs' cache keys."""
    value = env_choice("CUTE_MEGAMOE_SM90_FP4_EARLY_TABLES", ("auto", "0", "1"))
    return None if value == "auto" else value == "1"


def sm90_fp4_cluster() -> bool | None:
    """``CUTE_MEGAMOE_SM90_FP4_CLUSTER``: whether the sm_90a grouped GEMMs with MXFP4 weights at
    BLOCK_M 128 run in 2-CTA clusters that share the decode of each weight tile (each CTA decodes
    one 128-row chunk and copies it into the peer's stage by one bulk shared-memory copy:
    `Sm90ExpertGemmKernel`'s ``cluster_m`` 2 with FP4 weights). Unset or "auto": None, by the
    call's expected tokens per expert (`heuristics.select_sm90_fp4_cluster`); "1" / "0" force
    it on / off, for A/B runs. Part of the grouped GEMMs' cache keys; ranks may differ."""
    value = env_choice("CUTE_MEGAMOE_SM90_FP4_CLUSTER", ("auto", "0", "1"))
    return None if value == "auto" else value == "1"


def sm90_paired_pool() -> bool:
    """``CUTE_MEGAMOE_SM90_PAIRED_POOL``: whether the staged layer on sm_90a lays its pool out in
    256-row blocks where its grouped GEMMs run BLOCK_M 128 in 2-CTA clusters
    (`staged.layer_pool_block_m`: every cluster's two tiles one expert's, so that the pair
    shares its weight tile: the fp8xfp8 multicast, the MXFP4 shared decode). Unset, "auto" or
    "0": off, BLOCK_M blocks (pairs may straddle two experts): the 256-row blocks took
    1.07-1.19x the layer's time on an H200 (docs/performance.md); "1": on, for A/B runs. Part
    of the layer plans' keys; ranks may differ (each lays out its own pool)."""
    return env_choice("CUTE_MEGAMOE_SM90_PAIRED_POOL", ("auto", "0", "1")) == "1"


def sm90_row_stores() -> str | None:
    """``CUTE_MEGAMOE_SM90_ROW_STORES``: how the sm_90a L2 grouped GEMM and the fused kernel's L2
    send their rows to the combine buffers (`Sm90ExpertGemmKernel`'s ``row_stores``): unset or
    "auto": None, each kernel's default (the grouped GEMM a bulk copy per row, the fused kernel
    the lanes' stores, `sm90_mega_moe.FUSED_ROW_STORES`); ``bulk`` or ``lanes`` (each warp's
    lanes copy the row 16 bytes apart) force both, for A/B runs. Part of the grouped GEMMs' and
    the fused kernel's cache keys; ranks may differ (it changes how a rank writes, not
    what)."""
    value = env_choice("CUTE_MEGAMOE_SM90_ROW_STORES", ("auto", "bulk", "lanes"))
    return None if value == "auto" else value


def tile_owner_search() -> str:
    """``CUTE_MEGAMOE_TILE_SEARCH``: how the sm_90a grouped GEMMs' and fused kernel's tile walk
    finds a tile's expert (`scheduler.device.ExpertTileScheduler.owner_of`): ``gallop`` (the
    default: steps doubling, then halving: O(log E) instead of O(E) shared-memory loads for a
    CTA's first tile at decode sizes; the staged layer 111 against 115 us at 1 token on an
    H200, docs/performance.md) or ``linear`` (one expert at a time from the previous tile's;
    for A/Bs). Part of their cache keys."""
    return env_choice("CUTE_MEGAMOE_TILE_SEARCH", ("gallop", "linear"))


def sm90_transposed() -> bool | None:
    """``CUTE_MEGAMOE_SM90_TRANSPOSED``: "1" / "0" force the sm_90a FP8 grouped GEMMs
    (fp8xfp8, fp8xfp4_sm90) at BLOCK_M 64 to run transposed, the weight tile as the WGMMA's A
    and the pool rows in 16-token sub-blocks (`sm90_expert_gemm_transposed`), or staged; unset
    or "auto": None, `heuristics.select_sm90_transposed` chooses. Part of the grouped GEMMs'
    cache keys."""
    value = env_choice("CUTE_MEGAMOE_SM90_TRANSPOSED", ("auto", "1", "0"))
    return None if value == "auto" else value == "1"


def sm90_transposed_a_rows() -> str:
    """``CUTE_MEGAMOE_SM90_TRANSPOSED_A_ROWS``: which rows of a pool block the transposed
    sm_90a grouped GEMMs load per k-block (`Sm90TransposedExpertGemmKernel`'s ``a_rows``):
    ``received`` (the default: 16-row boxes, only those of sub-blocks with received tokens;
    0.96-0.97x the time of ``block`` for MXFP4 weights at 8 and 16 pairs per expert on an H200,
    docs/performance.md) or ``block`` (all 64 rows, one TMA box, as the staged kernel; for
    A/Bs). Part of the grouped GEMMs' cache keys."""
    return env_choice("CUTE_MEGAMOE_SM90_TRANSPOSED_A_ROWS", ("received", "block"))


def sm90_fp4_tables() -> str:
    """``CUTE_MEGAMOE_SM90_FP4_TABLES``: how the decode warps of the sm_90a grouped GEMMs with
    MXFP4 weights build their tables (`Sm90ExpertGemmKernel`'s ``decode_tables``): ``vote``
    (the default: the integer adds for a whole batch, the float path behind one warp vote) or
    ``item`` (a branch per item, for A/Bs). Part of the grouped GEMMs' cache keys."""
    return env_choice("CUTE_MEGAMOE_SM90_FP4_TABLES", ("vote", "item"))


def fused_weights_first() -> bool | None:
    """``CUTE_MEGAMOE_FUSED_WEIGHTS_FIRST``: "1" / "0" force the sm_90a fused kernel's
    ``weights_first`` on or off (tiles that find their pool block not ready load their first
    stages' weights before they wait; with counted rows, each CTA's first L1 tile's right after
    the counts), for A/B runs; unset: None, the kernel's default (on with counted rows). Part
    of the fused kernel's cache key."""
    if os.environ.get("CUTE_MEGAMOE_FUSED_WEIGHTS_FIRST") is None:
        return None
    return env_flag("CUTE_MEGAMOE_FUSED_WEIGHTS_FIRST")


def fused_staging() -> str:
    """``CUTE_MEGAMOE_FUSED_STAGING``: where the sm_90a fused layer stages a call's BF16
    inputs: ``auto`` (the default: ``kernel``, but ``launch`` for the FP4 experiment, whose
    fused kernel never ran staging its inputs), ``launch`` (the input staging kernel, then
    the fused kernel) or ``kernel`` (the fused kernel itself, step 0 of `sm90_mega_moe`: one
    launch per call; 1 token 101 us against 103 in a CUDA graph on an H200, 128 tokens and
    up unchanged, docs/performance.md). Part of the fused kernel's cache key and the layer
    plans' keys."""
    return env_choice("CUTE_MEGAMOE_FUSED_STAGING", ("auto", "launch", "kernel"))


def fused_local_dispatch() -> bool | None:
    """``CUTE_MEGAMOE_FUSED_LOCAL_DISPATCH``: ``1`` / ``0`` force the sm_90a fused kernel's
    one-rank dispatch (`sm90_mega_moe`'s ``local_dispatch``: every CTA counts all pairs itself
    and quantizes its own pairs' rows straight into the pool) on or off, for A/B runs; unset
    (``auto``): None, the kernel's default (on for one-rank groups with counted rows that
    stage their own inputs, in buffers of at most `sm90_mega_moe.LOCAL_MAX_TOKENS` tokens);
    ``1`` where it cannot run (several ranks, barrier rows, FP4 weights, ``x=None``): the
    default. Part of the fused kernel's cache key."""
    return {"auto": None, "0": False, "1": True}[
        env_choice("CUTE_MEGAMOE_FUSED_LOCAL_DISPATCH", ("auto", "0", "1"))]


FUSED_ROWS = ("auto", "barrier", "counted", "with_gemm")


def fused_rows() -> str | None:
    """``CUTE_MEGAMOE_FUSED_ROWS``: how the sm_90a fused kernel moves the rows
    (`sm90_mega_moe.ROW_TRANSFERS`), forced for A/B runs; None ("auto", the default): the
    kernel's `default_row_transfer` (by the buffer's token capacity). "barrier" and the two
    counted transfers are different row protocols: every rank of a call must use one of the
    same kind (a mismatch traps). Part of the fused kernel's cache key and the layer plans'
    keys."""
    value = os.environ.get("CUTE_MEGAMOE_FUSED_ROWS", "auto").strip().lower()
    if value not in FUSED_ROWS:
        raise ValueError(f"CUTE_MEGAMOE_FUSED_ROWS: one of {FUSED_ROWS}, got {value!r}")
    return None if value == "auto" else value


#: Environment variables that choose which kernels a layer call builds: part of the layer
#: plans' keys (`staged`, `fused`), so that changing one between calls builds a new plan
KERNEL_VARIANT_ENV = ("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "CUTE_MEGAMOE_SM90_PROMOTION",
                      "CUTE_MEGAMOE_SM90_TRANSPOSED", "CUTE_MEGAMOE_SM90_TRANSPOSED_A_ROWS",
                      "CUTE_MEGAMOE_EXPERIMENTAL_FUSED", "CUTE_MEGAMOE_FUSED_ROWS",
                      "CUTE_MEGAMOE_FUSED_WEIGHTS_FIRST",
                      "CUTE_MEGAMOE_ONE_RANK_SCOPE",
                      "CUTE_MEGAMOE_FUSED_STAGING", "CUTE_MEGAMOE_FUSED_LOCAL_DISPATCH",
                      "CUTE_MEGAMOE_TILE_SEARCH", "CUTE_MEGAMOE_SM90_FP4_TABLES",
                      "CUTE_MEGAMOE_SM90_K_UNROLL", "CUTE_MEGAMOE_SM90_TMA_STORE",
                      "CUTE_MEGAMOE_SM90_ROW_STORES", "CUTE_MEGAMOE_SM90_FP4_EARLY_TABLES",
                      "CUTE_MEGAMOE_SM90_FP4_CLUSTER", "CUTE_MEGAMOE_SM90_PAIRED_POOL")


def kernel_variant_env() -> tuple[str | None, ...]:
    """The values of `KERNEL_VARIANT_ENV` now."""
    return tuple(os.environ.get(name) for name in KERNEL_VARIANT_ENV)


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean `CUTE_MEGAMOE_*` environment switch ("1"/"true"/"yes" are true)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """A `CUTE_MEGAMOE_*` environment setting that takes one of ``choices`` (the first one when
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
    """`CUTE_MEGAMOE_TVM_FFI`: "0" the CuTe DSL path, "1" TVM-FFI (an error without it),
    unset TVM-FFI where `tvm_ffi` imports."""
    value = os.environ.get("CUTE_MEGAMOE_TVM_FFI")
    if value is None or value.strip() == "":
        return LAUNCH_PATHS["tvm-ffi" if tvm_ffi_available() else "cute-dsl"]
    if not env_flag("CUTE_MEGAMOE_TVM_FFI"):
        return LAUNCH_PATHS["cute-dsl"]
    if not tvm_ffi_available():
        raise ImportError(f"CUTE_MEGAMOE_TVM_FFI={value} asks for the TVM-FFI launch path, but "
                          f"tvm_ffi does not import ({_TVM_FFI_MISSING}); pip install "
                          f"apache-tvm-ffi, or set CUTE_MEGAMOE_TVM_FFI=0")
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
