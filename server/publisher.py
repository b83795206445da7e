"""What the server tells the world about its weights: the published version,
the aggregate store state, and WatchWeights events."""

from __future__ import annotations

import datetime

from weightsync.server.engines import EngineRegistry
from weightsync.server.state import (
    PublishedVersion,
    Watchers,
    aggregate_store_state,
    new_store_epoch,
)
from weightsync.server.supervisor import Supervisor
from weightsync.v1 import weight_sync_service_pb2 as pb


class Publisher:
    """Owns the published version; every state change goes out to watchers from here."""

    def __init__(self, supervisor: Supervisor, engines: EngineRegistry) -> None:
        self._supervisor = supervisor
        self.engines = engines
        self.version = PublishedVersion(new_store_epoch())
        self.watchers = Watchers()
        self.mixed = False
        """A commit reached some workers but not all: they hold different weights."""

    def store_state(self) -> int:
        workers = self._supervisor.workers
        state = aggregate_store_state([w.store.state for w in workers], [w.lost for w in workers])
        if self.mixed and state == pb.STORE_STATE_CONSISTENT:
            return pb.STORE_STATE_INCONSISTENT
        return state

    def event(self) -> pb.WatchWeightsResponse:
        event = pb.WatchWeightsResponse(version=self.version.to_proto(), store_state=self.store_state(),
                                        engines=self.engines.protos())
        event.event_time.GetCurrentTime()
        return event

    def publish_state(self) -> None:
        self.watchers.publish(self.event())

    @property
    def next_generation(self) -> int:
        """The generation the next commit publishes (the one place it is computed)."""
        return self.version.generation + 1

    def publish_version(self, label: str) -> PublishedVersion:
        self.version = PublishedVersion(
            store_epoch=self.version.store_epoch,
            version=label,
            generation=self.next_generation,
            commit_time=datetime.datetime.now(datetime.UTC),
        )
        self.mixed = False
        self.publish_state()
        return self.version
