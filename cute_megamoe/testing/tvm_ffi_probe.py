"""Every launcher's kernel on the TVM-FFI launch path, compiled for sm_90a without a GPU and
called with the arguments the launcher built: prints one JSON line, per launch, with what the
call did (tests/test_launch_path.py reads it).

    CUTE_DSL_ARCH=sm_90a CUDA_VISIBLE_DEVICES= CUTE_MEGAMOE_TVM_FFI=1 \\
        python -m cute_megamoe.testing.tvm_ffi_probe

``CUTE_DSL_ARCH`` must name the target before CuTe DSL is imported: only then does the DSL
build the host JIT engine that a TVM-FFI function lives in (a cross-compile gets none). The
buffer and the weights live on the CPU; the arch, SM count and stream are stubbed. A call
gets through the TVM-FFI stub's argument checks and stops where it needs the GPU (loading the
module: a CUDA runtime error), so nothing is launched.
"""

from __future__ import annotations

import json

import torch


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as exc:  # what the stub said
        return f"{type(exc).__name__}: {exc}"[:600]
    return "returned"


def main() -> None:
    from cuda.bindings import driver

    from .. import launch, runtime

    if not runtime.launch_path().tvm_ffi:
        raise SystemExit("set CUTE_MEGAMOE_TVM_FFI=1")
    launch.get_arch = lambda *args: "sm_90a"
    launch.get_num_sms = lambda *args: 132
    runtime.current_raw_stream = lambda: 0
    runtime.current_stream = lambda: driver.CUstream(0)

    report = {}
    for recipe in ("fp8xfp8", "bf16xbf16"):
        report.update({f"{recipe}/{name}": r for name, r in _probe(recipe).items()})
    print(json.dumps(report))


def _probe(recipe: str) -> dict:
    import tvm_ffi

    from .. import launch
    from ..buffer import get_symm_buffer_for_mega_moe
    from ..expert_gemm import ExpertWeights, expert_ffn_configs

    e, t, k, h, i = 8, 64, 4, 512, 256
    buf = get_symm_buffer_for_mega_moe(None, e, t, k, h, i, mma_type=recipe, device="cpu")
    gen = torch.Generator().manual_seed(0)
    weights = ExpertWeights.from_bf16(
        torch.randn(e, 2 * i, h, generator=gen).to(torch.bfloat16),
        torch.randn(e, h, i, generator=gen).to(torch.bfloat16), recipe, arch="sm_90a")
    fp8 = recipe != "bf16xbf16"
    n = 3
    x = torch.zeros(n, h, dtype=torch.bfloat16)
    idx = torch.zeros(n, k, dtype=torch.int64)
    w = torch.zeros(n, k)
    y = torch.zeros(n, h, dtype=torch.bfloat16)
    stats = torch.zeros(e, dtype=torch.int32)
    out = torch.zeros(buf.layout.num_pool_rows, h, dtype=torch.bfloat16)
    recv = launch.buffer_state(buf).recv_tokens

    def gemms(out, combine_buffer):
        configs = expert_ffn_configs("sm_90a", recipe, 64, h, i, None,
                                     combine_buffer is not None, None)
        return launch.expert_gemm_calls(
            "sm_90a", recipe, 132, weights, buf.l1_acts, buf.l1_acts_sf if fp8 else None,
            buf.l1_topk_weights, recv, buf.l2_acts, buf.l2_acts_sf if fp8 else None, out,
            10.0, True, combine_buffer, configs)

    l1, l2 = gemms(out=out, combine_buffer=None)
    calls = {
        "staging": (launch.staging_call(buf, x, idx, w), launch.STAGING_SLOTS),
        "dispatch": (launch.dispatch_call(buf, n, 64, 132, None, "push"),
                     launch.DISPATCH_SLOTS),
        "dispatch+stats": (launch.dispatch_call(buf, n, 64, 132, stats, "pull"),
                           launch.DISPATCH_SLOTS),
        "combine": (launch.combine_call(buf, n, 64, out, recv, y, 132, "registers", (8,)),
                    launch.COMBINE_SLOTS),
        "combine-epilogue": (launch.combine_call(buf, n, 64, None, recv, y, 132, "epilogue",
                                                 (8,)), launch.COMBINE_SLOTS),
        "l1": (l1, launch.GEMM_SLOTS),
        "l2": (l2, launch.GEMM_SLOTS),
        "l2-to-combine": (gemms(out=None, combine_buffer=buf)[1], launch.GEMM_SLOTS),
    }
    report = {}
    for name, (call, slots) in calls.items():
        prepared = call.prepare(slots)
        values = [call.args[s] for s in slots]
        report[name] = {
            "raw_is_tvm_ffi_function": type(call.fn) is tvm_ffi.Function,
            "all_int_args": all(type(a) is int for a in call.args),
            "call": _outcome(call),
            "prepared_call": _outcome(lambda prepared=prepared, values=values: prepared(*values)),
            "too_few": _outcome(lambda call=call: call.fn(*call.args[:-1])),
            "float_for_pointer": _outcome(lambda call=call: call.fn(1.5, *call.args[1:])),
            "float_for_stream": _outcome(lambda call=call: call.fn(*call.args[:-1], 1.5)),
        }
    return report


if __name__ == "__main__":
    main()
