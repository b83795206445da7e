"""One push: Begin on every server, the bucket loop, Commit or abort.

The loop runs in the caller's thread (packing and sending are CPU/GPU work
that must overlap); the gRPC streams live on the SDK's asyncio loop. How each
bucket's bytes are placed and sent is the transport's sink (transports/).
Every failure ends the same way: the broadcast in flight is completed (so no
rank is left inside a collective), every server aborts, and the caller gets
UpdateFailed with a status code and an ErrorInfo reason.

Every wait is bounded: Ready by the RPC timeout, each message a server must
take by the same timeout (client/channels/streams.py), each broadcast by the group's timeout,
Committed by the commit timeout, a server's end of an aborted stream by
ABORT_GRACE_SECONDS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from weightsync.client.buckets.packing import TensorSource
from weightsync.client.buckets.planning import PlannedBucket
from weightsync.client.buckets.read_order import wants_checksum
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.streams import UpdateStream, as_ended, first_failure, update_failed
from weightsync.client.errors import PlanMismatch, UpdateFailed, WeightSyncRpcError
from weightsync.client.intra_op import one_intra_op_thread
from weightsync.client.servers.records import UNSETTLED_RETRY_SECONDS, ServerState
from weightsync.client.transports.base import Sink
from weightsync.client.transports.shm import ShmSink
from weightsync.client.types import PushProgress, ServerOutcome, StoreGeneration
from weightsync.common import byte_passes
from weightsync.common.checksum import tensor_checksum
from weightsync.common.collective import CollectiveError
from weightsync.common.logging import get_logger
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")

ABORT_GRACE_SECONDS = 4.0
"""How long an aborted push waits for each server to end its stream. A server whose workers sat
in the broken broadcast answers within about 2 s of the group timeout; one that is cut off never
does, and must not hold the caller for the whole RPC timeout."""
FAILURE_POLL_SECONDS = 0.01
"""How often a COLLECTIVE push looks for a server's report of failure while the trainer's thread waits in a
transfer (see PushRun._abort_at_first_failure)."""
_SETTLING = frozenset({"UPDATE_IN_PROGRESS", "WORKER_UNAVAILABLE"})
"""What a server that was stopped says for a moment after it resumes: our abandoned update is still
being aborted; its workers' heartbeats look stale until it reads them again."""


@dataclass(slots=True)
class PushRun:
    """Everything one run of one plan needs; `run()` does it once.

    What the run learns of its servers goes to their records at once: settled() when every one took
    Begin, gave_up() for one whose stream it gave up on (or lost), plan_forgotten() for a
    PLAN_NOT_FOUND. The rest (committed, base refused, went stale) is the caller's to record."""

    loop: LoopThread
    servers: Sequence[ServerState]
    metadata: tuple
    rpc_timeout: float
    """Bounds Ready, and every message a server must take (a server that stops reading fails the push)."""
    commit_timeout: float
    """Bounds the wait for Committed from the server's last message (UpdateStream.committed_within)."""
    group_id: str
    """The transfer group (COLLECTIVE); empty for INLINE and SHM."""
    sink: Sink
    planned: list[PlannedBucket]
    plan: tensor_pb2.WeightPlan
    plan_id: str
    source: TensorSource
    version: str
    mode: int
    allow_new_tensors: bool
    checksums: bool | None
    """As asked; None: per bucket, on where its bytes came from or through CUDA (buckets.read_order.wants_checksum)."""
    progress: Callable[[PushProgress], None] | None
    bar: object | None
    started: float
    bases: dict[str, StoreGeneration] = field(default_factory=dict)
    """Server address -> the committed generation this push's patches apply to (none: dense plan)."""
    on_ready: Callable[[], None] | None = None
    """Called once every server is ready (none refused the update at Begin), before any byte moves."""
    part: pb.UpdatePart | None = None
    """BeginUpdate.part: this push is one part of an update several trainer processes send (client/parts/push.py)."""
    ready_timeout: float = 0.0
    """Bounds Ready when set (a part: the servers answer once every part joined); else rpc_timeout does."""
    plan_reused: bool = False
    zero_copy_buckets: int = 0
    wire_seconds: float = 0.0
    """How long the caller waited on the transport (sending, and the transfers in flight)."""
    sent_bytes: int = 0
    """The buckets' bytes sent (a deferred bucket's layout, not its room in the plan)."""

    @property
    def total_bytes(self) -> int:
        return sum(b.spec.size_bytes for b in self.planned)

    # -- the whole push ---------------------------------------------------------------------
    def run(self) -> list[ServerOutcome]:
        streams = self.loop.run(self._begin())
        watcher = (asyncio.run_coroutine_threadsafe(self._abort_at_first_failure(streams), self.loop.loop)
                   if self.group_id else None)
        try:
            if self.on_ready is not None:
                self.on_ready()
            failure = self._send_buckets(streams)
        except BaseException:
            # Our own code (or the caller's progress callback) raised: the servers must not
            # wait for buckets that will never come.
            self.loop.run(self._abort(streams, "client error"))
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        if failure is None:
            failure = first_failure(streams)
        if failure is not None:
            self.loop.run(self._abort(streams, str(failure)))
            raise update_failed(as_ended(failure, streams), streams)
        try:
            return self.loop.run(self._commit(streams))
        finally:
            self._note_unsettled(streams)

    # -- the hot loop -------------------------------------------------------------------------
    def _send_buckets(self, streams: list[UpdateStream]) -> BaseException | None:
        """Place and send every bucket; returns the first failure. Nothing raised past here
        leaves bytes in flight: the sink completes them on every exit."""
        try:
            for index, planned in enumerate(self.planned):
                # A deferred bucket waits for its comparison here, while bucket k-1 is still on the wire.
                bucket = self.source.laid_out(index, planned)
                # COLLECTIVE packs bucket k while bucket k-1 is still on the wire (see client/transports/collective.py).
                payload = self.sink.fill(index, bucket, self.source, streams)
                payload.layout = bucket.spec if bucket.laid_out else None
                self.zero_copy_buckets += not payload.packed
                checksum = tensor_pb2.Checksum()
                if not payload.sink_checksum and wants_checksum(self.checksums, payload.source_devices,
                                                                payload.device):
                    with one_intra_op_thread():
                        checksum = tensor_checksum(payload.read())
                    byte_passes.read("trainer.ws64", payload.size)
                # A server that failed meanwhile stops us before we announce more.
                failure = first_failure(streams) or self._timed(self.sink.send, index, payload, checksum, streams)
                if failure is not None:
                    return failure
                self.sent_bytes += bucket.spec.size_bytes
                self._report(index, self.sent_bytes)
            failure = self._timed(self.sink.finish)
            if failure is not None:
                return failure
            self.source.finish()
            return None
        except (PlanMismatch, CollectiveError, WeightSyncRpcError) as error:
            return error
        finally:
            self.sink.finish()

    @property
    def _writes_store(self) -> bool:
        """SHM, one stream: the sink writes the buckets the server places in its store there
        (client/transports/store_writes.py); a part's buckets go through its run of slots."""
        return self.part is None and isinstance(self.sink, ShmSink) and self.sink.writes_store

    def _timed(self, call: Callable[..., BaseException | None], *args) -> BaseException | None:
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.wire_seconds += time.perf_counter() - started

    def _report(self, index: int, sent: int) -> None:
        if self.progress is None and self.bar is None:
            return
        if self.bar is not None:
            self.bar.update(self.planned[index].spec.size_bytes)  # type: ignore[attr-defined]
        if self.progress is not None:
            self.progress(PushProgress(index, len(self.planned), sent, self.total_bytes,
                                       time.perf_counter() - self.started))

    # -- streams --------------------------------------------------------------------------------
    def _open_streams(self, by_id: bool) -> list[UpdateStream]:
        streams = []
        for server in self.servers:
            stream = UpdateStream(server.address, server.server.update_weights, self.metadata, self.rpc_timeout)
            base = self.bases.get(server.address)
            begin = pb.BeginUpdate(group_id=self.group_id, version=self.version, mode=self.mode,
                                   transport=self.sink.transport, allow_new_tensors=self.allow_new_tensors,
                                   base_generation=base.generation if base else 0,
                                   base_store_epoch=base.store_epoch if base else 0,
                                   store_writes=self._writes_store)
            if self.part is not None:
                begin.part.CopyFrom(self.part)
            if by_id:
                begin.plan_id = self.plan_id
            else:
                begin.plan.CopyFrom(self.plan)
            stream.send(pb.UpdateWeightsRequest(begin=begin))
            streams.append(stream)
        return streams

    async def _begin(self) -> list[UpdateStream]:
        """Begin on every server: the plan by id where every server committed it, else in full."""
        by_id = all(s.holds(self.plan_id) for s in self.servers)
        deadline = time.monotonic() + self.rpc_timeout
        ready_timeout = self.ready_timeout or self.rpc_timeout
        while True:
            streams = self._open_streams(by_id)
            results = await asyncio.gather(
                *(asyncio.wait_for(asyncio.shield(s.ready), ready_timeout) for s in streams), return_exceptions=True
            )
            failures = [(s, r) for s, r in zip(streams, results, strict=True) if isinstance(r, BaseException)]
            if not failures:
                self.plan_reused = by_id
                for server in self.servers:
                    server.settled()
                return streams
            await self._abort(streams, "begin failed")
            stream, error = failures[0]
            reasons = {getattr(e, "reason", "") for _, e in failures}
            if by_id and "PLAN_NOT_FOUND" in reasons:
                forgot = {s.server for s, e in failures if getattr(e, "reason", "") == "PLAN_NOT_FOUND"}
                for server in self.servers:  # a server forgot the plan (restart): send it in full
                    if server.address in forgot:
                        server.plan_forgotten(self.plan_id)
                by_id = False
                continue
            if reasons <= _SETTLING and self._all_unsettled(failures) and time.monotonic() < deadline:
                # A server we gave up on, answering again, still winds our abandoned update down.
                log.info("begin_waits_for_aborted_update", servers=[s.server for s, _ in failures])
                await asyncio.sleep(UNSETTLED_RETRY_SECONDS)
                continue
            if isinstance(error, TimeoutError):
                error = WeightSyncRpcError(stream.server, grpc.StatusCode.DEADLINE_EXCEEDED, "READY_TIMEOUT",
                                           f"no Ready within {ready_timeout:g} s", {})
            self._note_unsettled(streams)
            raise UpdateFailed(f"update {self.version!r} refused by {stream.server}: {error}", error, stream.server)

    def _all_unsettled(self, failures: list[tuple[UpdateStream, BaseException]]) -> bool:
        unsettled = {s.address for s in self.servers if s.unsettled}
        return all(stream.server in unsettled for stream, _ in failures)

    def _note_unsettled(self, streams: list[UpdateStream]) -> None:
        """Remember the servers whose stream we gave up on, or lost with its connection (a cut link: the
        server learns of it only by its own timeouts): see ServerState.gave_up."""
        silent = {s.server for s in streams if s.unresponsive or (
            s.failure is not None and s.failure.code == grpc.StatusCode.UNAVAILABLE)}
        for server in self.servers:
            if server.address in silent:
                server.gave_up()

    async def _abort_at_first_failure(self, streams: list[UpdateStream]) -> None:
        """COLLECTIVE: abort the update on every server as soon as one reports a failure (its `aborting`).

        The trainer's thread may be inside a transfer that cannot complete: a Gloo send whose receiver never
        posts its receive (a bucket the server refused: it broke the group) waits out the group timeout, and
        nothing in this process can end it (ProcessGroupGloo's abort() and shutdown() leave a pending send
        waiting). A server that failed waits for our `abort`, then aborts its workers, and those of a broken
        group leave it: the send then fails at once (its peer closed the connection). A group that is not
        broken is unharmed: its workers still drain what was announced, then abort."""
        while (failure := first_failure(streams)) is None:
            await asyncio.sleep(FAILURE_POLL_SECONDS)
        log.info("update_aborting_at_server_failure", server=failure.server, reason=failure.reason)
        for stream in streams:
            stream.send(pb.UpdateWeightsRequest(abort=pb.AbortUpdate(reason=f"{failure.server}: {failure.reason}"[:500])))
            stream.send(None)

    async def _abort(self, streams: list[UpdateStream], reason: str) -> None:
        for stream in streams:
            stream.send(pb.UpdateWeightsRequest(abort=pb.AbortUpdate(reason=reason[:500])))
            stream.send(None)
        await asyncio.gather(*(s.finish(min(self.rpc_timeout, ABORT_GRACE_SECONDS)) for s in streams))
        self._note_unsettled(streams)

    async def _commit(self, streams: list[UpdateStream]) -> list[ServerOutcome]:
        for stream in streams:
            stream.send(pb.UpdateWeightsRequest(commit=pb.CommitUpdate()))
            stream.send(None)
        results = await asyncio.gather(
            *(s.committed_within(self.commit_timeout) for s in streams),
            return_exceptions=True,
        )
        await asyncio.gather(*(s.finish(5.0) for s in streams))
        failures = [(s, r) for s, r in zip(streams, results, strict=True) if isinstance(r, BaseException)]
        if failures:
            stream, error = failures[0]
            if isinstance(error, TimeoutError):
                error = WeightSyncRpcError(stream.server, grpc.StatusCode.DEADLINE_EXCEEDED, "COMMIT_TIMEOUT",
                                           f"no Committed, and no word from the server, within "
                                           f"{self.commit_timeout:g} s", {})
            raise UpdateFailed(f"commit failed on {stream.server}: {error}", error, stream.server)
        return [
            ServerOutcome(
                server=s.server, version=c.version.version, generation=c.version.generation,
                size_bytes=c.size_bytes, seconds=c.duration.ToTimedelta().total_seconds(),
                fast_path_buckets=s.ready.result().fast_path_bucket_count, store_epoch=c.version.store_epoch,
            )
            for s, c in zip(streams, results, strict=True)
        ]
