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
    (("--config", "fused_kernel.walk=sideways"), "--config fused_kernel.walk=sideways"),
    (("--config", "walk=tickets"), "LayerConfig has no field 'walk'"),
])
def test_bad_options_stop_before_any_process(args, message):
    run = _soak(*args, "--no-save")
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_the_soak_takes_every_routing_of_the_checks_and_bad_slots():
    """The soak's routings are the fused checks' and "bad" (`make_routing`): about 5 % of the
    slots out of range, negative or repeating the token's slot 0, which the host check
    rejects (the dispatch masks them on the GPU, alike in both layers)."""
    import torch

    from bench.soak import SOAK_ROUTINGS
    from cute_megamoe.checks import check_routing
    from cute_megamoe.testing.dispatch_checks import make_routing
    from cute_megamoe.testing.fused_checks import ROUTINGS

    assert SOAK_ROUTINGS == (*ROUTINGS, "bad")
    idx, w = make_routing(2000, 16, 4, "bad", torch.Generator().manual_seed(3))
    good, _ = make_routing(2000, 16, 4, "random", torch.Generator().manual_seed(3))
    assert torch.equal(idx[:, 0], good[:, 0])
    out_of_range, negative = int((idx >= 16).sum()), int((idx < -1).sum())
    repeats = int(((idx[:, 1:] == idx[:, :1]) & (idx[:, 1:] >= 0)).sum())
    for count in (out_of_range, negative, repeats):
        assert 60 < count < 200, (out_of_range, negative, repeats)  # ~ 2000 * 3 / 60 each
    with pytest.raises(ValueError, match="topk_idx"):
        check_routing(idx, 16)
    assert w.shape == idx.shape
