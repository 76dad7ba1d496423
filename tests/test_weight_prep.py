"""Weight preparation in chunks of experts (`chunks`, issue 62): bit-identical to one pass over
all experts for every recipe, and within the memory model that picks the chunk size."""

import pytest
import torch

from cute_megamoe import quant
from cute_megamoe.chunks import (
    ALL_EXPERTS,
    PREP_BUDGET_BYTES,
    PREP_BUDGET_FRACTION,
    chunk_experts_for,
    map_experts,
)
from cute_megamoe.expert_gemm import (
    _TENSOR_FIELDS,
    FROM_BF16_PEAK_BYTES,
    FROM_QUANTIZED_PEAK_FACTOR,
    ExpertWeights,
)
from cute_megamoe.staged import TORCH_WEIGHTS_PEAK_BYTES, TorchExpertWeights
from cute_megamoe.tables import RECIPES
from cute_megamoe.testing.memory import peak_extra_bytes

E, H, INTER = 3, 256, 128  # three experts: chunks of 1 and 2 (a short last chunk)
ARCH = {"fp8xfp8": "sm_90a", "bf16xbf16": "sm_90a", "fp8xfp4": "sm_100a",
        "fp8xfp4_sm90": "sm_90a"}


def _masters(seed: int = 0, experts: int = E, hidden: int = H, inter: int = INTER):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g).to(torch.bfloat16)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(torch.bfloat16)
    # (experts of different magnitudes, so that chunks see different scales)
    scale = torch.logspace(-3, 2, experts).view(-1, 1, 1)
    return (w1.float() * scale).to(torch.bfloat16), (w2.float() * scale).to(torch.bfloat16)


def _flat(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _flat(item)]
    return [tree]


def _assert_identical(a, b):
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb, strict=True):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            assert x == y
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        assert [st for st, n in zip(x.stride(), x.shape, strict=True) if n > 1] == \
            [st for st, n in zip(y.stride(), y.shape, strict=True) if n > 1]
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("chunk", (1, 2))
def test_chunked_quantization_is_bit_identical(recipe, chunk):
    w1, w2 = _masters()
    for w in (w1, w2, w1.float()):
        whole = quant.quantize_weights_for_recipe(w, recipe, chunk_experts=ALL_EXPERTS)
        _assert_identical(quant.quantize_weights_for_recipe(w, recipe, chunk_experts=chunk),
                          whole)


@pytest.mark.parametrize("chunk", (1, 2))
def test_chunked_fp8_quantization_of_partial_blocks_is_bit_identical(chunk):
    # N not a multiple of 128: the per-expert path (blocks must not straddle experts)
    w = _masters()[0][:, :192, :]
    _assert_identical(quant.quantize_weights_for_recipe(w, "fp8xfp8", chunk_experts=chunk),
                      quant.quantize_weights_for_recipe(w, "fp8xfp8", chunk_experts=ALL_EXPERTS))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ("sm_90a", "sm_100a"))
def test_chunked_transform_is_bit_identical(recipe, arch):
    w1, w2 = _masters(1)
    q1 = quant.quantize_weights_for_recipe(w1, recipe)
    q2 = quant.quantize_weights_for_recipe(w2, recipe)
    if isinstance(q1, tuple):  # scales MN-major, as DeepGEMM holds them: strides are kept
        q1 = (q1[0], q1[1].transpose(1, 2).contiguous().transpose(1, 2))
    whole = quant.transform_weights_for_mega_moe(q1, q2, arch=arch, chunk_experts=ALL_EXPERTS)
    for chunk in (1, 2):
        _assert_identical(quant.transform_weights_for_mega_moe(q1, q2, arch=arch,
                                                               chunk_experts=chunk), whole)


def _fields(w: ExpertWeights):
    return [getattr(w, name) for name in _TENSOR_FIELDS] + [w.recipe, w.arch, w.tiled]


@pytest.mark.parametrize("recipe", RECIPES)
def test_chunked_expert_weights_are_bit_identical(recipe):
    w1, w2 = _masters(2)
    arch = ARCH[recipe]
    whole = ExpertWeights.from_bf16(w1, w2, recipe, arch=arch, chunk_experts=ALL_EXPERTS)
    for chunk in (1, 2):
        _assert_identical(_fields(ExpertWeights.from_bf16(w1, w2, recipe, arch=arch,
                                                          chunk_experts=chunk)), _fields(whole))
    q1 = quant.quantize_weights_for_recipe(w1, recipe)
    q2 = quant.quantize_weights_for_recipe(w2, recipe)
    _assert_identical(_fields(ExpertWeights.from_quantized(q1, q2, recipe, arch=arch,
                                                           chunk_experts=2)), _fields(whole))
    untiled = ExpertWeights.from_bf16(w1, w2, recipe, arch=arch, tiled=False,
                                      chunk_experts=ALL_EXPERTS)
    _assert_identical(_fields(ExpertWeights.from_bf16(w1, w2, recipe, arch=arch, tiled=False,
                                                      chunk_experts=1)), _fields(untiled))


@pytest.mark.parametrize("recipe", RECIPES)
def test_chunked_torch_expert_weights_are_bit_identical(recipe):
    w1, w2 = _masters(3)
    whole = TorchExpertWeights.from_bf16(w1, w2, recipe, chunk_experts=ALL_EXPERTS)
    for chunk in (1, 2):
        chunked = TorchExpertWeights.from_bf16(w1, w2, recipe, chunk_experts=chunk)
        _assert_identical([chunked.w1, chunked.w2], [whole.w1, whole.w2])


def test_map_experts_keeps_the_layout_and_checks_its_arguments():
    x = torch.arange(24.0).view(3, 2, 4)
    mn_major = x.transpose(1, 2).contiguous().transpose(1, 2)
    out = map_experts(lambda t: (t * 2, None), (mn_major,), 1)
    assert out[1] is None and out[0].stride() == mn_major.stride()
    assert torch.equal(out[0], x * 2)
    with pytest.raises(ValueError, match="leading"):
        map_experts(lambda a, b: a, (x, x[:2]), 1)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="chunk_experts"):
            chunk_experts_for(3, 1, 1, bad)
    with pytest.raises(ValueError, match="chunk_experts"):
        ExpertWeights.from_bf16(*_masters(), "fp8xfp8", arch="sm_90a", chunk_experts=0)


# ---------------------------------------------------------------------------- memory model

def _model_holds(fn, chunk: int, per_expert: float) -> tuple[int, float]:
    peak, _, _ = peak_extra_bytes(fn)
    return peak, chunk * per_expert


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("chunk", (1, 2))
def test_chunked_preparation_stays_within_its_memory_model(recipe, chunk):
    """The temporaries of a chunk (measured op by op, `testing.memory`) stay within the
    per-expert model the default chunk size comes from, so the default keeps the peak within
    a quarter of the output plus 1.5 GiB."""
    w1, w2 = _masters(4)
    arch = ARCH[recipe]
    l1_numel = w1[0].numel()
    checks = [
        (lambda: ExpertWeights.from_bf16(w1, w2, recipe, arch=arch, chunk_experts=chunk),
         FROM_BF16_PEAK_BYTES[recipe] * l1_numel),
        (lambda: TorchExpertWeights.from_bf16(w1, w2, recipe, chunk_experts=chunk),
         TORCH_WEIGHTS_PEAK_BYTES * l1_numel),
    ]
    for w in (w1, w1.float()):
        checks.append((lambda w=w: quant.quantize_weights_for_recipe(w, recipe,
                                                                     chunk_experts=chunk),
                       quant.QUANTIZE_PEAK_BYTES[recipe] * l1_numel))
    q1 = quant.quantize_weights_for_recipe(w1, recipe)
    q2 = quant.quantize_weights_for_recipe(w2, recipe)
    in_bytes = sum(t.numel() * t.element_size() for t in _flat((q1, q2))) / E
    checks += [
        (lambda: quant.transform_weights_for_mega_moe(q1, q2, arch=arch, chunk_experts=chunk),
         quant.TRANSFORM_PEAK_FACTOR * in_bytes),
        (lambda: ExpertWeights.from_quantized(q1, q2, recipe, arch=arch, chunk_experts=chunk),
         FROM_QUANTIZED_PEAK_FACTOR[recipe] * in_bytes),
    ]
    for fn, per_expert in checks:
        peak, bound = _model_holds(fn, chunk, per_expert)
        assert 0 <= peak <= bound, (peak, bound)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", ((192, 7168, 3072), (128, 7168, 2048), (8, 256, 128)))
def test_default_chunk_keeps_the_model_within_the_budget(recipe, shape):
    experts, hidden, inter = shape
    l1, l2 = (experts, 2 * inter, hidden), (experts, hidden, inter)
    out = sum(quant.quantized_weight_bytes(s, recipe) for s in (l1, l2))
    per_expert = FROM_BF16_PEAK_BYTES[recipe] * 2 * inter * hidden
    chunk = chunk_experts_for(experts, per_expert, out)
    assert 1 <= chunk <= experts
    assert chunk * per_expert <= PREP_BUDGET_FRACTION * out + PREP_BUDGET_BYTES \
        or chunk == 1
    assert PREP_BUDGET_FRACTION * out + PREP_BUDGET_BYTES <= 0.25 * out + (2 << 30)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_chunked_preparation_on_gpu_is_bit_identical(recipe):
    """On the GPU (whose fp8xfp8 scales differ from the CPU's in the last bit: compared on
    one device): chunked and one-pass preparation give the same bits."""
    w1, w2 = (w.cuda() for w in _masters(5, experts=5, hidden=512, inter=256))
    arch = ARCH[recipe]
    whole = ExpertWeights.from_bf16(w1, w2, recipe, arch=arch, chunk_experts=ALL_EXPERTS)
    _assert_identical(_fields(ExpertWeights.from_bf16(w1, w2, recipe, arch=arch,
                                                      chunk_experts=2)), _fields(whole))
    torch_whole = TorchExpertWeights.from_bf16(w1, w2, recipe, chunk_experts=ALL_EXPERTS)
    torch_chunked = TorchExpertWeights.from_bf16(w1, w2, recipe, chunk_experts=2)
    _assert_identical([torch_chunked.w1, torch_chunked.w2], [torch_whole.w1, torch_whole.w2])
