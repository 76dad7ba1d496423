"""cute-megamoe: an expert-parallel Mixture-of-Experts layer as persistent CuTe DSL kernels.

Public API (see README.md):
* `get_symm_buffer_for_mega_moe`, `SymmBuffer`: the symmetric buffer and its views;
* `transform_weights_for_mega_moe` and the quantization helpers in `cute_megamoe.quant`;
* `stage_inputs`: quantize BF16 activations straight into the buffer (one kernel);
* `cute_megamoe.staged`: dispatch / combine kernels with any expert computation between them;
* `mega_moe_reference`: the pure-PyTorch definition of one call on all ranks.
"""

from .api import stage_inputs
from .buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from .quant import transform_weights_for_mega_moe
from .reference import mega_moe_reference

__version__ = "0.1.0"

__all__ = [
    "SymmBuffer",
    "get_symm_buffer_for_mega_moe",
    "mega_moe_reference",
    "stage_inputs",
    "transform_weights_for_mega_moe",
]
