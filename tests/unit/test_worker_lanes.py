"""A worker's lanes (gpu_worker/receive_update.py ReceiveUpdate): an update fed by several streams names where
each stream's run of the plan starts, and the worker takes its owned buckets in order within each run,
whatever the interleaving between runs; the staging admission counts a buffer per extra lane."""

from __future__ import annotations

import pytest

from weightsync.gpu_worker.receive_update import ReceiveUpdate
from weightsync.server.update.admission import StagingNeed
from weightsync.worker.v1 import worker_pb2 as wpb


def update(order: list[int], lane_starts: list[int]) -> ReceiveUpdate:
    command = wpb.PrepareUpdateCommand(buckets=[wpb.OwnedBucket(sequence=k) for k in order])
    return ReceiveUpdate(command, {k: command.buckets[i] for i, k in enumerate(order)}, order,
                         lane_starts=lane_starts)


@pytest.mark.parametrize(("lane_starts", "sequence", "lane"), [
    ([0], 0, 0), ([0], 9, 0),
    ([0, 4, 6], 0, 0), ([0, 4, 6], 3, 0), ([0, 4, 6], 4, 1), ([0, 4, 6], 5, 1), ([0, 4, 6], 6, 2), ([0, 4, 6], 99, 2),
    # a part with no buckets: its run is empty, the next part's starts at the same sequence
    ([0, 2, 2], 2, 2), ([0, 2, 2], 1, 0),
])
def test_lane_of(lane_starts: list[int], sequence: int, lane: int) -> None:
    assert update([], lane_starts).lane_of(sequence) == lane


def test_each_lane_in_its_own_order_whatever_the_interleaving() -> None:
    u = update([1, 3, 4, 5, 7], [0, 4, 6])
    assert [list(w) for w in u.waiting] == [[1, 3], [4, 5], [7]]
    # lane 2's only bucket, then lane 1's first, then lane 0's: each is its lane's next
    assert (u.expected(7), u.expected(4), u.expected(1)) == (7, 4, 1)
    u.waiting[1].popleft()
    assert (u.expected(5), u.expected(4)) == (5, 5)  # 4 is in: 5 is lane 1's next, for either sequence
    one_lane = update([1, 3, 4], [0])
    assert (one_lane.expected(4), one_lane.expected(1)) == (1, 1)  # one lane: the plan's order, as before


class Worker:
    def __init__(self, staging_bytes: int) -> None:
        self.status = wpb.WorkerStatus(staging_bytes=staging_bytes)


@pytest.mark.parametrize(("held", "size", "lanes", "growth"), [
    (0, 100, 0, 100),
    (150, 100, 0, 0),      # the kept staging is reused
    (40, 100, 0, 60),      # and grows only by what it lacks
    (150, 100, 70, 70),    # another lane's buffer is new for the update, whatever is held
    (0, 0, 30, 30),
])
def test_staging_growth_counts_every_lane(held: int, size: int, lanes: int, growth: int) -> None:
    assert StagingNeed(Worker(held), size, on_device=False, lane_bytes=lanes).growth == growth  # type: ignore[arg-type]
