"""Checks of the fused layer kernel (`fused.fused_mega_moe`) against the staged layer.

The staged layer (`staged.staged_mega_moe` on our kernels, L2 sending the rows) runs the same
numerics as separate launches, so the fused kernel must give the same `y` bit for bit, the same
received counts and the same cumulative statistics; `y` is also compared with the PyTorch
reference (within the layer tolerance), and poisoned with NaN before every call so that a row
the kernel never writes shows up. Works for the ranks of a group in this process
(`protocol_checks.Ranks`: one rank, or a loopback group on one GPU).
"""

from __future__ import annotations

import random

import torch

from .. import reference
from ..config import LayerConfig, Sm90FusedConfig
from .dispatch_checks import LAYER_TOLERANCE
from .ranks import Ranks, init_rank_process, make_call
from .spawn import record_failure, spawn_ranks

ROUTINGS = ("random", "masked", "one_expert", "skewed")
#: The fused layer's configuration in these checks: its experiments allowed (groups of several
#: GPUs, MXFP4 weights), every kernel setting the heuristics'
EXPERIMENTS = LayerConfig(experimental_fused_multi_gpu=True, experimental_fused_fp4=True)


def rows_config(row_transfer: str | None) -> LayerConfig:
    """`EXPERIMENTS` with the fused kernel's row transfer ``row_transfer`` (None: its
    default)."""
    return LayerConfig(experimental_fused_multi_gpu=True, experimental_fused_fp4=True,
                       fused_kernel=Sm90FusedConfig(row_transfer=row_transfer))


class FusedLayer:
    """Per-rank weights (random BF16 masters, quantized per recipe) and the two layers."""

    def __init__(self, ranks: Ranks, seed: int = 0, activation_clamp: float = 10.0,
                 configs: dict | None = None, fused_tiled: bool = False,
                 staged_ranks: Ranks | None = None):
        from ..expert_gemm import ExpertWeights

        self.ranks = ranks
        # the buffers the staged oracle runs on (default ``ranks``'): whole-pool buffers of the
        # same group where ``ranks``' keep rings (`MegaMoELayout.received_rows`,
        # `l1_output_rows`), which the staged kernels refuse
        self.staged_ranks = staged_ranks or ranks
        if [b.rank for b in self.staged_ranks.buffers] != [b.rank for b in ranks.buffers]:
            raise ValueError("staged_ranks: the same ranks as ranks")
        # per rank: the fused layer's configuration (`rows_config`; default `EXPERIMENTS`)
        self.configs = configs or {}
        layout = ranks.layout
        self.clamp = activation_clamp
        e_l, h, inter = layout.num_local_experts, layout.hidden, layout.intermediate_hidden
        device = ranks.buffers[0].device
        self.device = device
        gen = torch.Generator().manual_seed(seed + 11)
        self.w1s = [(torch.randn(e_l, 2 * inter, h, generator=gen) / h**0.5)
                    .to(torch.bfloat16).to(device) for _ in range(layout.num_ranks)]
        self.w2s = [(torch.randn(e_l, h, inter, generator=gen) / inter**0.5)
                    .to(torch.bfloat16).to(device) for _ in range(layout.num_ranks)]
        self.weights = {buf.rank: ExpertWeights.from_bf16(self.w1s[buf.rank],
                                                          self.w2s[buf.rank], layout.recipe)
                        for buf in ranks.buffers}
        # `fused_tiled`: the fused layer reads the weights in TMA-box order
        # (`ExpertWeights.tiled_copy`), the staged oracle the plain ones
        self.fused_weights = {r: w.tiled_copy() if fused_tiled else w
                              for r, w in self.weights.items()}
        self.stats = {buf.rank: {kind: torch.zeros(e_l, dtype=torch.int32, device=device)
                                 for kind in ("fused", "staged")} for buf in ranks.buffers}

    def inputs(self, tokens: tuple[int, ...], routing: str, seed: int):
        xs, idxs, ws = make_call(self.ranks.layout, tokens, routing, seed)
        return xs, idxs, ws, {buf.rank: tuple(t[buf.rank].to(self.device) for t in (xs, idxs, ws))
                              for buf in self.ranks.buffers}

    def run(self, kind: str | dict, inputs: dict, block_ms: dict, ys: dict,
            stats: str | None = None, validate_routing: str | bool = False) -> None:
        """Every local rank's layer call (`kind` "fused" or "staged", or per rank a dict of
        them) into ``ys[rank]``, counting into the ranks' ``stats`` statistics ("fused" or
        "staged"; default: `kind`'s), with the rank's configuration (`config`: its
        ``fused_kernel`` for the fused layer, its ``gemm`` for the staged one) and
        ``validate_routing`` (`checks.routing_check`; default "off": the checks compare
        layers, `check_bad_routing` the routing check)."""
        from .. import fused, staged

        kinds = kind if isinstance(kind, dict) else {b.rank: kind for b in self.ranks.buffers}
        ranks = self.ranks
        if set(kinds.values()) == {"staged"}:
            ranks = self.staged_ranks
        elif "staged" in kinds.values() and self.staged_ranks is not self.ranks:
            raise ValueError("a call mixing the layers runs on one group of buffers: not with "
                             "staged_ranks")

        def step(buf):
            x, idx, w = inputs[buf.rank]
            kind = kinds[buf.rank]
            kwargs = dict(y=ys[buf.rank], activation_clamp=self.clamp,
                          block_m=block_ms[buf.rank], validate_routing=validate_routing,
                          cumulative_local_expert_recv_stats=self.stats[buf.rank][stats or kind],
                          config=self.config(buf.rank))
            if kind == "fused":
                fused.fused_mega_moe(buf, x, idx, w, self.fused_weights[buf.rank], **kwargs)
            else:
                staged.staged_mega_moe(buf, x, idx, w, self.weights[buf.rank], **kwargs)

        try:
            ranks.run(step)
        except Exception as error:
            # an earlier call's failed kernel surfaces at a later launch (torch's or the CuTe
            # DSL's CUDA error): name it with the reports, as `synchronize` does
            if "launchfailure" not in str(error).lower().replace(" ", ""):
                raise
            self.fail_with_reports(f"{kind} calls (an earlier call failed)", error)

    def config(self, rank: int) -> LayerConfig:
        """The fused layer's configuration on ``rank``."""
        return self.configs.get(rank, EXPERIMENTS)

    def synchronize(self, what: str) -> None:
        """Wait for the calls; a failed kernel raises naming the call (``what``) and every
        rank's stall or disagreement report (`SymmBuffer.report`), which torch's error alone
        does not show."""
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as error:  # (torch.AcceleratorError is one)
            self.fail_with_reports(what, error)

    def fail_with_reports(self, what: str, error: Exception) -> None:
        """Raise an AssertionError naming ``what``, ``error`` and every rank's report."""
        reports = [f"rank {b.rank}: {b.report()}" for b in self.ranks.buffers]
        raise AssertionError(f"{what}: the calls failed ({error}); reports: "
                             f"{'; '.join(reports)}") from error

    def warm_up(self, block_ms: tuple[int, ...]) -> None:
        """Load every kernel a later call uses with every rank using it (see `Ranks`: a
        kernel's first launch waits for the running ones, so the staged layer warms up in
        phases, every rank's dispatch before anyone's GEMMs; the fused layer is one launch).
        The staged layer's kernels also follow the call's token count (MXFP4 GEMMs run
        transposed at few tokens per expert), so each BLOCK_M warms up at every count of
        `heuristics.warm_up_token_counts`: a kernel first loaded in a later call deadlocked
        that call's loopback group until the spin limit (docs/performance.md, 12-04)."""
        from .. import staged
        from ..heuristics import warm_up_token_counts

        r = self.ranks.layout.num_ranks
        counts = warm_up_token_counts(self.ranks.layout.num_max_tokens_per_rank)
        for block_m in block_ms:
            for n in counts:
                self._warm_up_call(staged, (n,) * r, block_m)
        for per_rank in self.stats.values():
            for t in per_rank.values():
                t.zero_()

    def _warm_up_call(self, staged, tokens: tuple[int, ...], block_m: int) -> None:
        """One phased staged call and one fused call of ``tokens`` per rank at ``block_m``."""
        _, _, _, inputs = self.inputs(tokens, "random", block_m + sum(tokens))
        oracle = self.staged_ranks
        results = dict(zip(
            [b.rank for b in oracle.buffers],
            oracle.run(lambda buf: staged.dispatch(
                buf, *inputs[buf.rank], block_m=block_m, validate_routing=False,
                cumulative_local_expert_recv_stats=self.stats[buf.rank]["staged"])),
            strict=True))
        oracle.run(lambda buf: staged.kernel_experts(
            buf, results[buf.rank], self.weights[buf.rank], self.clamp, send_to_combine=True,
            config=self.config(buf.rank)))
        oracle.run(lambda buf: staged.combine(buf, None, results[buf.rank]))
        ys = {b.rank: torch.empty(tokens[b.rank], self.ranks.layout.hidden,
                                  dtype=torch.bfloat16, device=self.device)
              for b in self.ranks.buffers}
        # ranks that differ in their fused configuration (each rank's walk is its own) each
        # warm up with every rank on it: a rank after the first may not compile
        configs = self.configs
        distinct = []
        for rank in sorted(b.rank for b in self.ranks.buffers):
            if self.config(rank) not in distinct:
                distinct.append(self.config(rank))
        try:
            for config in distinct:
                self.configs = {b.rank: config for b in self.ranks.buffers}
                self.run("fused", inputs, {b.rank: block_m for b in self.ranks.buffers}, ys)
                self.synchronize(f"warm-up, {tokens[0]}-token calls, block_m {block_m}")
        finally:
            self.configs = configs

    def check_call(self, tokens: tuple[int, ...], routing: str, block_ms: dict, seed: int,
                   against_reference: bool = True, fused_ranks: set | None = None) -> None:
        """One call of both layers on the same inputs (`check_calls`)."""
        self.check_calls([(tokens, routing, block_ms, seed)], against_reference, fused_ranks)

    def check_calls(self, calls: list, against_reference: bool = True,
                    fused_ranks: set | None = None) -> None:
        """Calls of both layers on the same inputs, ``calls`` a list of (tokens per rank,
        routing, BLOCK_M per rank, seed): the staged layer's back to back, a wait, then the
        fused layer's back to back (no host wait between two calls, as a server makes them), a
        wait. Per call: `y` equal, every row written, `y` near the reference; the stats the
        calls add equal. ``fused_ranks``: the ranks that run the fused layer in the "fused"
        calls (default all; the others run the staged one there too)."""
        layout = self.ranks.layout
        mixed = {b.rank: "fused" if fused_ranks is None or b.rank in fused_ranks else "staged"
                 for b in self.ranks.buffers}
        made = []
        for tokens, routing, block_ms, seed in calls:
            xs, idxs, ws, inputs = self.inputs(tokens, routing, seed)
            ys = {kind: {b.rank: torch.full((tokens[b.rank], layout.hidden), float("nan"),
                                            dtype=torch.bfloat16, device=self.device)
                         for b in self.ranks.buffers} for kind in ("fused", "staged")}
            what = f"tokens {tokens}, {routing}, block_m {block_ms}, seed {seed}"
            made.append((what, (xs, idxs, ws), inputs, block_ms, ys))
        whats = "; ".join(m[0] for m in made)
        # (the counts these calls add: earlier calls of one layer alone, `check_bad_routing`'s,
        # made the running totals differ)
        before = {r: {k: t.clone() for k, t in s.items()} for r, s in self.stats.items()}
        # (a wait between the layers, so that a failure names its layer)
        for _, _, inputs, block_ms, ys in made:
            self.run("staged", inputs, block_ms, ys["staged"])
        self.synchronize(f"{whats}, the staged layer")
        for _, _, inputs, block_ms, ys in made:
            self.run(mixed, inputs, block_ms, ys["fused"], stats="fused")
        self.synchronize(f"{whats}, the fused layer")
        # every comparison on the device, one wait for all of them: a host wait per check
        # was most of a soak's time with other processes on the GPU (each waits for a slice)
        checks = []  # (what fails, how many elements it fails in)
        for what, _, _, _, ys in made:
            for buf in self.ranks.buffers:
                got, want = ys["fused"][buf.rank], ys["staged"][buf.rank]
                checks.append((f"{what}: rank {buf.rank}: rows not written",
                               got.isnan().sum()))
                checks.append((f"{what}: rank {buf.rank}: fused y differs from the staged "
                               "layer's", (got.view(torch.int16) != want.view(torch.int16)).sum()))
        for buf in self.ranks.buffers:
            added = {k: t - before[buf.rank][k] for k, t in self.stats[buf.rank].items()}
            checks.append((f"{whats}: rank {buf.rank}: stats differ",
                           (added["fused"] != added["staged"]).sum()))
        counts = torch.stack([count for _, count in checks]).tolist()
        for (message, _), count in zip(checks, counts, strict=True):
            assert count == 0, f"{message} ({count} elements)"
        if against_reference:
            for what, host_inputs, _, _, ys in made:
                self._check_against_reference(what, host_inputs, ys["fused"])

    def _check_against_reference(self, what: str, host_inputs, ys: dict) -> None:
        """Every rank's ``ys`` near `reference.mega_moe_reference` of ``host_inputs``."""
        layout = self.ranks.layout
        # on the device that quantized the kernels' weights: fp8xfp8's weight scales divide
        # differently on the CPU (`reference`, step 2), and that alone moved y 1-2.3 % from
        # the kernels' (a 1-token rank over the tolerance, 2026-12-04)
        ref = reference.mega_moe_reference(
            *([t.to(self.device) for t in ts] for ts in host_inputs), self.w1s, self.w2s,
            recipe=layout.recipe, activation_clamp=self.clamp)
        for buf in self.ranks.buffers:
            y, want = ys[buf.rank].float(), ref.y[buf.rank].float()
            if want.numel() == 0 or float(want.norm()) == 0.0:
                assert bool((y == want).all()), f"{what}: rank {buf.rank}: expected zeros"
                continue
            err = float((y - want).norm() / want.norm())
            assert err < LAYER_TOLERANCE[layout.recipe], \
                f"{what}: rank {buf.rank}: rel. error {err:.3g} against the reference"


#: the bad slots `check_bad_routing` puts into a routing: (token, slot, value) from the
#: token count ``n``, the experts ``E`` and the routing's row ``row`` of that token
BAD_SLOTS = {
    "out_of_range": lambda n, e, row: (n // 2, row.numel() - 1, e + 3),
    "negative": lambda n, e, row: (0, 1, -5),
    "duplicate": lambda n, e, row: (n - 1, 2, int(row[0])),
}


def check_bad_routing(layer: FusedLayer, kind: str, tokens: tuple[int, ...], block_m: int,
                      seed: int) -> None:
    """The device routing check (`kernels/common/routing.py`) through ``kind``'s layer
    ("fused" or "staged"), every rank of the group at once: per case of `BAD_SLOTS`, and
    then all of them in one call, every rank with ``n > 2`` tokens gets bad slots. The call
    (routing check "off": nothing raised) must give bit for bit the `y` of the same routing
    with those slots masked, every row written; `SymmBuffer.check_routing_errors` must raise
    naming each such rank's first bad slot and their count (the others' raise nothing); and
    with the default check, the next clean call must raise it after its launch, and that call
    and the one after must equal the staged layer (`check_call`, against the reference)."""
    layout = layer.ranks.layout
    hidden, experts = layout.hidden, layout.num_experts
    block_ms = {b.rank: block_m for b in layer.ranks.buffers}
    cases = [[name] for name in BAD_SLOTS] + [list(BAD_SLOTS)]
    for i, names in enumerate(cases):
        _, _, _, inputs = layer.inputs(tokens, "random", seed + i)
        bad_inputs, masked_inputs, expected = {}, {}, {}
        for buf in layer.ranks.buffers:
            x, idx, w = inputs[buf.rank]
            bad, masked = idx.clone(), idx.clone()
            slots = []
            if x.shape[0] > 2:
                for name in names:
                    t, k, value = BAD_SLOTS[name](x.shape[0], experts, idx[x.shape[0] - 1])
                    bad[t, k], masked[t, k] = value, -1
                    slots.append((t * layout.num_topk + k, t, k, value))
                expected[buf.rank] = (min(slots), len(slots))
            bad_inputs[buf.rank], masked_inputs[buf.rank] = (x, bad, w), (x, masked, w)
        ys = {which: {b.rank: torch.full((tokens[b.rank], hidden), float("nan"),
                                         dtype=torch.bfloat16, device=layer.device)
                      for b in layer.ranks.buffers} for which in ("bad", "masked")}
        what = f"{kind}, tokens {tokens}, bad slots {names}, block_m {block_m}"
        layer.run(kind, bad_inputs, block_ms, ys["bad"])
        layer.run(kind, masked_inputs, block_ms, ys["masked"])
        layer.synchronize(what)
        for buf in layer.ranks.buffers:
            got, want = ys["bad"][buf.rank], ys["masked"][buf.rank]
            assert not bool(got.isnan().any()), f"{what}: rank {buf.rank}: rows not written"
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                f"{what}: rank {buf.rank}: y differs from the masked routing's"
        for buf in layer.ranks.buffers:
            _expect_routing_error(buf.check_routing_errors, expected.get(buf.rank), what)
        # the default check: the next call raises it after its launch (which ran)
        layer.run(kind, bad_inputs, block_ms, ys["bad"])
        layer.synchronize(what)
        clean = {b.rank: torch.full((tokens[b.rank], hidden), float("nan"),
                                    dtype=torch.bfloat16, device=layer.device)
                 for b in layer.ranks.buffers}
        if layout.num_ranks == 1:
            _expect_routing_error(
                lambda inputs=masked_inputs, ys=clean: layer.run(
                    kind, inputs, block_ms, ys, validate_routing="device"),
                expected.get(0), what)
        else:  # (in one process the ranks' calls run in turn: none may stop before the last)
            layer.run(kind, masked_inputs, block_ms, clean)
            for buf in layer.ranks.buffers:
                _expect_routing_error(buf.raise_routing_error, expected.get(buf.rank), what)
        layer.synchronize(what)
        for buf in layer.ranks.buffers:
            assert torch.equal(clean[buf.rank].view(torch.int16),
                               ys["masked"][buf.rank].view(torch.int16)), \
                f"{what}: rank {buf.rank}: the call that raised gave another y"
        layer.check_call(tokens, "masked", block_ms, seed + 100 + i)


def _expect_routing_error(call, expected, what: str) -> None:
    """``call()`` raises the routing error ``expected`` (``((pair, token, slot, value),
    count)``), or nothing when None."""
    try:
        call()
    except ValueError as error:
        message = str(error)
        assert expected is not None, f"{what}: unexpected {message}"
        (_, token, slot, value), count = expected
        assert f"token {token} slot {slot} " in message, f"{what}: {message}"
        assert (f"names expert {value} again" in message
                or f"holds expert index {value}," in message), f"{what}: {message}"
        assert (f"{count} bad slots in all" in message) == (count > 1), f"{what}: {message}"
        return
    assert expected is None, f"{what}: no routing error raised, expected {expected}"


def check_fused_calls(layer: FusedLayer, num_calls: int, max_tokens: int, seed: int = 0,
                      block_ms: tuple[int, ...] = (64, 128), reference_every: int = 10) -> None:
    """`num_calls` back-to-back calls with random token counts per rank (0 and 1 included),
    routings and per-rank BLOCK_M, each checked against the staged layer."""
    rng = random.Random(seed)
    r = layer.ranks.layout.num_ranks
    for call in range(num_calls):
        tokens = tuple(rng.choice((0, 1, rng.randint(0, max_tokens), max_tokens))
                       for _ in range(r))
        # (drawn for every rank of the group, so that all processes draw alike)
        drawn = [rng.choice(block_ms) for _ in range(r)]
        chosen = {b.rank: drawn[b.rank] for b in layer.ranks.buffers}
        layer.check_call(tokens, ROUTINGS[call % len(ROUTINGS)], chosen, seed * 7919 + call,
                         against_reference=call % reference_every == 0)


def check_fused_graph(layer: FusedLayer, tokens: int, num_replays: int, seed: int = 0) -> None:
    """One rank (R = 1): the fused call captured in a CUDA graph, replayed `num_replays` times
    with new inputs copied in between, each replay equal to an eager staged call."""
    from .. import fused, staged

    (buf,) = layer.ranks.buffers
    layout = buf.layout
    weights = layer.weights[buf.rank]
    _, _, _, inputs = layer.inputs((tokens,), "random", seed)
    x, idx, w = (t.clone() for t in inputs[buf.rank])
    y = torch.empty(tokens, layout.hidden, dtype=torch.bfloat16, device=layer.device)

    def call():
        fused.fused_mega_moe(buf, x, idx, w, weights, y=y, activation_clamp=layer.clamp,
                             validate_routing=False, config=layer.config(buf.rank))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for replay in range(num_replays):
        _, _, _, new = layer.inputs((tokens,), ROUTINGS[replay % len(ROUTINGS)],
                                    seed * 131 + replay)
        for dst, src in zip((x, idx, w), new[buf.rank], strict=True):
            dst.copy_(src)
        y.fill_(float("nan"))
        graph.replay()
        want = staged.staged_mega_moe(buf, x, idx, w, weights, activation_clamp=layer.clamp,
                                      validate_routing=False)
        layer.synchronize(f"replay {replay}")
        assert not bool(y.isnan().any()), f"replay {replay}: rows not written"
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), \
            f"replay {replay}: graph replay differs from the staged layer"


# ----------------------------------------------------------------------------- one GPU per rank

def _worker(rank: int, num_ranks: int, port: int, recipe: str, num_calls: int) -> None:
    import torch.distributed as dist

    from ..buffer import get_symm_buffer_for_mega_moe

    init_rank_process(rank, num_ranks, port)
    try:
        with record_failure(rank):
            buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, 16 * num_ranks, 256, 4, 512, 256,
                                               mma_type=recipe)
            layer = FusedLayer(Ranks([buf], [torch.cuda.Stream()]))
            layer.warm_up((64, 128))
            layer.check_call(tuple(256 if r == 0 else 0 for r in range(num_ranks)), "random",
                             {rank: 128 if rank == 0 else 64}, seed=1)
            check_fused_calls(layer, num_calls, 256, seed=7)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_multiprocess(num_ranks: int, recipe: str, num_calls: int, port: int = 29957) -> None:
    """`check_fused_calls` with one process per GPU (needs `num_ranks` GPUs); every process
    draws the same calls from the seed (its own rank's inputs and BLOCK_M)."""
    spawn_ranks(_worker, num_ranks, num_ranks, port, recipe, num_calls)


def check_tile_walk(layer: FusedLayer, tokens: int, routing: str, block_m: int,
                    seed: int = 0) -> int:
    """One rank (R = 1): the fused kernel built with its tile log runs one call; every CTA's
    tiles, in order, must be `scheduler.host_model.fused_tile_walk` of the received counts.
    Returns the number of tiles checked."""
    from ..heuristics import default_fused_config
    from ..kernels.sm90_mega_moe import Sm90MegaMoEKernel
    from ..launch import buffer_state, fused_call
    from ..scheduler import fused_tile_walk
    from ..staged import stage_inputs

    (buf,) = layer.ranks.buffers
    layout = buf.layout
    _, _, _, inputs = layer.inputs((tokens,), routing, seed)
    stage_inputs(buf, *inputs[buf.rank], validate_routing=False)
    state = buffer_state(buf)
    grid = state.num_sms
    # (the caller staged x: the kernel as a call with x=None builds it, with the tile log)
    config = default_fused_config(layout, block_m, False, Sm90FusedConfig(debug="tile_log"))
    kernel = Sm90MegaMoEKernel(layout, config)  # (host side only: the raster groups)
    n1, n2 = 2 * layout.intermediate_hidden, layout.hidden
    max_tiles = (layout.num_pool_rows // block_m) * (n1 + n2) // kernel.l1.block_n
    log = torch.full(((max_tiles + grid - 1) // grid + 1, grid, 4), -1, dtype=torch.int32,
                     device=layer.device)
    y = torch.empty(tokens, layout.hidden, dtype=torch.bfloat16, device=layer.device)
    fused_call(buf, layer.weights[buf.rank], tokens, y, grid, None, layer.clamp, True, config,
               debug=log)()
    torch.cuda.synchronize(layer.device)
    counts = state.recv_tokens.cpu().tolist()
    log = log.cpu()
    checked = 0
    for cta in range(grid):
        want = [(1 if phase == "l1" else 2, t.pool_block, t.n_block, t.valid_m)
                for phase, t in fused_tile_walk(counts, block_m, kernel.l1.block_n, n1,
                                                kernel.l2.block_n, n2, grid, cta,
                                                (kernel.l1.raster_group,
                                                 kernel.l2.raster_group))]
        got = [tuple(row) for row in log[:, cta].tolist() if row[0] != -1]
        assert got == want, f"CTA {cta}: device walk {got[:6]}... != host model {want[:6]}..."
        assert bool((log[len(want):, cta] == -1).all()), f"CTA {cta}: tiles past its walk"
        checked += len(want)
    return checked
