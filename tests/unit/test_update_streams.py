"""One update fed by several streams (the parts of one version), in-process: the session, its INLINE
intakes, the node store and a fake fleet of real receivers (tests/fake_fleet.py), as test_update_core.

Each stream has its own plan and sequences; the store's plan is theirs one after another
(update_streams.store_plan). The update commits once every stream asked to commit and every bucket
of every stream was applied; any stream's failure aborts it, and every other stream learns which
part failed (PART_FAILED naming it). Each failure is followed by the next push and a check of the
store's bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch
from fake_fleet import FakeFleet, fake_session_services

from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.common.errors import WeightSyncError
from weightsync.common.plan_id import plan_id_of
from weightsync.server.store.ingress import Ingress
from weightsync.server.store.node_store import NodeStore
from weightsync.server.update.session import UpdateSession
from weightsync.server.update.streams import store_plan
from weightsync.server.update.view import SessionServices
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import pack, plan_buckets

pytestmark = pytest.mark.timeout(60)
SLOT = 1 << 16
KEY = "step-key"


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(1000 + 300 * i, generator=g) for i in range(6)}


def halves(named: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Part 0 the even layers, part 1 the odd ones."""
    return [{n: t for k, (n, t) in enumerate(named.items()) if k % 2 == rank} for rank in range(2)]


@pytest.fixture
def services():
    ingress = Ingress(SLOT, 4)
    services, close = fake_session_services(FakeFleet(2, ingress), ingress)
    yield services
    close()


def held(store: NodeStore) -> dict[str, int]:
    return {name: ws64(store.view(name)) for name in store.tensors}


def expected(named: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: ws64(t) for name, t in named.items()}


async def requests(plan, named, *, before: asyncio.Event | None = None, after: asyncio.Event | None = None,
                   corrupt: int | None = None) -> AsyncIterator[pb.UpdateWeightsRequest]:
    """A part's stream after Begin: every bucket in chunks, then commit. `before`: wait for it first;
    `after`: set as commit is sent; `corrupt`: that bucket's checksum names other bytes."""
    if before is not None:
        await asyncio.wait_for(before.wait(), 10)
    for k in range(len(plan.buckets)):
        data = pack(plan, named, k)
        checksum = tensor_checksum(data if k != corrupt else data + 1)
        yield pb.UpdateWeightsRequest(bucket_start=pb.BucketStart(sequence=k, size_bytes=data.numel(),
                                                                   checksum=checksum))
        yield pb.UpdateWeightsRequest(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=0,
                                                                   data=data.numpy().tobytes()))
    if after is not None:
        # Set as commit is handed over: the reader puts it in the inbox before the next stream can run
        # (the reader reads nothing after a commit, so after yielding it would be too late).
        after.set()
    yield pb.UpdateWeightsRequest(commit=pb.CommitUpdate())


async def collect(responses: AsyncIterator[pb.UpdateWeightsResponse]):
    """The stream's responses, and the error it ended with (None: it committed)."""
    got = []
    try:
        async for response in responses:
            got.append(response)
    except WeightSyncError as error:
        return got, error
    return got, None


async def push_parts(services: SessionServices, named: dict[str, torch.Tensor], version: str, *,
                     corrupt: tuple[int, int] | None = None):
    """Two parts of one version, each its own stream; part 0 sends all and commits before part 1 starts.
    Returns each part's (responses, error)."""
    parts = halves(named)
    plans = [plan_buckets(list(part.items()), 8192) for part in parts]
    plan, streams = store_plan([(rank, p, plan_id_of(p)) for rank, p in enumerate(plans)])
    begin = pb.BeginUpdate(version=version, mode=pb.UPDATE_MODE_STAGED, transport=pb.TRANSPORT_INLINE,
                           allow_new_tensors=True, part=pb.UpdatePart(update_key=KEY, world=2))
    session = UpdateSession(services, f"u-{version}", None, begin, plan, plan_id_of(plan), streams=streams)
    committed_sent = asyncio.Event()
    bad = dict([corrupt]) if corrupt else {}
    first = requests(plans[0], parts[0], after=committed_sent, corrupt=bad.get(0))
    second = requests(plans[1], parts[1], before=committed_sent, corrupt=bad.get(1))
    driving = asyncio.create_task(collect(session.run(first, following={1: second})))
    following = asyncio.create_task(collect(session.follow(1)))
    return [await driving, await following], plans


def kinds(responses) -> list[str]:
    return [r.WhichOneof("message") for r in responses]


def test_two_parts_commit_once_with_one_generation_after_both_asked(services):
    v1 = model(1)
    (zero, one), plans = asyncio.run(push_parts(services, v1, "v1"))
    assert (zero[1], one[1]) == (None, None)
    # Part 0 asked first: it hears that part 1 still sends, then both commit.
    assert kinds(zero[0]) == ["ready"] + ["bucket_applied"] * len(plans[0].buckets) + ["waiting", "committed"]
    assert list(zero[0][-2].waiting.sending) == [1]
    assert kinds(one[0]) == ["ready"] + ["bucket_applied"] * len(plans[1].buckets) + ["committed"]
    zero = (zero[0][:-2] + zero[0][-1:], zero[1])
    for (responses, _), plan in zip((zero, one), plans, strict=True):
        count = len(plan.buckets)
        assert responses[0].ready.bucket_count == count
        assert responses[0].ready.plan_id == plan_id_of(plan)
        # Each part's own sequences, and each bucket's own size.
        assert [r.bucket_applied.sequence for r in responses[1:-1]] == list(range(count))
        assert [r.bucket_applied.size_bytes for r in responses[1:-1]] == [b.size_bytes for b in plan.buckets]
    assert zero[0][-1].committed.version == one[0][-1].committed.version
    assert zero[0][-1].committed.version.generation == 1  # one commit: one generation for both parts
    assert services.publisher.version.version == "v1"
    assert held(services.store) == expected(v1)  # part 1's buckets were in before the commit


def test_a_part_that_fails_aborts_both_and_the_other_learns_which(services):
    v1, v2, v3 = model(1), model(2), model(3)
    asyncio.run(push_parts(services, v1, "v1"))
    before = held(services.store)
    (zero, one), _ = asyncio.run(push_parts(services, v2, "v2", corrupt=(1, 1)))
    assert one[1].reason == "BUCKET_CHECKSUM_MISMATCH"  # the failing part gets its own failure
    assert zero[1].reason == "PART_FAILED"  # part 0 had asked to commit: it learns part 1 failed
    assert (zero[1].metadata["part"], zero[1].metadata["part_reason"]) == ("1", "BUCKET_CHECKSUM_MISMATCH")
    assert zero[1].metadata["update_key"] == KEY
    assert kinds(zero[0])[-1] == "aborting" and zero[0][-1].aborting.reason == "PART_FAILED"
    assert kinds(one[0])[-1] == "aborting" and one[0][-1].aborting.reason == "BUCKET_CHECKSUM_MISMATCH"
    assert "committed" not in kinds(zero[0]) + kinds(one[0])
    assert services.publisher.version.version == "v1"
    assert held(services.store) == before == expected(v1)  # bit for bit: nothing of v2 published
    (zero, one), _ = asyncio.run(push_parts(services, v3, "v3"))
    assert (zero[1], one[1]) == (None, None)
    assert zero[0][-1].committed.version.generation == one[0][-1].committed.version.generation == 2
    assert held(services.store) == expected(v3)


def test_the_first_part_failing_aborts_the_one_that_had_not_started(services):
    v1, v2, v3 = model(1), model(2), model(3)
    asyncio.run(push_parts(services, v1, "v1"))
    (zero, one), _ = asyncio.run(push_parts(services, v2, "v2", corrupt=(0, 0)))
    assert zero[1].reason == "BUCKET_CHECKSUM_MISMATCH"
    assert one[1].reason == "PART_FAILED" and one[1].metadata["part"] == "0"
    assert services.publisher.version.version == "v1"
    assert held(services.store) == expected(v1)
    (zero, one), _ = asyncio.run(push_parts(services, v3, "v3"))
    assert (zero[1], one[1]) == (None, None)
    assert held(services.store) == expected(v3)
