"""What a stream's reader sees of its update: its stream's side (StreamSide, an IntakeSession).

The stream's own plan, counters and sequences; every message it puts in the inbox tagged with the
stream; a failure it reports attributed to its part. The session is seen through SessionView (view.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from weightsync.common.errors import WeightSyncError
from weightsync.server.intake.intake import Item
from weightsync.server.update.streams import PooledShare, Stream
from weightsync.server.update.view import SessionView
from weightsync.v1 import tensor_pb2
from weightsync.worker.v1 import worker_pb2 as wpb


class StreamSide:
    """What the reader of one stream sees of its update (intake.intake.IntakeSession): its own plan,
    counters and sequences; every inbox message tagged with the stream; failures attributed to it."""

    def __init__(self, session: SessionView, stream: Stream) -> None:
        self._session = session
        self._stream = stream
        self.stream = stream.rank
        self.update_id = session.update_id
        self.plan = stream.plan
        self.inbox = _TaggedInbox(session.inbox, stream.rank)

    @property
    def failure(self) -> WeightSyncError | None:
        return self._session.failure

    @property
    def applied_sent(self) -> int:
        return self._stream.applied_sent

    @property
    def bucket_timeout(self) -> float:
        return self._session.bucket_timeout

    @property
    def parts(self) -> int:
        return len(self._session.streams)

    @property
    def broadcast_to_all(self) -> bool:
        # Parts over NCCL send point-to-point to each owner, as over Gloo (common/receive_order.py).
        return self._session.broadcast_to_all and len(self._session.streams) == 1

    @property
    def owners(self) -> list[int]:
        first = self._stream.first
        return self._session.owners[first : first + self._stream.count]

    def store_sequence(self, sequence: int) -> int:
        return self._stream.first + sequence

    def touched(self, sequence: int) -> None:
        self._session.touched(self.store_sequence(sequence))

    def route_is_direct(self, sequence: int) -> bool:
        return 0 <= sequence < self._stream.count and self._session.route_is_direct(self.store_sequence(sequence))

    def stored_here(self, sequence: int) -> bool:
        return not 0 <= sequence < self._stream.count or self._session.stored_here(self.store_sequence(sequence))

    def in_store(self, sequence: int) -> bool:
        return 0 <= sequence < self._stream.count and self._session.in_store(self.store_sequence(sequence))

    def lay_out(self, sequence: int, layout: tensor_pb2.BucketSpec) -> wpb.OwnedBucket:
        return self._session.lay_out(self.store_sequence(sequence), layout)

    def fail(self, error: WeightSyncError) -> None:
        self._session.fail(error, part=self._stream.rank)

    def break_group(self, why: str) -> None:
        self._session.break_group(why)

    async def claim_slot(self, piece: int) -> None:
        """Until this stream's ingress piece `piece` may be written (into slot_offset(piece)): the piece
        that used its slot before was finished by the workers, or the update failed. A run of slots of its
        own: piece p reuses the slot of piece p - count. A pool: once its own earlier pieces were finished
        (one slot at a time), the next free slot when its turn came."""
        stream = self._stream
        share = stream.ingress
        if not isinstance(share, PooledShare):
            assert share is not None
            await self._wait(lambda: stream.pieces_done >= piece - share.slot_count + 1)
            return
        await self._wait(lambda: stream.pieces_done >= piece)
        try:
            await self._wait(lambda: share.pool.take(stream.rank, piece))
        finally:
            share.pool.leave(stream.rank)

    async def _wait(self, ready: Callable[[], bool]) -> None:
        """Until `ready()` or the update failed; woken whenever a piece was done (session.progress)."""
        session = self._session
        while session.failure is None and not ready():
            session.progress.clear()
            await session.progress.wait()


class _TaggedInbox:
    """The update's inbox as one stream's reader puts into it: each item tagged with the stream."""

    def __init__(self, inbox: asyncio.Queue[tuple[int, Item]], stream: int) -> None:
        self._inbox = inbox
        self._stream = stream

    async def put(self, item: Item) -> None:
        await self._inbox.put((self._stream, item))

    def put_nowait(self, item: Item) -> None:
        self._inbox.put_nowait((self._stream, item))
