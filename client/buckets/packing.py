"""Filling each bucket's bytes on the trainer: reused pack buffers, or the
caller's own memory when the bucket is already laid out there (zero copy).

Copies into a pack buffer may still run when `fill_bucket` returns (CUDA):
its bytes are read only through `Payload.read()`, which waits for them
(read_order.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weightsync.client.buckets.planning import PlannedBucket, check_tensors
from weightsync.client.buckets.read_order import (
    BufferFence,
    CudaEvents,
    Events,
    devices_of,
    read_order,
)
from weightsync.client.delta.base import repeats_elements
from weightsync.client.errors import DuplicateTensor, PlanMismatch
from weightsync.client.intra_op import one_intra_op_thread
from weightsync.common import byte_passes, dtypes
from weightsync.common.patches import is_patch
from weightsync.v1 import tensor_pb2

if TYPE_CHECKING:
    from weightsync.client.delta.deferred import DeferredCompare


@dataclass(slots=True)
class PackBuffers:
    """Pack buffers, reused across pushes, grown when a plan needs more."""

    device: torch.device
    slots: list[torch.Tensor] = field(default_factory=list)
    """Bucket k packs into slots[k % len(slots)]: two buffers of our own, or the server's ingress slots (SHM)."""
    events: Events = field(default_factory=CudaEvents)
    fences: list[BufferFence] = field(init=False)
    """One per slot: the copies last queued into it, which its readers wait for."""
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Typed destination views per bucket index, valid for the plan named views_plan."""
    views_plan: str = ""

    def __post_init__(self) -> None:
        self.fences = [BufferFence(self.events) for _ in self.slots]

    def ensure(self, size: int) -> None:
        if self.slots and self.slots[0].numel() >= size:
            return
        # Pinned host memory makes CUDA -> CPU copies real DMAs; their readers wait for them (read_order.py).
        # Only in a process that already uses CUDA: pinning creates a CUDA context, which a CPU-only
        # trainer on a GPU host must not get (on GPU 0, whoever uses it).
        pin = self.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized()
        # zeros() touches every page once, here, not during the first push.
        self.slots = [torch.zeros(size, dtype=torch.uint8, device=self.device, pin_memory=pin) for _ in range(2)]
        self.fences = [BufferFence(self.events) for _ in self.slots]
        self.views.clear()

    def release(self) -> None:
        """Drop every reference into the slots (SHM: before its mapping closes)."""
        self.slots.clear()
        self.fences.clear()
        self.views.clear()

    def use_plan(self, plan_id: str) -> None:
        """Views are per plan (content id): another plan, other views."""
        if plan_id != self.views_plan:
            self.views.clear()
            self.views_plan = plan_id

    def destinations(self, index: int, spec: tensor_pb2.BucketSpec, *, cached: bool = True) -> list[torch.Tensor]:
        """Where each non-empty tensor of bucket `index` goes in its pack buffer (cached per plan and index,
        unless not `cached`)."""
        views = self.views.get(index) if cached else None
        if views is None:
            buffer = self.slots[index % len(self.slots)]
            views = [
                buffer[t.offset_bytes : t.offset_bytes + t.size_bytes] if is_patch(t.encoding)  # a patch: raw bytes
                else buffer[t.offset_bytes : t.offset_bytes + t.size_bytes].view(dtypes.to_torch(t.dtype)).view(tuple(t.shape))
                for t in spec.tensors
                if t.size_bytes
            ]
            if cached:
                self.views[index] = views
        return views


class Payload:
    """One bucket's bytes. Read them only through `read()`: copies into them may still be running."""

    __slots__ = ("_bytes", "_fence", "_pack", "layout", "packed", "parts", "sink_checksum", "source_devices")

    def __init__(self, data: torch.Tensor, *, packed: bool, source_devices: frozenset[torch.device],
                 fence: BufferFence | None = None, sink_checksum: bool = False,
                 pack: Callable[[], None] | None = None,
                 parts: list[tuple[int, torch.Tensor]] | None = None) -> None:
        self._bytes = data
        self._fence = fence
        self._pack = pack
        self.parts = parts
        """The bucket's tensors as (offset in the bucket, their bytes) where they lie, not packed yet (fill_bucket
        with `lazy`: INLINE encodes its chunks straight from them, one copy instead of two); None once packed:
        `read` packs them first."""
        self.packed = packed
        """False: the caller's own memory, sent as it is (zero copy)."""
        self.sink_checksum = sink_checksum
        """The sink computes the bucket's checksum itself, as it writes the bytes (SHM store writes): the push
        computes none (and `read` has nothing to give: the bytes went straight to the server)."""
        self.source_devices = source_devices
        """Where the bytes came from (their own device when not packed)."""
        self.layout: tensor_pb2.BucketSpec | None = None
        """A deferred bucket's layout, announced with it (BucketStart.layout)."""

    @classmethod
    def own_memory(cls, data: torch.Tensor) -> Payload:
        return cls(data, packed=False, source_devices=frozenset({data.device}))

    @property
    def size(self) -> int:
        return self._bytes.numel()

    @property
    def device(self) -> torch.device:
        return self._bytes.device

    def read(self) -> torch.Tensor:
        """The bytes, once every copy into them is ordered before this read."""
        if self._pack is not None:
            self._pack()
            self._pack, self.parts = None, None
        if self._fence is not None:
            self._fence.before_read()
        return self._bytes


class TensorSource:
    """Tensors for packing: from a mapping, or pulled in plan order from an iterator."""

    # Small tensors of an open packed bucket wait here while the flat buckets
    # that follow them in the input are sent; more than this is a mismatch.
    MAX_STASHED = 100_000

    def __init__(self, mapping: dict[str, torch.Tensor] | None, iterator: Iterator[tuple[str, torch.Tensor]] | None,
                 *, deferred: tuple[DeferredCompare, int] | None = None):
        self._mapping = mapping
        self._iterator = iterator
        self._deferred = deferred
        """The comparison that lays out the deferred buckets, and the plan index of the first."""
        self._stash: dict[str, torch.Tensor] = {}
        self._pulled: set[str] = set()
        self._split: tuple[str, torch.Tensor] | None = None
        """The tensor whose pieces are being sent, as contiguous bytes (taken once for all its pieces),
        or as it is where it repeats elements (each piece copied on its own: _elements)."""

    def piece(self, spec: tensor_pb2.TensorSpec) -> torch.Tensor:
        """The bytes of one piece of a split tensor (uint8, contiguous): the tensor is taken at its first
        piece and kept, made contiguous once, until its last. A view that reads elements more than once
        (expand()) is never made contiguous whole: its logical size can be far beyond its storage's
        (12 GB of views over a few bytes); only the piece's elements are copied."""
        if spec.piece.offset_bytes == 0 or self._split is None or self._split[0] != spec.name:
            tensor = self.take(spec).detach()
            self._split = (spec.name, tensor if repeats_elements(tensor)
                           else tensor.contiguous().reshape(-1).view(torch.uint8))
        held = self._split[1]
        start, itemsize = spec.piece.offset_bytes, held.element_size()
        if start + spec.size_bytes >= held.numel() * itemsize:
            self._split = None  # the last piece: nothing of the tensor is held past it
        if not repeats_elements(held):
            return held[start : start + spec.size_bytes]
        # Pieces are cut at multiples of every element size (planning.PIECE_ALIGN_BYTES).
        return _elements(held, start // itemsize, (start + spec.size_bytes) // itemsize).view(torch.uint8)

    def laid_out(self, index: int, bucket: PlannedBucket) -> PlannedBucket:
        """Bucket `index` as it is sent: a deferred one waits for its comparison (client/delta/deferred.py) and is
        its layout, whose patches this source then hands out; any other is the plan's."""
        if not bucket.spec.deferred:
            return bucket
        assert self._deferred is not None and self._mapping is not None
        compare, first = self._deferred
        layout = compare.layout(index - first)
        for name, patch in layout.patches.items():
            self._mapping[name] = patch.data
        return PlannedBucket(layout.spec, None, laid_out=True)

    def put_back(self, name: str, tensor: torch.Tensor) -> None:
        if self._mapping is None:
            self._stash[name] = tensor

    def _pull(self) -> tuple[str, torch.Tensor] | None:
        """The iterator's next tensor, checked as a dict's would be; None at its end."""
        assert self._iterator is not None
        try:
            name, tensor = next(self._iterator)
        except StopIteration:
            return None
        check_tensors([(name, tensor)])  # a streamed value gets the same clear errors as a dict
        if name in self._pulled:
            raise DuplicateTensor(f"tensor {name!r} appears twice in the streamed tensors")
        self._pulled.add(name)
        return name, tensor

    def take(self, spec: tensor_pb2.TensorSpec) -> torch.Tensor:
        if self._mapping is not None:
            return self._mapping[spec.name]
        tensor = self._stash.pop(spec.name, None)
        name = spec.name
        while tensor is None:
            pulled = self._pull()
            if pulled is None:
                raise PlanMismatch(f"the iterator ended before tensor {spec.name!r} of the reused plan")
            name, candidate = pulled
            if name == spec.name:
                tensor = candidate
            elif len(self._stash) < self.MAX_STASHED:
                self._stash[name] = candidate
            else:
                raise PlanMismatch(f"tensor {spec.name!r} of the reused plan never came from the iterator")
        if name != spec.name or dtypes.from_torch(tensor.dtype) != spec.dtype or list(tensor.shape) != list(spec.shape):
            raise PlanMismatch(
                f"streamed tensor {name!r} ({tensor.dtype}, {list(tensor.shape)}) does not match the plan's "
                f"{spec.name!r}; pass a dict (or set allow_new_tensors) when the model's tensors change"
            )
        return tensor

    def finish(self) -> None:
        if self._iterator is not None:
            extra = next(iter(self._stash), None)
            if extra is None:
                pulled = self._pull()
                extra = pulled[0] if pulled is not None else None
            if extra is not None:
                raise PlanMismatch(f"the iterator yields {extra!r}, which is not in the reused plan")


def _elements(tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of a tensor in row-major order, as a new contiguous 1-D tensor: only those
    are copied (whole rows at a time, the first and last row recursively)."""
    if tensor.dim() <= 1:
        return tensor.reshape(-1)[start:end].contiguous()
    inner = tensor[0].numel()
    first, last = start // inner, (end - 1) // inner
    if first == last:
        return _elements(tensor[first], start - first * inner, end - first * inner)
    parts = [_elements(tensor[first], start - first * inner, inner)]
    if last > first + 1:
        parts.append(tensor[first + 1 : last].reshape(-1))
    parts.append(_elements(tensor[last], 0, end - last * inner))
    return torch.cat(parts)


def fill_bucket(buffers: PackBuffers, bucket: PlannedBucket, index: int, source: TensorSource, *,
                lazy: bool = False) -> Payload:
    """One bucket's bytes: the caller's own memory where they already lie as the plan says, else packed. With
    `lazy`, a bucket of contiguous CPU tensors is packed only if its bytes are read (Payload.parts)."""
    if is_zero_copy(buffers, bucket):
        assert bucket.flat_source is not None
        return Payload.own_memory(bucket.flat_source)
    if bucket.spec.tensors and bucket.spec.tensors[0].HasField("piece"):
        return _fill_piece(buffers, bucket, index, source)
    if len(bucket.spec.tensors) == 1 and bucket.spec.tensors[0].offset_bytes == 0:
        # A streamed tensor in a bucket of its own: send its memory if it can be.
        spec = bucket.spec.tensors[0]
        tensor = source.take(spec)
        if tensor.is_contiguous() and tensor.device == buffers.device and spec.size_bytes == bucket.spec.size_bytes:
            return Payload.own_memory(tensor.detach().reshape(-1).view(torch.uint8))
        source.put_back(spec.name, tensor)
    slot = index % len(buffers.slots)
    buffer = buffers.slots[slot][: bucket.spec.size_bytes]
    sources, offsets = [], []
    for spec in bucket.spec.tensors:
        tensor = source.take(spec)  # streamed empty tensors are consumed (and checked) too
        if spec.size_bytes:
            sources.append(tensor.detach())
            offsets.append(spec.offset_bytes)
    devices = devices_of(sources)
    fence = buffers.fences[slot]

    def pack() -> None:
        # A deferred bucket's layout is this push's own: its views are never the cached ones.
        destinations = buffers.destinations(index, bucket.spec, cached=not bucket.laid_out)
        with torch.no_grad(), one_intra_op_thread():
            if all(t.device == buffer.device for t in sources):
                torch._foreach_copy_(destinations, sources)  # one call for the whole bucket
            else:
                for target, tensor in zip(destinations, sources, strict=True):
                    target.copy_(tensor, non_blocking=True)
        byte_passes.copied("trainer.pack", sum(t.numel() * t.element_size() for t in destinations))
        fence.after_copies(read_order(devices, buffer.device))

    if lazy and all(d.type == "cpu" for d in devices) and all(t.is_contiguous() for t in sources):
        parts = [(offset, t.reshape(-1).view(torch.uint8)) for offset, t in zip(offsets, sources, strict=True)]
        return Payload(buffer, packed=True, source_devices=devices, fence=fence, pack=pack, parts=parts)
    pack()
    return Payload(buffer, packed=True, source_devices=devices, fence=fence)


def _fill_piece(buffers: PackBuffers, bucket: PlannedBucket, index: int, source: TensorSource) -> Payload:
    """A piece of a split tensor whose memory cannot be sent as it lies (not contiguous, or on another device
    than the buffers): copied into its pack buffer."""
    data = source.piece(bucket.spec.tensors[0])
    if data.device == buffers.device:  # the tensor's own bytes, or the contiguous copy the source keeps
        return Payload.own_memory(data)
    slot = index % len(buffers.slots)
    buffer = buffers.slots[slot][: bucket.spec.size_bytes]
    with torch.no_grad():
        buffer.copy_(data, non_blocking=True)
    byte_passes.copied("trainer.pack", data.numel())
    devices = frozenset({data.device})
    fence = buffers.fences[slot]
    fence.after_copies(read_order(devices, buffer.device))
    return Payload(buffer, packed=True, source_devices=devices, fence=fence)


def is_zero_copy(buffers: PackBuffers, bucket: PlannedBucket) -> bool:
    """Whether the bucket's bytes can be broadcast from where they already are."""
    return bucket.flat_source is not None and bucket.flat_source.device == buffers.device
