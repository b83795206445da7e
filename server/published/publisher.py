"""What the server tells the world about its weights: the published version,
the store's state, and WatchWeights events."""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass, field

from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.store.node_store import NodeStore
from weightsync.server.store.version import PublishedVersion, new_store_epoch
from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass(slots=True)
class Watchers:
    """Fan-out of WatchWeights events to every subscriber."""

    queues: set[asyncio.Queue[pb.WatchWeightsResponse]] = field(default_factory=set)

    def subscribe(self) -> asyncio.Queue[pb.WatchWeightsResponse]:
        queue: asyncio.Queue[pb.WatchWeightsResponse] = asyncio.Queue(maxsize=1024)
        self.queues.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[pb.WatchWeightsResponse]) -> None:
        self.queues.discard(queue)

    def publish(self, event: pb.WatchWeightsResponse) -> None:
        for queue in list(self.queues):
            if queue.full():  # a stalled watcher loses its oldest event, never blocks us
                queue.get_nowait()
            queue.put_nowait(event)


class Publisher:
    """Owns the published version; every state change goes out to watchers from here."""

    def __init__(self, store: NodeStore, engines: EngineRegistry) -> None:
        self._store = store
        self.engines = engines
        self.version = PublishedVersion(new_store_epoch())
        """The store's epoch is drawn once, with the store: the server's life."""
        self.watchers = Watchers()

    def store_state(self) -> int:
        return self._store.state

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
        self.publish_state()
        return self.version
