"""The streams that feed one update: each one's own state, and what its reader sees of the update.

An update is fed by one stream per part (BeginUpdate.part; a stream without a part is the whole
update, a world of 1). Each stream has its own plan, and its buckets are a run of the update's:
the node store sees one plan, the concatenation of the parts' plans in rank order, so stream
`rank`'s bucket k is the store's bucket `first + k`. What is the stream's own is kept here, per
stream: its reader, the buckets applied and the BucketApplied messages handed to it, the ingress
pieces its workers finished, whether it asked to commit and was told the update is aborting, and
(for every stream but the one whose handler drives the update) the queue of its responses.

A reader sees its update only through its stream's side (StreamSide, an IntakeSession: stream_side.py): the
stream's own plan, counters and sequences, every message it puts in the inbox tagged with the
stream, and a failure it reports attributed to its part. INLINE streams share the ingress slots:
and so do SHM parts (each client writes its slots itself, told its run in UpdateReady): each
stream gets its own run of them (IngressShare), so one part never writes into another's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from weightsync.common.errors import WeightSyncError
from weightsync.server.intake.intake import StreamReader
from weightsync.server.store.ingress import Ingress
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

END = None
"""Put in a following stream's response queue after its last response."""


@dataclass(slots=True)
class Stream:
    """One stream of an update: its part's rank (0 for a world of 1), plan and state."""

    rank: int
    plan: tensor_pb2.WeightPlan
    plan_id: str
    first: int
    """The store's sequence of this stream's bucket 0."""
    reader: StreamReader | None = None
    reading: asyncio.Task[None] | None = None
    applied: int = 0
    """This stream's buckets its owners applied."""
    applied_sent: int = 0
    """BucketApplied messages handed to this stream: what its client can have seen (SHM slot reuse)."""
    pieces_done: int = 0
    """This stream's ingress pieces the workers finished with (their slots are free again)."""
    ingress: Ingress | IngressShare | PooledShare | None = None
    """The ingress slots this stream writes (INLINE) or its client writes (SHM): ingress_shares."""
    commit_asked: bool = False
    ended: bool = False
    """The stream said its last word: commit, abort, or it closed."""
    aborting_sent: bool = False
    responses: asyncio.Queue[pb.UpdateWeightsResponse | None] = field(default_factory=asyncio.Queue)
    """A following stream's responses (the driving stream's are yielded by the driver itself)."""

    @property
    def count(self) -> int:
        return len(self.plan.buckets)

    def piece_done(self, piece: int) -> None:
        """The workers finished this stream's ingress piece `piece`: its slot is free again."""
        self.pieces_done += 1
        if isinstance(self.ingress, PooledShare):
            self.ingress.pool.settled(self.rank, piece)

    def owns(self, sequence: int) -> bool:
        """The store's bucket `sequence` is one of this stream's."""
        return self.first <= sequence < self.first + self.count


class IngressShare:
    """A stream's run of the ingress slots: `count` of them from slot `start` (the whole ingress for one
    stream). Offsets are the ingress's own, so workers copy from them unchanged."""

    def __init__(self, ingress: Ingress, start: int, count: int) -> None:
        self.ingress = ingress
        self.first_slot = start
        self.slot_count = count
        self.slot_bytes = ingress.slot_bytes

    def slot_offset(self, sequence: int) -> int:
        return (self.first_slot + sequence % self.slot_count) * self.slot_bytes

    def write(self, sequence: int, offset_bytes: int, data: bytes | memoryview) -> None:
        start = self.slot_offset(sequence) + offset_bytes
        self.ingress.view[start : start + len(data)] = data


class SlotPool:
    """The ingress slots of an update with more parts than slots, taken by whichever stream needs one: a
    free slot goes to the stream that has waited longest, one slot per stream at a time (each stream's
    fair share is less than one slot), and is free again once the workers finished the piece in it."""

    def __init__(self, ingress: Ingress) -> None:
        self.ingress = ingress
        self.free: deque[int] = deque(range(ingress.slot_count))
        self.waiting: deque[int] = deque()
        """Streams (ranks) waiting for a slot, longest first."""
        self.held: dict[tuple[int, int], int] = {}
        """(rank, piece) -> the slot that piece is in, until its workers finished it."""

    def take(self, rank: int, piece: int) -> bool:
        """Give piece `piece` of stream `rank` a free slot if it is its turn (the longest waiting stream gets
        the next free slot); False: it waits (it is queued the first time)."""
        if rank not in self.waiting:
            self.waiting.append(rank)
        if not self.free or self.waiting[0] != rank:
            return False
        self.waiting.popleft()
        self.held[(rank, piece)] = self.free.popleft()
        return True

    def leave(self, rank: int) -> None:
        """Stream `rank` stopped waiting (the update failed, or its wait timed out)."""
        if rank in self.waiting:
            self.waiting.remove(rank)

    def settled(self, rank: int, piece: int) -> None:
        """The workers finished piece `piece` of stream `rank`: its slot is free."""
        self.free.append(self.held.pop((rank, piece)))


class PooledShare:
    """A stream's view of a SlotPool: piece p is wherever the pool put it (slot_count 1: one slot at a time)."""

    first_slot = 0
    slot_count = 1

    def __init__(self, pool: SlotPool, rank: int) -> None:
        self.pool = pool
        self.rank = rank
        self.slot_bytes = pool.ingress.slot_bytes

    def slot_offset(self, sequence: int) -> int:
        return self.pool.held[(self.rank, sequence)] * self.slot_bytes

    def write(self, sequence: int, offset_bytes: int, data: bytes | memoryview) -> None:
        start = self.slot_offset(sequence) + offset_bytes
        self.pool.ingress.view[start : start + len(data)] = data


def ingress_shares(ingress: Ingress, streams: int) -> list[IngressShare] | list[PooledShare]:
    """The slots split evenly between the streams, in order (the first ones get a remainder's slot); with
    more streams than slots, one pool that every stream takes its slot from in turn (INLINE only: an SHM
    client writes its slots unasked, so it needs a run of its own)."""
    if streams > ingress.slot_count:
        pool = SlotPool(ingress)
        return [PooledShare(pool, rank) for rank in range(streams)]
    base, extra = divmod(ingress.slot_count, streams)
    shares, start = [], 0
    for index in range(streams):
        count = base + (1 if index < extra else 0)
        shares.append(IngressShare(ingress, start, count))
        start += count
    return shares


def store_plan(parts: list[tuple[int, tensor_pb2.WeightPlan, str]]) -> tuple[tensor_pb2.WeightPlan, list[Stream]]:
    """The store's plan of an update fed by these parts (rank, plan, plan id), in rank order: their
    buckets one after another, each part's stream starting where the previous one's buckets end."""
    plan = tensor_pb2.WeightPlan()
    streams = []
    for rank, part_plan, part_plan_id in sorted(parts, key=lambda part: part[0]):
        streams.append(Stream(rank=rank, plan=part_plan, plan_id=part_plan_id, first=len(plan.buckets)))
        plan.buckets.extend(part_plan.buckets)
    return plan, streams


def attributed(error: WeightSyncError, streams: list[Stream],
               stream: Stream | None = None) -> tuple[WeightSyncError, int | None]:
    """An error that names a bucket of the store's plan (a refusal of the plan, derived in prepare: a tensor's
    dtype or shape against the store, a new tensor not allowed, ...; a worker's failure of a bucket: its
    checksum, its patch, ...) as the part's: metadata `part` (its rank) and `bucket` (the index in that part's
    own plan), so that the part at fault hears its own bucket and the others PART_FAILED naming it. `stream`:
    the part whose bucket failed, when known (it gets `part` even where no bucket is named); else the part
    whose bucket the error names. One stream, or no part found: the error as it is, and no part."""
    sequence = error.metadata.get("bucket", "")
    if len(streams) < 2:
        return error, None
    named_stream = next((s for s in streams if s.owns(int(sequence))), None) if sequence.isdigit() else None
    stream = stream or named_stream
    if stream is None:
        return error, None
    named = type(error).__new__(type(error))  # the same class and attributes, its message and metadata the part's
    named.__dict__.update(error.__dict__)
    named.metadata = {**error.metadata, "part": str(stream.rank)}
    named.message = f"part {stream.rank}: {error.message}"
    if named_stream is stream:
        local = int(sequence) - stream.first
        named.metadata["bucket"] = str(local)
        named.message = f"part {stream.rank}, bucket {local}: {error.message}"
    Exception.__init__(named, named.message)
    return named, stream.rank
