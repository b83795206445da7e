"""The asyncio core of an update, in-process: UpdateSession, its INLINE intake, the node store, admission,
the update gate, the group registry and the publisher, against a fake fleet of real receivers
(tests/fake_fleet.py). Milliseconds per update; the real-process suites drive the real fleet."""

from __future__ import annotations

import asyncio
import datetime

import pytest
import torch
from fake_fleet import FakeFleet, KillWorker, failing

from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.common.errors import (
    DataLoss,
    FailedPrecondition,
    ResourceExhausted,
    WeightSyncError,
)
from weightsync.common.plan_id import plan_id_of
from weightsync.server.groups import GroupRecord, GroupRegistry
from weightsync.server.metrics import Metrics
from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.published.publisher import Publisher
from weightsync.server.store.ingress import Ingress
from weightsync.server.store.leases import LeaseTable
from weightsync.server.store.node_store import NodeStore
from weightsync.server.update.admission import MemoryAdmission, StagingNeed
from weightsync.server.update.gate import UpdateGate
from weightsync.server.update.session import UpdateSession
from weightsync.server.update.view import SessionServices
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import pack, plan_buckets

pytestmark = pytest.mark.timeout(60)
SLOT = 1 << 16


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(1000 + 300 * i, generator=g) for i in range(6)}


@pytest.fixture
def node():
    ingress = Ingress(SLOT, 4)
    store = NodeStore()
    fleets: list[FakeFleet] = []

    def build(workers: int, **admission) -> tuple[SessionServices, FakeFleet]:
        fleet = FakeFleet(workers, ingress)
        fleets.append(fleet)
        services = SessionServices(
            fleet=fleet, store=store, publisher=Publisher(store, EngineRegistry()), groups=GroupRegistry(_gone),
            admission=MemoryAdmission(available=lambda: 1 << 40, **admission), leases=LeaseTable(),
            ingress=ingress, command_timeout=5, transfer_timeout=5, lease_timeout=5, max_chunk_bytes=SLOT,
            metrics=Metrics())
        return services, fleet

    yield build
    for fleet in fleets:
        fleet.close()
    store.close()
    ingress.close()


async def _gone(record) -> None:
    pass


async def push(services: SessionServices, named: dict[str, torch.Tensor], version: str, *, mode=pb.UPDATE_MODE_STAGED,
               bucket=8192, stop_after: int | None = None,
               on_response=lambda response: None) -> list[pb.UpdateWeightsResponse]:
    """One INLINE update through the session, as its stream handler runs it; the responses, or the error."""
    plan = plan_buckets(list(named.items()), bucket)
    begin = pb.BeginUpdate(version=version, mode=mode, transport=pb.TRANSPORT_INLINE, allow_new_tensors=True)
    session = UpdateSession(services, f"u-{version}", None, begin, plan, plan_id_of(plan))

    async def requests():
        for k in range(len(plan.buckets)):
            if k == stop_after:
                yield pb.UpdateWeightsRequest(abort=pb.AbortUpdate(reason="test stops"))
                return
            data = pack(plan, named, k)
            yield pb.UpdateWeightsRequest(bucket_start=pb.BucketStart(sequence=k, size_bytes=data.numel(),
                                                                       checksum=tensor_checksum(data)))
            yield pb.UpdateWeightsRequest(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=0,
                                                                       data=data.numpy().tobytes()))
        yield pb.UpdateWeightsRequest(commit=pb.CommitUpdate())

    responses = []
    async for response in session.run(requests()):
        on_response(response)  # while the session waits at this message, as gRPC holds it
        responses.append(response)
    return responses


def held(store: NodeStore) -> dict[str, int]:
    return {name: ws64(store.view(name)) for name in store.tensors}


def expected(named: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: ws64(t) for name, t in named.items()}


def test_each_bucket_is_received_by_its_owner_alone_into_one_store(node):
    services, fleet = node(3)
    v1 = model(1)
    responses = asyncio.run(push(services, v1, "v1"))
    assert responses[-1].committed.version.version == "v1"
    plan = plan_buckets(list(v1.items()), 8192)
    assert [b.size_bytes for b in plan.buckets] == [4032, 5248, 6400, 7616, 8832, 10048]  # a tensor each
    # By hand (docs/data-plane.md): loads 4032/0/0, 4032/5248/0, 4032/5248/6400, then 11648/5248/6400,
    # 11648/14080/6400, 11648/14080/16448.
    owners = [0, 1, 2, 0, 1, 2]
    for worker in fleet.workers:
        owned = sum(b.size_bytes for b, owner in zip(plan.buckets, owners, strict=True) if owner == worker.index)
        assert worker.receiver.received_bytes == owned
        assert worker.commands.count("receive_bucket") == owners.count(worker.index)
    assert held(services.store) == expected(v1)
    live = services.store.live_bytes
    assert services.store.held_bytes < live + 3 * 4096  # one copy (pages rounded), not one per worker


def test_a_staged_update_that_one_owner_refuses_publishes_nothing_and_the_next_commits(node):
    services, fleet = node(2)
    v1, v2, v3 = model(1), model(2), model(3)
    asyncio.run(push(services, v1, "v1"))
    shadowless = services.store.held_bytes
    fleet.workers[1].fault = failing("receive_bucket", 3, DataLoss("BUCKET_CHECKSUM_MISMATCH", "injected"))
    with pytest.raises(WeightSyncError) as caught:
        asyncio.run(push(services, v2, "v2"))
    assert caught.value.reason == "BUCKET_CHECKSUM_MISMATCH"
    store = services.store
    assert (store.state, services.publisher.version.version) == (pb.STORE_STATE_CONSISTENT, "v1")
    assert held(store) == expected(v1)  # the base, bit for bit, whatever owner 0 wrote into the shadows
    assert store.held_bytes > shadowless  # the shadows stay for the next STAGED update
    assert [w.receiver.update for w in fleet.workers] == [None, None]  # every owner aborted
    asyncio.run(push(services, v3, "v3"))
    assert held(store) == expected(v3) and services.publisher.version.generation == 2


def test_an_update_is_counted_in_the_metrics_before_the_client_sees_it_committed(node):
    services, _ = node(2)
    registry = services.metrics.registry
    labels = {"transport": "inline", "mode": "staged", "outcome": "committed"}
    counted_at_commit = []

    def note(response: pb.UpdateWeightsResponse) -> None:
        if response.HasField("committed"):
            counted_at_commit.append(registry.get_sample_value("weightsync_update_duration_seconds_count", labels))

    responses = asyncio.run(push(services, model(1), "v1", on_response=note))
    assert counted_at_commit == [1.0]  # a raw-gRPC trainer that scrapes right after `committed` finds it
    assert registry.get_sample_value("weightsync_update_duration_seconds_count", labels) == 1.0  # once, not twice
    assert registry.get_sample_value("weightsync_buckets_applied_total", {"transport": "inline"}) == \
        responses[0].ready.bucket_count


def test_an_in_place_update_marks_dirty_only_what_an_owner_may_have_written(node):
    services, fleet = node(2)
    v1, v2 = model(1), model(2)
    asyncio.run(push(services, v1, "v1", mode=pb.UPDATE_MODE_IN_PLACE))
    plan = plan_buckets(list(v2.items()), 8192)
    with pytest.raises(WeightSyncError):
        asyncio.run(push(services, v2, "v2", mode=pb.UPDATE_MODE_IN_PLACE, stop_after=3))
    store = services.store
    written = {t.name for b in plan.buckets[:3] for t in b.tensors}
    assert store.state == pb.STORE_STATE_INCONSISTENT and store.dirty == written
    assert {n: v for n, v in held(store).items() if n not in written} == {
        n: v for n, v in expected(v1).items() if n not in written}
    asyncio.run(push(services, v2, "repair", mode=pb.UPDATE_MODE_IN_PLACE))
    assert store.state == pb.STORE_STATE_CONSISTENT and held(store) == expected(v2)


def test_a_dead_owner_fails_the_update_and_loses_nothing(node):
    services, fleet = node(2)
    v1, v2 = model(1), model(2)
    asyncio.run(push(services, v1, "v1"))
    fleet.workers[0].fault = failing("receive_bucket", 2, KillWorker())
    with pytest.raises(WeightSyncError) as caught:
        asyncio.run(push(services, v2, "v2"))
    assert caught.value.reason == "WORKER_DIED"
    assert held(services.store) == expected(v1)  # the store is the server's: nothing died with the worker
    assert services.store.state == pb.STORE_STATE_CONSISTENT


@pytest.mark.parametrize("transport", [pb.TRANSPORT_SHM, pb.TRANSPORT_COLLECTIVE], ids=["shm", "collective"])
def test_a_chunk_on_a_stream_whose_transport_sends_none_is_refused_and_changes_nothing(node, transport):
    """Each transport has its own intake: only INLINE's takes BucketChunks; the others refuse one."""
    services, fleet = node(2)
    v1, v2 = model(1), model(2)
    asyncio.run(push(services, v1, "v1"))
    plan = plan_buckets(list(v2.items()), 8192)
    begin = pb.BeginUpdate(version="chunked", mode=pb.UPDATE_MODE_IN_PLACE, transport=transport)
    session = UpdateSession(services, "u-chunked", None, begin, plan, plan_id_of(plan))

    async def requests():
        yield pb.UpdateWeightsRequest(bucket_chunk=pb.BucketChunk(sequence=0, offset_bytes=0, data=b"z" * 64))

    async def run() -> list[pb.UpdateWeightsResponse]:
        return [response async for response in session.run(requests())]

    with pytest.raises(WeightSyncError) as caught:
        asyncio.run(run())
    assert (caught.value.code.name, caught.value.reason) == ("INVALID_ARGUMENT", "CHUNK_UNEXPECTED")
    assert [w.commands.count("receive_bucket") for w in fleet.workers] == [6 // 2, 6 // 2]  # v1's only
    store = services.store
    assert (store.state, services.publisher.version.version) == (pb.STORE_STATE_CONSISTENT, "v1")
    assert held(store) == expected(v1)
    asyncio.run(push(services, v2, "v2"))
    assert held(store) == expected(v2) and services.publisher.version.generation == 2


def test_admission_counts_the_store_once_and_host_staging(node):
    services, fleet = node(2, host_limit_bytes=64 << 10, store_held_bytes=lambda: 0)
    big = {"w": torch.randn(20000)}  # 80 KB of new store: over the 64 KiB limit
    with pytest.raises(ResourceExhausted) as caught:
        asyncio.run(push(services, big, "big", bucket=1 << 20))
    assert caught.value.reason == "HOST_OUT_OF_MEMORY"
    assert services.store.state == pb.STORE_STATE_EMPTY and services.store.held_bytes == 0
    worker = fleet.workers[0]
    admission = MemoryAdmission(host_limit_bytes=1 << 20, available=lambda: 1 << 40)
    admission.check(store_bytes=512 << 10, staging=[StagingNeed(worker, 256 << 10, on_device=False)])
    with pytest.raises(ResourceExhausted):
        admission.check(store_bytes=900 << 10, staging=[StagingNeed(worker, 256 << 10, on_device=False)])


def test_the_gate_refuses_a_second_update_and_lets_one_that_only_cleans_up_wait():
    class Session:
        update_id = "first"
        finished = False

    async def scenario() -> None:
        gate, first = UpdateGate(), Session()
        async with gate.running(first):
            with pytest.raises(FailedPrecondition) as caught:
                gate.require_idle()
            assert (caught.value.reason, caught.value.metadata["update_id"]) == ("UPDATE_IN_PROGRESS", "first")
            first.finished = True  # committed: only its clean-up runs
            gate.require_idle()
            waiting = asyncio.ensure_future(gate.wait_idle())
            await asyncio.sleep(0)
            assert not waiting.done()
        await asyncio.wait_for(waiting, 1)
        assert gate.running_update() is None

    asyncio.run(scenario())


def test_the_group_registry_owns_every_transition():
    async def scenario() -> None:
        registry = GroupRegistry(_gone)
        record = GroupRecord("g", 3, 1, pb.BACKEND_GLOO, datetime.timedelta(seconds=5), "127.0.0.1", 1)
        registry.add(record)
        assert record.state == pb.GROUP_STATE_JOINING
        registry.joined(record)
        assert record.state == pb.GROUP_STATE_READY
        registry.update_started(record)
        assert record.updating
        registry.mark_broken("g", "COLLECTIVE_FAILED: first")
        registry.mark_broken("g", "WORKER_DIED: second")
        assert (record.state, record.broken_reason) == (pb.GROUP_STATE_BROKEN, "COLLECTIVE_FAILED: first")
        registry.joined(record)  # a late join answer does not revive a broken group
        assert record.state == pb.GROUP_STATE_BROKEN
        registry.update_ended(record)
        assert not record.updating

    asyncio.run(scenario())


def test_the_publisher_keeps_its_store_epoch_and_counts_generations():
    store = NodeStore()
    publisher = Publisher(store, EngineRegistry())
    epoch = publisher.version.store_epoch
    assert epoch > 0 and publisher.next_generation == 1
    first = publisher.publish_version("a")
    second = publisher.publish_version("b")
    assert [(v.version, v.generation, v.store_epoch) for v in (first, second)] == [("a", 1, epoch), ("b", 2, epoch)]
    assert Publisher(NodeStore(), EngineRegistry()).version.store_epoch != epoch  # a new store, a new epoch
    assert publisher.store_state() == pb.STORE_STATE_EMPTY
    store.close()
