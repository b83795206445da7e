"""One UpdateWeights stream, from Begin to Committed (or to an abort).

Two tasks cooperate:
  - the reader (update_intake.py) takes client messages and forwards each
    bucket to every worker as soon as its bytes can be received: at once for a
    collective broadcast or an SHM slot, once its chunks are in for INLINE;
  - the driver (this module, the stream handler itself) awaits the workers'
    answers in order and writes BucketApplied, Aborting and Committed.

Once anything fails the session is "aborting": it tells the client, keeps
draining what the client already announced (workers join those broadcasts and
drop the bytes, so nobody hangs), and ends with the failure's status when the
client sends abort or closes. Whatever happens, the workers' update is
committed or aborted before the store lock is released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from google.protobuf import duration_pb2

from weightsync.common.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Unavailable,
    WeightSyncError,
    code_number,
)
from weightsync.common.logging import get_logger
from weightsync.common.patches import is_patch
from weightsync.server.admission import MemoryAdmission
from weightsync.server.groups import GroupRegistry
from weightsync.server.ingress import Ingress
from weightsync.server.leases import LeaseTable
from weightsync.server.metrics import Metrics
from weightsync.server.publisher import Publisher
from weightsync.server.state import GroupRecord
from weightsync.server.supervisor import Supervisor
from weightsync.server.tasks import finish_despite_cancel, retrieve_quietly
from weightsync.server.update_intake import (
    Abort,
    Bucket,
    BucketIntake,
    Closed,
    Commit,
    Failed,
    Item,
    ShuttingDown,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.update")

BUCKET_MARGIN_SECONDS = 2.0
"""Slack on top of the group timeout for a worker to report a bucket (it reports a collective
timeout itself at the group timeout; a worker that stays silent longer is killed)."""


@dataclass(frozen=True, slots=True)
class SessionServices:
    """What an update session needs from the server, and nothing more."""

    supervisor: Supervisor
    publisher: Publisher
    groups: GroupRegistry
    admission: MemoryAdmission
    leases: LeaseTable
    ingress: Ingress | None
    command_timeout: float
    """Longest a non-collective worker command may take."""
    transfer_timeout: float
    """INLINE/SHM: longest wait for the client's next bytes, or for workers to apply a bucket."""
    lease_timeout: float
    """Longest an update waits for engines to release the bytes it would write."""
    max_chunk_bytes: int
    metrics: Metrics


@dataclass(slots=True)
class UpdateSession:
    services: SessionServices
    update_id: str
    group: GroupRecord | None
    """The transfer group (COLLECTIVE); None for INLINE and SHM."""
    begin: pb.BeginUpdate
    plan: tensor_pb2.WeightPlan
    plan_id: str
    inbox: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    intake: BucketIntake | None = None
    failure: WeightSyncError | None = None
    aborting_sent: bool = False
    applied: int = 0
    applied_sent: int = 0
    """BucketApplied messages handed to the client's stream: what it can have seen (SHM slot reuse)."""
    applied_bytes: int = 0
    pieces_done: int = 0
    """Ingress pieces the workers finished with (their slots are free again)."""
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever a piece or bucket was done or the update failed (frees ingress slots)."""
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the update failed: the driver stops waiting for buckets and tells the client."""
    prepared: bool = False
    finished: bool = False
    fast_path_count: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def bucket_timeout(self) -> float:
        if self.group is None:
            return self.services.transfer_timeout
        return self.group.timeout.total_seconds() + BUCKET_MARGIN_SECONDS

    @property
    def patched(self) -> bool:
        return any(is_patch(t.encoding) for b in self.plan.buckets for t in b.tensors)

    @property
    def in_place(self) -> bool:
        return self.begin.mode == pb.UPDATE_MODE_IN_PLACE

    def break_group(self, why: str) -> None:
        if self.group is not None:
            self.services.groups.mark_broken(self.group.group_id, why)

    def request_shutdown(self) -> None:
        """Server is draining and the grace period ran out."""
        self.inbox.put_nowait(ShuttingDown())

    async def wait_pieces(self, count: int) -> None:
        """Until the workers finished `count` ingress pieces, or the update failed."""
        while self.pieces_done < count and self.failure is None:
            self.progress.clear()
            await self.progress.wait()

    # -- driver ------------------------------------------------------------------
    async def run(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> AsyncIterator[pb.UpdateWeightsResponse]:
        reader: asyncio.Task[None] | None = None
        if self.group is not None:
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
            services = self.services
            self.intake = BucketIntake(self, transport=self.begin.transport, supervisor=services.supervisor,
                                       ingress=services.ingress, max_chunk_bytes=services.max_chunk_bytes)
            reader = asyncio.create_task(self.intake.read(requests))
            idle = self.bucket_timeout
            while True:
                try:
                    item = await asyncio.wait_for(self.inbox.get(), idle)
                except TimeoutError:
                    self.fail(DeadlineExceeded("CLIENT_IDLE", f"no message from the client for {idle:g} s"))
                    break
                if isinstance(item, Bucket):
                    message = await self._bucket_done(item)
                    if message is not None:
                        # Counted when handed to gRPC: the client may act on it before we resume.
                        self.applied_sent += 1
                        yield message
                elif isinstance(item, Commit):
                    if self.failure is None:
                        yield await self._commit()
                        return
                    break
                elif isinstance(item, Abort):
                    self.fail(Aborted("ABORTED_BY_CLIENT", f"the client aborted the update: {item.reason or 'no reason given'}"))
                    break
                elif isinstance(item, Closed):
                    self.fail(Aborted("STREAM_CLOSED", "the client closed the stream before commit"))
                    break
                elif isinstance(item, Failed):
                    self.fail(item.error)
                elif isinstance(item, ShuttingDown):
                    self.fail(Unavailable("SERVER_SHUTTING_DOWN", "the server is shutting down"))
                    yield self._aborting_message()
                    break
                if self.failure is not None and not self.aborting_sent:
                    yield self._aborting_message()
            assert self.failure is not None
            raise self.failure
        except WeightSyncError as error:  # refused in prepare or commit: recorded as what it was
            self.fail(error)
            raise
        finally:
            # To its end even if this handler is cancelled, once or again (a client that aborts
            # and then cancels): the workers' abort, the engines' leases, the group's idle mark.
            await finish_despite_cancel(self._finish(reader))

    async def _finish(self, reader: asyncio.Task[None] | None) -> None:
        if reader is not None:
            reader.cancel()
            retrieve_quietly(reader)
        try:
            self._record()
            if not self.finished:
                await self._abort_workers()
        finally:
            await self.services.leases.write_done()
            if self.group is not None:
                self.group.updating = False

    async def _prepare(self) -> None:
        supervisor = self.services.supervisor
        # Engines reading the bytes this update would write finish first (see leases.py).
        await self.services.leases.before_write(staged=not self.in_place, timeout=self.services.lease_timeout,
                                                generation=self.services.publisher.version.generation)
        command = wpb.PrepareUpdateCommand(
            update_id=self.update_id, group_id=self.group.group_id if self.group else "", plan=self.plan,
            mode=self.begin.mode, allow_new_tensors=self.begin.allow_new_tensors, plan_id=self.plan_id,
        )
        self.prepared = True  # from here on, abort is owed to the workers
        timeout = self.services.command_timeout
        events = await supervisor.call_all(timeout, prepare_update=command)
        answers = [(w, e.update_prepared) for w, e in zip(supervisor.workers, events, strict=True)]
        if any(p.needed_bytes for _, p in answers):
            self.services.admission.check(answers)
            sized = [w for w, p in answers if p.needed_bytes]
            allocated = await supervisor.fan_out(timeout, sized, allocate_update=wpb.AllocateUpdateCommand(
                update_id=self.update_id))
            allocated.raise_first()
        self.fast_path_count = min(p.fast_path_bucket_count for _, p in answers)

    async def _bucket_done(self, bucket: Bucket) -> pb.UpdateWeightsResponse | None:
        supervisor = self.services.supervisor
        waiting = asyncio.ensure_future(supervisor.settle(bucket.receives, self.bucket_timeout))
        failing = asyncio.ensure_future(self.failed.wait())
        await asyncio.wait({waiting, failing}, return_when=asyncio.FIRST_COMPLETED)
        failing.cancel()
        if not waiting.done():
            # The update failed meanwhile (the reader refused a message): say so now; the abort
            # path settles this bucket's receives (_settle_receives).
            waiting.cancel()
            retrieve_quietly(waiting)
            return None
        settled = waiting.result()
        results = [answer for _, answer in settled.answers]
        errors = settled.errors
        for error in errors:
            self._note_broken(error)
        if not errors:
            self.pieces_done += 1
            self.progress.set()
        if bucket.discard or self.failure is not None:
            return None
        if errors:
            # A dead worker breaks the broadcast for the others too: report the cause, not the symptom.
            error = next((e for e in errors if isinstance(e, WeightSyncError) and not e.broken_group_id), errors[0])
            if not isinstance(error, WeightSyncError):
                raise error
            self.fail(error)
            return None
        if not bucket.last:
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
            self.fail(error)
            raise error
        supervisor = self.services.supervisor
        if not self.in_place and self.patched:
            # A STAGED patch is scattered into the live bytes at commit: engines reading the
            # committed version finish first, and none starts until the commit is done.
            await self.services.leases.before_write(staged=False, timeout=self.services.lease_timeout,
                                                    generation=self.services.publisher.version.generation)
        async with self.services.leases.publishing_commit():
            committed = await supervisor.fan_out(self.services.command_timeout,
                                                 commit_update=wpb.CommitUpdateCommand(update_id=self.update_id))
            failures = committed.errors
            if failures:
                if len(failures) < len(committed.answers):
                    self.services.publisher.mixed = True  # some workers hold the new weights, some the old
                raise failures[0]
            self.finished = True
            generation = self.services.publisher.next_generation
            names = [t.name for b in self.plan.buckets for t in b.tensors]
            for worker in supervisor.workers:
                worker.kept.mark_written(names, generation)  # before watchers hear of it: engines read what changed
            version = self.services.publisher.publish_version(self.begin.version)
        seconds = time.monotonic() - self.started
        duration = duration_pb2.Duration()
        duration.FromNanoseconds(int(seconds * 1e9))
        log.info("update_committed", version=self.begin.version, generation=version.generation,
                 bytes=self.applied_bytes, seconds=round(seconds, 3))
        return pb.UpdateWeightsResponse(
            committed=pb.UpdateCommitted(version=version.to_proto(), size_bytes=self.applied_bytes, duration=duration)
        )

    def _record(self) -> None:
        """Metrics of this update, once, whatever its end."""
        labels = {"transport": pb.Transport.Name(self.begin.transport).removeprefix("TRANSPORT_").lower(),
                  "mode": pb.UpdateMode.Name(self.begin.mode).removeprefix("UPDATE_MODE_").lower()}
        metrics = self.services.metrics
        committed = self.finished and self.failure is None
        metrics.update_seconds.labels(outcome="committed" if committed else "failed", **labels).observe(
            time.monotonic() - self.started)
        metrics.buckets.labels(transport=labels["transport"]).inc(self.applied)
        if committed:
            metrics.update_bytes.labels(**labels).observe(self.applied_bytes)
        else:
            error = self.failure or Aborted("ABORTED", "the update did not commit")
            metrics.failures.labels(reason=error.reason, code=error.code.name).inc()

    def fail(self, error: WeightSyncError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        self.progress.set()
        self.failed.set()
        self._note_broken(error)
        log.warning("update_failing", reason=error.reason, message=error.message)

    def _note_broken(self, error: BaseException) -> None:
        """A worker's collective failed: the group is unusable, whatever else the update hit first."""
        if isinstance(error, WeightSyncError) and error.broken_group_id and self.group is not None:
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
        aborted = await supervisor.fan_out(self.bucket_timeout, supervisor.alive_workers(),
                                           abort_update=wpb.AbortUpdateCommand(update_id=self.update_id))
        await settled
        aborted.log_errors("abort_failed_on_worker")
        if self.group is not None and self.group.state == pb.GROUP_STATE_BROKEN:
            # Every worker leaves: a group that failed one collective is unusable for all.
            left = await supervisor.fan_out(self.services.command_timeout, supervisor.alive_workers(),
                                            leave_group=wpb.LeaveGroupCommand(group_id=self.group.group_id))
            left.log_errors("leave_failed_on_worker")
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
        if self.intake is None:
            return
        receives, self.intake.receives = self.intake.receives, []
        settled = await self.services.supervisor.settle(receives, self.bucket_timeout)
        for result in settled.errors:
            if isinstance(result, WeightSyncError):
                self.fail(result)
                self._note_broken(result)
