"""The inference engines that take this node's weights, and what each one serves.

Local engines (weightsync.engine over the local socket) report what they apply
when they release a version; driven engines (--engine) are reported by their
driver. Every change goes out to WatchWeights watchers.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import duration_pb2, timestamp_pb2

from weightsync.server.store.version import PublishedVersion
from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass(slots=True)
class EngineRecord:
    name: str
    kind: str
    endpoint: str
    state: int = pb.ENGINE_STATE_UNSPECIFIED
    applied: PublishedVersion | None = None
    applied_time: datetime.datetime | None = None
    commit_to_serving: float | None = None
    last_error: str = ""
    before_applying: int = pb.ENGINE_STATE_UNSPECIFIED
    """The state it had when it started applying: what it returns to when it applies nothing."""
    before_gone: tuple[int, str] | None = None
    """(state, last_error) when its last local connection closed: what it returns to on reconnecting."""

    def to_proto(self) -> pb.EngineStatus:
        status = pb.EngineStatus(name=self.name, kind=self.kind, endpoint=self.endpoint, state=self.state,
                                 last_error=self.last_error)
        if self.applied is not None:
            status.applied_version.CopyFrom(self.applied.to_proto())
        if self.applied_time is not None:
            stamp = timestamp_pb2.Timestamp()
            stamp.FromDatetime(self.applied_time)
            status.applied_time.CopyFrom(stamp)
        if self.commit_to_serving is not None:
            duration = duration_pb2.Duration()
            duration.FromNanoseconds(int(self.commit_to_serving * 1e9))
            status.commit_to_serving.CopyFrom(duration)
        return status


class EngineRegistry:
    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.records: dict[str, EngineRecord] = {}
        self.connections: dict[str, int] = {}
        """Local engine name -> its open local-socket connections (one record per name, many connections)."""
        self.on_change = on_change

    def protos(self) -> list[pb.EngineStatus]:
        return [self.records[name].to_proto() for name in sorted(self.records)]

    def register(self, name: str, kind: str, endpoint: str) -> EngineRecord:
        record = self.records.get(name)
        if record is None or (record.kind, record.endpoint) != (kind, endpoint):
            record = self.records[name] = EngineRecord(name, kind, endpoint)
            self.on_change()
        return record

    def attached(self, name: str, kind: str, endpoint: str) -> None:
        """A local connection attached as `name`; a name that was gone is back to what it was."""
        record = self.register(name, kind, endpoint)
        self.connections[name] = self.connections.get(name, 0) + 1
        if self.connections[name] == 1 and record.before_gone is not None:
            state, error = record.before_gone
            record.before_gone = None
            self._set(name, state=state, last_error=error)

    def detached(self, name: str, *, holding: bool) -> None:
        """A local connection of `name` closed (`holding`: with a version it was reading). The last
        one makes the engine UNREACHABLE; another one that was reading leaves it FAILED."""
        left = self.connections.get(name, 0) - 1
        if left > 0:
            self.connections[name] = left
            if holding:
                self.failed(name, "DISCONNECTED: a connection of this engine closed while it read a version")
            return
        self.connections.pop(name, None)
        record = self.records.get(name)
        if record is None:
            return
        applying = record.state == pb.ENGINE_STATE_APPLYING
        record.before_gone = (record.before_applying if applying else record.state, record.last_error)
        self.unreachable(name, "DISCONNECTED: no connection of this engine is open"
                         + (" (the last one closed while it read a version)" if holding else ""))

    def applying(self, name: str) -> None:
        record = self.records.get(name)
        if record is not None and record.state != pb.ENGINE_STATE_APPLYING:
            record.before_applying = record.state
        self._set(name, state=pb.ENGINE_STATE_APPLYING)

    def not_applied(self, name: str) -> None:
        """It read a version and applied none of it, without an error: back to what it was (it
        still serves applied_version), never left APPLYING."""
        record = self.records.get(name)
        if record is not None and record.state == pb.ENGINE_STATE_APPLYING:
            self._set(name, state=record.before_applying)

    def applied(self, name: str, version: PublishedVersion) -> None:
        now = datetime.datetime.now(datetime.UTC)
        lag = (now - version.commit_time).total_seconds() if version.commit_time else None
        self._set(name, state=pb.ENGINE_STATE_SERVING, applied=version, applied_time=now, commit_to_serving=lag,
                  last_error="")

    def failed(self, name: str, error: str) -> None:
        self._set(name, state=pb.ENGINE_STATE_FAILED, last_error=error[:2000])

    def unreachable(self, name: str, error: str = "") -> None:
        self._set(name, state=pb.ENGINE_STATE_UNREACHABLE, last_error=error[:2000])

    def _set(self, name: str, **fields) -> None:
        record = self.records.get(name)
        if record is None:
            return
        for key, value in fields.items():
            setattr(record, key, value)
        self.on_change()
