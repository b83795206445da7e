"""A CUDA worker gives its device staging back: at an abort, and when a group is deleted with no update
in flight (docs/architecture.md); a committed update keeps it for the next one.

No GPU here: the worker is configured for cuda:0 (nothing touches the device until a command needs
it), and its device lane holds two host tensors in place of the two device staging buffers. What is
checked is what the worker's command handling does with them, as GetServerInfo would report it
(`staging_bytes`). tests/gpu/test_gpu_paths.py checks the device memory itself on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from weightsync.common.shm_queue import OwnedQueue
from weightsync.gpu_worker.worker import Worker
from weightsync.worker.v1 import worker_pb2 as wpb

SLOT_BYTES = 4096


class Harness:
    def __init__(self) -> None:
        self.commands, self.events = OwnedQueue(1 << 16), OwnedQueue(1 << 16)
        config = wpb.WorkerConfig(index=0, device="cuda:0", queue_capacity_bytes=1 << 16, parent_pid=os.getpid())
        self.worker = Worker(config, self.commands.queue, self.events.queue, None)
        self.ids = iter(range(1, 1000))

    def hold_staging(self) -> None:
        """What a prepare on an NCCL group leaves: the lane's two buffers (host stand-ins here)."""
        lane = self.worker.receiver.lane
        assert lane is not None, "a cuda:N worker has a device lane"
        lane.slots = [torch.zeros(SLOT_BYTES, dtype=torch.uint8) for _ in range(2)]

    def send(self, **command) -> wpb.WorkerEvent:
        payload = wpb.WorkerCommand(command_id=next(self.ids), **command).SerializeToString()
        self.worker._dispatch(payload)
        event = wpb.WorkerEvent.FromString(self.events.queue.get(timeout=5))
        assert event.WhichOneof("event") != "command_failed", event.command_failed
        return event

    def prepare(self, update_id: str) -> wpb.WorkerEvent:
        return self.send(prepare_update=wpb.PrepareUpdateCommand(update_id=update_id, staged=False))

    def close(self) -> None:
        self.commands.close()
        self.events.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def test_an_abort_gives_the_device_staging_back(harness):
    harness.hold_staging()
    prepared = harness.prepare("u1")
    assert prepared.update_prepared.staging_bytes == 2 * SLOT_BYTES
    aborted = harness.send(abort_update=wpb.AbortUpdateCommand(update_id="u1"))
    assert aborted.update_aborted.update_id == "u1"
    assert aborted.status.staging_bytes == 0
    assert harness.worker.receiver.lane.slots == []
    # The next update goes on as usual.
    assert harness.prepare("u2").update_prepared.update_id == "u2"
    assert harness.send(commit_update=wpb.CommitUpdateCommand(update_id="u2")).update_committed.update_id == "u2"


def test_a_committed_update_keeps_the_staging_for_the_next_one(harness):
    harness.hold_staging()
    harness.prepare("u1")
    committed = harness.send(commit_update=wpb.CommitUpdateCommand(update_id="u1"))
    assert committed.status.staging_bytes == 2 * SLOT_BYTES


def test_deleting_a_group_gives_the_staging_back_once_no_update_runs(harness):
    harness.hold_staging()
    harness.prepare("u1")  # an update not of that group (INLINE) is in flight: the staging stays
    left = harness.send(leave_group=wpb.LeaveGroupCommand(group_id="g"))
    assert left.group_left.group_id == "g" and left.status.staging_bytes == 2 * SLOT_BYTES
    harness.send(commit_update=wpb.CommitUpdateCommand(update_id="u1"))
    left = harness.send(leave_group=wpb.LeaveGroupCommand(group_id="g2"))
    assert left.group_left.group_id == "g2" and left.status.staging_bytes == 0
    assert harness.prepare("u2").update_prepared.update_id == "u2"
    assert harness.send(commit_update=wpb.CommitUpdateCommand(update_id="u2")).update_committed.update_id == "u2"
