"""Compile CuTe DSL kernels for a given arch without a GPU, and read their PTX and SASS.

`compile_for_arch(kernel, *args, arch="sm_90a")` runs `cute.compile` with the target chosen by
the `--gpu-arch` option (no GPU and no `CUTE_DSL_ARCH` needed), keeps the PTX, cubin and SASS in
a fresh temporary folder (artifact names do not include the arch, so folders are never shared),
and returns them with the compiled function. Arguments are fake: `fake_ptr(dtype)` for pointer
arguments, `cutlass.cute.runtime.make_fake_compact_tensor` for tensors, `fake_stream()`.

SASS needs `nvdisasm` (pip `nvidia-cuda-nvdisasm`, at least the DSL's CUDA version); where it is
missing `sass` is `None` and callers that assert on SASS skip with that reason.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
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
    """Compile `kernel(*args)` for `arch` and return its artifacts (no GPU needed)."""
    import cutlass.cute as cute

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {SUPPORTED_ARCHS}, got {arch!r}")
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
