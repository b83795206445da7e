"""The transfer groups of this server, every change of their state, and the watch for trainers
that went away.

    JOINING --joined--> READY --mark_broken--> BROKEN --remove--> (gone)
    READY --update_started / update_ended--> READY (an update runs on it meanwhile)

A trainer keeps its rendezvous store (a TCPStore) listening for the life of
its group. Between updates nothing else would notice a trainer that died: the
workers would stay in the group, each holding sockets and Gloo threads,
READY forever. So the registry probes every idle READY group's store: a
refused connection means nobody listens any more (the trainer is gone); an
address that stops answering altogether is given a few tries. Either way the
group is marked BROKEN (reason TRAINER_GONE), its workers leave it, and it
stays listed until deleted.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from google.protobuf import duration_pb2

from weightsync.common.logging import get_logger
from weightsync.server.tasks import supervised
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.groups")

PROBE_INTERVAL_SECONDS = 2.0
PROBE_TIMEOUT_SECONDS = 2.0
SILENT_PROBES_BEFORE_GONE = 3
MAX_BROKEN_KEPT = 256
"""Broken groups stay listed (they hold nothing) until deleted; the oldest go past this many."""


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


class GroupRegistry:
    """Every group by id, and the liveness watch."""

    def __init__(self, on_trainer_gone: Callable[[GroupRecord], Awaitable[None]]) -> None:
        self.records: dict[str, GroupRecord] = {}
        self._on_gone = on_trainer_gone
        self._silent: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.records

    def get(self, group_id: str) -> GroupRecord | None:
        return self.records.get(group_id)

    def add(self, record: GroupRecord) -> None:
        self.records[record.group_id] = record

    def remove(self, group_id: str) -> None:
        self.records.pop(group_id, None)
        self._silent.pop(group_id, None)

    def joined(self, record: GroupRecord) -> None:
        """Every worker joined: READY (unless it broke meanwhile, e.g. a worker died)."""
        if record.state == pb.GROUP_STATE_JOINING:
            record.state = pb.GROUP_STATE_READY

    def update_started(self, record: GroupRecord) -> None:
        """An update runs on the group: its own collectives notice a dead trainer, the probe need not."""
        record.updating = True

    def update_ended(self, record: GroupRecord) -> None:
        record.updating = False

    def mark_broken(self, group_id: str, reason: str) -> None:
        record = self.records.get(group_id)
        if record is not None:
            _break(record, reason)
        broken = [g for g in self.records.values() if g.state == pb.GROUP_STATE_BROKEN]
        for old in broken[: max(0, len(broken) - MAX_BROKEN_KEPT)]:
            self.remove(old.group_id)

    def sorted(self) -> list[GroupRecord]:
        return [self.records[g] for g in sorted(self.records)]

    def mark_all_broken(self, reason: str) -> None:
        for record in self.records.values():
            _break(record, reason)

    # -- liveness ------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(supervised("group_watch", self._watch))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_SECONDS)
            idle = [g for g in self.records.values() if g.state == pb.GROUP_STATE_READY and not g.updating]
            results = await asyncio.gather(*(self._probe(g) for g in idle), return_exceptions=True)
            for record, gone in zip(idle, results, strict=True):
                if gone is True and record.state == pb.GROUP_STATE_READY and not record.updating:
                    why = f"the trainer's rendezvous store {record.store_host}:{record.store_port} is gone"
                    log.warning("trainer_gone", group_id=record.group_id, store=f"{record.store_host}:{record.store_port}")
                    self.mark_broken(record.group_id, f"TRAINER_GONE: {why}")
                    await self._on_gone(record)

    async def _probe(self, record: GroupRecord) -> bool:
        """True once the trainer's store is known to be gone."""
        try:
            _reader, writer = await asyncio.wait_for(
                asyncio.open_connection(record.store_host, record.store_port), PROBE_TIMEOUT_SECONDS
            )
        except (ConnectionRefusedError, ConnectionResetError):
            return True
        except (TimeoutError, OSError):
            silent = self._silent.get(record.group_id, 0) + 1
            self._silent[record.group_id] = silent
            return silent >= SILENT_PROBES_BEFORE_GONE
        self._silent.pop(record.group_id, None)
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return False


def _break(record: GroupRecord, reason: str) -> None:
    """BROKEN, with the first reason (a group breaks once)."""
    if record.state != pb.GROUP_STATE_BROKEN:
        record.state = pb.GROUP_STATE_BROKEN
        record.broken_reason = reason
