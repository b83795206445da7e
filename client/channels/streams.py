"""The client side of one UpdateWeights stream (lives on the SDK's loop)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import grpc.aio

from weightsync.client.errors import UpdateFailed, WeightSyncRpcError
from weightsync.common.collective import CollectiveError
from weightsync.common.errors import status_code
from weightsync.v1 import weight_sync_service_pb2 as pb

UNRESPONSIVE = "SERVER_UNRESPONSIVE"
"""The reason of a stream given up because its server stopped taking messages."""


class UpdateStream:
    """Messages go out through a queue; responses are read by a task.

    `failure` and `aborting` are plain attributes set on the loop and read by
    the trainer thread between buckets (single writes, safe under the GIL).
    `progress_timeout` bounds every wait for the server to take a message: a
    server that stops reading (stopped, hung, or cut off behind a proxy) holds
    gRPC's flow control shut forever, and nothing else would end the wait.
    """

    def __init__(self, server: str, update_weights: grpc.aio.StreamStreamMultiCallable, metadata: tuple,
                 progress_timeout: float) -> None:
        self.server = server
        self.progress_timeout = progress_timeout
        self._outgoing: asyncio.Queue[pb.UpdateWeightsRequest | bytes | None] = asyncio.Queue()
        self._call = update_weights(self._requests(), metadata=metadata)
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[pb.UpdateReady] = loop.create_future()
        self.committed: asyncio.Future[pb.UpdateCommitted] = loop.create_future()
        self.heard_at = loop.time()
        """When the server last said anything on this stream (a part waiting for the others hears
        PartsWaiting at least every 10 s: the commit wait counts its bound from here)."""
        self.applied = 0
        self._applied_changed = threading.Condition()
        self._taken = asyncio.Event()
        self.unresponsive = False
        """finish() gave up on this stream: the server did not end it in time (unreachable?)."""
        self.failure: WeightSyncRpcError | None = None
        self.aborting: pb.UpdateAborting | None = None
        self._not_stored: frozenset[int] | None = None
        self._reader = asyncio.create_task(self._read())

    def stores(self, index: int) -> bool:
        """Whether this server stores any tensor of bucket `index` (UpdateReady.not_stored_buckets:
        a server with a --tensors subset); ask after Ready came."""
        if self._not_stored is None:
            self._not_stored = frozenset(self.ready.result().not_stored_buckets)
        return index not in self._not_stored

    async def _requests(self):
        while True:
            message = await self._outgoing.get()
            self._taken.set()
            if message is None:
                return
            yield message

    def send(self, message: pb.UpdateWeightsRequest | None) -> None:
        """Queue a message (None half-closes the stream). Call on the loop."""
        self._outgoing.put_nowait(message)

    async def send_data(self, message: pb.UpdateWeightsRequest | bytes, backlog: int = 2) -> None:
        """Queue a bulky message once gRPC took all but `backlog` of the queued ones: the trainer
        thread waits here, so an INLINE push holds a few chunks in memory, not a whole model."""
        while self._outgoing.qsize() >= backlog and self.failure is None:
            self._taken.clear()
            try:
                await asyncio.wait_for(self._taken.wait(), self.progress_timeout)
            except TimeoutError:
                self.give_up(f"took no message for {self.progress_timeout:g} s")
                return
        if self.failure is None:
            self._outgoing.put_nowait(message)

    def give_up(self, why: str) -> None:
        """The server stopped answering: fail the stream (typed, naming the server) and cancel it. On the loop."""
        if self.failure is None:
            self._fail(WeightSyncRpcError(self.server, grpc.StatusCode.DEADLINE_EXCEEDED, UNRESPONSIVE,
                                          f"the server {why}", {"timeout_seconds": f"{self.progress_timeout:g}"}))
        self.unresponsive = True
        self._call.cancel()

    def wait_applied(self, count: int, timeout: float) -> bool:
        """Block (trainer thread) until `count` buckets were applied, the stream failed, or timeout."""
        with self._applied_changed:
            return self._applied_changed.wait_for(lambda: self.applied >= count or self.failed, timeout)

    def _bump_applied(self) -> None:
        with self._applied_changed:
            self.applied += 1
            self._applied_changed.notify_all()

    def _wake(self) -> None:
        with self._applied_changed:
            self._applied_changed.notify_all()

    @property
    def failed(self) -> bool:
        return self.failure is not None or self.aborting is not None

    @property
    def reported_error(self) -> WeightSyncRpcError | None:
        """What the server said went wrong: its `aborting` message, or the stream's status."""
        if self.aborting is not None:
            a = self.aborting
            return WeightSyncRpcError(self.server, status_code(a.code), a.reason, a.message, dict(a.metadata))
        return self.failure

    async def _read(self) -> None:
        try:
            async for response in self._call:
                self.heard_at = asyncio.get_running_loop().time()
                kind = response.WhichOneof("message")
                if kind == "ready":
                    self.ready.set_result(response.ready)
                elif kind == "bucket_applied":
                    self._bump_applied()
                elif kind == "aborting":
                    self.aborting = response.aborting
                    self._wake()
                    if not self.committed.done():
                        # The update will not commit: a part that already asked to commit learns it now, not
                        # when every other part's stream ended (one may hold its stream open a long while).
                        self.committed.set_exception(self.reported_error)
                        self.committed.exception()  # retrieved: the commit wait may not be running
                elif kind == "committed":
                    self.committed.set_result(response.committed)
            error: WeightSyncRpcError | None = None
            if not self.committed.done():
                error = WeightSyncRpcError(self.server, grpc.StatusCode.UNKNOWN, "STREAM_ENDED", "the stream ended before commit", {})
        except grpc.aio.AioRpcError as rpc_error:
            error = WeightSyncRpcError.from_rpc(self.server, rpc_error)
        except asyncio.CancelledError:
            error = WeightSyncRpcError(self.server, grpc.StatusCode.CANCELLED, "CANCELLED", "cancelled", {})
        if error is not None:
            self._fail(error)

    def _fail(self, error: WeightSyncRpcError) -> None:
        """The first failure is the one kept: a stream we gave up on then ends CANCELLED, which explains nothing."""
        if self.failure is None:
            self.failure = error
        self._wake()
        self._taken.set()
        for future in (self.ready, self.committed):
            if not future.done():
                future.set_exception(self.failure)
                future.exception()  # mark retrieved: not every path awaits both

    async def committed_within(self, quiet_timeout: float) -> pb.UpdateCommitted:
        """Committed, waited for while the server keeps talking: the bound counts from the later of this call
        and the server's last message, so a part whose server says the other parts still send (PartsWaiting)
        waits for them, however long they take, and one whose server went quiet gives up after
        `quiet_timeout` (TimeoutError). The server's UpdateAborting ends the wait at once (its error: the
        reason, and the ErrorInfo metadata that names a failed part)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            left = max(started, self.heard_at) + quiet_timeout - loop.time()
            if left <= 0:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(self.committed), left)
            except TimeoutError:
                continue  # heard from meanwhile? then the bound moved: look again

    async def finish(self, timeout: float) -> None:
        """Wait for the server to end the stream; past the timeout, cancel it."""
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        except TimeoutError:
            self.unresponsive = True
            self._call.cancel()
            self._reader.cancel()

    def cancel(self) -> None:
        self._call.cancel()

def as_ended(failure: BaseException, streams: list[UpdateStream]) -> BaseException:
    """A failure read from a server's `aborting` (no metadata), as that server's stream ended with it (the
    same reason, with its ErrorInfo metadata: PART_FAILED's part, PARTS_MISSING's ranks); else as it is.
    Call once the streams ended."""
    if not isinstance(failure, WeightSyncRpcError) or failure.metadata:
        return failure
    ended = next((s.failure for s in streams if s.server == failure.server and s.failure is not None
                  and s.failure.reason == failure.reason and s.failure.metadata), None)
    return ended or failure


def first_failure(streams: list[UpdateStream]) -> WeightSyncRpcError | None:
    """The first server-reported error among the streams, if any (cheap: checked per bucket)."""
    for stream in streams:
        error = stream.reported_error
        if error is not None:
            return error
    return None


# A broken broadcast is a symptom every rank sees when one of them dies; these
# reasons (and our own abort echoed back) never explain a failure by themselves.
_SYMPTOM_REASONS = frozenset({"COLLECTIVE_FAILED", "COLLECTIVE_TIMEOUT", "ABORTED_BY_CLIENT", "STREAM_CLOSED", "CANCELLED"})


def _root_cause(failure: BaseException, streams: list[UpdateStream]) -> BaseException:
    """The server error that explains a broken broadcast (a worker died, a server went away), if any.

    Called after every stream ended. When one of two servers dies, the survivor's
    workers see the broadcast break and report COLLECTIVE_FAILED, possibly before
    the dead server's stream is seen to drop: name the dead one, not the survivor.
    """
    reason = getattr(failure, "reason", "")
    if reason == "CLIENT_IDLE":
        # A server idles out on us while the SDK waits on another that stopped taking data
        # (INLINE sends each chunk to every server in turn): the silent one is the cause.
        silent = next((s.reported_error for s in streams if s.unresponsive and s.reported_error is not None), None)
        return silent if silent is not None else failure
    if not isinstance(failure, CollectiveError) and reason not in _SYMPTOM_REASONS:
        return failure
    reports = [s.reported_error for s in streams if s.reported_error is not None]
    return next((r for r in reports if r.reason not in _SYMPTOM_REASONS), failure)


def update_failed(failure: BaseException, streams: list[UpdateStream]) -> UpdateFailed:
    """The UpdateFailed for a push that failed, always with a status code and a reason."""
    failure = _root_cause(failure, streams)
    server = getattr(failure, "server", "")
    code, reason = getattr(failure, "code", None), getattr(failure, "reason", "")
    silent = [s.server for s in streams if s.unresponsive]
    if silent and (isinstance(failure, CollectiveError) or reason in _SYMPTOM_REASONS):
        # The broadcast broke and one server never answered the abort: it is the one cut off.
        message = f"{silent[0]} did not answer after the broadcast broke ({failure})"
        return UpdateFailed(f"update aborted on {silent[0]}: SERVER_UNREACHABLE: {message}", failure, silent[0],
                            code=grpc.StatusCode.UNAVAILABLE, reason="SERVER_UNREACHABLE")
    if isinstance(failure, CollectiveError):
        # Our own broadcast broke and no server said more: name it as the servers would.
        report = next((e for s in streams if (e := s.reported_error) is not None
                       and e.reason in ("COLLECTIVE_TIMEOUT", "COLLECTIVE_FAILED")), None)
        if report is not None:
            code, reason, server = report.code, report.reason, report.server
        else:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if failure.timed_out else grpc.StatusCode.ABORTED
            reason = "COLLECTIVE_TIMEOUT" if failure.timed_out else "COLLECTIVE_FAILED"
            server = next((s.server for s in streams if s.failed), server)
    where = f" on {server}" if server else ""
    return UpdateFailed(f"update aborted{where}: {reason}: {failure}", failure, server, code=code, reason=reason)
