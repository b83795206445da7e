"""One UpdateWeights stream, from Begin to Committed (or to an abort).

Two tasks cooperate:
  - the reader takes client messages; each BucketStart is checked and forwarded
    at once to every worker (so workers are already waiting when the broadcast
    starts, and the client can pipeline bucket k+1 behind bucket k);
  - the driver (the stream handler itself) awaits the workers' answers in
    order and writes BucketApplied, Aborting and Committed.

Every announced broadcast is joined by the workers, even a wrong one: a
BucketStart out of order, for a bucket the plan does not have, or with a
length that is not the bucket's, makes the workers receive and drop a
broadcast of the announced length, so the sender never hangs, and the update
fails at once. Once anything failed the session is "aborting": it tells the
client, keeps draining the buckets the client announces, and ends with the
failure's status when the client sends abort or closes. Whatever happens, the
workers' update is committed or aborted before the store lock is released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog
from google.protobuf import duration_pb2

from weightsync.common.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    WeightSyncError,
    code_number,
)
from weightsync.server.admission import MemoryAdmission
from weightsync.server.groups import GroupRegistry
from weightsync.server.publisher import Publisher
from weightsync.server.state import GroupRecord
from weightsync.server.supervisor import Supervisor, WorkerHandle
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = structlog.get_logger("weightsync.update")

BUCKET_MARGIN_SECONDS = 2.0
"""Slack on top of the group timeout for a worker to report a bucket (it reports a collective
timeout itself at the group timeout; a worker that stays silent longer is killed)."""
KNOWN_CHECKSUMS = (tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED, tensor_pb2.CHECKSUM_ALGORITHM_WS64)


@dataclass(frozen=True, slots=True)
class SessionServices:
    """What an update session needs from the server, and nothing more."""

    supervisor: Supervisor
    publisher: Publisher
    groups: GroupRegistry
    admission: MemoryAdmission
    command_timeout: float
    """Longest a non-collective worker command may take."""


# -- what the reader hands the driver ------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Bucket:
    sequence: int
    receives: list[tuple[WorkerHandle, asyncio.Future[wpb.WorkerEvent]]]
    discard: bool


@dataclass(frozen=True, slots=True)
class _Commit:
    pass


@dataclass(frozen=True, slots=True)
class _Abort:
    reason: str


@dataclass(frozen=True, slots=True)
class _Closed:
    pass


@dataclass(frozen=True, slots=True)
class _Failed:
    error: WeightSyncError


@dataclass(frozen=True, slots=True)
class _ShuttingDown:
    pass


_Item = _Bucket | _Commit | _Abort | _Closed | _Failed | _ShuttingDown


@dataclass(slots=True)
class UpdateSession:
    services: SessionServices
    update_id: str
    group: GroupRecord
    begin: pb.BeginUpdate
    plan: tensor_pb2.WeightPlan
    plan_id: str
    inbox: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    receives: list[tuple[WorkerHandle, asyncio.Future[wpb.WorkerEvent]]] = field(default_factory=list)
    """Every receive_bucket submitted; the abort path settles the ones nobody awaited."""
    failure: WeightSyncError | None = None
    aborting_sent: bool = False
    announced: int = 0
    applied: int = 0
    applied_bytes: int = 0
    prepared: bool = False
    finished: bool = False
    fast_path_count: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def bucket_timeout(self) -> float:
        return self.group.timeout.total_seconds() + BUCKET_MARGIN_SECONDS

    @property
    def in_place(self) -> bool:
        return self.begin.mode == pb.UPDATE_MODE_IN_PLACE

    def request_shutdown(self) -> None:
        """Server is draining and the grace period ran out."""
        self.inbox.put_nowait(_ShuttingDown())

    # -- driver ------------------------------------------------------------------
    async def run(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> AsyncIterator[pb.UpdateWeightsResponse]:
        reader: asyncio.Task[None] | None = None
        self.group.updating = True
        try:
            await self._prepare()
            self.services.publisher.publish_state()  # watchers see UPDATING
            log.info("update_ready", buckets=len(self.plan.buckets), fast_path=self.fast_path_count,
                     version=self.begin.version)
            yield pb.UpdateWeightsResponse(ready=pb.UpdateReady(
                update_id=self.update_id, plan_id=self.plan_id, bucket_count=len(self.plan.buckets),
                fast_path_bucket_count=self.fast_path_count,
            ))
            reader = asyncio.create_task(self._read(requests))
            idle = self.bucket_timeout
            while True:
                try:
                    item = await asyncio.wait_for(self.inbox.get(), idle)
                except TimeoutError:
                    self._fail(DeadlineExceeded("CLIENT_IDLE", f"no message from the client for {idle:g} s"))
                    break
                if isinstance(item, _Bucket):
                    message = await self._bucket_done(item)
                    if message is not None:
                        yield message
                elif isinstance(item, _Commit):
                    if self.failure is None:
                        yield await self._commit()
                        return
                    break
                elif isinstance(item, _Abort):
                    self._fail(Aborted("ABORTED_BY_CLIENT", f"the client aborted the update: {item.reason or 'no reason given'}"))
                    break
                elif isinstance(item, _Closed):
                    self._fail(Aborted("STREAM_CLOSED", "the client closed the stream before commit"))
                    break
                elif isinstance(item, _Failed):
                    self._fail(item.error)
                elif isinstance(item, _ShuttingDown):
                    self._fail(Unavailable("SERVER_SHUTTING_DOWN", "the server is shutting down"))
                    yield self._aborting_message()
                    break
                if self.failure is not None and not self.aborting_sent:
                    yield self._aborting_message()
            assert self.failure is not None
            raise self.failure
        finally:
            if reader is not None:
                reader.cancel()
            if not self.finished:
                # Shielded: the abort must reach the workers even if this
                # handler is being cancelled (client gone).
                await asyncio.shield(self._abort_workers())
            self.group.updating = False

    async def _prepare(self) -> None:
        supervisor = self.services.supervisor
        command = wpb.PrepareUpdateCommand(
            update_id=self.update_id, group_id=self.group.group_id, plan=self.plan, mode=self.begin.mode,
            allow_new_tensors=self.begin.allow_new_tensors, plan_id=self.plan_id,
        )
        self.prepared = True  # from here on, abort is owed to the workers
        timeout = self.services.command_timeout
        events = await supervisor.call_all(timeout, prepare_update=command)
        answers = [(w, e.update_prepared) for w, e in zip(supervisor.workers, events, strict=True)]
        if any(p.needed_bytes for _, p in answers):
            self.services.admission.check(answers)
            allocate = wpb.AllocateUpdateCommand(update_id=self.update_id)
            results = await asyncio.gather(
                *(supervisor.call(w, timeout, allocate_update=allocate) for w, p in answers if p.needed_bytes),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        self.fast_path_count = min(p.fast_path_bucket_count for _, p in answers)

    async def _bucket_done(self, bucket: _Bucket) -> pb.UpdateWeightsResponse | None:
        supervisor = self.services.supervisor
        results = await asyncio.gather(
            *(supervisor.result(w, f, self.bucket_timeout) for w, f in bucket.receives), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            self._note_broken(error)
        if bucket.discard or self.failure is not None:
            return None
        if errors:
            # A dead worker breaks the broadcast for the others too: report the cause, not the symptom.
            error = next((e for e in errors if isinstance(e, WeightSyncError) and not e.broken_group_id), errors[0])
            if not isinstance(error, WeightSyncError):
                raise error
            self._fail(error)
            return None
        self.applied += 1
        size = results[0].bucket_received.size_bytes  # type: ignore[union-attr]
        self.applied_bytes += size
        return pb.UpdateWeightsResponse(bucket_applied=pb.BucketApplied(sequence=bucket.sequence, size_bytes=size))

    async def _commit(self) -> pb.UpdateWeightsResponse:
        buckets = len(self.plan.buckets)
        if self.applied != buckets:
            error = FailedPrecondition("BUCKETS_MISSING", f"commit after {self.applied} of {buckets} buckets",
                                       received=self.applied, expected=buckets)
            self._fail(error)
            raise error
        supervisor = self.services.supervisor
        command = wpb.CommitUpdateCommand(update_id=self.update_id)
        results = await asyncio.gather(
            *(supervisor.call(w, self.services.command_timeout, commit_update=command) for w in supervisor.workers),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            if len(failures) < len(results):
                self.services.publisher.mixed = True  # some workers hold the new weights, some the old
            raise failures[0]
        self.finished = True
        version = self.services.publisher.publish_version(self.begin.version)
        seconds = time.monotonic() - self.started
        duration = duration_pb2.Duration()
        duration.FromNanoseconds(int(seconds * 1e9))
        log.info("update_committed", version=self.begin.version, generation=version.generation,
                 bytes=self.applied_bytes, seconds=round(seconds, 3))
        return pb.UpdateWeightsResponse(
            committed=pb.UpdateCommitted(version=version.to_proto(), size_bytes=self.applied_bytes, duration=duration)
        )

    def _fail(self, error: WeightSyncError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        self._note_broken(error)
        log.warning("update_failing", reason=error.reason, message=error.message)

    def _note_broken(self, error: BaseException) -> None:
        """A worker's collective failed: the group is unusable, whatever else the update hit first."""
        if isinstance(error, WeightSyncError) and error.broken_group_id:
            self.services.groups.mark_broken(self.group.group_id, f"{error.reason}: {error.message}")

    def _aborting_message(self) -> pb.UpdateWeightsResponse:
        assert self.failure is not None
        self.aborting_sent = True
        return pb.UpdateWeightsResponse(aborting=pb.UpdateAborting(
            code=code_number(self.failure.code), reason=self.failure.reason, message=self.failure.message))

    async def _abort_workers(self) -> None:
        self.finished = True
        if not self.prepared:
            return
        supervisor = self.services.supervisor
        settled = asyncio.ensure_future(self._settle_receives())
        running = [w for w in supervisor.workers if w.state == pb.WORKER_STATE_RUNNING]
        abort = wpb.AbortUpdateCommand(update_id=self.update_id)
        results = await asyncio.gather(
            *(supervisor.call(w, self.bucket_timeout, abort_update=abort) for w in running), return_exceptions=True
        )
        await settled
        if self.group.state == pb.GROUP_STATE_BROKEN:
            # Every worker leaves: a group that failed one collective is unusable for all.
            leave = wpb.LeaveGroupCommand(group_id=self.group.group_id)
            results += await asyncio.gather(
                *(supervisor.call(w, self.services.command_timeout, leave_group=leave)
                  for w in supervisor.workers if w.state == pb.WORKER_STATE_RUNNING),
                return_exceptions=True,
            )
        for result in results:
            if isinstance(result, BaseException):
                log.warning("abort_failed_on_worker", error=str(result))
        log.info("update_aborted", reason=self.failure.reason if self.failure else "")
        self.services.publisher.publish_state()

    async def _settle_receives(self) -> None:
        """Await the announced buckets' results that nobody awaited.

        When the stream is cancelled (the trainer died) while workers sit in a
        broadcast, the driver stops awaiting that bucket. The workers still
        answer it (the abort is queued behind it anyway); a collective failure
        in that answer must still mark the group BROKEN, or the server would
        keep a group the workers already dropped.
        """
        receives, self.receives = self.receives, []
        supervisor = self.services.supervisor
        results = await asyncio.gather(
            *(supervisor.result(w, f, self.bucket_timeout) for w, f in receives), return_exceptions=True
        )
        for result in results:
            if isinstance(result, WeightSyncError):
                self._fail(result)
                self._note_broken(result)

    # -- reader ------------------------------------------------------------------
    def _check_announcement(self, start: pb.BucketStart) -> WeightSyncError | None:
        """Why a BucketStart cannot be received into the store, if it cannot."""
        sequence, buckets = start.sequence, len(self.plan.buckets)
        if sequence < self.announced:
            return InvalidArgument("BUCKET_OUT_OF_ORDER", f"bucket {sequence} was already announced; expected "
                                   f"{self.announced}", bucket=sequence, expected=self.announced)
        if sequence >= buckets:
            return InvalidArgument("BUCKET_OUT_OF_RANGE", f"bucket {sequence} announced; the plan has {buckets}",
                                   bucket=sequence, buckets=buckets)
        if sequence != self.announced:
            return InvalidArgument("BUCKET_OUT_OF_ORDER", f"bucket {sequence} announced, expected {self.announced}",
                                   bucket=sequence, expected=self.announced)
        planned = self.plan.buckets[sequence].size_bytes
        if start.size_bytes and start.size_bytes != planned:
            return InvalidArgument(
                "BUCKET_SIZE_MISMATCH",
                f"bucket {sequence} is {planned} bytes in the plan but its broadcast is announced as "
                f"{start.size_bytes} bytes", bucket=sequence, planned_bytes=planned, announced_bytes=start.size_bytes,
            )
        if start.checksum.algorithm not in KNOWN_CHECKSUMS:
            return InvalidArgument("CHECKSUM_ALGORITHM_UNKNOWN", f"bucket {sequence} has unknown checksum algorithm "
                                   f"{start.checksum.algorithm}", bucket=sequence)
        return None

    def _announced_length(self, start: pb.BucketStart) -> int | None:
        """The length of the broadcast that follows a BucketStart, if it is known and drainable."""
        if start.size_bytes < 0:
            return None
        length = start.size_bytes
        if not length:
            if not 0 <= start.sequence < len(self.plan.buckets):
                return None
            length = self.plan.buckets[start.sequence].size_bytes
        # Draining costs a scratch buffer of that length on every worker: no more than the plan's largest bucket.
        return length if length <= max(b.size_bytes for b in self.plan.buckets) else None

    def _forward(self, start: pb.BucketStart, *, discard: bool, size: int) -> _Bucket:
        """Every worker joins the broadcast that follows this BucketStart."""
        supervisor = self.services.supervisor
        command = wpb.ReceiveBucketCommand(update_id=self.update_id, sequence=start.sequence,
                                           checksum=start.checksum, discard=discard, size_bytes=size)
        names = {t.name for t in self.plan.buckets[start.sequence].tensors} if not discard and self.in_place else ()
        receives = []
        for worker in supervisor.workers:
            if names:
                worker.writes_in_flight.update(names)
            receives.append((worker, supervisor.submit(worker, receive_bucket=command)))
        self.receives.extend(receives)
        return _Bucket(start.sequence, receives, discard)

    async def _announce(self, start: pb.BucketStart) -> None:
        refusal = self._check_announcement(start) if self.failure is None else None
        if refusal is not None:
            self._fail(refusal)
            await self.inbox.put(_Failed(refusal))  # the client hears it before the drain completes
        if self.failure is None:
            await self.inbox.put(self._forward(start, discard=False, size=self.plan.buckets[start.sequence].size_bytes))
            self.announced += 1
            return
        length = self._announced_length(start)
        if length is None:
            # Nothing can receive it: the sender's broadcast fails at the group timeout, so the group breaks.
            self.services.groups.mark_broken(self.group.group_id, f"{self.failure.reason}: bucket {start.sequence} "
                                             "was announced with a length the workers cannot drain")
            await self.inbox.put(_Failed(self.failure))
            return
        await self.inbox.put(self._forward(start, discard=True, size=length))

    async def _read(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                if kind == "bucket_start":
                    try:
                        await self._announce(request.bucket_start)
                    except WeightSyncError as error:  # a worker is not running
                        self._fail(error)
                        await self.inbox.put(_Failed(error))
                elif kind == "commit":
                    await self.inbox.put(_Commit())
                    return
                elif kind == "abort":
                    await self.inbox.put(_Abort(request.abort.reason))
                    return
                else:
                    await self.inbox.put(_Failed(InvalidArgument(
                        "UNEXPECTED_MESSAGE", f"unexpected {kind or 'empty'} message after begin")))
            await self.inbox.put(_Closed())
        except asyncio.CancelledError:
            raise
        except WeightSyncError as error:  # e.g. MESSAGE_MALFORMED from the parsing layer
            await self.inbox.put(_Failed(error))
            await self.inbox.put(_Closed())
        except Exception as error:  # noqa: BLE001 - the stream broke: same as closing it
            log.info("update_stream_broken", error=type(error).__name__)
            await self.inbox.put(_Closed())
