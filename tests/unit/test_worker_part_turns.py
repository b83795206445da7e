"""A worker's receives of a COLLECTIVE update of several parts, through its command handling (no processes, a
fake Gloo group): whatever order the receive commands arrive in, it receives point-to-point from each bucket's
part (source rank, tag = the bucket's index in that part's plan) in the one global order (bucket index, then
part rank: common/receive_order.py), answering each when it ran; a receive still held when the update is
aborted, or for longer than the group's timeout, is answered COLLECTIVE_FAILED / COLLECTIVE_TIMEOUT and the
worker leaves the group (a part's send to it may be pending)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator

import pytest
import torch

from weightsync.common.collective import CollectiveGroup, bucket_tail
from weightsync.common.shm_queue import OwnedQueue
from weightsync.gpu_worker.worker import Worker
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

SIZE = 32
LANES = [0, 2]
"""Part 0's buckets are the store's 0 and 1, part 1's 2 and 3; this worker owns all four."""


def payload_of(sequence: int) -> torch.Tensor:
    return torch.arange(SIZE, dtype=torch.uint8) + 10 * sequence


class Work:
    def wait(self, timeout=None) -> bool:
        return True


class FakeGloo:
    """Receives fill the buffer with the bucket the (source, tag) pair names; every receive is recorded."""

    def __init__(self) -> None:
        self.received: list[tuple[int, int]] = []

    def recv(self, tensors, source: int, tag: int) -> Work:
        self.received.append((source, tag))
        tensors[0].copy_(payload_of(LANES[source] + tag))
        return Work()


class Harness:
    def __init__(self, timeout: float = 60.0) -> None:
        self.commands, self.events = OwnedQueue(1 << 16), OwnedQueue(1 << 16)
        config = wpb.WorkerConfig(index=0, device="cpu", queue_capacity_bytes=1 << 16, parent_pid=os.getpid())
        self.worker = Worker(config, self.commands.queue, self.events.queue, None)
        self.pg = FakeGloo()
        self.worker.groups.groups["g"] = CollectiveGroup("g", pb.BACKEND_GLOO, 2, 4,
                                                         datetime.timedelta(seconds=timeout), torch.device("cpu"),
                                                         self.pg, trainer_ranks=2)
        self.ids = iter(range(1, 1000))

    def dispatch(self, **command) -> int:
        command_id = next(self.ids)
        self.worker._dispatch(wpb.WorkerCommand(command_id=command_id, **command).SerializeToString())
        return command_id

    def answers(self) -> list[wpb.WorkerEvent]:
        out = []
        while (raw := self.events.queue.get(timeout=0.05)) is not None:
            out.append(wpb.WorkerEvent.FromString(raw))
        return out

    def prepare(self) -> None:
        buckets = [wpb.OwnedBucket(sequence=s, size_bytes=SIZE) for s in range(4)]
        self.dispatch(prepare_update=wpb.PrepareUpdateCommand(update_id="u", group_id="g", lane_starts=LANES,
                                                              buckets=buckets, largest_bucket_bytes=SIZE))
        assert [e.WhichOneof("event") for e in self.answers()] == ["update_prepared"]

    def receive(self, sequence: int) -> int:
        part = 1 if sequence >= LANES[1] else 0
        return self.dispatch(receive_bucket=wpb.ReceiveBucketCommand(
            update_id="u", sequence=sequence, size_bytes=SIZE, tail=bucket_tail(payload_of(sequence)),
            source_rank=part, source_sequence=sequence - LANES[part]))

    def close(self) -> None:
        self.commands.close()
        self.events.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def test_receives_run_in_the_global_order_whatever_order_they_arrive_in(harness):
    harness.prepare()
    ids = {s: harness.receive(s) for s in (2, 3)}  # part 1's announcements came first: both wait their turn
    assert harness.answers() == [] and harness.pg.received == []
    ids[0] = harness.receive(0)  # part 0's bucket 0, then part 1's bucket 0 (its turn came)
    assert [(e.command_id, e.bucket_received.sequence) for e in harness.answers()] == [(ids[0], 0), (ids[2], 2)]
    ids[1] = harness.receive(1)
    assert [(e.command_id, e.bucket_received.sequence) for e in harness.answers()] == [(ids[1], 1), (ids[3], 3)]
    # From each bucket's part, under its own plan's index: (source rank, tag), in the global order.
    assert harness.pg.received == [(0, 0), (1, 0), (0, 1), (1, 1)]
    harness.dispatch(commit_update=wpb.CommitUpdateCommand(update_id="u"))
    assert [e.WhichOneof("event") for e in harness.answers()] == ["update_committed"]


def test_a_receive_held_at_the_abort_fails_and_the_worker_leaves_the_group(harness):
    harness.prepare()
    held = harness.receive(2)
    assert harness.answers() == []
    harness.dispatch(abort_update=wpb.AbortUpdateCommand(update_id="u"))
    failed, aborted = harness.answers()
    assert failed.command_id == held
    assert (failed.command_failed.reason, failed.command_failed.broken_group_id) == ("COLLECTIVE_FAILED", "g")
    assert not failed.command_failed.store_touched
    assert aborted.WhichOneof("event") == "update_aborted"
    assert "g" not in harness.worker.groups.groups and harness.pg.received == []


def test_a_receive_held_past_the_groups_timeout_fails_as_a_timed_out_transfer():
    harness = Harness(timeout=5.0)
    try:
        harness.prepare()
        held = harness.receive(3)
        harness.worker._expire_held()  # what the command loop does at least once a second: not yet
        assert harness.answers() == []
        key, (payload, since) = next(iter(harness.worker._held.items()))
        harness.worker._held[key] = (payload, since - 5.0)  # held for the whole timeout
        harness.worker._expire_held()
        (failed,) = harness.answers()
        assert (failed.command_id, failed.command_failed.reason) == (held, "COLLECTIVE_TIMEOUT")
        assert failed.command_failed.broken_group_id == "g" and "g" not in harness.worker.groups.groups
    finally:
        harness.close()
