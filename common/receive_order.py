"""The order of an update's COLLECTIVE transfers when several parts send it (BeginUpdate.part, world > 1).

Each part (group rank = part rank, 0..W-1) sends its bucket k point-to-point to each server's owner of
it, in increasing bucket order. Each worker receives the buckets it owns one at a time, in ONE global
order: bucket index, then part rank. No wait then forms a cycle, in either way a part sends:
  - Gloo: a bucket's sends to several owners in increasing owner rank, running ahead (two buckets in
    flight). Of all pending transfers take the least by (bucket, part, owner): its sender has nothing
    pending before it (an earlier bucket, or the same bucket to a lower owner, would be less), nor has
    its receiver (an earlier bucket, or the same bucket from a lower part, would be less), so both are
    at it and it completes.
  - NCCL: a bucket's sends to all its owners as ONE batch (one kernel, its sends in any order or at
    once), every rank's batches one at a time on the group's one stream (no pair is connected by an
    update: open_group connected them all, common/nccl_connect.py). Take the least incomplete batch
    by (bucket, part): its part finished every earlier batch, so it runs; each of its owners finished
    every receive before (bucket, part) in the global order, since those belong to lesser batches,
    so each is at it; every send of the batch meets its receive, and it completes. A batch per owner,
    each waited for before the next, would hold the same order but run a bucket to S servers S
    times as long.
No communicator per part and no rotating broadcast root are needed. tests/unit/test_receive_order.py checks
it over random plans and delays, the three ways (a part's sends serialized, windowed, batched), and
shows that a worker taking its buckets in the order the announcements reach it can deadlock.

The server knows every part's plan before any byte moves: a worker's prepare names the buckets it owns
in the store's plan and where each part's run of that plan starts (PrepareUpdateCommand.lane_starts: part
p's bucket k is the store's lane_starts[p] + k), which is all `store_receive_order` needs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence


def receive_order(transfers: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (part, bucket) transfers one worker receives, in the order it receives them: bucket index,
    then part rank."""
    return sorted(transfers, key=lambda transfer: (transfer[1], transfer[0]))


def send_order(owners: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """One part's sends, as (bucket, owner rank): `owners[k]` are the group ranks that receive its bucket k
    (one per server that stores some of it). In increasing bucket order, a bucket's owners in increasing
    rank (over NCCL a bucket's sends are one batch: their order within it does not matter)."""
    return [(bucket, owner) for bucket, ranks in enumerate(owners) for owner in sorted(ranks)]


def lane_of(sequence: int, lane_starts: Sequence[int]) -> int:
    """The part whose run of the store's plan holds the store's bucket `sequence` (lanes: where each part's
    run starts, in rank order; [] or [0]: one part)."""
    return max(0, bisect.bisect_right(list(lane_starts), sequence) - 1)


def source_of(sequence: int, lane_starts: Sequence[int]) -> tuple[int, int]:
    """(part rank, the bucket's index in that part's own plan) of the store's bucket `sequence`: who sends
    it, and the tag it is sent with."""
    lane = lane_of(sequence, lane_starts)
    start = lane_starts[lane] if lane_starts else 0
    return lane, sequence - start


def store_receive_order(owned: Iterable[int], lane_starts: Sequence[int]) -> list[int]:
    """A worker's owned buckets (the store's sequences) in the order it receives them (receive_order)."""
    return sorted(owned, key=lambda sequence: tuple(reversed(source_of(sequence, lane_starts))))
