"""The shared-memory bandwidth model of the sm_90a FP8 GEMM tiles (`bench.common`), against
the numbers docs/performance.md derives by hand ("Why DeepGEMM is faster at large M")."""

import pytest

from bench.common import smem_bound_tensor_share


@pytest.mark.parametrize("tile,bound", [
    ((128, 192, 192, False), 768 / 832),  # DeepGEMM's tiles (ncu: 92.1 % busy)
    ((128, 256, 128, False), 1024 / 1152),  # ours, two m64n128 chunks per warpgroup
    ((128, 256, 64, False), 1024 / 1408),  # ours, the "quarter" promotion
    ((128, 128, 128, False), 512 / 640),  # 128 x 128 tiles
    ((128, 256, 128, True), 1.0),  # A by ldmatrix once per k-block (the model only)
    ((128, 256, 64, True), 1.0),
])
def test_smem_bound_matches_the_hand_counts(tile, bound):
    assert smem_bound_tensor_share(*tile) == pytest.approx(bound)


def test_smem_bound_refuses_tiles_it_cannot_split():
    with pytest.raises(ValueError):
        smem_bound_tensor_share(96, 256, 128)
    with pytest.raises(ValueError):
        smem_bound_tensor_share(128, 192, 128)
