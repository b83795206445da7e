"""A verl rollout worker's side of a sync: reading the commit the actor ranks made on its node.

By the time a rollout worker reads its node, it knows from the senders' outcomes (outcomes.py)
exactly what this sync committed: a generation in each server's store, named by the store's epoch.
It never goes by the step label: a node may hold the same label from another run, or another push
of this one, and a later label from a run before a resume.

- "tensors": `NodeReader.lease` finds the generation this sync committed in its node's store (the
  store's epoch in the commits) and acquires exactly it through the node's EngineClient (the
  node's one store, mapped read-only, no copy). VERSION_GONE when the node's store is not one the
  sync committed to (its server restarted since the commit) or moved past that generation.
- "served" (driver mode): `NodeReader.wait_served` watches the node's WatchWeights events (from the
  start of the rollout's receive, before the commit: `start_watching`) until the driven engine
  serves that generation (served.py decides on each event).

Either connects again to a node server that went away (stopped, restarted: a new local socket,
looked up from its address), within timeout_s of the commit: VERSION_NOT_COMMITTED when the node
cannot be read all that time. A server that refuses the rollout (a wrong token, no local socket) is
CONFIG_INVALID, its reason as cause_reason.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc

from weightsync.common.logging import get_logger
from weightsync.engine import EngineClient, EngineError, StoreSnapshot
from weightsync.integrations.verl.config import VerlSyncConfig
from weightsync.integrations.verl.errors import WeightSyncVerlError
from weightsync.integrations.verl.served import ServedWatch
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

log = get_logger("weightsync.integrations.verl")

POLL_S = 0.02
"""How often a waiting rollout worker looks at its node again (an IN_PLACE update writing the store)."""
RECONNECT_POLL_S = 0.25
"""How often a waiting rollout worker tries again to reach its node's server while it cannot."""
STREAM_GRACE_S = 5.0
"""A WatchWeights stream's gRPC deadline runs this much past the sync's bound, which decides first."""
UNREACHABLE = ("SERVER_UNREACHABLE", "DEADLINE_EXCEEDED")
"""EngineClient's reasons for a node server that did not answer (stopped, restarting), not one that refused."""


class NodeUnreachable(Exception):
    """The rollout's node server (or its local socket) cannot be reached now; retried until the deadline."""


class NodeReader:
    """One rollout worker's connection to its node's weightsync server."""

    def __init__(self, config: VerlSyncConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.node = config.node_server or config.servers[0]
        self._client: EngineClient | None = None
        self._channel: grpc.Channel | None = None
        """Driver mode: the channel to the node's server (WatchWeights)."""

    def connect_soon(self) -> None:
        """Connects now if the node answers (a node down for now is connected to when read)."""
        if self.config.receive == "served":
            if self._channel is None:
                self._channel = grpc.insecure_channel(self.node)
            return
        try:
            self._engine_client()
        except NodeUnreachable:
            pass

    def close(self) -> None:
        self._drop()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- "tensors" ------------------------------------------------------------------------------
    def lease(self, version: str, commits: dict[int, int]) -> StoreSnapshot:
        """The snapshot of the generation this sync committed in the node's store (`commits`: store
        epoch -> generation), leased; the caller releases it."""
        deadline = time.monotonic() + self.config.timeout_s
        where = ""
        while True:
            try:
                snapshot, where = self._try_lease(version, commits, deadline)
            except NodeUnreachable as error:  # stopped or restarting: reached again within the bound
                self._drop()
                snapshot, where = None, f"its node's server is unreachable ({error})"
            if snapshot is not None:
                return snapshot
            if time.monotonic() >= deadline:
                raise WeightSyncVerlError("VERSION_NOT_COMMITTED", f"rollout worker {self.rank}: version {version!r} "
                                          f"not readable on its node {self.node} within {self.config.timeout_s:g} s "
                                          f"of its commit ({where})", version=version)
            time.sleep(RECONNECT_POLL_S if "unreachable" in where else POLL_S)

    def _try_lease(self, version: str, commits: dict[int, int], deadline: float) -> tuple[StoreSnapshot | None, str]:
        """One look at the node: (the snapshot, or None and why not yet)."""
        client = self._engine_client()
        try:
            held = client.status().version
            generation = self._committed_here(version, commits, held)
            if held.generation > generation:
                raise self._gone(version, f"the node moved on to generation {held.generation} ({held.version!r})")
            try:
                snapshot = client.acquire(generation=generation, wait=max(0.001, deadline - time.monotonic()))
            except EngineError as error:
                if error.reason == "STORE_UPDATING":
                    return None, "an in-place update is writing its store"
                if error.reason in ("VERSION_GONE", "STORE_INCONSISTENT"):
                    raise self._gone(version, str(error)) from None
                raise WeightSyncVerlError("VERSION_NOT_COMMITTED", f"rollout worker {self.rank}: its node {self.node} "
                                          f"refused to lease version {version!r}: {error}", version=version,
                                          cause_reason=error.reason) from None
        except OSError as error:  # the local connection broke (LocalWireError is one): the server went away
            raise NodeUnreachable(f"{type(error).__name__}: {error}") from None
        return snapshot, ""

    def _committed_here(self, version: str, commits: dict[int, int], held: pb.WeightVersion) -> int:
        generation = commits.get(held.store_epoch)
        if generation is None:
            raise self._gone(version, f"its store (epoch {held.store_epoch}) is not one this sync committed to (epochs "
                             f"{', '.join(map(str, sorted(commits))) or 'none'}): its server restarted after the "
                             "commit, or node_server names a server the actor ranks do not push to")
        return generation

    def _gone(self, version: str, why: str) -> WeightSyncVerlError:
        return WeightSyncVerlError("VERSION_GONE", f"rollout worker {self.rank}: its node {self.node} no longer holds "
                                   f"version {version!r} as this sync committed it: {why}", version=version)

    def _engine_client(self) -> EngineClient:
        """The node's EngineClient, connected (again) when there is none: its local socket is looked up
        from the node's server each time, since a restarted server listens on a new one (its name carries
        the pid). NodeUnreachable when the server or its socket cannot be reached."""
        if self._client is None:
            try:
                self._client = EngineClient(server=self.node, name=f"verl-rollout-{self.rank}",
                                            token=self.config.token, timeout=self.config.timeout_s)
            except OSError as error:  # the socket named is gone: the server stopped since it answered
                raise NodeUnreachable(f"{type(error).__name__}: {error}") from None
            except EngineError as error:
                if error.reason in UNREACHABLE:
                    raise NodeUnreachable(str(error)) from None
                raise WeightSyncVerlError("CONFIG_INVALID", f"rollout worker {self.rank}: the node's server {self.node} "
                                          f"refused it: {error}", cause_reason=error.reason) from None
        return self._client

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- "served" (driver mode) -----------------------------------------------------------------
    def start_watching(self) -> Watching:
        """The node's WatchWeights events from now on (the rollout watches from the start of its receive,
        before the commit, so that it sees the engine start on the commit, and fail). Cancelled by
        wait_served; no deadline of its own: wait_served's bound decides."""
        assert self._channel is not None
        return Watching(self._channel, self._metadata(), self.rank, timeout=None)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.config.token}"),) if self.config.token else ()

    def wait_served(self, version: str, commits: dict[int, int], watching: Watching) -> None:
        """Returns once the node's driven engine serves the generation this sync committed (served.py
        decides on each WatchWeights event, from `watching`'s first); watches again, within the same
        bound, when the node's server went away."""
        assert self._channel is not None
        deadline = time.monotonic() + self.config.timeout_s
        watch = ServedWatch(version=version, commits=commits, engine=self.config.engine, node=self.node)
        unreachable = ""
        current: Watching | None = watching
        while True:
            left = deadline - time.monotonic()
            if current is None:
                if left <= 0:
                    raise watch.timed_out(self.config.timeout_s, unreachable)
                current = Watching(self._channel, self._metadata(), self.rank, timeout=left + STREAM_GRACE_S)
            try:
                broken = _follow(watch, current.events, deadline, self.config.timeout_s)
            finally:
                current.cancel()
                current = None
            if broken is None:
                log.info("verl sync served", version=version, rank=self.rank, engine=watch.engine,
                         generation=watch.generation)
                return
            if broken.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the stream's own deadline: ours has passed
                raise watch.timed_out(self.config.timeout_s, unreachable)
            if broken.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise WeightSyncVerlError("CONFIG_INVALID", f"rollout worker {self.rank}: the node's server refused "
                                          f"its token: {broken.details()}", version=version,
                                          cause_reason="UNAUTHENTICATED")
            if broken.code() not in (grpc.StatusCode.UNAVAILABLE, None):
                raise WeightSyncVerlError("VERSION_NOT_SERVED", f"rollout worker {self.rank}: the node's server "
                                          f"refused WatchWeights: {broken.code()}: {broken.details()}",
                                          version=version)
            unreachable = f"{broken.code()}: {broken.details()}"
            watch.restart()
            time.sleep(min(RECONNECT_POLL_S, max(0.0, deadline - time.monotonic())))


class Watching:
    """One WatchWeights stream, read on its own thread into `events` (then its error, or None at its end)."""

    def __init__(self, channel: grpc.Channel, metadata: tuple, rank: int, *, timeout: float | None) -> None:
        self.stream = pb_grpc.WeightSyncServiceStub(channel).WatchWeights(pb.WatchWeightsRequest(), metadata=metadata,
                                                                          timeout=timeout)
        self.events: queue.Queue[pb.WatchWeightsResponse | grpc.RpcError | None] = queue.Queue()
        threading.Thread(target=_read_stream, args=(self.stream, self.events), daemon=True,
                         name=f"verl-watch-{rank}").start()

    def cancel(self) -> None:
        self.stream.cancel()


def _follow(watch: ServedWatch, events: queue.Queue, deadline: float, timeout_s: float) -> grpc.RpcError | None:
    """Reads one WatchWeights stream until the engine serves the version (None) or the stream breaks
    (its error)."""
    while True:
        try:
            event = events.get(timeout=max(0.001, deadline - time.monotonic()))
        except queue.Empty:
            raise watch.timed_out(timeout_s, "") from None
        if isinstance(event, grpc.RpcError) or event is None:
            return event if event is not None else _StreamEnded()
        if watch.see(event) is not None:
            return None
        if time.monotonic() >= deadline:  # events that keep coming do not stretch the bound
            raise watch.timed_out(timeout_s, "")


def _read_stream(stream: Any, events: queue.Queue) -> None:
    """Feeds a WatchWeights stream's events into `events`, then its error (or None when it ended)."""
    try:
        for event in stream:
            events.put(event)
    except grpc.RpcError as error:
        events.put(error)
        return
    events.put(None)


class _StreamEnded(grpc.RpcError):
    """The server ended a WatchWeights stream (it is stopping): watched again, like an unreachable one."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the server ended the WatchWeights stream"
