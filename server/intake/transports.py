"""One intake per transport: what an accepted BucketStart forwards, and when (see intake.py).

The rules an announcement must meet are the same for all (announcements.py); the
transports differ in where the bytes are when the owner is told to receive them:
  - COLLECTIVE: in the transfer that follows the announcement. Each bucket is
    forwarded at once, so the client can pipeline bucket k+1 behind bucket k: to
    the owner alone over Gloo (the trainer sends it there); over NCCL to every
    worker, each joining the broadcast, the others dropping the bytes. A refused
    announcement (a missing or wrong-length tail included) is still joined, at the
    announced length, and dropped, so the sender never hangs.
  - INLINE: in the BucketChunks that follow, written into the bucket's ingress slot
    (after its owner released it: until then the stream is not read, which is
    gRPC's back-pressure); a complete bucket, or a full slot of a larger one, is
    forwarded to the owner.
  - SHM: in the ingress slot the client wrote before announcing; forwarded to the
    owner at once, which checks its copy of the slot against the WS64 checksum. Or,
    for a bucket the client writes straight into the store (server/store/writes.py), in
    its places there: the owner checks it where it lies and copies nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from weightsync.common.errors import Aborted, DeadlineExceeded
from weightsync.server.intake.announcements import (
    Accepted,
    Filling,
    check_chunk,
    drain_length,
    incomplete,
)
from weightsync.server.intake.intake import (
    Abort,
    Closed,
    Failed,
    IngressSlots,
    Intake,
    IntakeSession,
)
from weightsync.server.intake.wire import ChunkView
from weightsync.server.workers.worker_fleet import WorkerFleet
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


class CollectiveIntake(Intake):
    """COLLECTIVE: each bucket's transfer follows its announcement, over the group."""

    transport = pb.TRANSPORT_COLLECTIVE

    async def _accepted(self, start: pb.BucketStart, accepted: Accepted, layout: wpb.OwnedBucket | None) -> None:
        await self.session.inbox.put(self.forward(start.sequence, start.checksum, discard=False,
                                                  size=accepted.wire_bytes, tail=start.tail,
                                                  compression=accepted.compression, layout=layout))

    async def _refused(self, start: pb.BucketStart) -> None:
        """The trainer's transfer follows a refused announcement regardless: join it at its announced length
        and drop it, or break the group if no worker can."""
        session = self.session
        length = drain_length(start, session.plan)
        owned = 0 <= start.sequence < len(session.owners)
        if length is None or not (owned or session.broadcast_to_all):
            # Nothing can receive it: the sender's transfer fails at the group timeout, so the group breaks.
            assert session.failure is not None
            session.break_group(f"{session.failure.reason}: bucket {start.sequence} was announced with a "
                                "length, or a sequence, the workers cannot drain")
            await session.inbox.put(Failed(session.failure))
            return
        await session.inbox.put(self.forward(start.sequence, start.checksum, discard=True, size=length))

    def _ended(self, end: Abort | Closed) -> None:
        """Fail the update now, as the driver would once it reads `end` (the same error, naming this part): a
        worker of an update of several parts may hold a receive of another part's bucket for the turn of one
        this stream never sent (common/receive_order.py), and the driver, waiting on that receive, would read
        `end` only at the bucket timeout. Failing wakes it; the abort answers the held receives. (A whole update
        from one stream holds nothing: the driver reads `end` in order, as over the other transports.)"""
        if self.session.parts < 2:
            return
        if isinstance(end, Abort):
            self._refuse(Aborted("ABORTED_BY_CLIENT",
                                 f"the client aborted the update: {end.reason or 'no reason given'}"))
        else:
            self._refuse(Aborted("STREAM_CLOSED", "the client closed the stream before commit"))


class ShmIntake(Intake):
    """SHM: the client wrote bucket k into slot k % slots before announcing it (announcements.check_slot), or
    into its places in the store (server/store/writes.py): its owner checks it there."""

    transport = pb.TRANSPORT_SHM

    async def _accepted(self, start: pb.BucketStart, accepted: Accepted, layout: wpb.OwnedBucket | None) -> None:
        if start.sequence in self.link.in_store:
            await self.session.inbox.put(self.forward(start.sequence, start.checksum, discard=False,
                                                      size=accepted.wire_bytes, in_store=True))
            return
        assert self.ingress is not None
        await self.session.inbox.put(self.forward(
            start.sequence, start.checksum, discard=False, size=accepted.wire_bytes, tail=start.tail,
            compression=accepted.compression, layout=layout, piece=start.sequence))


@dataclass(slots=True)
class _Filling:
    """An INLINE bucket whose chunks are arriving, one ingress slot (piece) at a time."""

    sequence: int
    size_bytes: int
    checksum: tensor_pb2.Checksum
    compression: int = pb.BUCKET_COMPRESSION_UNSPECIFIED
    """ZSTD: size_bytes is the frame's, which the owner gathers whole before it decompresses."""
    layout: wpb.OwnedBucket | None = None
    """A deferred bucket: where its owner puts it (sent with each piece)."""
    received: int = 0
    piece_start: int = 0
    """Where the piece now filling its slot starts in the bucket."""

    def expecting(self) -> Filling:
        return Filling(self.sequence, self.received, self.size_bytes)


class InlineIntake(Intake):
    """INLINE: a bucket arrives in chunks; its bytes fill ingress slots one after another, each slot
    holding one piece (a bucket no larger than a slot is one piece). A full piece goes to the
    workers at once, so a bucket of any size streams through slots the workers keep freeing."""

    transport = pb.TRANSPORT_INLINE

    def __init__(self, session: IntakeSession, *, fleet: WorkerFleet, ingress: IngressSlots | None,
                 max_chunk_bytes: int) -> None:
        super().__init__(session, fleet=fleet, ingress=ingress, max_chunk_bytes=max_chunk_bytes)
        self.filling: _Filling | None = None
        self.pieces_sent = 0
        """Ingress pieces forwarded: piece p uses slot p % slot_count."""

    async def _accepted(self, start: pb.BucketStart, accepted: Accepted, layout: wpb.OwnedBucket | None) -> None:
        if not self.session.stored_here(start.sequence):
            await self.session.inbox.put(self.forward(start.sequence, start.checksum, discard=False,
                                                      size=accepted.size_bytes))
            return  # no chunks follow: there is nothing here to receive them into
        self.filling = _Filling(start.sequence, accepted.wire_bytes, start.checksum, accepted.compression,
                                layout=layout)
        await self._claim_slot()
        if accepted.size_bytes == 0 and self.session.failure is None:
            self._forward_piece(last=True)

    async def _claim_slot(self) -> None:
        """The next piece's slot (StreamSide.claim_slot): piece p reuses the slot of piece p - slots of the
        stream's run once the workers applied that one; with more parts than slots, the stream waits its turn
        for a free one. Meanwhile the stream is not read, so gRPC flow control holds the client back."""
        try:
            await asyncio.wait_for(self.session.claim_slot(self.pieces_sent), self.session.bucket_timeout)
        except TimeoutError:
            raise DeadlineExceeded("INGRESS_SLOT_TIMEOUT", f"the workers did not apply an earlier piece within "
                                   f"{self.session.bucket_timeout:g} s") from None

    async def chunk(self, chunk: pb.BucketChunk | ChunkView) -> None:
        if self.session.failure is not None:
            return  # the update is failing: chunks are dropped, nothing waits for them
        filling = self.filling
        data = chunk.data
        refusal = check_chunk(filling.expecting() if filling is not None else None, sequence=chunk.sequence,
                              offset_bytes=chunk.offset_bytes, size_bytes=len(data),
                              max_chunk_bytes=self.max_chunk_bytes)
        if refusal is not None:
            self._refuse(refusal)
            return
        assert filling is not None and self.ingress is not None
        ingress = self.ingress
        view = memoryview(data)
        while view:
            room = ingress.slot_bytes - (filling.received - filling.piece_start)
            part, view = view[:room], view[room:]
            ingress.write(self.pieces_sent, filling.received - filling.piece_start, part)
            filling.received += len(part)
            done = filling.received == filling.size_bytes
            if done or filling.received - filling.piece_start == ingress.slot_bytes:
                self._forward_piece(last=done)
                if not done:
                    await self._claim_slot()
                    if self.session.failure is not None:
                        return

    def _forward_piece(self, *, last: bool) -> None:
        filling = self.filling
        assert filling is not None and self.ingress is not None
        piece = self.forward(filling.sequence, filling.checksum, discard=False, size=filling.size_bytes,
                             piece=self.pieces_sent,
                             piece_offset=filling.piece_start, piece_size=filling.received - filling.piece_start,
                             last=last, compression=filling.compression, layout=filling.layout)
        self.pieces_sent += 1
        self.session.inbox.put_nowait(piece)
        filling.piece_start = filling.received
        if last:
            self.filling = None

    def _before_next(self) -> None:
        """Any message but a chunk ends the bucket being filled: it must be complete."""
        filling = self.filling
        if filling is not None and self.session.failure is None:
            self.filling = None
            self._refuse(incomplete(filling.expecting()))

    def _abandon(self) -> None:
        self.filling = None


INTAKES: dict[int, type[Intake]] = {
    pb.TRANSPORT_COLLECTIVE: CollectiveIntake,
    pb.TRANSPORT_INLINE: InlineIntake,
    pb.TRANSPORT_SHM: ShmIntake,
}
"""The intake of each transport (Begin was checked: its transport is one of these)."""


def open_intake(session: IntakeSession, *, transport: int, fleet: WorkerFleet, ingress: IngressSlots | None,
                max_chunk_bytes: int) -> Intake:
    """The reader of one stream of `session`, for the transport its Begin named."""
    return INTAKES[transport](session, fleet=fleet, ingress=ingress, max_chunk_bytes=max_chunk_bytes)
