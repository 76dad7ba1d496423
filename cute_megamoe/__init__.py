"""cute-megamoe: an expert-parallel Mixture-of-Experts layer as persistent CuTe DSL kernels.

Public API (see README.md):
* `MegaMoE`: the layer as a ``torch.nn.Module`` (buffer, weights and settings fixed at
  construction; our kernels on CUDA, the reference on the CPU; a custom op for torch.compile);
* DeepGEMM's Mega MoE API, same names and signatures (`deepgemm_api`):
  `get_symm_buffer_for_mega_moe`, `transform_weights_for_mega_moe`, `fp8_fp4_mega_moe`,
  `bf16_mega_moe`; the caller fills the buffer's ``x`` / ``x_sf`` / ``topk_idx`` /
  ``topk_weights`` views;
* `SymmBuffer`: the symmetric buffer and its views;
* `stage_inputs`: quantize BF16 activations straight into the buffer (one kernel);
* `mega_moe` / `fp8_mega_moe`: one whole layer on staged inputs with our weights object
  (`expert_gemm.ExpertWeights`);
* `cute_megamoe.staged`: dispatch / combine kernels with any expert computation between them;
* `mega_moe_reference`: the pure-PyTorch definition of one call on all ranks;
* `cute_megamoe.quant`: DeepGEMM-compatible casts and weight transforms;
* `LayerConfig`, `Sm90GemmConfig`, `Sm90FusedConfig`, `Sm100GemmConfig` (`cute_megamoe.config`):
  the kernels' configuration, ``config=`` of the entry points (None fields: the heuristics').
"""

from .api import fp8_mega_moe, mega_moe, stage_inputs
from .buffer import SymmBuffer
from .config import LayerConfig, Sm90FusedConfig, Sm90GemmConfig, Sm100GemmConfig
from .deepgemm_api import (
    bf16_mega_moe,
    fp8_fp4_mega_moe,
    get_symm_buffer_for_mega_moe,
    transform_weights_for_mega_moe,
)
from .expert_gemm import ExpertWeights
from .module import MegaMoE, MegaMoEConfig
from .reference import mega_moe_reference
from .tables import ARCHS, RECIPES

__version__ = "0.1.0"

__all__ = [
    "ARCHS",
    "RECIPES",
    "ExpertWeights",
    "LayerConfig",
    "MegaMoE",
    "MegaMoEConfig",
    "Sm100GemmConfig",
    "Sm90FusedConfig",
    "Sm90GemmConfig",
    "SymmBuffer",
    "bf16_mega_moe",
    "fp8_fp4_mega_moe",
    "fp8_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "mega_moe",
    "mega_moe_reference",
    "stage_inputs",
    "transform_weights_for_mega_moe",
]
