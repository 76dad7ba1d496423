"""Host-side input checks of the public API (CPU; the GPU paths are in the kernel tests)."""

import pytest
import torch

from cute_megamoe.checks import check_routing, check_tensor


def test_check_routing_accepts_valid_and_masked_slots():
    idx = torch.tensor([[0, 5, -1], [7, -1, -1], [-1, -1, -1]])
    check_routing(idx, num_experts=8)
    check_routing(torch.zeros(0, 3, dtype=torch.int64), num_experts=8)


@pytest.mark.parametrize("bad", [8, 100, -2])
def test_check_routing_rejects_out_of_range(bad):
    idx = torch.tensor([[0, 1], [2, bad]])
    with pytest.raises(ValueError, match=f"topk_idx: expert index {bad} is out of range"):
        check_routing(idx, num_experts=8)


def test_check_routing_rejects_repeated_expert_in_a_token():
    idx = torch.tensor([[0, 1, 2], [3, 4, 3]])
    with pytest.raises(ValueError, match="token 1 names the same expert"):
        check_routing(idx, num_experts=8)


def test_check_tensor_names_the_argument():
    t = torch.zeros(4, 8)
    assert check_tensor("x", t, torch.float32, (4, 8), t.device) is t
    with pytest.raises(TypeError, match="x: expected dtype"):
        check_tensor("x", t, torch.bfloat16, (4, 8), t.device)
    with pytest.raises(ValueError, match="x: expected shape"):
        check_tensor("x", t, torch.float32, (4, 9), t.device)
    with pytest.raises(ValueError, match="x: must be contiguous"):
        check_tensor("x", t.t(), torch.float32, (8, 4), t.device)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        check_tensor("x", [1, 2], torch.float32, (2,), t.device)
