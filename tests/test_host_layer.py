"""The host layer: `MegaMoE`, the DeepGEMM-compatible entry points' weight handling, checks,
defaults, and the give-up rule of every collective entry point.

CPU: the module on the reference path against `mega_moe_reference` (bit-exact: it is the
reference), traced by ``torch.compile`` through its custom op; weight conversions from
DeepGEMM's layout bit-exact against our own preparation; the conversion cache; defaults that
run together; every entry point's host errors (and that a collective one gives the call up
exactly once). GPU (``gpu``): the module on our kernels (fp8xfp8, bf16xbf16 on Hopper) and on
the torch-experts path (fp8xfp4 on Hopper) against the reference, inside a CUDA graph, and
under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import cute_megamoe as cm
from cute_megamoe import quant, staged
from cute_megamoe.checks import check_tensor
from cute_megamoe.expert_gemm import ExpertWeights
from cute_megamoe.layout import BarrierSlots
from cute_megamoe.testing.dispatch_checks import LAYER_TOLERANCE, make_routing

RECIPES = ("fp8xfp4", "fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")


def _weights(e_l: int, hidden: int, inter: int, seed: int, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(e_l, 2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e_l, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    return w1.to(device), w2.to(device)


def _inputs(n: int, experts: int, topk: int, hidden: int, seed: int, routing="masked",
            device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    idx, w = make_routing(n, experts, topk, routing, gen)
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    return x.to(device), idx.to(device), w.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _call_tag(buf) -> int:
    return int(buf.barrier[BarrierSlots.CALL_TAG])


# ----------------------------------------------------------------------------- MegaMoE, CPU

@pytest.mark.parametrize("recipe", RECIPES)
def test_module_on_cpu_is_the_reference(recipe):
    e, t, k, h, i = 8, 96, 3, 256, 128
    w1, w2 = _weights(e, h, i, 1)
    moe = cm.MegaMoE(None, e, t, k, h, i, recipe, w1, w2, device="cpu", activation_clamp=10.0)
    assert (moe.config.path, moe.config.arch, moe.sym_buffer) == ("reference", None, None)
    for n, routing, seed in ((96, "masked", 2), (17, "one_expert", 3), (0, "random", 4)):
        x, idx, w = _inputs(n, e, k, h, seed, routing)
        y = moe(x, idx, w)
        ref = cm.mega_moe_reference([x], [idx], [w], [w1], [w2], recipe=recipe,
                                    activation_clamp=10.0).y[0]
        assert y.shape == (n, h) and y.dtype == torch.bfloat16
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
        if n:
            assert float(y.float().abs().max()) > 0


def test_module_config_is_frozen_and_chosen_at_construction():
    w1, w2 = _weights(4, 128, 128, 5)
    moe = cm.MegaMoE(None, 4, 32, 2, 128, 128, "bf16xbf16", w1, w2, device="cpu",
                     transfer="pull", l2_sends=False, fast_math=False, validate_routing=False,
                     activation_clamp=7)
    cfg = moe.config
    assert (cfg.transfer, cfg.l2_sends, cfg.fast_math, cfg.validate_routing) == \
        ("pull", False, False, "off")
    assert cfg.activation_clamp == 7.0 and isinstance(cfg.activation_clamp, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.transfer = "push"
    assert moe.num_local_experts == 4 and moe.hidden == 128 and moe.device.type == "cpu"
    # forward takes exactly (x, topk_idx, topk_weights): no per-call knobs
    assert list(inspect.signature(moe.forward).parameters) == ["x", "topk_idx", "topk_weights"]


def test_module_traced_by_torch_compile_as_one_custom_op():
    e, t, k, h, i = 8, 64, 2, 256, 128
    w1, w2 = _weights(e, h, i, 6)
    moe = cm.MegaMoE(None, e, t, k, h, i, "fp8xfp8", w1, w2, device="cpu")
    x, idx, w = _inputs(40, e, k, h, 7)
    eager = moe(x, idx, w)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, idx, w).view(torch.int16), eager.view(torch.int16))
    x2, idx2, w2_ = _inputs(40, e, k, h, 8)
    assert torch.equal(compiled(x2, idx2, w2_).view(torch.int16),
                       moe(x2, idx2, w2_).view(torch.int16))
    checks = torch.library.opcheck(torch.ops.cute_megamoe.mega_moe, (x, idx, w, moe.layer_id))
    assert set(checks.values()) == {"SUCCESS"} and len(checks) >= 4


def test_module_rejects_bad_construction():
    e, t, k, h, i = 8, 64, 2, 256, 128
    w1, w2 = _weights(e, h, i, 9)
    with pytest.raises(ValueError, match="w1: expected shape"):
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", w1[:4], w2, device="cpu")
    with pytest.raises(TypeError, match="w2: expected dtype"):
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", w1, w2.float(), device="cpu")
    with pytest.raises(ValueError, match="weights: give either"):
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", device="cpu")
    with pytest.raises(ValueError, match="weights: 4 experts"):  # (the CPU path takes them)
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", device="cpu",
                   weights=staged.TorchExpertWeights(w1[:4], w2[:4]))
    with pytest.raises(ValueError, match="recipe: expected one of"):
        cm.MegaMoE(None, e, t, k, h, i, "fp4xfp4", w1, w2, device="cpu")
    with pytest.raises(ValueError, match="transfer: expected one of"):
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", w1, w2, device="cpu", transfer="bcast")
    with pytest.raises(ValueError, match="activation_clamp"):
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", w1, w2, device="cpu",
                   activation_clamp=-1.0)
    with pytest.raises(ValueError, match="block_m"):
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", w1, w2, device="cpu", block_m=40)
    with pytest.raises(ValueError, match="experts=.* needs CUDA"):
        cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", w1, w2, device="cpu", experts="torch")
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 128"):
        cm.MegaMoE(None, e, t, k, 100, i, "bf16xbf16", w1, w2, device="cpu")


def test_module_rejects_bad_inputs_on_cpu():
    e, t, k, h, i = 8, 64, 2, 256, 128
    w1, w2 = _weights(e, h, i, 10)
    moe = cm.MegaMoE(None, e, t, k, h, i, "bf16xbf16", w1, w2, device="cpu")
    x, idx, w = _inputs(8, e, k, h, 11)
    with pytest.raises(TypeError, match="x: expected dtype"):
        moe(x.float(), idx, w)
    # (the layer's own limit, not the buffer's rows: 64 rounded up to 128)
    for n in (65, 200):
        with pytest.raises(ValueError, match=f"x: {n} tokens; this layer takes 0..64 per rank "
                                             r"\(num_max_tokens_per_rank=64\)"):
            moe(torch.zeros(n, h, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.int64),
                torch.zeros(n, k))
    with pytest.raises(ValueError, match="topk_idx: expected shape"):
        moe(x, idx[:, :1], w)
    with pytest.raises(ValueError, match="names the same expert"):
        moe(x, torch.zeros_like(idx), w)
    with pytest.raises(ValueError, match="out of range"):
        moe(x, idx + e, w)


def test_module_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w1, w2 = _weights(4, 128, 128, 12)
    moe = cm.MegaMoE(None, 4, 32, 2, 128, 128, "fp8xfp4", w1, w2)  # device None: the CPU
    assert moe.config.path == "reference" and moe.device.type == "cpu"
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        cm.MegaMoE(None, 4, 32, 2, 128, 128, "fp8xfp4", w1, w2, device="cuda")


# ----------------------------------------------------------------------------- defaults

def test_defaults_run_together():
    """The buffer's default recipe (fp8xfp4, DeepGEMM's) runs with the defaults of every
    other piece: weights default to the arch that has kernels for their recipe, the module
    chooses its path, the DeepGEMM entry point falls back to torch experts; BLOCK_M defaults
    to the heuristics everywhere."""
    from cute_megamoe import api, deepgemm_api, heuristics
    from cute_megamoe.tables import GEMM_RECIPES

    assert inspect.signature(cm.get_symm_buffer_for_mega_moe).parameters["mma_type"].default \
        == inspect.signature(cm.MegaMoE).parameters["recipe"].default == "fp8xfp4"
    w1, w2 = _weights(2, 256, 128, 13)
    for recipe, arch in (("fp8xfp4", "sm_100a"), ("fp8xfp8", "sm_90a")):
        weights = ExpertWeights.from_bf16(w1, w2, recipe)  # CPU weights, arch by the recipe
        assert weights.arch == arch and recipe in GEMM_RECIPES[arch]
    for fn in (staged.dispatch, staged.staged_mega_moe, api.mega_moe, api.fp8_mega_moe):
        assert inspect.signature(fn).parameters["block_m"].default is None, fn.__name__
    assert not hasattr(staged, "DEFAULT_BLOCK_M")
    assert heuristics.block_m_for_call(1, 1, 8, 256, "sm_90a") == 64
    assert heuristics.block_m_for_call(8192, 8, 8, 256, "sm_90a") == 128
    assert heuristics.block_m_for_call(8192, 8, 8, 256, "sm100") == 256
    assert deepgemm_api.RECIPE_SF_GRANULARITY["fp8xfp4"] == \
        inspect.signature(cm.fp8_fp4_mega_moe).parameters["recipe"].default


def test_expert_weights_arch_is_explicit_or_clear():
    w1, w2 = _weights(2, 256, 128, 14)
    with pytest.raises(ValueError, match="'fp8xfp4' has no grouped-GEMM kernels on 'sm_90a'.*"
                                         "TorchExpertWeights"):
        ExpertWeights.from_bf16(w1, w2, "fp8xfp4", arch="sm90")
    with pytest.raises(ValueError, match="arch: expected one of"):
        ExpertWeights.from_bf16(w1, w2, "bf16xbf16", arch="sm_80")
    w = ExpertWeights.from_bf16(w1, w2, "bf16xbf16", arch="sm90a")
    assert w.arch == "sm_90a" and torch.equal(w.untiled_copy().w1, quant.interleave_gate_up(w1))


def test_expert_weights_bf16_on_cpu_without_a_gpu_need_an_arch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w1, w2 = _weights(2, 256, 128, 15)
    with pytest.raises(ValueError, match="arch: bf16xbf16 weights on the CPU"):
        ExpertWeights.from_bf16(w1, w2, "bf16xbf16")


# ----------------------------------------------------------------------------- weights

def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("recipe,arch", [("fp8xfp4", "sm_100a"), ("fp8xfp8", "sm_90a"),
                                         ("bf16xbf16", "sm_90a"), ("bf16xbf16", "sm_100a")])
def test_expert_weights_from_deepgemm_layout_match_ours(recipe, arch):
    """What `transform_weights_for_mega_moe` returns (its default, DeepGEMM's layout; FP4
    scales also as DeepGEMM's MN-major strides) gives the same bytes as `from_bf16`."""
    w1, w2 = _weights(2, 256, 128, 16)
    ours = ExpertWeights.from_bf16(w1, w2, recipe, arch=arch)
    q1, q2 = (quant.quantize_weights_for_recipe(w, recipe) for w in (w1, w2))
    l1, l2 = cm.transform_weights_for_mega_moe(q1, q2)
    layouts = [(l1, l2)]
    if recipe == "fp8xfp4":  # DeepGEMM's scales are MN-major: same values, other strides
        def mn_major(sf):
            return sf.transpose(1, 2).contiguous().transpose(1, 2)

        layouts.append(((l1[0], mn_major(l1[1])), (l2[0], mn_major(l2[1]))))
    for a, b in layouts:
        theirs = ExpertWeights.from_transformed(a, b, arch=arch)
        assert theirs.recipe == recipe and theirs.arch == arch
        for name in ("w1", "w2", "w1_sf", "w2_sf"):
            if getattr(ours, name) is None:
                assert getattr(theirs, name) is None
            else:
                _assert_same(getattr(theirs, name), getattr(ours, name))


@pytest.mark.parametrize("recipe", RECIPES)
def test_torch_weights_from_deepgemm_layout_match_ours(recipe):
    w1, w2 = _weights(2, 256, 128, 17)
    ours = staged.TorchExpertWeights.from_bf16(w1, w2, recipe)
    q1, q2 = (quant.quantize_weights_for_recipe(w, recipe) for w in (w1, w2))
    theirs = staged.TorchExpertWeights.from_transformed(
        *cm.transform_weights_for_mega_moe(q1, q2))
    _assert_same(theirs.w1, ours.w1)
    _assert_same(theirs.w2, ours.w2)
    assert (theirs.num_experts, theirs.hidden, theirs.intermediate) == (2, 256, 128)


def test_conversion_cache_converts_once_per_weights():
    from cute_megamoe.deepgemm_api import _ConversionCache

    cache = _ConversionCache()
    calls = []

    def doubled(t):
        def convert():
            calls.append(1)
            return (t * 2,)
        return convert

    w = torch.randn(4, 8)
    first = cache.get((w,), ("x2",), doubled(w))
    assert cache.get((w,), ("x2",), doubled(w)) is first and len(calls) == 1
    assert torch.equal(first[0], w * 2)
    assert cache.get((w[1:],), ("x2",), doubled(w[1:])) is not first and len(calls) == 2
    w.add_(1.0)  # changed in place: the version counter moved
    again = cache.get((w,), ("x2",), doubled(w))
    assert again is not first and len(calls) == 3 and torch.equal(again[0], w * 2)
    assert cache.get((w,), ("other",), doubled(w)) is not again and len(calls) == 4
    assert len(cache) == 4
    del w, first, again
    import gc

    gc.collect()
    assert len(cache) == 0  # the entries went with the weights
    # a result that is a view of the source is not kept (it would keep the source alive)
    v = torch.randn(4, 8)
    cache.get((v,), ("view",), lambda: (v.t(),))
    assert len(cache) == 0


# ----------------------------------------------------------------------------- entry points

def _cpu_buffer(recipe="bf16xbf16"):
    return cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, mma_type=recipe,
                                           device="cpu")


def test_deepgemm_buffer_signature_checks():
    buf = cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, True, "fp8xfp8",
                                          device="cpu")
    assert buf.recipe == "fp8xfp8" and buf.x.shape == (128, 256) and buf.x_sf.shape == (128, 2)
    with pytest.raises(TypeError, match="use_fp8_dispatch"):
        cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, "bf16xbf16", device="cpu")
    with pytest.raises(ValueError, match="use_fp8_dispatch=True contradicts"):
        cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, True, "bf16xbf16",
                                        device="cpu")
    with pytest.raises(ValueError, match="activation"):
        cm.get_symm_buffer_for_mega_moe(None, 8, 64, 2, 256, 128, activation="gelu",
                                        device="cpu")


def _layer_calls(buf, w1, w2):
    """Every collective layer entry point, with valid-looking arguments for `buf`."""
    y = torch.zeros(4, 256, dtype=torch.bfloat16)
    q1, q2 = (quant.quantize_weights_for_recipe(w, buf.recipe) for w in (w1, w2))
    l1, l2 = cm.transform_weights_for_mega_moe(q1, q2)
    kernel_w = ExpertWeights.from_bf16(w1, w2, buf.recipe, arch="sm_90a") \
        if buf.recipe != "fp8xfp4" else None
    torch_w = staged.TorchExpertWeights.from_bf16(w1, w2, buf.recipe)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    idx, w = torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    if buf.recipe == "bf16xbf16":
        yield "bf16_mega_moe", lambda: cm.bf16_mega_moe(y, l1, l2, buf)
    else:
        yield "fp8_fp4_mega_moe", lambda: cm.fp8_fp4_mega_moe(
            y, l1, l2, buf, recipe=(1, 1, 32) if buf.recipe == "fp8xfp4" else (1, 128, 128))
    if kernel_w is not None:
        yield "mega_moe", lambda: cm.mega_moe(y, kernel_w, buf)
        yield "staged_mega_moe(kernels)", lambda: staged.staged_mega_moe(
            buf, x, idx, w, kernel_w)
    yield "staged_mega_moe(torch)", lambda: staged.staged_mega_moe(buf, x, idx, w, torch_w)
    yield "dispatch", lambda: staged.dispatch(buf, x, idx, w)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_collective_entry_point_gives_up_a_rejected_call_once(recipe):
    """On a CPU buffer every layer entry point fails its host checks (no CUDA, or a buffer
    off the GPU): each call counts as given up exactly once, before anything launches."""
    buf = _cpu_buffer(recipe)
    w1, w2 = _weights(8, 256, 128, 18)
    made = 0
    for name, call in _layer_calls(buf, w1, w2):
        with pytest.raises((RuntimeError, ValueError), match="sym_buffer"):
            call()
        made += 1
        assert _call_tag(buf) == made, name
    assert made >= 3


def test_entry_point_errors_name_the_argument_and_give_up():
    buf = _cpu_buffer("fp8xfp4")
    w1, w2 = _weights(8, 256, 128, 19)
    q1, q2 = (quant.quantize_weights_for_recipe(w, "fp8xfp4") for w in (w1, w2))
    l1, l2 = cm.transform_weights_for_mega_moe(q1, q2)
    y = torch.zeros(4, 256, dtype=torch.bfloat16)
    cases = [
        (ValueError, "recipe: a fp8xfp4 buffer takes", dict(recipe=(1, 128, 128))),
        (ValueError, "activation: only 'swiglu'", dict(activation="relu")),
    ]
    for exc, text, kwargs in cases:
        with pytest.raises(exc, match=text):
            cm.fp8_fp4_mega_moe(y, l1, l2, buf, **kwargs)
    with pytest.raises(TypeError, match="l1_weights: bf16xbf16 weights for a fp8xfp4 buffer"):
        cm.fp8_fp4_mega_moe(y, w1, w2, buf)
    with pytest.raises(ValueError, match="sym_buffer: bf16_mega_moe takes a buffer of bf16xbf16"):
        cm.bf16_mega_moe(y, w1, w2, buf)
    assert _call_tag(buf) == 4
    with pytest.raises(TypeError, match="sym_buffer: expected a SymmBuffer"):
        cm.fp8_fp4_mega_moe(y, l1, l2, object())
    assert _call_tag(buf) == 4  # no buffer: nothing to give up


def test_check_tensor_is_the_one_tensor_check():
    t = torch.zeros(4, 8)
    assert check_tensor("t", t, torch.float32, (4, None), "cpu") is t
    assert check_tensor("t", t.t(), for_kernel=False) is not None  # any strides
    with pytest.raises(ValueError, match=r"t: expected shape \(\*, 9\), got \(4, 8\)"):
        check_tensor("t", t, shape=(None, 9))
    with pytest.raises(ValueError, match=r"t: expected shape \(32,\)"):
        check_tensor("t", t, shape=(32,))
    with pytest.raises(ValueError, match="t: must be contiguous"):
        check_tensor("t", t.t())
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_tensor("t", torch.zeros(9)[1:])
    with pytest.raises(ValueError, match="t: expected device"):
        check_tensor("t", t, device="meta")


# ----------------------------------------------------------------------------- MegaMoE, GPU

GPU_SHAPE = dict(num_experts=8, num_max_tokens_per_rank=300, num_topk=4, hidden=512,
                 intermediate_hidden=256)


def _gpu_module(recipe, **kwargs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    s = GPU_SHAPE
    w1, w2 = _weights(s["num_experts"], s["hidden"], s["intermediate_hidden"], 21, "cuda")
    moe = cm.MegaMoE(None, **s, recipe=recipe, w1=w1, w2=w2, activation_clamp=10.0, **kwargs)
    return moe, w1, w2


def _check_against_reference(recipe, y, x, idx, w, w1, w2) -> float:
    ref = cm.mega_moe_reference([x], [idx], [w], [w1], [w2], recipe=recipe,
                                activation_clamp=10.0).y[0]
    assert bool(torch.isfinite(y.float()).all())
    assert bool((y[(idx < 0).all(dim=1)] == 0).all())
    err = _rel(y, ref)
    assert err < LAYER_TOLERANCE[recipe], f"{recipe}: rel. error {err:.3g}"
    return err


def _expected_path(recipe: str) -> str:
    from cute_megamoe.runtime import get_arch
    from cute_megamoe.tables import has_gemm_kernels

    return "kernels" if has_gemm_kernels(get_arch(), recipe) else "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_module_on_gpu_matches_reference(recipe):
    moe, w1, w2 = _gpu_module(recipe)
    assert moe.config.path == _expected_path(recipe) and moe.sym_buffer is not None
    s = GPU_SHAPE
    for n, routing, seed in ((300, "random", 31), (129, "masked", 32), (1, "one_expert", 33),
                             (0, "random", 34)):
        x, idx, w = _inputs(n, s["num_experts"], s["num_topk"], s["hidden"], seed, routing,
                            "cuda")
        y = moe(x, idx, w)
        torch.cuda.synchronize()
        assert y.shape == (n, s["hidden"])
        if n:
            _check_against_reference(recipe, y, x, idx, w, w1, w2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_module_from_prepared_weights_matches_module_from_bf16(recipe):
    """Built from pre-quantized weights (`ExpertWeights` where the arch has kernels for the
    recipe, else `TorchExpertWeights`): the same bits as built from the BF16 weights."""
    moe, w1, w2 = _gpu_module(recipe)
    prepared = (ExpertWeights.from_bf16(w1, w2, recipe) if moe.config.path == "kernels"
                else staged.TorchExpertWeights.from_bf16(w1, w2, recipe))
    s = GPU_SHAPE
    other = cm.MegaMoE(None, **s, recipe=recipe, weights=prepared, activation_clamp=10.0)
    assert other.config == moe.config
    x, idx, w = _inputs(100, s["num_experts"], s["num_topk"], s["hidden"], 36, "masked", "cuda")
    assert torch.equal(other(x, idx, w), moe(x, idx, w))
    with pytest.raises(ValueError, match="weights: 8 experts, hidden 512"):
        cm.MegaMoE(None, **{**s, "num_experts": 16}, recipe=recipe, weights=prepared)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16"))
def test_module_on_gpu_forced_torch_experts_match_reference(recipe):
    moe, w1, w2 = _gpu_module(recipe, experts="torch", transfer="pull")
    assert moe.config.path == "torch"
    s = GPU_SHAPE
    x, idx, w = _inputs(200, s["num_experts"], s["num_topk"], s["hidden"], 35, "masked", "cuda")
    _check_against_reference(recipe, moe(x, idx, w), x, idx, w, w1, w2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16", "fp8xfp4"))
def test_module_in_a_cuda_graph(recipe):
    """Captured once with the defaults (the routing checked on the GPU), replayed on new
    inputs copied into the captured tensors: the reference of the new inputs; a bad slot
    copied in is raised by `check_routing_errors`. The torch-experts path refuses to be
    captured, naming why."""
    moe, w1, w2 = _gpu_module(recipe)
    s = GPU_SHAPE
    n = 160
    x, idx, w = _inputs(n, s["num_experts"], s["num_topk"], s["hidden"], 41, "masked", "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, builds the launch state
        for _ in range(2):
            moe(x, idx, w)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if moe.config.path == "torch":
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                moe(x, idx, w)
        return
    with torch.cuda.graph(graph):
        y = moe(x, idx, w)
    for seed in (42, 43):
        x2, idx2, w2_ = _inputs(n, s["num_experts"], s["num_topk"], s["hidden"], seed,
                                "random", "cuda")
        x.copy_(x2)
        idx.copy_(idx2)
        w.copy_(w2_)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_against_reference(recipe, y, x2, idx2, w2_, w1, w2)
    moe.check_routing_errors()  # (nothing bad so far)
    idx[3, 1] = s["num_experts"] + 1
    graph.replay()
    with pytest.raises(ValueError, match=f"token 3 slot 1 holds expert index "
                                         f"{s['num_experts'] + 1},"):
        moe.check_routing_errors()
    moe.check_routing_errors()  # (taken)


@pytest.mark.gpu
def test_module_in_a_cuda_graph_refuses_host_routing_checks():
    moe, _, _ = _gpu_module("bf16xbf16", validate_routing="host")
    if moe.config.path != "kernels":
        pytest.skip("bf16xbf16 runs on our kernels on Hopper and Blackwell")
    s = GPU_SHAPE
    x, idx, w = _inputs(16, s["num_experts"], s["num_topk"], s["hidden"], 44, "random", "cuda")
    moe(x, idx, w)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="validate_routing='device'"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe(x, idx, w)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16", "fp8xfp4"))
def test_module_under_torch_compile(recipe):
    """A model holding the layer, compiled (inductor, fullgraph=False): the layer is one custom
    op between compiled torch ops; the same bits as eager, and the reference's numbers."""
    moe, w1, w2 = _gpu_module(recipe)
    s = GPU_SHAPE

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = moe

        def forward(self, x, idx, w):
            return self.moe(x * 1.0, idx, w) + 0.0  # torch ops around the layer

    model = Model()
    compiled = torch.compile(model)
    for seed in (51, 52):
        x, idx, w = _inputs(120, s["num_experts"], s["num_topk"], s["hidden"], seed, "masked",
                            "cuda")
        y = compiled(x, idx, w)
        eager = model(x, idx, w)
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
        _check_against_reference(recipe, y, x, idx, w, w1, w2)
