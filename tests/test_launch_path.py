"""The launch paths and the layer's hot path (CPU; what they cost is `bench/host_overhead.py`'s).

* Structure (CPU, no compile): `staged.staged_mega_moe` on our kernels keeps the launches of a
  configuration as a plan on the buffer; a later call runs its checks, fills in only what
  changes (inputs' and ``y``'s addresses, the token count, the stream) and launches: no
  compiled-kernel lookup, no pointer building for the buffer or the weights, the same
  arguments the full path builds. Checked on both launch paths with a fake CUDA environment
  (the "must be on CUDA" checks, arch, SM count and stream stubbed; kernels recorded instead
  of compiled). A wrong input still raises before any launch and gives the call up.
* TVM-FFI (``compile``): every launcher's kernel compiles with ``--enable-tvm-ffi`` for sm_90a,
  yields a raw positional ``tvm_ffi.Function``, and its C stub accepts the arguments in the
  form the launchers build (ints for pointers, ``Int32`` and the stream) up to the point where
  it needs a GPU (loading the module: a CUDA runtime error), in a subprocess whose
  ``CUTE_DSL_ARCH=sm_90a`` lets the DSL build the host JIT engine without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_megamoe import expert_gemm, launch, runtime, staged
from cute_megamoe.buffer import get_symm_buffer_for_mega_moe
from cute_megamoe.config import LayerConfig, Sm90FusedConfig, Sm90GemmConfig
from cute_megamoe.expert_gemm import ExpertWeights
from cute_megamoe.layout import BarrierSlots
from cute_megamoe.testing.dispatch_checks import make_routing

E, T, K, H, INTER = 8, 64, 4, 256, 128
#: apache-tvm-ffi is a dependency, but a GPU machine may run the tests from a source tree
needs_tvm_ffi = pytest.mark.skipif(not runtime.tvm_ffi_available(),
                                   reason="apache-tvm-ffi does not import here")
PATHS = [pytest.param("tvm-ffi", marks=needs_tvm_ffi), "cute-dsl"]
KERNELS = ("InputStagingKernel", "DispatchKernel", "l1", "l2", "CombineKernel")


class _Recorder:
    """A "compiled kernel" that records its launches."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __call__(self, *args) -> None:
        self.log.append((self.name, args))


@pytest.fixture
def fake_cuda(monkeypatch):
    """The host layer on a CPU buffer as if on an sm_90a GPU: kernels recorded, not compiled.
    Yields counters of the compiles, compiled-kernel lookups and `cute.Pointer`s built."""
    counts = {"compile": 0, "compiled_kernel": 0, "as_ptr": 0}
    log: list = []

    def fake_compile(kernel, specs, arch, path):
        counts["compile"] += 1
        name = type(kernel).__name__
        return _Recorder(getattr(kernel, "phase", name) if "Gemm" in name else name, log)

    real_compiled_kernel, real_as_ptr = runtime.compiled_kernel, runtime.as_ptr

    def counting_compiled_kernel(key, build):
        counts["compiled_kernel"] += 1
        return real_compiled_kernel(key, build)

    def counting_as_ptr(*args, **kwargs):
        counts["as_ptr"] += 1
        return real_as_ptr(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staged, "check_cuda_buffer", lambda buf: buf.device)
    monkeypatch.setattr(expert_gemm, "check_cuda_device", lambda name, device: device)
    for module in (launch, expert_gemm):
        monkeypatch.setattr(module, "get_arch", lambda *args: "sm_90a")
    monkeypatch.setattr(launch, "get_num_sms", lambda *args: 132)
    monkeypatch.setattr(runtime, "current_raw_stream", lambda: 1234)
    monkeypatch.setattr(runtime, "current_stream", lambda: "stream-1234")
    monkeypatch.setattr(runtime, "_COMPILED", {})  # keep the recorders out of the real cache
    monkeypatch.setattr(runtime, "as_ptr", counting_as_ptr)
    monkeypatch.setattr(launch, "compiled_kernel", counting_compiled_kernel)
    monkeypatch.setattr(launch, "_compile", fake_compile)
    previous = runtime.launch_path().name
    yield counts, log
    runtime.set_launch_path(previous)


def _layer_inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    idx, w = make_routing(n, E, K, "random", gen)
    return torch.randn(n, H, generator=gen).to(torch.bfloat16), idx, w


def _buffer_and_weights(recipe: str = "fp8xfp8", arch: str = "sm_90a"):
    """A CPU buffer and `ExpertWeights` of the test shape, as if for ``arch``."""
    buf = get_symm_buffer_for_mega_moe(None, E, T, K, H, INTER, mma_type=recipe, device="cpu")
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(E, H, INTER, generator=gen).to(torch.bfloat16)
    return buf, ExpertWeights.from_bf16(w1, w2, recipe, arch=arch), (w1, w2)


def _address(arg) -> int:
    """The address a pointer argument carries on either path (an int on TVM-FFI, a
    `cute.Pointer` on the CuTe DSL path)."""
    return arg if isinstance(arg, int) else arg._pointer


def _value(arg) -> object:
    """A launch argument as something comparable: an address, an int, or the stream's text."""
    if isinstance(arg, int) or hasattr(arg, "_pointer"):
        return _address(arg)
    if isinstance(arg, str):  # the stubbed stream
        return arg
    return int(arg)  # cutlass.Int32


@pytest.mark.parametrize("path", PATHS)
def test_layer_calls_reuse_the_plan_and_fill_in_only_what_changes(fake_cuda, path,
                                                                    monkeypatch):
    counts, log = fake_cuda
    runtime.set_launch_path(path)
    buf = get_symm_buffer_for_mega_moe(None, E, T, K, H, INTER, mma_type="fp8xfp8",
                                       device="cpu")
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(E, H, INTER, generator=gen).to(torch.bfloat16)
    weights = ExpertWeights.from_bf16(w1, w2, "fp8xfp8", arch="sm_90a")

    def layer(n, seed, **kwargs):
        x, idx, w = _layer_inputs(n, seed)
        before = (dict(counts), len(log))
        y = staged.staged_mega_moe(buf, x, idx, w, weights, activation_clamp=10.0,
                                   validate_routing=False, **kwargs)
        spent = {k: counts[k] - before[0][k] for k in counts}
        return (x, idx, w, y), spent, log[before[1]:]

    first, spent, launched = layer(5, 1)
    assert [name for name, _ in launched] == list(KERNELS)
    assert spent["compile"] == 5
    assert len(launch.buffer_state(buf).plans) == 1
    # later calls: the plan, with the new inputs' addresses and token count
    for n, seed in ((5, 2), (7, 3)):
        (x, idx, w, y), spent, launched = layer(n, seed)
        assert [name for name, _ in launched] == list(KERNELS)
        assert spent["compile"] == 0 and spent["compiled_kernel"] == 0
        # pointers built per call: the four tensors of the call (x, topk_idx, topk_weights,
        # y) on the CuTe DSL path, none on TVM-FFI: never the buffer's or the weights'
        assert spent["as_ptr"] == (0 if path == "tvm-ffi" else 4)
        args = dict(launched)
        assert [_address(a) for a in args["InputStagingKernel"][:3]] == \
            [x.data_ptr(), idx.data_ptr(), w.data_ptr()]
        assert _address(args["CombineKernel"][launch.COMBINE_SLOTS[1]]) == y.data_ptr()
        for name, slot in (("InputStagingKernel", 7), ("DispatchKernel", 2),
                           ("CombineKernel", 2)):
            assert int(args[name][slot]) == n
        assert y.shape == (n, H) and y.dtype == torch.bfloat16
    assert len(launch.buffer_state(buf).plans) == 1  # 5 and 7 tokens: one configuration

    # the plan's launches are the full path's: drop the plans, repeat the last call
    fast = launched
    launch.buffer_state(buf).plans.clear()
    before = len(log)
    y2 = staged.staged_mega_moe(buf, x, idx, w, weights, activation_clamp=10.0,
                                validate_routing=False, y=y)
    assert y2 is y
    full = log[before:]
    assert [name for name, _ in full] == [name for name, _ in fast]
    for (name, a), (_, b) in zip(fast, full, strict=True):
        assert [_value(v) for v in a] == [_value(v) for v in b], name

    # a new configuration (another SiLU) builds a plan of its own, beside the y-given one
    _, spent, _ = layer(5, 4, fast_math=False)
    assert spent["compile"] == 2  # the GEMMs (both keyed by fast_math)
    assert len(launch.buffer_state(buf).plans) == 2
    # so does another configuration (here the staged mainloop where the heuristics pick the
    # transposed one): a plan keeps its kernels, a changed configuration must not reuse them
    staged_loop = LayerConfig(gemm=Sm90GemmConfig(transposed=False))
    _, spent, _ = layer(5, 5, config=staged_loop)
    assert spent["compile"] == 2  # the GEMMs with the other mainloop
    assert len(launch.buffer_state(buf).plans) == 3
    _, spent, _ = layer(5, 6, config=staged_loop)
    assert spent["compile"] == 0 and len(launch.buffer_state(buf).plans) == 3
    # (a configuration that resolves to the default's kernels builds none)
    _, spent, _ = layer(5, 7, config=LayerConfig(gemm=Sm90GemmConfig(promotion="chunk")))
    assert spent["compile"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_layer_checks_still_run_before_any_launch_with_a_plan(fake_cuda, path):
    """With a plan in place, a wrong input raises as without one, naming the argument, gives
    the call up once and launches nothing."""
    counts, log = fake_cuda
    runtime.set_launch_path(path)
    buf = get_symm_buffer_for_mega_moe(None, E, T, K, H, INTER, mma_type="bf16xbf16",
                                       device="cpu")
    gen = torch.Generator().manual_seed(5)
    weights = ExpertWeights.from_bf16(
        torch.randn(E, 2 * INTER, H, generator=gen).to(torch.bfloat16),
        torch.randn(E, H, INTER, generator=gen).to(torch.bfloat16), "bf16xbf16", arch="sm_90a")
    x, idx, w = _layer_inputs(6, 6)
    for _ in range(2):
        staged.staged_mega_moe(buf, x, idx, w, weights, validate_routing=False)
    assert len(launch.buffer_state(buf).plans) == 1
    tag = int(buf.barrier[BarrierSlots.CALL_TAG])
    y_wrong = torch.empty(6, H, dtype=torch.float32)
    cases = [
        (TypeError, "x: expected dtype", dict(x=x.float())),
        (ValueError, "topk_idx: expected shape", dict(topk_idx=idx[:, :2].contiguous())),
        (ValueError, "topk_weights: must be contiguous",
         dict(topk_weights=w.t().contiguous().t())),
        (ValueError, "x: 9999 tokens exceed", dict(x=torch.zeros(9999, H, dtype=torch.bfloat16),
                                                   topk_idx=torch.zeros(9999, K, dtype=torch.int64),
                                                   topk_weights=torch.zeros(9999, K))),
        (TypeError, "y: expected dtype", dict(y=y_wrong)),
        (ValueError, "out of range", dict(topk_idx=idx + E, validate_routing="host")),
        (ValueError, "validate_routing: one of", dict(validate_routing="gpu")),
        (TypeError, "fast_math: expected a bool", dict(fast_math=1)),
        (TypeError, "activation_clamp: expected None or a float", dict(activation_clamp=True)),
    ]
    for exc, text, change in cases:
        kwargs = dict(x=x, topk_idx=idx, topk_weights=w, validate_routing=False) | change
        before = len(log)
        with pytest.raises(exc, match=text):
            staged.staged_mega_moe(buf, kwargs.pop("x"), kwargs.pop("topk_idx"),
                                   kwargs.pop("topk_weights"), weights, **kwargs)
        assert len(log) == before, text  # nothing launched
        tag += 1
        assert int(buf.barrier[BarrierSlots.CALL_TAG]) == tag, text  # given up once
    # a weight changed in place (a shape the kernels were not built for) is seen too
    weights.w2 = weights.w2[:, :, : INTER // 2]
    with pytest.raises(ValueError, match="weights.w2: expected shape"):
        staged.staged_mega_moe(buf, x, idx, w, weights, validate_routing=False)


def test_launch_path_is_chosen_once_and_switchable():
    assert runtime.launch_path() in runtime.LAUNCH_PATHS.values()
    previous = runtime.set_launch_path("cute-dsl")
    try:
        path = runtime.launch_path()
        assert (path.name, path.tvm_ffi) == ("cute-dsl", False)
        assert path.options("sm_90a") == "--gpu-arch sm_90a"
        assert runtime.LAUNCH_PATHS["tvm-ffi"].options("sm_90a") == \
            "--gpu-arch sm_90a --enable-tvm-ffi"
        t = torch.zeros(4, dtype=torch.int32)
        assert runtime.LAUNCH_PATHS["tvm-ffi"].ptr(t, 4) == t.data_ptr()
        assert runtime.LAUNCH_PATHS["tvm-ffi"].int32(7) == 7
        with pytest.raises(ValueError, match="name: expected one of"):
            runtime.set_launch_path("dlpack")
    finally:
        runtime.set_launch_path(previous.name)


@needs_tvm_ffi
@pytest.mark.parametrize("value,expected", [("0", "cute-dsl"), ("1", "tvm-ffi"), ("", "tvm-ffi")])
def test_launch_path_env_switch(value, expected):
    env = dict(os.environ, CUTE_MEGAMOE_TVM_FFI=value)
    out = subprocess.run([sys.executable, "-c", "from cute_megamoe import runtime; "
                          "print(runtime.launch_path().name)"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == expected


# ----------------------------------------------------------------------------- TVM-FFI compile

@needs_tvm_ffi
@pytest.mark.compile
def test_every_launcher_compiles_for_tvm_ffi_and_its_stub_takes_the_arguments():
    """`testing.tvm_ffi_probe` in a subprocess: per launch, the raw function and what its
    calls did."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="",
               CUTE_MEGAMOE_TVM_FFI="1")
    proc = subprocess.run([sys.executable, "-m", "cute_megamoe.testing.tvm_ffi_probe"],
                          env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    launches = ("staging", "dispatch", "dispatch+stats", "combine", "combine-epilogue", "l1",
                "l2", "l2-to-combine")
    assert set(report) == {f"{recipe}/{name}" for recipe in ("fp8xfp8", "bf16xbf16")
                           for name in launches}
    for name, r in report.items():
        assert r["raw_is_tvm_ffi_function"] and r["all_int_args"], name
        # the stub decoded every argument (ints for pointers, Int32s and the stream), then
        # needed the GPU
        assert "Cuda Runtime Error" in r["call"], (name, r["call"])
        assert "Cuda Runtime Error" in r["prepared_call"], (name, r["prepared_call"])
        # and it does check them, all before the GPU: the count, the first and last argument
        assert r["too_few"].startswith("TypeError: Expects"), (name, r["too_few"])
        for case in ("float_for_pointer", "float_for_stream"):
            assert r[case].startswith("TypeError: Mismatched type"), (name, r[case])
            assert "expected handle or int" in r[case], (name, r[case])


def test_module_eager_call_skips_the_custom_op_dispatcher_only_when_it_may(monkeypatch):
    """`MegaMoE.forward` runs its implementation directly in plain eager calls (the same bits),
    and through the custom op when autograd would record an input or a mode is active."""
    import cute_megamoe as cm
    from cute_megamoe import module

    gen = torch.Generator().manual_seed(7)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(E, H, INTER, generator=gen).to(torch.bfloat16)
    moe = cm.MegaMoE(None, E, T, K, H, INTER, "bf16xbf16", w1, w2, device="cpu")
    x, idx, w = _layer_inputs(9, 8)
    through_op = []
    real_op = module.mega_moe_op
    monkeypatch.setattr(module, "mega_moe_op", lambda *args: through_op.append(1) or
                        real_op(*args))
    direct = moe(x, idx, w)
    assert through_op == []
    via_op = real_op(x, idx, w, moe.layer_id)
    assert torch.equal(direct.view(torch.int16), via_op.view(torch.int16))
    assert not direct.requires_grad
    moe(x.clone().requires_grad_(), idx, w)
    assert through_op == [1]
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        moe(x, idx, w)
    assert through_op == [1, 1]


@pytest.mark.parametrize("path", PATHS)
def test_fused_layer_plan_fills_in_the_right_arguments(fake_cuda, path, monkeypatch):
    """`fused.fused_mega_moe` with the inputs staged by a launch (``stages_inputs=False``)
    keeps its two launches (staging, the fused kernel) as a plan; a later call's launches are
    exactly what the full path builds for it (`FUSED_SLOTS`: the token count, the stats, y and
    the stream)."""
    from cute_megamoe import fused

    counts, log = fake_cuda
    monkeypatch.setattr(fused, "check_cuda_buffer", lambda buf: buf.device)
    config = LayerConfig(fused_kernel=Sm90FusedConfig(stages_inputs=False))
    runtime.set_launch_path(path)
    buf, weights, _ = _buffer_and_weights()
    stats = torch.zeros(E, dtype=torch.int32)

    def layer(n, seed):
        x, idx, w = _layer_inputs(n, seed)
        y = torch.empty(n, H, dtype=torch.bfloat16)
        before = (counts["compile"], len(log))
        fused.fused_mega_moe(buf, x, idx, w, weights, y=y, activation_clamp=10.0,
                             validate_routing=False, cumulative_local_expert_recv_stats=stats,
                             config=config)
        return (x, idx, w, y), counts["compile"] - before[0], log[before[1]:]

    _, compiles, launched = layer(5, 1)
    assert [name for name, _ in launched] == ["InputStagingKernel", "Sm90MegaMoEKernel"]
    assert compiles == 2
    (x, idx, w, y), compiles, fast = layer(7, 2)
    assert compiles == 0
    args = dict(fast)["Sm90MegaMoEKernel"]
    n_slot, stats_slot, y_slot, _ = launch.FUSED_SLOTS
    assert int(args[n_slot]) == 7
    assert _address(args[stats_slot]) == stats.data_ptr()
    assert _address(args[y_slot]) == y.data_ptr()
    # the same launches from the full path
    launch.buffer_state(buf).plans.clear()
    before = len(log)
    fused.fused_mega_moe(buf, x, idx, w, weights, y=y, activation_clamp=10.0,
                         validate_routing=False, cumulative_local_expert_recv_stats=stats,
                         config=config)
    full = log[before:]
    for (name, a), (_, b) in zip(fast, full, strict=True):
        assert [_value(v) for v in a] == [_value(v) for v in b], name


@pytest.mark.parametrize("staging", [True, None])
@pytest.mark.parametrize("path", PATHS)
def test_fused_layer_staging_in_the_kernel_is_one_launch(fake_cuda, path, staging, monkeypatch):
    """``stages_inputs`` (and None: the default for FP8 / BF16 weights): a call with ``x`` is
    one launch, the fused kernel with the caller's inputs at
    `FUSED_INPUT_SLOTS`; the plan fills in new inputs' addresses as the full path does; the
    routing is still checked on the host before any launch; with ``x=None`` (inputs staged by
    the caller) nothing changes."""
    from cute_megamoe import fused

    counts, log = fake_cuda
    monkeypatch.setattr(fused, "check_cuda_buffer", lambda buf: buf.device)
    config = LayerConfig(fused_kernel=Sm90FusedConfig(stages_inputs=staging))
    runtime.set_launch_path(path)
    buf, weights, _ = _buffer_and_weights()

    def layer(n, seed, **kwargs):
        x, idx, w = _layer_inputs(n, seed)
        y = torch.empty(n, H, dtype=torch.bfloat16)
        before = len(log)
        fused.fused_mega_moe(buf, x, idx, w, weights, y=y, activation_clamp=10.0,
                             config=config, **kwargs)
        return (x, idx, w, y), log[before:]

    for n, seed in ((5, 1), (9, 2)):  # the full path, then the plan
        (x, idx, w, y), launched = layer(n, seed, validate_routing=False)
        assert [name for name, _ in launched] == ["Sm90MegaMoEKernel"], n
        args = launched[0][1]
        assert [_address(args[s]) for s in launch.FUSED_INPUT_SLOTS] == \
            [t.data_ptr() for t in (x, idx, w)]
        assert int(args[launch.FUSED_SLOTS[0]]) == n
    fast = launched
    launch.buffer_state(buf).plans.clear()
    before = len(log)
    fused.fused_mega_moe(buf, x, idx, w, weights, y=y, activation_clamp=10.0,
                         validate_routing=False, config=config)
    for (name, a), (_, b) in zip(fast, log[before:], strict=True):
        assert [_value(v) for v in a] == [_value(v) for v in b], name
    # (a plan exists for this configuration: its routing check still runs before a launch)
    bad = idx.clone()
    bad[0, 0] = E
    before = len(log)
    with pytest.raises(ValueError, match="topk_idx"):
        fused.fused_mega_moe(buf, x, bad, w, weights, y=y, activation_clamp=10.0,
                             validate_routing="host", config=config)
    assert len(log) == before
    # the caller staged the inputs: the kernel without step 0, the inputs' slots unused
    before = len(log)
    fused.fused_mega_moe(buf, None, None, None, weights, num_tokens=5, y=y[:5],
                         activation_clamp=10.0, config=config)
    (name, args), = log[before:]
    assert name == "Sm90MegaMoEKernel"
    assert _address(args[launch.FUSED_INPUT_SLOTS[0]]) != x.data_ptr()


def test_fused_layer_picks_the_local_dispatch_where_it_runs(fake_cuda, monkeypatch):
    """The one-rank fused kernel's local dispatch: on for a call with ``x`` (the kernel
    stages it) in a buffer of at most `LOCAL_MAX_TOKENS` tokens with counted rows; off with
    ``local_dispatch=False``, with barrier rows, and with ``x=None`` (nothing to quantize: the
    staged rows are pushed); asked for where it cannot run, the call raises before any
    launch."""
    from cute_megamoe import fused
    from cute_megamoe.heuristics import LOCAL_MAX_TOKENS

    counts, log = fake_cuda
    built = []
    real = launch._compile

    def recording_compile(kernel, specs, arch, path):
        built.append(kernel)
        return real(kernel, specs, arch, path)

    monkeypatch.setattr(launch, "_compile", recording_compile)
    monkeypatch.setattr(fused, "check_cuda_buffer", lambda buf: buf.device)
    buf, weights, _ = _buffer_and_weights()
    assert buf.layout.num_max_tokens_per_rank <= LOCAL_MAX_TOKENS
    x, idx, w = _layer_inputs(5, 0)

    def fused_kernel(**kwargs):
        # (built anew every time: no plan or compiled kernel kept from another call)
        launch.buffer_state(buf).plans.clear()
        runtime._COMPILED.clear()
        before = len(built)
        fused.fused_mega_moe(buf, x if "x" not in kwargs else kwargs.pop("x"), idx, w, weights,
                             validate_routing=False, **kwargs)
        kernels = [k for k in built[before:] if type(k).__name__ == "Sm90MegaMoEKernel"]
        return kernels[-1] if kernels else None

    def config(**fields):
        return LayerConfig(fused_kernel=Sm90FusedConfig(**fields))

    assert fused_kernel().local_dispatch
    for fields, local in ((dict(local_dispatch=False), False),
                          (dict(row_transfer="barrier"), False),
                          (dict(local_dispatch=True, row_transfer="counted"), True)):
        kernel = fused_kernel(config=config(**fields))
        assert kernel is not None and kernel.local_dispatch == local, fields
    from cute_megamoe.staged import stage_inputs

    stage_inputs(buf, x, idx, w, validate_routing=False)
    before = len(built)
    fused.fused_mega_moe(buf, None, None, None, weights, num_tokens=5)
    kernels = [k for k in built[before:] if type(k).__name__ == "Sm90MegaMoEKernel"]
    assert kernels and not kernels[-1].local_dispatch and not kernels[-1].stages_inputs
    # (asked for where it cannot run: refused, nothing launched)
    before = len(log)
    with pytest.raises(ValueError, match="local_dispatch"):
        config(local_dispatch=True, row_transfer="barrier")
    with pytest.raises(ValueError, match="local_dispatch"):
        fused_kernel(x=None, num_tokens=5, config=config(local_dispatch=True))
    assert len(log) == before


def test_fused_layer_checks_run_before_any_launch(fake_cuda, monkeypatch):
    """A wrong input to `fused.fused_mega_moe` raises naming it, gives the call up once and
    launches nothing, with or without a plan."""
    from cute_megamoe import fused

    counts, log = fake_cuda
    monkeypatch.setattr(fused, "check_cuda_buffer", lambda buf: buf.device)
    buf, weights, _ = _buffer_and_weights()
    x, idx, w = _layer_inputs(5, 0)
    fused.fused_mega_moe(buf, x, idx, w, weights, validate_routing=False)  # makes a plan
    for bad, what in ((dict(x=x.float()), "x"), (dict(block_m=96), "block_m"),
                      (dict(num_sms=10**6), "num_sms"),
                      (dict(y=torch.empty(5, H + 128, dtype=torch.bfloat16)), "y")):
        args = {"x": x, **bad}
        kwargs = {k: v for k, v in bad.items() if k != "x"}
        tag = int(buf.barrier[BarrierSlots.CALL_TAG])
        before = len(log)
        with pytest.raises((TypeError, ValueError), match=what):
            fused.fused_mega_moe(buf, args["x"], idx, w, weights, validate_routing=False,
                                 **kwargs)
        assert len(log) == before, what
        assert int(buf.barrier[BarrierSlots.CALL_TAG]) == tag + 1, what


def test_entry_points_run_the_fused_kernel_by_default_at_one_rank(fake_cuda, monkeypatch):
    """On a (stubbed) sm_90a GPU, a one-rank buffer: `mega_moe` / `fp8_mega_moe` and DeepGEMM's
    `fp8_fp4_mega_moe` (the caller staged the inputs) launch the fused kernel by default
    (for calls of at most `heuristics.FUSED_AUTO_MAX_TOKENS` tokens, the staged kernels above),
    ``fused=False`` and ``CUTE_MEGAMOE_FUSED=0`` the staged kernels (a pull transfer too), and
    sm_100a (compiled, never run) the staged ones unless asked."""
    import cute_megamoe as cm
    from cute_megamoe import api, deepgemm_api, fused, quant

    counts, log = fake_cuda
    for module in (fused, api, deepgemm_api):
        monkeypatch.setattr(module, "check_cuda_buffer", lambda buf: buf.device)
    monkeypatch.setattr(deepgemm_api, "get_arch", lambda *args: "sm_90a")
    monkeypatch.delenv("CUTE_MEGAMOE_FUSED", raising=False)
    buf, weights, (w1, w2) = _buffer_and_weights()
    l1, l2 = cm.transform_weights_for_mega_moe(
        *(quant.quantize_weights_for_recipe(t, "fp8xfp8") for t in (w1, w2)))
    y = torch.empty(5, H, dtype=torch.bfloat16)
    staged_kernels = ["DispatchKernel", "l1", "l2", "CombineKernel"]
    calls = {
        "mega_moe": lambda **kw: api.mega_moe(y, weights, buf, **kw),
        "fp8_mega_moe": lambda **kw: api.fp8_mega_moe(y, weights, buf, **kw),
        "fp8_fp4_mega_moe": lambda **kw: cm.fp8_fp4_mega_moe(y, l1, l2, buf,
                                                             recipe=(1, 128, 128)),
    }
    for name, call in calls.items():
        for kwargs, env, want in (({}, None, ["Sm90MegaMoEKernel"]),
                                  ({}, "0", staged_kernels),
                                  ({"fused": False}, None, staged_kernels),
                                  ({"transfer": "pull"}, None, staged_kernels)):
            if name == "fp8_fp4_mega_moe" and kwargs:
                continue  # (DeepGEMM's signature: the environment decides)
            if env is None:
                monkeypatch.delenv("CUTE_MEGAMOE_FUSED", raising=False)
            else:
                monkeypatch.setenv("CUTE_MEGAMOE_FUSED", env)
            before = len(log)
            call(**kwargs)
            assert [n for n, _ in log[before:]] == want, (name, kwargs, env)
    monkeypatch.delenv("CUTE_MEGAMOE_FUSED", raising=False)
    assert fused.choose(None, buf, weights) is True
    # a call larger than the default's limit (5 tokens here) runs the staged kernels
    monkeypatch.setattr(fused, "FUSED_AUTO_MAX_TOKENS", 4)
    for name, call in calls.items():
        before = len(log)
        call()
        assert [n for n, _ in log[before:]] == staged_kernels, name
        before = len(log)
        api.mega_moe(y[:4], weights, buf)
        assert [n for n, _ in log[before:]] == ["Sm90MegaMoEKernel"], name
    monkeypatch.setattr(launch, "get_arch", lambda *args: "sm_100a")
    sm100 = ExpertWeights.from_bf16(w1, w2, "bf16xbf16", arch="sm_100a")
    bf16_buf = get_symm_buffer_for_mega_moe(None, E, T, K, H, INTER, mma_type="bf16xbf16",
                                            device="cpu")
    assert fused.choose(None, bf16_buf, sm100) is False
    assert fused.choose(True, bf16_buf, sm100) is True


def test_fused_layer_picks_the_sm100_kernel_on_blackwell(fake_cuda, monkeypatch):
    """On an sm_100a GPU (stubbed) `fused.fused_mega_moe` launches the Blackwell fused kernel
    for fp8xfp4 weights, keeps a plan whose slots are the same as on sm_90a, and refuses
    weights prepared for another arch."""
    from cute_megamoe import fused

    counts, log = fake_cuda
    monkeypatch.setattr(fused, "check_cuda_buffer", lambda buf: buf.device)
    monkeypatch.setattr(launch, "get_arch", lambda *args: "sm_100a")
    buf, weights, (w1, w2) = _buffer_and_weights("fp8xfp4", "sm_100a")
    for n, seed in ((5, 1), (9, 2)):
        x, idx, w = _layer_inputs(n, seed)
        y = torch.empty(n, H, dtype=torch.bfloat16)
        before = len(log)
        fused.fused_mega_moe(buf, x, idx, w, weights, y=y, validate_routing=False)
        launched = log[before:]
        assert [name for name, _ in launched] == ["InputStagingKernel", "Sm100MegaMoEKernel"]
        args = launched[1][1]
        assert int(args[launch.FUSED_SLOTS[0]]) == n
        assert _address(args[launch.FUSED_SLOTS[2]]) == y.data_ptr()
    assert counts["compile"] == 2  # the second call ran the plan
    wrong = ExpertWeights.from_bf16(w1, w2, "bf16xbf16", arch="sm_90a")
    with pytest.raises(ValueError, match="runs|prepared"):
        fused.fused_mega_moe(buf, x, idx, w, wrong, validate_routing=False)


def test_fp4_sm90_layer_on_the_staged_and_the_fused_kernels(fake_cuda, monkeypatch):
    """fp8xfp4_sm90 on a (stubbed) sm_90a GPU: the staged layer launches the five kernels and
    keeps a plan; the fused kernel refuses the recipe before any launch unless asked for as an
    experiment, and then runs it with the weights' block scales where fp8xfp8's go and their
    per-32 scales in the last two pointer arguments."""
    from cute_megamoe import api, fused

    counts, log = fake_cuda
    for module in (fused, api):
        monkeypatch.setattr(module, "check_cuda_buffer", lambda buf: buf.device)
    buf, weights, _ = _buffer_and_weights("fp8xfp4_sm90")
    x, idx, w = _layer_inputs(5, 0)
    for _ in range(2):
        before = len(log)
        staged.staged_mega_moe(buf, x, idx, w, weights, validate_routing=False)
        assert [name for name, _ in log[before:]] == list(KERNELS)
    assert counts["compile"] == len(KERNELS)  # the second call ran the plan
    assert "only as an experiment" in fused.supports(buf, weights)
    y = torch.empty(5, H, dtype=torch.bfloat16)
    for call in (lambda: fused.fused_mega_moe(buf, x, idx, w, weights, validate_routing=False),
                 lambda: api.mega_moe(y, weights, buf, fused=True)):
        tag = int(buf.barrier[BarrierSlots.CALL_TAG])
        before = len(log)
        with pytest.raises(ValueError, match="experimental_fused_fp4=True"):
            call()
        assert len(log) == before
        assert int(buf.barrier[BarrierSlots.CALL_TAG]) == tag + 1
    experiment = LayerConfig(experimental_fused_fp4=True)
    assert fused.supports(buf, weights, experiment) is None
    before = len(log)
    fused.fused_mega_moe(buf, x, idx, w, weights, y=y, validate_routing=False,
                         config=experiment)
    launched = log[before:]
    assert [name for name, _ in launched] == ["InputStagingKernel", "Sm90MegaMoEKernel"]
    args = launched[1][1]
    assert _address(args[launch.FUSED_SLOTS[2]]) == y.data_ptr()
    # (w1, w1_sf, w2, w2_sf after the activations; w1_group_sf, w2_group_sf after y)
    assert [_address(a) for a in args[11:15]] == [
        t.data_ptr() for t in (weights.w1, weights.w1_block_sf, weights.w2, weights.w2_block_sf)]
    assert [_address(a) for a in args[19:21]] == [weights.w1_sf.data_ptr(),
                                                  weights.w2_sf.data_ptr()]


def test_deployment_variables_parse_strictly(monkeypatch):
    """The four environment variables the package reads (deployment settings, not kernel
    variants: those are configuration values) take their documented values, and anything else
    raises `ValueError` naming the variable and what it takes."""
    from cute_megamoe import checks, fused

    monkeypatch.delenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", raising=False)
    assert runtime.spin_timeout_ns() == 120 * 10**9
    for value, ns in (("0", 0), ("2.5", 2_500_000_000), (" 7 ", 7 * 10**9)):
        monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", value)
        assert runtime.spin_timeout_ns() == ns
    for bad in ("abc", "-1", "inf", "nan"):
        monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="CUTE_MEGAMOE_SPIN_TIMEOUT_S: seconds"):
            runtime.spin_timeout_ns()
    monkeypatch.delenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S")
    for value, mode in (("", "device"), ("device", "device"), (" Host ", "host"),
                        ("off", "off")):
        monkeypatch.setenv("CUTE_MEGAMOE_CHECK_ROUTING", value)
        assert checks.routing_check(None) == mode
        # (the argument wins)
        assert [checks.routing_check(v) for v in (True, False, "host", "device", "off")] == \
            ["device", "off", "host", "device", "off"]
    for bad in ("maybe", "1", "0"):
        monkeypatch.setenv("CUTE_MEGAMOE_CHECK_ROUTING", bad)
        with pytest.raises(ValueError, match="CUTE_MEGAMOE_CHECK_ROUTING: one of"):
            checks.routing_check(None)
    for bad in ("gpu", 1, 0, "HOST"):
        with pytest.raises(ValueError, match="validate_routing: one of"):
            checks.routing_check(bad)
    monkeypatch.setenv("CUTE_MEGAMOE_TVM_FFI", "0")
    assert runtime._default_path().name == "cute-dsl"
    monkeypatch.setenv("CUTE_MEGAMOE_TVM_FFI", "sometimes")
    with pytest.raises(ValueError, match="CUTE_MEGAMOE_TVM_FFI: one of"):
        runtime._default_path()
    monkeypatch.setenv("CUTE_MEGAMOE_FUSED", "maybe")
    with pytest.raises(ValueError, match="CUTE_MEGAMOE_FUSED: one of"):
        fused.env_choice("CUTE_MEGAMOE_FUSED", fused.FUSED_DEFAULTS)


def test_layer_plans_key_on_the_configuration(fake_cuda, monkeypatch):
    """A layer call's plan is kept per configuration value: an equal one (built anew) reuses
    it, another one builds its kernels (and its GEMM configurations are what the heuristics
    fill in for the call); the wait limit, compiled into every kernel, keys the plans too."""
    counts, log = fake_cuda
    buf, weights, _ = _buffer_and_weights()
    x, idx, w = _layer_inputs(5, 0)

    def layer(config=None):
        before = counts["compile"]
        staged.staged_mega_moe(buf, x, idx, w, weights, validate_routing=False, config=config)
        return counts["compile"] - before

    assert layer() == 5 and layer() == 0
    assert layer(LayerConfig()) == 0  # (None is the default configuration)
    assert layer(LayerConfig(gemm=Sm90GemmConfig(k_unroll=2))) == 2
    assert layer(LayerConfig(gemm=Sm90GemmConfig(k_unroll=2))) == 0
    assert len(launch.buffer_state(buf).plans) == 2
    monkeypatch.setenv("CUTE_MEGAMOE_SPIN_TIMEOUT_S", "3")
    assert layer() == 5  # (every kernel again: the limit is compiled in)
    with pytest.raises(ValueError, match="block_m"):
        staged.staged_mega_moe(buf, x, idx, w, weights, validate_routing=False, block_m=64,
                               config=LayerConfig(gemm=Sm90GemmConfig(block_m=128)))
    with pytest.raises(TypeError, match="config"):
        staged.staged_mega_moe(buf, x, idx, w, weights, validate_routing=False,
                               config=Sm90GemmConfig())
