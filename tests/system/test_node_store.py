"""One copy per node, with real servers: each bucket is received by exactly one worker of a node (its
owner), the node holds the model once (and its STAGED shadow once), engines read that one store, a
worker's death loses nothing, and owners follow the plan and the worker count, nothing else."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.client.buckets.planning import build_plan
from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server, wait_for

pytestmark = pytest.mark.timeout(240)
BUCKET = 256 << 10
MIB = 1 << 20


def model(seed: int) -> dict[str, torch.Tensor]:
    """12 tensors of 128 KiB: 6 buckets of 256 KiB, split across a node's workers by bytes."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(64 * 1024, generator=g).to(torch.bfloat16) for i in range(12)}


def model_bytes(named: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in named.values())


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def received(server) -> list[int]:
    return [w.received_bytes for w in info(server).workers]


@pytest.fixture
def servers(tmp_path):
    started = []

    def start(workers: int, *extra: str):
        directory = tmp_path / f"s{len(started)}"
        directory.mkdir()
        server = start_server(directory, *extra, workers=workers)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            assert server.stop() == 0, server.log()[-2000:]


def engine_bytes(server) -> dict[str, torch.Tensor]:
    with EngineClient(server=server.address, name="reader") as engine, engine.acquire() as snapshot:
        return {n: t.clone() for n, t in snapshot.tensors.items()}


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("transport", ["collective", "inline"])
def test_each_bucket_reaches_one_worker_and_the_node_holds_one_copy(servers, workers, transport):
    node = servers(workers)
    v1, v2 = model(1), model(2)
    size = model_bytes(v1)
    with WeightSyncClient(node.address, timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=30)
        first = client.push(v1, version="v1", transport=transport, bucket_size_bytes=BUCKET, allow_new_tensors=True)
        planned = build_plan(list(v1.items()), BUCKET)
        assert [b.spec.size_bytes for b in planned] == [BUCKET] * 6
        expected = [6 // workers * BUCKET] * workers  # equal buckets go round-robin: 6 / workers each
        assert received(node) == expected  # each bucket once, by its owner: together exactly the push
        assert sum(expected) == first.size_bytes and min(expected) > 0
        store = info(node).store
        assert size <= store.held_bytes < size + MIB  # one copy, not one per worker
        second = client.push(v2, version="v2", transport=transport, mode="staged", bucket_size_bytes=BUCKET)
        assert received(node) == [2 * e for e in expected]  # the same owners for the same plan
        assert second.plan_reused
        store = info(node).store
        assert 2 * size <= store.held_bytes < 2 * size + MIB  # and one shadow, once
        assert client.verify(v2).ok
    assert server_checksums(node) == [local_checksums(v2)]
    seen = engine_bytes(node)
    assert all(torch.equal(seen[n].view(torch.int16), t.view(torch.int16)) for n, t in v2.items())


def test_a_worker_killed_after_a_commit_loses_nothing_and_takes_its_buckets_again(servers):
    node = servers(2)
    v1, v2 = model(3), model(4)
    with WeightSyncClient(node.address, timeout=60) as client:
        client.push(v1, version="v1", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
        before = info(node)
        victim = before.workers[1]
        with EngineClient(server=node.address, name="steady") as engine:
            os.kill(victim.pid, signal.SIGKILL)
            restarted = wait_for(lambda: (w := info(node).workers[1]).state == pb.WORKER_STATE_RUNNING
                                 and w.pid != victim.pid and w, timeout=60)
            assert restarted.restart_count == victim.restart_count + 1
            assert info(node).store.state == pb.STORE_STATE_CONSISTENT  # any device: the store is the server's
            with engine.acquire() as snapshot:  # the engine keeps reading, across the death
                assert snapshot.version.version == "v1"
                assert all(torch.equal(snapshot.tensors[n].view(torch.int16), t.view(torch.int16))
                           for n, t in v1.items())
        client.push(v2, version="v2", transport="inline", bucket_size_bytes=BUCKET)
        after = info(node).workers
        assert after[1].received_bytes > 0  # the new process received its buckets of v2
        assert after[0].received_bytes > before.workers[0].received_bytes
        assert client.verify(v2).ok


def test_another_worker_count_re_plans_the_owners(servers, tmp_path):
    v1 = model(5)
    assert [b.spec.size_bytes for b in build_plan(list(v1.items()), BUCKET)] == [BUCKET] * 6
    for workers in (1, 3):
        node = servers(workers)
        with WeightSyncClient(node.address, timeout=60) as client:
            client.create_group(timeout=30)
            client.push(v1, version="v1", bucket_size_bytes=BUCKET, allow_new_tensors=True)
            assert received(node) == [6 // workers * BUCKET] * workers  # round-robin: 6 / workers buckets each
            assert client.verify(v1).ok
        assert node.stop() == 0
