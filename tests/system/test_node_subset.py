"""A node that holds a subset (`--tensors REGEX`): it stores and receives only its tensors, a bucket
with none of them reaches none of its workers, and verify, patches and engines see that subset."""

from __future__ import annotations

import re
import subprocess
import sys

import grpc
import pytest
import torch

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.client.buckets.planning import build_plan
from weightsync.common.ownership import NO_OWNER, bucket_owners
from weightsync.engine import EngineClient, EngineError, ModuleFollower
from weightsync.server.config import config_from_args
from weightsync.server.store.update_plan import derive_update_plan
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server

pytestmark = pytest.mark.timeout(240)
BUCKET = 256 << 10
FIRST = r"^(embed|layers\.[01]\.)"
"""Node A: pipeline stage 0."""
SECOND = r"^(head|layers\.[23]\.)"
"""Node B: stage 1."""


def model(seed: int) -> dict[str, torch.Tensor]:
    """Four 384 KiB layers (a bucket each) and small norms, packed together into buckets that hold
    tensors of both stages."""
    g = torch.Generator().manual_seed(seed)
    named: dict[str, torch.Tensor] = {"embed": torch.randn(96 * 1024, generator=g).to(torch.bfloat16)}
    for i in range(4):
        named[f"layers.{i}.w"] = torch.randn(192 * 1024, generator=g).to(torch.bfloat16)
        named[f"layers.{i}.norm"] = torch.randn(512, generator=g)
    named["head"] = torch.randn(96 * 1024, generator=g).to(torch.bfloat16)
    return named


def part(named: dict[str, torch.Tensor], pattern: str) -> dict[str, torch.Tensor]:
    return {n: t for n, t in named.items() if re.search(pattern, n)}


def expected_received(named: dict[str, torch.Tensor], pattern: str, workers: int) -> list[int]:
    """Bytes each worker of a node with this subset receives for one dense push of `named`."""
    planned = build_plan(list(named.items()), BUCKET)
    not_stored = {k for k, b in enumerate(planned) if not any(re.search(pattern, t.name) for t in b.spec.tensors)}
    owners = bucket_owners([b.spec.size_bytes for b in planned], workers, not_stored)
    assert NO_OWNER in owners and len(set(owners)) == workers + 1  # the model really spans both nodes
    return [sum(b.spec.size_bytes for b, o in zip(planned, owners, strict=True) if o == w) for w in range(workers)]


def received(server) -> list[int]:
    return [w.received_bytes for w in server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).workers]


@pytest.fixture
def stages(tmp_path):
    started = []
    for name, pattern in (("a", FIRST), ("b", SECOND)):
        (tmp_path / name).mkdir()
        started.append(start_server(tmp_path / name, "--tensors", pattern, workers=2))
    yield started
    for server in started:
        assert server.stop() == 0, server.log()[-2000:]


@pytest.mark.parametrize("transport", ["collective", "inline"])
def test_each_node_stores_and_receives_only_its_stage(stages, transport):
    a, b = stages
    v1, v2 = model(1), model(2)
    with WeightSyncClient([a.address, b.address], timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=30)
        client.push(v1, version="v1", transport=transport, bucket_size_bytes=BUCKET, allow_new_tensors=True)
        assert received(a) == expected_received(v1, FIRST, 2)
        assert received(b) == expected_received(v1, SECOND, 2)
        result = client.push(v2, version="v2", transport=transport, bucket_size_bytes=BUCKET, mode="staged",
                             delta=False)
        assert received(a) == [2 * n for n in expected_received(v2, FIRST, 2)]  # the same buckets again, no more
        assert received(b) == [2 * n for n in expected_received(v2, SECOND, 2)]
        assert {o.server: o.size_bytes for o in result.servers} == {
            a.address: sum(expected_received(v2, FIRST, 2)), b.address: sum(expected_received(v2, SECOND, 2))}
        assert server_checksums(a) == [local_checksums(part(v2, FIRST))]  # exactly its tensors, bit for bit
        assert server_checksums(b) == [local_checksums(part(v2, SECOND))]
        assert client.verify(v2).ok  # each node answers for its part; the rest is not its to hold
        assert not client.verify(v1).ok
    for server, pattern in ((a, FIRST), (b, SECOND)):
        info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.store.tensor_filter == pattern and info.store.tensor_count == len(part(v2, pattern))
        with EngineClient(server=server.address, name="stage") as engine, engine.acquire() as snapshot:
            assert snapshot.version.version == "v2"
            assert sorted(snapshot.tensors) == sorted(part(v2, pattern))
            assert all(torch.equal(snapshot.tensors[n].view(torch.uint8), t.view(torch.uint8))
                       for n, t in part(v2, pattern).items())


def test_checksums_name_what_a_node_does_not_store_and_refuse_what_it_lacks(stages):
    a, _ = stages
    v1 = model(1)
    with WeightSyncClient(a.address, timeout=60) as client:
        client.push(v1, version="v1", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
    answer = a.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(names=["embed", "head", "layers.3.w"]))
    assert [t.name for t in answer.tensors] == ["embed"] and list(answer.not_stored) == ["head", "layers.3.w"]
    with pytest.raises(grpc.RpcError) as missing:
        a.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(names=["embed", "layers.0.gone"]))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    described = subprocess.run([sys.executable, "-m", "weightsync.client.cli.main", "info", "--server", a.address],
                               capture_output=True, text=True, timeout=60)
    assert f"subset       only tensors matching {FIRST!r} (--tensors)" in described.stdout.splitlines()


def test_patches_reach_only_the_node_of_each_tensor_and_a_refusal_on_one_stage_changes_nothing(stages):
    a, b = stages
    current = model(1)
    with WeightSyncClient([a.address, b.address], timeout=60) as client:
        client.push(current, version="v1", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
        step = {n: t.clone() for n, t in current.items()}
        step["layers.0.w"][::97] += 1  # about 1% of stage 0, and of stage 1 below
        step["layers.3.w"][5::89] -= 1
        patched = client.push(step, version="v2", transport="inline", bucket_size_bytes=BUCKET, delta=True)
        assert patched.bytes_sent < 0.1 * patched.dense_bytes
        assert client.verify(step).ok
        # A new tensor of stage 1 without allow_new_tensors: node B refuses it; node A would have
        # ignored it (not its tensor), and the push is aborted on both.
        bad = dict(step, **{"layers.3.extra": torch.ones(8)})
        with pytest.raises(UpdateFailed) as refused:
            client.push(bad, version="bad", transport="inline", bucket_size_bytes=BUCKET)
        assert refused.value.reason == "TENSOR_UNKNOWN" and refused.value.server == b.address
        assert server_checksums(a) == [local_checksums(part(step, FIRST))]
        assert server_checksums(b) == [local_checksums(part(step, SECOND))]
        # Only stage 0's tensors are new on a node that stores stage 0 alone: nothing to allow there.
        after = dict(step, **{"layers.1.extra": torch.full((8,), 3.0)})
        with pytest.raises(UpdateFailed) as refused_on_a:
            client.push(after, version="bad2", transport="inline", bucket_size_bytes=BUCKET)
        assert refused_on_a.value.server == a.address
        grown = client.push(after, version="v3", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
        assert grown.version == "v3" and client.verify(after).ok
        assert "layers.1.extra" in server_checksums(a)[0] and "layers.1.extra" not in server_checksums(b)[0]


def test_a_bucket_routes_nowhere_or_through_staging_by_what_the_node_stores():
    plan = tensor_pb2.WeightPlan(buckets=[
        tensor_pb2.BucketSpec(size_bytes=64, tensors=[
            tensor_pb2.TensorSpec(name="head", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[16], size_bytes=64)]),
        tensor_pb2.BucketSpec(size_bytes=128, tensors=[
            tensor_pb2.TensorSpec(name="embed", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[16], size_bytes=64),
            tensor_pb2.TensorSpec(name="head.bias", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[16], offset_bytes=64,
                                  size_bytes=64)]),
    ])
    derived = derive_update_plan(plan=plan, plan_id="p", mode=pb.UPDATE_MODE_STAGED, allow_new_tensors=True,
                                 tensors={}, segment_signatures=[], segment_sizes=[], layout_version=0,
                                 stores=lambda name: name == "embed")
    assert derived.not_stored == (0,)
    mixed = derived.routes[1]
    assert mixed.stored and not mixed.direct and [c.src_offset for c in mixed.copies] == [0]
    assert [t.name for t in derived.new_tensors] == ["embed"] and derived.names == frozenset({"embed"})
    assert bucket_owners([64, 128, 64], 2, {0}) == [NO_OWNER, 0, 1]


def test_a_filter_that_is_not_a_regex_is_refused_at_start_up():
    assert config_from_args(["--tensors", r"^layers\.[0-3]\."]).tensors == r"^layers\.[0-3]\."
    with pytest.raises(ValueError, match="not a regular expression"):
        config_from_args(["--tensors", "layers.(["])


def test_shm_to_a_node_with_a_subset(stages):
    """SHM: the buckets the node does not store are announced and nobody reads their slots; the
    next buckets reuse those slots in order."""
    a, _ = stages
    v1, v2 = model(1), model(2)
    with WeightSyncClient(a.address, timeout=60) as client:
        client.push(v1, version="v1", transport="shm", bucket_size_bytes=BUCKET, allow_new_tensors=True)
        client.push(v2, version="v2", transport="shm", bucket_size_bytes=BUCKET, delta=False)
        assert server_checksums(a) == [local_checksums(part(v2, FIRST))]
        assert received(a) == [2 * n for n in expected_received(v2, FIRST, 2)]
        assert client.verify(v2).ok


EXTRA = r"^extra\."
"""A node for tensors the model of these tests does not have (until a test adds them)."""


def store_of(server) -> tuple[int, int]:
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return info.store_state, info.current_version.generation


def test_a_pattern_that_matches_nothing_is_refused_at_the_first_plan_and_verify_says_so(tmp_path):
    """A node whose --tensors matches none of the model's names would commit an EMPTY store at every
    push, and verify would find nothing to compare there: its first plan is refused (naming the
    pattern), verify fails naming it, and a model with its tensors then commits on every node."""
    servers = []
    for name, pattern in (("a", FIRST), ("c", EXTRA)):
        (tmp_path / name).mkdir()
        servers.append(start_server(tmp_path / name, "--tensors", pattern, workers=2))
    a, c = servers
    try:
        v1 = model(1)
        with WeightSyncClient([a.address, c.address], timeout=60) as client:
            with pytest.raises(UpdateFailed) as refused:
                client.push(v1, version="v1", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
            failure = refused.value
            assert (failure.code, failure.reason, failure.server) == (
                grpc.StatusCode.FAILED_PRECONDITION, "TENSOR_FILTER_MATCHES_NOTHING", c.address)
            assert f"--tensors {EXTRA!r}" in failure.cause.message
            assert failure.cause.metadata["tensor_filter"] == EXTRA
            assert failure.cause.metadata["tensors"] == str(len(v1)) and failure.cause.metadata["tensor"] in v1
            assert store_of(a) == store_of(c) == (pb.STORE_STATE_EMPTY, 0)  # aborted on both, nothing committed
            # verify: A lacks its part; C stores none of the names asked for, so it vouches for nothing.
            checked = client.verify(v1)
            assert not checked.ok
            on_c = [m for m in checked.mismatches if m.server == c.address]
            assert sorted(m.name for m in on_c) == sorted(v1) and all(m.remote is None for m in on_c)
            # The next normal push: a model with node C's tensors commits on both, and verifies.
            grown = dict(v1, **{"extra.w": torch.arange(8, dtype=torch.float32)})
            client.push(grown, version="v2", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
            assert server_checksums(a) == [local_checksums(part(grown, FIRST))]
            assert server_checksums(c) == [local_checksums(part(grown, EXTRA))]
            assert client.verify(grown).ok
            # Once C holds its part, a partial update of other stages' tensors passes it by.
            step = {"layers.0.w": grown["layers.0.w"] + 1}
            client.push(step, version="v3", transport="inline", bucket_size_bytes=BUCKET, delta=False)
            assert store_of(c) == (pb.STORE_STATE_CONSISTENT, 2)
            assert client.verify(dict(grown, **step)).ok
    finally:
        for server in servers:
            assert server.stop() == 0, server.log()[-2000:]


def test_verify_fails_on_a_node_that_stores_none_of_the_tensors_asked_for(stages):
    a, b = stages
    v1 = model(1)
    with WeightSyncClient([a.address, b.address], timeout=60) as client:
        client.push(v1, version="v1", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
        assert client.verify(v1).ok
        second = client.verify(part(v1, SECOND))  # node A holds none of them: it cannot vouch for them
        assert not second.ok and {m.server for m in second.mismatches} == {a.address}
        assert sorted(m.name for m in second.mismatches) == sorted(part(v1, SECOND))
        assert all(m.remote is None for m in second.mismatches)
        # A mix of both stages: each node answers for its part.
        assert client.verify({n: v1[n] for n in ("embed", "head")}).ok
        assert not client.verify({"embed": v1["embed"], "head": v1["head"] + 1}).ok
        v2 = model(2)  # the next normal push, and a verify of everything
        client.push(v2, version="v2", transport="inline", bucket_size_bytes=BUCKET, delta=False)
        assert client.verify(v2).ok
    with WeightSyncClient(b.address, timeout=60) as client:  # a client of node B alone verifies stage 1
        assert client.verify(part(v2, SECOND)).ok


class Whole(torch.nn.Module):
    """The whole model of these tests as a module: its state_dict names are model()'s."""

    def __init__(self) -> None:
        super().__init__()
        like = model(0)
        self.embed = torch.nn.Parameter(torch.zeros_like(like["embed"]))
        self.head = torch.nn.Parameter(torch.zeros_like(like["head"]))
        self.layers = torch.nn.ModuleList()
        for i in range(4):
            layer = torch.nn.Module()
            layer.w = torch.nn.Parameter(torch.zeros_like(like[f"layers.{i}.w"]))
            layer.norm = torch.nn.Parameter(torch.zeros_like(like[f"layers.{i}.norm"]))
            self.layers.append(layer)


def test_a_strict_follower_of_a_subset_node_names_what_the_node_does_not_hold(stages):
    a, _ = stages
    v1 = model(1)
    with WeightSyncClient(a.address, timeout=60) as client:
        client.push(v1, version="v1", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
    net = Whole()
    before = {n: t.detach().clone() for n, t in net.state_dict().items()}
    outside = sorted(set(v1) - set(part(v1, FIRST)))
    with EngineClient(server=a.address, name="whole") as engine:
        with pytest.raises(EngineError) as caught:
            ModuleFollower(engine, net).update()  # strict by default
        assert caught.value.reason == "TENSOR_NOT_IN_STORE"
        assert caught.value.metadata == {"count": str(len(outside)), "tensors": ",".join(outside)}
        assert all(torch.equal(net.state_dict()[n], t) for n, t in before.items())  # nothing was copied
        status = {e.name: e for e in a.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}["whole"]
        assert status.state == pb.ENGINE_STATE_FAILED and "TENSOR_NOT_IN_STORE" in status.last_error
        # strict=False: the node's part is applied, the rest stays as it was.
        follower = ModuleFollower(engine, net, strict=False)
        assert follower.update() is True
        state = net.state_dict()
        assert all(torch.equal(state[n], t) for n, t in part(v1, FIRST).items())
        assert all(torch.equal(state[n], before[n]) for n in outside)
        # The next normal push, a verify, and the follower takes it.
        v2 = model(2)
        with WeightSyncClient(a.address, timeout=60) as client:
            client.push(v2, version="v2", transport="inline", bucket_size_bytes=BUCKET, delta=False)
            assert client.verify(v2).ok
        assert follower.update() is True and follower.applied_version == "v2"
        assert all(torch.equal(net.state_dict()[n], t) for n, t in part(v2, FIRST).items())


def test_a_strict_follower_counts_a_tied_weight_once():
    """strict: a model tensor the store fills under another name (tied weights) is not missing."""
    from weightsync.engine.follower import ModuleFollower as Follower

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(4, 4, bias=False)
            self.head = torch.nn.Linear(4, 4, bias=False)
            self.head.weight = self.embed.weight

    class Snapshot:
        def __init__(self, names: list[str]) -> None:
            self.tensors = dict.fromkeys(names, torch.zeros(4, 4))

    follower = Follower(None, Tied())  # type: ignore[arg-type]
    follower._require_whole_model(Snapshot(["embed.weight"]))  # type: ignore[arg-type]
    follower._require_whole_model(Snapshot(["head.weight"]))  # type: ignore[arg-type]
    with pytest.raises(EngineError) as caught:
        follower._require_whole_model(Snapshot(["other"]))  # type: ignore[arg-type]
    assert caught.value.metadata["tensors"] == "embed.weight,head.weight"
