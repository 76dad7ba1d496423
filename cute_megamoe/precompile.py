"""Ahead-of-time compile: every kernel a layer can pick for a shape, before its first call.

    python -m cute_megamoe.precompile --experts 256 --topk 8 --hidden 7168 --intermediate 2048 \\
        --max-tokens 4096 --recipe fp8xfp8 --ranks 8           # prints a table and the total

    from cute_megamoe.precompile import precompile, precompile_layer
    precompile_layer(layer)        # in the serving process, before it takes traffic

The first call of a shape compiles its kernels: tens of seconds (`runtime.compiled_kernel`
logs each compile through the ``cute_megamoe`` logger). Compiled kernels live in the process
(`runtime.compiled_kernel`'s cache; CuTe DSL keeps nothing on disk for them), so a server calls
`precompile_layer` (or `precompile` with the layer's arguments) in its own process; the command
line measures the compile time and checks that every kernel compiles, also on a machine
without a GPU (``--arch``).

What it compiles: for every token count ``0..max_tokens`` per rank, the kernels of a call of
`cute_megamoe.MegaMoE` (inputs given as ``x``, no cumulative stats) on each path of
``paths``: ``"staged"`` (staging, dispatch, the two grouped GEMMs, combine; where the arch has
no grouped GEMMs for the recipe, staging, dispatch and the pool-order combine around the torch
experts) and ``"fused"`` (where `fused.supports` lets it run: sm_90a fp8xfp8 / bf16xbf16 for
one rank; sm_100a fp8xfp4 / bf16xbf16). The
choices that follow the token count (BLOCK_M, `heuristics.block_m_for_call`; the sm_90a
mainloop, `launch.sm90_runs_transposed`; the MXFP4 decode's clusters; the combine's rounds)
are evaluated for every count, one call per distinct choice. It goes through the launchers
themselves (`launch.staging_call`, ...), on a stand-in of the symmetric buffer and the weights
(meta tensors: no memory), so the cache keys are the layer's own; the kernel-variant
environment switches (``CUTE_MEGAMOE_*``) count as for the layer, so set them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .buffer import SymmBuffer
from .config import Sm90FusedConfig
from .expert_gemm import (
    _BLOCK_SF_FIELDS,
    _WEIGHT_DTYPE,
    ExpertWeights,
    _check_weights,
    expert_ffn_configs,
)
from .expert_gemm import tiles_weights as _tiles_weights
from .fused import fused_kernel_config, supports
from .heuristics import (
    DEFAULT_NUM_SMS,
    block_m_for_call,
    expected_tokens_per_expert,
    get_num_sms,
)
from .kernels.common.gemm_config import weight_sf_row_len
from .launch import (
    _STATES,
    BufferState,
    combine_call,
    dispatch_call,
    expert_gemm_calls,
    fused_call,
    staging_call,
    streamless,
)
from .layout import MegaMoELayout
from .runtime import LOGGER, get_arch, launch_path
from .staged import TRANSFERS, _combine_rounds
from .tables import ARCHS, check_recipe, has_gemm_kernels, normalize_arch

__all__ = ["PATHS", "CompiledKernel", "PrecompileReport", "main", "precompile",
           "precompile_layer"]

#: The layer paths `precompile` can compile for.
PATHS = ("staged", "fused")


@dataclass(frozen=True)
class CompiledKernel:
    """One compile: the kernel (`runtime.compiled_kernel`'s name, the GEMMs' with their
    phase), the calls it serves (path, token counts, BLOCK_M) and its seconds."""

    kernel: str
    serves: str
    seconds: float
    key: tuple = field(repr=False, compare=False)


@dataclass
class PrecompileReport:
    """What `precompile` compiled, in order; the calls it compiled for (token counts per rank
    and what the layer chooses for them); its total wall time (including the kernels already
    compiled, which are not compiled again)."""

    arch: str
    launch_path: str
    compiled: list[CompiledKernel]
    seconds: float
    calls: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The calls, then the compiles as a text table, with the total."""
        rows = [("#", "kernel", "for", "seconds")]
        rows += [(str(i + 1), c.kernel, c.serves, f"{c.seconds:.1f}")
                 for i, c in enumerate(self.compiled)]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"calls: {call}" for call in self.calls]
        lines += ["  ".join(r[i].ljust(widths[i]) if i < 3 else r[i].rjust(widths[i])
                            for i in range(4)) for r in rows]
        compile_s = sum(c.seconds for c in self.compiled)
        lines.append(f"{len(self.compiled)} kernels compiled for {self.arch} (launch path "
                     f"{self.launch_path}) in {compile_s:.1f} s; total {self.seconds:.1f} s")
        return "\n".join(lines)


class _Collect(logging.Handler):
    """The compiles `runtime.compiled_kernel` logs, each with what it serves."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.serves = ""
        self.compiled: list[CompiledKernel] = []

    def emit(self, record: logging.LogRecord) -> None:
        info = getattr(record, "cute_megamoe_compile", None)
        if info is None:
            return
        name, key = info["name"], info["key"]
        if name == "expert_gemm" and len(key) > 2:
            name = f"expert_gemm {key[2]}"  # (the phase)
        self.compiled.append(CompiledKernel(name, self.serves, info["seconds"], key))


class _CompileOnlyState(BufferState):
    """`launch.BufferState` of a stand-in buffer: the arch and SMs given, meta tensors."""

    def __init__(self, sym_buffer: SymmBuffer, arch: str, num_sms: int):
        layout = sym_buffer.layout
        self.arch = arch
        self.num_sms = num_sms
        self.recv_tokens = torch.empty(layout.num_local_experts, dtype=torch.int32,
                                       device="meta")
        self.peer_bases = self.recv_tokens_ptr = None
        self.expert_out = torch.empty(layout.num_pool_rows, layout.hidden,
                                      dtype=torch.bfloat16, device="meta")
        self.plans = {}
        self.pool_block_ready = torch.empty(layout.num_pool_rows // 64 + 1, dtype=torch.int32,
                                            device="meta")


#: Stands for a process group in a stand-in buffer of several ranks (`fused.supports` reads a
#: buffer with a group as one process per GPU).
_A_GROUP = object()


def _stand_in_buffer(layout: MegaMoELayout, arch: str) -> SymmBuffer:
    """A `SymmBuffer` of ``layout`` on the meta device (no memory) with its launch state for
    ``arch``, as `SymmBuffer.loopback` builds its buffers."""
    buf = SymmBuffer.__new__(SymmBuffer)
    buf.layout, buf.handle, buf.rank, buf.num_ranks = layout, None, 0, layout.num_ranks
    buf.group = None if layout.num_ranks == 1 else _A_GROUP
    buf.num_sms = None
    buf._attach(torch.empty(layout.num_bytes, dtype=torch.uint8, device="meta"),
                [0] * layout.num_ranks)
    sms = get_num_sms() if torch.cuda.is_available() else DEFAULT_NUM_SMS
    _STATES[buf] = _CompileOnlyState(buf, arch, sms)
    return buf


def _stand_in_weights(recipe: str, arch: str, layout: MegaMoELayout,
                      tiled: bool | None) -> ExpertWeights:
    """`ExpertWeights` of the layout's shapes on the meta device, stored as ``tiled`` says
    (None: as the constructors store them by default, `tiles_weights`)."""
    e_l, hidden, inter = layout.num_local_experts, layout.hidden, layout.intermediate_hidden
    per_byte = 2 if recipe in ("fp8xfp4", "fp8xfp4_sm90") else 1

    def empty(*shape, dtype=_WEIGHT_DTYPE[recipe]):
        return torch.empty(shape, dtype=dtype, device="meta")

    w1, w2 = empty(e_l, 2 * inter, hidden // per_byte), empty(e_l, hidden, inter // per_byte)
    scales = {}
    if per_byte == 2:
        scales.update(w1_sf=empty(e_l, hidden // 128, 2 * inter, dtype=torch.int32),
                      w2_sf=empty(e_l, inter // 128, hidden, dtype=torch.int32))
    for name, n, k in zip(_BLOCK_SF_FIELDS.get(recipe, ()), (2 * inter, hidden),
                          (hidden, inter), strict=False):
        scales[name] = empty(e_l, k // 128, weight_sf_row_len(n), dtype=torch.float32)
    weights = ExpertWeights(recipe, w1, w2, arch=arch, **scales)
    tiled = _tiles_weights(recipe, arch, w1, w2) if tiled is None else tiled
    weights = replace(weights, tiled=tiled)
    _check_weights(weights, torch.device("meta"))
    return weights


def _choices(n: int, layout: MegaMoELayout, weights: ExpertWeights | None, arch: str,
             block_m: int | None, l2_sends: bool) -> tuple:
    """Everything a call of ``n`` tokens decides by its token count: whether it has tokens,
    BLOCK_M, the grouped GEMMs' complete configurations (`expert_gemm.expert_ffn_configs`:
    the compile keys) and the combine's mode and rounds."""
    args = (n, layout.num_ranks, layout.num_topk, layout.num_experts)
    plain = block_m or block_m_for_call(*args, arch)
    to_combine = weights is not None and l2_sends
    configs = None if weights is None else expert_ffn_configs(
        arch, layout.recipe, plain, layout.hidden, layout.intermediate_hidden,
        expected_tokens_per_expert(*args), to_combine, None)
    return (n > 0, plain, configs, _combine_rounds("registers", None, n, to_combine))


def _stand_in_inputs(n: int, layout: MegaMoELayout):
    return (torch.empty(n, layout.hidden, dtype=torch.bfloat16, device="meta"),
            torch.empty(n, layout.num_topk, dtype=torch.int64, device="meta"),
            torch.empty(n, layout.num_topk, dtype=torch.float32, device="meta"))


def _staged_call(buf: SymmBuffer, weights: ExpertWeights | None, n: int, block_m: int,
                 configs: tuple | None, clamp, fast_math: bool, transfer: str,
                 l2_sends: bool) -> None:
    """The launches `staged.staged_mega_moe` prepares for a call of ``n`` tokens (built, not
    made): staging, dispatch, the expert GEMMs (``weights`` None: the torch experts), combine."""
    layout, state = buf.layout, _STATES[buf]
    x, idx, w = _stand_in_inputs(n, layout)
    if n > 0:
        staging_call(buf, x, idx, w)
    dispatch_call(buf, n, block_m, state.num_sms, None, transfer)
    epilogue = weights is not None and l2_sends
    out = None if epilogue else state.expert_out
    if weights is not None:
        expert_gemm_calls(state.arch, layout.recipe, state.num_sms, weights,
                          buf.l1_acts, buf.l1_acts_sf if layout.has_sf else None,
                          buf.l1_topk_weights, state.recv_tokens, buf.l2_acts,
                          buf.l2_acts_sf if layout.has_sf else None, out, clamp, fast_math,
                          buf if epilogue else None, configs)
    send_mode, rounds = _combine_rounds("registers", None, n, epilogue)
    y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device="meta")
    combine_call(buf, n, block_m, out, state.recv_tokens, y, state.num_sms, send_mode, rounds)


def _fused_call(buf: SymmBuffer, weights: ExpertWeights, n: int, block_m: int, clamp,
                fast_math: bool) -> None:
    """The launches `fused.fused_mega_moe` prepares for a call of ``n`` tokens given as ``x``."""
    layout, state = buf.layout, _STATES[buf]
    x, idx, w = _stand_in_inputs(n, layout)
    config = fused_kernel_config(state.arch, layout, block_m, True, Sm90FusedConfig())
    in_kernel = bool(getattr(config, "stages_inputs", False))
    if n > 0 and not in_kernel:
        staging_call(buf, x, idx, w)
    y = torch.empty(n, layout.hidden, dtype=torch.bfloat16, device="meta")
    fused_call(buf, weights, n, y, state.num_sms, None, clamp, fast_math, config,
               inputs=(x, idx, w) if in_kernel else None)


def _arch(arch: str | None) -> str:
    if arch is not None:
        return normalize_arch(arch)
    if not torch.cuda.is_available():
        raise ValueError(f"arch: no GPU here to take it from; give the arch to compile for "
                         f"({' or '.join(ARCHS)}: --arch)")
    return get_arch()


def precompile(num_experts: int, num_topk: int, hidden: int, intermediate_hidden: int,
               max_tokens: int, recipe: str, *, num_ranks: int = 1, arch: str | None = None,
               activation_clamp: float | None = None, fast_math: bool = True,
               transfer: str = "push", l2_sends: bool = True, block_m: int | None = None,
               tiled: bool | None = None, paths: Sequence[str] = PATHS,
               fused_max_tokens: int | None = None) -> PrecompileReport:
    """Compile every kernel a `cute_megamoe.MegaMoE` of these arguments can launch for 0 to
    ``max_tokens`` tokens per rank (see the module doc), into this process's compile cache.
    ``arch`` defaults to the GPU's (without a GPU, give it: the kernels then compile for it and
    cannot run here). ``num_experts`` counts all ranks' experts; ``activation_clamp``,
    ``fast_math``, ``transfer``, ``l2_sends`` and ``block_m`` (None: the heuristics) as the
    layer's; ``tiled``: the weights' storage order (`ExpertWeights.tiled`; None: the
    constructors' default); ``paths``: a subset of `PATHS`; ``fused_max_tokens`` (with both
    paths): the fused kernel for counts up to it, the staged kernels above (a layer's
    `MegaMoEConfig.fused_max_tokens`; None: each path for every count). Returns the compiles (those
    already in the cache are not compiled again, nor listed)."""
    start = time.perf_counter()
    check_recipe(recipe)
    arch = _arch(arch)
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer: expected one of {TRANSFERS}, got {transfer!r}")
    if not paths or any(p not in PATHS for p in paths):
        raise ValueError(f"paths: expected some of {PATHS}, got {paths!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive int, got {max_tokens!r}")
    if fused_max_tokens is not None and (isinstance(fused_max_tokens, bool)
                                         or not isinstance(fused_max_tokens, int)
                                         or fused_max_tokens < 0):
        raise ValueError(f"fused_max_tokens: expected None or an int >= 0, got "
                         f"{fused_max_tokens!r}")
    layout = MegaMoELayout(num_ranks, num_experts, max_tokens, num_topk, hidden,
                           intermediate_hidden, recipe)
    buf = _stand_in_buffer(layout, arch)
    weights = _stand_in_weights(recipe, arch, layout, tiled) \
        if has_gemm_kernels(arch, recipe) else None
    fused = ("fused" in paths and weights is not None and transfer == "push" and l2_sends
             and supports(buf, weights) is None)
    split = fused_max_tokens if fused and "staged" in paths else None
    calls: dict[tuple, list[int]] = {}
    for n in range(max_tokens + 1):
        calls.setdefault(_choices(n, layout, weights, arch, block_m, l2_sends), []).append(n)
    collect = _Collect()
    level = LOGGER.level
    LOGGER.addHandler(collect)
    if LOGGER.getEffectiveLevel() > logging.INFO:
        LOGGER.setLevel(logging.INFO)
    # (without a GPU, the launches built, never made, take no stream: `launch.streamless`)
    no_gpu = contextlib.nullcontext() if torch.cuda.is_available() else streamless()
    try:
        with no_gpu:
            for choice, counts in calls.items():
                staged_counts = [n for n in counts if split is None or n > split]
                fused_counts = [n for n in counts if split is None or n <= split]
                if "staged" in paths and staged_counts:
                    collect.serves = f"staged, BLOCK_M {choice[1]}"
                    _staged_call(buf, weights, staged_counts[0], choice[1], choice[2],
                                 activation_clamp, fast_math, transfer, l2_sends)
                if fused and fused_counts:
                    collect.serves = f"fused, BLOCK_M {choice[1]}"
                    _fused_call(buf, weights, fused_counts[0], choice[1], activation_clamp,
                                fast_math)
    finally:
        LOGGER.removeHandler(collect)
        LOGGER.setLevel(level)
        _STATES.pop(buf, None)
    return PrecompileReport(arch, launch_path().name, collect.compiled,
                            time.perf_counter() - start,
                            [_describe(choice, counts) for choice, counts in calls.items()])


def _describe(choice: tuple, counts: list[int]) -> str:
    """One line for the calls of ``counts`` tokens that decide alike (`_choices`)."""
    _, plain, configs, (send_mode, rounds) = choice
    tokens = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else str(counts[0])
    transposed = configs is not None and getattr(configs[0], "transposed", False)
    shares = configs is not None and getattr(configs[0], "cluster_m", 1) == 2
    return (f"{tokens} tokens: BLOCK_M {plain}"
            + (", sm_90a GEMMs transposed" if transposed else "")
            + (", 2-CTA clusters" if shares else "")
            + f", combine {send_mode} {'/'.join(map(str, rounds))}")


def precompile_layer(layer, max_tokens: int | None = None) -> PrecompileReport:
    """`precompile` for a built `cute_megamoe.MegaMoE` (its shapes, settings and path; the
    fused or staged kernels per call size, `MegaMoEConfig.fused_max_tokens`) and up to
    ``max_tokens`` tokens per rank (default: the layer's maximum). Nothing to compile on
    the CPU path (the reference)."""
    cfg, lay = layer.config, layer.layout
    if cfg.path == "reference":
        return PrecompileReport("cpu", "reference", [], 0.0)
    max_tokens = max_tokens or lay.num_max_tokens_per_rank
    limit = cfg.fused_max_tokens
    paths = (("staged",) if limit is None else ("fused",) if limit >= max_tokens
             else ("fused", "staged"))
    return precompile(lay.num_experts, lay.num_topk, lay.hidden, lay.intermediate_hidden,
                      max_tokens, cfg.recipe,
                      num_ranks=lay.num_ranks, arch=cfg.arch,
                      activation_clamp=cfg.activation_clamp, fast_math=cfg.fast_math,
                      transfer=cfg.transfer, l2_sends=cfg.l2_sends, block_m=cfg.block_m,
                      tiled=getattr(layer.weights, "tiled", None),
                      paths=paths, fused_max_tokens=limit)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cute_megamoe.precompile",
        description="Compile every kernel a MegaMoE layer of this shape can launch, print a "
                    "table and the total time (the kernels stay in this process only).")
    parser.add_argument("--experts", type=int, required=True, help="all ranks' experts")
    parser.add_argument("--topk", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--intermediate", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True, help="tokens per rank")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--arch", default=None,
                        help="sm_90a or sm_100a (default: this GPU's; required without one)")
    parser.add_argument("--activation-clamp", type=float, default=None)
    parser.add_argument("--block-m", type=int, default=None, help="fixed BLOCK_M")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated, of {','.join(PATHS)}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log each compile as it finishes")
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        report = precompile(args.experts, args.topk, args.hidden, args.intermediate,
                            args.max_tokens, args.recipe, num_ranks=args.ranks, arch=args.arch,
                            activation_clamp=args.activation_clamp, block_m=args.block_m,
                            paths=tuple(p for p in args.paths.split(",") if p))
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
