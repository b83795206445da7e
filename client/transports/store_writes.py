"""SHM: a trainer on the server's host writes each bucket where the server reads it, in one copy of each
byte, the bucket's WS64 computed where the bytes are, as they are copied: straight into the node store
where the server placed the bucket there (UpdateReady.store_places, server/store/writes.py), else into
its ingress slot (the ingress is mapped here as one more arena, INGRESS).

  CPU tensors   one pass per tensor (common/ws64_host.copy_ws64_terms): the tensor is read once and its
                place in the store written once, its checksum terms summed on the way; the gaps of a
                bucket laid out as a segment (its padding) are written as zeros, which the checksum
                counts as such. Small tensors (a call each would cost more than their bytes) are copied
                by groups of about a MiB with one torch call and summed from their place right after, while
                it is in the cache (StoreWriter._copy_host).
  CUDA tensors  a device-to-host copy into the store's mapping, which is pinned (cudaHostRegister,
                common/host_pinning.py) once per mapping, so the copy is a DMA that runs while the host
                goes on; queued on a side stream of the tensor's device, after the work already queued on
                its current stream (the stream waits for it), with the tensor's checksum terms computed
                there by torch reductions (common/checksum.ws64_terms_torch) and copied into a pinned
                scalar; then one event per device. The bucket is announced only once its events
                completed (BucketWrite.checksum waits for them), so its owner, who reads the store once
                it is announced, reads it after the copies; the sources and temporaries the queued work
                reads are held until then.
The checksum is the source's as it is copied (a small tensor's: of its place just after the copy), so a
byte that changes in the store after it was written fails the owner's check.
"""

from __future__ import annotations

import bisect
import mmap
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from weightsync.client.buckets.packing import TensorSource
from weightsync.client.errors import WeightSyncClientError
from weightsync.common import byte_passes
from weightsync.common.checksum import to_proto, ws64_terms_torch
from weightsync.common.host_pinning import pin_host, unpin_host
from weightsync.common.ws64_host import copy_ws64_terms, ws64_terms
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

_MASK = (1 << 64) - 1
INGRESS = -1
"""The arena id this process gives the server's ingress (the store's ids are positive)."""
ArenaOpener = Callable[[Sequence[int]], tuple[list[tuple[int, int, int]], list[int]]]
"""Asks the server for arenas by id: ((arena id, size, descriptor) each, every arena the store holds)."""


@dataclass(frozen=True, slots=True)
class Region:
    """Bucket bytes [bucket_offset, +size_bytes) lie in arena `arena_id` at `offset_bytes` (StoreRegion)."""

    bucket_offset: int
    size_bytes: int
    arena_id: int
    offset_bytes: int


def places_of(ready: pb.UpdateReady) -> dict[int, tuple[Region, ...]]:
    """The buckets the server placed in the store, each's regions in bucket order."""
    return {place.sequence: tuple(sorted((Region(r.bucket_offset_bytes, r.size_bytes, r.arena_id, r.offset_bytes)
                                          for r in place.regions), key=lambda r: r.bucket_offset))
            for place in ready.store_places}


def gaps(regions: Iterable[Region], written: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(bucket offset, length) of every byte of `regions` that no written (offset, length) range covers: a
    segment's padding, which the trainer writes as zeros (the checksum counts it so)."""
    out = []
    spans = sorted(written)
    first = 0  # regions and spans both in bucket order: one pass over each (a region per tensor: thousands)
    for region in sorted(regions, key=lambda r: r.bucket_offset):
        cursor, end = region.bucket_offset, region.bucket_offset + region.size_bytes
        while first < len(spans) and sum(spans[first]) <= cursor:
            first += 1
        for start, length in spans[first:]:
            if start >= end:
                break
            if start + length <= cursor:
                continue
            if start > cursor:
                out.append((cursor, start - cursor))
            cursor = max(cursor, start + length)
        if cursor < end:
            out.append((cursor, end - cursor))
    return out


@dataclass(slots=True)
class MappedArena:
    """One arena of the store, mapped read-write in this process; pinned for DMA once a CUDA tensor is copied in."""

    arena_id: int
    size_bytes: int
    mapping: mmap.mmap
    data: torch.Tensor
    pinned: list[int] | None = None
    """The registrations to undo (common/host_pinning.pin_host); None: not tried yet, []: refused."""


class StoreMappings:
    """The store's arenas this trainer writes into, mapped once each and kept across pushes; an arena the
    store let go is unmapped at the next refresh (its memory is freed only once nobody maps it)."""

    def __init__(self, ingress: mmap.mmap, open_arenas: ArenaOpener | None, *,
                 pin: Callable[[torch.Tensor], list[int]] = pin_host,
                 unpin: Callable[[list[int]], None] = unpin_host) -> None:
        self._open = open_arenas
        self._pin = pin
        self._unpin = unpin
        self.arenas: dict[int, MappedArena] = {INGRESS: _mapped(INGRESS, ingress)}

    @property
    def ingress(self) -> torch.Tensor:
        return self.arenas[INGRESS].data

    @property
    def store_arenas(self) -> list[int]:
        return [arena_id for arena_id in self.arenas if arena_id != INGRESS]

    def refresh(self, needed: Iterable[int]) -> None:
        """Map the store's arenas `needed` that are not mapped yet, and unmap those the store no longer holds."""
        if self._open is None:
            return
        missing = sorted(set(needed) - set(self.arenas))
        opened, held = self._open(missing)
        try:
            for arena_id, size, fd in opened:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self.arenas[arena_id] = _mapped(arena_id, mapping)
        finally:
            for _, _, fd in opened:
                os.close(fd)  # the mapping holds the memory
        for arena_id in set(self.store_arenas) - set(held):
            self._drop(arena_id)

    def place(self, regions: Sequence[Region], offset: int, size: int) -> tuple[torch.Tensor, MappedArena]:
        """Where bucket bytes [offset, +size) lie (within one region; `regions` in bucket order), and the arena."""
        at = bisect.bisect_right(regions, offset, key=lambda r: r.bucket_offset) - 1  # one per tensor: thousands
        region = regions[at] if at >= 0 else None
        if region is None or offset + size > region.bucket_offset + region.size_bytes:
            raise WeightSyncClientError(f"the server placed no region for bucket bytes [{offset}, +{size})")
        arena = self.arenas.get(region.arena_id)
        start = region.offset_bytes + offset - region.bucket_offset
        if arena is None or start + size > arena.size_bytes:
            raise WeightSyncClientError(f"bucket bytes [{offset}, +{size}) are placed at arena {region.arena_id} "
                                        f"[{start}, +{size}), which is not mapped")
        return arena.data[start : start + size], arena

    def pin_once(self, arena: MappedArena) -> None:
        """Pin the arena for DMA (once per mapping; refused: copies into it stay synchronous, and correct)."""
        if arena.pinned is None:
            arena.pinned = self._pin(arena.data)

    def _drop(self, arena_id: int) -> None:
        arena = self.arenas.pop(arena_id)
        if arena.pinned:
            self._unpin(arena.pinned)
        arena.data = torch.empty(0, dtype=torch.uint8)
        try:
            arena.mapping.close()
        except BufferError:
            pass  # a view outlives us; the GC unmaps it

    def close(self) -> None:
        for arena_id in list(self.arenas):
            self._drop(arena_id)


def _mapped(arena_id: int, mapping: mmap.mmap) -> MappedArena:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "non-writable buffer" for a read-write mmap
        data = torch.frombuffer(mapping, dtype=torch.uint8)
    return MappedArena(arena_id, len(mapping), mapping, data)


SMALL_TENSOR_BYTES = 256 << 10
"""CPU tensors below this size are copied by groups (StoreWriter._copy_host)."""
SMALL_GROUP_BYTES = 1 << 20
"""A group's span in the bucket, at most: it is summed right after it is written, from the cache."""


@dataclass(frozen=True, slots=True)
class _HostCopy:
    """A CPU tensor's bytes and its place in the store (or a slot)."""

    offset: int
    """In the bucket."""
    data: torch.Tensor
    place: torch.Tensor
    arena_id: int

    @property
    def size(self) -> int:
        return self.data.numel()


@dataclass(slots=True)
class _DeviceCopies:
    """The copies of one bucket queued on one device's side stream."""

    event: torch.cuda.Event
    terms: torch.Tensor
    """Pinned host int64: the device's checksum terms, once the event completed."""


@dataclass(slots=True)
class BucketWrite:
    """One bucket written into the store, or being written (CUDA)."""

    sequence: int
    size_bytes: int
    devices: frozenset[torch.device] = frozenset()
    """Where its bytes came from."""
    host_terms: int = 0
    device: list[_DeviceCopies] = field(default_factory=list)
    held: list[torch.Tensor] = field(default_factory=list)
    """What the queued copies read: kept until their events completed."""

    def done(self) -> bool:
        return all(copies.event.query() for copies in self.device)

    def wait(self) -> None:
        for copies in self.device:
            copies.event.synchronize()
        self.held.clear()

    def checksum(self) -> tensor_pb2.Checksum:
        """The bucket's WS64, once every copy into it completed (waits for them)."""
        self.wait()
        total = self.size_bytes + self.host_terms + sum(int(c.terms.item()) for c in self.device)
        return to_proto(total & _MASK)


class StoreWriter:
    """Writes placed buckets into the store (see the module docstring)."""

    def __init__(self, mappings: StoreMappings) -> None:
        self.mappings = mappings
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def write(self, sequence: int, bucket: tensor_pb2.BucketSpec, source: TensorSource,
              regions: Sequence[Region]) -> BucketWrite:
        """Bucket `sequence`'s tensors, taken from `source`, into their places; CPU ones are done when this
        returns, CUDA ones queued (BucketWrite.checksum waits for them)."""
        write = BucketWrite(sequence, bucket.size_bytes)
        devices: set[torch.device] = set()
        on_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        on_host: list[_HostCopy] = []
        written = []
        for spec in bucket.tensors:
            data = source.piece(spec) if spec.HasField("piece") else source.take(spec)
            if not spec.size_bytes:
                continue  # taken (a streamed tensor is consumed and checked), nothing to write
            data = data.detach()
            data = data if spec.HasField("piece") else data.contiguous().reshape(-1).view(torch.uint8)
            place, arena = self.mappings.place(regions, spec.offset_bytes, spec.size_bytes)
            written.append((spec.offset_bytes, spec.size_bytes))
            devices.add(data.device)
            if data.device.type == "cpu":
                on_host.append(_HostCopy(spec.offset_bytes, data, place, arena.arena_id))
            else:
                self.mappings.pin_once(arena)
                on_device.setdefault(data.device, []).append((place, data, spec.offset_bytes // 8))
        write.host_terms = self._copy_host(on_host, regions)
        for start, length in gaps(regions, written):
            self.mappings.place(regions, start, length)[0].zero_()
        for device, copies in on_device.items():
            write.device.append(self._queue(device, copies, write.held))
        write.devices = frozenset(devices)
        return write

    def _copy_host(self, copies: list[_HostCopy], regions: Sequence[Region]) -> int:
        """Copy CPU tensors to their places, summing their checksum terms; returns the terms. A large tensor (or
        any, where a bucket lies in the store tensor by tensor) in one pass that reads it once. Small tensors of
        a bucket that lies in one region go by groups of at most SMALL_GROUP_BYTES: one torch call copies a
        group (a call per tensor would cost ~25 us each: seconds for a model of many small ones), then its span
        of the region, padding zeroed, is summed while it is still in the cache."""
        terms = 0
        one_region = len(regions) == 1
        index = 0
        while index < len(copies):
            first = copies[index]
            end = index + 1
            if one_region and first.size < SMALL_TENSOR_BYTES:
                while (end < len(copies) and copies[end].size < SMALL_TENSOR_BYTES
                       and copies[end].offset + copies[end].size - first.offset <= SMALL_GROUP_BYTES):
                    end += 1
            group = copies[index:end]
            stage = "trainer.slot" if first.arena_id == INGRESS else "trainer.store"
            if len(group) == 1:
                terms += copy_ws64_terms(first.place.numpy(), first.data.numpy(), first.offset // 8)
            else:
                with torch.no_grad():
                    torch._foreach_copy_([c.place for c in group], [c.data for c in group])
                span_end = group[-1].offset + group[-1].size
                written = [(c.offset, c.size) for c in group]
                for start, length in gaps([Region(first.offset, span_end - first.offset, 0, 0)], written):
                    self.mappings.place(regions, start, length)[0].zero_()
                span = self.mappings.place(regions, first.offset, span_end - first.offset)[0]
                terms += ws64_terms(span.numpy(), first.offset // 8)
                byte_passes.read("trainer.cached", span.numel())
            byte_passes.copied(stage, sum(c.size for c in group))
            index = end
        return terms

    def _queue(self, device: torch.device, copies: list[tuple[torch.Tensor, torch.Tensor, int]],
               held: list[torch.Tensor]) -> _DeviceCopies:
        """The device-to-host copies of one bucket from `device`, and its checksum terms, on the device's side
        stream after the work already queued on its current stream; one event after them."""
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the sources are written by what was queued
        terms = torch.zeros((), dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(side):
            total = torch.zeros((), dtype=torch.int64, device=device)
            for place, data, first_word in copies:
                place.copy_(data, non_blocking=True)
                total = total + ws64_terms_torch(data, first_word)
                held.append(data)
                byte_passes.copied("trainer.dma", data.numel())
            terms.copy_(total, non_blocking=True)
            held.append(total)
            event = torch.cuda.Event()
            event.record(side)
        return _DeviceCopies(event, terms)
