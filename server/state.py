"""Server-side records: transfer groups, the published version, watchers."""

from __future__ import annotations

import asyncio
import datetime
import secrets
from dataclasses import dataclass, field

from google.protobuf import duration_pb2, timestamp_pb2

from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass(slots=True)
class GroupRecord:
    """One transfer group as this server sees it."""

    group_id: str
    world_size: int
    rank_offset: int
    backend: int
    timeout: datetime.timedelta
    store_host: str
    store_port: int
    state: int = pb.GROUP_STATE_JOINING
    broken_reason: str = ""
    updating: bool = False
    """An update runs on the group (its collective notices a dead trainer itself)."""
    trainer_ranks: int = 1
    """The trainer's ranks, 0..trainer_ranks-1: one per part of an update sent in parts over the group."""

    def to_proto(self) -> pb.TransferGroup:
        timeout = duration_pb2.Duration()
        timeout.FromTimedelta(self.timeout)
        return pb.TransferGroup(
            group_id=self.group_id,
            world_size=self.world_size,
            rank_offset=self.rank_offset,
            backend=self.backend,
            state=self.state,
            timeout=timeout,
            broken_reason=self.broken_reason,
            trainer_ranks=self.trainer_ranks,
        )


def new_store_epoch() -> int:
    """A store's epoch: positive, random, so two stores (a server before and after a restart) differ."""
    return secrets.randbits(62) + 1


@dataclass(slots=True)
class PublishedVersion:
    """What was last committed on every worker."""

    store_epoch: int
    """The store this generation counts in (WeightVersion.store_epoch)."""
    version: str = ""
    generation: int = 0
    commit_time: datetime.datetime | None = None

    def to_proto(self) -> pb.WeightVersion:
        message = pb.WeightVersion(version=self.version, generation=self.generation, store_epoch=self.store_epoch)
        if self.commit_time is not None:
            stamp = timestamp_pb2.Timestamp()
            stamp.FromDatetime(self.commit_time)
            message.commit_time.CopyFrom(stamp)
        return message


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
