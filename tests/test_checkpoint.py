"""FP8 block-scaled expert weights as published (issue 62): `ExpertWeights.from_fp8_blocks`
and the safetensors loader, on a small synthetic DeepSeek-V3-style checkpoint written here."""

import pytest
import torch

import cute_megamoe as cm
from cute_megamoe import quant
from cute_megamoe.chunks import ALL_EXPERTS
from cute_megamoe.expert_gemm import _TENSOR_FIELDS, FROM_FP8_BLOCKS_PEAK_FACTOR, ExpertWeights
from cute_megamoe.testing.dispatch_checks import LAYER_TOLERANCE, make_routing
from cute_megamoe.testing.memory import peak_extra_bytes

LAYER = 3


def _fp8_expert(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [n, k] and its float32 block scales [n/128, k/128], none a power of two
    (as a checkpoint's amax / 448 scales are)."""
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(n // 128, k // 128, generator=gen) + 0.5) * 1e-3
    scale = torch.where(torch.frexp(scale).mantissa == 0.5, scale * 1.25, scale)
    return w, scale.float()


def _synthetic_tensors(experts, hidden, inter, seed):
    """A checkpoint's tensors by name: layer `LAYER`'s FP8 experts and two others."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.layers.3.mlp.gate.weight": torch.randn(4, hidden, generator=gen),
               "model.embed_tokens.weight": torch.randn(8, hidden, generator=gen)}
    for e in experts:
        for proj, (n, k) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                             ("down_proj", (hidden, inter))):
            w, s = _fp8_expert(gen, n, k)
            name = f"model.layers.{LAYER}.mlp.experts.{e}.{proj}.weight"
            tensors[name], tensors[name + "_scale_inv"] = w, s
    return tensors


def _checkpoint(tmp_path, experts, hidden, inter, seed=0, split=True):
    """DeepSeek-V3 names for layer `LAYER`'s `experts` (global indices), over two files (each
    expert's tensors in the file of its parity) with other tensors beside them. Returns the
    directory and the tensors by name."""
    from safetensors.torch import save_file

    tensors = _synthetic_tensors(experts, hidden, inter, seed)
    files = {0: {}, 1: {}}
    for i, (name, t) in enumerate(tensors.items()):
        files[(i % 2) if split else 0][name] = t
    for part, content in files.items():
        if content:
            save_file(content, str(tmp_path / f"model-0000{part + 1}-of-00002.safetensors"))
    return tmp_path, tensors


def _dequantized(tensors, experts, hidden, inter):
    """The checkpoint's weights dequantized by their definition (weight * scale, per block):
    w1 [E_l, 2I, H] (rows gate | up), w2 [E_l, H, I], float32."""
    def deq(name):
        w, s = tensors[name], tensors[name + "_scale_inv"]
        return w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)

    base = f"model.layers.{LAYER}.mlp.experts"
    w1 = torch.stack([torch.cat([deq(f"{base}.{e}.gate_proj.weight"),
                                 deq(f"{base}.{e}.up_proj.weight")]) for e in experts])
    w2 = torch.stack([deq(f"{base}.{e}.down_proj.weight") for e in experts])
    return w1, w2


def test_fp8_blocks_keep_the_codes_and_scales_exactly(tmp_path):
    pytest.importorskip("safetensors")
    from cute_megamoe.checkpoint import read_fp8_experts

    experts, hidden, inter = [4, 5, 6, 7], 256, 128
    path, tensors = _checkpoint(tmp_path, experts, hidden, inter)
    gate, gate_s, up, up_s, down, down_s = read_fp8_experts(path, LAYER, experts)
    for s in (gate_s, up_s, down_s):  # (no scale is a power of two)
        assert bool((torch.frexp(s).mantissa != 0.5).all())
    assert gate.dtype == torch.float8_e4m3fn and gate.shape == (4, inter, hidden)
    assert gate_s.shape == (4, 1, 2) and down_s.shape == (4, 2, 1)
    weights = ExpertWeights.from_fp8_blocks(gate, gate_s, up, up_s, down, down_s)
    assert weights.recipe == "fp8xfp8" and weights.arch == "sm_90a" and weights.tiled
    rows = weights.untiled_copy()
    # the e4m3 codes as published (only moved: gate/up interleave, tiles), the scales as given
    w1 = quant.deinterleave_gate_up(rows.w1)
    assert torch.equal(w1.view(torch.uint8), torch.cat([gate, up], 1).view(torch.uint8))
    assert torch.equal(rows.w2.view(torch.uint8), down.view(torch.uint8))
    assert torch.equal(weights.w1_sf[:, :, :2 * inter // 128],
                       torch.cat([gate_s, up_s], 1).transpose(1, 2))
    assert torch.equal(weights.w2_sf[:, :, :hidden // 128], down_s.transpose(1, 2))
    # dequantized: weight * scale, bit for bit
    ref1, ref2 = _dequantized(tensors, experts, hidden, inter)
    got1, got2 = weights.dequantized()
    assert torch.equal(got1, ref1) and torch.equal(got2, ref2)
    # in chunks of experts: the same bits
    for chunk in (1, 3):
        chunked = ExpertWeights.from_fp8_blocks(gate, gate_s, up, up_s, down, down_s,
                                                chunk_experts=chunk)
        for name in _TENSOR_FIELDS:
            a, b = getattr(chunked, name), getattr(weights, name)
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8),
                                                            b.view(torch.uint8))


def test_loader_reads_a_rank_of_experts_in_chunks(tmp_path):
    pytest.importorskip("safetensors")
    from cute_megamoe.checkpoint import load_fp8_expert_weights, read_fp8_experts

    experts, hidden, inter = [4, 5, 6, 7, 8], 256, 128
    path, _ = _checkpoint(tmp_path, experts, hidden, inter, seed=1)
    whole = ExpertWeights.from_fp8_blocks(*read_fp8_experts(path, LAYER, experts))
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    for source, chunk in ((path, 2), (files, None), (files, 1)):
        loaded = load_fp8_expert_weights(source, LAYER, experts, chunk_experts=chunk)
        for name in _TENSOR_FIELDS:
            a, b = getattr(loaded, name), getattr(whole, name)
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8),
                                                            b.view(torch.uint8))
    # another model's names: a pattern
    from cute_megamoe.checkpoint import ExpertTensorNames

    with pytest.raises(ValueError, match="not in the checkpoint"):
        load_fp8_expert_weights(path, LAYER, experts, names=ExpertTensorNames(
            weight="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"))
    with pytest.raises(ValueError, match="experts.9.gate_proj.weight: not in the checkpoint"):
        load_fp8_expert_weights(path, LAYER, [4, 9])
    with pytest.raises(ValueError, match="experts"):
        load_fp8_expert_weights(path, LAYER, [])


def test_layer_on_published_fp8_experts_equals_reference_on_dequantized(tmp_path):
    """The layer built from the checkpoint (the CPU path: the reference on the weights the
    kernels hold) equals the reference run on the checkpoint's dequantized weights."""
    pytest.importorskip("safetensors")
    from cute_megamoe.checkpoint import load_fp8_expert_weights

    num_experts, hidden, inter, topk = 8, 256, 128, 2
    experts = list(range(num_experts))
    path, tensors = _checkpoint(tmp_path, experts, hidden, inter, seed=2)
    weights = load_fp8_expert_weights(path, LAYER, experts, chunk_experts=3)
    layer = cm.MegaMoE(None, num_experts, 64, topk, hidden, inter, "fp8xfp8", weights=weights,
                       device="cpu", activation_clamp=10.0)
    w1, w2 = _dequantized(tensors, experts, hidden, inter)
    gen = torch.Generator().manual_seed(5)
    for n, routing in ((40, "random"), (7, "masked")):
        idx, w = make_routing(n, num_experts, topk, routing, gen)
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
        ref = cm.mega_moe_reference([x], [idx], [w], [w1], [w2], recipe="fp8xfp8",
                                    activation_clamp=10.0).y[0]
        y = layer(x, idx, w)
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
        assert float(ref.float().abs().max()) > 0


def test_from_fp8_blocks_checks_its_arguments():
    gen = torch.Generator().manual_seed(3)
    gate, gs = _fp8_expert(gen, 128, 256)
    down, ds = _fp8_expert(gen, 256, 128)
    args = [gate[None], gs[None], gate[None], gs[None], down[None], ds[None]]
    ExpertWeights.from_fp8_blocks(*args)  # (valid)
    bad = list(args)
    bad[0] = gate[None].float()
    with pytest.raises(TypeError, match="gate: expected dtype torch.float8_e4m3fn"):
        ExpertWeights.from_fp8_blocks(*bad)
    bad = list(args)
    bad[3] = gs[None].clone().fill_(float("inf"))
    with pytest.raises(ValueError, match="up_scale: block scales must be finite"):
        ExpertWeights.from_fp8_blocks(*bad)
    bad = list(args)
    bad[5] = ds[None, :1]
    with pytest.raises(ValueError, match=r"down_scale: expected float32 block scales of shape"):
        ExpertWeights.from_fp8_blocks(*bad)
    with pytest.raises(ValueError, match="multiples of 128"):
        ExpertWeights.from_fp8_blocks(gate[None, :64], gs[None], gate[None, :64], gs[None],
                                      down[None, :, :64], ds[None])
    with pytest.raises(ValueError, match="fp8xfp8"):  # (Blackwell: no fp8xfp8 grouped GEMMs)
        ExpertWeights.from_fp8_blocks(*args, arch="sm_100a")
    # BF16 scales are taken exactly
    bf16 = list(args)
    for i in (1, 3, 5):
        bf16[i] = args[i].to(torch.bfloat16)
    a = ExpertWeights.from_fp8_blocks(*bf16).dequantized()[0]
    exact = [t.to(torch.bfloat16).float() if i in (1, 3, 5) else t for i, t in enumerate(args)]
    assert torch.equal(a, ExpertWeights.from_fp8_blocks(*exact).dequantized()[0])


@pytest.mark.parametrize("chunk", (1, 2))
def test_from_fp8_blocks_stays_within_its_memory_model(chunk):
    gen = torch.Generator().manual_seed(4)
    parts = [[_fp8_expert(gen, n, k) for _ in range(3)]
             for n, k in ((128, 256), (128, 256), (256, 128))]
    args = [torch.stack([p[i] for p in part]) for part in parts for i in (0, 1)]
    peak, kept, _ = peak_extra_bytes(
        lambda: ExpertWeights.from_fp8_blocks(*args, chunk_experts=chunk))
    assert 0 < peak <= chunk * FROM_FP8_BLOCKS_PEAK_FACTOR * 3 * 128 * 256
    assert ExpertWeights.from_fp8_blocks(*args, chunk_experts=ALL_EXPERTS).num_experts == 3


@pytest.mark.parametrize("recipe,arch", (("fp8xfp8", "sm_90a"), ("bf16xbf16", "sm_90a"),
                                         ("fp8xfp4", "sm_100a"), ("fp8xfp4_sm90", "sm_90a")))
def test_dequantized_expert_weights_are_the_reference_weights(recipe, arch):
    gen = torch.Generator().manual_seed(6)
    w1 = torch.randn(2, 256, 256, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(2, 256, 128, generator=gen).to(torch.bfloat16)
    got1, got2 = ExpertWeights.from_bf16(w1, w2, recipe, arch=arch).dequantized()
    for got, w in ((got1, w1), (got2, w2)):
        want = quant.dequantize_weights_for_recipe(quant.quantize_weights_for_recipe(w, recipe),
                                                   recipe)
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.gpu
def test_layer_on_gpu_on_published_fp8_experts_matches_reference(tmp_path):
    """The checkpoint loaded onto the GPU: the kernels' layer equals the reference on the
    dequantized weights (within the fp8xfp8 layer's tolerance; the same weights on both).
    Where safetensors is missing (the GPU machine has no package index), the same tensors go
    to `ExpertWeights.from_fp8_blocks` directly (the loader's reading is tested on the CPU)."""
    from cute_megamoe.runtime import get_arch

    if get_arch() != "sm_90a":
        pytest.skip("fp8xfp8 grouped GEMMs run on sm_90a (Blackwell: the torch experts)")
    num_experts, hidden, inter, topk = 8, 512, 256, 4
    experts = list(range(num_experts))
    try:
        from cute_megamoe.checkpoint import load_fp8_expert_weights

        path, tensors = _checkpoint(tmp_path, experts, hidden, inter, seed=7)
        weights = load_fp8_expert_weights(path, LAYER, experts, device="cuda", chunk_experts=3)
    except ImportError:
        tensors = _synthetic_tensors(experts, hidden, inter, seed=7)
        base = f"model.layers.{LAYER}.mlp.experts"
        weights = ExpertWeights.from_fp8_blocks(*(
            torch.stack([tensors[f"{base}.{e}.{proj}.weight{kind}"] for e in experts]).cuda()
            for proj in ("gate_proj", "up_proj", "down_proj") for kind in ("", "_scale_inv")),
            chunk_experts=3)
    layer = cm.MegaMoE(None, num_experts, 300, topk, hidden, inter, "fp8xfp8", weights=weights,
                       activation_clamp=10.0)
    w1, w2 = (w.cuda() for w in _dequantized(tensors, experts, hidden, inter))
    gen = torch.Generator().manual_seed(8)
    for n, routing in ((300, "random"), (129, "masked"), (1, "one_expert")):
        idx, w = make_routing(n, num_experts, topk, routing, gen)
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
        x, idx, w = x.cuda(), idx.cuda(), w.cuda()
        y = layer(x, idx, w)
        ref = cm.mega_moe_reference([x], [idx], [w], [w1], [w2], recipe="fp8xfp8",
                                    activation_clamp=10.0).y[0]
        err = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
        assert bool(torch.isfinite(y.float()).all())
        assert err < LAYER_TOLERANCE["fp8xfp8"], err
