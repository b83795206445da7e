"""SHM: each bucket written straight into its place in the node store where the server placed it there,
else into the server's ingress slot (same host), in one copy with its checksum (client/transports/store_writes.py),
then announced (see base.py).

Announcements leave in plan order from one queue: a bucket is announced once its bytes are where the server
reads them. From CPU tensors they are there when `fill` returns; from CUDA tensors once its copies' events
completed, so such a bucket is announced when the next one is sent (its copies run meanwhile: two buckets
in flight at most) or at `finish`.
"""

from __future__ import annotations

import mmap
from collections import deque
from dataclasses import dataclass

import grpc
import torch

from weightsync.client.buckets.packing import PackBuffers, Payload, TensorSource
from weightsync.client.buckets.planning import PlannedBucket
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.streams import UpdateStream
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.transports.base import announce
from weightsync.client.transports.store_writes import (
    INGRESS,
    ArenaOpener,
    BucketWrite,
    Region,
    StoreMappings,
    StoreWriter,
    places_of,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

IN_FLIGHT = 2
"""Buckets written from CUDA tensors and not yet announced, at most (double buffering)."""


@dataclass(slots=True)
class _Announcement:
    """A bucket sent, not yet announced: the write that computes its checksum."""

    write: BucketWrite
    layout: tensor_pb2.BucketSpec | None


class ShmSink:
    """Write each bucket into the server's store or ingress (same host), then announce it."""

    transport = pb.TRANSPORT_SHM
    broken = False
    """Nothing of a group to break."""
    frames = None
    """Buckets go into the server's memory whole: nothing to compress."""

    def __init__(self, loop: LoopThread, fd: int, slot_bytes: int, slot_count: int, timeout: float,
                 open_arenas: ArenaOpener | None = None) -> None:
        self._loop = loop
        self._map = mmap.mmap(fd, slot_bytes * slot_count, flags=mmap.MAP_SHARED)
        self._store = StoreMappings(self._map, open_arenas)
        self._writer = StoreWriter(self._store)
        ingress = self._store.ingress
        self._ingress_slots = [ingress[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slot_count)]
        self._slot_bytes = slot_bytes
        self.buffers = PackBuffers(torch.device("cpu"), slots=self._ingress_slots)
        """The Sink's pack buffers: the ingress slots (the StoreWriter writes the buckets there)."""
        self._run = (0, slot_count)
        """The slots this push writes (first, count): UpdateReady's run, the whole ingress for a push of one."""
        self._slot_count = slot_count
        self._timeout = timeout
        self.writes_store = open_arenas is not None
        """This sink can write buckets straight into the store (BeginUpdate.store_writes)."""
        self._places: dict[int, tuple[Region, ...]] = {}
        """This push's buckets the server placed in its store, and where (UpdateReady.store_places)."""
        self._writes: dict[int, BucketWrite] = {}
        self._queue: deque[_Announcement] = deque()
        self._streams: list[UpdateStream] = []

    def _use_run(self, streams: list[UpdateStream]) -> None:
        """Pack into the run of slots the server gave this stream (UpdateReady.ingress_slot_first/_count:
        a part's own share, so parts on one host never write each other's slots). A server that names none
        (older than parts over SHM) gave the whole ingress. Map the arenas of the buckets it placed in the
        store (and let go of those it no longer holds)."""
        ready = streams[0].ready.result()
        self._streams = streams
        self._places = places_of(ready) if self.writes_store else {}
        if self._places or self._store.store_arenas:
            self._store.refresh({r.arena_id for regions in self._places.values() for r in regions})
        run = (ready.ingress_slot_first, ready.ingress_slot_count) if ready.ingress_slot_count else (
            0, len(self._ingress_slots))
        first, count = run
        if run == self._run:
            return
        if first < 0 or count < 1 or first + count > len(self._ingress_slots):
            raise WeightSyncClientError(f"{streams[0].server} gave ingress slots {first}..{first + count - 1} "
                                        f"(UpdateReady), outside the {len(self._ingress_slots)} slots mapped")
        self.buffers = PackBuffers(torch.device("cpu"), slots=self._ingress_slots[first : first + count])
        self._run = run
        self._slot_count = count

    def fill(self, index: int, bucket: PlannedBucket, source: TensorSource, streams: list[UpdateStream]) -> Payload:
        if index == 0:
            self._use_run(streams)
        regions = self._places.get(index)
        if regions is None:
            # Bucket k reuses the slot of bucket k - slots: the server must have applied that one. (It was
            # announced: of the buckets copied from CUDA only the last one sent, k - 1, may wait for its copies.)
            earlier = index - self._slot_count + 1
            if earlier > 0:
                for stream in streams:
                    if not stream.wait_applied(earlier, self._timeout):
                        raise WeightSyncRpcError(stream.server, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                 "BUCKET_NOT_APPLIED", f"bucket {earlier - 1} was not applied "
                                                 f"within {self._timeout:g} s", {})
            slot = self._run[0] + index % self._slot_count
            regions = (Region(0, bucket.spec.size_bytes, INGRESS, slot * self._slot_bytes),)
        write = self._writer.write(index, bucket.spec, source, regions)
        self._writes[index] = write
        return Payload(self._store.ingress[:0], packed=True, source_devices=write.devices, sink_checksum=True)

    def send(self, index: int, payload: Payload, checksum: tensor_pb2.Checksum,
             streams: list[UpdateStream]) -> BaseException | None:
        failure = next((stream.reported_error for stream in streams if stream.failed), None)
        if failure is not None:
            self._drain(announce_them=False)
            return failure
        self._queue.append(_Announcement(self._writes.pop(index), payload.layout))
        self._announce_ready(in_flight=IN_FLIGHT - 1)
        return None

    def _announce_ready(self, in_flight: int) -> None:
        """Announce, in order, every bucket whose bytes are in place; wait for the oldest ones while more
        than `in_flight` are still being copied."""
        while self._queue and (len(self._queue) > in_flight or self._queue[0].write.done()):
            item = self._queue.popleft()
            write = item.write
            # The checksum waits for the copies: the server reads the bytes once the bucket is announced.
            announce(self._loop, self._streams, write.sequence, write.size_bytes, write.checksum(),
                     layout=item.layout)

    def _drain(self, *, announce_them: bool) -> None:
        """Every copy queued into the store completed (none outlives the push); announced, unless it failed."""
        if announce_them and not any(stream.failed for stream in self._streams):
            self._announce_ready(in_flight=0)
        for item in self._queue:
            item.write.wait()
        for write in self._writes.values():
            write.wait()
        self._queue.clear()
        self._writes.clear()

    def finish(self) -> BaseException | None:
        self._drain(announce_them=True)
        return next((stream.reported_error for stream in self._streams if stream.failed), None)

    def close(self) -> None:
        self._drain(announce_them=False)
        self.buffers.release()
        self._ingress_slots.clear()
        self._store.close()
        try:
            self._map.close()
        except BufferError:
            pass  # a view outlives us; the GC unmaps it
