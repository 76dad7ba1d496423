"""The expert FFN over the pool on our grouped-GEMM kernels.

    weights = ExpertWeights.from_bf16(w1, w2, "fp8xfp8")        # once, at load time
    out = expert_ffn(acts, acts_sf, topk_weights, expert_recv_tokens, weights, block_m=128)

`acts` is the L1 pool `[P, H]` in the layout the dispatch fills (expert-major, expert `e` from
pool block `pool_block_offsets(counts, block_m)[e]`, pad rows to a multiple of `block_m`);
`expert_ffn` runs L1 (gate/up GEMM + SwiGLU + routing weight + FP8 requantization into the L2
pool) then L2, and returns BF16 `[P, H]` in pool order, pad rows unwritten. Everything is
checked on the host before the first launch.

Kernels per arch (`tables.GEMM_RECIPES`, also `SUPPORTED_RECIPES` here): Hopper
`kernels/sm90_expert_gemm.py` (fp8xfp8, bf16xbf16, GPU-tested; fp8xfp4_sm90: MXFP4 weights
decoded on chip to fp8xfp8's); Blackwell
`kernels/sm100_expert_gemm.py` (fp8xfp4, bf16xbf16; compiled and SASS-checked for sm_100a, never
run: no Blackwell GPU was available). The launches themselves are built in `launch.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from . import quant
from .checks import (
    check_cuda_device,
    check_gemm_block_m,
    check_mn_major,
    check_tensor,
    routing_check,
)
from .chunks import ALL_EXPERTS, chunk_experts_for, map_experts
from .config import Sm90GemmConfig, Sm100GemmConfig
from .heuristics import default_gemm_config, get_num_sms
from .kernels.common.gemm_config import SF_BLOCK, weight_sf_row_len
from .launch import expert_gemm_calls, gemm_kernel
from .runtime import get_arch
from .tables import BLOCK_MS, GEMM_RECIPES, activation_recipe, check_recipe, normalize_arch
from .utils import ceil_div

#: Recipes with grouped-GEMM kernels, per arch (`tables.GEMM_RECIPES`).
SUPPORTED_RECIPES = GEMM_RECIPES

#: Pool dtypes by activation recipe (`tables.activation_recipe`).
_ACT_DTYPE = {"fp8xfp8": torch.float8_e4m3fn, "fp8xfp4": torch.float8_e4m3fn,
              "bf16xbf16": torch.bfloat16}
_ACT_SF_DTYPE = {"fp8xfp8": torch.float32, "fp8xfp4": torch.int32}  # per 128 K / 4 x UE8M0
#: dtype of the L1 weight of each recipe (FP4: e2m1 packed two per byte).
_WEIGHT_DTYPE = {"fp8xfp8": torch.float8_e4m3fn, "fp8xfp4": torch.int8,
                 "bf16xbf16": torch.bfloat16, "fp8xfp4_sm90": torch.int8}
#: The recipe of MXFP4 weights on each arch (the dtype alone cannot tell them apart).
_FP4_RECIPE = {"sm_90a": "fp8xfp4_sm90", "sm_100a": "fp8xfp4"}
#: The L1, L2 fields holding f32 128x128 block scales: fp8xfp8's own, fp8xfp4_sm90's decode's.
_BLOCK_SF_FIELDS = {"fp8xfp8": ("w1_sf", "w2_sf"),
                    "fp8xfp4_sm90": ("w1_block_sf", "w2_block_sf")}


#: `ExpertWeights`' tensor fields (what the constructors build chunk by chunk).
_TENSOR_FIELDS = ("w1", "w2", "w1_sf", "w2_sf", "w1_block_sf", "w2_block_sf")
#: Peak temporaries of preparing one expert in a chunk, the chunk's result included (`chunks`;
#: measured on the CPU with `testing.memory` and rounded up): `ExpertWeights.from_bf16` in
#: bytes per BF16 master element of its L1 weight (measured 6, 5, 12.1, 12.1),
#: `ExpertWeights.from_quantized` as a multiple of its input bytes (1.7, 1.7, 1.7, 5.7).
FROM_BF16_PEAK_BYTES = {"fp8xfp8": 10, "bf16xbf16": 8, "fp8xfp4": 16, "fp8xfp4_sm90": 16}
FROM_QUANTIZED_PEAK_FACTOR = {"fp8xfp8": 3, "bf16xbf16": 3, "fp8xfp4": 3, "fp8xfp4_sm90": 7}


#: `ExpertWeights.from_fp8_blocks`' peak per expert, as a multiple of its e4m3 bytes: the
#: chunk's ``[gate | up]`` concatenation, then `FROM_QUANTIZED_PEAK_FACTOR`.
FROM_FP8_BLOCKS_PEAK_FACTOR = FROM_QUANTIZED_PEAK_FACTOR["fp8xfp8"] + 1


def _check_fp8_blocks(gate, gate_scale, up, up_scale, down, down_scale) -> tuple[int, int, int]:
    """`ExpertWeights.from_fp8_blocks`' argument checks; returns ``(E_l, H, I)``."""
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check_tensor(name, w, torch.float8_e4m3fn, for_kernel=False)
        if w.dim() != 3:
            raise ValueError(f"{name}: expected [E_l, N, K] e4m3 weights, got shape "
                             f"{tuple(w.shape)}")
    num, inter, hidden = gate.shape
    for name, w, shape in (("up", up, (num, inter, hidden)), ("down", down, (num, hidden, inter))):
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (gate is {tuple(gate.shape)}), "
                             f"got {tuple(w.shape)}")
    if hidden % SF_BLOCK or inter % SF_BLOCK:
        raise ValueError(f"gate: hidden ({hidden}) and intermediate ({inter}) must be multiples "
                         f"of {SF_BLOCK} (whole {SF_BLOCK}x{SF_BLOCK} scale blocks)")
    for name, sf, w in (("gate_scale", gate_scale, gate), ("up_scale", up_scale, up),
                        ("down_scale", down_scale, down)):
        check_tensor(name, sf, for_kernel=False)
        want = (num, w.shape[1] // SF_BLOCK, w.shape[2] // SF_BLOCK)
        if not sf.is_floating_point() or sf.element_size() < 2 or tuple(sf.shape) != want:
            raise ValueError(f"{name}: expected float32 block scales of shape {want} (one per "
                             f"{SF_BLOCK}x{SF_BLOCK} block of {tuple(w.shape)}), got "
                             f"{sf.dtype} {tuple(sf.shape)}")
        if not bool(torch.isfinite(sf).all()):
            raise ValueError(f"{name}: block scales must be finite")
    return num, hidden, inter


def _tensors_of(*trees) -> list[torch.Tensor]:
    """The tensors of weights given as tensors or (weight, scale) tuples (others skipped: the
    constructors' checks name them)."""
    out = []
    for tree in trees:
        for t in tree if isinstance(tree, tuple) else (tree,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _leading_dim(weights) -> int:
    """The experts of a weight tensor or (weight, scale) tuple (0 where it is neither)."""
    tensors = _tensors_of(weights)
    return tensors[0].shape[0] if tensors and tensors[0].dim() else 0


def _expert_numel(w) -> int:
    return w[0].numel() if isinstance(w, torch.Tensor) and w.dim() and len(w) else 0


def _k_major_block_sf(block_sf: torch.Tensor, n: int) -> torch.Tensor:
    """Block scales ``[E, N/128, K/128]`` as the sm90 kernels read them: ``[E, K/128, N/128]``,
    each row padded with 1.0 to ``weight_sf_row_len(N)`` entries."""
    return torch.nn.functional.pad(block_sf.transpose(1, 2),
                                   (0, weight_sf_row_len(n) - n // SF_BLOCK),
                                   value=1.0).contiguous()


def _block_weight_sf(rows_sf: torch.Tensor, name: str, gate_up: bool) -> torch.Tensor:
    """Per-row f32 scales ``[E, N, K/128]`` (L1: rows gate/up interleaved, as the transform
    returns them) -> the sm90 kernels' 128x128 block scales ``[E, K/128, N/128]`` (L1: row
    blocks of ``[gate | up]``), each row padded to ``weight_sf_row_len(N)`` entries. Raises
    unless the rows of every 128-row block agree."""
    num_experts, n, kb = rows_sf.shape
    if n % SF_BLOCK:
        raise ValueError(f"{name}: {n} weight rows are not whole blocks of {SF_BLOCK} (fp8xfp8 "
                         f"weights have one scale per {SF_BLOCK}x{SF_BLOCK} block: hidden and "
                         f"2 * intermediate must be multiples of {SF_BLOCK})")
    if gate_up:
        rows_sf = quant.deinterleave_gate_up(rows_sf)
    blocks = rows_sf.reshape(num_experts, n // SF_BLOCK, SF_BLOCK, kb)
    if not bool((blocks == blocks[:, :, :1]).all()):
        raise ValueError(f"{name}: scales must be equal within every block of {SF_BLOCK} rows "
                         f"(per-{SF_BLOCK}x{SF_BLOCK}-block scales)")
    return _k_major_block_sf(blocks[:, :, 0], n)


def _fp4_block_weight_sf(sf: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """Packed MXFP4 scales ``int32 [E, N, K/128]`` (L1: rows gate/up interleaved, as the
    sm_90a transform returns them) -> the f32 block scales ``2**b`` of
    `quant.fp4_weights_to_fp8_blocks` in the layout of `_block_weight_sf` (L1: row blocks of
    ``[gate | up]``, the blocks the weights are decoded by)."""
    if gate_up:
        sf = quant.deinterleave_gate_up(sf)
    return _k_major_block_sf(quant.fp4_block_scales(sf), sf.shape[1])


def weights_recipe(l1_weights: object, name: str = "l1_weights", arch: str | None = None) -> str:
    """The recipe of L1 weights as `quant.quantize_weights_for_recipe` or
    `quant.transform_weights_for_mega_moe` return them: a BF16 tensor (``bf16xbf16``) or a
    (weight, scale) pair with e4m3 (``fp8xfp8``) or packed-FP4 int8 weights: ``fp8xfp4``, or
    ``fp8xfp4_sm90`` for ``arch`` sm_90a (the dtype alone cannot tell them apart)."""
    if isinstance(l1_weights, torch.Tensor):
        if l1_weights.dtype != torch.bfloat16:
            raise TypeError(f"{name}: a plain tensor must be BF16 (bf16xbf16), got "
                            f"{l1_weights.dtype}")
        return "bf16xbf16"
    if not (isinstance(l1_weights, tuple) and len(l1_weights) == 2
            and isinstance(l1_weights[0], torch.Tensor)):
        raise TypeError(f"{name}: expected a BF16 tensor or a (weight, scale) tuple, got "
                        f"{type(l1_weights).__name__}")
    if l1_weights[0].dtype == torch.float8_e4m3fn:
        return "fp8xfp8"
    if l1_weights[0].dtype == torch.int8:
        return "fp8xfp4" if arch is None else _FP4_RECIPE[normalize_arch(arch)]
    raise TypeError(f"{name}[0]: expected torch.float8_e4m3fn (FP8) or torch.int8 (packed "
                    f"FP4) weights, got {l1_weights[0].dtype}")


def _device_arch(like: object) -> str | None:
    """The arch of the CUDA device ``like``'s tensors (a tensor or a tuple) live on, or None."""
    tensor = like[0] if isinstance(like, tuple) else like
    return get_arch(tensor.device) if isinstance(tensor, torch.Tensor) and tensor.is_cuda \
        else None


def _resolve_arch(arch: str | None, recipe: str, like: object) -> str:
    """``arch`` normalized; None: the arch of the CUDA device ``like``'s tensors live on, else
    the one arch with grouped-GEMM kernels for ``recipe``, else (bf16xbf16 on the CPU) the
    current CUDA device's. Raises naming the recipe if that arch has no kernels for it (and,
    for MXFP4, the recipe that runs them there)."""
    if arch is None:
        arch = _device_arch(like)
    if arch is None:
        candidates = [a for a, recipes in GEMM_RECIPES.items() if recipe in recipes]
        if len(candidates) == 1:
            arch = candidates[0]
        elif torch.cuda.is_available():
            arch = get_arch()
        else:
            raise ValueError(f"arch: {recipe} weights on the CPU without a GPU: give the arch "
                             f"they are for ({', '.join(candidates)})")
    arch = normalize_arch(arch)
    if recipe not in GEMM_RECIPES[arch]:
        fp4 = _FP4_RECIPE[arch] if recipe in _FP4_RECIPE.values() else None
        hint = "" if fp4 is None else f"; MXFP4 weights run on the {arch} kernels as recipe {fp4!r}"
        raise ValueError(
            f"recipe {recipe!r} has no grouped-GEMM kernels on {arch!r} (supported: "
            f"{GEMM_RECIPES}){hint}; run it with torch expert GEMMs between our kernels: "
            f"cute_megamoe.MegaMoE, cute_megamoe.fp8_fp4_mega_moe, or "
            f"staged.staged_mega_moe with staged.TorchExpertWeights")
    return arch


@dataclass
class ExpertWeights:
    """One rank's expert weights as the grouped GEMMs of ``arch`` read them.

    ``w1`` ``[E_l, 2I, H]`` with gate/up rows interleaved by 8 and ``w2`` ``[E_l, H, I]``:

    * ``fp8xfp8`` (sm_90a): e4m3, with ``w1_sf`` ``[E_l, H/128, 2I/128]`` and ``w2_sf``
      ``[E_l, I/128, H/128]`` f32: the 128x128 block scales, K-block major (``w1_sf`` row blocks
      in ``[gate | up]`` order, i.e. before the interleave), the last dim padded up to a multiple
      of 4 (16-byte rows; the pad is never read);
    * ``bf16xbf16`` (sm_90a, sm_100a): bf16, no scales;
    * ``fp8xfp4`` (sm_100a): e2m1 packed two per byte (int8, last dim halved), with ``w1_sf``
      ``[E_l, H/128, 2I]`` and ``w2_sf`` ``[E_l, I/128, H]`` int32 (UE8M0 per 32, packed four per
      word, UTCCP row order, MN-major: ``quant.weight_sf_for_sm100``);
    * ``fp8xfp4_sm90`` (sm_90a): the same MXFP4 weights, the codes of each 32-bit word in the
      order the on-chip decode reads (`quant.fp4_words_for_sm90_decode`: `from_transformed`
      converts), and ``w1_sf`` / ``w2_sf`` shapes, rows
      in plain order (the sm_90a transform: no UTCCP), which the kernels decode on chip to
      fp8xfp8's format (`quant.fp4_weights_to_fp8_blocks`), plus ``w1_block_sf``
      ``[E_l, H/128, 2I/128]`` and ``w2_block_sf`` ``[E_l, I/128, H/128]`` f32: the decode's
      power-of-two block scales ``2**b``, laid out as fp8xfp8's ``w1_sf`` / ``w2_sf``
      (`decoded_fp8` is the fp8xfp8 weights the decode must equal). None for other recipes.

    ``arch`` (any spelling; stored as ``"sm_90a"`` / ``"sm_100a"``) defaults to the arch of the
    GPU the weights live on; for weights on the CPU, to the one arch with kernels for the
    recipe (fp8xfp8, fp8xfp4_sm90: sm_90a; fp8xfp4: sm_100a) or, for bf16xbf16, the current
    GPU's (give it explicitly without a GPU). A recipe without grouped-GEMM kernels on the arch
    raises (`tables.GEMM_RECIPES`): use `staged.TorchExpertWeights` there.

    ``tiled`` (sm_90a fp8xfp8 / bf16xbf16, and fp8xfp4_sm90 as an A/B option): ``w1`` / ``w2``
    keep their shapes but hold each 128-row block's k-blocks (128 bytes; MXFP4: 64 bytes of
    packed codes) as contiguous 128-row boxes (`tile_weight_rows`), the order the grouped
    GEMMs' TMA loads read them in: each load is one run of HBM instead of 128 short ones
    (fp8xfp8: 0.93-0.94x the decode-size GEMM time on an H200, 2026-12-02). The constructors
    (`from_transformed`, `from_quantized`, `from_bf16`) store fp8xfp8 / bf16xbf16 weights so by
    default where the shapes are whole boxes (`tiles_weights`; ``tiled=False`` keeps row
    order); `tiled_copy` / `untiled_copy` convert.
    """

    recipe: str
    w1: torch.Tensor
    w2: torch.Tensor
    w1_sf: torch.Tensor | None = None
    w2_sf: torch.Tensor | None = None
    arch: str | None = None
    w1_block_sf: torch.Tensor | None = None
    w2_block_sf: torch.Tensor | None = None
    tiled: bool = False

    def __post_init__(self) -> None:
        check_recipe(self.recipe)
        self.arch = _resolve_arch(self.arch, self.recipe, self.w1)
        if self.tiled and (self.arch != "sm_90a" or self.recipe not in TILEABLE_RECIPES):
            raise ValueError(f"tiled: sm_90a {' / '.join(TILEABLE_RECIPES)} weights only, not "
                             f"{self.recipe} on {self.arch}")

    def tiled_copy(self) -> ExpertWeights:
        """These weights with ``w1`` / ``w2`` in the tiled storage order (``tiled``)."""
        if self.tiled:
            return self
        box = _box_bytes(self.recipe)
        return replace(self, w1=tile_weight_rows(self.w1, box_bytes=box),
                       w2=tile_weight_rows(self.w2, box_bytes=box), tiled=True)

    def untiled_copy(self) -> ExpertWeights:
        """These weights with ``w1`` / ``w2`` in plain row order (``tiled`` False)."""
        if not self.tiled:
            return self
        box = _box_bytes(self.recipe)
        return replace(self, w1=untile_weight_rows(self.w1, box_bytes=box),
                       w2=untile_weight_rows(self.w2, box_bytes=box), tiled=False)

    def _stored(self, tiled: bool | None) -> ExpertWeights:
        """The constructors' storage order: ``tiled`` True / False, None the default (tiled
        where the sm_90a kernels read tiles and the shapes are whole tiles: `tiles_weights`)."""
        if tiled is None:
            tiled = tiles_weights(self.recipe, self.arch, self.w1, self.w2)
        return self.tiled_copy() if tiled else self

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2] * (2 if self.recipe in _FP4_RECIPE.values() else 1)

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w1.device

    @classmethod
    def from_transformed(cls, l1_weights, l2_weights, recipe: str | None = None,
                         arch: str | None = None, tiled: bool | None = None) -> ExpertWeights:
        """From what `quant.transform_weights_for_mega_moe` returned for ``arch`` (DeepGEMM's
        layout: for fp8xfp4 its default, the sm_100a one; fp8xfp4_sm90 the sm_90a one).
        ``recipe`` defaults to the weights' own (`weights_recipe` for ``arch``: MXFP4 weights
        are fp8xfp4_sm90 on sm_90a); ``arch`` as in the class doc. No copy where the layouts
        agree (bf16xbf16, and fp8xfp4 scales that are MN-major as DeepGEMM's are)."""
        found = weights_recipe(l1_weights, arch=_device_arch(l1_weights) if arch is None
                               else arch)
        fp4 = _FP4_RECIPE.values()
        if recipe is not None and check_recipe(recipe) != found:
            if not (recipe in fp4 and found in fp4):  # (else the arch decides, below)
                raise TypeError(f"l1_weights: {found} weights, expected {recipe}")
            found = recipe
        recipe = found
        arch = _resolve_arch(arch, recipe, l1_weights)
        if recipe == "bf16xbf16":
            if not isinstance(l2_weights, torch.Tensor) or l2_weights.dtype != torch.bfloat16:
                raise TypeError("l2_weights: bf16xbf16 weights must be a BF16 tensor")
            return cls(recipe, l1_weights.contiguous(), l2_weights.contiguous(),
                       arch=arch)._stored(tiled)
        if not (isinstance(l2_weights, tuple) and len(l2_weights) == 2
                and isinstance(l2_weights[0], torch.Tensor)
                and l2_weights[0].dtype == l1_weights[0].dtype):
            raise TypeError(f"l2_weights: expected a ({_WEIGHT_DTYPE[recipe]}, scale) tuple "
                            f"like l1_weights")
        w1, w2 = l1_weights[0].contiguous(), l2_weights[0].contiguous()
        if recipe == "fp8xfp8":
            sf1 = _block_weight_sf(l1_weights[1], "l1_weights[1]", gate_up=True)
            sf2 = _block_weight_sf(l2_weights[1], "l2_weights[1]", gate_up=False)
        elif recipe == "fp8xfp4":
            sf1 = quant.weight_sf_for_sm100(l1_weights[1])
            sf2 = quant.weight_sf_for_sm100(l2_weights[1])
        else:
            rows1 = check_tensor("l1_weights[1]", l1_weights[1], torch.int32, for_kernel=False)
            rows2 = check_tensor("l2_weights[1]", l2_weights[1], torch.int32, for_kernel=False)
            for name, packed, size in (("hidden", w1, "l1_weights[0].shape[2] * 2"),
                                       ("intermediate", w2, "l2_weights[0].shape[2] * 2")):
                if packed.dim() != 3 or packed.shape[2] % 16:
                    raise ValueError(f"{recipe} weights: {name} ({size} = "
                                     f"{2 * packed.shape[-1]}) must be a multiple of 32 (whole "
                                     f"groups of 32 codes with one UE8M0 scale each)")
            w1 = quant.fp4_words_for_sm90_decode(w1)
            w2 = quant.fp4_words_for_sm90_decode(w2)
            return cls(recipe, w1, w2, rows1.transpose(1, 2).contiguous(),
                       rows2.transpose(1, 2).contiguous(), arch=arch,
                       w1_block_sf=_fp4_block_weight_sf(rows1, gate_up=True),
                       w2_block_sf=_fp4_block_weight_sf(rows2, gate_up=False))._stored(tiled)
        return cls(recipe, w1, w2, sf1, sf2, arch=arch)._stored(tiled)

    @classmethod
    def from_quantized(cls, l1_weights, l2_weights, recipe: str, arch: str | None = None,
                       tiled: bool | None = None, *,
                       chunk_experts: int | None = None) -> ExpertWeights:
        """From `quant.quantize_weights_for_recipe` outputs (gate | up rows, not interleaved).
        ``chunk_experts`` experts at a time (`chunks`; default: by the shapes, within a quarter
        of the output plus 1.5 GiB of temporaries); the result does not depend on it."""
        check_recipe(recipe)
        arch = _resolve_arch(arch, recipe, l1_weights)

        def build(l1, l2):
            t1, t2 = quant.transform_weights_for_mega_moe(l1, l2, arch=arch,
                                                          chunk_experts=ALL_EXPERTS)
            return cls.from_transformed(t1, t2, recipe, arch, tiled)

        size = sum(t.numel() * t.element_size() for t in _tensors_of(l1_weights, l2_weights))
        num = _leading_dim(l1_weights)
        chunk = chunk_experts_for(num, FROM_QUANTIZED_PEAK_FACTOR[recipe] * size // max(num, 1),
                                  size, chunk_experts)
        return cls._chunked(build, (l1_weights, l2_weights), chunk)

    @classmethod
    def from_bf16(cls, w1: torch.Tensor, w2: torch.Tensor, recipe: str,
                  arch: str | None = None, tiled: bool | None = None, *,
                  chunk_experts: int | None = None) -> ExpertWeights:
        """Quantize BF16 master weights ``[E_l, 2I, H]`` / ``[E_l, H, I]`` as the reference does.
        ``chunk_experts`` experts at a time (`chunks`; default: by the shapes, within a quarter
        of the output plus 1.5 GiB of temporaries); the result does not depend on it."""
        check_recipe(recipe)
        arch = _resolve_arch(arch, recipe, w1)

        def build(p1, p2):
            return cls.from_quantized(
                quant.quantize_weights_for_recipe(p1, recipe, chunk_experts=ALL_EXPERTS),
                quant.quantize_weights_for_recipe(p2, recipe, chunk_experts=ALL_EXPERTS),
                recipe, arch, tiled, chunk_experts=ALL_EXPERTS)

        num = _leading_dim(w1)
        chunk = chunk_experts_for(
            num, FROM_BF16_PEAK_BYTES[recipe] * _expert_numel(w1),
            sum(quant.quantized_weight_bytes(tuple(w.shape), recipe) for w in (w1, w2)
                if isinstance(w, torch.Tensor) and w.dim() == 3), chunk_experts)
        return cls._chunked(build, (w1, w2), chunk)

    @classmethod
    def from_fp8_blocks(cls, gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor,
                        up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                        arch: str | None = None, tiled: bool | None = None, *,
                        chunk_experts: int | None = None) -> ExpertWeights:
        """fp8xfp8 weights from FP8 block-scaled expert weights as checkpoints publish them,
        without re-quantizing: DeepSeek-V3 / R1 hold each expert's ``gate_proj`` / ``up_proj``
        / ``down_proj`` weight as e4m3 with a float32 ``weight_scale_inv`` per 128x128 block,
        the dequantized weight being ``weight * scale`` (`checkpoint.load_fp8_experts` reads
        them from safetensors files).

        Args:
            gate, up: e4m3 ``[E_l, I, H]``; down: e4m3 ``[E_l, H, I]`` (``[out, in]``, as
                ``nn.Linear`` stores them).
            gate_scale, up_scale, down_scale: their block scales ``[E_l, N/128, K/128]`` for a
                weight ``[E_l, N, K]``; float32 (BF16 / FP16 are converted, exactly), finite.
            arch, tiled, chunk_experts: as `from_bf16` (``arch``: sm_90a, the arch with
                fp8xfp8 grouped-GEMM kernels).

        Exact: the fp8xfp8 kernels take any f32 block scale (each 128-deep k-block's partial
        sums are multiplied by the activation scale times the weight block's scale in f32,
        DeepGEMM's SM90 promotion; only the activations' scales are powers of two), so the
        checkpoint's e4m3 codes and scales are the kernels' operands bit for bit: no
        power-of-two condition on the scales, no rescaled code, no second rounding. The layer
        then computes what `reference.mega_moe_reference` computes on the dequantized weights
        (`dequantized`), up to the GEMMs' FP32 accumulation. Needs H and I to be multiples of
        128 (whole blocks; the gate and up blocks stay apart in ``[gate | up]``). Blackwell
        has no fp8xfp8 grouped GEMMs: there `staged.TorchExpertWeights.from_transformed` of
        `quant.transform_weights_for_mega_moe` of the same pairs runs them on BF16 weights
        (one rounding of ``weight * scale`` to BF16).
        """
        tensors = (gate, gate_scale, up, up_scale, down, down_scale)
        num, hidden, inter = _check_fp8_blocks(*tensors)
        arch = _resolve_arch(arch, "fp8xfp8", gate)

        def build(g, gs, u, us, d, ds):
            l1 = (torch.cat([g, u], dim=1), torch.cat([gs, us], dim=1).float())
            return cls.from_quantized(l1, (d, ds.float()), "fp8xfp8", arch, tiled,
                                      chunk_experts=ALL_EXPERTS)

        size = 3 * num * hidden * inter
        chunk = chunk_experts_for(num, FROM_FP8_BLOCKS_PEAK_FACTOR * size // max(num, 1), size,
                                  chunk_experts)
        return cls._chunked(build, tensors, chunk)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 weights the kernels compute with, in the reference's layout: ``w1``
        ``[E_l, 2I, H]`` (rows ``[gate | up]``, not interleaved) and ``w2`` ``[E_l, H, I]``
        (`reference.mega_moe_reference` takes them as they are; `MegaMoE` runs it on them on
        the CPU). fp8xfp8: each e4m3 code times its block's f32 scale (one f32 product);
        MXFP4: e2m1 times its UE8M0 scale (fp8xfp4_sm90: its on-chip decode's e4m3 blocks,
        `decoded_fp8`); BF16 as it is. All experts at once: 4 bytes per weight."""
        if self.recipe == "fp8xfp4_sm90":
            return self.decoded_fp8().dequantized()
        rows = self.untiled_copy()
        w1, w2 = quant.deinterleave_gate_up(rows.w1), rows.w2
        if self.recipe == "bf16xbf16":
            return w1.float(), w2.float()
        if self.recipe == "fp8xfp8":  # (block scales K-block major, rows padded)
            sf1 = self.w1_sf.transpose(1, 2)[:, : w1.shape[1] // SF_BLOCK].contiguous()
            sf2 = self.w2_sf.transpose(1, 2)[:, : w2.shape[1] // SF_BLOCK].contiguous()
        else:  # fp8xfp4: MN-major, UTCCP row order, L1 rows interleaved
            sf1 = quant.deinterleave_gate_up(quant.untranspose_sf_for_utccp(
                self.w1_sf.transpose(1, 2).contiguous()))
            sf2 = quant.untranspose_sf_for_utccp(self.w2_sf.transpose(1, 2).contiguous())
        return (quant.dequantize_weights_for_recipe((w1, sf1), self.recipe),
                quant.dequantize_weights_for_recipe((w2, sf2), self.recipe))

    @classmethod
    def _chunked(cls, build, args: tuple, chunk: int) -> ExpertWeights:
        """``build(*args)`` (an `ExpertWeights` from expert-major tensors) ``chunk`` experts at
        a time, each chunk's tensors copied into tensors for all experts (`chunks.map_experts`);
        one chunk: ``build(*args)``'s own tensors."""
        kept = {}

        def fields(*parts):
            part = build(*parts)
            kept.update(recipe=part.recipe, arch=part.arch, tiled=part.tiled)
            return tuple(getattr(part, name) for name in _TENSOR_FIELDS)

        out = map_experts(fields, args, chunk)
        return cls(**kept, **dict(zip(_TENSOR_FIELDS, out, strict=True)))

    def decoded_fp8(self) -> ExpertWeights:
        """fp8xfp4_sm90 only: the fp8xfp8 weights (same arch and device) that the kernels'
        on-chip decode must equal bit for bit, `quant.fp4_weights_to_fp8_blocks` of the
        ``[gate | up]`` rows; their ``w1_sf`` / ``w2_sf`` equal ``w1_block_sf`` /
        ``w2_block_sf``."""
        if self.recipe != "fp8xfp4_sm90":
            raise ValueError(f"decoded_fp8: fp8xfp4_sm90 weights only, these are {self.recipe}")
        rows = self.untiled_copy()  # (the codes in row order)
        sf1 = quant.deinterleave_gate_up(self.w1_sf.transpose(1, 2))
        w1 = quant.fp4_words_from_sm90_decode(rows.w1)
        l1 = quant.fp4_weights_to_fp8_blocks((quant.deinterleave_gate_up(w1), sf1))
        l2 = quant.fp4_weights_to_fp8_blocks((quant.fp4_words_from_sm90_decode(rows.w2),
                                              self.w2_sf.transpose(1, 2)))
        return ExpertWeights.from_quantized(l1, l2, "fp8xfp8", arch=self.arch, tiled=False)


def tile_weight_rows(w: torch.Tensor, rows: int = 128, box_bytes: int = 128) -> torch.Tensor:
    """``w`` ``[E, N, K]`` with each block of ``rows`` rows stored k-block by k-block (``box_bytes``
    of each row per k-block), every ``[rows, k-block]`` box contiguous; the shape is kept (the
    same bytes, in the order the sm_90a TMA weight boxes read them). ``N`` and ``K`` must be
    multiples of ``rows`` and of a k-block."""
    e, n, k = w.shape
    bk = box_bytes // w.element_size()
    if n % rows or k % bk:
        raise ValueError(f"tile_weight_rows: [{e}, {n}, {k}] is not a whole number of "
                         f"[{rows}, {bk}] boxes")
    return (w.reshape(e * n // rows, rows, k // bk, bk).permute(0, 2, 1, 3).contiguous()
            .view(e, n, k))


def untile_weight_rows(w: torch.Tensor, rows: int = 128, box_bytes: int = 128) -> torch.Tensor:
    """The inverse of `tile_weight_rows`: ``w`` ``[E, N, K]`` back in row order."""
    e, n, k = w.shape
    bk = box_bytes // w.element_size()
    if n % rows or k % bk:
        raise ValueError(f"untile_weight_rows: [{e}, {n}, {k}] is not a whole number of "
                         f"[{rows}, {bk}] boxes")
    return (w.reshape(e * n // rows, k // bk, rows, bk).permute(0, 2, 1, 3).contiguous()
            .view(e, n, k))


#: recipes whose sm_90a grouped GEMMs read tiled weights (`ExpertWeights.tiled`), and those the
#: constructors tile by default (MXFP4: an A/B option, not measured yet)
TILEABLE_RECIPES = ("fp8xfp8", "bf16xbf16", "fp8xfp4_sm90")
TILED_RECIPES = ("fp8xfp8", "bf16xbf16")


def _box_bytes(recipe: str) -> int:
    """Bytes of each weight row in one TMA box: a k-block (MXFP4: its packed codes)."""
    return 64 if recipe == "fp8xfp4_sm90" else 128


def tiles_weights(recipe: str, arch: str, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the constructors store these weights tiled by default: sm_90a, a recipe of
    `TILED_RECIPES`, and both tensors whole ``[128 rows, 128 bytes]`` boxes."""
    def whole(w):
        return (w.dim() == 3 and w.shape[1] % 128 == 0
                and w.shape[2] % (128 // w.element_size()) == 0)

    return arch == "sm_90a" and recipe in TILED_RECIPES and whole(w1) and whole(w2)


def _check_weights(weights: ExpertWeights, device: torch.device) -> tuple[int, int, int]:
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights: expected ExpertWeights, got {type(weights).__name__}")
    e_l, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    recipe = weights.recipe
    fp4 = recipe in _FP4_RECIPE.values()
    per_byte = 2 if fp4 else 1
    dtype = _WEIGHT_DTYPE[recipe]
    check_tensor("weights.w1", weights.w1, dtype, (e_l, 2 * inter, hidden // per_byte), device)
    check_tensor("weights.w2", weights.w2, dtype, (e_l, hidden, inter // per_byte), device)
    if fp4:
        check_tensor("weights.w1_sf", weights.w1_sf, torch.int32,
                     (e_l, hidden // 128, 2 * inter), device)
        check_tensor("weights.w2_sf", weights.w2_sf, torch.int32, (e_l, inter // 128, hidden),
                     device)
    fields = _BLOCK_SF_FIELDS.get(recipe)
    if fields is not None:
        for name, n, k in zip(fields, (2 * inter, hidden), (hidden, inter), strict=True):
            check_tensor(f"weights.{name}", getattr(weights, name), torch.float32,
                         (e_l, k // SF_BLOCK, weight_sf_row_len(n)), device)
    if recipe != "fp8xfp4_sm90" and (weights.w1_block_sf is not None
                                     or weights.w2_block_sf is not None):
        raise ValueError(f"weights.w1_block_sf, w2_block_sf: only for fp8xfp4_sm90, not "
                         f"{recipe}")
    return e_l, hidden, inter


def check_pool_capacity(expert_recv_tokens: torch.Tensor, block_m: int, pool_rows: int) -> None:
    """Raise unless every count is >= 0 and the experts' padded blocks fit in the pool
    (``sum(ceil(count / block_m)) * block_m <= pool_rows``); the kernels would write past the
    pool otherwise. Reads the counts back to the host (synchronizes)."""
    counts = [int(c) for c in expert_recv_tokens.tolist()]
    if any(c < 0 for c in counts):
        raise ValueError(f"expert_recv_tokens: counts must be >= 0, got {counts}")
    need = sum(ceil_div(c, block_m) for c in counts) * block_m
    if need > pool_rows:
        raise ValueError(f"expert_recv_tokens: the experts need {need} pool rows in blocks of "
                         f"{block_m}, the pool has {pool_rows}")


def _sf_view(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(cols, rows, dtype=dtype, device=device).t()


def expert_ffn(acts: torch.Tensor, acts_sf: torch.Tensor | None, topk_weights: torch.Tensor,
               expert_recv_tokens: torch.Tensor, weights: ExpertWeights, *, block_m: int,
               activation_clamp: float | None = None, fast_math: bool = True,
               l2_acts: torch.Tensor | None = None, l2_acts_sf: torch.Tensor | None = None,
               out: torch.Tensor | None = None, num_sms: int | None = None,
               validate_counts: bool | None = None,
               combine_buffer=None,
               expected_tokens_per_expert: float | None = None,
               config: Sm90GemmConfig | Sm100GemmConfig | None = None) -> torch.Tensor | None:
    """L1 + SwiGLU + L2 over the pool on our kernels; returns BF16 ``[P, H]`` (see module doc),
    or None with ``combine_buffer``.

    Args:
        acts: ``[P, H]`` e4m3 (fp8 recipes) or bf16 pool rows, ``P`` a multiple of ``block_m``.
        acts_sf: the activation scales, ``[P, H/128]`` with strides ``(1, P)``: f32
            (fp8xfp8, fp8xfp4_sm90) or int32 with four UE8M0 bytes (fp8xfp4); None for
            bf16xbf16.
        topk_weights: f32 ``[P]``, the routing weight of each pool row.
        expert_recv_tokens: int32 ``[E_l]`` rows per expert (on the device).
        weights: `ExpertWeights` of the same recipe as ``acts``, prepared for this GPU's arch.
        l2_acts, l2_acts_sf, out: optional outputs (the L2 pool ``[P, I]``, its scales
            ``[P, I/128]`` strides ``(1, P)``, and ``[P, H]`` bf16); allocated when None.
        validate_counts: check that the counts fit the pool (`check_pool_capacity`; a host
            synchronization, so not inside CUDA-graph capture). Default: unless the
            ``CUTE_MEGAMOE_CHECK_ROUTING`` setting is "off". The staged layer skips it: the
            dispatch sizes the pool for the worst case.
        combine_buffer: the `SymmBuffer` whose pool this is: L2 writes each row
            straight into its source rank's ``combine[slot, token]`` over NVLink, as the
            buffer's ``token_src_metadata`` (filled by the dispatch) says; ``out`` is not used.
            Collective in effect: the source ranks' combine reads these rows after its
            cross-rank barrier (`staged.combine` with ``expert_out=None``).
        expected_tokens_per_expert: the rows per expert the caller expects (e.g.
            `heuristics.expected_tokens_per_expert`): the heuristics pick the sm_90a mainloop
            and clusters by it (`heuristics.default_gemm_config`); None: not known. Any value
            gives the same outputs.
        config: the GEMMs' configuration for this GPU's arch (`config.Sm90GemmConfig`,
            `config.Sm100GemmConfig`; its ``block_m`` None or ``block_m``); fields left None
            (None: all of them) are the heuristics' choice. Any value gives the same outputs.
    """
    launches, out = _prepare_expert_ffn(
        acts, acts_sf, topk_weights, expert_recv_tokens, weights, block_m, activation_clamp,
        fast_math, l2_acts, l2_acts_sf, out, num_sms, validate_counts, combine_buffer,
        expected_tokens_per_expert, config)
    for launch in launches:
        launch()
    return out  # None with combine_buffer


def _prepare_expert_ffn(acts, acts_sf, topk_weights, expert_recv_tokens, weights, block_m,
                        activation_clamp, fast_math, l2_acts, l2_acts_sf, out, num_sms,
                        validate_counts, combine_buffer, expected_tokens_per_expert=None,
                        config=None):
    """The checks of `expert_ffn` and its two launches (not made yet), and its result."""
    if not isinstance(acts, torch.Tensor):
        raise TypeError(f"acts: expected a torch.Tensor, got {type(acts).__name__}")
    device = check_cuda_device("acts", acts.device)
    arch = get_arch(device)
    recipe = weights.recipe if isinstance(weights, ExpertWeights) else None
    if recipe not in GEMM_RECIPES[arch]:
        raise ValueError(f"expert_ffn: no grouped-GEMM kernels for recipe {recipe!r} on {arch} "
                         f"(supported: {GEMM_RECIPES})")
    if weights.arch != arch:
        raise ValueError(f"weights: prepared for {weights.arch}, this GPU is {arch}")
    e_l, hidden, inter = _check_weights(weights, device)
    check_gemm_block_m(block_m, arch)
    act_recipe = activation_recipe(recipe)
    act_dtype, sf_dtype = _ACT_DTYPE[act_recipe], _ACT_SF_DTYPE.get(act_recipe)
    if acts.dim() != 2 or acts.shape[1] != hidden:
        raise ValueError(f"acts: expected shape [P, {hidden}], got {tuple(acts.shape)}")
    pool_rows = acts.shape[0]
    if pool_rows % block_m != 0:
        raise ValueError(f"acts: pool rows ({pool_rows}) must be a multiple of block_m "
                         f"({block_m})")
    check_tensor("acts", acts, act_dtype, (pool_rows, hidden), device)
    check_tensor("topk_weights", topk_weights, torch.float32, (pool_rows,), device)
    check_tensor("expert_recv_tokens", expert_recv_tokens, torch.int32, (e_l,), device)
    if routing_check(None) != "off" if validate_counts is None else validate_counts:
        check_pool_capacity(expert_recv_tokens, block_m, pool_rows)
    if sf_dtype is not None:
        if acts_sf is None:
            raise ValueError(f"acts_sf: required for {recipe}")
        check_mn_major("acts_sf", acts_sf, sf_dtype, pool_rows, hidden // 128, device)
    elif acts_sf is not None:
        raise ValueError("acts_sf: must be None for bf16xbf16")
    if l2_acts is None:
        l2_acts = torch.empty(pool_rows, inter, dtype=act_dtype, device=device)
    check_tensor("l2_acts", l2_acts, act_dtype, (pool_rows, inter), device)
    if sf_dtype is not None:
        if l2_acts_sf is None:
            l2_acts_sf = _sf_view(pool_rows, inter // 128, sf_dtype, device)
        check_mn_major("l2_acts_sf", l2_acts_sf, sf_dtype, pool_rows, inter // 128, device)
    if combine_buffer is not None:
        combine_layout = combine_buffer.layout
        if out is not None:
            raise ValueError("out: must be None with combine_buffer (rows go to the combine "
                             "buffers)")
        if combine_buffer.device != device or combine_layout.num_pool_rows != pool_rows \
                or combine_layout.hidden != hidden or combine_layout.recipe != recipe:
            raise ValueError("combine_buffer: must be the symmetric buffer of this pool (same "
                             "device, pool rows, hidden size and recipe)")
    else:
        if out is None:
            out = torch.empty(pool_rows, hidden, dtype=torch.bfloat16, device=device)
        check_tensor("out", out, torch.bfloat16, (pool_rows, hidden), device)
    if arch == "sm_100a":
        # the sm100 epilogue stores 32- / 64-byte row chunks (`out` is None with a
        # combine_buffer, whose rows are 128-byte aligned)
        for name, t in (("l2_acts", l2_acts), ("out", out)):
            if t is not None and t.data_ptr() % 64 != 0:
                raise ValueError(f"{name}: data pointer must be 64-byte aligned on {arch}")
    grid = get_num_sms(device) if num_sms is None else num_sms
    if block_m == 256:
        grid -= grid % 2  # 2-CTA clusters
    if expected_tokens_per_expert is not None and not (
            isinstance(expected_tokens_per_expert, (int, float))
            and expected_tokens_per_expert >= 0):
        raise ValueError(f"expected_tokens_per_expert: a number >= 0 or None, got "
                         f"{expected_tokens_per_expert!r}")
    if config is not None and not isinstance(config, (Sm90GemmConfig, Sm100GemmConfig)):
        raise TypeError(f"config: None, an Sm90GemmConfig or an Sm100GemmConfig, got "
                        f"{type(config).__name__}")
    configs = expert_ffn_configs(arch, recipe, block_m, hidden, inter,
                                 expected_tokens_per_expert, combine_buffer is not None, config)
    calls = expert_gemm_calls(arch, recipe, grid, weights, acts, acts_sf, topk_weights,
                              expert_recv_tokens, l2_acts, l2_acts_sf, out, activation_clamp,
                              fast_math, combine_buffer, configs)
    return calls, out


@functools.lru_cache(maxsize=4096)
def expert_ffn_configs(arch: str, recipe: str, block_m: int, hidden: int, inter: int,
                       expected_tokens_per_expert: float | None, to_combine: bool,
                       config: Sm90GemmConfig | Sm100GemmConfig | None
                       ) -> tuple[Sm90GemmConfig | Sm100GemmConfig, ...]:
    """The complete configurations of the expert FFN's L1 and L2 (`heuristics.default_gemm_config`;
    remembered: a layer call's plan lookup asks for them every call). ``to_combine``: L2 sends
    its rows to the combine buffers."""
    return (default_gemm_config(arch, recipe, "l1", 2 * inter, block_m,
                                expected_tokens_per_expert, False, config),
            default_gemm_config(arch, recipe, "l2", hidden, block_m, expected_tokens_per_expert,
                                to_combine, config))


__all__ = ["BLOCK_MS", "SUPPORTED_RECIPES", "ExpertWeights", "check_pool_capacity", "expert_ffn",
           "expert_ffn_configs",
           "tile_weight_rows", "untile_weight_rows", "tiles_weights", "TILED_RECIPES",
           "TILEABLE_RECIPES",
           "gemm_kernel", "weights_recipe"]
