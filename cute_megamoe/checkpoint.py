"""Expert weights read from a model's safetensors files as published: FP8 block-scaled experts.

    weights = load_fp8_expert_weights("/models/DeepSeek-V3", layer=3, experts=range(32, 64),
                                      device="cuda")           # this rank's experts 32..63
    layer = cute_megamoe.MegaMoE(group, 256, 4096, 8, 7168, 2048, "fp8xfp8", weights=weights)

DeepSeek-V3 / R1 (and other FP8 releases in their format) store each routed expert's
``gate_proj`` / ``up_proj`` / ``down_proj`` weight as e4m3 ``[out, in]`` with a float32
``weight_scale_inv`` ``[out/128, in/128]``: one scale per 128x128 block, the dequantized weight
being ``weight * scale``. `load_fp8_expert_weights` finds them by name (`ExpertTensorNames`,
DeepSeek-V3's by default), reads a chunk of experts at a time and builds the fp8xfp8 weights
with `expert_gemm.ExpertWeights.from_fp8_blocks`: the checkpoint's codes and scales as they are
(no re-quantization, no rounding: the fp8xfp8 kernels take any f32 block scale), in bounded
memory (`chunks`: a chunk's tensors, then its prepared weights copied into the output).
`read_fp8_experts` returns the raw stacked tensors.

Needs the ``safetensors`` package (``pip install 'cute-megamoe[checkpoints]'``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .chunks import ALL_EXPERTS, chunk_experts_for
from .expert_gemm import FROM_FP8_BLOCKS_PEAK_FACTOR, ExpertWeights

__all__ = ["DEEPSEEK_V3", "ExpertTensorNames", "load_fp8_expert_weights", "read_fp8_experts"]


@dataclass(frozen=True)
class ExpertTensorNames:
    """How a checkpoint names an expert's tensors: ``weight`` formatted with ``layer``,
    ``expert`` (the global expert index) and ``proj`` (one of ``gate``, ``up``, ``down``),
    and ``scale`` formatted with ``weight`` (that tensor's name)."""

    weight: str = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    scale: str = "{weight}_scale_inv"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def of(self, layer: int, expert: int, proj: str) -> tuple[str, str]:
        """The (weight, scale) names of projection ``proj`` (the field's value, e.g.
        ``self.gate``) of one expert."""
        weight = self.weight.format(layer=layer, expert=expert, proj=proj)
        return weight, self.scale.format(weight=weight)


#: DeepSeek-V3 / R1's names (``model.layers.3.mlp.experts.17.gate_proj.weight`` and
#: ``..._scale_inv``).
DEEPSEEK_V3 = ExpertTensorNames()


def _safetensors():
    try:
        from safetensors import safe_open
    except ImportError as error:  # (an optional dependency)
        raise ImportError("reading checkpoints needs the safetensors package: pip install "
                          "'cute-megamoe[checkpoints]'") from error
    return safe_open


def _files(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A checkpoint directory's ``*.safetensors`` files, or the files given."""
    if isinstance(files, (str, os.PathLike)) and os.path.isdir(files):
        found = sorted(os.path.join(files, f) for f in os.listdir(files)
                       if f.endswith(".safetensors"))
        if not found:
            raise ValueError(f"files: no .safetensors files in {os.fspath(files)!r}")
        return found
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not paths:
        raise ValueError("files: expected a checkpoint directory or safetensors files")
    return [os.fspath(p) for p in paths]


class _Checkpoint:
    """Where each tensor name lives (a directory's ``model.safetensors.index.json`` when
    present, else every file's header), and its tensors read one at a time."""

    def __init__(self, files):
        paths = _files(files)
        self._open = _safetensors()
        self._where: dict[str, str] = {}
        index = os.path.join(os.path.dirname(paths[0]), "model.safetensors.index.json")
        if isinstance(files, (str, os.PathLike)) and os.path.isdir(files) \
                and os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._where = {k: os.path.join(os.path.dirname(index), v)
                           for k, v in weight_map.items()}
        else:
            for path in paths:
                with self._open(path, framework="pt") as f:
                    self._where.update(dict.fromkeys(f.keys(), path))
        self._count = len(paths)
        self._handles: dict[str, object] = {}

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def get(self, name: str) -> torch.Tensor:
        path = self._where.get(name)
        if path is None:
            raise ValueError(f"{name}: not in the checkpoint ({self._count} files); pass "
                             f"names=ExpertTensorNames(...) for another model's names")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = self._open(path, framework="pt").__enter__()
        return handle.get_tensor(name)


def _read(checkpoint: _Checkpoint, layer: int, experts: Sequence[int],
          names: ExpertTensorNames, device) -> tuple[torch.Tensor, ...]:
    out = []
    for proj in (names.gate, names.up, names.down):
        for which in (0, 1):  # weight, scale
            out.append(torch.stack([checkpoint.get(names.of(layer, e, proj)[which])
                                    for e in experts]).to(device))
    return tuple(out)


def _experts(experts) -> list[int]:
    experts = list(experts)
    if not experts or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0
                              for e in experts):
        raise ValueError(f"experts: expected expert indices >= 0, got {experts!r}")
    return experts


def read_fp8_experts(files, layer: int, experts: Sequence[int], *,
                     names: ExpertTensorNames = DEEPSEEK_V3,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The tensors of ``experts`` (global indices) of ``layer``, stacked in that order on
    ``device``: ``(gate, gate_scale, up, up_scale, down, down_scale)`` as
    `expert_gemm.ExpertWeights.from_fp8_blocks` takes them (e4m3 ``[E_l, I, H]`` /
    ``[E_l, H, I]``, scales ``[E_l, N/128, K/128]``). ``files``: a checkpoint directory (its
    ``model.safetensors.index.json`` if present) or safetensors files. All at once: for
    bounded memory use `load_fp8_expert_weights`."""
    with _Checkpoint(files) as checkpoint:
        return _read(checkpoint, layer, _experts(experts), names, device)


def load_fp8_expert_weights(files, layer: int, experts: Sequence[int], *,
                            names: ExpertTensorNames = DEEPSEEK_V3,
                            device: torch.device | str = "cpu", arch: str | None = None,
                            tiled: bool | None = None,
                            chunk_experts: int | None = None) -> ExpertWeights:
    """This rank's fp8xfp8 `ExpertWeights` of ``layer`` (``experts``: their global indices, in
    local order) from a checkpoint's FP8 block-scaled experts, exactly as published
    (`ExpertWeights.from_fp8_blocks`). Reads ``chunk_experts`` experts at a time (default: by
    the shapes, within a quarter of the output plus 1.5 GiB of temporaries), onto ``device``
    (``arch``: as `from_fp8_blocks`; the GPU's for CUDA, sm_90a on the CPU)."""
    experts = _experts(experts)
    with _Checkpoint(files) as checkpoint:
        first = checkpoint.get(names.of(layer, experts[0], names.gate)[0])
        inter, hidden = first.shape if first.dim() == 2 else (0, 0)
        size = 3 * len(experts) * inter * hidden  # (the e4m3 bytes: the output's size)
        # (per expert: its tensors as read, then `from_fp8_blocks`' temporaries)
        chunk = chunk_experts_for(len(experts), (FROM_FP8_BLOCKS_PEAK_FACTOR + 1) * 3 * inter
                                  * hidden, size, chunk_experts)

        def build(index: torch.Tensor) -> ExpertWeights:
            part = _read(checkpoint, layer, [experts[i] for i in index.tolist()], names,
                         device)
            return ExpertWeights.from_fp8_blocks(*part, arch=arch, tiled=tiled,
                                                 chunk_experts=ALL_EXPERTS)

        return ExpertWeights._chunked(build, (torch.arange(len(experts)),), chunk)
