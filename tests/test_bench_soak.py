"""The soak tool (`bench/soak.py`) on a machine without a GPU: a process that dies before its
first call counts as a stall with its output in the row, the exit status says so, and bad
options stop before any process starts."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _soak(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.soak", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_process_that_dies_is_a_stall_with_its_output():
    if torch.cuda.is_available():
        pytest.skip("the GPU soak runs on the device (docs/performance.md, Reliability)")
    run = _soak("--processes", "2", "--seconds", "1", "--no-save")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "0 calls, 2 stalls, 0 mismatches" in run.stdout, run.stdout
    # every row carries what its process printed last (here: why it could not start)
    assert run.stdout.count("process 0:") == 1 and run.stdout.count("process 1:") == 1
    assert "Error" in run.stdout, run.stdout


@pytest.mark.parametrize("args,message", [
    (("--row-transfer", "with_gemm"), "--row-transfer: one of"),
    (("--processes", "0"), "--processes and --seconds must be positive"),
    (("--ranks", "3"), "invalid choice: 3"),
    (("--gpus", "1"), "--gpus: at least 2"),
    (("--gpus", "2", "--ranks", "2"), "without --ranks"),
])
def test_bad_options_stop_before_any_process(args, message):
    run = _soak(*args, "--no-save")
    assert run.returncode == 2 and message in run.stderr, run.stderr
