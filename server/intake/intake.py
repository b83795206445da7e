"""The reading half of an UpdateWeights stream: client messages in, worker receives out.

One intake reads one stream after Begin. Each bucket goes to its owner
(common/ownership.py), the one worker of the node that receives it into the
store. What a message may say is decided by the announcement rules
(announcements.py, pure functions every transport shares); what an accepted
BucketStart forwards, and when, is the transport's: one Intake subclass per
transport (transports.py), chosen once when the update begins:
  - COLLECTIVE forwards each announcement at once (the client pipelines
    bucket k+1 behind bucket k) and drains a refused one, so the sender never
    hangs;
  - INLINE writes the BucketChunks that follow into ingress slots and forwards
    each full slot (piece);
  - SHM forwards the slot the client wrote before announcing, or, for a bucket
    the client writes straight into the store (server/store/writes.py), tells
    its owner to check it there.
A deferred bucket (BucketSpec.deferred) comes with its layout: it is checked against
the plan's candidates, the node store routes its patches, and its owner gets that
route with the receive command (it replaces the placeholder the prepare gave).
A bucket with none of the node's tensors (a `--tensors` subset) has no owner: it is
announced as usual and counts as applied at once; no bytes follow it on INLINE, the
trainer sends none over Gloo nor writes its SHM slot, and over NCCL every worker
joins the broadcast and drops it.

The driver (server/update/session.py) awaits the forwarded receives in order. An intake
owns its stream's announcements, its ingress piece counter and the forwarding; it
sees its session only through IntakeSession, never writes the session's state, and
the session sees it only as a StreamReader (so one session can be fed by several).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar, Protocol

from weightsync.common.errors import WeightSyncError
from weightsync.common.logging import get_logger
from weightsync.server.intake.announcements import (
    Accepted,
    Link,
    check_chunk,
    check_start,
    unexpected,
)
from weightsync.server.intake.wire import ChunkView
from weightsync.server.workers.worker_fleet import FleetWorker, WorkerFleet
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.update")


# -- what the reader hands the driver ------------------------------------------------
@dataclass(frozen=True, slots=True)
class Bucket:
    """A bucket (or a piece of one) its owner is receiving (over NCCL: every worker, the others dropping it)."""

    sequence: int
    """The store's sequence (server/update/streams.py: a stream's bucket k is the store's first + k)."""
    receives: list[tuple[FleetWorker, asyncio.Future[wpb.WorkerEvent]]]
    discard: bool
    last: bool = True
    """False for a piece that does not complete its bucket (INLINE buckets larger than a slot)."""
    piece: int | None = None
    """Its bytes are in an ingress slot, as its stream's ingress piece `piece`: the slot is free again once
    this settles. None: no slot (a collective transfer; a not-stored INLINE bucket)."""
    compressed: bool = False
    """A zstd frame (or a piece of one): its owner writes the store only once the whole frame checked out."""


@dataclass(frozen=True, slots=True)
class Commit:
    pass


@dataclass(frozen=True, slots=True)
class Abort:
    reason: str


@dataclass(frozen=True, slots=True)
class Closed:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    error: WeightSyncError


@dataclass(frozen=True, slots=True)
class ShuttingDown:
    pass


Item = Bucket | Commit | Abort | Closed | Failed | ShuttingDown


class Inbox(Protocol):
    """Where an intake hands the driver what its stream says (the session tags each item with the stream)."""

    async def put(self, item: Item) -> None: ...

    def put_nowait(self, item: Item) -> None: ...


class IngressSlots(Protocol):
    """The ingress slots an intake may use: the whole ingress (server/store/ingress.py), or its stream's share of them."""

    slot_bytes: int
    first_slot: int
    """The ingress slot of this run's sequence 0 (0 for the whole ingress)."""
    slot_count: int

    def slot_offset(self, sequence: int) -> int: ...

    def write(self, sequence: int, offset_bytes: int, data: bytes | memoryview) -> None: ...


class IntakeSession(Protocol):
    """What an intake needs from its update session, and all it may change there (fail it). It is its
    stream's side of the session (server/update/stream_side.py): the stream's own plan, counters and
    sequences (bucket k of the stream's plan); what it puts in the inbox is tagged with the stream."""

    update_id: str
    stream: int
    """The stream's part rank (0 for an update of one stream): over COLLECTIVE, the group rank that sends its
    buckets."""
    plan: tensor_pb2.WeightPlan
    """The stream's own plan."""
    inbox: Inbox

    @property
    def failure(self) -> WeightSyncError | None: ...

    @property
    def applied_sent(self) -> int:
        """BucketApplied messages handed to the client: what it can have seen (SHM slot reuse)."""

    @property
    def bucket_timeout(self) -> float: ...

    @property
    def parts(self) -> int:
        """How many streams feed the update (1: the whole update from one stream)."""

    @property
    def broadcast_to_all(self) -> bool:
        """NCCL, one stream: every worker joins every broadcast (non-owners drop the bytes). Parts over NCCL
        send each bucket point-to-point to its owner, as over Gloo."""

    @property
    def owners(self) -> list[int]:
        """Per bucket: the worker that receives it."""

    def store_sequence(self, sequence: int) -> int:
        """The store's sequence of the stream's bucket `sequence` (workers receive it under that one)."""

    def touched(self, sequence: int) -> None:
        """Bytes of bucket `sequence` may reach the store from now on."""

    def route_is_direct(self, sequence: int) -> bool:
        """Bucket `sequence` is received straight into the store (no staging)."""

    def stored_here(self, sequence: int) -> bool:
        """Bucket `sequence` holds some of this node's tensors (see the module docstring)."""

    def in_store(self, sequence: int) -> bool:
        """SHM: the client writes bucket `sequence` straight into the store, not into a slot
        (UpdateReady.store_places)."""

    def lay_out(self, sequence: int, layout: tensor_pb2.BucketSpec) -> wpb.OwnedBucket:
        """Deferred bucket `sequence` is announced with this (valid) layout: its owner's part."""

    def fail(self, error: WeightSyncError) -> None: ...

    def break_group(self, why: str) -> None:
        """The group is unusable: a broadcast was announced that nobody can receive."""

    async def claim_slot(self, piece: int) -> None:
        """Until this stream's ingress piece `piece` may be written into its slot (slot_offset(piece)), or
        the update failed."""


class StreamReader(Protocol):
    """What an update session sees of the reader of one stream that feeds it."""

    async def read(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> None:
        """Read the stream to its end, handing the session's inbox what it says."""

    def forwarded_to(self, worker_index: int) -> list[int]:
        """The buckets (the store's sequences) this stream forwarded to the worker to receive into the store
        (not to drop)."""

    def take_pending(self) -> list[Bucket]:
        """Every bucket forwarded so far, handed over once (the abort path settles their receives)."""


class Intake:
    """Reads one stream's messages after Begin: the message loop and the forwarding every transport shares.

    A subclass per transport says what an accepted BucketStart forwards (`_accepted`), what a refused
    one still needs (`_refused`), and whether chunks follow (`chunk`)."""

    transport: ClassVar[int]
    """pb.Transport this intake reads."""

    def __init__(self, session: IntakeSession, *, fleet: WorkerFleet, ingress: IngressSlots | None,
                 max_chunk_bytes: int) -> None:
        self.session = session
        self.fleet = fleet
        self.ingress = ingress
        self.max_chunk_bytes = max_chunk_bytes
        in_store = frozenset(k for k in range(len(session.plan.buckets)) if session.in_store(k)) if (
            self.transport == pb.TRANSPORT_SHM) else frozenset()
        self.link = Link(self.transport, broadcast_to_all=session.broadcast_to_all,
                         slot_count=ingress.slot_count if ingress is not None else 0, in_store=in_store)
        self.announced = 0
        """Buckets announced and accepted: the next BucketStart must name this one."""
        self.pending: list[Bucket] = []
        """Every bucket forwarded; the session's abort path settles the receives nobody awaited."""

    async def read(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> None:
        inbox = self.session.inbox
        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                try:
                    if kind == "bucket_start":
                        await self.announce(request.bucket_start)
                    elif kind == "bucket_chunk":
                        await self.chunk(request.bucket_chunk)
                    elif kind == "commit":
                        self._before_next()
                        await inbox.put(Commit())
                        return
                    elif kind == "abort":
                        self._abandon()  # a client abort is an abort, wherever it comes
                        self._ended(Abort(request.abort.reason))
                        await inbox.put(Abort(request.abort.reason))
                        return
                    else:
                        self._refuse(unexpected(kind))
                except WeightSyncError as error:  # e.g. a worker is not running
                    self._refuse(error)
            self._ended(Closed())
            await inbox.put(Closed())
        except asyncio.CancelledError:
            raise
        except WeightSyncError as error:  # e.g. MESSAGE_MALFORMED from the parsing layer
            self._refuse(error)
            await inbox.put(Closed())
        except Exception as error:  # noqa: BLE001 - the stream broke: same as closing it
            log.info("update_stream_broken", error=type(error).__name__)
            self._ended(Closed())
            await inbox.put(Closed())

    def _ended(self, end: Abort | Closed) -> None:
        """The stream ended before commit (its client aborted, closed it, or died): the driver learns it from the
        inbox, in order. A transport whose driver may meanwhile wait on a transfer that only this stream would
        have started fails the update at once instead (CollectiveIntake)."""

    def _refuse(self, error: WeightSyncError) -> None:
        """Fail the update; the driver tells the client at once."""
        if self.session.failure is None:
            self.session.fail(error)
            self.session.inbox.put_nowait(Failed(error))

    # -- announcements -------------------------------------------------------------
    async def announce(self, start: pb.BucketStart) -> None:
        """A BucketStart: checked by the rules, then forwarded by the transport (or, refused, drained)."""
        self._before_next()
        decision: Accepted | WeightSyncError | None = None
        if self.session.failure is None:
            decision = check_start(start, self.session.plan, expected=self.announced, link=self.link,
                                   applied_sent=self.session.applied_sent)
            if not isinstance(decision, Accepted):
                self._refuse(decision)
        if self.session.failure is None and isinstance(decision, Accepted):
            self.announced += 1
            layout = self.session.lay_out(start.sequence, start.layout) if start.HasField("layout") else None
            await self._accepted(start, decision, layout)
            return
        await self._refused(start)

    async def _accepted(self, start: pb.BucketStart, accepted: Accepted, layout: wpb.OwnedBucket | None) -> None:
        """Bucket `start.sequence` may be received: forward it (now, or as its bytes arrive)."""
        raise NotImplementedError

    async def _refused(self, start: pb.BucketStart) -> None:
        """The update is failing and `start` was not accepted: nothing follows it that needs receiving."""

    async def chunk(self, chunk: pb.BucketChunk | ChunkView) -> None:
        """A BucketChunk: no bucket is filled by chunks on this transport."""
        if self.session.failure is not None:
            return  # the update is failing: chunks are dropped, nothing waits for them
        refusal = check_chunk(None, sequence=chunk.sequence, offset_bytes=chunk.offset_bytes,
                              size_bytes=len(chunk.data), max_chunk_bytes=self.max_chunk_bytes)
        if refusal is not None:
            self._refuse(refusal)

    def _before_next(self) -> None:
        """A message other than a chunk arrived (nothing to check where no bucket fills by chunks)."""

    def _abandon(self) -> None:
        """The client aborts: forget what it was sending."""

    # -- forwarding ----------------------------------------------------------------------
    def forward(self, sequence: int, checksum: tensor_pb2.Checksum, *, discard: bool, size: int,
                piece: int | None = None, piece_offset: int = 0, piece_size: int = 0,
                last: bool = True, tail: bytes = b"", compression: int = pb.BUCKET_COMPRESSION_UNSPECIFIED,
                layout: wpb.OwnedBucket | None = None, in_store: bool = False) -> Bucket:
        """Bucket `sequence` is received now: its owner joins the transfer that follows (NCCL: every other
        worker joins it too and drops the bytes), or copies the bucket (or one piece of it) from the ingress
        slot of this stream's ingress piece `piece` (INLINE: the pieces it forwarded; SHM: the bucket). A worker that cannot take the command (it died) answers with its error; the
        others still get theirs, so none of them waits on a transfer the rest never joined."""
        stored_as = self.session.store_sequence(sequence)
        ingress_offset = None
        if piece is not None:
            assert self.ingress is not None
            ingress_offset = self.ingress.slot_offset(piece)
        command = wpb.ReceiveBucketCommand(update_id=self.session.update_id, sequence=stored_as, checksum=checksum,
                                           discard=discard, size_bytes=size, from_ingress=ingress_offset is not None,
                                           ingress_offset_bytes=ingress_offset or 0, piece_offset_bytes=piece_offset,
                                           piece_size_bytes=piece_size, last_piece=last, tail=tail,
                                           compression=compression, in_store=in_store)
        if self.transport == pb.TRANSPORT_COLLECTIVE:  # who sends it, under which tag (its own plan's index)
            command.source_rank = self.session.stream
            command.source_sequence = sequence
        owners = self.session.owners
        owner = owners[sequence] if 0 <= sequence < len(owners) else None
        if not discard and not compression and self.session.route_is_direct(sequence):
            # Received straight into the store: its bytes may land at any time. (A compressed frame lands
            # in the owner's wire buffer; the owner says whether the bucket reached the store.)
            self.session.touched(sequence)
        receives = []
        for worker in self.fleet.workers:
            if worker.index == owner:
                owned = command
                if layout is not None and not discard:
                    owned = wpb.ReceiveBucketCommand()
                    owned.CopyFrom(command)
                    owned.layout.CopyFrom(layout)
                receives.append((worker, self.fleet.submit_or_refusal(worker, receive_bucket=owned)))
            elif self.session.broadcast_to_all and ingress_offset is None:
                dropped = wpb.ReceiveBucketCommand()
                dropped.CopyFrom(command)
                dropped.discard = True
                receives.append((worker, self.fleet.submit_or_refusal(worker, receive_bucket=dropped)))
        bucket = Bucket(stored_as, receives, discard, last, piece=piece,
                        compressed=compression != pb.BUCKET_COMPRESSION_UNSPECIFIED)
        self.pending.append(bucket)
        return bucket

    def forwarded_to(self, worker_index: int) -> list[int]:
        """The buckets forwarded to this worker to receive into the store (not to drop)."""
        return sorted({b.sequence for b in self.pending if not b.discard
                       and any(w.index == worker_index for w, _ in b.receives)})

    def take_pending(self) -> list[Bucket]:
        pending, self.pending = self.pending, []
        return pending
