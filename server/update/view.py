"""What the steps of an update (prepare.py, commit.py, abort.py) and a stream's side (stream_side.py)
see of its session, and what a session needs from the server (SessionServices).

UpdateSession (session.py) is the one owner of an update's state; the steps read it, and write only
the fields SessionView declares writable (store_update, finished, torn), through this Protocol, so
they do not import the session: the session imports them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from weightsync.common.errors import WeightSyncError
from weightsync.server.groups import GroupRecord, GroupRegistry
from weightsync.server.intake.intake import Bucket, Item, StreamReader
from weightsync.server.metrics import Metrics
from weightsync.server.published.publisher import Publisher
from weightsync.server.store.ingress import Ingress
from weightsync.server.store.leases import LeaseTable
from weightsync.server.store.node_store import NodeStore, StoreUpdate
from weightsync.server.update.admission import MemoryAdmission
from weightsync.server.update.streams import Stream
from weightsync.server.workers.worker_fleet import WorkerFleet
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


@dataclass(frozen=True, slots=True)
class SessionServices:
    """What an update session needs from the server, and nothing more."""

    fleet: WorkerFleet
    store: NodeStore
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


class SessionView(Protocol):
    """One update's session as its steps and its streams' sides see it."""

    services: SessionServices
    update_id: str
    group: GroupRecord | None
    begin: pb.BeginUpdate
    plan: tensor_pb2.WeightPlan
    plan_id: str
    streams: list[Stream]
    inbox: asyncio.Queue[tuple[int | None, Item]]
    store_update: StoreUpdate | None
    """Set by prepare once derived: from then on an abort is owed to the store and the workers."""
    failure: WeightSyncError | None
    applied_bytes: int
    progress: asyncio.Event
    finished: bool
    """Set by commit once every worker committed, or by the abort: nothing more is owed."""
    torn: set[str]
    """Set by a commit that failed half-way: the tensors it may have half-written."""
    started: float

    @property
    def bucket_timeout(self) -> float: ...

    @property
    def in_place(self) -> bool: ...

    @property
    def broadcast_to_all(self) -> bool: ...

    @property
    def owners(self) -> list[int]: ...

    @property
    def readers(self) -> list[StreamReader]: ...

    @property
    def reading(self) -> list[asyncio.Task[None]]: ...

    def break_group(self, why: str) -> None: ...

    def route_is_direct(self, sequence: int) -> bool: ...

    def stored_here(self, sequence: int) -> bool: ...

    def in_store(self, sequence: int) -> bool: ...

    def touched(self, sequence: int) -> None: ...

    def lay_out(self, sequence: int, layout: tensor_pb2.BucketSpec) -> wpb.OwnedBucket: ...

    def forwarded_to(self, worker_index: int) -> list[int]: ...

    def note_touched(self, bucket: Bucket, answers) -> None: ...

    def record(self) -> None: ...

    def fail(self, error: WeightSyncError, part: int | None = None) -> None: ...

    def note_broken(self, error: BaseException) -> None: ...
