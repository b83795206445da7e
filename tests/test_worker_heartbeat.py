"""A busy worker is not a stalled one: a worker process keeps beating while it allocates
and pre-faults a large store.

Before: pre-faulting went through mmap.madvise, which holds the GIL for the whole call, so
the heartbeat thread went silent for seconds (3.4 s for a 1.2 GB push to two workers) and
the server failed a healthy push with WORKER_UNAVAILABLE.

The worker runs as the server runs it (python -m weightsync.gpu_worker, queues handed over
as descriptors); this test plays the server's side of the queues.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weightsync.common.shm_queue import OwnedQueue
from weightsync.server.supervisor import UNRESPONSIVE_AFTER_SECONDS
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

pytestmark = pytest.mark.timeout(180)
STORE_BYTES = 2 << 30
"""Large enough that pre-faulting takes seconds on this host (about 3 s holding the GIL before)."""


class WorkerProcess:
    def __init__(self) -> None:
        self.commands, self.events = OwnedQueue(1 << 20), OwnedQueue(1 << 20)
        config = wpb.WorkerConfig(index=0, device="cpu", log_level="warning", queue_capacity_bytes=1 << 20,
                                  parent_pid=os.getpid())
        cmd = (self.commands.segment_fd, self.commands.doorbell_fd)
        evt = (self.events.segment_fd, self.events.doorbell_fd)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "weightsync.gpu_worker", "--config-hex", config.SerializeToString().hex(),
             "--command-fds", f"{cmd[0]},{cmd[1]}", "--event-fds", f"{evt[0]},{evt[1]}"],
            pass_fds=(*cmd, *evt), stdin=subprocess.DEVNULL,
        )
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
        self.commands.close()
        self.events.close()
        return code


@pytest.fixture
def worker():
    process = WorkerProcess()
    yield process
    assert process.stop() == 0


def test_a_worker_keeps_beating_while_it_allocates_a_large_store(worker):
    assert worker.event().WhichOneof("event") == "started"
    plan = tensor_pb2.WeightPlan()
    bucket = plan.buckets.add(size_bytes=STORE_BYTES)
    bucket.tensors.add(name="big", dtype=tensor_pb2.DTYPE_UINT8, shape=[STORE_BYTES], offset_bytes=0,
                       size_bytes=STORE_BYTES)
    worker.send(prepare_update=wpb.PrepareUpdateCommand(update_id="u", plan=plan, mode=pb.UPDATE_MODE_IN_PLACE,
                                                        allow_new_tensors=True))
    prepared = worker.event()
    assert prepared.update_prepared.needed_bytes >= STORE_BYTES, prepared
    assert prepared.store.state == pb.STORE_STATE_EMPTY  # sized, nothing allocated yet

    allocating = worker.send(allocate_update=wpb.AllocateUpdateCommand(update_id="u"))
    oldest = 0.0
    done = None
    while done is None:
        age = worker.commands.queue.seconds_since_beat()
        assert age is not None
        oldest = max(oldest, age)
        payload = worker.events.queue.get(timeout=0.02)
        if payload is not None:
            done = wpb.WorkerEvent.FromString(payload)
    assert done.command_id == allocating and done.WhichOneof("event") == "update_prepared", done
    assert done.store.state == pb.STORE_STATE_UPDATING
    # What the server's supervisor would have seen: never a heartbeat old enough to call it stalled.
    assert oldest < UNRESPONSIVE_AFTER_SECONDS, f"the heartbeat went silent for {oldest:.1f} s while allocating"

    worker.send(abort_update=wpb.AbortUpdateCommand(update_id="u"))
    aborted = worker.event()
    assert aborted.WhichOneof("event") == "update_aborted" and aborted.store.state == pb.STORE_STATE_EMPTY
