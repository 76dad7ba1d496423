"""Benchmark plumbing shared by every `bench/*.py`: timing, ceilings, roofline, JSON results.

Method (see METHOD.md of the device notes): warm up, time with CUDA graph replay (many calls
per replay so launch gaps do not count) or CUDA events, take the median of several replays,
rotate inputs when they would fit in L2, read clocks before and after, and always measure the
ceilings (a device-to-device copy, dense GEMMs) in the same run as the thing compared to them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
COPY_CHUNK = 256 << 20  # bytes per torch copy in `copy_ceiling`


@dataclass
class Peaks:
    """Roofline ceilings. Defaults: what we measured on one H200 (issue 2); override per GPU."""

    hbm_bytes_per_s: float = 4.2e12  # device-to-device copy, bytes read + written
    bf16_flops: float = 763e12  # dense BF16 GEMM through torch
    fp8_flops: float = 1307e12  # dense FP8 GEMM through torch._scaled_mm
    nvlink_bytes_per_s: float = 391e9  # plain peer copy, one direction

    def roofline_s(self, flops: float = 0.0, hbm_bytes: float = 0.0, nvl_bytes: float = 0.0,
                   fp8: bool = True) -> float:
        """max(flops / peak, bytes / HBM bandwidth, NVLink bytes / NVLink bandwidth)."""
        rate = self.fp8_flops if fp8 else self.bf16_flops
        return max(flops / rate, hbm_bytes / self.hbm_bytes_per_s,
                   nvl_bytes / self.nvlink_bytes_per_s)


SMEM_BYTES_PER_CLOCK = 128  # per SM on Hopper
FP8_FLOPS_PER_CLOCK = 8192  # dense FP8 WGMMA per SM on Hopper (BF16: half, at half the bytes)


def smem_bound_tensor_share(block_m: int, block_n: int, wgmma_n: int,
                            a_in_registers: bool = False, block_k_bytes: int = 128) -> float:
    """The share of tensor-pipe cycles an sm_90a FP8 GEMM tile can keep busy when shared
    memory, 128 bytes per clock per SM, carries its operands: per k-block of ``block_k_bytes``
    the TMA writes the ``block_m x block_n`` tile's A and B rows, and each of the ``block_m /
    64`` warpgroups' SS WGMMAs (``m64 x wgmma_n`` per instruction, over ``block_n``) reads its
    A rows and the B rows of its instruction once per k32 step; with ``a_in_registers`` A is
    read once per k-block by ``ldmatrix`` instead (a model only: the kernels' A-in-registers
    promotions measured slower than "chunk" on an H200 and were removed). Tensor cycles over
    shared-memory cycles, at most 1. The model of docs/performance.md ("Why DeepGEMM is faster
    at large M"): it gives DeepGEMM's 128 x 192 tiles 92.3 % (ncu: 92.1 %)."""
    if block_m % 64 or block_n % wgmma_n or block_k_bytes % 32:
        raise ValueError(f"tile {block_m} x {block_n} in m64 x {wgmma_n} WGMMAs, k-block "
                         f"{block_k_bytes} bytes")
    steps = block_k_bytes // 32
    tensor = block_m * block_n * block_k_bytes * 2 / FP8_FLOPS_PER_CLOCK
    per_wg = (block_n // wgmma_n) * steps * ((0 if a_in_registers else 64 * 32) + wgmma_n * 32)
    if a_in_registers:
        per_wg += 64 * block_k_bytes
    smem = (block_m // 64) * per_wg + (block_m + block_n) * block_k_bytes
    return min(1.0, tensor / (smem / SMEM_BYTES_PER_CLOCK))


def _capture_graph(fn: Callable[[], None], calls_per_replay: int, warmup: int,
                   stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """`fn` warmed up, then captured ``calls_per_replay`` times in a CUDA graph on ``stream``
    (replayed once before it is returned)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # one eager call on the capture stream (lazy init)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls_per_replay):
                fn()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _replay_seconds(graph: torch.cuda.CUDAGraph, calls_per_replay: int) -> float:
    """Seconds per call of one replay of ``graph`` (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls_per_replay


def time_cuda_graph(fn: Callable[[], None], calls_per_replay: int = 20, replays: int = 15,
                    warmup: int = 3) -> float:
    """Median seconds per call of `fn`, captured `calls_per_replay` times in one CUDA graph."""
    graph = _capture_graph(fn, calls_per_replay, warmup, torch.cuda.Stream())
    return statistics.median(_replay_seconds(graph, calls_per_replay) for _ in range(replays))


def time_cuda_graphs_interleaved(fns: dict, calls_per_replay: int = 5, replays: int = 15,
                                 warmup: int = 3) -> dict:
    """Median seconds per call of each of ``fns`` (key: callable), each captured
    ``calls_per_replay`` times in a CUDA graph of its own, the graphs replayed in turn (one
    replay of each, ``replays`` times, the order rotating): every variant sees the same mix of
    clock and power states. A GPU at its power limit lowers its clock within milliseconds, so
    a variant timed right after a power-hungry one (e.g. our FP8 kernels before the FP4 ones)
    otherwise runs at a lower clock than the one timed first."""
    stream = torch.cuda.Stream()
    graphs = {key: _capture_graph(fn, calls_per_replay, warmup, stream)
              for key, fn in fns.items()}
    keys = list(graphs)
    times = {key: [] for key in keys}
    for r in range(replays):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(_replay_seconds(graphs[key], calls_per_replay))
    return {key: statistics.median(v) for key, v in times.items()}

def time_events(fn: Callable[[], None], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call of `fn` timed one call at a time with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = time_cuda_graph(lambda: dst.copy_(src), calls_per_replay=5, replays=10)
    return 2 * nbytes / t


def copy_ceiling(total_bytes: int, rotate: int = 1) -> float:
    """Bytes/s of a device-to-device copy moving `total_bytes` (read + written), timed like a
    kernel that moves as many bytes: the ceiling a memory-bound kernel of that size is held to.

    Copies go in chunks of at most COPY_CHUNK bytes: on an H200 torch copies of 1 GiB and more
    ran at 2.7-2.8 TB/s against 4.2-4.3 TB/s for smaller ones (measured 2026-11-30)."""
    n = max(16, total_bytes // 2)
    srcs = [torch.empty(n, dtype=torch.uint8, device="cuda").random_() for _ in range(rotate)]
    dsts = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(rotate)]
    state = {"i": 0}

    def copy():
        i = state["i"] = (state["i"] + 1) % rotate
        for start in range(0, n, COPY_CHUNK):
            dsts[i][start:start + COPY_CHUNK].copy_(srcs[i][start:start + COPY_CHUNK])

    return 2 * n / time_cuda_graph(copy)


def gpu_clocks() -> dict[str, str]:
    """SM and memory clocks and temperature as nvidia-smi reports them now (no settings touched)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout
        return {"nvidia_smi": out.strip()}
    except (OSError, subprocess.SubprocessError):
        return {"nvidia_smi": "unavailable"}


def _this_gpu() -> list[str]:
    """nvidia-smi's option for the current CUDA device (by its UUID; CUDA's device numbers
    need not be nvidia-smi's), or none (every GPU) when torch does not know it or nvidia-smi
    does not take it."""
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    if not uuid:
        return []
    option = [f"--id=GPU-{str(uuid).removeprefix('GPU-')}"]
    try:
        probe = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                                *option], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return option if probe.returncode == 0 and probe.stdout.strip() else []


def power_limit_w() -> float | None:
    """The current GPU's board power limit as nvidia-smi reports it now (W); None when
    unavailable."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=power.limit",
                              "--format=csv,noheader,nounits", *_this_gpu()],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def energy_columns(sustained: dict, limit_w: float | None,
                   steps: tuple[str, ...] = ("dispatch", "experts", "combine")) -> dict:
    """Row columns from `sustained_power` readings: per name ``{name}_sustained_us``,
    ``{name}_watts``, ``{name}_sm_mhz`` and ``{name}_mj`` (energy per call, watts x seconds).
    With every one of ``steps`` read and the power limit known, ``power_floor_us``: their
    energies' sum over the limit, the time that work takes at the limit at those energies
    (an estimate, not a bound: at a lower clock the GPU runs at a lower voltage and spends
    less per operation), and ``{name}_over_power_floor`` for the others."""
    cols = {}
    for name, r in sustained.items():
        cols[f"{name}_sustained_us"] = r["seconds_per_call"] * 1e6
        cols[f"{name}_watts"] = r["watts"]
        cols[f"{name}_sm_mhz"] = r["sm_mhz"]
        cols[f"{name}_mj"] = r["watts"] * r["seconds_per_call"] * 1e3
    if limit_w and all(step in sustained for step in steps):
        floor_us = sum(cols[f"{step}_mj"] for step in steps) / limit_w * 1e3
        cols["power_floor_us"] = floor_us
        for name in sustained:
            if name not in steps:
                cols[f"{name}_over_power_floor"] = cols[f"{name}_sustained_us"] / floor_us
    return cols


def power_during(fn: Callable[[], None], seconds: float, calls_per_replay: int = 5,
                 sample_ms: int = 50, settle_s: float = 0.3) -> dict:
    """Board power and SM clock while `fn` runs back to back for about `seconds` (captured in a
    CUDA graph of `calls_per_replay` calls, replayed), sampled by ``nvidia-smi -lms`` and the
    first `settle_s` dropped (its readings average over about 100 ms). Returns ``watts`` and
    ``sm_mhz`` (medians), ``seconds_per_call`` (events over all replays) and ``samples``; at
    the power limit the energy per call, watts x seconds, is what sets the speed. Empty when
    nvidia-smi is unavailable."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls_per_replay):
                fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1, int(seconds / max(start.elapsed_time(end) / 1e3, 1e-6)))
    try:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits",
             f"-lms={sample_ms}", *_this_gpu()], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return {}
    t0 = time.monotonic()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    elapsed = time.monotonic() - t0
    smi.terminate()
    out, _ = smi.communicate(timeout=10)
    readings = []
    for line in out.splitlines():
        try:
            watts, mhz = (float(v) for v in line.split(","))
        except ValueError:
            continue
        readings.append((watts, mhz))
    keep = readings[int(len(readings) * min(settle_s / max(elapsed, 1e-6), 0.5)):]
    if not keep:
        return {}
    return {"watts": statistics.median(w for w, _ in keep),
            "sm_mhz": statistics.median(m for _, m in keep),
            "seconds_per_call": start.elapsed_time(end) / 1e3 / (replays * calls_per_replay),
            "samples": len(keep)}


def sustained_power(runs: dict, seconds: float, rounds: int = 1) -> dict:
    """`power_during` for each ``name: fn`` of ``runs``, the runs in turn ``rounds`` times (each
    sees the same drift), as ``name: {"watts", "sm_mhz", "seconds_per_call"}`` (medians over
    the rounds; names nvidia-smi could not sample are left out). At the power limit this is the
    speed under a steady load, where interleaved graph replays alternate short bursts."""
    readings = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            got = power_during(fn, seconds)
            if got:
                readings[name].append(got)
    return {name: {key: statistics.median(r[key] for r in got)
                   for key in ("watts", "sm_mhz", "seconds_per_call")}
            for name, got in readings.items() if got}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return os.environ.get("CUTE_MEGAMOE_COMMIT", "unknown")


@dataclass
class Results:
    """One benchmark run: environment, ceilings and rows; saved as JSON under bench/results/."""

    name: str
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.meta.update(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            gpu=gpu, num_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            torch=torch.__version__, python=platform.python_version(),
            commit=os.environ.get("CUTE_MEGAMOE_COMMIT") or git_commit())

    def add(self, **row) -> None:
        self.rows.append(row)

    def save(self, out_dir: Path | None = None) -> Path:
        out_dir = Path(out_dir or os.environ.get("CUTE_MEGAMOE_RESULTS_DIR") or RESULTS_DIR)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = self.meta["date"].replace(":", "").replace("-", "")[:15]
        text = json.dumps({"name": self.name, "meta": self.meta, "rows": self.rows}, indent=1)
        # never over another result: two runs started in the same second (two soaks side by
        # side, 12-07) wrote one file
        for n in range(1, 100):
            path = out_dir / (f"{self.name}-{stamp}.json" if n == 1
                              else f"{self.name}-{stamp}-{n}.json")
            try:
                with path.open("x") as f:
                    f.write(text)
                return path
            except FileExistsError:
                continue
        raise FileExistsError(f"{out_dir}: {self.name}-{stamp}*.json, 99 of them")

    def table(self, columns: list[str]) -> str:
        widths = [max(len(c), *(len(_fmt(r.get(c))) for r in self.rows)) for c in columns]
        pairs = list(zip(columns, widths, strict=True))
        lines = ["  ".join(c.rjust(w) for c, w in pairs)]
        for r in self.rows:
            lines.append("  ".join(_fmt(r.get(c)).rjust(w) for c, w in pairs))
        return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def random_expert_weights(num_experts: int, hidden: int, intermediate: int, recipe: str,
                          seed: int = 0):
    """`expert_gemm.ExpertWeights` of random BF16 masters ``[E, 2I, H]`` / ``[E, H, I]``
    (scaled by 1/sqrt(K)) quantized for ``recipe`` on the current GPU."""
    from cute_megamoe.expert_gemm import ExpertWeights

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=gen, device="cuda")
          / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=gen, device="cuda")
          / intermediate**0.5).to(torch.bfloat16)
    return ExpertWeights.from_bf16(w1, w2, recipe)


# ----------------------------------------------------------------------------- configurations

_NONE = ("none", "auto")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_config(settings: Iterable[str], base=None, option: str = "--config"):
    """``KEY=VALUE`` settings (a bench's ``--config``, repeatable) applied to the configuration
    ``base`` (a `cute_megamoe.config` value; default `LayerConfig()`): a dotted key names a
    field of a nested configuration (``gemm.promotion=chunk``,
    ``fused_kernel.row_transfer=barrier``), VALUE is read as the field's type (an integer,
    ``1`` / ``0`` / ``true`` / ``false``, a name; ``none`` or ``auto`` for None: the
    heuristics'). Anything else exits naming ``option`` and the setting."""
    from cute_megamoe.config import LayerConfig

    config = LayerConfig() if base is None else base
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise SystemExit(f"{option}: KEY=VALUE, got {setting!r}")
        try:
            config = _with_setting(config, key.strip().split("."), value.strip())
        except (ValueError, TypeError) as error:
            raise SystemExit(f"{option} {setting}: {error}") from None
    return config


def _with_setting(config, path: list[str], value: str):
    """``config`` with the field at ``path`` set to ``value`` (read as its type)."""
    fields = {f.name: f for f in dataclasses.fields(config) if not f.name.startswith("_")}
    name = path[0]
    if name not in fields:
        raise ValueError(f"{type(config).__name__} has no field {name!r} (fields: "
                         f"{', '.join(fields)})")
    current = getattr(config, name)
    if dataclasses.is_dataclass(current):
        if len(path) == 1:
            raise ValueError(f"{name} is a {type(current).__name__}: name one of its fields "
                             f"({name}.FIELD=VALUE)")
        return dataclasses.replace(config, **{name: _with_setting(current, path[1:], value)})
    if len(path) > 1:
        raise ValueError(f"{name} has no fields")
    kind = str(fields[name].type)
    lower = value.lower()
    if "None" in kind and lower in _NONE:
        parsed = None
    elif "bool" in kind:
        if lower not in _TRUE + _FALSE:
            raise ValueError(f"{name}: one of {_TRUE + _FALSE}, got {value!r}")
        parsed = lower in _TRUE
    elif "int" in kind:
        parsed = int(value)
    else:
        parsed = value
    return dataclasses.replace(config, **{name: parsed})


def config_label(settings: Iterable[str]) -> str:
    """A column-name part for ``KEY=VALUE`` settings: ``gemm.promotion=chunk`` ->
    ``gemm_promotion_chunk`` (several joined by ``__``)."""
    return "__".join(setting.replace(".", "_").replace("=", "_").lower()
                     for setting in settings)

