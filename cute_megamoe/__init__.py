"""cute-megamoe: an expert-parallel Mixture-of-Experts layer as persistent CuTe DSL kernels.

Public API (see README.md):
* `get_symm_buffer_for_mega_moe`, `SymmBuffer`: the symmetric buffer and its views;
* `transform_weights_for_mega_moe` and the quantization helpers in `cute_megamoe.quant`;
* `stage_inputs`: quantize BF16 activations straight into the buffer (one kernel);
* `fp8_mega_moe` / `bf16_mega_moe`: one whole layer on staged inputs (dispatch, our grouped
  GEMMs, combine; Hopper: fp8xfp8 and bf16xbf16);
* `cute_megamoe.expert_gemm`: `ExpertWeights` and the grouped-GEMM expert FFN over the pool;
* `cute_megamoe.staged`: dispatch / combine kernels with any expert computation between them;
* `mega_moe_reference`: the pure-PyTorch definition of one call on all ranks.
"""

from .api import bf16_mega_moe, fp8_mega_moe, stage_inputs
from .buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from .quant import transform_weights_for_mega_moe
from .reference import mega_moe_reference

__version__ = "0.1.0"

__all__ = [
    "SymmBuffer",
    "bf16_mega_moe",
    "fp8_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "mega_moe_reference",
    "stage_inputs",
    "transform_weights_for_mega_moe",
]
