"""One UpdateWeights stream, from Begin to Committed (or to an abort).

Two tasks cooperate:
  - the reader takes client messages; each BucketStart is forwarded at once to
    every worker (so workers are already waiting when the broadcast starts,
    and the client can pipeline bucket k+1 behind bucket k);
  - the driver (the stream handler itself) awaits the workers' answers in
    order and writes BucketApplied, Aborting and Committed.

Once anything fails, the session is "aborting": it tells the client, keeps
servicing buckets the client already announced (workers join those broadcasts
and drop the bytes, so nobody hangs), and ends with the failure's status when
the client sends abort or closes. Whatever happens, the workers' update is
committed or aborted before the store lock is released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
from weightsync.server.state import GroupRecord
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

if TYPE_CHECKING:
    from weightsync.server.service import WeightSyncServicer

log = structlog.get_logger("weightsync.update")

# Slack on top of the group timeout for a worker to report a bucket.
BUCKET_MARGIN_SECONDS = 15.0


@dataclass(slots=True)
class UpdateSession:
    servicer: WeightSyncServicer
    update_id: str
    group: GroupRecord
    begin: pb.BeginUpdate
    plan: tensor_pb2.WeightPlan
    plan_id: str
    inbox: asyncio.Queue[tuple] = field(default_factory=asyncio.Queue)
    # Every receive_bucket submitted to a worker; the abort path settles the ones
    # nobody awaited (the stream was cancelled mid-bucket), see _settle_receives.
    receives: list[tuple] = field(default_factory=list)
    failure: WeightSyncError | None = None
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

    def request_shutdown(self) -> None:
        """Server is draining and the grace period ran out."""
        self.inbox.put_nowait(("shutdown",))

    # -- driver ------------------------------------------------------------------
    async def run(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> AsyncIterator[pb.UpdateWeightsResponse]:
        reader: asyncio.Task[None] | None = None
        try:
            await self._prepare()
            self.servicer.publish_state()  # watchers see UPDATING
            fast = self.fast_path_count
            log.info("update_ready", buckets=len(self.plan.buckets), fast_path=fast, version=self.begin.version)
            yield pb.UpdateWeightsResponse(
                ready=pb.UpdateReady(
                    update_id=self.update_id,
                    plan_id=self.plan_id,
                    bucket_count=len(self.plan.buckets),
                    fast_path_bucket_count=fast,
                )
            )
            reader = asyncio.create_task(self._read(requests))
            idle = self.group.timeout.total_seconds() + BUCKET_MARGIN_SECONDS
            while True:
                try:
                    item = await asyncio.wait_for(self.inbox.get(), idle)
                except TimeoutError:
                    self._fail(DeadlineExceeded("CLIENT_IDLE", f"no message from the client for {idle:g} s"))
                    break
                kind = item[0]
                if kind == "bucket":
                    _, sequence, futures = item
                    message = await self._bucket_done(sequence, futures)
                    if message is not None:
                        yield message
                elif kind == "commit":
                    if self.failure is None:
                        yield await self._commit()
                        return
                    break
                elif kind == "abort":
                    self._fail(Aborted("ABORTED_BY_CLIENT", f"the client aborted the update: {item[1] or 'no reason given'}"))
                    break
                elif kind == "eof":
                    self._fail(Aborted("STREAM_CLOSED", "the client closed the stream before commit"))
                    break
                elif kind in ("error", "shutdown"):
                    error = item[1] if kind == "error" else Unavailable("SERVER_SHUTTING_DOWN", "the server is shutting down")
                    first = self.failure is None
                    self._fail(error)
                    if first:
                        yield self._aborting_message()
                    if kind == "shutdown":
                        break
            assert self.failure is not None
            raise self.failure
        finally:
            if reader is not None:
                reader.cancel()
            if not self.finished:
                # Shielded: the abort must reach the workers even if this
                # handler is being cancelled (client gone).
                await asyncio.shield(self._abort_workers())

    async def _prepare(self) -> None:
        supervisor = self.servicer.supervisor
        command = wpb.PrepareUpdateCommand(
            update_id=self.update_id,
            group_id=self.group.group_id,
            plan=self.plan,
            mode=self.begin.mode,
            allow_new_tensors=self.begin.allow_new_tensors,
            plan_id=self.plan_id,
        )
        self.prepared = True  # from here on, abort is owed to the workers
        events = await supervisor.call_all(self.servicer.config.worker_call_timeout_seconds, prepare_update=command)
        self.fast_path_count = min(e.update_prepared.fast_path_bucket_count for e in events)

    async def _bucket_done(self, sequence: int, futures: list) -> pb.UpdateWeightsResponse | None:
        supervisor = self.servicer.supervisor
        results = await asyncio.gather(
            *(supervisor.result(w, f, self.bucket_timeout) for w, f in futures), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            self._note_broken(error)
        if self.failure is not None:
            return None
        if errors:
            # A dead worker breaks the broadcast for the others too: report the cause, not the symptom.
            error = next((e for e in errors if not getattr(e, "broken_group_id", "")), errors[0])
            if not isinstance(error, WeightSyncError):
                raise error
            self._fail(error)
            return self._aborting_message()
        self.applied += 1
        size = results[0].bucket_received.size_bytes  # type: ignore[union-attr]
        self.applied_bytes += size
        return pb.UpdateWeightsResponse(bucket_applied=pb.BucketApplied(sequence=sequence, size_bytes=size))

    async def _commit(self) -> pb.UpdateWeightsResponse:
        if self.applied != len(self.plan.buckets):
            error = FailedPrecondition(
                "BUCKETS_MISSING",
                f"commit after {self.applied} of {len(self.plan.buckets)} buckets",
                received=self.applied,
                expected=len(self.plan.buckets),
            )
            self._fail(error)
            raise error
        supervisor = self.servicer.supervisor
        await supervisor.call_all(
            self.servicer.config.worker_call_timeout_seconds,
            commit_update=wpb.CommitUpdateCommand(update_id=self.update_id),
        )
        self.finished = True
        version = self.servicer.publish_version(self.begin.version)
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
        if getattr(error, "broken_group_id", ""):
            self.group.mark_broken(f"{error.reason}: {error.message}")  # type: ignore[attr-defined]

    def _aborting_message(self) -> pb.UpdateWeightsResponse:
        assert self.failure is not None
        return pb.UpdateWeightsResponse(
            aborting=pb.UpdateAborting(
                code=code_number(self.failure.code), reason=self.failure.reason, message=self.failure.message
            )
        )

    async def _abort_workers(self) -> None:
        if self.finished or not self.prepared:
            self.finished = True
            return
        self.finished = True
        supervisor = self.servicer.supervisor
        settled = asyncio.ensure_future(self._settle_receives())
        command = wpb.AbortUpdateCommand(update_id=self.update_id)
        results = await asyncio.gather(
            *(
                supervisor.call(w, self.bucket_timeout, abort_update=command)
                for w in supervisor.workers
                if w.state == pb.WORKER_STATE_RUNNING
            ),
            return_exceptions=True,
        )
        await settled
        for result in results:
            if isinstance(result, BaseException):
                log.warning("abort_failed_on_worker", error=str(result))
        log.info("update_aborted", reason=self.failure.reason if self.failure else "")
        self.servicer.publish_state()

    async def _settle_receives(self) -> None:
        """Await the announced buckets' results that nobody awaited.

        When the stream is cancelled (the trainer died) while workers sit in a
        broadcast, the driver stops awaiting that bucket. The workers still
        answer it (the abort is queued behind it anyway); a collective failure
        in that answer must still mark the group BROKEN, or the server would
        keep a group the workers already dropped.
        """
        receives, self.receives = self.receives, []
        supervisor = self.servicer.supervisor
        results = await asyncio.gather(
            *(supervisor.result(w, f, self.bucket_timeout) for w, f in receives), return_exceptions=True
        )
        for result in results:
            if isinstance(result, WeightSyncError):
                self._fail(result)
                self._note_broken(result)

    # -- reader ------------------------------------------------------------------
    async def _read(self, requests: AsyncIterator[pb.UpdateWeightsRequest]) -> None:
        supervisor = self.servicer.supervisor
        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                if kind == "bucket_start":
                    start = request.bucket_start
                    discard = self.failure is not None
                    if not discard and start.sequence != self.announced:
                        await self.inbox.put(("error", InvalidArgument(
                            "BUCKET_OUT_OF_ORDER",
                            f"bucket {start.sequence} announced, expected {self.announced}",
                            bucket=start.sequence, expected=self.announced,
                        )))
                        continue
                    if not 0 <= start.sequence < len(self.plan.buckets):
                        await self.inbox.put(("error", InvalidArgument(
                            "BUCKET_OUT_OF_RANGE",
                            f"bucket {start.sequence} announced; the plan has {len(self.plan.buckets)}",
                            bucket=start.sequence,
                        )))
                        continue
                    command = wpb.ReceiveBucketCommand(
                        update_id=self.update_id, sequence=start.sequence, checksum=start.checksum, discard=discard
                    )
                    futures = []
                    try:
                        for worker in supervisor.workers:
                            futures.append((worker, supervisor.submit(worker, receive_bucket=command)))
                            self.receives.append(futures[-1])
                    except WeightSyncError as error:
                        await self.inbox.put(("error", error))
                        continue
                    self.announced += 1
                    await self.inbox.put(("bucket", start.sequence, futures))
                elif kind == "commit":
                    await self.inbox.put(("commit",))
                    return
                elif kind == "abort":
                    await self.inbox.put(("abort", request.abort.reason))
                    return
                else:
                    await self.inbox.put(("error", InvalidArgument(
                        "UNEXPECTED_MESSAGE", f"unexpected {kind or 'empty'} message after begin"
                    )))
            await self.inbox.put(("eof",))
        except asyncio.CancelledError:
            raise
        except WeightSyncError as error:  # e.g. MESSAGE_MALFORMED from the parsing layer
            await self.inbox.put(("error", error))
            await self.inbox.put(("eof",))
        except Exception as error:  # noqa: BLE001 - the stream broke: same as closing it
            log.info("update_stream_broken", error=type(error).__name__)
            await self.inbox.put(("eof",))
