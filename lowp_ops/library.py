"""THE place where the ``lowp::`` ops are defined and registered.

Pattern (torch_library_compile.md §0): the default implementation is the pure-PyTorch reference, so
every device works and CPU CI can trace, compile and ``opcheck``; ``register_kernel("cuda")`` calls the
Triton launcher; ``register_fake`` allocates through ``meta/``; backward formulas call backward ops.
Under ``TRITON_INTERPRET=1`` with ``LOWP_OPS_CPU_KERNELS=triton`` the CPU path runs the Triton kernels
in the interpreter instead, so the same op-level tests exercise them without a GPU.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .meta import mxfp8 as mxfp8_meta
from .reference import mxfp8 as mxfp8_ref


def cpu_runs_triton() -> bool:
    """True when CPU calls go to the Triton kernels through the interpreter (the ``interp`` test suite)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("LOWP_OPS_CPU_KERNELS") == "triton"


# ----------------------------------------------------------------------------------------------- MXFP8


@torch.library.custom_op("lowp::mxfp8_quantize", mutates_args=())
def mxfp8_quantize(x: Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool,
                   scale_layout: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (row_data, row_scale, col_data, col_scale), all uint8 (data hold FP8 bit patterns); a copy not
    asked for is a 0-element tensor."""
    if cpu_runs_triton():
        return _mxfp8_quantize_triton(x, fp8_dtype, rowwise, columnwise, scale_layout)
    return mxfp8_ref.mxfp8_quantize(x, fp8_dtype, rowwise, columnwise, scale_layout)


@mxfp8_quantize.register_kernel("cuda")
def _mxfp8_quantize_triton(x, fp8_dtype, rowwise, columnwise, scale_layout):
    from .kernels.mxfp8 import launch_mxfp8_quantize

    return launch_mxfp8_quantize(x, fp8_dtype, rowwise, columnwise, scale_layout)


mxfp8_quantize.register_fake(mxfp8_meta.mxfp8_quantize_outputs)


@torch.library.custom_op("lowp::mxfp8_dequantize", mutates_args=())
def mxfp8_dequantize(data: Tensor, scale: Tensor, fp8_dtype: str, use: str, scale_layout: str,
                     dtype: torch.dtype) -> Tensor:
    """-> ``dtype(fp8(data) * 2^(scale - 127))`` in data's shape; data holds FP8 bits as uint8."""
    if cpu_runs_triton():
        return _mxfp8_dequantize_triton(data, scale, fp8_dtype, use, scale_layout, dtype)
    return mxfp8_ref.mxfp8_dequantize(data, scale, fp8_dtype, use, scale_layout, dtype)


@mxfp8_dequantize.register_kernel("cuda")
def _mxfp8_dequantize_triton(data, scale, fp8_dtype, use, scale_layout, dtype):
    from .kernels.mxfp8 import launch_mxfp8_dequantize

    return launch_mxfp8_dequantize(data, scale, fp8_dtype, use, scale_layout, dtype)


mxfp8_dequantize.register_fake(mxfp8_meta.mxfp8_dequantize_output)
