"""The SHA-256 of the SASS of every default kernel build, compiled on the CPU (no GPU needed).

    python -m cute_megamoe.testing.sass_hashes [-k SUBSTRING ...] > hashes.txt

One line per build: its name and the hash of its SASS (`testing.compile.compile_for_arch`; the
kernel symbols, which spell the module and class, renamed in order of appearance). The kernels
are built as the layer builds them by default: the heuristics' complete configurations
(`heuristics.default_gemm_config`, `heuristics.default_fused_config`) and the launchers' kernel
constructors (`launch`), at the shapes of a one-rank decode buffer, a one-rank prefill buffer, a
small one-rank buffer and a two-rank buffer. Comparing the output of two commits shows that a
change left the code of the default builds as it was. Needs `nvdisasm` (the ``sass`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..layout import MegaMoELayout

#: (name, ranks, experts, tokens per rank, top-k, hidden, intermediate) of the buffers
SHAPES = (("decode", 1, 128, 128, 8, 7168, 2048), ("prefill", 1, 128, 4096, 8, 7168, 2048),
          ("small", 1, 8, 64, 2, 512, 256), ("two_ranks", 2, 64, 512, 8, 7168, 2048))
#: expected (token, slot) pairs per expert of the grouped GEMMs' builds, by BLOCK_M: the
#: mainloop (sm_90a transposed at decode sizes) and the MXFP4 clusters follow it
GEMM_TOKENS = {64: (8, 32), 128: (128, 256)}
ACTIVATION_CLAMP = 10.0

_SYMBOL = re.compile(r"kernel_cutlass_\w+")


@dataclass(frozen=True)
class Build:
    """One kernel build: ``make()`` returns the kernel object and its example arguments."""

    name: str
    arch: str
    make: Callable[[], tuple[object, tuple]]


def sass_hash(sass: str) -> str:
    """SHA-256 of ``sass`` with each kernel symbol renamed to its order of appearance."""
    names: dict[str, str] = {}
    text = _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"kernel_{len(names)}"), sass)
    return hashlib.sha256(text.encode()).hexdigest()


def _layout(shape: tuple, recipe: str) -> MegaMoELayout:
    return MegaMoELayout(*shape[1:], recipe)


def _collective_args(kernel, num_ctas: int) -> tuple:
    """The example arguments of a fused kernel (`launch.fused_call`'s order)."""
    from cutlass import Int32

    from .compile import fake_ptr, fake_stream

    ptrs = [fake_ptr(dtype, 4 if name in ("expert_recv_tokens", "stats", "pool_block_ready",
                                          "tile_log") else 16)
            for name, dtype in kernel.pointer_args()]
    return (ptrs[0], Int32(0), Int32(0), *ptrs[1:], Int32(num_ctas), fake_stream())


def _staging(arch: str, recipe: str, shape: tuple) -> tuple:
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64

    from ..kernels.staging import InputStagingKernel
    from .compile import fake_ptr, fake_stream

    layout = _layout(shape, recipe)
    out = BFloat16 if recipe == "bf16xbf16" else Float8E4M3FN
    sf = Int32 if recipe == "fp8xfp4" else Float32
    kernel = InputStagingKernel(recipe, layout.hidden, layout.num_topk)
    return kernel, (fake_ptr(BFloat16), fake_ptr(Int64), fake_ptr(Float32), fake_ptr(out),
                    fake_ptr(sf), fake_ptr(Int64), fake_ptr(Float32), Int32(1), fake_stream())


def _dispatch(recipe: str, shape: tuple, block_m: int) -> tuple:
    from cutlass import Int32, Int64

    from ..kernels.dispatch import DispatchKernel
    from .compile import fake_ptr, fake_stream

    kernel = DispatchKernel(_layout(shape, recipe), block_m, has_stats=False, transfer="push")
    counts = fake_ptr(Int32, align=4)
    return kernel, (fake_ptr(Int64), Int32(0), Int32(1), counts, counts, Int32(132),
                    fake_stream())


def _combine(recipe: str, shape: tuple, block_m: int, send_mode: str, rounds: tuple) -> tuple:
    from cutlass import BFloat16, Int32, Int64

    from ..kernels.combine import CombineKernel
    from .compile import fake_ptr, fake_stream

    kernel = CombineKernel(_layout(shape, recipe), block_m, send_mode=send_mode, rounds=rounds)
    return kernel, (fake_ptr(Int64), Int32(0), Int32(1), fake_ptr(BFloat16),
                    fake_ptr(Int32, align=4), fake_ptr(BFloat16), Int32(132), fake_stream())


def _gemm(arch: str, recipe: str, phase: str, shape: tuple, block_m: int, tokens: float,
          to_combine: bool) -> tuple:
    from cutlass import Int32

    from ..expert_gemm import TILED_RECIPES, expert_ffn_configs
    from ..launch import gemm_kernel
    from .compile import fake_ptr, fake_stream

    layout = _layout(shape, recipe)
    h, inter = layout.hidden, layout.intermediate_hidden
    n, k = (2 * inter, h) if phase == "l1" else (h, inter)
    l1, l2 = expert_ffn_configs(arch, recipe, block_m, h, inter, tokens, to_combine, None)
    kernel, dtypes = gemm_kernel(
        arch, recipe, phase, layout.num_local_experts, layout.num_pool_rows, n, k,
        l1 if phase == "l1" else l2, ACTIVATION_CLAMP, True,
        combine_layout=layout if to_combine else None,
        tiled_weights=arch == "sm_90a" and recipe in TILED_RECIPES)
    args = [fake_ptr(d, 4 if i == 4 else 16) for i, d in enumerate(dtypes)]
    return kernel, (*args, Int32(132), fake_stream())


def _fused(arch: str, recipe: str, shape: tuple, block_m: int, given_x: bool = True) -> tuple:
    from ..config import Sm90FusedConfig
    from ..fused import fused_kernel_config

    layout = _layout(shape, recipe)
    config = fused_kernel_config(arch, layout, block_m, given_x, Sm90FusedConfig())
    if arch == "sm_100a":
        from ..kernels.sm100_mega_moe import Sm100MegaMoEKernel

        kernel = Sm100MegaMoEKernel(layout, config, activation_clamp=ACTIVATION_CLAMP)
        return kernel, _collective_args(kernel, 148)
    from ..expert_gemm import TILED_RECIPES
    from ..kernels.sm90_mega_moe import Sm90MegaMoEKernel

    kernel = Sm90MegaMoEKernel(layout, config, activation_clamp=ACTIVATION_CLAMP,
                               tiled_weights=recipe in TILED_RECIPES)
    return kernel, _collective_args(kernel, 132)


def builds() -> Iterator[Build]:
    """Every default kernel build, by arch and kind."""
    from ..heuristics import select_combine_rounds
    from ..tables import BLOCK_MS, FUSED_RECIPES, GEMM_RECIPES, activation_recipe

    shapes = {s[0]: s for s in SHAPES}
    two = shapes["two_ranks"]
    rounds = sorted({select_combine_rounds(n) for n in (1, 2048, 8192)})
    for arch in ("sm_90a", "sm_100a"):
        recipes = GEMM_RECIPES[arch]
        acts = sorted({activation_recipe(r) for r in recipes})
        for recipe in recipes:
            yield Build(f"{arch}/staging/{recipe}", arch,
                        lambda arch=arch, r=recipe: _staging(arch, r, two))
        for recipe in acts:
            for block_m in BLOCK_MS[arch]:
                yield Build(f"{arch}/dispatch/{recipe}/bm{block_m}", arch,
                            lambda r=recipe, b=block_m: _dispatch(r, two, b))
                yield Build(f"{arch}/combine/{recipe}/bm{block_m}/epilogue", arch,
                            lambda r=recipe, b=block_m: _combine(r, two, b, "epilogue", (8,)))
            for each in rounds:
                name = "-".join(map(str, each))
                yield Build(f"{arch}/combine/{recipe}/bm128/registers/{name}", arch,
                            lambda r=recipe, e=each: _combine(r, two, 128, "registers", e))
        for recipe in recipes:
            for block_m in BLOCK_MS[arch]:
                for tokens in GEMM_TOKENS[block_m] if arch == "sm_90a" else (None,):
                    for phase, to_combine in (("l1", False), ("l2", False), ("l2", True)):
                        out = "combine" if to_combine else "out"
                        name = phase if phase == "l1" else f"{phase}-{out}"
                        yield Build(
                            f"{arch}/gemm/{recipe}/bm{block_m}/tokens{tokens}/{name}", arch,
                            lambda arch=arch, r=recipe, p=phase, b=block_m, t=tokens,
                            c=to_combine: _gemm(arch, r, p, two, b, t, c))
        for recipe in FUSED_RECIPES[arch]:
            for block_m in BLOCK_MS[arch]:
                for shape in (SHAPES if arch == "sm_90a" else (two,)):
                    yield Build(f"{arch}/fused/{recipe}/bm{block_m}/{shape[0]}", arch,
                                lambda arch=arch, r=recipe, s=shape, b=block_m:
                                _fused(arch, r, s, b))
                if arch == "sm_90a" and recipe != "fp8xfp4_sm90":  # (x staged by the caller)
                    yield Build(f"{arch}/fused/{recipe}/bm{block_m}/decode/x-staged", arch,
                                lambda r=recipe, b=block_m:
                                _fused("sm_90a", r, shapes["decode"], b, given_x=False))


def main(argv: list[str] | None = None) -> int:
    from .compile import compile_for_arch, find_cuda_tool

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", action="append", default=[],
                        help="only builds whose name contains this (repeatable: any of them)")
    parser.add_argument("--list", action="store_true", help="print the build names only")
    args = parser.parse_args(argv)
    if not args.list and find_cuda_tool("nvdisasm") is None:
        parser.error("nvdisasm is not installed (pip install -e '.[sass]')")
    for build in builds():
        if args.k and not any(k in build.name for k in args.k):
            continue
        if args.list:
            print(build.name)
            continue
        kernel, example = build.make()
        art = compile_for_arch(kernel, *example, arch=build.arch)
        print(f"{build.name} {sass_hash(art.sass)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
