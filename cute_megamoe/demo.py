"""Run a small MoE layer end to end and print its error and time.

    python -m cute_megamoe.demo [--recipe fp8xfp8] [--tokens 512] [--cpu]

With a CUDA GPU the layer runs on our kernels where they exist: on Hopper with the fp8xfp8
(default there) or bf16xbf16 recipe every step is ours (input staging, dispatch, the L1/L2
grouped GEMMs with the SwiGLU epilogue, combine: `stage_inputs` + `mega_moe`); otherwise
the expert GEMMs are `torch._grouped_mm` between our staging/dispatch/combine kernels. Without
a GPU (or with `--cpu`) it runs only `mega_moe_reference`, the pure-PyTorch definition of the
layer (default recipe fp8xfp4, DeepGEMM's).

Errors are against the same layer in float64 without any quantization. The reference's error is
the recipe's own (for fp8xfp4 about 20 %, nearly all of it the FP4 weights, which the demo shows
by quantizing only the weights); on a GPU the demo also prints our kernels' error against the
reference, which is what the kernels add.
"""

from __future__ import annotations

import argparse
import time

import torch

from .quant import dequantize_weights_for_recipe, quantize_weights_for_recipe
from .reference import expert_ffn_float64, mega_moe_reference
from .tables import RECIPES

# Where each recipe's error comes from (printed next to the reference's error).
ERROR_SOURCE = {
    "fp8xfp4": "nearly all FP4 (e2m1) weight quantization, 8 magnitudes per 32 values",
    "fp8xfp8": "FP8 (e4m3, 3 mantissa bits) weights and activations",
    "fp8xfp4_sm90": "nearly all FP4 (e2m1) weight quantization, decoded to FP8 blocks on chip",
    "bf16xbf16": "BF16 rounding between the steps and of the output",
}


def float64_layer(x, topk_idx, topk_weights, w1, w2, clamp):
    """The layer in float64 with no quantization and no intermediate rounding (one rank)."""
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w1.shape[0]):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y.index_add_(0, tok, expert_ffn_float64(x[tok], topk_weights[tok, slot], w1[e], w2[e],
                                                clamp))
    return y


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _positive(value: str) -> int:
    """An argparse type: an int >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return number


def _multiple_of_128(value: str) -> int:
    """An argparse type: a positive multiple of 128 (the recipes' scale blocks)."""
    number = _positive(value)
    if number % 128:
        raise argparse.ArgumentTypeError(f"expected a multiple of 128, got {value}")
    return number


def _clamp(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return number


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=None, choices=RECIPES,
                   help="default: fp8xfp8 on a Hopper GPU, else fp8xfp4")
    p.add_argument("--tokens", type=_positive, default=512)
    p.add_argument("--experts", type=_positive, default=16)
    p.add_argument("--topk", type=_positive, default=4, help="at most --experts")
    p.add_argument("--hidden", type=_multiple_of_128, default=1024)
    p.add_argument("--intermediate", type=_multiple_of_128, default=512)
    p.add_argument("--clamp", type=_clamp, default=10.0)
    p.add_argument("--cpu", action="store_true", help="run the reference even if a GPU exists")
    args = p.parse_args(argv)
    if args.topk > args.experts:
        p.error(f"argument --topk: at most --experts ({args.experts}), got {args.topk}")

    use_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if use_gpu else "cpu")
    hopper = use_gpu and torch.cuda.get_device_capability()[0] == 9
    if args.recipe is None:
        args.recipe = "fp8xfp8" if hopper else "fp8xfp4"
    gen = torch.Generator().manual_seed(0)
    n, e, k, h, i = args.tokens, args.experts, args.topk, args.hidden, args.intermediate
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    scores = torch.randn(n, e, generator=gen)
    topk_w, topk_idx = torch.topk(scores.softmax(-1), k, dim=-1)
    w1 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(torch.bfloat16)
    x, topk_idx, topk_w, w1, w2 = (t.to(device) for t in (x, topk_idx, topk_w, w1, w2))

    def run_reference():
        return mega_moe_reference([x], [topk_idx], [topk_w], [w1], [w2], recipe=args.recipe,
                                  activation_clamp=args.clamp).y[0]

    print(f"MoE layer: {n} tokens, {e} experts, top-{k}, hidden {h}, intermediate {i}, "
          f"recipe {args.recipe}")
    start = time.perf_counter()
    ref = run_reference()
    elapsed = time.perf_counter() - start
    if use_gpu:
        from . import api, fused, staged
        from .buffer import get_symm_buffer_for_mega_moe
        from .expert_gemm import SUPPORTED_RECIPES, ExpertWeights
        from .runtime import get_arch

        buf = get_symm_buffer_for_mega_moe(None, e, n, k, h, i, mma_type=args.recipe)
        arch = get_arch(device)
        ours = args.recipe in SUPPORTED_RECIPES.get(arch, ())
        one_kernel = False
        if ours:
            weights = ExpertWeights.from_bf16(w1, w2, args.recipe, arch=arch)
            y_out = torch.empty_like(x)
            one_kernel = fused.choose(None, buf, weights, num_tokens=n)  # as `api.mega_moe`

            def run():
                api.stage_inputs(buf, x, topk_idx, topk_w, validate_routing=False)
                return api.mega_moe(y_out, weights, buf, activation_clamp=args.clamp)
        else:
            weights = staged.TorchExpertWeights.from_bf16(w1, w2, args.recipe)

            def run():
                return staged.staged_mega_moe(buf, x, topk_idx, topk_w, weights,
                                              activation_clamp=args.clamp, block_m=64,
                                              validate_routing=False)

        y = run()  # compiles the kernels
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        iters = 20
        for _ in range(iters):
            y = run()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1e3 / iters
        print("ran on the GPU: " + (
            "our input staging + one persistent kernel (dispatch, grouped GEMMs, combine)"
            if one_kernel else
            "every step on our kernels (staging, dispatch, grouped GEMMs, combine)" if ours
            else "our staging, dispatch and combine kernels + torch._grouped_mm experts"))
    else:
        why = "--cpu was given" if args.cpu else "no CUDA GPU is present"
        print(f"ran the pure-PyTorch reference on the CPU, not our kernels ({why})")
    print(f"time per call: {elapsed * 1e3:.3f} ms")

    exact = float64_layer(x, topk_idx, topk_w, w1, w2, args.clamp)
    print("relative error against the same layer in float64 without quantization:")
    print(f"  the reference (the recipe's own error):  {rel_error(ref, exact):.3e}")
    if args.recipe != "bf16xbf16":
        w1q, w2q = (dequantize_weights_for_recipe(quantize_weights_for_recipe(w, args.recipe),
                                                  args.recipe) for w in (w1, w2))
        weights_only = float64_layer(x, topk_idx, topk_w, w1q, w2q, args.clamp)
        print(f"  float64 with only the weights quantized: {rel_error(weights_only, exact):.3e}")
    if use_gpu:
        print(f"  our kernels:                             {rel_error(y, exact):.3e}")
    print(f"  (the {args.recipe} recipe's error: {ERROR_SOURCE[args.recipe]})")
    if use_gpu:
        print(f"our kernels against the reference (what the kernels add): {rel_error(y, ref):.3e}")


if __name__ == "__main__":
    main()
