"""The ranks of a group that run in this process, and the inputs every process builds alike:
what the protocol checks (`protocol_checks`) and the fused layer's checks (`fused_checks`)
share."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from .dispatch_checks import make_routing

__all__ = ["Ranks", "init_rank_process", "make_call"]


@dataclass
class Ranks:
    """The ranks of one group that run in this process: their buffers (one per rank, all of the
    group's with `SymmBuffer.loopback`) and a stream each.

    Several ranks in one process share one CUDA context, where loading a kernel (on its first
    launch) may wait for every running kernel: a rank's collective kernel that spins for a
    peer whose kernel is still to be loaded deadlocks. So a call runs in phases (every rank's
    dispatch, then every rank's experts and combine, `run`), and every kernel a call uses is
    first loaded by a call in which every rank uses it (`check_calls` and `check_layer_calls`
    warm up each BLOCK_M so). Processes with one rank each have no such constraint.
    """

    buffers: list
    streams: list

    @classmethod
    def loopback(cls, num_ranks: int, num_experts: int, max_tokens: int, num_topk: int,
                 hidden: int, intermediate: int, recipe: str, **rings) -> Ranks:
        """A loopback group (`SymmBuffer.loopback`; ``rings``: its ``l1_output_rows`` /
        ``received_rows``)."""
        from ..buffer import SymmBuffer

        buffers = SymmBuffer.loopback(num_ranks, num_experts, max_tokens, num_topk, hidden,
                                      intermediate, recipe, **rings)
        return cls(buffers, [torch.cuda.Stream() for _ in buffers])

    @property
    def layout(self):
        return self.buffers[0].layout

    def run(self, step) -> list:
        """`step(buffer)` for every local rank, each on its stream (no host synchronization in
        between: a rank's collective kernel waits for the others' to start). A rank after the
        first may not compile a kernel (`runtime.compiles_refused`): it would load it while the
        earlier ranks' kernels run; a warm-up must have loaded it."""
        from ..runtime import compiles_refused

        results = []
        for i, (buf, stream) in enumerate(zip(self.buffers, self.streams, strict=True)):
            stream.wait_stream(torch.cuda.current_stream())
            refuse = compiles_refused(
                f"rank {buf.rank} of a loopback call whose earlier ranks' kernels were launched "
                f"(warm up every kernel with every rank using it first: `Ranks`)") if i else \
                contextlib.nullcontext()
            with torch.cuda.stream(stream), refuse:
                results.append(step(buf))
        for stream in self.streams:
            torch.cuda.current_stream().wait_stream(stream)
        return results


def make_call(layout, tokens: tuple[int, ...], routing: str, seed: int):
    """Inputs of every rank for one call: (xs, topk_idx, topk_weights), on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for n in tokens:
        x = torch.randn(n, layout.hidden, generator=gen)
        x *= torch.exp2(torch.randint(-8, 8, (n, 1), generator=gen).float())
        xs.append(x.to(torch.bfloat16))
        idx, w = make_routing(n, layout.num_experts, layout.num_topk, routing, gen)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


def init_rank_process(rank: int, num_ranks: int, port: int) -> None:
    """A spawned process's NCCL group, one GPU per rank (the workers of the multi-GPU
    checks)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=num_ranks,
                            device_id=torch.device("cuda", rank))
