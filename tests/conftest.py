"""Markers: `gpu` needs CUDA, `multigpu` needs 2+ GPUs, `sm100` needs a Blackwell GPU.

Tests with those markers skip (never fail) on machines without the hardware. `fused_fp4`: a GPU
test of the fused kernel's MXFP4 experiment, run only with ``--fused-fp4`` (a stall there traps
and takes the CUDA context of every later test in the process with it).
"""

import pytest
import torch


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
