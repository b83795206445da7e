"""Where a push's bucket bytes go, one class per transport.

A sink does two things for bucket k: gives the bytes a place (`fill`: pack the
bucket, or use the caller's own memory) and sends them (`send`: announce, then
broadcast / chunk / nothing). PushRun (push.py) drives it and owns the rules
common to all three; `finish` completes whatever is still in flight. Every
sink reads a bucket's bytes through `Payload.read()` only, so no read can
overtake the copies into them (read_order.py).

  COLLECTIVE  pack into pack buffer k % 2 while bucket k-1 is on the wire;
              bucket k is announced and started before k-1 is waited for (two in
              flight at most). NCCL, one trainer: a broadcast to the group.
              Gloo, and NCCL for a part of several: a send to each server's owner
              of the bucket alone (the rank its Ready named; tag k, from this
              part's rank), in increasing owner rank, so a node receives each byte
              once and every worker can take its buckets in one global order
              (common/receive_order.py).
  INLINE      pack, then cut into BucketChunks queued on every stream (gRPC
              flow control holds the trainer back when the server is slower;
              a server that stops taking chunks fails its stream, streams.py).
  SHM         pack straight into the server's ingress slot k % slots, once
              the server applied the bucket that used it last.
"""

from __future__ import annotations

import asyncio
import mmap
import time
import warnings
from collections.abc import Coroutine
from typing import Any, Protocol

import grpc
import torch
import torch.distributed as dist

from weightsync.client._loop import LoopThread
from weightsync.client.compression import Frames
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.packing import PackBuffers, Payload, TensorSource, fill_bucket
from weightsync.client.planning import PlannedBucket
from weightsync.client.streams import UpdateStream
from weightsync.client.wire import encode_bucket_chunk
from weightsync.common.checksum import tensor_checksum
from weightsync.common.collective import CollectiveError, CollectiveGroup, bucket_tag, bucket_tail
from weightsync.common.threads import ThreadCall
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


class Sink(Protocol):
    """What a push (push.py, push_job.py, sdk.py) uses of a transport's sink: nothing else."""

    transport: int
    """The BeginUpdate.transport this sink speaks."""
    buffers: PackBuffers
    """Where buckets are packed (SHM: the server's ingress slots)."""

    @property
    def frames(self) -> Frames | None:
        """Buckets of patches as zstd frames (COLLECTIVE over Gloo, INLINE); None: this transport sends none."""

    @property
    def broken(self) -> bool:
        """A transfer of ours failed or timed out and left the transfer group unusable (COLLECTIVE only)."""

    def fill(self, index: int, bucket: PlannedBucket, source: TensorSource, streams: list[UpdateStream]) -> Payload:
        """Bucket `index`'s bytes, in a place this transport can send from."""

    def send(self, index: int, payload: Payload, checksum: tensor_pb2.Checksum,
             streams: list[UpdateStream]) -> BaseException | None:
        """Announce the bucket and start sending it; returns the first failure seen, if any."""

    def finish(self) -> BaseException | None:
        """Complete whatever is still in flight (safe to call more than once)."""


def announce(loop: LoopThread, streams: list[UpdateStream], index: int, size: int,
             checksum: tensor_pb2.Checksum, tail: bytes = b"",
             compression: int = pb.BUCKET_COMPRESSION_UNSPECIFIED, layout: tensor_pb2.BucketSpec | None = None) -> None:
    message = pb.UpdateWeightsRequest(bucket_start=pb.BucketStart(sequence=index, checksum=checksum, size_bytes=size,
                                                                  tail=tail, compression=compression, layout=layout))
    for stream in streams:
        loop.call_soon(stream.send, message)


class CollectiveSink:
    """Send each bucket to the group (rank 0 is us, or our part's rank): a broadcast (NCCL, one trainer), or to
    its owners, point-to-point (Gloo; NCCL when the group holds several parts' ranks)."""

    transport = pb.TRANSPORT_COLLECTIVE

    def __init__(self, loop: LoopThread, collective: CollectiveGroup, buffers: PackBuffers) -> None:
        self._loop = loop
        self._collective = collective
        self.buffers = buffers
        self._in_flight: list[tuple[dist.Work, float]] = []
        """The previous bucket's transfers, still on the wire, each with its deadline (time.monotonic())."""
        self._frames: list[torch.Tensor] = []
        """Compressed frames of the transfers in flight (kept alive until they completed)."""
        self.broken = False
        """A broadcast of ours failed or timed out: the group is unusable on every rank."""
        self.frames = Frames()
        """Buckets of patches as zstd frames (Gloo only; client/compression.py)."""
        self._streams: list[UpdateStream] = []
        """The push's streams (a part's waits stop once a server says the update is aborting)."""

    def fill(self, index: int, bucket: PlannedBucket, source: TensorSource, streams: list[UpdateStream]) -> Payload:
        self.frames.planned(index, bucket.spec)
        # Buffer k % 2: bucket k-2 used it, and send(k-1) returned only once its transfers completed.
        return fill_bucket(self.buffers, bucket, index, source)

    def send(self, index: int, payload: Payload, checksum: tensor_pb2.Checksum,
             streams: list[UpdateStream]) -> BaseException | None:
        self._streams = streams
        data, compression, frame = payload.read(), pb.BUCKET_COMPRESSION_UNSPECIFIED, None
        if self._collective.backend != pb.BACKEND_NCCL:
            # While bucket k-1 is on the wire; the owners decompress it (BucketStart.compression).
            data, compression = self.frames.encode(index, data)
            frame = data if compression else None
        # Announce first: workers join only announced broadcasts, at the announced length. The
        # tail lets them tell a short broadcast from a full one; read() waited for the pack copies.
        announce(self._loop, streams, index, data.numel(), checksum, bucket_tail(data), compression, payload.layout)
        try:
            deadline = self._collective.deadline()
            if self._collective.backend == pb.BACKEND_NCCL and self._collective.trainer_ranks == 1:
                started = [(self._collective.broadcast_async(data), deadline)]
            else:
                # In increasing owner rank (owner_ranks); the owners receive in one global order, so none waits
                # on a later one (common/receive_order.py). Over NCCL torch runs each single send on a two-rank
                # communicator of its own per (this rank, owner) pair, built by the first send to that owner
                # (through the group's store), with a stream of its own: each send's stream waits, when it is
                # enqueued, for this thread's current stream (the pack copies, read() ordered them), and sends
                # to several owners may run at once (sends running ahead: the order's proof covers them).
                # torch records `data` on each send's stream; finish() orders the next pack after every send.
                started = [(self._collective.send_async(data, rank, bucket_tag(index)), deadline)
                           for rank in owner_ranks(streams, index)]
        except CollectiveError:
            self._broke()
            self.finish()  # bucket k-1's transfers too: none is left in flight
            raise
        # Bucket k is on its way (its owner posted its receive while k-1's finished: over Gloo
        # usually another worker), then k-1 is waited for: two in flight at most, and the pack
        # buffer of k+1 (k-1's) is free once this returns.
        failure = self.finish()
        self._in_flight = started
        self._frames = [frame] if frame is not None else []
        return failure

    def finish(self) -> BaseException | None:
        """Complete the transfers in flight. At the first failure the group is unusable on every rank:
        NCCL's is closed at once (its other transfers end with it, never waited for again: a second
        group timeout), Gloo's remaining sends are waited for until their own deadline only (a Gloo
        send ends, with an error, as soon as its receiver leaves the group, which the servers' workers do
        once the update is aborted: push.py aborts it as soon as a server reports a failure; a receiver
        still in the group that never receives holds it to its deadline: test_collective_parts_units,
        test_a_gloo_send_ends_when_its_receiver_leaves_the_group). A part stops waiting as soon as a
        server says the update is aborting (_wait)."""
        transfers, self._in_flight = self._in_flight, []
        failure: BaseException | None = None
        for work, deadline in transfers:
            if self.broken and self._collective.backend == pb.BACKEND_NCCL:
                break  # aborted with the group: nothing of it is left to wait for
            try:
                stopped = self._wait(work, deadline)
            except CollectiveError as error:
                failure = error
                self._broke()
                continue
            if stopped is not None:
                failure = failure or stopped
                self._broke()
        self._frames = []  # their sends completed, or their group is closed, or left to their deadline
        return failure

    def _wait(self, work: dist.Work, deadline: float) -> BaseException | None:
        """Complete one transfer. A part's (several trainer ranks) is waited for in a thread of its own while
        its streams are watched: once a server says the update is aborting (another part failed), a send to a
        worker that will never receive it is not waited for to its deadline; the server's word is returned
        and the group is broken (the abandoned wait ends at its deadline; nothing receives its bytes)."""
        if self._collective.trainer_ranks == 1 or not self._streams:
            self._collective.wait(work, deadline)
            return None
        if self._collective.backend == pb.BACKEND_NCCL:
            # Polled here, in the caller's thread: wait() then orders the caller's current stream (the next pack
            # into this buffer) after the send. A send stopped early is aborted with the group (_broke).
            while not work.is_completed() and time.monotonic() < deadline:
                told = next((stream for stream in self._streams if stream.failed), None)
                if told is not None:
                    return told.reported_error or CollectiveError("a server ended the update", timed_out=False)
                time.sleep(PART_WAIT_POLL_SECONDS)
            self._collective.wait(work, deadline)
            return None
        call = ThreadCall(lambda: self._collective.wait(work, deadline), name="part-transfer")
        while not call.done:
            told = next((stream for stream in self._streams if stream.failed), None)
            if told is not None:
                return told.reported_error or CollectiveError("a server ended the update", timed_out=False)
            time.sleep(PART_WAIT_POLL_SECONDS)
        call.result(0)  # what the wait raised, if it did
        return None

    def _broke(self) -> None:
        """A transfer of ours failed or timed out: the group is unusable on every rank. NCCL's is aborted
        now (bounded), so no transfer of it runs on and none is waited for twice."""
        self.broken = True
        if self._collective.backend == pb.BACKEND_NCCL:
            self._collective.close()


PART_WAIT_POLL_SECONDS = 0.01
"""How often a part's wait for a transfer looks at its streams (CollectiveSink._wait)."""


def owner_ranks(streams: list[UpdateStream], index: int) -> list[int]:
    """The group ranks that receive bucket `index`, in increasing rank (common/receive_order.send_order): each
    server's owner, from its Ready (none on a server that stores none of its tensors: -1)."""
    ranks = []
    for stream in streams:
        owners = stream.ready.result().bucket_owner_ranks
        if index >= len(owners):
            raise CollectiveError(f"{stream.server} named no receiver for bucket {index} (UpdateReady."
                                  "bucket_owner_ranks): a server older than this SDK", timed_out=False)
        if owners[index] >= 0:
            ranks.append(owners[index])
    return sorted(ranks)


class InlineSink:
    """Send each bucket inside the UpdateWeights streams, in chunks."""

    transport = pb.TRANSPORT_INLINE
    broken = False
    """Nothing of a group to break."""

    def __init__(self, loop: LoopThread, buffers: PackBuffers, max_chunk_bytes: int) -> None:
        self._loop = loop
        self.buffers = buffers
        self._chunk = max_chunk_bytes
        self.frames = Frames()
        """Buckets of patches as zstd frames (client/compression.py)."""

    def fill(self, index: int, bucket: PlannedBucket, source: TensorSource, streams: list[UpdateStream]) -> Payload:
        self.frames.planned(index, bucket.spec)
        return fill_bucket(self.buffers, bucket, index, source)

    def send(self, index: int, payload: Payload, checksum: tensor_pb2.Checksum,
             streams: list[UpdateStream]) -> BaseException | None:
        sent, compression = self.frames.encode(index, payload.read().detach().cpu())
        size = sent.numel()
        data = memoryview(sent.numpy())
        announce(self._loop, streams, index, size, checksum, compression=compression, layout=payload.layout)
        receivers = [s for s in streams if s.stores(index)]  # the others take no chunks of it
        # Each server is sent the whole bucket at its own pace, not chunk by chunk in lockstep: a server
        # that holds the stream back (a part waiting its turn for an ingress slot there) must not stop the
        # bytes of a slot this part already holds on another server, or two parts each holding a slot the
        # other waits for would wait on each other until the transfer timeout.
        chunks = _SharedChunks(index, data, self._chunk, len(receivers))
        self._loop.run(_gather(*(_send_whole(stream, chunks, size, self._chunk) for stream in receivers)))
        for stream in receivers:
            if stream.unresponsive:
                # This server stopped taking data: the others may have timed out on us meanwhile
                # (CLIENT_IDLE); the cause is this one.
                return stream.reported_error
        return next((stream.reported_error for stream in receivers if stream.failed), None)

    def finish(self) -> BaseException | None:
        return None


class _SharedChunks:
    """A bucket's chunks for the servers that take it: each encoded once, when the first server's turn for it
    comes, and dropped once every one took it (a server far behind the others keeps at most the rest of the
    bucket encoded)."""

    def __init__(self, index: int, data: memoryview, chunk_bytes: int, readers: int) -> None:
        self._index = index
        self._data = data
        self._chunk_bytes = chunk_bytes
        self._readers = readers
        self._encoded: dict[int, tuple[bytes, int]] = {}
        """offset -> (the chunk, how many servers have yet to take it)."""

    def take(self, offset: int) -> bytes:
        encoded, left = self._encoded.get(offset) or (
            encode_bucket_chunk(self._index, offset, self._data[offset : offset + self._chunk_bytes]), self._readers)
        if left > 1:
            self._encoded[offset] = (encoded, left - 1)
        else:
            self._encoded.pop(offset, None)
        return encoded


async def _send_whole(stream: UpdateStream, chunks: _SharedChunks, size: int, chunk_bytes: int) -> None:
    """Every chunk of the bucket to one server, each once gRPC took the ones before (bounded:
    UpdateStream.progress_timeout); stops at the stream's failure."""
    for offset in range(0, size, chunk_bytes):
        if stream.failed:
            return
        await stream.send_data(chunks.take(offset))
        if stream.unresponsive:
            return


async def _gather(*sends: Coroutine[Any, Any, None]) -> None:
    await asyncio.gather(*sends)


class ShmSink:
    """Write each bucket into the server's ingress (same host), then announce it."""

    transport = pb.TRANSPORT_SHM
    broken = False
    """Nothing of a group to break."""
    frames = None
    """Buckets go into the server's memory whole: nothing to compress."""

    def __init__(self, loop: LoopThread, fd: int, slot_bytes: int, slot_count: int, timeout: float) -> None:
        self._loop = loop
        self._map = mmap.mmap(fd, slot_bytes * slot_count, flags=mmap.MAP_SHARED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ingress = torch.frombuffer(self._map, dtype=torch.uint8)
        self._ingress_slots = [ingress[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slot_count)]
        self.buffers = PackBuffers(torch.device("cpu"), slots=self._ingress_slots)
        self._run = (0, slot_count)
        """The slots this push writes (first, count): UpdateReady's run, the whole ingress for a push of one."""
        self._slot_count = slot_count
        self._timeout = timeout

    def _use_run(self, streams: list[UpdateStream]) -> None:
        """Pack into the run of slots the server gave this stream (UpdateReady.ingress_slot_first/_count:
        a part's own share, so parts on one host never write each other's slots). A server that names none
        (older than parts over SHM) gave the whole ingress."""
        ready = streams[0].ready.result()
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
        # Bucket k reuses the slot of bucket k - slots: the server must have applied that one.
        earlier = index - self._slot_count + 1
        if earlier > 0:
            for stream in streams:
                if not stream.wait_applied(earlier, self._timeout):
                    raise WeightSyncRpcError(stream.server, grpc.StatusCode.DEADLINE_EXCEEDED, "BUCKET_NOT_APPLIED",
                                             f"bucket {earlier - 1} was not applied within {self._timeout:g} s", {})
        payload = fill_bucket(self.buffers, bucket, index, source)
        if not payload.packed:  # the caller's own memory: it still has to reach the slot
            slot = self.buffers.slots[index % self._slot_count][: payload.size]
            slot.copy_(payload.read())
            payload = Payload(slot, packed=True, source_devices=payload.source_devices)
        return payload

    def send(self, index: int, payload: Payload, checksum: tensor_pb2.Checksum,
             streams: list[UpdateStream]) -> BaseException | None:
        for stream in streams:
            if stream.failed:
                return stream.reported_error
        data = payload.read()  # the server reads the slot once it is announced
        if checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED:
            checksum = tensor_checksum(data)  # required for SHM: the workers check their copy of the slot
        announce(self._loop, streams, index, payload.size, checksum, layout=payload.layout)
        return None

    def finish(self) -> BaseException | None:
        return None

    def close(self) -> None:
        self.buffers.release()
        self._ingress_slots.clear()
        try:
            self._map.close()
        except BufferError:
            pass  # a view outlives us; the GC unmaps it
