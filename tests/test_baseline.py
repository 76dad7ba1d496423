"""The pure-PyTorch baseline layer (all_to_all_single + torch grouped GEMMs) against the
reference: one rank in-process, two ranks over gloo on the CPU (NCCL on GPUs)."""

import pytest
import torch

from cute_megamoe.quant import RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_baseline_one_rank_matches_reference(recipe):
    from cute_megamoe.testing.dispatch_checks import Case, check_baseline_layer

    for case in (Case((53,), "random", 1), Case((0,), "random", 2), Case((40,), "masked", 3)):
        check_baseline_layer(0, 1, case, recipe, 8, 2, 256, 128, torch.device("cpu"))


@pytest.mark.parametrize("recipe", ["fp8xfp4", "bf16xbf16"])
def test_baseline_two_ranks_gloo_matches_reference(recipe):
    from cute_megamoe.testing.dispatch_checks import run_baseline_multiprocess

    run_baseline_multiprocess(2, recipe, "gloo", port=29571 + RECIPES.index(recipe))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_baseline_two_ranks_nccl_matches_reference():
    from cute_megamoe.testing.dispatch_checks import run_baseline_multiprocess

    run_baseline_multiprocess(2, "fp8xfp4", "nccl", port=29581)
