"""One update run by the streams of its parts, once they joined (server/parts/joins.py).

Every part's handler hands in its stream (its plan and its requests after Begin). The handler of
part 0 waits until every part's stream is in, then runs the one update (session.py) under the
update gate, fed by all of them: its own responses it yields, and every other part's handler relays
its own (UpdateSession.follow). Part 0's handler failing before the update starts (the gate is busy,
a part's stream never came, it was cancelled) fails every other part with PART_FAILED naming it;
every wait here is bounded by GATHER_SECONDS.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightsync.common.errors import Aborted, WeightSyncError
from weightsync.server.parts.rules import part_failed, parts_missing
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

if TYPE_CHECKING:
    from weightsync.server.update.session import UpdateSession

GATHER_SECONDS = 10.0
"""Every part learns the join's outcome at once; its handler hands in its stream within this, and part 0's
handler starts the update (or fails it) within this once they are in."""


@dataclass(frozen=True, slots=True)
class PartFeed:
    """One part's stream, as its handler hands it in."""

    plan: tensor_pb2.WeightPlan
    plan_id: str
    requests: AsyncIterator[pb.UpdateWeightsRequest]


@dataclass(slots=True)
class Gathering:
    """The streams of one joined update's parts, until part 0's handler started the update with them."""

    key: str
    world: int
    feeds: dict[int, PartFeed] = field(default_factory=dict)
    complete: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    session: asyncio.Future[UpdateSession] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class PartUpdates:
    def __init__(self, gather_seconds: float = GATHER_SECONDS) -> None:
        self.gather_seconds = gather_seconds
        self._open: dict[str, Gathering] = {}

    def hand_in(self, key: str, world: int, rank: int, feed: PartFeed) -> Gathering:
        """Part `rank` of the joined update `key` hands in its stream."""
        gathering = self._open.get(key)
        if gathering is None:
            gathering = self._open[key] = Gathering(key, world)
        gathering.feeds[rank] = feed
        if len(gathering.feeds) == world and not gathering.complete.done():
            gathering.complete.set_result(None)
        return gathering

    async def gathered(self, gathering: Gathering) -> dict[int, PartFeed]:
        """Part 0: every part's stream, by rank; PARTS_MISSING naming the absent ranks after GATHER_SECONDS."""
        try:
            await asyncio.wait_for(asyncio.shield(gathering.complete), self.gather_seconds)
        except TimeoutError:
            raise parts_missing(gathering.key, gathering.world, gathering.feeds,
                                datetime.timedelta(seconds=self.gather_seconds)) from None
        return dict(sorted(gathering.feeds.items()))

    def started(self, gathering: Gathering, session: UpdateSession) -> None:
        """Part 0 started the update: the other parts' handlers follow it."""
        self._close(gathering)
        gathering.session.set_result(session)

    def failed(self, gathering: Gathering, error: WeightSyncError) -> None:
        """Part 0 failed before the update started: every other part learns it (PART_FAILED naming part 0)."""
        self._close(gathering)
        if not gathering.session.done():
            gathering.session.set_exception(part_failed(gathering.key, 0, error))
            gathering.session.exception()  # retrieved: no other part may be waiting

    def left(self, gathering: Gathering) -> None:
        """Part 0's handler ended (cancelled) before it started the update or failed it."""
        self.failed(gathering, Aborted("STREAM_CLOSED", "the part's stream ended before its update started"))

    async def session(self, gathering: Gathering) -> UpdateSession:
        """A part but 0: the update part 0's handler started, or the failure it met."""
        try:
            return await asyncio.wait_for(asyncio.shield(gathering.session), 2 * self.gather_seconds)
        except TimeoutError:
            self.failed(gathering, Aborted("STREAM_CLOSED", "the part did not start the update within "
                                           f"{2 * self.gather_seconds:g} s"))
            return await gathering.session

    def _close(self, gathering: Gathering) -> None:
        if self._open.get(gathering.key) is gathering:
            del self._open[gathering.key]
