"""Compile CuTe DSL kernels for a given arch without a GPU, and read their PTX and SASS.

`compile_for_arch(kernel, *args, arch="sm_90a")` runs `cute.compile` with the target chosen by
the `--gpu-arch` option (no GPU and no `CUTE_DSL_ARCH` needed), keeps the PTX, cubin and SASS in
a fresh temporary folder (artifact names do not include the arch, so folders are never shared),
and returns them with the compiled function. Arguments are fake: `fake_ptr(dtype)` for pointer
arguments, `cutlass.cute.runtime.make_fake_compact_tensor` for tensors, `fake_stream()`.

SASS needs `nvdisasm` (pip `nvidia-cuda-nvdisasm`, at least the DSL's CUDA version); where it is
missing `sass` is `None` and callers that assert on SASS skip with that reason.

**Compile cache.** Tests compile the same kernel build more than once (a kernel object of the
same state, the same argument types, arch and options). With `enable_compile_cache(directory)`
(the test suite's conftest does it: one directory shared by the pytest-xdist workers, kept in
pytest's cache between runs) `compile_for_arch` keeps each build's PTX, SASS and cubin, keyed
by a fingerprint of all of that, the DSL's environment, the package's source and the DSL's and
tools' versions, in memory and on disk, and returns them for a later compile of the same build
without compiling. A build read from disk has ``compiled`` None (the tests read the PTX, SASS
and cubin only); the plain-data attributes that tracing set on the kernel object or its parts
(such as a stage's transaction bytes) are set on the new kernel object as the compile would
have. A kernel whose state cannot be fingerprinted (an object of an unknown type) is compiled
every time.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import fcntl
import functools
import hashlib
import os
import pickle
import re
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")

# (an opcode with its modifiers; WGMMA shapes have a lower-case x: QGMMA.64x128x32.F32...)
_SASS_OPCODE = re.compile(
    r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*(?:x[0-9][A-Z0-9_.x]*)?)",
    re.M)


@dataclass
class CompiledArtifacts:
    """What one compile produced: the callable, the PTX text, the SASS text and the cubin."""

    arch: str
    compiled: object
    ptx: str
    sass: str | None
    cubin: bytes | None

    def sass_opcodes(self) -> collections.Counter:
        """Count of every SASS opcode (with its modifiers, e.g. `QGMMA.64x128x32.F32.E4M3.E4M3`)."""
        if self.sass is None:
            raise RuntimeError("no SASS: nvdisasm is not available")
        return collections.Counter(_SASS_OPCODE.findall(self.sass))

    def count(self, prefix: str) -> int:
        """How many SASS instructions start with `prefix` (e.g. `LDG.E.128`, `STL`)."""
        return sum(n for op, n in self.sass_opcodes().items() if op.startswith(prefix))

    def resource_usage(self) -> dict[str, int]:
        """Registers, stack, local memory and static shared memory (max over kernels), from
        cuobjdump."""
        tool = find_cuda_tool("cuobjdump")
        if tool is None or self.cubin is None:
            raise RuntimeError("cuobjdump or the cubin is not available")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            path.write_bytes(self.cubin)
            out = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True,
                                 check=True).stdout
        usage = {"REG": 0, "STACK": 0, "SHARED": 0, "LOCAL": 0}
        for key in usage:
            values = [int(v) for v in re.findall(rf"\b{key}:(\d+)", out)]
            usage[key] = max(values, default=0)
        return usage


    def ptxas_performance_notes(self) -> list[str]:
        """ptxas's "Potential Performance Loss" notes on this PTX (for example C7514: WGMMAs
        serialized because other instructions touch an in-flight accumulator), from a separate
        `ptxas -v` run; raises when no ptxas is installed."""
        tool = find_cuda_tool("ptxas")
        if tool is None:
            raise RuntimeError("ptxas is not available")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.ptx"
            path.write_text(self.ptx)
            run = subprocess.run([tool, f"-arch={self.arch}", "-v", str(path), "-o",
                                  str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
        if run.returncode != 0:
            message = f"{tool} failed on this PTX: {run.stderr.strip()[-400:]}"
            # (the GPU machine's system ptxas 13.0 is older than the PTX of the CUDA 13 DSL
            # bundle there; a CPU machine's DSL emits CUDA 12 PTX)
            raise (ToolTooOld if ".version" in run.stderr else RuntimeError)(message)
        return [line for line in (run.stdout + run.stderr).splitlines()
                if "Performance Loss" in line]


class ToolTooOld(RuntimeError):
    """A CUDA tool older than the PTX it is given (`ptxas_notes_or_skip` skips on it)."""


def ptxas_notes_or_skip(art: CompiledArtifacts) -> list[str]:
    """`CompiledArtifacts.ptxas_performance_notes`, or a pytest skip that says why where this
    machine's ptxas cannot read the PTX (too old) or is missing."""
    import pytest

    if find_cuda_tool("ptxas") is None:
        pytest.skip("ptxas is not available")
    try:
        return art.ptxas_performance_notes()
    except ToolTooOld as error:
        pytest.skip(str(error))


def find_cuda_tool(name: str) -> str | None:
    """Path of a CUDA binary tool: the pip `nvidia-cuda-*` wheels first, then PATH."""
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_nvcc/bin", "cu12/bin"):
                candidate = Path(base) / sub / name
                if candidate.exists():
                    return str(candidate)
    except ImportError:
        pass
    return shutil.which(name)


def fake_ptr(dtype, align: int = 16):
    """A null `cute.Pointer` of `dtype` in global memory, for compile-only calls."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def fake_stream():
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream()


def compile_for_arch(kernel, *args, arch: str = "sm_90a", options: str = "",
                     keep_sass: bool = True) -> CompiledArtifacts:
    """Compile `kernel(*args)` for `arch` and return its artifacts (no GPU needed); through the
    compile cache where it is enabled (see the module doc)."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}")
    key = _cache_key(kernel, args, arch, options, keep_sass) if _CACHE.directory else None
    if key is None:
        _CACHE.stats["uncached" if _CACHE.directory else "compiled"] += 1
        return _compile(kernel, args, arch, options, keep_sass)
    if key in _CACHE.memory:
        art, traced = _CACHE.memory[key]
        _CACHE.stats["reused"] += 1
    else:
        path = Path(_CACHE.directory, f"{key}{_SUFFIX}")
        with _locked(Path(_CACHE.directory, f"{key}.lock")):  # one process compiles, others wait
            entry = _read_cached(path)
            if entry is None:
                before = _object_states(kernel)
                art = _compile(kernel, args, arch, options, keep_sass)
                traced = _traced_attributes(kernel, before)
                temporary = path.with_suffix(f".{os.getpid()}.tmp")
                temporary.write_bytes(zlib.compress(
                    pickle.dumps((dataclasses.replace(art, compiled=None), traced)), 1))
                os.replace(temporary, path)
                _CACHE.stats["compiled"] += 1
            else:
                art, traced = entry
                _CACHE.stats["reused"] += 1
        _CACHE.memory[key] = (art, traced)
    for where, name, value in traced:  # what tracing would have set on this kernel object
        setattr(_object_at(kernel, where), name, copy.deepcopy(value))
    return art


def compile_cache_stats() -> dict[str, int]:
    """How many builds this process compiled, reused from the cache, or compiled uncached."""
    return dict(_CACHE.stats)


def prune_compile_cache(directory: str | os.PathLike) -> None:
    """Remove the builds of other sources (or DSL versions) from a cache root given to
    `enable_compile_cache`, so that a cache kept between runs holds one version's builds."""
    current = _source_digest()[:16]
    for path in Path(directory).iterdir():
        if path.is_dir() and path.name != current:
            shutil.rmtree(path, ignore_errors=True)


def _compile(kernel, args, arch: str, options: str, keep_sass: bool) -> CompiledArtifacts:
    import cutlass.cute as cute

    nvdisasm = find_cuda_tool("nvdisasm") if keep_sass else None
    with tempfile.TemporaryDirectory(prefix=f"cute_megamoe_{arch}_") as dump:
        flags = f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump}"
        compiled = cute.compile(kernel, *args, options=f"{flags} {options}".strip())
        ptx = compiled.__ptx__
        cubins = [name for name in os.listdir(dump) if name.endswith(".cubin")]
        cubin = Path(dump, cubins[0]).read_bytes() if cubins else None
        sass = None
        if nvdisasm is not None and cubins:
            sass = subprocess.run([nvdisasm, "-c", os.path.join(dump, cubins[0])],
                                  capture_output=True, text=True, check=True).stdout
    return CompiledArtifacts(arch=arch, compiled=compiled, ptx=ptx, sass=sass, cubin=cubin)


def gemm_kernel_for(arch: str, recipe: str, phase: str, num_experts: int, num_pool_rows: int,
                    n: int, k: int, block_m: int, config=None,
                    expected_tokens_per_expert: float | None = None,
                    activation_clamp: float | None = None, fast_math: bool = True,
                    combine_layout=None, tiled_weights: bool = False):
    """`launch.gemm_kernel` (the kernel object and its pointer dtypes) built as a layer call
    builds it: the fields ``config`` sets, the heuristics' choice for the rest
    (`heuristics.default_gemm_config`)."""
    from ..heuristics import default_gemm_config
    from ..launch import gemm_kernel

    complete = default_gemm_config(arch, recipe, phase, n, block_m, expected_tokens_per_expert,
                                   combine_layout is not None, config)
    return gemm_kernel(arch, recipe, phase, num_experts, num_pool_rows, n, k, complete,
                       activation_clamp, fast_math, combine_layout, tiled_weights)


def fused_kernel_for(layout, block_m: int, config=None, given_x: bool = False,
                     activation_clamp: float | None = None, fast_math: bool = True,
                     has_stats: bool = False, tiled_weights: bool = False):
    """The sm_90a fused kernel object built as a layer call builds it on ``layout`` at
    ``block_m``, for calls that give ``x`` or not: the fields ``config`` (a
    `config.Sm90FusedConfig`) sets, the heuristics' choice for the rest
    (`heuristics.default_fused_config`)."""
    from ..heuristics import default_fused_config
    from ..kernels.sm90_mega_moe import Sm90MegaMoEKernel

    return Sm90MegaMoEKernel(layout, default_fused_config(layout, block_m, given_x, config),
                             activation_clamp=activation_clamp, fast_math=fast_math,
                             has_stats=has_stats, tiled_weights=tiled_weights)


# ----------------------------------------------------------------------------- compile cache

@dataclass
class _CompileCache:
    directory: str | None = None
    memory: dict = dataclasses.field(default_factory=dict)
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)


_CACHE = _CompileCache()

#: Environment variables that can change a build while it is traced or compiled. (The package's
#: own `CUTE_MEGAMOE_*` settings are read when a kernel object is constructed and are part of its
#: state, which the key holds.)
_ENV_PREFIXES = ("CUTE_DSL_", "CUTLASS_")
_SUFFIX = ".build"


def enable_compile_cache(directory: str | os.PathLike | None) -> None:
    """Keep `compile_for_arch`'s builds in memory and under `directory` (created if missing),
    in a subdirectory per version of the package's source; None turns the cache off."""
    _CACHE.memory.clear()
    _CACHE.directory = None
    if directory is not None:
        _CACHE.directory = os.path.join(directory, _source_digest()[:16])
        os.makedirs(_CACHE.directory, exist_ok=True)


class _Unkeyable(Exception):
    """A value the fingerprint does not know how to describe."""


def _cache_key(kernel, args, arch: str, options: str, keep_sass: bool) -> str | None:
    """A hex digest naming the build, or None where the kernel or an argument cannot be
    fingerprinted (then it is compiled without the cache)."""
    try:
        description = repr((_fingerprint(kernel, ()), _fingerprint(args, ()), arch, options,
                            keep_sass and find_cuda_tool("nvdisasm"),
                            sorted((k, v) for k, v in os.environ.items()
                                   if k.startswith(_ENV_PREFIXES)),
                            _source_digest()))
    except _Unkeyable:
        return None
    return hashlib.sha256(description.encode()).hexdigest()


def _fingerprint(value, path: tuple):
    """A deterministic description of `value` (no addresses, no hash order)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__qualname__, value.name)
    if isinstance(value, type):
        return ("type", value.__module__, value.__qualname__)
    if id(value) in path:
        raise _Unkeyable("a cycle")
    path = (*path, id(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_fingerprint(v, path) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_fingerprint(v, path)) for v in value)))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(_fingerprint(k, path)), _fingerprint(v, path))
                                     for k, v in value.items())))
    if callable(value) and hasattr(value, "__qualname__"):  # functions, methods
        name = value.__qualname__
        if "<" in name:  # a lambda or a function defined inside another: no stable name
            raise _Unkeyable(name)
        return ("function", getattr(value, "__module__", None), name,
                _fingerprint(getattr(value, "__self__", None), path))
    special = _special_fingerprint(value)
    if special is not None:
        return special
    if dataclasses.is_dataclass(value):
        return ("dataclass", type(value).__module__, type(value).__qualname__,
                tuple((f.name, _fingerprint(getattr(value, f.name), path))
                      for f in dataclasses.fields(value)))
    if type(value).__module__.startswith("cute_megamoe") and hasattr(value, "__dict__"):
        return ("object", type(value).__module__, type(value).__qualname__,
                _fingerprint(vars(value), path))
    raise _Unkeyable(type(value).__qualname__)


def _special_fingerprint(value):
    """The compile-only arguments (`fake_ptr`, `fake_stream`, DSL scalars) and dtypes."""
    try:
        import torch

        if isinstance(value, torch.dtype):
            return ("torch.dtype", str(value))
    except ImportError:  # pragma: no cover (torch is a dependency)
        pass
    from cutlass.cute.typing import Pointer

    if isinstance(value, Pointer):
        return ("pointer", _fingerprint(value.dtype, ()), str(value.memspace),
                getattr(value, "_assumed_align", None), getattr(value, "_pointer", None))
    if type(value).__name__ == "_FakeStream":
        return ("fake_stream", repr(sorted(vars(value).items())))
    if type(value).__module__.startswith("cutlass") and hasattr(value, "value") and \
            isinstance(value.value, (bool, int, float)):  # Int32(132) and its kin
        return ("scalar", type(value).__qualname__, value.value)
    return None


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """The package's Python source and the DSL's and tools' versions, so that a cache kept
    across runs misses after any edit or upgrade."""
    from importlib import metadata

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    for name in ("nvidia-cutlass-dsl", "nvidia-cuda-nvdisasm", "nvidia-cuda-cuobjdump"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{name}=={metadata.version(name)}".encode())
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _package_objects(root, where: tuple = (), seen: set | None = None):
    """(attribute path, object) of `root` and of every package object reachable through
    attributes from it (a kernel's GEMM phases, scheduler, layout ...)."""
    seen = set() if seen is None else seen
    if id(root) in seen:
        return
    seen.add(id(root))
    yield where, root
    for name, value in list(vars(root).items()):
        if type(value).__module__.startswith("cute_megamoe") and hasattr(value, "__dict__"):
            yield from _package_objects(value, (*where, name), seen)


def _object_states(kernel) -> dict:
    return {where: dict(vars(obj)) for where, obj in _package_objects(kernel)}


def _traced_attributes(kernel, before: dict) -> tuple:
    """The plain-data attributes that tracing set on the kernel or its parts (e.g. a stage's
    transaction bytes), as (attribute path, name, value), for a cache hit to set them too."""
    traced = []
    for where, obj in _package_objects(kernel):
        old = before.get(where, {})
        for name, value in vars(obj).items():
            if (name not in old or old[name] is not value) and _plain(value) and \
                    (name not in old or not _plain(old[name]) or old[name] != value):
                traced.append((where, name, value))
    return tuple(traced)


def _object_at(root, where: tuple):
    for name in where:
        root = getattr(root, name)
    return root


def _plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _read_cached(path: Path) -> tuple | None:
    try:
        return pickle.loads(zlib.decompress(path.read_bytes()))
    except (FileNotFoundError, EOFError, pickle.UnpicklingError, zlib.error):
        return None
