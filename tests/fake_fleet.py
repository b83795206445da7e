"""An in-process fleet for the asyncio core of an update (server/workers/worker_fleet.py, WorkerFleet).

Each fake worker is the real receiver (gpu_worker/receiver.py) run in this process on
the node store's real arenas and the server's real ingress: the session, its intake,
the node store, admission and the receivers meet exactly as in a server, without
processes or queues, so a whole update runs in milliseconds. A worker can be told to
fail a given command, or to die before it answers one.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from weightsync.common.errors import Unavailable, WeightSyncError, code_number
from weightsync.gpu_worker.memory import map_arena
from weightsync.gpu_worker.receiver import Receiver
from weightsync.server.store.arenas import HostArena
from weightsync.server.store.ingress import Ingress
from weightsync.server.workers.worker_fleet import FanOut
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

Fault = Callable[[wpb.WorkerCommand], BaseException | None]
"""Given a command about to run, an error to answer with instead (or None: run it)."""


@dataclass
class FakeWorker:
    index: int
    receiver: Receiver
    device: str = "cpu"
    status: wpb.WorkerStatus = field(default_factory=wpb.WorkerStatus)
    alive: bool = True
    mapped: set[int] = field(default_factory=set)
    fault: Fault | None = None
    commands: list[str] = field(default_factory=list)
    # What GetServerInfo reads of a worker (server/node.py): a running worker of this process.
    state: int = pb.WORKER_STATE_RUNNING
    backend: int = pb.BACKEND_UNSPECIFIED
    device_uuid: str = ""
    restart_count: int = 0

    @property
    def pid(self) -> int:
        return os.getpid() if self.alive else 0

    @property
    def host_memory(self) -> bool:
        return True


class FakeFleet:
    """WorkerFleet over in-process receivers (see the module docstring)."""

    def __init__(self, workers: int, ingress: Ingress | None = None) -> None:
        self._workers = [FakeWorker(i, Receiver(torch.device("cpu"))) for i in range(workers)]
        self._ingress = None
        if ingress is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self._ingress = torch.frombuffer(ingress.view, dtype=torch.uint8)

    @property
    def workers(self) -> list[FakeWorker]:
        return self._workers

    def alive_workers(self) -> list[FakeWorker]:
        return [w for w in self._workers if w.alive]

    def submit_or_refusal(self, worker: FakeWorker, **command: object) -> asyncio.Future[wpb.WorkerEvent]:
        future: asyncio.Future[wpb.WorkerEvent] = asyncio.get_running_loop().create_future()
        message = wpb.WorkerCommand(**command)  # type: ignore[arg-type]
        kind = message.WhichOneof("command") or ""
        worker.commands.append(kind)
        if not worker.alive:
            future.set_exception(Unavailable("WORKER_UNAVAILABLE", f"worker {worker.index} is dead"))
            return future
        injected = worker.fault(message) if worker.fault else None
        if isinstance(injected, KillWorker):
            worker.alive = False
            future.set_exception(Unavailable("WORKER_DIED", f"worker {worker.index} died", worker=worker.index))
            return future
        try:
            if injected is not None:
                raise injected
            event = self._run(worker, kind, message)
        except WeightSyncError as error:
            error.worker_index = worker.index
            error.store_touched = worker.receiver.touched
            future.set_exception(error)
        else:
            event.status.CopyFrom(worker.receiver.status())
            worker.status = event.status
            future.set_result(event)
        return future

    def _run(self, worker: FakeWorker, kind: str, command: wpb.WorkerCommand) -> wpb.WorkerEvent:
        receiver = worker.receiver
        event = wpb.WorkerEvent()
        if kind == "prepare_update":
            receiver.prepare(command.prepare_update, device_lane=False)
            event.update_prepared.update_id = command.prepare_update.update_id
        elif kind == "receive_bucket":
            receive = command.receive_bucket
            applied = receiver.receive_from_ingress(receive, self._ingress)
            event.bucket_received.sequence = receive.sequence
            if applied is not None:
                event.bucket_received.size_bytes = applied.size_bytes
        elif kind == "commit_update":
            receiver.commit(command.commit_update.update_id)
            event.update_committed.update_id = command.commit_update.update_id
        elif kind == "abort_update":
            if receiver.update is not None and receiver.update.update_id == command.abort_update.update_id:
                receiver.abort()
            event.update_aborted.update_id = command.abort_update.update_id
        elif kind == "unmap_arenas":
            receiver.maps.drop(command.unmap_arenas.arena_ids)
        else:
            raise AssertionError(f"the fake fleet does not run {kind}")
        return event

    async def settle(self, submitted, timeout: float) -> FanOut:
        results = await asyncio.gather(*(f for _, f in submitted), return_exceptions=True)
        return FanOut(list(zip((w for w, _ in submitted), results, strict=True)))

    async def fan_out(self, timeout: float, workers=None, command_for=None, **command: object) -> FanOut:
        targets = self._workers if workers is None else workers
        return await self.settle(
            [(w, self.submit_or_refusal(w, **(command_for(w) if command_for else command))) for w in targets], timeout)

    async def map_arenas(self, worker: FakeWorker, arenas: list[HostArena], timeout: float) -> None:
        if not worker.alive:
            raise Unavailable("WORKER_UNAVAILABLE", f"worker {worker.index} is dead")
        for arena in arenas:
            if arena.arena_id not in worker.mapped:
                worker.receiver.maps.add(map_arena(arena.arena_id, os.dup(arena.fd), arena.size_bytes,
                                                   torch.device("cpu")))
                worker.mapped.add(arena.arena_id)

    def forget_arenas(self, arena_ids: list[int]) -> None:
        for worker in self._workers:
            worker.receiver.maps.drop(arena_ids)
            worker.mapped -= set(arena_ids)

    def close(self) -> None:
        for worker in self._workers:
            worker.receiver.release()


class InProcessFleet(FakeFleet):
    """A FakeFleet with the Supervisor's lifecycle, for a whole server in the test's process
    (tests/inprocess_server.py): Node builds it from its ingress (server/node.py, FleetFactory)."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.close()

    @property
    def all_running(self) -> bool:
        return all(w.alive for w in self._workers)


class KillWorker(Exception):
    """A fault that kills the worker before it answers."""


def failing(kind: str, sequence: int | None, error: BaseException) -> Fault:
    """Answer `error` to the first `kind` command (of bucket `sequence`, for receive_bucket)."""
    fired: list[bool] = []

    def fault(command: wpb.WorkerCommand) -> BaseException | None:
        if fired or command.WhichOneof("command") != kind:
            return None
        if sequence is not None and command.receive_bucket.sequence != sequence:
            return None
        fired.append(True)
        return error

    return fault


def command_failed(error: WeightSyncError) -> int:
    return code_number(error.code)


def fake_session_services(fleet: FakeFleet, ingress: Ingress):
    """The SessionServices of an update run in-process over `fleet` and `ingress` (a fresh store, no engines),
    and what closes them: for tests that drive UpdateSession without a server."""
    from weightsync.server.groups import GroupRegistry
    from weightsync.server.metrics import Metrics
    from weightsync.server.published.engine_registry import EngineRegistry
    from weightsync.server.published.publisher import Publisher
    from weightsync.server.store.leases import LeaseTable
    from weightsync.server.store.node_store import NodeStore
    from weightsync.server.update.admission import MemoryAdmission
    from weightsync.server.update.view import SessionServices

    async def group_gone(record) -> None:
        pass

    store = NodeStore()
    services = SessionServices(
        fleet=fleet, store=store, publisher=Publisher(store, EngineRegistry()), groups=GroupRegistry(group_gone),
        admission=MemoryAdmission(available=lambda: 1 << 40), leases=LeaseTable(), ingress=ingress,
        command_timeout=5, transfer_timeout=5, lease_timeout=5, max_chunk_bytes=ingress.slot_bytes, metrics=Metrics())

    def close() -> None:
        fleet.close()
        store.close()
        ingress.close()

    return services, close
