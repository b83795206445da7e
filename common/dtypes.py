"""The one table between the wire's Dtype enum and torch dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.common.errors import InvalidArgument
from weightsync.v1 import tensor_pb2


@dataclass(frozen=True, slots=True)
class DtypeEntry:
    """One row of the table."""

    proto: int
    """The weightsync.v1.Dtype number."""
    torch_dtype: torch.dtype
    """The matching torch dtype."""
    itemsize: int
    """Bytes per element."""


_TABLE: tuple[DtypeEntry, ...] = (
    DtypeEntry(tensor_pb2.DTYPE_FLOAT32, torch.float32, 4),
    DtypeEntry(tensor_pb2.DTYPE_FLOAT16, torch.float16, 2),
    DtypeEntry(tensor_pb2.DTYPE_BFLOAT16, torch.bfloat16, 2),
    DtypeEntry(tensor_pb2.DTYPE_FLOAT64, torch.float64, 8),
    DtypeEntry(tensor_pb2.DTYPE_FLOAT8_E4M3FN, torch.float8_e4m3fn, 1),
    DtypeEntry(tensor_pb2.DTYPE_FLOAT8_E5M2, torch.float8_e5m2, 1),
    DtypeEntry(tensor_pb2.DTYPE_INT8, torch.int8, 1),
    DtypeEntry(tensor_pb2.DTYPE_UINT8, torch.uint8, 1),
    DtypeEntry(tensor_pb2.DTYPE_INT16, torch.int16, 2),
    DtypeEntry(tensor_pb2.DTYPE_INT32, torch.int32, 4),
    DtypeEntry(tensor_pb2.DTYPE_INT64, torch.int64, 8),
    DtypeEntry(tensor_pb2.DTYPE_BOOL, torch.bool, 1),
)

_BY_PROTO: dict[int, DtypeEntry] = {e.proto: e for e in _TABLE}
_BY_TORCH: dict[torch.dtype, DtypeEntry] = {e.torch_dtype: e for e in _TABLE}

SUPPORTED_PROTO_DTYPES: tuple[int, ...] = tuple(e.proto for e in _TABLE)


def entry_for_proto(value: int, *, tensor: str = "") -> DtypeEntry:
    """Look up a wire dtype; UNSPECIFIED or unknown numbers raise INVALID_ARGUMENT."""
    if value == tensor_pb2.DTYPE_UNSPECIFIED:
        raise InvalidArgument(
            "DTYPE_UNSPECIFIED",
            f"tensor {tensor!r} has dtype DTYPE_UNSPECIFIED",
            tensor=tensor,
        )
    entry = _BY_PROTO.get(value)
    if entry is None:
        raise InvalidArgument(
            "DTYPE_UNKNOWN",
            f"tensor {tensor!r} has unknown dtype number {value}",
            tensor=tensor,
            dtype=str(value),
        )
    return entry


def to_torch(value: int, *, tensor: str = "") -> torch.dtype:
    """Wire dtype number -> torch dtype."""
    return entry_for_proto(value, tensor=tensor).torch_dtype


def from_torch(dtype: torch.dtype) -> int:
    """torch dtype -> wire dtype number; unsupported dtypes raise ValueError."""
    entry = _BY_TORCH.get(dtype)
    if entry is None:
        supported = ", ".join(str(e.torch_dtype) for e in _TABLE)
        raise ValueError(f"dtype {dtype} is not supported by weightsync (supported: {supported})")
    return entry.proto


def itemsize(value: int, *, tensor: str = "") -> int:
    """Bytes per element of a wire dtype."""
    return entry_for_proto(value, tensor=tensor).itemsize
