"""lowp_ops: low-precision training ops that stay inside torch.compile graphs and CUDA graphs."""

from . import (
    library,  # noqa: F401  (registers torch.ops.lowp.*)
    nn,
)
from .formats import MXFP8Tensor, NVFP4GroupedTensor, NVFP4Tensor
from .functional import (
    cross_entropy,
    cross_entropy_with_mxfp8_grad,
    dglu,
    log_softmax,
    logsumexp,
    rms_norm,
    softmax,
    swiglu,
)
from .linear_cross_entropy import linear_cross_entropy
from .moe import grouped_swiglu_mlp
from .mxfp8 import mxfp8_dequantize, mxfp8_quantize
from .nvfp4 import nvfp4_dequantize, nvfp4_group_quantize, nvfp4_quantize

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.1.0"

__all__ = [
    "MXFP8Tensor",
    "NVFP4GroupedTensor",
    "NVFP4Tensor",
    "cross_entropy",
    "cross_entropy_with_mxfp8_grad",
    "dglu",
    "grouped_swiglu_mlp",
    "linear_cross_entropy",
    "log_softmax",
    "logsumexp",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "nn",
    "nvfp4_dequantize",
    "nvfp4_group_quantize",
    "nvfp4_quantize",
    "rms_norm",
    "softmax",
    "swiglu",
]
