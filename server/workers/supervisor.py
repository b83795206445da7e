"""Spawns the worker processes and talks to them through shared-memory queues.

The asyncio loop never blocks on a worker: commands go into a ring, events
come back through an eventfd the loop watches, and each worker's exit is seen
through a pidfd the loop also watches, so it is noticed at once. A heartbeat
in the command ring (written by a thread of the worker) tells a stopped or
wedged worker from one that sits in a long collective.

A dead worker is restarted with backoff. The node's store is the server's
(server/store/node_store.py), so nothing is lost: the new process maps the store's arenas
when it is next given something to write.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from weightsync.common import numba_cache
from weightsync.common.errors import Unavailable, WeightSyncError, error_from_code
from weightsync.common.fd_passing import send_fds
from weightsync.common.logging import get_logger
from weightsync.common.shm_queue import OwnedQueue, QueueCorrupted
from weightsync.gpu_worker.device_faults import EXIT_DEVICE_LOST
from weightsync.server.store.arenas import HostArena, map_timeout
from weightsync.server.store.ingress import Ingress
from weightsync.server.tasks import supervised
from weightsync.server.workers.worker_fleet import FanOut
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.supervisor")

STARTUP_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 5.0
UNRESPONSIVE_AFTER_SECONDS = 3.0
"""A worker whose heartbeat is older than this is UNRESPONSIVE (it beats every 0.25 s)."""
WATCH_INTERVAL_SECONDS = 0.5
STABLE_AFTER_SECONDS = 10.0
"""A worker that ran this long before dying restarts at once; quicker deaths back off."""
MAX_BACKOFF_SECONDS = 30.0


def restart_delay(exit_code: int, quick_failures: int) -> float:
    """How long to wait before restarting a worker that exited: at once the first time, then
    doubling for deaths in quick succession; a worker whose device is gone (EXIT_DEVICE_LOST)
    waits the longest from the first time, so a missing GPU is retried, never crash-looped."""
    if exit_code == EXIT_DEVICE_LOST:
        return MAX_BACKOFF_SECONDS
    return 0.0 if quick_failures <= 1 else min(0.5 * 2 ** (quick_failures - 2), MAX_BACKOFF_SECONDS)


@dataclass(slots=True)
class WorkerHandle:
    """The server's view of one worker process."""

    index: int
    device: str
    commands: OwnedQueue
    events: OwnedQueue
    process: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    channel: socket.socket | None = None
    """The server's end of the fd channel (the node store's arena descriptors go this way)."""
    state: int = pb.WORKER_STATE_STARTING
    status: wpb.WorkerStatus = field(default_factory=wpb.WorkerStatus)
    """What the worker last reported of itself (staging, bytes received, device memory)."""
    mapped: set[int] = field(default_factory=set)
    """Arenas this worker process was sent (a restarted one starts with none)."""
    backend: int = pb.BACKEND_UNSPECIFIED
    device_uuid: str = ""
    """The GPU's UUID as the worker reported it at start (empty: CPU)."""
    restart_count: int = 0
    quick_failures: int = 0
    ready_at: float = 0.0
    pending: dict[int, asyncio.Future[wpb.WorkerEvent]] = field(default_factory=dict)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        alive = self.state in (pb.WORKER_STATE_RUNNING, pb.WORKER_STATE_UNRESPONSIVE)
        return self.process.pid if self.process is not None and alive else 0

    @property
    def host_memory(self) -> bool:
        return self.device == "cpu"

    @property
    def alive(self) -> bool:
        """The process runs and takes commands (an UNRESPONSIVE one may only be slow: it queues them)."""
        return self.state in (pb.WORKER_STATE_RUNNING, pb.WORKER_STATE_UNRESPONSIVE)



class Supervisor:
    """Owns every worker process, its two queues and its fd channel."""

    def __init__(
        self,
        devices: tuple[str, ...],
        *,
        queue_capacity_bytes: int,
        log_level: str,
        memory_limit_bytes: int,
        on_worker_died: Callable[[WorkerHandle], None],
        on_worker_started: Callable[[WorkerHandle], None],
        on_worker_unresponsive: Callable[[WorkerHandle], None] = lambda worker: None,
        ingress: Ingress | None = None,
    ) -> None:
        self._ingress = ingress
        self._queue_capacity = queue_capacity_bytes
        self._log_level = log_level
        self._memory_limit = memory_limit_bytes
        self._on_died = on_worker_died
        self._on_started = on_worker_started
        self._on_unresponsive = on_worker_unresponsive
        self._ids = itertools.count(1)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: asyncio.Task[None] | None = None
        self._respawns: dict[int, asyncio.TimerHandle] = {}
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
        self._watch = asyncio.ensure_future(supervised("heartbeat_watch", self._watch_heartbeats))
        # The numba kernels, compiled (if the cache lacks them) by a child process while the workers start, not
        # by a worker (its heartbeat would stop) nor by a first push (it would wait): common/numba_cache.py.
        compiling = asyncio.ensure_future(numba_cache.compile_ahead())
        try:
            await self.wait_started()
            await compiling
        finally:
            compiling.cancel()

    async def wait_started(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
        await asyncio.wait_for(asyncio.gather(*(w.started.wait() for w in self.workers)), timeout)

    @property
    def all_running(self) -> bool:
        return all(w.state == pb.WORKER_STATE_RUNNING for w in self.workers)

    def _spawn(self, worker: WorkerHandle) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        config = wpb.WorkerConfig(
            index=worker.index,
            device=worker.device,
            log_level=self._log_level,
            queue_capacity_bytes=self._queue_capacity,
            parent_pid=os.getpid(),
            memory_limit_bytes=self._memory_limit,
            fd_channel=theirs.fileno(),
            ingress_fd=self._ingress.fd if self._ingress is not None else 0,
            ingress_bytes=self._ingress.size_bytes if self._ingress is not None else 0,
        )
        cmd = (worker.commands.segment_fd, worker.commands.doorbell_fd)
        evt = (worker.events.segment_fd, worker.events.doorbell_fd)
        argv = [
            sys.executable, "-m", "weightsync.gpu_worker",
            "--config-hex", config.SerializeToString().hex(),
            "--command-fds", f"{cmd[0]},{cmd[1]}",
            "--event-fds", f"{evt[0]},{evt[1]}",
        ]
        worker.started.clear()
        if worker.state != pb.WORKER_STATE_RESTARTING:  # a restart stays RESTARTING until ready
            worker.state = pb.WORKER_STATE_STARTING
        try:
            process = subprocess.Popen(
                argv, pass_fds=(*cmd, *evt, theirs.fileno(), *self._ingress_fds()),
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()  # the child has its copy; EOF on ours means it is gone
        try:
            pidfd = os.pidfd_open(process.pid)
        except OSError:
            process.kill()  # a worker nobody could see exit must not run
            process.wait()
            ours.close()
            raise
        worker.process = process
        worker.mapped = set()
        if worker.channel is not None:
            worker.channel.close()
        worker.channel = ours
        worker.pidfd = pidfd
        assert self._loop is not None
        self._loop.add_reader(worker.pidfd, self._reap, worker)
        log.info("worker_spawned", worker=worker.index, pid=worker.process.pid, device=worker.device)

    def _ingress_fds(self) -> tuple[int, ...]:
        return (self._ingress.fd,) if self._ingress is not None else ()

    def _reap(self, worker: WorkerHandle) -> None:
        """The pidfd became readable: the process exited."""
        assert self._loop is not None and worker.process is not None
        self._loop.remove_reader(worker.pidfd)
        os.close(worker.pidfd)
        worker.pidfd = -1
        code = worker.process.wait()
        self._fail_pending(worker, Unavailable("WORKER_DIED", f"worker {worker.index} exited with {code}", worker=worker.index))
        if self._stopping:
            worker.state = pb.WORKER_STATE_STOPPED
            return
        log.error("worker_died", worker=worker.index, exit_code=code)
        worker.state = pb.WORKER_STATE_RESTARTING
        worker.mapped = set()
        worker.restart_count += 1
        quick = worker.ready_at == 0.0 or time.monotonic() - worker.ready_at < STABLE_AFTER_SECONDS
        worker.quick_failures = worker.quick_failures + 1 if quick else 0
        worker.ready_at = 0.0
        self._on_died(worker)
        # The dead worker may have left half a frame in either ring.
        worker.commands.reset()
        worker.events.reset()
        delay = restart_delay(code, worker.quick_failures)
        if delay:
            log.warning("worker_restart_backoff", worker=worker.index, seconds=delay, failures=worker.quick_failures)
        self._respawns[worker.index] = self._loop.call_later(delay, self._respawn, worker)

    def _respawn(self, worker: WorkerHandle) -> None:
        self._respawns.pop(worker.index, None)
        if self._stopping:
            return
        try:
            self._spawn(worker)
        except OSError as error:  # Popen or pidfd_open: out of processes, memory, descriptors
            worker.quick_failures += 1
            delay = min(0.5 * 2 ** worker.quick_failures, MAX_BACKOFF_SECONDS)
            log.error("worker_respawn_failed", worker=worker.index, error=str(error), retry_in_seconds=delay)
            assert self._loop is not None
            self._respawns[worker.index] = self._loop.call_later(delay, self._respawn, worker)

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
        if worker.state == pb.WORKER_STATE_UNRESPONSIVE:
            self._responsive_again(worker)  # it answered: alive, whatever its heartbeat said a moment ago
        if event.HasField("status"):
            worker.status = event.status
        kind = event.WhichOneof("event")
        if kind == "started":
            worker.backend = event.started.backend
            worker.device_uuid = event.started.device_uuid
            log.info("worker_ready", worker=worker.index, pid=event.started.pid)
            self._mark_running(worker)
            return
        future = worker.pending.pop(event.command_id, None)
        if future is None or future.done():
            if not self._stopping:
                log.warning("event_unexpected", worker=worker.index, command_id=event.command_id)
            return
        future.set_result(event)

    def _mark_running(self, worker: WorkerHandle) -> None:
        worker.state = pb.WORKER_STATE_RUNNING
        worker.ready_at = time.monotonic()
        worker.started.set()
        self._on_started(worker)

    def _kill(self, worker: WorkerHandle) -> None:
        if worker.process is not None and worker.process.poll() is None:
            worker.process.kill()

    async def _watch_heartbeats(self) -> None:
        while not self._stopping:
            await asyncio.sleep(WATCH_INTERVAL_SECONDS)
            for worker in self.workers:
                if worker.state not in (pb.WORKER_STATE_RUNNING, pb.WORKER_STATE_UNRESPONSIVE):
                    continue
                silent = worker.commands.queue.seconds_since_beat()
                stalled = silent is not None and silent > UNRESPONSIVE_AFTER_SECONDS
                if stalled and worker.state == pb.WORKER_STATE_RUNNING:
                    worker.state = pb.WORKER_STATE_UNRESPONSIVE
                    log.error("worker_unresponsive", worker=worker.index, silent_seconds=round(silent or 0, 1))
                    self._on_unresponsive(worker)
                elif not stalled and worker.state == pb.WORKER_STATE_UNRESPONSIVE:
                    self._responsive_again(worker)

    def _responsive_again(self, worker: WorkerHandle) -> None:
        log.info("worker_responsive_again", worker=worker.index)
        worker.state = pb.WORKER_STATE_RUNNING
        self._on_started(worker)

    # -- the node store's arenas ---------------------------------------------------------
    async def map_arenas(self, worker: WorkerHandle, arenas: list[HostArena], timeout: float) -> None:
        """Make sure this worker process maps these arenas: their descriptors go over its fd channel,
        then the command that names them (in that order, so the worker finds them there). The wait
        grows with the bytes to map (map_timeout): faulting in or pinning a large store takes time
        in proportion, and a fixed bound would kill a worker that maps a large model, again and
        again at every restart."""
        missing = [a for a in arenas if a.arena_id not in worker.mapped]
        if not missing:
            return
        if worker.channel is None or not worker.alive:
            raise Unavailable("WORKER_UNAVAILABLE", f"worker {worker.index} is {pb.WorkerState.Name(worker.state)}",
                              worker=worker.index)
        command = wpb.MapArenasCommand(arenas=[wpb.ArenaSpec(arena_id=a.arena_id, size_bytes=a.size_bytes)
                                               for a in missing])
        send_fds(worker.channel, [a.fd for a in missing])
        incarnation = worker.restart_count
        await self.call(worker, map_timeout(timeout, sum(a.size_bytes for a in missing)), map_arenas=command)
        if worker.restart_count == incarnation:
            worker.mapped.update(a.arena_id for a in missing)

    def forget_arenas(self, arena_ids: list[int]) -> None:
        """Arenas the store released: unmapped wherever they were mapped (fire and forget: a worker that
        misses it holds a mapping of freed memory until it restarts, and never writes there)."""
        for worker in self.workers:
            gone = worker.mapped & set(arena_ids)
            if gone and worker.alive:
                worker.mapped -= gone
                future = self.submit_or_refusal(worker, unmap_arenas=wpb.UnmapArenasCommand(arena_ids=sorted(gone)))
                future.add_done_callback(lambda done: done.cancelled() or done.exception())

    # -- commands ------------------------------------------------------------------
    def submit(self, worker: WorkerHandle, **command: object) -> asyncio.Future[wpb.WorkerEvent]:
        """Enqueue one command now (synchronously, so commands keep their order)."""
        if not worker.alive:
            raise Unavailable(
                "WORKER_UNAVAILABLE",
                f"worker {worker.index} is {pb.WorkerState.Name(worker.state)}",
                worker=worker.index,
            )
        message = wpb.WorkerCommand(command_id=next(self._ids), sent_monotonic_ns=time.monotonic_ns(),
                                    **command)  # type: ignore[arg-type]
        if not worker.commands.queue.try_put(message.SerializeToString()):
            raise Unavailable("WORKER_QUEUE_FULL", f"worker {worker.index} is not draining its queue", worker=worker.index)
        assert self._loop is not None
        future: asyncio.Future[wpb.WorkerEvent] = self._loop.create_future()
        future.command_name = message.WhichOneof("command")  # type: ignore[attr-defined]
        worker.pending[message.command_id] = future
        return future

    async def result(self, worker: WorkerHandle, future: asyncio.Future[wpb.WorkerEvent], timeout: float) -> wpb.WorkerEvent:
        """Await a submitted command; CommandFailed becomes the domain error.

        A worker that does not answer in time is killed (its state is unknown;
        its host-memory store survives) and restarted; the caller gets UNAVAILABLE.
        """
        name = getattr(future, "command_name", "command")
        try:
            event = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            stalled = worker.state == pb.WORKER_STATE_UNRESPONSIVE
            log.error("worker_timeout", worker=worker.index, command=name, unresponsive=stalled)
            self._kill(worker)
            raise Unavailable(
                "WORKER_UNRESPONSIVE" if stalled else "WORKER_TIMEOUT",
                f"worker {worker.index} did not answer {name} within {timeout:g} s"
                + (" (its heartbeat had stopped)" if stalled else ""),
                worker=worker.index,
            ) from None
        if event.WhichOneof("event") == "command_failed":
            failed = event.command_failed
            error = error_from_code(failed.code, failed.reason, failed.message, dict(failed.metadata))
            error.broken_group_id = failed.broken_group_id
            error.worker_index = worker.index
            error.store_touched = failed.store_touched
            raise error
        return event

    async def call(self, worker: WorkerHandle, timeout: float, **command: object) -> wpb.WorkerEvent:
        """submit() then result()."""
        return await self.result(worker, self.submit(worker, **command), timeout)

    async def call_all(self, timeout: float, **command: object) -> list[wpb.WorkerEvent]:
        """The same command to every worker; the first failure is raised after all answered."""
        return (await self.fan_out(timeout, **command)).events

    def alive_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.alive]

    async def fan_out(self, timeout: float, workers: list[WorkerHandle] | None = None,
                      command_for: Callable[[WorkerHandle], dict[str, object]] | None = None,
                      **command: object) -> FanOut:
        """One command to each of `workers` (default: all), concurrently; `command_for` gives a
        worker its own command. Every answer is collected, errors included."""
        targets = self.workers if workers is None else workers
        return await self.settle(
            [(w, self.submit_or_refusal(w, **(command_for(w) if command_for else command))) for w in targets], timeout)

    def submit_or_refusal(self, worker: WorkerHandle, **command: object) -> asyncio.Future[wpb.WorkerEvent]:
        try:
            return self.submit(worker, **command)
        except WeightSyncError as error:
            assert self._loop is not None
            refused: asyncio.Future[wpb.WorkerEvent] = self._loop.create_future()
            refused.set_exception(error)
            return refused

    async def settle(self, submitted: list[tuple[WorkerHandle, asyncio.Future[wpb.WorkerEvent]]],
                     timeout: float) -> FanOut:
        """Await already submitted commands (see result()), every one of them."""
        results = await asyncio.gather(*(self.result(w, f, timeout) for w, f in submitted), return_exceptions=True)
        return FanOut(list(zip((w for w, _ in submitted), results, strict=True)))

    # -- shutdown ------------------------------------------------------------------
    async def stop(self) -> None:
        """Ask every worker to exit, kill the ones that don't, release every segment and arena."""
        self._stopping = True
        if self._loop is None:  # stopped before it started: only the rings exist
            for worker in self.workers:
                worker.commands.close()
                worker.events.close()
            return
        if self._watch is not None:
            self._watch.cancel()
        for handle in self._respawns.values():
            handle.cancel()
        self._respawns.clear()
        for worker in self.workers:
            if worker.state in (pb.WORKER_STATE_RUNNING, pb.WORKER_STATE_UNRESPONSIVE):
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
            if worker.channel is not None:
                worker.channel.close()
                worker.channel = None
        log.info("workers_stopped")
