"""Markers: `gpu` needs CUDA, `multigpu` needs 2+ GPUs, `sm100` needs a Blackwell GPU.

Tests with those markers skip (never fail) on machines without the hardware. `fused_fp4`: a GPU
test of the fused kernel's MXFP4 experiment, run only with ``--fused-fp4`` (a stall there traps
and takes the CUDA context of every later test in the process with it).

The compile tests share one compile cache (`testing.compile.enable_compile_cache`), so a kernel
build that several tests compile is compiled once: a directory in pytest's cache
(`.pytest_cache/d/cute_megamoe_compile`), shared by the pytest-xdist workers and kept between
runs (for the current source only: an edit of the package compiles afresh; ``--cache-clear``
empties it); with ``-p no:cacheprovider`` a temporary directory.
The suite runs in parallel
(``-n auto`` in pyproject.toml, at most 8 workers, 6 with a GPU); ``-n 0`` runs it in one process.
"""

import collections
import os
import shutil
import tempfile

# One intra-op thread per test process (and the processes the tests start), unless the caller
# says otherwise: the tests' tensors are small, and with a worker per core, OpenMP's thread
# pools oversubscribe the cores and spin (the CPU tests took 8x the CPU time with them).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 (after the thread count, which torch reads at import)
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from cute_megamoe.testing.compile import (  # noqa: E402
    compile_cache_stats,
    enable_compile_cache,
    prune_compile_cache,
)


def pytest_configure(config):
    # an xdist worker takes the controller's directory; the controller (or a lone process) keeps
    # it in pytest's cache (`.pytest_cache`), else (``-p no:cacheprovider``) in a temporary one
    directory = getattr(config, "workerinput", {}).get("cute_megamoe_compile_cache")
    config.cute_megamoe_cache_role = "worker" if directory is not None else (
        "persistent" if getattr(config, "cache", None) is not None else "temporary")
    if config.cute_megamoe_cache_role == "persistent":
        directory = str(config.cache.mkdir("cute_megamoe_compile"))
    elif config.cute_megamoe_cache_role == "temporary":
        directory = tempfile.mkdtemp(prefix="cute_megamoe_compile_cache_")
    config.cute_megamoe_compile_cache = directory
    config.cute_megamoe_compile_stats = collections.Counter()
    enable_compile_cache(directory)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # (pytest-xdist) each worker gets the controller's directory
    node.workerinput["cute_megamoe_compile_cache"] = node.config.cute_megamoe_compile_cache


def pytest_sessionfinish(session):
    config = session.config
    if hasattr(config, "workerinput"):  # (pytest-xdist) this worker's counts go to the controller
        config.workeroutput["cute_megamoe_compile_stats"] = compile_cache_stats()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # (pytest-xdist) a worker's counts, in the controller
    stats = getattr(node, "workeroutput", {}).get("cute_megamoe_compile_stats", {})
    for name, count in stats.items():
        node.config.cute_megamoe_compile_stats[name] += count


def pytest_unconfigure(config):
    role, directory = config.cute_megamoe_cache_role, config.cute_megamoe_compile_cache
    if role == "temporary":
        shutil.rmtree(directory, ignore_errors=True)
    elif role == "persistent":  # only the builds of this source
        prune_compile_cache(directory)


def pytest_terminal_summary(terminalreporter, config):
    totals = config.cute_megamoe_compile_stats + collections.Counter(compile_cache_stats())
    if totals and config.get_verbosity() >= 0:
        terminalreporter.write_line("compile cache: " + ", ".join(
            f"{count} {name}" for name, count in sorted(totals.items())))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 8; at most 6 where a GPU is present (the GPU
    tests share it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # (xdist's own reading of it)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 6 if torch.cuda.is_available() else 8))


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_addoption(parser):
    parser.addoption("--fused-fp4", action="store_true",
                     help="also run the GPU tests of the fused kernel's MXFP4 experiment")


def pytest_collection_modifyitems(config, items):
    gpus = _num_gpus()
    major = torch.cuda.get_device_capability(0)[0] if gpus else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA GPUs")
    skip_sm100 = pytest.mark.skip(reason="needs a Blackwell (sm_100) GPU")
    skip_fp4 = pytest.mark.skip(reason="the fused MXFP4 experiment runs with --fused-fp4")
    fp4 = config.getoption("--fused-fp4")
    for item in items:
        if item.get_closest_marker("fused_fp4") and not fp4:
            item.add_marker(skip_fp4)
        if item.get_closest_marker("gpu") and gpus == 0:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multigpu") and gpus < 2:
            item.add_marker(skip_multi)
        if item.get_closest_marker("sm100") and major != 10:
            item.add_marker(skip_sm100)
