"""`testing.spawn.spawn_ranks`: a multi-GPU check's error names every failed rank, the first
failure first with its traceback, also when that rank is still tearing down as its peer's
consequent failure ends the run (CPU processes here; no GPU needed)."""

import time

import pytest

from cute_megamoe.testing.spawn import record_failure, spawn_ranks


def _worker(rank: int, first_rank: int) -> None:
    try:
        with record_failure(rank):
            if rank != first_rank:  # a peer that fails because the first rank left the group
                time.sleep(1.0)
                raise RuntimeError("CUDA error: unspecified launch failure")
            raise AssertionError(f"rank {rank}: rel. error 0.0231 against the reference")
    finally:
        if rank == first_rank:
            time.sleep(30.0)  # (a teardown that outlasts the peer: spawn ends it)


def _passing_worker(rank: int, path: str) -> None:
    with open(f"{path}.{rank}", "w") as f:
        f.write(str(rank))


@pytest.mark.parametrize("first_rank", (0, 1))
def test_spawn_ranks_names_the_first_failure_first(first_rank):
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        spawn_ranks(_worker, 2, first_rank)
    assert time.monotonic() - start < 25.0  # (the peer's exit ended the run)
    message = str(info.value)
    assert message.startswith(f"rank {first_rank} failed first:\n"), message
    assert "Traceback" in message and "rel. error 0.0231" in message
    assert f"rank {1 - first_rank} failed" in message
    assert "s later: RuntimeError: CUDA error: unspecified launch failure" in message


def test_spawn_ranks_runs_every_rank(tmp_path):
    spawn_ranks(_passing_worker, 3, str(tmp_path / "out"))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", "1", "2"]
