"""One update as a worker receives it: the buckets it owns, per lane, and what it kept (gpu_worker/receiver.py).

An update fed by several streams (the parts of a multi-sender update) names where each stream's buckets start
(PrepareUpdateCommand.lane_starts): the streams' buckets interleave, so each stream's run of the plan is a
lane, its owned buckets taken in order within it.
"""

from __future__ import annotations

import bisect
import collections
import enum
from dataclasses import dataclass, field

import torch

from weightsync.common.receive_order import store_receive_order
from weightsync.gpu_worker.patch_apply import CheckedPatch
from weightsync.worker.v1 import worker_pb2 as wpb


class ReceivePhase(enum.Enum):
    RECEIVING = "receiving"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Applied:
    """A bucket in place."""

    size_bytes: int
    fast_path: bool


@dataclass(slots=True)
class ReceiveUpdate:
    """This worker's assignment in the update in flight."""

    command: wpb.PrepareUpdateCommand
    owned: dict[int, wpb.OwnedBucket]
    order: list[int]
    """The owned sequences, in plan order."""
    lane_starts: list[int] = field(default_factory=lambda: [0])
    """Where each lane's run of the plan starts (PrepareUpdateCommand.lane_starts; one lane: [0])."""
    waiting: list[collections.deque[int]] = field(default_factory=list)
    """Per lane, the owned sequences not yet in, in the order they arrive."""
    received: int = 0
    phase: ReceivePhase = ReceivePhase.RECEIVING
    kept: list[tuple[torch.Tensor, CheckedPatch]] = field(default_factory=list)
    """STAGED: checked patches, scattered at commit."""
    lane_buffers: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    """(staging or wire, lane) -> the receive buffer of a lane but the first, for this update only."""
    turns: collections.deque[int] = field(default_factory=collections.deque)
    """COLLECTIVE with several lanes (parts sending point-to-point): the owned buckets not yet received, in the
    one order this worker receives them (common/receive_order.py); empty otherwise (taken as they come)."""

    def __post_init__(self) -> None:
        self.waiting = [collections.deque() for _ in self.lane_starts]
        for sequence in self.order:
            self.waiting[self.lane_of(sequence)].append(sequence)
        if self.command.group_id and len(self.lane_starts) > 1:
            self.turns = collections.deque(store_receive_order(self.order, self.lane_starts))

    def in_turn(self, sequence: int) -> bool:
        """Whether a receive of bucket `sequence` may run now: no order to keep, it is the next turn, or it is
        none of the turns left (a bucket this worker does not own, or one already taken: refused as it runs)."""
        return not self.turns or self.turns[0] == sequence or sequence not in self.turns

    def took_turn(self, sequence: int) -> None:
        """Bucket `sequence`'s receive ran (received, dropped or failed): the next turn is due."""
        if self.turns and self.turns[0] == sequence:
            self.turns.popleft()

    def lane_of(self, sequence: int) -> int:
        """The lane of the plan's bucket `sequence`: the last whose run starts at or before it."""
        return max(0, bisect.bisect_right(self.lane_starts, sequence) - 1)

    def expected(self, sequence: int) -> int | None:
        """The owned bucket that must come next in `sequence`'s lane (None: that lane is done)."""
        lane = self.waiting[self.lane_of(sequence)]
        return lane[0] if lane else None

    @property
    def update_id(self) -> str:
        return self.command.update_id

    @property
    def group_id(self) -> str:
        return self.command.group_id
