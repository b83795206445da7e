"""INLINE: each bucket inside the UpdateWeights streams, in chunks, each server at its own pace (see base.py)."""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from weightsync.client.buckets.packing import PackBuffers, Payload, TensorSource, fill_bucket
from weightsync.client.buckets.planning import PlannedBucket
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.streams import UpdateStream
from weightsync.client.channels.wire import encode_bucket_chunk_of
from weightsync.client.transports.base import announce
from weightsync.client.transports.compression import Frames, holds_patches
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


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
        """Buckets of patches as zstd frames (client/transports/compression.py)."""

    def fill(self, index: int, bucket: PlannedBucket, source: TensorSource, streams: list[UpdateStream]) -> Payload:
        self.frames.planned(index, bucket.spec)
        # A bucket of CPU tensors is not packed: its chunks are encoded from the tensors where they lie (one copy
        # into each message instead of a pack and then that copy); one of patches may be compressed whole.
        return fill_bucket(self.buffers, bucket, index, source, lazy=not holds_patches(bucket.spec))

    def send(self, index: int, payload: Payload, checksum: tensor_pb2.Checksum,
             streams: list[UpdateStream]) -> BaseException | None:
        data: _BucketBytes
        if payload.parts is not None:  # not packed: nobody read it (no checksum asked)
            size, compression = payload.size, pb.BUCKET_COMPRESSION_UNSPECIFIED
            data = _Gathered(payload.parts, size)
        else:
            sent, compression = self.frames.encode(index, payload.read().detach().cpu())
            size = sent.numel()
            data = _Contiguous(memoryview(sent.numpy()))
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


class _BucketBytes(Protocol):
    def chunk(self, offset: int, length: int) -> list[memoryview | bytes]:
        """Bucket bytes [offset, +length), in pieces that are copied once, into the message."""


@dataclass(frozen=True, slots=True)
class _Contiguous:
    """A bucket packed (or a compressed frame): one buffer."""

    data: memoryview

    def chunk(self, offset: int, length: int) -> list[memoryview | bytes]:
        return [self.data[offset : offset + length]]


@dataclass(frozen=True, slots=True)
class _Gathered:
    """A bucket's tensors where they lie (Payload.parts), the padding between them zeros."""

    parts: list[tuple[int, torch.Tensor]]
    size: int

    def chunk(self, offset: int, length: int) -> list[memoryview | bytes]:
        end = min(offset + length, self.size)
        out: list[memoryview | bytes] = []
        cursor = offset
        first = max(0, bisect.bisect_right(self.parts, offset, key=lambda part: part[0]) - 1)  # thousands of parts
        for start, data in self.parts[first:]:
            stop = start + data.numel()
            if start >= end:
                break
            if stop <= cursor:
                continue
            if start > cursor:
                out.append(bytes(start - cursor))
            begin, finish = max(cursor, start), min(end, stop)
            out.append(memoryview(data.numpy())[begin - start : finish - start])
            cursor = finish
        if cursor < end:
            out.append(bytes(end - cursor))
        return out


class _SharedChunks:
    """A bucket's chunks for the servers that take it: each encoded once, when the first server's turn for it
    comes, and dropped once every one took it (a server far behind the others keeps at most the rest of the
    bucket encoded)."""

    def __init__(self, index: int, data: _BucketBytes, chunk_bytes: int, readers: int) -> None:
        self._index = index
        self._data = data
        self._chunk_bytes = chunk_bytes
        self._readers = readers
        self._encoded: dict[int, tuple[bytes, int]] = {}
        """offset -> (the chunk, how many servers have yet to take it)."""

    def take(self, offset: int) -> bytes:
        encoded, left = self._encoded.get(offset) or (
            encode_bucket_chunk_of(self._index, offset, self._data.chunk(offset, self._chunk_bytes)), self._readers)
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
