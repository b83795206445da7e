"""COLLECTIVE: each bucket to the transfer group, a broadcast (NCCL, one trainer) or point-to-point to its
owners (Gloo; NCCL for a part of several: one batch per bucket), two buckets in flight at most (see base.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from weightsync.client.buckets.packing import PackBuffers, Payload, TensorSource, fill_bucket
from weightsync.client.buckets.planning import PlannedBucket
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.streams import UpdateStream
from weightsync.client.transports.base import announce
from weightsync.client.transports.compression import Frames
from weightsync.common.collective import CollectiveError, CollectiveGroup, bucket_tag, bucket_tail
from weightsync.common.transfer_waits import TransferStopped
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


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
        self._broken = False
        """A transfer of ours failed or timed out: the group is unusable on every rank."""
        self._sent_point_to_point_over_nccl = False
        """This push sent some bucket point-to-point over NCCL (a part of several)."""
        self.frames = Frames()
        """Buckets of patches as zstd frames (Gloo only; client/transports/compression.py)."""
        self._streams: list[UpdateStream] = []
        """The push's streams (a part's waits stop once a server says the update is aborting)."""

    @property
    def broken(self) -> bool:
        """Whether the group is unusable on every rank once this push failed: a transfer of ours failed, or
        (a part over NCCL) any send of ours went out. An NCCL send that fits the connection's buffer completes
        before its receiver posts the receive (NCCL's p2p semantics): one to an owner whose receive the failed
        update never forwarded would be taken by that owner's next receive on the same group, the next
        update's, shifted by one bucket from then on. Only a new group is sure to hold none."""
        return self._broken or self._sent_point_to_point_over_nccl

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
                # To each server's owner; the owners receive in one global order, so no wait points at a later
                # transfer (common/receive_order.py). Gloo: a send per owner, in increasing rank. NCCL: ONE batch
                # of them all on the group's own communicator and stream (common/nccl_p2p.py; a send per owner
                # each completed before the next started ran a bucket to S servers S times as long), after this
                # thread's current stream (the pack copies, read() ordered them); its start is waited for within
                # the transfer's deadline and only while no server said the update is aborting. torch records
                # `data` on the batch's stream; finish() orders the next pack after every send.
                ranks = owner_ranks(streams, index)
                self._sent_point_to_point_over_nccl |= self._collective.backend == pb.BACKEND_NCCL and bool(ranks)
                works = self._collective.send_many_async(data, ranks, bucket_tag(index), deadline=deadline,
                                                         stopped=self._told)
                started = [(work, deadline) for work in works]
        except TransferStopped as stopped:
            self._broke()
            self.finish()
            return stopped.reason
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
        once the update is aborted: client/push/run.py aborts it as soon as a server reports a failure; a receiver
        still in the group that never receives holds it to its deadline: test_collective_parts_units,
        test_a_gloo_send_ends_when_its_receiver_leaves_the_group). A part stops waiting as soon as a
        server says the update is aborting (_wait)."""
        transfers, self._in_flight = self._in_flight, []
        failure: BaseException | None = None
        for work, deadline in transfers:
            if self._broken and self._collective.backend == pb.BACKEND_NCCL:
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
        """Complete one transfer. A part's (several trainer ranks) is waited for while its streams are watched
        (_told, every transfer_waits.STOP_CHECK_SECONDS): once a server says the update is aborting (another
        part failed), a send to a worker that will never receive it is not waited for to its deadline; the
        server's word is returned and the group is broken (NCCL's aborted; a Gloo wait given up on ends at
        its deadline, or when its receiver leaves the group). Over NCCL it is polled in this thread: wait()
        then orders this thread's current stream (the next pack into this buffer) after the send."""
        if self._collective.trainer_ranks == 1 or not self._streams:
            self._collective.wait(work, deadline)
            return None
        try:
            self._collective.wait(work, deadline, stopped=self._told)
        except TransferStopped as stopped:
            return stopped.reason
        return None

    def _told(self) -> BaseException | None:
        """What a server said when it ended the update (None while none has)."""
        told = next((stream for stream in self._streams if stream.failed), None)
        if told is None:
            return None
        return told.reported_error or CollectiveError("a server ended the update", timed_out=False)

    def _broke(self) -> None:
        """A transfer of ours failed or timed out: the group is unusable on every rank. NCCL's is aborted
        now (bounded), so no transfer of it runs on and none is waited for twice."""
        self._broken = True
        if self._collective.backend == pb.BACKEND_NCCL:
            self._collective.close()


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
