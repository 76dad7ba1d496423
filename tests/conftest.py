"""Markers: `gpu` needs CUDA, `multigpu` needs 2+ GPUs, `sm100` needs a Blackwell GPU.

Tests with those markers skip (never fail) on machines without the hardware.
"""

import pytest
import torch


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    gpus = _num_gpus()
    major = torch.cuda.get_device_capability(0)[0] if gpus else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA GPUs")
    skip_sm100 = pytest.mark.skip(reason="needs a Blackwell (sm_100) GPU")
    for item in items:
        if item.get_closest_marker("gpu") and gpus == 0:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multigpu") and gpus < 2:
            item.add_marker(skip_multi)
        if item.get_closest_marker("sm100") and major != 10:
            item.add_marker(skip_sm100)
