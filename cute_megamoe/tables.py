"""The package's tables: recipes, architectures, and which kernels exist where.

Every other module takes these names from here (a leaf module: it imports nothing from the
package). One spelling of an architecture is public, the CuTe DSL target name ``"sm_90a"`` /
``"sm_100a"`` (what `runtime.get_arch` returns, what ``cute.compile`` takes as ``--gpu-arch``,
what `expert_gemm.ExpertWeights.arch` holds); `normalize_arch` turns any accepted spelling
(``"sm90"``, ``"sm90a"``, ``"SM_100A"``, ``"sm100f"``) into it, at the edges of the API.
"""

from __future__ import annotations

__all__ = [
    "ARCHS",
    "ARCH_BY_MAJOR",
    "BLOCK_MS",
    "EXPERIMENTAL_FUSED_RECIPES",
    "FUSED_RECIPES",
    "GEMM_RECIPES",
    "RECIPES",
    "activation_recipe",
    "check_recipe",
    "has_gemm_kernels",
    "normalize_arch",
]

#: Recipes (activations x weights) the package understands. ``fp8xfp4_sm90``: MXFP4 weights
#: for Hopper, which has no FP4 MMA: its kernels decode them on chip to fp8xfp8's weight format
#: (`quant.fp4_weights_to_fp8_blocks`); its activations are fp8xfp8's (`activation_recipe`).
RECIPES: tuple[str, ...] = ("fp8xfp4", "fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")

#: Architectures with kernels, in their public (CuTe DSL target) spelling.
ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")

#: The architecture of a CUDA device by compute-capability major.
ARCH_BY_MAJOR: dict[int, str] = {9: "sm_90a", 10: "sm_100a"}

#: Recipes with grouped-GEMM expert kernels, per architecture. Elsewhere the expert GEMMs run
#: on torch ops between our dispatch and combine kernels (`staged.torch_experts`).
GEMM_RECIPES: dict[str, tuple[str, ...]] = {
    "sm_90a": ("fp8xfp8", "bf16xbf16", "fp8xfp4_sm90"),
    "sm_100a": ("fp8xfp4", "bf16xbf16"),
}

#: Recipes the fused single-kernel layer runs, per architecture (a subset of `GEMM_RECIPES`).
FUSED_RECIPES: dict[str, tuple[str, ...]] = {
    "sm_90a": ("fp8xfp8", "bf16xbf16", "fp8xfp4_sm90"),
    "sm_100a": ("fp8xfp4", "bf16xbf16"),
}

#: Fused recipes that run only as experiments (`config.LayerConfig.experimental_fused_fp4`):
#: fp8xfp4_sm90 matches the staged layer bit-exactly on the H200 and passed all of its GPU tests
#: on 12-04 (the loopback stops before were the test warm-ups': a kernel first loaded mid-call),
#: but it takes 1.29x the staged MXFP4 layer's time at 128 tokens (R = 1), and its one-rank
#: stalls of 12-01 / 12-04 fit the register handover fixed on 12-07, not yet soaked on a GPU
#: (docs/notes/register-handover.md).
EXPERIMENTAL_FUSED_RECIPES: dict[str, tuple[str, ...]] = {
    "sm_90a": ("fp8xfp4_sm90",),
    "sm_100a": (),
}

#: Recipes whose activations (buffer, staging, dispatch, combine, L2 input) are another's.
_ACTIVATION_RECIPE = {"fp8xfp4_sm90": "fp8xfp8"}

#: BLOCK_M values the grouped-GEMM kernels implement, per architecture (the heuristics choose
#: among them; dispatch and combine take any multiple of 16 up to the layout's maximum).
BLOCK_MS: dict[str, tuple[int, ...]] = {
    "sm_90a": (64, 128),
    "sm_100a": (64, 128, 256),
}

_ARCH_KEYS = {"sm90": "sm_90a", "sm100": "sm_100a"}


def normalize_arch(arch: str) -> str:
    """Any accepted spelling of an architecture -> its public one (``"sm_90a"`` / ``"sm_100a"``).

    ``"sm_90a"``, ``"sm90a"``, ``"sm90"`` -> ``"sm_90a"``; likewise ``"sm_100a"`` (and the
    ``f`` family suffix). Raises ``TypeError`` / ``ValueError`` naming the value otherwise.
    """
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected a str, got {type(arch).__name__}")
    key = arch.lower().replace("_", "")
    if key.endswith(("a", "f")):
        key = key[:-1]
    if key not in _ARCH_KEYS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    return _ARCH_KEYS[key]


def check_recipe(recipe: str, name: str = "recipe") -> str:
    """``recipe`` if it is one of `RECIPES`, else ``TypeError`` / ``ValueError`` naming it."""
    if not isinstance(recipe, str):
        raise TypeError(f"{name}: expected a str, got {type(recipe).__name__}")
    if recipe not in RECIPES:
        raise ValueError(f"{name}: expected one of {RECIPES}, got {recipe!r}")
    return recipe


def activation_recipe(recipe: str) -> str:
    """The recipe whose activation format ``recipe`` uses: the buffer's dtypes and sizes, the
    staging, dispatch and combine, and the L2 input's requantization (``"fp8xfp8"`` for
    ``"fp8xfp4_sm90"``; every other recipe its own)."""
    return _ACTIVATION_RECIPE.get(recipe, recipe)


def has_gemm_kernels(arch: str, recipe: str) -> bool:
    """Whether ``arch`` has grouped-GEMM expert kernels for ``recipe`` (`GEMM_RECIPES`)."""
    return recipe in GEMM_RECIPES[normalize_arch(arch)]
