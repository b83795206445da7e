"""The SDK compares while it sends (client/delta/deferred.py): on a slow link the kept host tensors go in
deferred buckets, each laid out once compared. Here the link is declared slow (the SDK decides on
its measured throughput: delta_policy.defers_comparison) so that loopback servers exercise it, on
every transport, with two workers a server; every push is verified bit for bit, and every
failure is followed by the next push and a verify."""

from __future__ import annotations

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.client.delta import deferred
from weightsync.client.delta import policy as delta_policy
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_servers

pytestmark = pytest.mark.timeout(300)


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    named = {f"layers.{i}.w": torch.randn(512, 256, generator=g).to(torch.bfloat16) for i in range(6)}
    named["layers.0.b"] = torch.randn(1000, generator=g)
    named["norm"] = torch.ones(128, dtype=torch.bfloat16)
    return named


def step(named: dict[str, torch.Tensor], seed: int, fraction: float) -> dict[str, torch.Tensor]:
    """`fraction` of each tensor's elements moved by one ulp (what a small AdamW step does to bf16)."""
    g = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in named.items()}
    for tensor in new.values():
        flat = tensor.view(-1)
        picks = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
        bits = flat.view(torch.int16) if flat.element_size() == 2 else flat.view(torch.int32)
        bits[picks] ^= 1
    return new


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers shared by the module's tests: each test pushes the same tensors (model()) from a client
    of its own, whose first push is dense and allowed new tensors, so what an earlier test left (its
    version, its kept base) changes nothing a later one checks; each test ends on a verified push."""
    started = start_servers([tmp_path_factory.mktemp(name) for name in ("a", "b")], workers=2)
    yield started
    for server in started:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture
def slow_link(monkeypatch):
    """Every link counts as slow: the SDK defers its comparisons (in groups a small model cuts into several)."""
    monkeypatch.setattr(delta_policy, "DEFER_BELOW_BYTES_PER_SECOND", float("inf"))
    monkeypatch.setattr(deferred, "MIN_GROUP_BYTES", 256 << 10)


@pytest.fixture
def planned(monkeypatch):
    """The deferred buckets of each push: (candidates, room) per bucket."""
    plans: list[list[tuple[int, int]]] = []
    real = deferred.DeferredCompare.__init__

    def spy(self, delta, choice, groups):
        plans.append([(len(g.names), g.capacity) for g in groups])
        real(self, delta, choice, groups)

    monkeypatch.setattr(deferred.DeferredCompare, "__init__", spy)
    return plans


def assert_held(servers, named) -> None:
    for server in servers:
        assert server_checksums(server) == [local_checksums(named)]


def received(server) -> list[int]:
    return [w.received_bytes for w in server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).workers]


@pytest.mark.parametrize("transport", ["collective", "inline", "shm"])
@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_patches_compared_while_they_travel_land_bit_for_bit(servers, slow_link, planned, transport, mode):
    targets = servers[:1] if transport == "shm" else servers
    with WeightSyncClient([s.address for s in targets], timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=60)
        current = model()
        client.push(current, version="v0", transport=transport, mode=mode, allow_new_tensors=True, delta=True)
        before = [received(s) for s in targets]
        for k, fraction in enumerate([0.01, 0.03, 0.001, 0.05, 0.02]):
            current = step(current, seed=k, fraction=fraction)
            result = client.push(current, version=f"v{k + 1}", transport=transport, mode=mode, delta=True)
            assert result.bytes_sent < 0.2 * result.dense_bytes, result
            assert planned and len(planned[-1]) >= 2  # several deferred buckets, one after the other
            assert_held(targets, current)
        assert client.verify(current).ok
        # Each server's two workers took their share of the deferred buckets.
        for server, was in zip(targets, before, strict=True):
            assert all(now > then for now, then in zip(received(server), was, strict=True))


def test_patches_that_outgrow_their_bucket_send_the_update_dense(servers, slow_link, planned, monkeypatch):
    """The samples said sparse; the comparison finds far more changed than the room planned for it:
    the push is aborted and sent dense, bit for bit, and the next one patches again."""
    monkeypatch.setattr(deferred, "ROOM_PER_PATCH_BELOW", 0.05)
    with WeightSyncClient([s.address for s in servers], timeout=60) as client:
        current = model()
        client.push(current, version="v0", transport="inline", allow_new_tensors=True)
        current = step(current, seed=1, fraction=0.03)
        result = client.push(current, version="v1", transport="inline")
        assert result.bytes_sent >= result.dense_bytes
        assert_held(servers, current)
        monkeypatch.setattr(deferred, "ROOM_PER_PATCH_BELOW", 2.0)
        current = step(current, seed=2, fraction=0.01)
        result = client.push(current, version="v2", transport="inline")
        assert result.bytes_sent < 0.1 * result.dense_bytes
        assert_held(servers, current)


def test_a_server_that_refuses_the_base_gets_it_dense_the_other_the_same_patches(servers, slow_link, planned):
    """Someone else pushed to server b: it refuses our base at Begin and gets the update dense;
    server a takes the patches the comparison already made (nothing is compared twice)."""
    a, b = servers
    with WeightSyncClient([a.address, b.address], timeout=60) as client, WeightSyncClient(b.address) as other:
        current = model()
        client.push(current, version="v0", transport="inline", allow_new_tensors=True)
        other.push(current, version="other", transport="inline", delta=False)
        current = step(current, seed=3, fraction=0.01)
        compares = len(planned)
        client.push(current, version="v1", transport="inline")
        assert len(planned) == compares + 1
        assert_held(servers, current)
        current = step(current, seed=4, fraction=0.01)
        result = client.push(current, version="v2", transport="inline")
        assert result.bytes_sent < 0.1 * result.dense_bytes  # both hold our last commit again
        assert_held(servers, current)


def test_a_comparison_that_fails_half_way_fails_the_push_and_the_next_goes_dense(servers, slow_link, planned,
                                                                                    monkeypatch):
    from weightsync.client.delta.base import DeltaBase

    with WeightSyncClient([s.address for s in servers], timeout=60) as client:
        client.create_group(timeout=60)
        current = model()
        client.push(current, version="v0", allow_new_tensors=True)
        real, calls = DeltaBase.compare_deferred, []

        def broken(self, named, threads=0):
            calls.append(len(named))
            if len(calls) == 2:
                raise RuntimeError("the trainer's host ran out of something")
            return real(self, named, threads)

        monkeypatch.setattr(DeltaBase, "compare_deferred", broken)
        current = step(current, seed=5, fraction=0.01)
        with pytest.raises(RuntimeError, match="ran out"):
            client.push(current, version="v1", mode="staged")
        monkeypatch.setattr(DeltaBase, "compare_deferred", real)
        result = client.push(current, version="v1")
        assert result.bytes_sent >= result.dense_bytes  # the copy claims no base after a failure
        assert_held(servers, current)
        current = step(current, seed=6, fraction=0.01)
        result = client.push(current, version="v2")
        assert result.bytes_sent < 0.1 * result.dense_bytes
        assert_held(servers, current)


def test_a_fast_link_compares_first(servers, planned):
    """Loopback measures fast: no deferred bucket (overlapping buys nothing where the bytes take no time)."""
    with WeightSyncClient([s.address for s in servers], timeout=60) as client:
        current = model()
        client.push(current, version="v0", transport="inline", allow_new_tensors=True)
        current = step(current, seed=7, fraction=0.01)
        result = client.push(current, version="v1", transport="inline")
        assert result.bytes_sent < 0.1 * result.dense_bytes and not planned
        assert_held(servers, current)


@pytest.mark.parametrize("transport", ["collective", "inline"])
def test_deferred_buckets_travel_as_zstd_frames(servers, slow_link, planned, transport):
    """A slow link also compresses buckets of patches: each deferred bucket's frame decompresses to
    its layout (not to its room in the plan)."""
    with WeightSyncClient([s.address for s in servers], timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=60)
        current = model()
        client.push(current, version="v0", transport=transport, allow_new_tensors=True, delta=True)
        for k in range(3):
            current = step(current, seed=20 + k, fraction=0.02)
            result = client.push(current, version=f"v{k + 1}", transport=transport, delta=True, compress=True)
            assert 0 < result.compressed_bytes and result.bytes_sent < 0.1 * result.dense_bytes, result
            assert planned and len(planned[-1]) >= 2
            assert_held(servers, current)
