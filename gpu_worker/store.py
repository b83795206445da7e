"""The weight store of one worker: segments of device memory, tensors as views.

The first plan (or a plan with new tensors) defines segments, one per bucket;
every tensor is a typed view into its segment at its offset. A segment made
from a bucket remembers that bucket's signature: a later bucket with the same
signature is received straight into the segment (the fast path).

STAGED updates write into per-segment shadows; commit swaps shadow and live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weightsync.common import dtypes
from weightsync.common.checksum import tensor_checksum
from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass(slots=True)
class Segment:
    """One contiguous block of device memory."""

    live: torch.Tensor
    """uint8, the published bytes."""
    signature: tuple | None
    """Signature of the bucket this segment mirrors; None if packed otherwise."""
    shadow: torch.Tensor | None = None
    """uint8, same size: where STAGED updates write."""


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor lives."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    segment: int
    offset_bytes: int
    size_bytes: int


def typed_view(raw: torch.Tensor, tensor: StoredTensor) -> torch.Tensor:
    """View segment bytes as the tensor (dtype, shape)."""
    chunk = raw[tensor.offset_bytes : tensor.offset_bytes + tensor.size_bytes]
    if tensor.size_bytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=raw.device)
    return chunk.view(tensor.dtype).view(tensor.shape)


@dataclass(slots=True)
class WeightStore:
    """All tensors held by one worker on one device."""

    device: torch.device
    segments: list[Segment] = field(default_factory=list)
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    """Tensors an aborted IN_PLACE update may have half-written."""
    updating: bool = False
    layout_version: int = 0
    """Bumped whenever segments or tensors are added or removed."""

    @property
    def state(self) -> int:
        if self.updating:
            return pb.STORE_STATE_UPDATING
        if not self.tensors:
            return pb.STORE_STATE_EMPTY
        return pb.STORE_STATE_INCONSISTENT if self.dirty else pb.STORE_STATE_CONSISTENT

    @property
    def live_bytes(self) -> int:
        return sum(s.live.numel() for s in self.segments)

    def allocate_segment(self, size_bytes: int, signature: tuple | None) -> int:
        """Add a zero-filled (so already touched) segment; returns its index."""
        self.segments.append(Segment(torch.zeros(size_bytes, dtype=torch.uint8, device=self.device), signature))
        self.layout_version += 1
        return len(self.segments) - 1

    def drop_segments_from(self, first: int) -> None:
        """Remove segments (and their tensors) created by an aborted update."""
        if first < len(self.segments):
            del self.segments[first:]
            self.tensors = {n: t for n, t in self.tensors.items() if t.segment < first}
            self.layout_version += 1

    def shadow_of(self, index: int) -> torch.Tensor:
        segment = self.segments[index]
        if segment.shadow is None or segment.shadow.numel() != segment.live.numel():
            segment.shadow = torch.zeros_like(segment.live)
        return segment.shadow

    def view(self, name: str) -> torch.Tensor:
        stored = self.tensors[name]
        return typed_view(self.segments[stored.segment].live, stored)

    def checksums(self, names: list[str]) -> list[pb.TensorChecksum]:
        """Per-tensor WS64 of the live weights, sorted by name; unknown names are skipped."""
        selected = sorted(names) if names else sorted(self.tensors)
        out = []
        for name in selected:
            stored = self.tensors.get(name)
            if stored is None:
                continue
            out.append(
                pb.TensorChecksum(
                    name=name,
                    dtype=dtypes.from_torch(stored.dtype),
                    shape=list(stored.shape),
                    checksum=tensor_checksum(self.view(name)),
                )
            )
        return out
