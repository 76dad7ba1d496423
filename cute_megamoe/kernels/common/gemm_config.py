"""Host-side checks shared by the grouped-GEMM kernels of every arch (`sm90_expert_gemm`,
`sm100_expert_gemm`): the arguments every one of them takes, validated the same way."""

from __future__ import annotations

import math

PHASES = ("l1", "l2")
SF_BLOCK = 128  # sm90 FP8 weight scales: one f32 per SF_BLOCK x SF_BLOCK weight block


def weight_sf_row_len(n: int) -> int:
    """Entries per k-block row of the sm90 FP8 weight block scales of an ``n``-row weight:
    ``n / SF_BLOCK`` rounded up to a multiple of 4 (16-byte rows for the bulk copies)."""
    return -(-(n // SF_BLOCK) // 4) * 4


def check_gemm_config(arch: str, phase: str, recipe: str, recipes: tuple[str, ...],
                      block_m: int, block_ms: tuple[int, ...],
                      multiples: tuple[tuple[str, int, int], ...],
                      activation_clamp: float | None) -> float | None:
    """Raise ``ValueError`` naming the argument on a bad phase, recipe, ``block_m``, a size that
    is not a positive multiple of what the kernel tiles it by (``(name, value, multiple)``), or
    a clamp that is not None / finite >= 0. Returns the clamp as a float (or None)."""
    if phase not in PHASES:
        raise ValueError(f"phase: expected one of {PHASES}, got {phase!r}")
    if recipe not in recipes:
        raise ValueError(f"recipe: {arch} grouped GEMMs support {recipes}, got {recipe!r}")
    if block_m not in block_ms:
        raise ValueError(f"block_m: expected one of {block_ms}, got {block_m}")
    for name, value, mult in multiples:
        if value <= 0 or value % mult != 0:
            raise ValueError(f"{name} ({value}) must be a positive multiple of {mult}")
    if activation_clamp is None:
        return None
    if not (activation_clamp >= 0 and math.isfinite(activation_clamp)):
        raise ValueError(f"activation_clamp must be None or finite >= 0, got {activation_clamp}")
    return float(activation_clamp)


def combine_target(phase: str, n: int, num_pool_rows: int, combine_layout) -> tuple[int, int, int]:
    """For an L2 GEMM that writes its rows into the source ranks' combine buffers of a
    symmetric buffer with `MegaMoELayout` ``combine_layout``: (byte offset of the ``combine``
    region, 128-byte aligned; its token slots ``T`` of ``[K, T, H]``; the ranks ``R``). Raises
    ``ValueError`` for L1 or a layout of another hidden size or pool."""
    if phase != "l2" or combine_layout.hidden != n or combine_layout.num_pool_rows != num_pool_rows:
        raise ValueError("combine_layout: only for L2, with N = hidden and the layout's pool rows")
    return combine_layout.offset("combine"), combine_layout.num_tokens, combine_layout.num_ranks
