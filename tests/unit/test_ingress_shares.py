"""INLINE parts each get their own run of the ingress slots (update_streams.ingress_shares), so one part's
bytes never land in a slot another part's piece still waits in.

The split itself is a table. Then the case the split exists for, in-process as test_update_streams (the
session, its INLINE intakes, the node store, real receivers): part 0's first piece waits in its slot for
its owner's copy, held by the fleet until part 1 wrote its own first piece; without the shares both are
piece 0 of slot 0, part 1's bytes overwrite part 0's, and part 0's bucket fails its checksum. Events
order it: part 1 starts once part 0's first chunk was written; part 0's copy runs once part 1's was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch
from fake_fleet import FakeFleet, FakeWorker, fake_session_services

from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.common.errors import WeightSyncError
from weightsync.common.plan_id import plan_id_of
from weightsync.server.store.ingress import Ingress
from weightsync.server.store.node_store import NodeStore
from weightsync.server.update.session import UpdateSession
from weightsync.server.update.streams import ingress_shares, store_plan
from weightsync.server.update.view import SessionServices
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

from helpers import pack, plan_buckets

pytestmark = pytest.mark.timeout(60)
SLOT = 1 << 16
WAIT = 10.0  # every wait below is bounded by this


# -- the split ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("slots", "streams", "runs"), [
    (2, 1, [(0, 2)]),  # one stream: the whole ingress
    (2, 2, [(0, 1), (1, 1)]),
    (4, 2, [(0, 2), (2, 2)]),
    (5, 2, [(0, 3), (3, 2)]),  # the remainder's slot goes to the first
    (7, 3, [(0, 3), (3, 2), (5, 2)]),
    (8, 3, [(0, 3), (3, 3), (6, 2)]),
    (4, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
])
def test_each_stream_gets_its_own_run_of_the_slots(slots, streams, runs):
    ingress = Ingress(64, slots)
    try:
        shares = ingress_shares(ingress, streams)
        assert [(s.first_slot, s.slot_count) for s in shares] == runs
        for share, (start, count) in zip(shares, runs, strict=True):
            assert share.slot_bytes == 64
            # piece p of the stream uses slot start + p % count, in the ingress's own offsets
            assert [share.slot_offset(p) for p in range(2 * count)] == [64 * (start + p % count)
                                                                      for p in range(2 * count)]
            share.write(count + 1, 3, bytes([start + 1]) * 5)  # piece count + 1: the run's second slot (or only)
        written = bytes(ingress.view)
        for start, count in runs:
            slot = start + (1 % count)
            assert written[slot * 64 : (slot + 1) * 64] == bytes(3) + bytes([start + 1]) * 5 + bytes(56)
        assert sum(written) == sum((start + 1) * 5 for start, _ in runs)  # nothing outside the runs
    finally:
        ingress.close()


# -- more streams than slots: a pool ---------------------------------------------------------------------------
def test_more_streams_than_slots_share_one_pool():
    ingress = Ingress(64, 2)
    try:
        shares = ingress_shares(ingress, 3)
        assert [type(s).__name__ for s in shares] == ["PooledShare"] * 3
        assert len({id(s.pool) for s in shares}) == 1 and [s.slot_count for s in shares] == [1, 1, 1]
    finally:
        ingress.close()


# Each step: (what, rank, piece) and what the pool answers: take -> the slot taken or None (it waits);
# settled -> None. Literal: the order in which slots go round, and who waits.
POOL_STEPS = [
    (("take", 0, 0), 0),      # slot 0 to rank 0
    (("take", 1, 0), 1),      # slot 1 to rank 1
    (("take", 2, 0), None),   # none free: rank 2 waits, first in line
    (("take", 0, 1), None),   # rank 0 waits behind rank 2
    (("settled", 1, 0), None),  # slot 1 free again
    (("take", 0, 1), None),   # not rank 0's turn: rank 2 waited longer
    (("take", 2, 0), 1),      # rank 2 gets slot 1
    (("settled", 0, 0), None),
    (("take", 0, 1), 0),      # rank 0's turn now: slot 0
    (("settled", 2, 0), None),
    (("settled", 0, 1), None),
    (("take", 1, 1), 1),      # free slots go round in the order they were freed (1, then 0)
    (("take", 2, 1), 0),
]


def test_a_free_slot_goes_to_the_stream_that_waited_longest():
    ingress = Ingress(64, 2)
    try:
        pool = ingress_shares(ingress, 3)[0].pool
        for (what, rank, piece), expected in POOL_STEPS:
            if what == "take":
                took = pool.take(rank, piece)
                assert (pool.held[(rank, piece)] if took else None) == expected, (what, rank, piece)
            else:
                pool.settled(rank, piece)
        assert pool.held == {(1, 1): 1, (2, 1): 0} and not pool.free and not pool.waiting
        pool.take(0, 2)  # rank 0 waits, then leaves (its update failed): the next free slot is another's
        pool.leave(0)
        pool.settled(2, 1)
        assert pool.take(1, 2) and pool.held[(1, 2)] == 0
    finally:
        ingress.close()


# -- two parts with a piece each in flight at once -----------------------------------------------------------
class HeldFleet(FakeFleet):
    """The fake fleet, but the receive of store bucket `held` copies from the ingress only once `release` is
    set (the copy of a real worker, still running while the other part's intake writes)."""

    def __init__(self, workers: int, ingress: Ingress) -> None:
        super().__init__(workers, ingress)
        self.held: int | None = None
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        """Set as the held receive waits."""
        self.copying: asyncio.Future[None] | None = None

    def submit_or_refusal(self, worker: FakeWorker, **command: object) -> asyncio.Future[wpb.WorkerEvent]:
        receive = command.get("receive_bucket")
        if not isinstance(receive, wpb.ReceiveBucketCommand) or receive.sequence != self.held:
            return super().submit_or_refusal(worker, **command)
        self.held = None  # once
        answer: asyncio.Future[wpb.WorkerEvent] = asyncio.get_running_loop().create_future()

        async def copy_when_released() -> None:
            self.holding.set()
            try:
                await asyncio.wait_for(self.release.wait(), WAIT)
            except TimeoutError as error:
                answer.set_exception(error)
                return
            done = FakeFleet.submit_or_refusal(self, worker, **command)  # the fake copies at once
            if done.exception() is not None:
                answer.set_exception(done.exception())
            else:
                answer.set_result(done.result())

        self.copying = asyncio.ensure_future(copy_when_released())
        return answer


@pytest.fixture
def services():
    ingress = Ingress(SLOT, 4)  # two slots for each of two parts
    services, close = fake_session_services(HeldFleet(2, ingress), ingress)
    yield services
    close()


def part_weights(seed: int) -> list[dict[str, torch.Tensor]]:
    """Two parts, each one bucket of 4 KiB (smaller than a slot: one piece each), different bytes."""
    g = torch.Generator().manual_seed(seed)
    return [{f"part{rank}.w": torch.randn(1024, generator=g)} for rank in range(2)]


async def requests(plan, named, *, wrote: asyncio.Event,
                   before: asyncio.Event | None = None) -> AsyncIterator[pb.UpdateWeightsRequest]:
    """A part's stream after Begin: its bucket in one chunk, then commit. `wrote` is set once the reader
    asked for the message after the chunk: the chunk is in the ingress by then, its piece forwarded."""
    if before is not None:
        await asyncio.wait_for(before.wait(), WAIT)
    data = pack(plan, named, 0)
    yield pb.UpdateWeightsRequest(bucket_start=pb.BucketStart(sequence=0, size_bytes=data.numel(),
                                                               checksum=tensor_checksum(data)))
    yield pb.UpdateWeightsRequest(bucket_chunk=pb.BucketChunk(sequence=0, offset_bytes=0,
                                                               data=data.numpy().tobytes()))
    wrote.set()
    yield pb.UpdateWeightsRequest(commit=pb.CommitUpdate())


async def collect(responses: AsyncIterator[pb.UpdateWeightsResponse]) -> WeightSyncError | None:
    try:
        async for _ in responses:
            pass
    except WeightSyncError as error:
        return error
    return None


async def push_overlapping(services: SessionServices, parts: list[dict[str, torch.Tensor]], version: str):
    """Part 0 writes its piece; its owner's copy is held; part 1 writes its piece; then the copy runs."""
    fleet = services.fleet
    assert isinstance(fleet, HeldFleet)
    plans = [plan_buckets(list(part.items()), 8192) for part in parts]
    assert [len(p.buckets) for p in plans] == [1, 1]
    plan, streams = store_plan([(rank, p, plan_id_of(p)) for rank, p in enumerate(plans)])
    begin = pb.BeginUpdate(version=version, mode=pb.UPDATE_MODE_STAGED, transport=pb.TRANSPORT_INLINE,
                           allow_new_tensors=True, part=pb.UpdatePart(update_key="overlap", world=2))
    session = UpdateSession(services, f"u-{version}", None, begin, plan, plan_id_of(plan), streams=streams)
    fleet.held, fleet.release, fleet.holding = 0, asyncio.Event(), asyncio.Event()
    zero_wrote, one_wrote = asyncio.Event(), asyncio.Event()
    first = requests(plans[0], parts[0], wrote=zero_wrote)
    second = requests(plans[1], parts[1], wrote=one_wrote, before=zero_wrote)
    driving = asyncio.create_task(collect(session.run(first, following={1: second})))
    following = asyncio.create_task(collect(session.follow(1)))
    await asyncio.wait_for(one_wrote.wait(), WAIT)
    await asyncio.wait_for(fleet.holding.wait(), WAIT)  # part 0's copy had not run when part 1 wrote
    fleet.release.set()
    return await asyncio.wait_for(driving, WAIT), await asyncio.wait_for(following, WAIT)


def held(store: NodeStore) -> dict[str, int]:
    return {name: ws64(store.view(name)) for name in store.tensors}


def test_two_parts_with_a_piece_each_in_flight_write_into_their_own_slots(services):
    for seed, version in ((1, "v1"), (2, "v2")):
        parts = part_weights(seed)
        assert asyncio.run(push_overlapping(services, parts, version)) == (None, None)
        assert services.publisher.version.version == version
        assert held(services.store) == {n: ws64(t) for part in parts for n, t in part.items()}
