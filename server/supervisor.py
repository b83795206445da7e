"""Spawns the worker processes and talks to them through shared-memory queues.

The asyncio loop never blocks on a worker: commands go into a ring (waiting,
without blocking, if it is full), events come back through an eventfd the loop
watches, and each worker's death is seen through a pidfd the loop also
watches, so it is noticed at once and the worker restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from weightsync.common.errors import Unavailable, WeightSyncError, error_from_code
from weightsync.common.shm_queue import OwnedQueue, QueueCorrupted
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = structlog.get_logger("weightsync.supervisor")

STARTUP_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 5.0


class CommandTimeout(WeightSyncError):
    """A worker did not answer in time; it is restarted."""


@dataclass(slots=True)
class WorkerHandle:
    """The server's view of one worker process."""

    index: int
    device: str
    commands: OwnedQueue
    events: OwnedQueue
    process: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    state: int = pb.WORKER_STATE_STARTING
    store: wpb.StoreStatus = field(default_factory=lambda: wpb.StoreStatus(state=pb.STORE_STATE_EMPTY))
    backend: int = pb.BACKEND_UNSPECIFIED
    lost: bool = False
    """The worker died holding weights; cleared once its store is refilled."""
    restart_count: int = 0
    pending: dict[int, asyncio.Future[wpb.WorkerEvent]] = field(default_factory=dict)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None and self.state == pb.WORKER_STATE_RUNNING else 0


class Supervisor:
    """Owns every worker process and its two queues."""

    def __init__(
        self,
        devices: tuple[str, ...],
        *,
        queue_capacity_bytes: int,
        log_level: str,
        memory_limit_bytes: int,
        on_worker_died: Callable[[WorkerHandle], None],
        on_worker_started: Callable[[WorkerHandle], None],
    ) -> None:
        self._queue_capacity = queue_capacity_bytes
        self._log_level = log_level
        self._memory_limit = memory_limit_bytes
        self._on_died = on_worker_died
        self._on_started = on_worker_started
        self._ids = itertools.count(1)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.workers = [
            WorkerHandle(i, d, OwnedQueue(queue_capacity_bytes), OwnedQueue(queue_capacity_bytes))
            for i, d in enumerate(devices)
        ]

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for worker in self.workers:
            self._loop.add_reader(worker.events.doorbell_fd, self._drain_events, worker)
            self._spawn(worker)
        await self.wait_started()

    async def wait_started(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
        await asyncio.wait_for(asyncio.gather(*(w.started.wait() for w in self.workers)), timeout)

    @property
    def all_running(self) -> bool:
        return all(w.state == pb.WORKER_STATE_RUNNING for w in self.workers)

    def _spawn(self, worker: WorkerHandle) -> None:
        config = wpb.WorkerConfig(
            index=worker.index,
            device=worker.device,
            log_level=self._log_level,
            queue_capacity_bytes=self._queue_capacity,
            parent_pid=os.getpid(),
            memory_limit_bytes=self._memory_limit,
        )
        cmd = (worker.commands.segment_fd, worker.commands.doorbell_fd)
        evt = (worker.events.segment_fd, worker.events.doorbell_fd)
        argv = [
            sys.executable,
            "-m",
            "weightsync.gpu_worker",
            "--config-hex",
            config.SerializeToString().hex(),
            "--command-fds",
            f"{cmd[0]},{cmd[1]}",
            "--event-fds",
            f"{evt[0]},{evt[1]}",
        ]
        # The worker maps the segment through its own fd copy (it closes it).
        worker.started.clear()
        if worker.state != pb.WORKER_STATE_RESTARTING:  # a restart stays RESTARTING until ready
            worker.state = pb.WORKER_STATE_STARTING
        worker.process = subprocess.Popen(argv, pass_fds=(*cmd, *evt), stdin=subprocess.DEVNULL)
        worker.pidfd = os.pidfd_open(worker.process.pid)
        assert self._loop is not None
        self._loop.add_reader(worker.pidfd, self._reap, worker)
        log.info("worker_spawned", worker=worker.index, pid=worker.process.pid, device=worker.device)

    def _reap(self, worker: WorkerHandle) -> None:
        """The pidfd became readable: the process exited."""
        assert self._loop is not None and worker.process is not None
        self._loop.remove_reader(worker.pidfd)
        os.close(worker.pidfd)
        worker.pidfd = -1
        code = worker.process.wait()
        had_weights = worker.store.state != pb.STORE_STATE_EMPTY or worker.lost
        self._fail_pending(worker, Unavailable("WORKER_DIED", f"worker {worker.index} exited with {code}", worker=worker.index))
        if self._stopping:
            worker.state = pb.WORKER_STATE_STOPPED
            return
        log.error("worker_died", worker=worker.index, exit_code=code, had_weights=had_weights)
        worker.state = pb.WORKER_STATE_RESTARTING
        worker.lost = had_weights
        worker.store = wpb.StoreStatus(state=pb.STORE_STATE_EMPTY)
        worker.restart_count += 1
        self._on_died(worker)
        # The dead worker may have left half a frame in either ring.
        worker.commands.reset()
        worker.events.reset()
        self._spawn(worker)

    def _fail_pending(self, worker: WorkerHandle, error: WeightSyncError) -> None:
        pending, worker.pending = worker.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def _drain_events(self, worker: WorkerHandle) -> None:
        worker.events.queue.clear_doorbell()
        while True:
            try:
                payload = worker.events.queue.try_get()
            except QueueCorrupted as error:
                log.error("event_queue_corrupted", worker=worker.index, error=str(error))
                self._kill(worker)
                return
            if payload is None:
                return
            event = wpb.WorkerEvent()
            try:
                event.ParseFromString(payload)
            except Exception:  # noqa: BLE001 - DecodeError; the frame passed its CRC
                log.error("event_unparseable", worker=worker.index, size=len(payload))
                self._kill(worker)
                return
            self._handle_event(worker, event)

    def _handle_event(self, worker: WorkerHandle, event: wpb.WorkerEvent) -> None:
        if event.HasField("store"):
            worker.store = event.store
            if worker.lost and event.store.state == pb.STORE_STATE_CONSISTENT:
                worker.lost = False
        if event.WhichOneof("event") == "started":
            worker.state = pb.WORKER_STATE_RUNNING
            worker.backend = event.started.backend
            worker.started.set()
            log.info("worker_ready", worker=worker.index, pid=event.started.pid)
            self._on_started(worker)
            return
        future = worker.pending.pop(event.command_id, None)
        if future is None or future.done():
            if self._stopping:
                return
            log.warning("event_unexpected", worker=worker.index, command_id=event.command_id)
            return
        future.set_result(event)

    def _kill(self, worker: WorkerHandle) -> None:
        if worker.process is not None and worker.process.poll() is None:
            worker.process.kill()

    # -- commands ------------------------------------------------------------------
    def submit(self, worker: WorkerHandle, **command: object) -> asyncio.Future[wpb.WorkerEvent]:
        """Enqueue one command now (synchronously, so commands keep their order)."""
        if worker.state != pb.WORKER_STATE_RUNNING:
            raise Unavailable(
                "WORKER_UNAVAILABLE",
                f"worker {worker.index} is {pb.WorkerState.Name(worker.state)}",
                worker=worker.index,
            )
        message = wpb.WorkerCommand(command_id=next(self._ids), **command)  # type: ignore[arg-type]
        if not worker.commands.queue.try_put(message.SerializeToString()):
            raise Unavailable("WORKER_QUEUE_FULL", f"worker {worker.index} is not draining its queue", worker=worker.index)
        assert self._loop is not None
        future: asyncio.Future[wpb.WorkerEvent] = self._loop.create_future()
        future.command_name = message.WhichOneof("command")  # type: ignore[attr-defined]
        worker.pending[message.command_id] = future
        return future

    async def result(self, worker: WorkerHandle, future: asyncio.Future[wpb.WorkerEvent], timeout: float) -> wpb.WorkerEvent:
        """Await a submitted command; CommandFailed becomes the domain error.

        A worker that does not answer in time is killed (its state is unknown)
        and restarted; the caller gets UNAVAILABLE.
        """
        name = getattr(future, "command_name", "command")
        try:
            event = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            log.error("worker_timeout", worker=worker.index, command=name)
            self._kill(worker)
            raise Unavailable(
                "WORKER_TIMEOUT",
                f"worker {worker.index} did not answer {name} within {timeout:g} s",
                worker=worker.index,
            ) from None
        if event.WhichOneof("event") == "command_failed":
            failed = event.command_failed
            error = error_from_code(failed.code, failed.reason, failed.message, dict(failed.metadata))
            error.broken_group_id = failed.broken_group_id  # type: ignore[attr-defined]
            error.worker_index = worker.index  # type: ignore[attr-defined]
            raise error
        return event

    async def call(self, worker: WorkerHandle, timeout: float, **command: object) -> wpb.WorkerEvent:
        """submit() then result()."""
        return await self.result(worker, self.submit(worker, **command), timeout)

    async def call_all(self, timeout: float, **command: object) -> list[wpb.WorkerEvent]:
        """The same command to every worker, concurrently; the first failure is raised
        after all have answered (so no worker is left mid-command)."""
        results = await asyncio.gather(
            *(self.call(w, timeout, **command) for w in self.workers), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    # -- shutdown ------------------------------------------------------------------
    async def stop(self) -> None:
        """Ask every worker to exit, kill the ones that don't, unlink every segment."""
        self._stopping = True
        for worker in self.workers:
            if worker.state == pb.WORKER_STATE_RUNNING:
                try:
                    worker.commands.queue.try_put(
                        wpb.WorkerCommand(command_id=next(self._ids), shutdown=wpb.ShutdownCommand()).SerializeToString()
                    )
                except ValueError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for worker in self.workers:
            process = worker.process
            if process is None:
                continue
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if process.poll() is None:
                log.warning("worker_killed_on_stop", worker=worker.index)
                process.send_signal(signal.SIGKILL)
                process.wait()
        assert self._loop is not None
        for worker in self.workers:
            if worker.pidfd >= 0:
                self._loop.remove_reader(worker.pidfd)
                os.close(worker.pidfd)
                worker.pidfd = -1
            self._fail_pending(worker, Unavailable("SERVER_STOPPING", "server is shutting down"))
            worker.state = pb.WORKER_STATE_STOPPED
            self._loop.remove_reader(worker.events.doorbell_fd)
            worker.commands.close()
            worker.events.close()
        log.info("workers_stopped")
