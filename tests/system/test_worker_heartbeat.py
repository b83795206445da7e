"""A busy worker is not a stalled one: a worker process keeps beating while it maps and
pre-faults a large arena of the node's store.

Before: pre-faulting went through mmap.madvise, which holds the GIL for the whole call, so
the heartbeat thread went silent for seconds (3.4 s for a 1.2 GB push to two workers) and
the server failed a healthy push with WORKER_UNAVAILABLE.

The worker runs as the server runs it (python -m weightsync.gpu_worker, queues handed over
as descriptors); this test plays the server's side of the queues.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from weightsync.common.fd_passing import send_fds
from weightsync.common.shm_queue import OwnedQueue
from weightsync.server.workers.supervisor import UNRESPONSIVE_AFTER_SECONDS
from weightsync.worker.v1 import worker_pb2 as wpb

pytestmark = pytest.mark.timeout(180)
STORE_BYTES = 2 << 30
"""Large enough that pre-faulting takes seconds on this host (about 3 s holding the GIL before)."""


class WorkerProcess:
    def __init__(self) -> None:
        self.commands, self.events = OwnedQueue(1 << 20), OwnedQueue(1 << 20)
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = wpb.WorkerConfig(index=0, device="cpu", log_level="warning", queue_capacity_bytes=1 << 20,
                                  parent_pid=os.getpid(), fd_channel=theirs.fileno())
        cmd = (self.commands.segment_fd, self.commands.doorbell_fd)
        evt = (self.events.segment_fd, self.events.doorbell_fd)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "weightsync.gpu_worker", "--config-hex", config.SerializeToString().hex(),
             "--command-fds", f"{cmd[0]},{cmd[1]}", "--event-fds", f"{evt[0]},{evt[1]}"],
            pass_fds=(*cmd, *evt, theirs.fileno()), stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.next_id = 0

    def event(self, timeout: float = 60.0) -> wpb.WorkerEvent:
        payload = self.events.queue.get(timeout=timeout)
        assert payload is not None, "the worker sent nothing"
        event = wpb.WorkerEvent()
        event.ParseFromString(payload)
        return event

    def send(self, **command) -> int:
        self.next_id += 1
        self.commands.queue.put(wpb.WorkerCommand(command_id=self.next_id, **command).SerializeToString(), timeout=10)
        return self.next_id

    def stop(self) -> int:
        if self.process.poll() is None:
            self.send(shutdown=wpb.ShutdownCommand())
        code = self.process.wait(timeout=60)
        self.channel.close()
        self.commands.close()
        self.events.close()
        return code


@pytest.fixture
def worker():
    process = WorkerProcess()
    yield process
    assert process.stop() == 0


def test_a_worker_keeps_beating_while_it_maps_a_large_arena(worker):
    assert worker.event().WhichOneof("event") == "started"
    fd = os.memfd_create("arena")
    os.ftruncate(fd, STORE_BYTES)
    os.posix_fallocate(fd, 0, STORE_BYTES)  # what the server does: the pages exist, the worker faults them in
    send_fds(worker.channel, [fd])
    os.close(fd)
    mapping = worker.send(map_arenas=wpb.MapArenasCommand(arenas=[wpb.ArenaSpec(arena_id=1, size_bytes=STORE_BYTES)]))
    oldest = 0.0
    done = None
    while done is None:
        age = worker.commands.queue.seconds_since_beat()
        assert age is not None
        oldest = max(oldest, age)
        payload = worker.events.queue.get(timeout=0.02)
        if payload is not None:
            done = wpb.WorkerEvent.FromString(payload)
    assert done.command_id == mapping and list(done.arenas_mapped.arena_ids) == [1], done
    # What the server's supervisor would have seen: never a heartbeat old enough to call it stalled.
    assert oldest < UNRESPONSIVE_AFTER_SECONDS, f"the heartbeat went silent for {oldest:.1f} s while mapping"

    worker.send(unmap_arenas=wpb.UnmapArenasCommand(arena_ids=[1]))
    unmapped = worker.event()
    assert unmapped.WhichOneof("event") == "arenas_mapped" and not unmapped.arenas_mapped.arena_ids
