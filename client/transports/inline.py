"""INLINE: each bucket inside the UpdateWeights streams, in chunks, each server at its own pace (see base.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from weightsync.client._loop import LoopThread
from weightsync.client.compression import Frames
from weightsync.client.packing import PackBuffers, Payload, TensorSource, fill_bucket
from weightsync.client.planning import PlannedBucket
from weightsync.client.streams import UpdateStream
from weightsync.client.transports.base import announce
from weightsync.client.wire import encode_bucket_chunk
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
