"""The reading half of an UpdateWeights stream: client messages in, worker receives out.

Each bucket goes to its owner (common/ownership.py), the one worker of the node that
receives it into the store. Each BucketStart is checked and then, by transport:
  - COLLECTIVE: forwarded at once, so the client can pipeline bucket k+1 behind
    bucket k: to the owner alone over Gloo (the trainer sends it there); over NCCL
    to every worker, each joining the broadcast, the others dropping the bytes. A
    wrong announcement (a missing or wrong-length tail included) is still
    joined, at the announced length, and dropped, so the sender never hangs.
  - INLINE: the BucketChunks that follow are written into the bucket's ingress
    slot (after its owner released it: until then the stream is not read,
    which is gRPC's back-pressure); a complete bucket, or a full slot of a
    larger one, is forwarded to the owner.
  - SHM: the client wrote the slot before announcing; it is forwarded to the
    owner at once. It must carry a WS64 checksum (the owner checks its own copy
    of the slot against it). An announcement that reuses a slot before
    BucketApplied freed it is refused.
A deferred bucket (BucketSpec.deferred) comes with its layout: it is checked against
the plan's candidates, the node store routes its patches, and its owner gets that
route with the receive command (it replaces the placeholder the prepare gave).
A bucket with none of the node's tensors (a `--tensors` subset) has no owner: it is
announced as usual and counts as applied at once; no bytes follow it on INLINE, the
trainer sends none over Gloo nor writes its SHM slot, and over NCCL every worker
joins the broadcast and drops it.
The driver (update_session.py) awaits the forwarded receives in order. The intake
owns the announcements, the ingress piece counter and the forwarding; it sees
its session only through IntakeSession, and never writes the session's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from weightsync.common.collective import tail_length
from weightsync.common.errors import DeadlineExceeded, InvalidArgument, WeightSyncError
from weightsync.common.logging import get_logger
from weightsync.common.plan_validation import validate_layout
from weightsync.server.fleet import FleetWorker, WorkerFleet
from weightsync.server.ingress import Ingress
from weightsync.server.wire import ChunkView
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.update")

KNOWN_CHECKSUMS = (tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED, tensor_pb2.CHECKSUM_ALGORITHM_WS64)


# -- what the reader hands the driver ------------------------------------------------
@dataclass(frozen=True, slots=True)
class Bucket:
    """A bucket (or a piece of one) its owner is receiving (over NCCL: every worker, the others dropping it)."""

    sequence: int
    receives: list[tuple[FleetWorker, asyncio.Future[wpb.WorkerEvent]]]
    discard: bool
    last: bool = True
    """False for a piece that does not complete its bucket (INLINE buckets larger than a slot)."""
    in_slot: bool = False
    """Its bytes are in an ingress slot, free again once this settles (a not-stored INLINE bucket has none)."""
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


class IntakeSession(Protocol):
    """What the intake needs from its update session, and all it may change there (fail it)."""

    update_id: str
    plan: tensor_pb2.WeightPlan
    inbox: asyncio.Queue[Item]

    @property
    def failure(self) -> WeightSyncError | None: ...

    @property
    def applied_sent(self) -> int:
        """BucketApplied messages handed to the client: what it can have seen (SHM slot reuse)."""

    @property
    def bucket_timeout(self) -> float: ...

    @property
    def broadcast_to_all(self) -> bool:
        """NCCL: every worker joins every broadcast (non-owners drop the bytes)."""

    @property
    def owners(self) -> list[int]:
        """Per bucket: the worker that receives it."""

    def touched(self, sequence: int) -> None:
        """Bytes of bucket `sequence` may reach the store from now on."""

    def route_is_direct(self, sequence: int) -> bool:
        """Bucket `sequence` is received straight into the store (no staging)."""

    def stored_here(self, sequence: int) -> bool:
        """Bucket `sequence` holds some of this node's tensors (see the module docstring)."""

    def lay_out(self, sequence: int, layout: tensor_pb2.BucketSpec) -> wpb.OwnedBucket:
        """Deferred bucket `sequence` is announced with this (valid) layout: its owner's part."""

    def fail(self, error: WeightSyncError) -> None: ...

    def break_group(self, why: str) -> None:
        """The group is unusable: a broadcast was announced that nobody can receive."""

    async def wait_pieces(self, count: int) -> None:
        """Until the workers finished `count` ingress pieces, or the update failed."""


class BucketIntake:
    """Reads one stream's messages after Begin (see the module docstring)."""

    def __init__(self, session: IntakeSession, *, transport: int, fleet: WorkerFleet, ingress: Ingress | None,
                 max_chunk_bytes: int) -> None:
        self.session = session
        self.transport = transport
        self.fleet = fleet
        self.ingress = ingress
        self.max_chunk_bytes = max_chunk_bytes
        self.filling: _Filling | None = None
        self.announced = 0
        self.pieces_sent = 0
        """Ingress pieces forwarded (INLINE/SHM): piece p uses slot p % slot_count."""
        self.pending: list[Bucket] = []
        """Every bucket forwarded; the session's abort path settles the receives nobody awaited."""

    async def read(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> None:
        inbox = self.session.inbox
        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                try:
                    if kind == "bucket_start":
                        await self._announce(request.bucket_start)
                    elif kind == "bucket_chunk":
                        await self._chunk(request.bucket_chunk)
                    elif kind == "commit":
                        self._refuse_if_filling()
                        await inbox.put(Commit())
                        return
                    elif kind == "abort":
                        self.filling = None  # a client abort is an abort, wherever it comes
                        await inbox.put(Abort(request.abort.reason))
                        return
                    else:
                        self._refuse(InvalidArgument("UNEXPECTED_MESSAGE", f"unexpected {kind or 'empty'} message after begin"))
                except WeightSyncError as error:  # e.g. a worker is not running
                    self._refuse(error)
            await inbox.put(Closed())
        except asyncio.CancelledError:
            raise
        except WeightSyncError as error:  # e.g. MESSAGE_MALFORMED from the parsing layer
            self._refuse(error)
            await inbox.put(Closed())
        except Exception as error:  # noqa: BLE001 - the stream broke: same as closing it
            log.info("update_stream_broken", error=type(error).__name__)
            await inbox.put(Closed())

    def _refuse(self, error: WeightSyncError) -> None:
        """Fail the update; the driver tells the client at once."""
        if self.session.failure is None:
            self.session.fail(error)
            self.session.inbox.put_nowait(Failed(error))

    # -- announcements -------------------------------------------------------------
    def _check(self, start: pb.BucketStart) -> WeightSyncError | None:
        """Why a BucketStart cannot be received into the store, if it cannot."""
        sequence, buckets = start.sequence, len(self.session.plan.buckets)
        announced = self.announced
        if sequence < announced:
            return InvalidArgument("BUCKET_OUT_OF_ORDER", f"bucket {sequence} was already announced; expected "
                                   f"{announced}", bucket=sequence, expected=announced)
        if sequence >= buckets:
            return InvalidArgument("BUCKET_OUT_OF_RANGE", f"bucket {sequence} announced; the plan has {buckets}",
                                   bucket=sequence, buckets=buckets)
        if sequence != announced:
            return InvalidArgument("BUCKET_OUT_OF_ORDER", f"bucket {sequence} announced, expected {announced}",
                                   bucket=sequence, expected=announced)
        bucket = self.session.plan.buckets[sequence]
        if bucket.deferred and not start.HasField("layout"):
            return InvalidArgument("BUCKET_LAYOUT_MISSING", f"bucket {sequence} is deferred: announce it with its "
                                   "layout", bucket=sequence)
        if start.HasField("layout") and not bucket.deferred:
            return InvalidArgument("BUCKET_LAYOUT_UNEXPECTED", f"bucket {sequence} is laid out by the plan: announce "
                                   "it without a layout", bucket=sequence)
        if bucket.deferred:
            try:
                validate_layout(sequence, bucket, start.layout)
            except InvalidArgument as error:
                return error
        planned = bucket_size(self.session.plan, start)
        if start.compression != pb.BUCKET_COMPRESSION_UNSPECIFIED:
            return self._check_compressed(start, planned)
        if start.size_bytes and start.size_bytes != planned:
            return InvalidArgument(
                "BUCKET_SIZE_MISMATCH",
                f"bucket {sequence} is {planned} bytes in the plan but is announced as {start.size_bytes} bytes",
                bucket=sequence, planned_bytes=planned, announced_bytes=start.size_bytes,
            )
        if start.checksum.algorithm not in KNOWN_CHECKSUMS:
            return InvalidArgument("CHECKSUM_ALGORITHM_UNKNOWN", f"bucket {sequence} has unknown checksum algorithm "
                                   f"{start.checksum.algorithm}", bucket=sequence)
        if self.transport == pb.TRANSPORT_COLLECTIVE and len(start.tail) != tail_length(planned):
            return InvalidArgument("BUCKET_TAIL_INVALID", f"bucket {sequence}: tail has {len(start.tail)} bytes; "
                                   f"send the bucket's last {tail_length(planned)} bytes", bucket=sequence,
                                   tail_bytes=len(start.tail), expected=tail_length(planned))
        if self.transport == pb.TRANSPORT_SHM:
            if start.checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_WS64:
                return InvalidArgument("BUCKET_CHECKSUM_REQUIRED", f"bucket {sequence}: an SHM bucket needs its WS64 "
                                       "checksum", bucket=sequence)
            return self._check_slot(sequence)
        return None

    def _check_compressed(self, start: pb.BucketStart, planned: int) -> WeightSyncError | None:
        """A compressed bucket: one zstd frame (a Gloo group, or INLINE), shorter than the bucket (its owner
        checks the frame itself as it decompresses it)."""
        sequence = start.sequence
        if start.compression not in pb.BucketCompression.values():
            return InvalidArgument("BUCKET_COMPRESSION_UNKNOWN", f"bucket {sequence}: unknown compression "
                                   f"{start.compression}", bucket=sequence, compression=start.compression)
        if self.transport == pb.TRANSPORT_SHM or self.session.broadcast_to_all:
            return InvalidArgument("BUCKET_COMPRESSION_UNSUPPORTED", f"bucket {sequence}: compressed buckets travel "
                                   "only over a Gloo group (COLLECTIVE) or INLINE", bucket=sequence)
        if not 0 < start.size_bytes < planned:
            return InvalidArgument(
                "BUCKET_SIZE_MISMATCH", f"bucket {sequence} is {planned} bytes in the plan; its compressed frame is "
                f"announced as {start.size_bytes} bytes (1 to {planned - 1}: send a bucket that does not shrink as "
                "it is)", bucket=sequence, planned_bytes=planned, announced_bytes=start.size_bytes)
        if start.checksum.algorithm not in KNOWN_CHECKSUMS:
            return InvalidArgument("CHECKSUM_ALGORITHM_UNKNOWN", f"bucket {sequence} has unknown checksum algorithm "
                                   f"{start.checksum.algorithm}", bucket=sequence)
        if self.transport == pb.TRANSPORT_COLLECTIVE and len(start.tail) != tail_length(start.size_bytes):
            return InvalidArgument("BUCKET_TAIL_INVALID", f"bucket {sequence}: tail has {len(start.tail)} bytes; "
                                   f"send the frame's last {tail_length(start.size_bytes)} bytes", bucket=sequence,
                                   tail_bytes=len(start.tail), expected=tail_length(start.size_bytes))
        return None

    def _check_slot(self, sequence: int) -> WeightSyncError | None:
        """SHM: the client may write bucket k's slot only after BucketApplied(k - slots) came back."""
        assert self.ingress is not None
        slots = self.ingress.slot_count
        if sequence - slots >= self.session.applied_sent:
            return InvalidArgument(
                "SHM_SLOT_BUSY",
                f"bucket {sequence} was announced before bucket {sequence - slots} (same ingress slot) was applied: "
                "wait for its BucketApplied before writing the slot",
                bucket=sequence, slot=sequence % slots,
            )
        return None

    async def _announce(self, start: pb.BucketStart) -> None:
        self._refuse_if_filling()
        if self.session.failure is None:
            refusal = self._check(start)
            if refusal is not None:
                self._refuse(refusal)
        if self.session.failure is None:
            self.announced += 1
            size = bucket_size(self.session.plan, start)
            layout = self.session.lay_out(start.sequence, start.layout) if start.HasField("layout") else None
            if self.transport == pb.TRANSPORT_INLINE and not self.session.stored_here(start.sequence):
                await self.session.inbox.put(self.forward(start.sequence, start.checksum, discard=False, size=size))
                return  # no chunks follow: there is nothing here to receive them into
            if self.transport == pb.TRANSPORT_INLINE:
                compressed = start.compression != pb.BUCKET_COMPRESSION_UNSPECIFIED
                self.filling = _Filling(start.sequence, start.size_bytes if compressed else size, start.checksum,
                                        start.compression, layout=layout)
                await self._claim_slot()
                if size == 0:
                    self._forward_piece(last=True)
                return
            shm = self.transport == pb.TRANSPORT_SHM
            assert not shm or self.ingress is not None
            compression = start.compression
            await self.session.inbox.put(self.forward(
                start.sequence, start.checksum, discard=False, size=start.size_bytes if compression else size,
                tail=start.tail, compression=compression, layout=layout,
                ingress_offset=self.ingress.slot_offset(start.sequence) if shm and self.ingress else None))
            if shm:
                self.pieces_sent += 1
            return
        if self.transport == pb.TRANSPORT_COLLECTIVE:
            # Every refused announcement is drained: the trainer's broadcast follows regardless.
            await self._drain(start)

    async def _drain(self, start: pb.BucketStart) -> None:
        """The update is failing: join the announced broadcast at its length, or break the group."""
        length = self._announced_length(start)
        owned = 0 <= start.sequence < len(self.session.owners)
        if length is None or not (owned or self.session.broadcast_to_all):
            # Nothing can receive it: the sender's transfer fails at the group timeout, so the group breaks.
            assert self.session.failure is not None
            self.session.break_group(f"{self.session.failure.reason}: bucket {start.sequence} was announced with a "
                                     "length, or a sequence, the workers cannot drain")
            await self.session.inbox.put(Failed(self.session.failure))
            return
        await self.session.inbox.put(self.forward(start.sequence, start.checksum, discard=True, size=length))

    def _announced_length(self, start: pb.BucketStart) -> int | None:
        """The length of the broadcast that follows a BucketStart, if it is known and drainable."""
        if start.size_bytes < 0:
            return None
        length = start.size_bytes
        if not length:
            if not 0 <= start.sequence < len(self.session.plan.buckets):
                return None
            length = bucket_size(self.session.plan, start)
        # Draining costs a scratch buffer of that length on every worker: no more than the plan's largest bucket.
        return length if length <= max(b.size_bytes for b in self.session.plan.buckets) else None

    # -- INLINE ----------------------------------------------------------------------
    # A bucket arrives in chunks; its bytes fill ingress slots one after another, each slot
    # holding one piece (a bucket no larger than a slot is one piece). A full piece goes to the
    # workers at once, so a bucket of any size streams through slots the workers keep freeing.
    async def _claim_slot(self) -> None:
        """Piece p reuses the slot of piece p - slots: wait until the workers applied that one.
        Meanwhile the stream is not read, so gRPC flow control holds the client back."""
        assert self.ingress is not None
        pieces, slots = self.pieces_sent, self.ingress.slot_count
        try:
            await asyncio.wait_for(self.session.wait_pieces(pieces - slots + 1), self.session.bucket_timeout)
        except TimeoutError:
            raise DeadlineExceeded("INGRESS_SLOT_TIMEOUT", f"the workers did not apply an earlier piece within "
                                   f"{self.session.bucket_timeout:g} s") from None

    async def _chunk(self, chunk: pb.BucketChunk | ChunkView) -> None:
        if self.session.failure is not None:
            return  # the update is failing: chunks are dropped, nothing waits for them
        filling = self.filling
        data = chunk.data
        error = None
        if self.transport != pb.TRANSPORT_INLINE or filling is None or chunk.sequence != filling.sequence:
            error = InvalidArgument("CHUNK_UNEXPECTED", f"a chunk for bucket {chunk.sequence}, which is not being sent",
                                    bucket=chunk.sequence)
        elif chunk.offset_bytes != filling.received:
            error = InvalidArgument("CHUNK_OUT_OF_ORDER", f"bucket {chunk.sequence}: chunk at offset "
                                    f"{chunk.offset_bytes}, expected {filling.received}", bucket=chunk.sequence,
                                    offset_bytes=chunk.offset_bytes, expected=filling.received)
        elif not 0 < len(data) <= self.max_chunk_bytes:
            error = InvalidArgument("CHUNK_SIZE_INVALID", f"bucket {chunk.sequence}: a chunk of {len(data)} bytes "
                                    f"(1 to {self.max_chunk_bytes})", bucket=chunk.sequence,
                                    size_bytes=len(data))
        elif chunk.offset_bytes + len(data) > filling.size_bytes:
            error = InvalidArgument("CHUNK_OVERFLOW", f"bucket {chunk.sequence}: a chunk ends at byte "
                                    f"{chunk.offset_bytes + len(data)}, past the bucket's {filling.size_bytes}",
                                    bucket=chunk.sequence, size_bytes=filling.size_bytes)
        if error is not None:
            self._refuse(error)
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
                             ingress_offset=self.ingress.slot_offset(self.pieces_sent),
                             piece_offset=filling.piece_start, piece_size=filling.received - filling.piece_start,
                             last=last, compression=filling.compression, layout=filling.layout)
        self.pieces_sent += 1
        self.session.inbox.put_nowait(piece)
        filling.piece_start = filling.received
        if last:
            self.filling = None

    def _refuse_if_filling(self) -> None:
        filling = self.filling
        if filling is not None and self.session.failure is None:
            self.filling = None
            self._refuse(InvalidArgument(
                "BUCKET_INCOMPLETE", f"bucket {filling.sequence} got {filling.received} of its "
                f"{filling.size_bytes} bytes before the next message", bucket=filling.sequence,
                received=filling.received, size_bytes=filling.size_bytes,
            ))

    # -- forwarding ----------------------------------------------------------------------
    def forward(self, sequence: int, checksum: tensor_pb2.Checksum, *, discard: bool, size: int,
                ingress_offset: int | None = None, piece_offset: int = 0, piece_size: int = 0,
                last: bool = True, tail: bytes = b"", compression: int = pb.BUCKET_COMPRESSION_UNSPECIFIED,
                layout: wpb.OwnedBucket | None = None) -> Bucket:
        """Bucket `sequence` is received now: its owner joins the transfer that follows (NCCL: every other
        worker joins it too and drops the bytes), or copies the bucket (or one piece of it) from the ingress
        at `ingress_offset`. A worker that cannot take the command (it died) answers with its error; the
        others still get theirs, so none of them waits on a transfer the rest never joined."""
        command = wpb.ReceiveBucketCommand(update_id=self.session.update_id, sequence=sequence, checksum=checksum,
                                           discard=discard, size_bytes=size, from_ingress=ingress_offset is not None,
                                           ingress_offset_bytes=ingress_offset or 0, piece_offset_bytes=piece_offset,
                                           piece_size_bytes=piece_size, last_piece=last, tail=tail,
                                           compression=compression)
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
        bucket = Bucket(sequence, receives, discard, last, in_slot=ingress_offset is not None,
                        compressed=compression != pb.BUCKET_COMPRESSION_UNSPECIFIED)
        self.pending.append(bucket)
        return bucket

    def forwarded_to(self, worker_index: int) -> list[int]:
        """The buckets forwarded to this worker to receive into the store (not to drop)."""
        return sorted({b.sequence for b in self.pending if not b.discard
                       and any(w.index == worker_index for w, _ in b.receives)})


def bucket_size(plan: tensor_pb2.WeightPlan, start: pb.BucketStart) -> int:
    """The length of an announced bucket: its layout's for a deferred one, the plan's otherwise."""
    if start.HasField("layout"):
        return start.layout.size_bytes
    return plan.buckets[start.sequence].size_bytes
