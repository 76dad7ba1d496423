"""One process per GPU for the multi-GPU checks, with every rank's failure in the error.

When one rank's check fails, that process leaves the group, and its peers then fail too: a
kernel waits on the rank that is gone until its spin limit, or faults on memory the gone rank
unmapped ("unspecified launch failure", no report). `torch.multiprocessing.spawn` raises the
error of the first process to exit, which may be such a consequence: the failing rank is
still tearing its group down (2026-12-04: a peer's launch failure hid the failing rank's
assertion). So each rank records its failure with the time, as it happens (`record_failure`,
before the worker's teardown), and `spawn_ranks` raises them all, the first failure first.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator

# where this process records its failure: the folder `spawn_ranks` made, passed to each
# process it spawns (None elsewhere)
_failures_dir: str | None = None


@contextlib.contextmanager
def record_failure(rank: int) -> Iterator[None]:
    """Record an exception leaving the block, with its time, for `spawn_ranks` (once per
    rank: the first record stays), and re-raise it. Workers wrap their checks in it, inside
    the group teardown. Outside `spawn_ranks` it only re-raises."""
    try:
        yield
    except BaseException:
        path = os.path.join(_failures_dir, f"rank {rank}") if _failures_dir else None
        if path and not os.path.exists(path):
            with open(path, "w") as f:
                f.write(f"{time.time():.6f}\n{traceback.format_exc()}")
        raise


def _run_recording_failure(rank: int, failures_dir: str, worker: Callable, *args) -> None:
    global _failures_dir
    _failures_dir = failures_dir
    with record_failure(rank):
        worker(rank, *args)


def spawn_ranks(worker: Callable, num_ranks: int, *args) -> None:
    """``worker(rank, *args)`` in ``num_ranks`` spawned processes (``worker`` a module-level
    function). Raises AssertionError naming every rank that failed, in the order they failed,
    with the first one's whole traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="cute_megamoe_ranks_") as failures_dir:
        try:
            mp.spawn(_run_recording_failure, args=(failures_dir, worker, *args),
                     nprocs=num_ranks, join=True)
        except Exception as error:
            failures = []
            for name in os.listdir(failures_dir):
                with open(os.path.join(failures_dir, name)) as f:
                    when, _, text = f.read().partition("\n")
                failures.append((float(when), name, text.strip()))
            if not failures:
                raise
            failures.sort()
            first_time, first, first_text = failures[0]
            lines = [f"{name} failed first:\n{first_text}" if name == first else
                     f"{name} failed {when - first_time:.1f} s later: {text.splitlines()[-1]}"
                     for when, name, text in failures]
            raise AssertionError("\n".join(lines)) from error
