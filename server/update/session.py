"""One update, from Begin to Committed (or to an abort), fed by one stream or by one stream per part.

Two kinds of task cooperate:
  - a reader per stream that feeds the update (server/intake/intake.py; one per
    part, and a stream without a part is the whole update) takes client
    messages and forwards each bucket to its owner (and, for an NCCL
    broadcast, to every other worker, which joins it and drops the bytes) as
    soon as its bytes can be received: at once for a collective or an SHM
    slot, once its chunks are in for INLINE;
  - the driver (this module, run by the handler of the first stream) awaits
    the workers' answers in the order the readers put them in the inbox, each
    tagged with its stream, and writes each stream's BucketApplied, Aborting
    and Committed: its own stream's it yields, the others' it queues for
    their handlers (`follow`).
The session sees a reader only as a StreamReader (read, forwarded_to,
take_pending), and a reader sees the session only as its stream's side
(StreamSide, an IntakeSession: stream_side.py): each stream has its own plan,
sequences and counters (streams.py).

The node's store (server/store/node_store.py) decides where every byte goes before any
moves: the session derives the update there (one plan: the streams' plans one
after another), admits its memory, allocates and hands each worker its assignment
(prepare.py), and at the end commits the store and publishes the
version in one step (no lease sees one without the other; commit.py),
or aborts it (abort.py). It commits once every stream asked to commit, each having
had every bucket of its own applied: a stream that asked first waits.

Once anything fails the session is "aborting": it tells every stream (the
failing part's its own failure, the others PART_FAILED naming that part),
keeps draining what the clients already announced (workers join those
transfers and drop the bytes, so nobody hangs), and ends with the failure's
status when every stream has sent abort, commit or closed. Whatever happens,
the workers' update is committed or aborted before the update gate is
released.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from weightsync.common.errors import (
    Aborted,
    Unavailable,
    WeightSyncError,
    code_number,
)
from weightsync.common.logging import get_logger
from weightsync.common.ownership import NO_OWNER
from weightsync.server.groups import GroupRecord
from weightsync.server.intake.announcements import check_commit
from weightsync.server.intake.intake import (
    Abort,
    Bucket,
    Closed,
    Commit,
    Failed,
    Item,
    ShuttingDown,
    StreamReader,
)
from weightsync.server.intake.transports import open_intake
from weightsync.server.parts.rules import client_idle, part_failed
from weightsync.server.store.node_store import StoreUpdate
from weightsync.server.tasks import finish_despite_cancel, retrieve_quietly
from weightsync.server.update.abort import finish
from weightsync.server.update.commit import commit
from weightsync.server.update.prepare import prepare
from weightsync.server.update.stream_side import StreamSide
from weightsync.server.update.streams import END, Stream, attributed, ingress_shares
from weightsync.server.update.view import SessionServices
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.update")

KEEPALIVE_SECONDS = 10.0
"""A part that asked to commit hears PartsWaiting{sending} at once and at least this often until the others
have (as a joining part does: parts.joins.KEEPALIVE_SECONDS)."""
BUCKET_MARGIN_SECONDS = 2.0
"""Slack on top of the group timeout for a worker to report a bucket (it reports a collective
timeout itself at the group timeout; a worker that stays silent longer is killed)."""


@dataclass(slots=True)
class UpdateSession:
    services: SessionServices
    update_id: str
    group: GroupRecord | None
    """The transfer group (COLLECTIVE); None for INLINE and SHM."""
    begin: pb.BeginUpdate
    plan: tensor_pb2.WeightPlan
    """The store's plan: the streams' plans one after another (one stream: its own)."""
    plan_id: str
    streams: list[Stream] = field(default_factory=list)
    """The streams that feed this update, in rank order (streams.py); empty at construction: one
    stream, rank 0, of the whole plan. The first one drives the update (its handler runs `run`)."""
    inbox: asyncio.Queue[tuple[int | None, Item]] = field(default_factory=asyncio.Queue)
    """What the streams' readers say, each tagged with its stream's rank (None: the server's own)."""
    store_update: StoreUpdate | None = None
    """The node store's side of this update, once derived."""
    failure: WeightSyncError | None = None
    failed_part: int | None = None
    """The rank of the stream whose part failed the update (None: the update itself, e.g. idle)."""
    applied_bytes: int = 0
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever a piece or bucket was done or the update failed (frees ingress slots)."""
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the update failed: the driver stops waiting for buckets and tells the clients."""
    ready_sent: bool = False
    """Every stream was handed its UpdateReady (from then on a failure is told with UpdateAborting)."""
    finished: bool = False
    recorded: bool = False
    """The metrics of this update were recorded (once, whatever its end)."""
    torn: set[str] = field(default_factory=set)
    """Tensors a commit that failed half-way may have half-written (STAGED patches)."""
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.streams:
            self.streams = [Stream(rank=0, plan=self.plan, plan_id=self.plan_id, first=0)]
        ingress = self.services.ingress
        if ingress is not None:
            shares = [ingress] if len(self.streams) == 1 else ingress_shares(ingress, len(self.streams))
            for stream, share in zip(self.streams, shares, strict=True):
                stream.ingress = share

    @property
    def bucket_timeout(self) -> float:
        if self.group is None:
            return self.services.transfer_timeout
        return self.group.timeout.total_seconds() + BUCKET_MARGIN_SECONDS

    @property
    def in_place(self) -> bool:
        return self.begin.mode == pb.UPDATE_MODE_IN_PLACE

    @property
    def broadcast_to_all(self) -> bool:
        """NCCL: every worker joins every broadcast (non-owners drop the bytes)."""
        return self.group is not None and self.group.backend == pb.BACKEND_NCCL

    @property
    def owners(self) -> list[int]:
        assert self.store_update is not None
        return self.store_update.owners

    @property
    def driving(self) -> Stream:
        """The stream whose handler runs the update (`run` yields its responses)."""
        return self.streams[0]

    @property
    def readers(self) -> list[StreamReader]:
        """The readers of the streams that feed this update."""
        return [stream.reader for stream in self.streams if stream.reader is not None]

    @property
    def reading(self) -> list[asyncio.Task[None]]:
        """Their tasks; cancelled when the update ends."""
        return [stream.reading for stream in self.streams if stream.reading is not None]

    @property
    def applied(self) -> int:
        return sum(stream.applied for stream in self.streams)

    def stream(self, rank: int) -> Stream:
        return next(stream for stream in self.streams if stream.rank == rank)

    def break_group(self, why: str) -> None:
        if self.group is not None:
            self.services.groups.mark_broken(self.group.group_id, why)

    def request_shutdown(self) -> None:
        """Server is draining and the grace period ran out."""
        self.inbox.put_nowait((None, ShuttingDown()))

    def route_is_direct(self, sequence: int) -> bool:
        """Bucket `sequence` is received straight into the store (no staging)."""
        update = self.store_update
        return update is not None and 0 <= sequence < len(update.plan.routes) and update.plan.routes[sequence].direct

    def stored_here(self, sequence: int) -> bool:
        update = self.store_update
        return update is None or not 0 <= sequence < len(update.plan.routes) or update.plan.routes[sequence].stored

    def in_store(self, sequence: int) -> bool:
        """Bucket `sequence` is written straight into the store by the SHM trainer (UpdateReady.store_places)."""
        return self.store_update is not None and sequence in self.store_update.client_written

    def touched(self, sequence: int) -> None:
        """Bytes of bucket `sequence` may have reached the store (an IN_PLACE abort marks them dirty)."""
        if self.store_update is not None:
            self.services.store.touched(self.store_update, sequence)

    def lay_out(self, sequence: int, layout: tensor_pb2.BucketSpec) -> wpb.OwnedBucket:
        assert self.store_update is not None
        return self.services.store.lay_out(self.store_update, sequence, layout)

    def feed(self, stream: Stream, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> None:
        """Read `requests` (a stream after its Begin) into this update, through its transport's intake."""
        services = self.services
        stream.reader = open_intake(StreamSide(self, stream), transport=self.begin.transport, fleet=services.fleet,
                                    ingress=stream.ingress, max_chunk_bytes=services.max_chunk_bytes)
        stream.reading = asyncio.create_task(stream.reader.read(requests))

    def forwarded_to(self, worker_index: int) -> list[int]:
        """The buckets any stream forwarded to this worker to receive into the store."""
        return sorted({sequence for reader in self.readers for sequence in reader.forwarded_to(worker_index)})

    # -- the streams that follow -----------------------------------------------------
    async def follow(self, rank: int) -> AsyncIterator[pb.UpdateWeightsResponse]:
        """The responses of stream `rank` (not the driving one): what the driver hands it, to the update's
        end (the driver always ends with END); then, unless the update committed, its failure as this part
        sees it. A stream that goes away early (its handler cancelled) fails the update as closed."""
        stream = self.stream(rank)
        committed = False
        try:
            while (message := await stream.responses.get()) is not END:
                if message.HasField("bucket_applied"):
                    stream.applied_sent += 1  # counted when handed to gRPC, as the driver counts its own
                committed = committed or message.HasField("committed")
                yield message
        finally:
            if not stream.ended and not self.finished:
                self.inbox.put_nowait((rank, Closed()))
        if not committed:
            if self.failure is None:  # the driver's handler went away before anything failed
                raise Aborted("ABORTED", "the update did not commit")
            raise self.failure_for(stream)

    def failure_for(self, stream: Stream) -> WeightSyncError:
        """The update's failure as stream `stream` learns it: its own, or which other part failed."""
        assert self.failure is not None
        if self.failed_part is None or self.failed_part == stream.rank or not self.begin.HasField("part"):
            return self.failure
        return part_failed(self.begin.part.update_key, self.failed_part, self.failure)

    def _hand(self, stream: Stream, message: pb.UpdateWeightsResponse) -> bool:
        """True when the driver yields `message` itself (the driving stream's); else it is queued."""
        if stream is self.driving:
            return True
        stream.responses.put_nowait(message)
        return False

    # -- driver ------------------------------------------------------------------
    async def run(self, requests: AsyncIterator[pb.UpdateWeightsRequest],
                  following: dict[int, AsyncIterator[pb.UpdateWeightsRequest]] | None = None,
                  ) -> AsyncIterator[pb.UpdateWeightsResponse]:
        """Drive the update: `requests` is the driving stream's, `following` the others' by rank (their
        responses come from `follow`). Yields the driving stream's responses."""
        if self.group is not None:
            self.services.groups.update_started(self.group)
        try:
            await prepare(self)
            self.services.publisher.publish_state()  # watchers see UPDATING
            log.info("update_ready", buckets=len(self.plan.buckets), fast_path=self._fast(None),
                     version=self.begin.version)
            for stream in self.streams[1:]:
                self._hand(stream, self._ready(stream))
            self.ready_sent = True
            yield self._ready(self.driving)
            self.feed(self.driving, requests)
            for rank, followed in (following or {}).items():
                self.feed(self.stream(rank), followed)
            idle = self.bucket_timeout
            loop = asyncio.get_running_loop()
            quiet_until: float | None = None
            while True:
                if quiet_until is None:  # the idle bound counts from here, after the last message was handled
                    quiet_until = loop.time() + idle
                waiting = [s for s in self.streams if s.commit_asked] if self.failure is None else []
                wait = quiet_until - loop.time()
                try:
                    rank, item = await asyncio.wait_for(self.inbox.get(),
                                                        min(wait, KEEPALIVE_SECONDS) if waiting else wait)
                except TimeoutError:
                    if loop.time() < quiet_until:  # parts that asked to commit hear that the others still send
                        for stream in waiting:
                            if self._hand(stream, self._sending()):
                                yield self._sending()
                        continue
                    silent = [s.rank for s in self.streams if not (s.ended or s.commit_asked)]
                    self.fail(client_idle(idle, silent if len(self.streams) > 1 else ()))  # names the stalled parts
                    break
                quiet_until = None
                stream = self.stream(rank) if rank is not None else self.driving
                if isinstance(item, Bucket):
                    message = await self._bucket_done(stream, item)
                    if message is not None and self._hand(stream, message):
                        # Counted when handed to gRPC: the client may act on it before we resume.
                        stream.applied_sent += 1
                        yield message
                elif isinstance(item, Commit):
                    stream.ended = True
                    if self.failure is None:
                        self._commit_asked(stream)
                        if all(s.commit_asked for s in self.streams):  # the barrier: every part asked
                            committed = await commit(self)
                            for other in self.streams[1:]:
                                self._hand(other, committed)
                            yield committed
                            return
                        if self._hand(stream, self._sending()):  # it waits for the others
                            yield self._sending()
                        continue
                    if self._all_ended():
                        break
                elif isinstance(item, Abort):
                    stream.ended = True
                    self.fail(Aborted("ABORTED_BY_CLIENT", f"the client aborted the update: {item.reason or 'no reason given'}"),
                              part=stream.rank)
                    if self._all_ended():
                        break
                elif isinstance(item, Closed):
                    stream.ended = True
                    self.fail(Aborted("STREAM_CLOSED", "the client closed the stream before commit"), part=stream.rank)
                    if self._all_ended():
                        break
                elif isinstance(item, Failed):
                    self.fail(item.error, part=stream.rank)
                elif isinstance(item, ShuttingDown):
                    self.fail(Unavailable("SERVER_SHUTTING_DOWN", "the server is shutting down"))
                    for other in self.streams[1:]:
                        self._hand(other, self._aborting_message(other))
                    yield self._aborting_message(self.driving)
                    break
                if self.failure is not None:
                    for other in self.streams[1:]:
                        if not other.aborting_sent:
                            self._hand(other, self._aborting_message(other))
                    if not self.driving.aborting_sent:
                        yield self._aborting_message(self.driving)
            assert self.failure is not None
            raise self.failure_for(self.driving)
        except WeightSyncError as error:  # refused in prepare or commit: recorded as what it was
            if self.failure is None:
                self.fail(*attributed(error, self.streams))
                raise self.failure_for(self.driving) from None
            raise
        finally:
            if len(self.streams) > 1 and self.failure is None and not self.finished:
                # The driving stream's handler went away (its client died): the others learn which part left.
                self.fail(Aborted("STREAM_CLOSED", "the part's stream ended before commit"), part=self.driving.rank)
            for stream in self.streams[1:]:
                if self.ready_sent and self.failure is not None and not stream.aborting_sent:
                    stream.responses.put_nowait(self._aborting_message(stream))  # told, as in any abort
                stream.responses.put_nowait(END)
            # To its end even if this handler is cancelled, once or again (a client that aborts
            # and then cancels): the workers' abort, the engines' leases, the group's idle mark.
            await finish_despite_cancel(finish(self))

    def _sending(self) -> pb.UpdateWeightsResponse:
        """The keepalive of a part that asked to commit: the ranks that have not yet (PartsWaiting.sending)."""
        return pb.UpdateWeightsResponse(waiting=pb.PartsWaiting(
            sending=[s.rank for s in self.streams if not s.commit_asked]))

    def _all_ended(self) -> bool:
        return all(stream.ended for stream in self.streams)

    def _commit_asked(self, stream: Stream) -> None:
        """Stream `stream` asks to commit: every bucket of its own must have been applied."""
        error = check_commit(stream.applied, stream.count)
        if error is not None:
            self.fail(error, part=stream.rank)
            raise self.failure_for(self.driving)
        stream.commit_asked = True

    def _fast(self, stream: Stream | None) -> int:
        """Buckets received straight into the store (of one stream, or of the whole update)."""
        plan = self.store_update.plan if self.store_update else None
        if plan is None:
            return 0
        if stream is None or len(self.streams) == 1:
            return plan.fast_path_count
        return sum(1 for r in plan.routes[stream.first : stream.first + stream.count] if r.direct)

    def _ready(self, stream: Stream) -> pb.UpdateWeightsResponse:
        plan = self.store_update.plan if self.store_update else None
        ready = pb.UpdateReady(update_id=self.update_id, plan_id=stream.plan_id, bucket_count=stream.count,
                               fast_path_bucket_count=self._fast(stream))
        if self.group is not None:
            ready.bucket_owner_ranks.extend(NO_OWNER if owner == NO_OWNER else self.group.rank_offset + owner
                                            for owner in self.owners[stream.first : stream.first + stream.count])
        if plan is not None:
            ready.not_stored_buckets.extend(k - stream.first for k in plan.not_stored if stream.owns(k))
        ingress = stream.ingress
        if self.begin.transport == pb.TRANSPORT_SHM and ingress is not None:
            ready.ingress_slot_first = ingress.first_slot
            ready.ingress_slot_count = ingress.slot_count
        if (self.begin.transport == pb.TRANSPORT_SHM and self.begin.store_writes and len(self.streams) == 1
                and self.store_update is not None):
            ready.store_places.extend(self.services.store.place_for_client(self.store_update, self.plan.buckets))
        return pb.UpdateWeightsResponse(ready=ready)

    async def _bucket_done(self, stream: Stream, bucket: Bucket) -> pb.UpdateWeightsResponse | None:
        fleet = self.services.fleet
        waiting = asyncio.ensure_future(fleet.settle(bucket.receives, self.bucket_timeout))
        failing = asyncio.ensure_future(self.failed.wait())
        await asyncio.wait({waiting, failing}, return_when=asyncio.FIRST_COMPLETED)
        failing.cancel()
        if not waiting.done():
            # The update failed meanwhile (the reader refused a message): say so now; the abort
            # path settles this bucket's receives (abort.settle_receives).
            waiting.cancel()
            retrieve_quietly(waiting)
            return None
        settled = waiting.result()
        self.note_touched(bucket, settled.answers)
        errors = settled.errors
        for error in errors:
            self.note_broken(error)
        if not errors:
            if bucket.piece is not None:
                stream.piece_done(bucket.piece)
            self.progress.set()
        if bucket.discard or self.failure is not None:
            return None
        if errors:
            # A dead worker breaks the broadcast for the others too: report the cause, not the symptom.
            error = next((e for e in errors if isinstance(e, WeightSyncError) and not e.broken_group_id), errors[0])
            if not isinstance(error, WeightSyncError):
                raise error
            self.fail(attributed(error, self.streams, stream)[0], part=stream.rank)  # its own bucket index, `part`
            return None
        if not bucket.last:
            return None
        stream.applied += 1
        size = self.store_update.route(bucket.sequence).size_bytes if self.store_update else 0  # a deferred one's layout
        if self.stored_here(bucket.sequence):
            self.applied_bytes += size  # what the node received (UpdateCommitted.size_bytes)
        return pb.UpdateWeightsResponse(bucket_applied=pb.BucketApplied(sequence=bucket.sequence - stream.first,
                                                                        size_bytes=size))

    def note_touched(self, bucket: Bucket, answers) -> None:
        """The owner's answer says whether the bucket's bytes reached the store: applied, or failed after they
        could (its flag), or it died holding them (assumed). A piece of a compressed frame that does not
        complete it went to the owner's wire buffer only."""
        sequence = bucket.sequence
        if bucket.discard or self.store_update is None or not 0 <= sequence < len(self.owners):
            return
        owner = self.owners[sequence]
        for worker, answer in answers:
            if worker.index != owner:
                continue
            if isinstance(answer, BaseException):
                if getattr(answer, "store_touched", True):
                    self.touched(sequence)
            elif bucket.last or not bucket.compressed:
                self.touched(sequence)

    def record(self) -> None:
        """Metrics of this update, once, whatever its end."""
        if self.recorded:
            return
        self.recorded = True
        committed = self.finished and self.failure is None
        error = None if committed else self.failure or Aborted("ABORTED", "the update did not commit")
        self.services.metrics.record_update(
            transport=self.begin.transport, mode=self.begin.mode, seconds=time.monotonic() - self.started,
            buckets=self.applied, size_bytes=self.applied_bytes,
            failure=None if error is None else (error.reason, error.code.name))

    def fail(self, error: WeightSyncError, part: int | None = None) -> None:
        """The update fails with `error`: the first failure holds. `part`: the rank of the stream whose part
        failed (the other streams learn PART_FAILED naming it); None when no one part did (idle, shutdown)."""
        if self.failure is not None:
            return
        self.failure = error
        self.failed_part = part
        self.progress.set()
        self.failed.set()
        self.note_broken(error)
        log.warning("update_failing", reason=error.reason, message=error.message)

    def note_broken(self, error: BaseException) -> None:
        """A worker's collective failed: the group is unusable, whatever else the update hit first."""
        if isinstance(error, WeightSyncError) and error.broken_group_id and self.group is not None:
            self.services.groups.mark_broken(self.group.group_id, f"{error.reason}: {error.message}")

    def _aborting_message(self, stream: Stream) -> pb.UpdateWeightsResponse:
        failure = self.failure_for(stream)
        stream.aborting_sent = True
        return pb.UpdateWeightsResponse(aborting=pb.UpdateAborting(
            code=code_number(failure.code), reason=failure.reason, message=failure.message,
            metadata=failure.metadata))
