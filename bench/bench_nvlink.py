"""NVLink ceilings between two GPUs: copy engine vs SM-driven copies, one direction vs both.

The dispatch pulls (each rank reads its peers' rows) and the combine pushes (each rank writes
its peers' rows), with both directions busy at once, so the ceiling for a per-direction rate is
the SM-driven copy of the same kind, both ranks at once. Measured here for 470 MB per rank:

* ``ce_push``: the copy engine writes the peer's symmetric buffer (a device-to-device memcpy);
* ``sm_push``: an SM kernel (torch's vectorized elementwise kernel) writes the peer's buffer;
* ``sm_pull``: the same kernel reads the peer's buffer into local memory;
* ``local_copy``: memcpy inside one GPU (bytes read + written count once here);

each with only rank 1 active ("one") and with both ranks at once ("both"). CUDA events around
one call after a barrier, median of 8.

    python -m bench.bench_nvlink   (2 GPUs)
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import Results, gpu_clocks

NBYTES = 470 << 20


def _worker(rank: int, port: int) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device(f"cuda:{rank}"))
    buf = symm_mem.empty(2 * NBYTES, dtype=torch.uint8, device=f"cuda:{rank}")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = handle.get_buffer(1 - rank, (2 * NBYTES,), torch.uint8)
    src = torch.empty(NBYTES, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")

    def words(t):
        return t.view(torch.int64)

    ops = {  # xor with 0 is a copy that torch runs as an SM kernel, not a memcpy
        "ce_push": lambda: peer[:NBYTES].copy_(src),
        "sm_push": lambda: torch.bitwise_xor(words(src), 0, out=words(peer[:NBYTES])),
        "sm_pull": lambda: torch.bitwise_xor(words(peer[NBYTES:]), 0, out=words(dst)),
        "local_copy": lambda: dst.copy_(src),
    }
    rows = []
    for name, fn in ops.items():
        for both in (False, True):
            active = both or rank == 1
            for _ in range(2):
                if active:
                    fn()
            times = []
            for _ in range(8):
                torch.cuda.synchronize()
                dist.barrier()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                if active:
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            if active:
                rows.append(dict(op=name, directions="both" if both else "one", rank=rank,
                                 gbps=NBYTES / statistics.median(times) / 1e9))
    gathered = [None, None]
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        res = Results("nvlink", meta={"bytes_per_rank": NBYTES, "ranks": 2,
                                         "clocks_before": gpu_clocks()})
        for part in gathered:
            for row in part:
                res.add(**row)
        print(f"saved {res.save()}")
        print(res.table(["op", "directions", "rank", "gbps"]))
    dist.destroy_process_group()


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_nvlink needs 2 GPUs")
    mp.spawn(_worker, args=(29571,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
