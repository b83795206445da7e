"""Turn named tensors into a bucket plan.

Two kinds of bucket:
  - packed: small tensors copied into a reused buffer at 64-byte aligned
    offsets;
  - flat: bytes that already sit contiguously in the caller's memory are
    broadcast as they are, with no pack copy: a large contiguous tensor on its
    own, or consecutive tensors laid out in one storage (a flat parameter),
    described at their real byte offsets.
A tensor larger than a bucket is split into pieces, one bucket each
(tensor.proto, WeightPlan): flat where its memory is contiguous, packed
otherwise.

Emission order follows the input: a flat bucket is emitted where its tensor
appears; a packed bucket when it is full (or at the end). So a consumer that
pulls tensors from an iterator never has to look ahead past the current
bucket; it only holds the small tensors of the open packed bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.common import dtypes
from weightsync.common.layout import TensorMeta, align_up, plan_buckets
from weightsync.v1 import tensor_pb2


@dataclass(frozen=True, slots=True)
class PlannedBucket:
    """A bucket of the plan and, for flat buckets, where its bytes already live."""

    spec: tensor_pb2.BucketSpec
    flat_source: torch.Tensor | None
    """uint8 view of the storage bytes to broadcast as-is (flat buckets)."""
    laid_out: bool = False
    """A deferred bucket's layout for this push (TensorSource.laid_out), not a bucket of the plan."""


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of the whole storage under `tensor` (no copy): where a flat bucket's bytes are read."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _byte_offset(tensor: torch.Tensor) -> int:
    return tensor.storage_offset() * tensor.element_size()


MAX_FLAT_GAP_BYTES = 64
"""A flat run tolerates alignment padding between tensors, no more: the bytes between two
views are broadcast too, so two small views far apart in one storage are packed instead."""
MIN_FLAT_RUN_BYTES = 64
"""Smaller runs are packed: not worth a broadcast of their own, and buckets must be >= 8 bytes."""


def _flat_runs(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, int]]:
    """[start, end) index ranges of >= 2 consecutive tensors laid out in increasing
    order inside one storage, at most MAX_FLAT_GAP_BYTES apart."""
    runs: list[tuple[int, int]] = []
    start = 0
    while start < len(named):
        end = start + 1
        first = named[start][1]
        if first.is_contiguous() and first.numel():
            storage = first.untyped_storage().data_ptr()
            cursor = _byte_offset(first) + first.numel() * first.element_size()
            while end < len(named):
                t = named[end][1]
                if not (t.is_contiguous() and t.numel() and t.untyped_storage().data_ptr() == storage
                        and t.device == first.device
                        and cursor <= _byte_offset(t) <= cursor + MAX_FLAT_GAP_BYTES):
                    break
                cursor = _byte_offset(t) + t.numel() * t.element_size()
                end += 1
        if end - start >= 2 and cursor - _byte_offset(first) >= MIN_FLAT_RUN_BYTES:
            runs.append((start, end))
            start = end
        else:
            start += 1
    return runs


def _flat_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_size_bytes: int) -> list[PlannedBucket]:
    """Split one flat run into buckets at tensor boundaries, offsets as laid out."""
    out: list[PlannedBucket] = []
    storage = storage_bytes(named[0][1])
    group: list[tuple[str, torch.Tensor]] = []

    def close() -> None:
        if not group:
            return
        base = _byte_offset(group[0][1])
        last = group[-1][1]
        end = _byte_offset(last) + last.numel() * last.element_size()
        spec = tensor_pb2.BucketSpec(size_bytes=end - base)
        for name, t in group:
            spec.tensors.add(
                name=name,
                dtype=dtypes.from_torch(t.dtype),
                shape=list(t.shape),
                offset_bytes=_byte_offset(t) - base,
                size_bytes=t.numel() * t.element_size(),
            )
        out.append(PlannedBucket(spec, storage[base:end]))
        group.clear()

    for name, t in named:
        if group:
            base = _byte_offset(group[0][1])
            end = _byte_offset(t) + t.numel() * t.element_size()
            misaligned = (_byte_offset(t) - base) % t.element_size()
            if end - base > bucket_size_bytes or misaligned:
                close()
        if _nbytes(t) > bucket_size_bytes:
            out.extend(_piece_buckets(name, t, bucket_size_bytes))
            continue
        group.append((name, t))
    close()
    return out


DEFAULT_ZERO_COPY_MIN_BYTES = 4 << 20
PIECE_ALIGN_BYTES = 64
"""Pieces are cut at multiples of this (and so of every element size)."""
MIN_PIECE_BYTES = 8
"""A piece is its bucket, and a bucket is at least 8 bytes (receivers check its last 8)."""


def piece_ranges(size: int, bucket_size_bytes: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of a tensor's pieces: as large as a bucket allows, cut at multiples of
    PIECE_ALIGN_BYTES; the last one never shorter than MIN_PIECE_BYTES."""
    step = max(PIECE_ALIGN_BYTES, bucket_size_bytes // PIECE_ALIGN_BYTES * PIECE_ALIGN_BYTES)
    bounds = list(range(0, size, step)) + [size]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < MIN_PIECE_BYTES:
        bounds[-2] -= PIECE_ALIGN_BYTES  # the piece before gives the last one a little
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _piece_buckets(name: str, tensor: torch.Tensor, bucket_size_bytes: int) -> list[PlannedBucket]:
    """One bucket per piece of a tensor too large for one; flat (its own memory) where it is contiguous."""
    size = _nbytes(tensor)
    contiguous = tensor.is_contiguous()
    storage = storage_bytes(tensor) if contiguous else None
    base = _byte_offset(tensor)
    out = []
    for start, end in piece_ranges(size, bucket_size_bytes):
        spec = tensor_pb2.BucketSpec(size_bytes=end - start)
        piece = spec.tensors.add(name=name, dtype=dtypes.from_torch(tensor.dtype), shape=list(tensor.shape),
                                 offset_bytes=0, size_bytes=end - start)
        piece.piece.offset_bytes = start
        out.append(PlannedBucket(spec, None if storage is None else storage[base + start : base + end]))
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _loose_buckets(
    loose: Sequence[tuple[str, torch.Tensor]], bucket_size_bytes: int, zero_copy_min_bytes: int
) -> list[PlannedBucket]:
    out: list[PlannedBucket] = []
    pending: list[TensorMeta] = []
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending_bytes
        out.extend(PlannedBucket(b.to_proto(), None) for b in plan_buckets(pending, bucket_size_bytes))
        pending.clear()
        pending_bytes = 0

    for name, tensor in loose:
        size = _nbytes(tensor)
        if size > bucket_size_bytes:  # emitted where it appears, like a zero-copy bucket; the packed one stays open
            out.extend(_piece_buckets(name, tensor, bucket_size_bytes))
            continue
        if zero_copy_min_bytes and size >= zero_copy_min_bytes and tensor.is_contiguous():
            spec = tensor_pb2.BucketSpec(size_bytes=size)
            spec.tensors.add(name=name, dtype=dtypes.from_torch(tensor.dtype), shape=list(tensor.shape),
                             offset_bytes=0, size_bytes=size)
            out.append(PlannedBucket(spec, tensor.detach().reshape(-1).view(torch.uint8)))
            continue
        start = align_up(pending_bytes)
        if pending and start + size > bucket_size_bytes:
            flush()
            start = 0
        pending.append(TensorMeta.of(name, tensor))
        pending_bytes = start + size
    flush()
    return out


def build_plan(
    named: Sequence[tuple[str, torch.Tensor]],
    bucket_size_bytes: int,
    zero_copy_min_bytes: int = DEFAULT_ZERO_COPY_MIN_BYTES,
) -> list[PlannedBucket]:
    """Plan every tensor (see the module docstring for the order); check_tensors first."""
    check_tensors(named)
    planned: list[PlannedBucket] = []
    cursor = 0
    for start, end in [*_flat_runs(named), (len(named), len(named))]:
        loose = named[cursor:start]
        if loose:
            planned.extend(_loose_buckets(loose, bucket_size_bytes, zero_copy_min_bytes))
        if end > start:
            planned.extend(_flat_buckets(named[start:end], bucket_size_bytes))
        cursor = end
    return [_at_least_8_bytes(p) for p in planned]


def _at_least_8_bytes(bucket: PlannedBucket) -> PlannedBucket:
    """A bucket is 0 or >= 8 bytes (receivers check its last 8): pack a tiny flat remainder instead."""
    if bucket.spec.size_bytes == 0 or bucket.spec.size_bytes >= 8:
        return bucket
    spec = tensor_pb2.BucketSpec()
    spec.CopyFrom(bucket.spec)
    spec.size_bytes = 8
    return PlannedBucket(spec, None)


def check_tensors(named: Sequence[tuple[object, object]]) -> None:
    """TypeError/ValueError naming the first tensor weightsync cannot send, before anything is sent."""
    seen: set[str] = set()
    for name, tensor in named:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            kind = f"{type(tensor).__module__}.{type(tensor).__name__}".removeprefix("builtins.")
            hint = ": wrap it with torch.from_numpy()" if kind == "numpy.ndarray" else ""
            raise TypeError(f"tensor {name!r} is a {kind}, not a torch.Tensor{hint}")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {name!r} has layout {tensor.layout}; send tensor.to_dense()")
        if tensor.device.type == "meta":
            raise ValueError(f"tensor {name!r} is on the meta device: it has no data to send")
        try:
            dtypes.from_torch(tensor.dtype)
        except ValueError as error:
            raise ValueError(f"tensor {name!r}: {error}") from None


def plan_proto(planned: Sequence[PlannedBucket]) -> tensor_pb2.WeightPlan:
    return tensor_pb2.WeightPlan(buckets=[p.spec for p in planned])
