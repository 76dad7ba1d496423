"""Weight preparation at model scale: peak extra device memory and time (issue 62).

    python -m bench.weights                                   # the issue's rows
    python -m bench.weights --shape 192 7168 3072 --recipes fp8xfp8 --methods from_bf16

Per (experts, hidden, intermediate, recipe, method): the sources on the GPU (BF16 masters
``[E, 2I, H]`` / ``[E, H, I]``, normal with std 1/sqrt(K), filled in place: no float32 copy;
for ``from_fp8_blocks`` e4m3 gate / up / down weights with float32 block scales, as a
checkpoint holds them), then the preparation, synchronized and timed:

* ``from_bf16``: `ExpertWeights.from_bf16(w1, w2, recipe)`;
* ``torch_from_bf16``: `staged.TorchExpertWeights.from_bf16(w1, w2, recipe)` (the torch
  experts' BF16 weights);
* ``from_fp8_blocks``: `ExpertWeights.from_fp8_blocks(...)` (fp8xfp8 only).

``peak_extra_bytes`` = `torch.cuda.max_memory_allocated` during the preparation minus what was
allocated before it (the sources) minus the output's bytes (its tensors' storages);
``within_bound``: ``peak_extra_bytes <= 0.25 * output_bytes + 2 GiB``. Sources and output are
freed between rows. The JSON goes to ``bench/results/weights-<stamp>.json`` (or
``CUTE_MEGAMOE_RESULTS_DIR``), ``gpu`` in each row and in ``meta``.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from bench.common import Results

#: The issue's rows: a DeepSeek-V4-Pro-like rank (192 experts, H 7168, I 3072) in fp8xfp8 and
#: fp8xfp4_sm90, and a DeepSeek-V3 rank (128 experts, H 7168, I 2048) in fp8xfp8.
ISSUE_ROWS = (((192, 7168, 3072), "fp8xfp8", "from_bf16"),
              ((192, 7168, 3072), "fp8xfp4_sm90", "from_bf16"),
              ((128, 7168, 2048), "fp8xfp8", "from_bf16"))
#: Also by default: the issue's other out-of-memory (the torch experts' MXFP4 weights of a V3
#: rank) and a V3 rank's FP8 checkpoint as published.
EXTRA_ROWS = (((128, 7168, 2048), "fp8xfp4_sm90", "torch_from_bf16"),
              ((128, 7168, 2048), "fp8xfp8", "from_fp8_blocks"))
METHODS = ("from_bf16", "torch_from_bf16", "from_fp8_blocks")
GIB = 1 << 30


def _bf16_masters(experts: int, hidden: int, inter: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        w = torch.empty(experts, n, k, dtype=torch.bfloat16, device="cuda")
        out.append(w.normal_(0.0, k**-0.5, generator=gen))
    return tuple(out)


def _fp8_blocks(experts: int, hidden: int, inter: int, seed: int):
    """gate, gate_scale, up, up_scale, down, down_scale as a checkpoint holds them (e4m3 codes
    of unit normals, scales 1e-3 .. 2e-3: not powers of two), filled expert by expert."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        w = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device="cuda")
        for e in range(experts):
            w[e] = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        scale = torch.rand(experts, n // 128, k // 128, generator=gen, device="cuda") * 1e-3
        out += [w, scale + 1e-3]
    return tuple(out)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def measure(experts: int, hidden: int, inter: int, recipe: str, method: str,
            seed: int = 0) -> dict:
    """One row (see the module doc)."""
    from cute_megamoe.expert_gemm import _TENSOR_FIELDS, ExpertWeights
    from cute_megamoe.staged import TorchExpertWeights

    if method == "from_fp8_blocks":
        if recipe != "fp8xfp8":
            raise ValueError("from_fp8_blocks builds fp8xfp8 weights")
        sources = _fp8_blocks(experts, hidden, inter, seed)
        prepare, args = ExpertWeights.from_fp8_blocks, sources
    else:
        sources = _bf16_masters(experts, hidden, inter, seed)
        kind = ExpertWeights if method == "from_bf16" else TorchExpertWeights
        prepare, args = kind.from_bf16, (*sources, recipe)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = prepare(*args)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    fields = (_TENSOR_FIELDS if isinstance(out, ExpertWeights) else ("w1", "w2"))
    output_bytes = _storage_bytes(getattr(out, name) for name in fields)
    source_bytes = _storage_bytes(sources)
    extra = peak - before - output_bytes
    row = dict(experts=experts, hidden=hidden, intermediate=inter, recipe=recipe,
               method=method, output_bytes=output_bytes, peak_extra_bytes=extra,
               seconds=seconds, gpu=torch.cuda.get_device_name(),
               source_bytes=source_bytes, bound_bytes=int(0.25 * output_bytes + 2 * GIB),
               within_bound=extra <= 0.25 * output_bytes + 2 * GIB,
               peak_allocated_bytes=peak,
               total_memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    return row  # (the sources and the output go with this frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, action="append",
                        metavar=("EXPERTS", "HIDDEN", "INTERMEDIATE"),
                        help="a rank's shape (repeatable); default: the issue's rows")
    parser.add_argument("--recipes", nargs="+", default=["fp8xfp8"])
    parser.add_argument("--methods", nargs="+", default=["from_bf16"], choices=METHODS)
    parser.add_argument("--no-extra", action="store_true",
                        help="without --shape: only the issue's three rows")
    args = parser.parse_args()
    if args.shape:
        plan = [(tuple(s), r, m) for s in args.shape for r in args.recipes for m in args.methods
                if m != "from_fp8_blocks" or r == "fp8xfp8"]
    else:
        plan = list(ISSUE_ROWS) + ([] if args.no_extra else list(EXTRA_ROWS))
    results = Results("weights")
    for (experts, hidden, inter), recipe, method in plan:
        try:
            row = measure(experts, hidden, inter, recipe, method)
        except torch.cuda.OutOfMemoryError as error:
            row = dict(experts=experts, hidden=hidden, intermediate=inter, recipe=recipe,
                       method=method, gpu=torch.cuda.get_device_name(),
                       error=str(error).splitlines()[0][:300])
            gc.collect()
            torch.cuda.empty_cache()
        results.add(**row)
        gc.collect()
        torch.cuda.empty_cache()
        print({k: (f"{v / GIB:.2f} GiB" if k.endswith("_bytes") else v) for k, v in row.items()},
              flush=True)
    print(results.table(["experts", "hidden", "intermediate", "recipe", "method",
                         "output_bytes", "peak_extra_bytes", "bound_bytes", "within_bound",
                         "seconds"]))
    print(results.save())


if __name__ == "__main__":
    main()
