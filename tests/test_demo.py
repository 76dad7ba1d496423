"""The demo (`python -m cute_megamoe.demo`): what it prints on the CPU and on a GPU.

CPU: it says plainly that it ran the reference (no kernels), prints no "against the reference"
line (that would compare the reference with itself) and shows where the error comes from
(fp8xfp4: nearly all of it the FP4 weights). GPU: it compares our kernels with the reference.
"""

import re

import pytest
import torch

from cute_megamoe import demo

SMALL = ["--tokens", "64", "--experts", "4", "--hidden", "256", "--intermediate", "128"]


def _number(out: str, label: str) -> float:
    m = re.search(re.escape(label) + r"[^\n]*?([0-9.]+e[-+][0-9]+)", out)
    assert m, f"no line {label!r} in:\n{out}"
    return float(m.group(1))


@pytest.mark.parametrize("recipe", ["fp8xfp4", "fp8xfp8", "bf16xbf16", "fp8xfp4_sm90"])
def test_demo_on_cpu_says_it_ran_the_reference(recipe, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    demo.main(["--recipe", recipe, *SMALL])
    out = capsys.readouterr().out
    assert "ran the pure-PyTorch reference on the CPU, not our kernels" in out
    assert "no CUDA GPU is present" in out
    assert "against the reference" not in out and "our kernels:" not in out
    assert f"the {recipe} recipe's error: {demo.ERROR_SOURCE[recipe]}" in out
    ref_err = _number(out, "the reference (the recipe's own error)")
    assert 0 < ref_err < 0.5
    if recipe == "bf16xbf16":
        assert "only the weights quantized" not in out
        assert ref_err < 2e-2
    else:
        weights_err = _number(out, "only the weights quantized")
        assert 0 < weights_err <= ref_err * 1.05
        if recipe != "fp8xfp8":  # the FP4 weights are nearly all of the error
            assert ref_err > 0.1 and weights_err > 0.8 * ref_err


@pytest.mark.parametrize("args,message", [
    (["--tokens", "-5"], "argument --tokens: expected an integer >= 1, got -5"),
    (["--topk", "20"], "argument --topk: at most --experts (16), got 20"),
    (["--hidden", "100"], "argument --hidden: expected a multiple of 128, got 100"),
    (["--experts", "x"], "argument --experts: invalid _positive value"),
    (["--clamp", "-1"], "argument --clamp: expected a number >= 0, got -1")])
def test_demo_refuses_bad_arguments_as_usage_errors(args, message, capsys):
    """A bad argument is a usage error naming it (exit status 2), not a traceback."""
    with pytest.raises(SystemExit) as info:
        demo.main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_cpu_flag_is_named(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --cpu wins over a GPU
    demo.main(["--cpu", "--recipe", "bf16xbf16", *SMALL])
    out = capsys.readouterr().out
    assert "not our kernels (--cpu was given)" in out and "against the reference" not in out


@pytest.mark.gpu
def test_demo_on_gpu_compares_our_kernels_with_the_reference(capsys):
    demo.main([])
    out = capsys.readouterr().out
    assert "ran on the GPU" in out
    ref_err = _number(out, "the reference (the recipe's own error)")
    ours_err = _number(out, "our kernels:")
    added = _number(out, "our kernels against the reference")
    # our kernels add little to the recipe's own error
    assert added < 0.25 * ref_err and abs(ours_err - ref_err) < 0.1 * ref_err
