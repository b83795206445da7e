"""Bucket layout: where each tensor sits inside a flattened bucket.

The rules are written on weightsync.v1.BucketSpec. The SDK plans buckets
greedily in input order, each tensor at a multiple of ALIGN_BYTES; a tensor
larger than the bucket size gets a bucket of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from weightsync.common import dtypes
from weightsync.v1 import tensor_pb2

ALIGN_BYTES = 64
DEFAULT_BUCKET_BYTES = 256 << 20
SEGMENT_ALIGN_BYTES = 4096
"""Store segments start on page boundaries inside their arena (engines map whole arenas)."""


def align_up(value: int, alignment: int = ALIGN_BYTES) -> int:
    """Smallest multiple of alignment that is >= value."""
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    return -(-value // alignment) * alignment


def align_segment(size: int) -> int:
    """A store segment's footprint in its arena: its size rounded up to a page."""
    return align_up(size, SEGMENT_ALIGN_BYTES)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the planner needs to know of a tensor: no data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def size_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(name, tensor.dtype, tuple(tensor.shape))


@dataclass(frozen=True, slots=True)
class PlacedTensor:
    """A tensor placed in a bucket."""

    meta: TensorMeta
    offset_bytes: int


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """One planned bucket."""

    tensors: tuple[PlacedTensor, ...]
    size_bytes: int

    def to_proto(self) -> tensor_pb2.BucketSpec:
        return tensor_pb2.BucketSpec(
            size_bytes=self.size_bytes,
            tensors=[
                tensor_pb2.TensorSpec(
                    name=p.meta.name,
                    dtype=dtypes.from_torch(p.meta.dtype),
                    shape=list(p.meta.shape),
                    offset_bytes=p.offset_bytes,
                    size_bytes=p.meta.size_bytes,
                )
                for p in self.tensors
            ],
        )


def plan_buckets(metas: Iterable[TensorMeta], bucket_size_bytes: int) -> list[BucketLayout]:
    """Greedy, order-preserving bucketing.

    Tensors are packed in input order; a bucket closes when the next tensor
    would not fit. A tensor larger than bucket_size_bytes gets its own bucket
    of exactly its (aligned) size.
    """
    if bucket_size_bytes < ALIGN_BYTES:
        raise ValueError(f"bucket_size_bytes must be at least {ALIGN_BYTES}, got {bucket_size_bytes}")
    buckets: list[BucketLayout] = []
    current: list[PlacedTensor] = []
    cursor = 0

    def close() -> None:
        nonlocal current, cursor
        if current:
            buckets.append(BucketLayout(tuple(current), align_up(cursor)))
        current, cursor = [], 0

    for meta in metas:
        start = align_up(cursor)
        if current and start + meta.size_bytes > bucket_size_bytes:
            close()
            start = 0
        current.append(PlacedTensor(meta, start))
        cursor = start + meta.size_bytes
    close()
    return buckets

