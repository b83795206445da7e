"""What an update session needs from the node's worker processes, and nothing more.

The Supervisor (supervisor.py) is the real fleet: processes, queues, fd channels. An
UpdateSession sees it only through WorkerFleet, so the asyncio core of an update (the
session, its intake, the node store, admission) runs in-process against a fake fleet in
tests (tests/unit/test_update_core.py), while the real-process suites drive the real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from weightsync.common.logging import get_logger
from weightsync.server.store.arenas import HostArena
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.fleet")


class FleetWorker(Protocol):
    """One worker as the session sees it."""

    index: int
    device: str
    status: wpb.WorkerStatus
    """What the worker last reported of itself (staging, bytes received, device memory)."""

    @property
    def alive(self) -> bool: ...

    @property
    def host_memory(self) -> bool:
        """Its staging is host memory (a CPU worker; a CUDA worker's NCCL staging is device memory)."""


@dataclass(frozen=True, slots=True)
class FanOut:
    """Every addressed worker's answer to one command: its event, or the error it ended with.
    All answers are in before a FanOut exists, so no worker is left mid-command."""

    answers: list[tuple[FleetWorker, wpb.WorkerEvent | BaseException]]

    @property
    def errors(self) -> list[BaseException]:
        return [a for _, a in self.answers if isinstance(a, BaseException)]

    @property
    def events(self) -> list[wpb.WorkerEvent]:
        """Every event, in worker order; raises the first error if any worker failed."""
        errors = self.errors
        if errors:
            raise errors[0]
        return [a for _, a in self.answers]  # type: ignore[misc]

    def raise_first(self) -> None:
        """The first worker's error, if any worker failed."""
        errors = self.errors
        if errors:
            raise errors[0]

    def log_errors(self, event: str, **context: object) -> None:
        for worker, answer in self.answers:
            if isinstance(answer, BaseException):
                log.warning(event, worker=worker.index, error=str(answer), **context)



class WorkerFleet(Protocol):
    """The node's workers: commands to one or many, their answers, their maps of the store."""

    @property
    def workers(self) -> Sequence[FleetWorker]: ...

    def alive_workers(self) -> list[FleetWorker]: ...

    def submit_or_refusal(self, worker: FleetWorker, **command: object) -> asyncio.Future[wpb.WorkerEvent]:
        """Enqueue one command now; a worker that cannot take it answers with its error."""

    async def settle(self, submitted: list[tuple[FleetWorker, asyncio.Future[wpb.WorkerEvent]]],
                     timeout: float) -> FanOut:
        """Await already submitted commands, every one of them."""

    async def fan_out(self, timeout: float, workers: list[FleetWorker] | None = None,
                      command_for: Callable[[FleetWorker], dict[str, object]] | None = None,
                      **command: object) -> FanOut:
        """One command to each of `workers` (default: all), concurrently; every answer collected."""

    async def map_arenas(self, worker: FleetWorker, arenas: list[HostArena], timeout: float) -> None:
        """Make sure this worker maps these arenas of the store."""

    def forget_arenas(self, arena_ids: list[int]) -> None:
        """Arenas the store released: unmapped wherever they were mapped."""
