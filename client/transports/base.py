"""Where a push's bucket bytes go: the Sink Protocol every transport's sink implements, and the
BucketStart announcement they all send.

A sink does two things for bucket k: gives the bytes a place (`fill`: pack the
bucket, or use the caller's own memory) and sends them (`send`: announce, then
broadcast / chunk / nothing). PushRun (client/push/run.py) drives it and owns the rules
common to all three; `finish` completes whatever is still in flight. Every
sink reads a bucket's bytes through `Payload.read()` only, so no read can
overtake the copies into them (client/buckets/read_order.py). One module per transport:

  COLLECTIVE  (collective.py) pack into pack buffer k % 2 while bucket k-1 is on
              the wire; bucket k is announced and started before k-1 is waited for
              (two in flight at most). NCCL, one trainer: a broadcast to the group.
              Gloo, and NCCL for a part of several: a send to each server's owner
              of the bucket alone (the rank its Ready named; tag k, from this
              part's rank), in increasing owner rank, so a node receives each byte
              once and every worker can take its buckets in one global order
              (common/receive_order.py).
  INLINE      (inline.py) pack, then cut into BucketChunks queued on every stream
              (gRPC flow control holds the trainer back when the server is slower;
              a server that stops taking chunks fails its stream, client/channels/streams.py).
  SHM         (shm.py) pack straight into the server's ingress slot k % slots, once
              the server applied the bucket that used it last.
"""

from __future__ import annotations

from typing import Protocol

from weightsync.client.buckets.packing import PackBuffers, Payload, TensorSource
from weightsync.client.buckets.planning import PlannedBucket
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.streams import UpdateStream
from weightsync.client.transports.compression import Frames
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


class Sink(Protocol):
    """What a push (client/push/run.py, client/push/job.py, client/sdk.py) uses of a transport's sink: nothing else."""

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
