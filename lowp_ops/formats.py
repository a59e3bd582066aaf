"""Format constants and quantized containers.

The containers are plain pytree-registered dataclasses of tensors, not ``torch.Tensor`` subclasses: a
subclass returned as the ``.grad`` of a compiled graph input fails in AOTAutograd (torch 2.11 and 2.13).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "E2M1_MAGNITUDES",
    "E8M0_EXPONENT_BIAS",
    "E8M0_NAN",
    "F4E2M1_MAX",
    "F8E4M3_MAX",
    "F8E5M2_MAX",
    "FP8_DTYPES",
    "MXFP8_BLOCK_SIZE",
    "NVFP4_BLOCK_SIZE",
    "NVFP4_GLOBAL_SCALE_NUMERATOR",
    "RHT_SIGN_MASK",
    "SCALE_LAYOUTS",
    "SCALE_TILE_COLS",
    "SCALE_TILE_ROWS",
    "MXFP8Tensor",
    "NVFP4GroupedTensor",
    "NVFP4Tensor",
]

MXFP8_BLOCK_SIZE = 32
"""Elements that share one E8M0 scale (1x32 row-wise, 32x1 column-wise)."""

SCALE_TILE_ROWS = 128
SCALE_TILE_COLS = 4
"""Compact scale buffers are padded to multiples of a 128x4 tile (the GEMM-swizzle tile)."""

F8E4M3_MAX = 448.0
F8E5M2_MAX = 57344.0

E8M0_EXPONENT_BIAS = 127
E8M0_NAN = 255
"""E8M0 codes: value 2^(e - 127) for e in 0..254; 255 is NaN; there is no zero."""

# fp32 bit patterns of 1/max_norm as TE's CUDA computes them (docs/mxfp8.md step 2: a multiply, not a divide).
E4M3_MAX_RCP_BITS = 0x3B124925
E5M2_MAX_RCP_BITS = 0x37924925

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in FP8_DTYPES.items()}
FP8_MAX: dict[str, float] = {"e4m3": F8E4M3_MAX, "e5m2": F8E5M2_MAX}
FP8_MAX_RCP_BITS: dict[str, int] = {"e4m3": E4M3_MAX_RCP_BITS, "e5m2": E5M2_MAX_RCP_BITS}


def fp32_from_bits(bits: int) -> float:
    """The fp32 value with the given bit pattern, as an exactly representable Python float."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def round_to_fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (what a Triton fp32 scalar argument holds)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


FP8_MAX_RCP: dict[str, float] = {name: fp32_from_bits(bits) for name, bits in FP8_MAX_RCP_BITS.items()}
"""fp32 ``1/max_norm`` exactly as TE's CUDA rounds it (448 * R = 1 + 0.375 ulp for E4M3)."""

NVFP4_BLOCK_SIZE = 16
"""Elements that share one E4M3 block scale (1x16, or 16x16 tiles for 2-D weights)."""

F4E2M1_MAX = 6.0
NVFP4_GLOBAL_SCALE_NUMERATOR = 2688.0
"""448 (E4M3 max) x 6 (E2M1 max): the global encode scale is ``2688 / amax``."""

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 code k (0..7) has this magnitude; code k + 8 is its negative (8 is -0)."""

RHT_SIGN_MASK = 0xD7E8
"""Bit i set: the 16-point random Hadamard transform negates input i (TE's fixed wgrad sign vector)."""

SCALE_LAYOUTS = ("compact", "swizzled")
MXFP8_USES = ("rowwise", "columnwise")
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def describe_tensor(value) -> str:
    """``dtype[shape]`` (and the device unless CPU) of a tensor, never its values; repr of anything else."""
    if not isinstance(value, torch.Tensor):
        return repr(value)
    device = "" if value.device.type == "cpu" else f" {value.device}"
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}{device}"


def container_repr(container, flags: tuple[str, ...], tensors: tuple[str, ...]) -> str:
    """``Name(shape=..., <flags>, <tensors as describe_tensor>)``: a few lines, not the padded buffers."""
    parts = [f"shape={tuple(container.shape)}"]
    parts += [f"{name}={getattr(container, name)!r}" for name in flags]
    parts += [f"{name}={describe_tensor(getattr(container, name))}" for name in tensors]
    return f"{type(container).__name__}({', '.join(parts)})"


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_mxfp8_fields(t: MXFP8Tensor) -> None:
    """Field consistency of an MXFP8Tensor; ValueErrors name the field. Leaves that are not tensors (a
    pytree map to other types) are not checked."""
    if not (isinstance(t.fp8_dtype, str) and t.fp8_dtype in FP8_DTYPES):
        names = f"{sorted(FP8_DTYPES)}, torch.float8_e4m3fn or torch.float8_e5m2"
        _fail(f"fp8_dtype must be one of {names}, got {t.fp8_dtype!r}")
    if t.scale_layout not in SCALE_LAYOUTS:
        _fail(f"scale_layout must be one of {list(SCALE_LAYOUTS)}, got {t.scale_layout!r}")
    expected = FP8_DTYPES[t.fp8_dtype]
    for data_name, scale_name in (("row_data", "row_scale"), ("col_data", "col_scale")):
        data, scale = getattr(t, data_name), getattr(t, scale_name)
        if (data is None) != (scale is None):
            _fail(f"{data_name} and {scale_name} must both be given or both be None")
        if isinstance(data, torch.Tensor) and data.dtype != expected:
            _fail(f"{data_name} has dtype {data.dtype} but fp8_dtype is {t.fp8_dtype!r} ({expected} data)")
        if isinstance(scale, torch.Tensor) and scale.dtype != torch.uint8:
            _fail(f"{scale_name} must hold uint8 E8M0 codes, got {scale.dtype}")


@dataclass(repr=False)
class MXFP8Tensor:
    """An MXFP8 tensor: FP8 data with one E8M0 scale per 32 elements, in up to two copies.

    The tensor is viewed as 2-D ``(rows, cols)`` with ``rows = prod(shape[:-1])``.

    - ``row_data``: ``shape``, FP8; 1x32 blocks along the last dim. ``row_scale``: uint8 E8M0 codes,
      ``[roundup(rows, 128), roundup(ceil(cols / 32), 4)]``.
    - ``col_data``: ``shape`` (not transposed), FP8; 32x1 blocks along the rows. ``col_scale``: uint8,
      ``[roundup(ceil(rows / 32), 4), roundup(cols, 128)]``.
    - A copy that was not asked for is ``None``. Scale padding is zero.
    - Data made here have rows ``ceil(cols / 16) * 16`` bytes apart (``row_data.stride(-2)``; the
      padding is not part of the tensor): the leading dimension an FP8 GEMM needs. Any data of the
      right shape and dtype are accepted.
    - ``scale_layout == "swizzled"``: the scale bytes are in the GEMM-swizzled order (128x4 tiles of
      512 bytes; column-wise scales swizzled as their transpose); the buffers keep the compact shapes.
    - ``fp8_dtype``: ``"e4m3"`` / ``"e5m2"`` (``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` are
      accepted and stored as their names); it must match the data's dtype, or construction raises.
    """

    row_data: torch.Tensor | None
    row_scale: torch.Tensor | None
    col_data: torch.Tensor | None
    col_scale: torch.Tensor | None
    fp8_dtype: str
    scale_layout: str
    shape: torch.Size

    def __post_init__(self) -> None:
        if isinstance(self.fp8_dtype, torch.dtype):
            self.fp8_dtype = FP8_DTYPE_NAMES.get(self.fp8_dtype, self.fp8_dtype)
        _check_mxfp8_fields(self)

    def __repr__(self) -> str:
        return container_repr(
            self, ("fp8_dtype", "scale_layout"), ("row_data", "row_scale", "col_data", "col_scale")
        )

    @classmethod
    def of_op_outputs(
        cls, row_data, row_scale, col_data, col_scale, fp8_dtype: str, scale_layout: str, shape
    ):
        """The container of an op's outputs, whose fields hold by the op's contract (a format name,
        fp8 data, uint8 scales, both or neither of each copy): built eagerly without the field checks
        (1.5 against 0.6 us on a CI-class CPU, of a small quantize call's 11-22 us). Under Dynamo the
        dataclass constructor runs (torch 2.11's Dynamo cannot trace the instance dict's ``update``: a
        graph break), checks included; they cost nothing at run time there."""
        if torch.compiler.is_compiling():
            return cls(row_data, row_scale, col_data, col_scale, fp8_dtype, scale_layout, shape)
        self = cls.__new__(cls)
        self.__dict__.update(
            row_data=row_data,
            row_scale=row_scale,
            col_data=col_data,
            col_scale=col_scale,
            fp8_dtype=fp8_dtype,
            scale_layout=scale_layout,
            shape=shape,
        )
        return self


_NVFP4_TENSORS = ("row_data", "row_scale", "col_data", "col_scale", "amax_rowwise", "amax_columnwise")


@dataclass(repr=False)
class NVFP4Tensor:
    """An NVFP4 tensor: E2M1 data (two per byte, element 2i in the low nibble) with one E4M3 scale per
    16 elements and an fp32 global amax per copy. The tensor is viewed as 2-D ``(M, K)``.

    - ``row_data``: uint8 ``(M, K/2)``; ``row_scale``: E4M3 bits as uint8,
      ``[roundup(M, 128), roundup(ceil(K/16), 4)]``, zero padding; ``amax_rowwise``: fp32 ``(1,)``.
    - ``col_data``: uint8 ``(K, M/2)``, the quantized *transpose* (of ``RHT(x^T)`` when ``rht``);
      ``col_scale``: ``[roundup(K, 128), roundup(ceil(M/16), 4)]``; ``amax_columnwise``: fp32 ``(1,)``.
    - ``rht``: the column-wise copy is in the Hadamard domain (False when there is none).
    - A copy that was not asked for is ``None``. Dequantized value:
      ``e2m1(q) * (fp32(scale) * amax * fp32(1/2688))`` (an amax >= 2^64 in units of 2^64, so that it
      cannot overflow: ``reference.nvfp4.staged_amax``).
    """

    row_data: torch.Tensor | None
    row_scale: torch.Tensor | None
    col_data: torch.Tensor | None
    col_scale: torch.Tensor | None
    amax_rowwise: torch.Tensor | None
    amax_columnwise: torch.Tensor | None
    rht: bool
    block_2d: bool
    shape: torch.Size

    def __repr__(self) -> str:
        return container_repr(self, ("rht", "block_2d"), _NVFP4_TENSORS)


@dataclass(repr=False)
class NVFP4GroupedTensor:
    """NVFP4 copies of tokens ``x`` (T, K) grouped by expert (``split_sizes``: E device ints, m_e rows
    each, in order); every expert is quantized as its own tensor, with its own amaxes.

    - ``row_data`` (T, K/2), ``row_scale`` [roundup(T, 128), roundup(ceil(K/16), 4)]: all rows in token
      order (the row-wise copy does not depend on the grouping except through the amaxes).
    - ``col_data`` (K * T / 2,): expert e's (K, m_e/2) transposed copy, contiguous, at byte
      ``K * row0_e / 2`` with ``row0_e = sum_{i<e} m_i`` (TE's grouped layout).
    - ``col_scale`` [roundup(K, 128), T // 16 + 4E]: expert e's [roundup(K, 128), roundup(ceil(m_e/16), 4)]
      block starts at column ``sum_{i<e} roundup(ceil(m_i/16), 4)``
      (``reference.nvfp4.group_col_scale_starts``); all other bytes are 0.
    - ``amax_rowwise``, ``amax_columnwise``: fp32 (E,): the given amaxes as given, else each expert's
      computed one (0 for an empty expert).
    - A copy that was not asked for is ``None``.
    - ``block_2d``: one scale per 16x16 tile within each expert (stacked expert weights), else 1x16.
    """

    row_data: torch.Tensor | None
    row_scale: torch.Tensor | None
    col_data: torch.Tensor | None
    col_scale: torch.Tensor | None
    amax_rowwise: torch.Tensor
    amax_columnwise: torch.Tensor
    split_sizes: torch.Tensor
    rht: bool
    shape: torch.Size
    block_2d: bool = False

    def __repr__(self) -> str:
        return container_repr(self, ("rht", "block_2d"), (*_NVFP4_TENSORS, "split_sizes"))


def _flatten_mxfp8(t: MXFP8Tensor):
    children = [t.row_data, t.row_scale, t.col_data, t.col_scale]
    return children, (t.fp8_dtype, t.scale_layout, tuple(t.shape))


def _unflatten_mxfp8(children, context) -> MXFP8Tensor:
    fp8_dtype, scale_layout, shape = context
    return MXFP8Tensor(*children, fp8_dtype=fp8_dtype, scale_layout=scale_layout, shape=torch.Size(shape))


pytree.register_pytree_node(
    MXFP8Tensor, _flatten_mxfp8, _unflatten_mxfp8, serialized_type_name="lowp_ops.formats.MXFP8Tensor"
)


def _flatten_nvfp4(t: NVFP4Tensor):
    children = [t.row_data, t.row_scale, t.col_data, t.col_scale, t.amax_rowwise, t.amax_columnwise]
    return children, (t.rht, t.block_2d, tuple(t.shape))


def _unflatten_nvfp4(children, context) -> NVFP4Tensor:
    rht, block_2d, shape = context
    return NVFP4Tensor(*children, rht=rht, block_2d=block_2d, shape=torch.Size(shape))


pytree.register_pytree_node(
    NVFP4Tensor, _flatten_nvfp4, _unflatten_nvfp4, serialized_type_name="lowp_ops.formats.NVFP4Tensor"
)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``a >= 0``, ``b > 0`` (blocks of ``b`` that cover ``a`` elements)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The least power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``, which is a
    ``constexpr_function`` in Triton >= 3.5: a host call through it costs several microseconds."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def round_up(a: int, b: int) -> int:
    """The least multiple of ``b`` that is ``>= a`` (``a >= 0``, ``b > 0``): padded sizes of scale tiles."""
    return ceil_div(a, b) * b


def _flatten_nvfp4_grouped(t: NVFP4GroupedTensor):
    children = [t.row_data, t.row_scale, t.col_data, t.col_scale, t.amax_rowwise, t.amax_columnwise]
    return [*children, t.split_sizes], (t.rht, tuple(t.shape), t.block_2d)


def _unflatten_nvfp4_grouped(children, context) -> NVFP4GroupedTensor:
    rht, shape, block_2d = context
    return NVFP4GroupedTensor(*children, rht=rht, shape=torch.Size(shape), block_2d=block_2d)


pytree.register_pytree_node(
    NVFP4GroupedTensor,
    _flatten_nvfp4_grouped,
    _unflatten_nvfp4_grouped,
    serialized_type_name="lowp_ops.formats.NVFP4GroupedTensor",
)
