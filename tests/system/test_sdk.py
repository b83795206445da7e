"""The trainer SDK against real servers."""

from __future__ import annotations

import grpc
import pytest
import torch

from weightsync.client import PushProgress, UpdateFailed, WeightSyncClient, WeightSyncRpcError
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, shm_segments, start_server
from models import mixed_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    servers = [start_server(tmp_path_factory.mktemp(f"s{i}")) for i in range(2)]
    segments = set().union(*(s.segments() for s in servers))
    yield servers
    assert [s.stop() for s in servers] == [0, 0]
    assert segments & shm_segments() == set()


def test_single_server_in_place_staged_reuse_and_iterator(server):
    model = mixed_model(11)
    reports: list[PushProgress] = []
    with WeightSyncClient([server.address]) as client:
        # The module's server: another test may have pushed (other tensors) before this one.
        base = client.server_info()[0].current_version.generation
        client.create_group(timeout=30)
        first = client.push(model, version="s1", bucket_size_bytes=1 << 20, progress=reports.append,
                            allow_new_tensors=True)
        assert (first.version, first.tensor_count, first.bucket_count) == ("s1", len(model), 3)
        assert first.plan_reused is False
        assert [r.bucket for r in reports] == [0, 1, 2]
        assert reports[-1].bytes_sent == reports[-1].total_bytes == first.size_bytes
        assert [(o.version, o.generation) for o in first.servers] == [("s1", base + 1)]
        assert client.verify(model).ok
        assert server_checksums(server, sorted(model)) == [local_checksums(model)]  # others may be stored too

        staged = mixed_model(12)
        second = client.push(staged, version="s2", mode="staged", bucket_size_bytes=1 << 20)
        assert second.plan_reused is True  # same names, dtypes, shapes, layout
        assert second.servers[0].fast_path_buckets == 3  # every bucket lands straight in its segment
        assert server_checksums(server, sorted(staged)) == [local_checksums(staged)]

        # An iterator repeating the plan is streamed bucket by bucket.
        streamed = mixed_model(13)
        pulled: list[str] = []

        def layers():
            for name, tensor in streamed.items():
                pulled.append(name)
                yield name, tensor

        third = client.push(layers(), version="s3", bucket_size_bytes=1 << 20)
        assert third.plan_reused is True
        assert pulled == list(streamed)
        assert client.verify(streamed).ok
        assert [o.generation for o in third.servers] == [base + 3]


def test_typed_errors_name_server_and_reason(server):
    model = mixed_model(21)
    with WeightSyncClient([server.address]) as client:
        client.create_group(timeout=30)
        client.push(model, version="e1", bucket_size_bytes=1 << 20, allow_new_tensors=True)
        bad = dict(model)
        bad["layers.0.attn.q_proj.bias"] = torch.zeros(31)
        with pytest.raises(UpdateFailed) as caught:
            client.push(bad, version="e2", bucket_size_bytes=1 << 20)
        assert caught.value.server == server.address
        assert caught.value.reason == "TENSOR_SHAPE_MISMATCH"
        assert isinstance(caught.value.cause, WeightSyncRpcError)
        assert caught.value.cause.code == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.cause.metadata["tensor"] == "layers.0.attn.q_proj.bias"
        # Nothing was harmed: the next push commits and verifies.
        result = client.push(mixed_model(22), version="e3", bucket_size_bytes=1 << 20)
        assert client.verify(mixed_model(22)).ok
        assert result.servers[0].version == "e3"
        # IN_PLACE: an iterator is materialised and checked before a byte moves.
        def wrong():
            yield from [("not.in.plan", torch.zeros(3))]

        with pytest.raises(UpdateFailed) as caught:
            client.push(wrong(), version="e4", bucket_size_bytes=1 << 20)
        assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_UNKNOWN")
        # STAGED: streamed against the committed plan; departing from it aborts with nothing changed.
        with pytest.raises(UpdateFailed) as caught:
            client.push(wrong(), version="e5", mode="staged", bucket_size_bytes=1 << 20)
        assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PLAN_MISMATCH")
        assert client.verify(mixed_model(22)).ok


def test_large_tensors_stream_without_copies(server):
    model = {f"big.{i}": torch.randn(1 << 20) for i in range(3)} | {"small.a": torch.randn(10), "small.b": torch.randn(7)}
    model = {"small.a": model["small.a"], "big.0": model["big.0"], "big.1": model["big.1"], "small.b": model["small.b"], "big.2": model["big.2"]}
    with WeightSyncClient([server.address]) as client:
        client.create_group(timeout=30)
        first = client.push(model, version="z1", allow_new_tensors=True)
        assert (first.bucket_count, first.zero_copy_buckets) == (4, 3)
        streamed = {k: v + 1 for k, v in model.items()}
        second = client.push(iter(streamed.items()), version="z2")
        assert second.plan_reused and second.zero_copy_buckets == 3
        assert client.verify(streamed).ok


def test_flat_parameter_is_sent_without_a_pack_copy(server):
    flat = torch.randn(3 * 4096 + 100)
    views = {
        "flat.a": flat[:4096].view(64, 64),
        "flat.b": flat[4096 : 2 * 4096],
        "flat.c": flat[2 * 4096 : 3 * 4096 + 100],
    }
    with WeightSyncClient([server.address]) as client:
        client.create_group(timeout=30)
        result = client.push(views, version="flat", bucket_size_bytes=1 << 20, allow_new_tensors=True)
        assert result.zero_copy_buckets == result.bucket_count == 1
        assert result.size_bytes == flat.numel() * 4
        assert client.verify(views).ok


def test_two_servers_one_group_and_verify_catches_divergence(two_servers):
    a, b = two_servers
    model = mixed_model(31)
    with WeightSyncClient([a.address, b.address]) as client:
        bases = [info.current_version.generation for info in client.server_info()]
        client.create_group(timeout=30)
        groups = client.list_groups()
        assert [g.rank_offset for g in groups[a.address]] == [1]
        assert [g.rank_offset for g in groups[b.address]] == [3]
        assert {g.world_size for gs in groups.values() for g in gs} == {5}
        result = client.push(model, version="m1", bucket_size_bytes=1 << 20)
        assert [o.server for o in result.servers] == [a.address, b.address]
        assert [o.generation for o in result.servers] == [g + 1 for g in bases]
        assert client.verify(model).ok
        staged = client.push(mixed_model(32), version="m2", mode="staged", bucket_size_bytes=1 << 20)
        assert [o.version for o in staged.servers] == ["m2", "m2"]

        # Someone else pushes different values to server b only.
        with WeightSyncClient([b.address]) as other:
            other.create_group(timeout=30)
            tampered = mixed_model(32)
            tampered["step"] = torch.tensor(-1, dtype=torch.int64)
            other.push(tampered, version="rogue", bucket_size_bytes=1 << 20)
        check = client.verify(mixed_model(32))
        assert not check.ok
        assert {(m.server, m.name) for m in check.mismatches} == {(b.address, "step")}


def test_push_without_group_and_bad_arguments(tmp_path):
    from weightsync.client import WeightSyncClientError

    fresh = start_server(tmp_path)  # its own server: nothing another test pushed
    try:
        with WeightSyncClient(fresh.address) as client:
            with pytest.raises(WeightSyncClientError, match="create_group"):
                client.push({"x": torch.zeros(1)}, version="v")
            info = client.server_info()[0]
            assert (info.store_state, info.current_version.generation) == (pb.STORE_STATE_EMPTY, 0)  # nothing sent
            with pytest.raises(ValueError, match="mode must be"):
                client.push({"x": torch.zeros(1)}, version="v", mode="sideways", transport="inline")
            client.push({"x": torch.ones(1)}, version="after", transport="inline")  # the next call works
            assert client.verify({"x": torch.ones(1)}).ok
    finally:
        assert fresh.stop() == 0
    with pytest.raises(ValueError, match="host:port"):
        WeightSyncClient(["nocolon"])


def test_plan_is_reused_while_the_layout_holds(server, monkeypatch):
    import weightsync.client.push.plans as plan_choice

    calls = []
    real = plan_choice.build_plan
    monkeypatch.setattr(plan_choice, "build_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = {"big": torch.randn(1 << 20), "small": torch.randn(5)}
    with WeightSyncClient([server.address]) as client:
        client.create_group(timeout=30)
        client.push(model, version="r1", allow_new_tensors=True)
        model["big"].add_(1.0)  # in place: same memory, same plan
        client.push(model, version="r2")
        assert len(calls) == 1
        assert client.verify(model).ok
        model["big"] = torch.randn(1 << 20)  # a new tensor, the same layout: the plan rebound to it
        result = client.push(model, version="r3")
        assert len(calls) == 1 and result.plan_reused and result.zero_copy_buckets == 1
        assert client.verify(model).ok  # its bytes, not the old tensor's
        flat = torch.randn((1 << 20) + 5)  # both in one storage: a flat run, a layout of its own
        model = {"big": flat[: 1 << 20], "small": flat[1 << 20:]}
        client.push(model, version="r4")
        assert len(calls) == 2
        assert client.verify(model).ok
        flat = torch.randn((1 << 20) + 5)  # the same layout in new memory: rebound again
        model = {"big": flat[: 1 << 20], "small": flat[1 << 20:]}
        client.push(model, version="r5")
        assert len(calls) == 2
        assert client.verify(model).ok
        apart = {"big": torch.randn(1 << 20), "small": flat[1 << 20:]}  # one storage no longer shared
        client.push(apart, version="r6")
        assert len(calls) == 3
        assert client.verify(apart).ok
        offset = {"big": torch.randn((1 << 20) + 8)[8:], "small": torch.randn(5)}  # the same shapes elsewhere in a storage
        client.push(offset, version="r7")
        assert len(calls) == 4
        assert client.verify(offset).ok


def test_a_server_restarted_with_smaller_messages_is_asked_again_after_a_failed_push(tmp_path):
    """The SDK keeps what GetServerInfo said (chunk size, worker counts) between pushes. A server restarted
    at the same address with a smaller --max-message-bytes refuses the chunks cut for the old one: that push
    fails, and the next one asks again and cuts chunks the new server takes. (The new limit still lets the
    old chunks through gRPC, so the refusal is the server's own, typed: an over-long message is gRPC's
    RESOURCE_EXHAUSTED or, racing the stream's reset, INTERNAL.)"""
    old_limit, new_limit = 2 << 20, (2 << 20) - (32 << 10)
    first = start_server(tmp_path, "--max-message-bytes", str(old_limit), workers=1)
    address = first.address
    tensors = {"w": torch.arange(3 << 20, dtype=torch.int32)}  # 12 MiB: chunks of old_limit - 64 KiB
    with WeightSyncClient(address, timeout=60) as client:
        client.push(tensors, version="v0", transport="inline", allow_new_tensors=True, delta=False)
        assert first.stop() == 0
        second = start_server(tmp_path, "--listen", address, "--max-message-bytes", str(new_limit), workers=1)
        try:
            with pytest.raises(UpdateFailed) as failed:
                client.push(tensors, version="v1", transport="inline", allow_new_tensors=True, delta=False)
            assert (failed.value.code, failed.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "CHUNK_SIZE_INVALID")
            result = client.push(tensors, version="v2", transport="inline", allow_new_tensors=True, delta=False)
            assert result.bytes_sent == 12 << 20
            info = client.server_info()[0]
            assert (info.current_version.version, info.store_state) == ("v2", pb.STORE_STATE_CONSISTENT)
            assert info.limits.max_chunk_bytes == new_limit - (64 << 10)
            assert client.verify(tensors).ok
            assert server_checksums(second) == [local_checksums(tensors)]
        finally:
            assert second.stop() == 0, second.log()[-2000:]


def test_the_first_shm_push_after_a_server_restart_maps_the_new_servers_ingress(tmp_path):
    """The SDK keeps the SHM ingress it mapped. A server restarted at the same address has another
    ingress: pushing into the old one left every later push DATA_LOSS (the bytes were not where the new
    server read them). The local connection's end tells the SDK, and the next push maps the new one."""
    first = start_server(tmp_path, "--local-socket", "auto", workers=1)
    address = first.address
    before = {"w": torch.arange(1 << 20, dtype=torch.int32)}
    after = {"w": torch.arange(1 << 20, dtype=torch.int32) * 3}
    with WeightSyncClient(address, timeout=60) as client:
        client.push(before, version="v0", transport="shm", allow_new_tensors=True, delta=False)
        assert first.stop() == 0
        second = start_server(tmp_path, "--local-socket", "auto", "--listen", address, workers=1)
        try:
            for version in ("v1", "v2"):
                result = client.push(after, version=version, transport="shm", allow_new_tensors=True, delta=False)
                assert result.servers[0].version == version
                assert client.verify(after).ok
                assert server_checksums(second) == [local_checksums(after)]
        finally:
            assert second.stop() == 0, second.log()[-2000:]
