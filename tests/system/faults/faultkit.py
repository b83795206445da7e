"""Helpers for the fault-injection suite: tracked servers, a trainer subprocess, leak checks."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import ServerProcess, shm_segments, start_server

# Every group in this suite uses one collective/rendezvous timeout, so a fault that is not handled
# shows up as a slow test, not a hung one: long enough that a healthy rendezvous and push finish
# within it on a loaded host (4 s did not: a store's wait timed out at load 10-24), far below the
# clients' and servers' other bounds (30 s and more) that a fault must not wait for.
GROUP_TIMEOUT = 20.0
# Slack on top of GROUP_TIMEOUT for "within the timeout" assertions: as long again, so that such an
# assertion tells "at the group's timeout" from "at the next bound", not a fast host from a loaded one.
MARGIN = GROUP_TIMEOUT
TRAINER_SCRIPT = Path(__file__).with_name("trainer_proc.py")
TESTS_DIR = Path(__file__).resolve().parents[2]


def info(server: ServerProcess) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def groups(server: ServerProcess) -> list[pb.TransferGroup]:
    return list(server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups)


def group_state(server: ServerProcess, group_id: str) -> int | None:
    return next((g.state for g in groups(server) if g.group_id == group_id), None)


def delete_group(server: ServerProcess, group_id: str) -> None:
    server.stub().DeleteTransferGroup(pb.DeleteTransferGroupRequest(group_id=group_id), timeout=30)


def health(server: ServerProcess) -> int:
    stub = health_pb2_grpc.HealthStub(server.channel())
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def children(pid: int) -> set[int]:
    """Direct children of a process (every thread's)."""
    out: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie holds nothing but its pid)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "?")
    return state not in ("Z", "X")


def still_running(pids: set[int], timeout: float = 10.0) -> set[int]:
    """The pids still running after up to `timeout` seconds of polling (init reaps orphans lazily)."""
    deadline = time.monotonic() + timeout
    alive = {p for p in pids if running(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {p for p in alive if running(p)}
    return alive


@dataclass
class Tracked:
    """A server the suite started, with everything it must leave behind when stopped: nothing."""

    server: ServerProcess
    segments: set[str]
    pids: set[int] = field(default_factory=set)
    checked: bool = False

    def refresh(self) -> None:
        """Remember the server's current workers (and any other child, e.g. the resource tracker)."""
        if self.server.process.poll() is None:
            self.pids.update(children(self.server.process.pid))
            try:
                self.pids.update(w.pid for w in info(self.server).workers if w.pid)
            except grpc.RpcError:
                pass

    def leaks_after_exit(self) -> list[str]:
        """Call once the server process has exited (and was reaped)."""
        problems = []
        alive = still_running(self.pids | {self.server.process.pid})
        if alive:
            problems.append(f"{self.server.address}: processes still running after exit: {sorted(alive)}")
        left = {s for s in self.segments if (Path("/dev/shm") / s).exists()}
        if left:
            problems.append(f"{self.server.address}: shared-memory segments left: {sorted(left)}")
        self.checked = True
        return problems

    def orphaned_workers(self) -> set[int]:
        """Pids this (running) server had but replaced (a killed worker): they must be gone."""
        current = children(self.server.process.pid)
        return still_running(self.pids - current, timeout=5.0)


# Servers started by the suite, in start order (module-scoped ones included).
TRACKED: list[Tracked] = []
# Helper subprocesses (trainers) started by the current test.
HELPERS: list[subprocess.Popen] = []


def start_tracked_server(tmp_path: Path, *extra: str, workers: int = 2) -> ServerProcess:
    server = start_server(tmp_path, *extra, workers=workers)
    segments = server.segments()
    assert len(segments) == 2 * workers, segments  # a command and an event queue per worker
    assert not segments & shm_segments()  # unlinked at creation; only the mappings hold them
    tracked = Tracked(server, segments)
    tracked.refresh()
    assert len(tracked.pids) >= workers
    TRACKED.append(tracked)
    return server


def tracked(server: ServerProcess) -> Tracked:
    return next(t for t in TRACKED if t.server is server)


def stop_and_check(server: ServerProcess, sig: int = signal.SIGTERM) -> list[str]:
    entry = tracked(server)
    entry.refresh()
    code = server.stop(sig)
    problems = entry.leaks_after_exit()
    if sig == signal.SIGTERM and code != 0:
        problems.append(f"{server.address} exited {code}:\n{server.log()[-3000:]}")
    return problems


# -- a trainer in its own process -------------------------------------------------------------
class TrainerProcess:
    """tests/system/faults/trainer_proc.py in a subprocess; its JSON-line events are read by a thread."""

    def __init__(self, server: ServerProcess, *, stop: str, mode: str, group_id: str | None = None,
                 seeds: tuple[int, int] = (1, 2), log_dir: Path | None = None) -> None:
        self.group_id = group_id or f"proc-{uuid.uuid4().hex[:8]}"
        argv = [sys.executable, str(TRAINER_SCRIPT), "--address", server.address, "--group-id", self.group_id,
                "--timeout", str(GROUP_TIMEOUT), "--mode", mode, "--stop", stop,
                "--seeds", f"{seeds[0]},{seeds[1]}"]
        self._stderr_path = (log_dir or Path("/tmp")) / f"trainer-{self.group_id}.err"
        self._stderr = open(self._stderr_path, "wb")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL,
                                        cwd=str(TESTS_DIR.parent))
        HELPERS.append(self.process)
        self.events: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                continue
        self.events.put({"event": "exit"})

    def expect(self, event: str, timeout: float = 90.0) -> dict:
        """The next events until `event`; fails on exit or timeout (with the trainer's stderr)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"trainer: no {event!r} in {timeout:g} s\n{self.stderr()}") from None
            if got["event"] == event:
                return got
            if got["event"] in ("exit", "error"):
                raise AssertionError(f"trainer ended before {event!r}: {got}\n{self.stderr()}")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.wait()

    def wait(self, timeout: float = 30.0) -> int:
        code = self.process.wait(timeout)
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()
        return code

    def stderr(self) -> str:
        try:
            return self._stderr_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

