"""`bench.buffer_sizes`: DeepGEMM's buffer size formula reproduces the reference doc's own table
(section 2.4, EP8, FP8xFP4), and our layout's size is what the bench compares with it."""

import pytest

from bench.buffer_sizes import deepgemm_buffer_bytes

# (E, H, I, K, T after alignment) -> (Rg, total GiB) from the doc's table
DOC_ROWS = [
    ((384, 7168, 3072, 6, 768), 55_296, 0.87),
    ((384, 7168, 3072, 6, 4224), 221_184, 3.58),
    ((384, 7168, 3072, 6, 8448), 423_936, 6.90),
    ((384, 7168, 3072, 6, 33024), 786_432, 14.5),
    ((256, 4096, 2048, 6, 8448), 417_792, 4.08),
]


@pytest.mark.parametrize("shape,ring,total_gib", DOC_ROWS)
def test_deepgemm_formula_reproduces_the_reference_table(shape, ring, total_gib):
    e, h, i, k, t = shape
    parts = deepgemm_buffer_bytes(8, e, t, k, h, i)
    assert parts["ring_tokens"] == ring
    assert round(parts["total"] / 2**30, 2 if total_gib < 10 else 1) == total_gib
    assert parts["total"] == sum(v for name, v in parts.items()
                                 if name not in ("total", "ring_tokens"))


def test_tokens_align_to_384_and_bf16_doubles_the_rows():
    fp8 = deepgemm_buffer_bytes(2, 256, 8192, 8, 7168, 2048)
    assert fp8 == deepgemm_buffer_bytes(2, 256, 8448, 8, 7168, 2048)  # 8192 -> 8448
    bf16 = deepgemm_buffer_bytes(2, 256, 8192, 8, 7168, 2048, fp8=False)
    assert bf16["l2_ring"] == 2 * bf16["ring_tokens"] * 2048
    assert bf16["total"] > fp8["total"]
