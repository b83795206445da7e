"""The engine side (weightsync.engine) against a real server, with a plain torch module.

The engine maps the worker store read-only through the local socket, applies
versions between forward passes, never sees a torn one, and the server reports
what it serves. (transformers and vLLM engines: tests/engines, make test-engines.)
"""

from __future__ import annotations

import os
import signal
import threading
import warnings

import grpc
import pytest
import torch

from weightsync.client import UpdateFailed
from weightsync.engine import EngineClient, EngineError, ModuleFollower, apply_to_module
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import running_server, sdk_client, wait_for

pytestmark = pytest.mark.timeout(180)


class Net(torch.nn.Module):
    """A small model with parameters and a buffer, in two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False).to(torch.bfloat16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head((self.proj(self.embed(tokens)) * self.scale).to(torch.bfloat16)).float()


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("engine"), "--engine-lease-timeout-seconds", "3") as server:
        yield server


@pytest.fixture(scope="module")
def trainer(node):
    with sdk_client(node) as client:
        yield client


def engines(node) -> dict[str, pb.EngineStatus]:
    return {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}


def test_an_empty_store_cannot_be_acquired(tmp_path):
    """A server of its own: the module's shared one holds whatever the tests before this one pushed."""
    with running_server(tmp_path) as empty, EngineClient(server=empty.address, name="early") as engine, \
            pytest.raises(EngineError) as caught:
        engine.acquire(wait=1)
    assert caught.value.reason == "STORE_EMPTY"


def test_every_engine_reads_the_one_store_whatever_worker_it_names(node, trainer):
    """Servers before 0.3 kept a replica per worker and engines picked one; the node's store is one."""
    with pytest.raises(EngineError) as caught:  # this process has no GPU: said before asking the server
        EngineClient(server=node.address, device="cuda:0")
    assert (caught.value.reason, caught.value.metadata) == ("DEVICE_UNAVAILABLE", {"device": "cuda:0"})
    v1 = weights(1)
    trainer.push(v1, version="one-store", transport="inline", allow_new_tensors=True)
    with pytest.warns(DeprecationWarning, match=r"EngineClient\(worker=\.\.\.\) is deprecated and ignored"):
        a = EngineClient(server=node.address, name="a", worker=1)
    with a:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # without worker=, no warning
            b = EngineClient(server=node.address, name="b")
        with b:
            with a.acquire() as first, b.acquire() as second:
                assert first.version == second.version and first.version.version == "one-store"
                for name, tensor in v1.items():
                    assert torch.equal(first.tensors[name], tensor) and torch.equal(second.tensors[name], tensor)
                    # the same memory: one copy per node, mapped by each engine
                    assert first.tensors[name].untyped_storage().nbytes() == second.tensors[name].untyped_storage().nbytes()


def test_follower_warm_starts_then_applies_only_what_changed(node, trainer):
    v1 = weights(1)
    trainer.push(v1, version="v1", transport="inline", allow_new_tensors=True)
    model = Net()
    with EngineClient(server=node.address, name="follower") as engine:
        follower = ModuleFollower(engine, model)
        assert follower.update() is True  # warm start: every tensor, from the node's store
        assert all(torch.equal(model.state_dict()[k], v) for k, v in v1.items())
        assert follower.update() is False  # nothing newer
        status = engines(node)["follower"]
        assert (status.state, status.applied_version.version, status.kind) == (pb.ENGINE_STATE_SERVING, "v1", "local")
        assert status.commit_to_serving.ToTimedelta().total_seconds() > 0

        v2 = dict(v1)
        v2["proj.weight"] = v1["proj.weight"] * 2
        trainer.push({"proj.weight": v2["proj.weight"]}, version="v2", transport="inline")
        with engine.acquire() as snapshot:
            assert snapshot.changed_since(follower.applied_generation) == ["proj.weight"]
        assert follower.update() is True
        assert all(torch.equal(model.state_dict()[k], v) for k, v in v2.items())
        assert engines(node)["follower"].applied_version.version == "v2"


def test_a_model_that_does_not_match_keeps_its_weights(node, trainer):
    trainer.push(weights(3), version="v3", transport="inline")

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

    other = Other()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with EngineClient(server=node.address, name="mismatch") as engine:
        with pytest.raises(EngineError) as caught, engine.acquire() as snapshot:
            apply_to_module(other, snapshot)
        assert caught.value.reason == "TENSOR_NOT_IN_MODEL" and "embed.weight" in caught.value.metadata["tensors"]
        assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())  # nothing was copied
        status = engines(node)["mismatch"]
        assert status.state == pb.ENGINE_STATE_FAILED and "TENSOR_NOT_IN_MODEL" in status.last_error
        with engine.acquire() as snapshot:  # strict=False takes what the model has
            assert apply_to_module(other, snapshot, strict=False) == ["proj.bias", "proj.weight"]
        assert torch.equal(other.proj.weight, weights(3)["proj.weight"])


def test_an_engine_that_releases_without_applying_is_not_left_applying(node, trainer):
    trainer.push(weights(9), version="v9", transport="inline")
    with EngineClient(server=node.address, name="looker") as engine:
        engine.acquire().release(applied=False)  # looked, applied nothing, no error: it never served
        assert engines(node)["looker"].state == pb.ENGINE_STATE_UNSPECIFIED
        model = Net()
        assert ModuleFollower(engine, model).update()  # the next normal operation
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights(9).items())
        assert (engines(node)["looker"].state, engines(node)["looker"].applied_version.version) == (
            pb.ENGINE_STATE_SERVING, "v9")
        engine.acquire().release(applied=False)  # serving v9 still: SERVING, not APPLYING
        assert (engines(node)["looker"].state, engines(node)["looker"].applied_version.version) == (
            pb.ENGINE_STATE_SERVING, "v9")


def test_views_are_mapped_not_copied(node, trainer):
    trainer.push(weights(4), version="v4", transport="inline")
    with EngineClient(server=node.address, name="mapper") as engine:
        with engine.acquire() as first:
            pointers = {k: v.data_ptr() for k, v in first.tensors.items()}
        with engine.acquire() as second:
            assert {k: v.data_ptr() for k, v in second.tensors.items()} == pointers  # the same mapped bytes
            assert all(torch.equal(second.tensors[k], v) for k, v in weights(4).items())


def test_a_held_version_delays_in_place_and_not_staged_updates(node, trainer):
    trainer.push(weights(5), version="v5", transport="inline")
    with EngineClient(server=node.address, name="reader") as engine:
        snapshot = engine.acquire()
        # STAGED writes shadows: it does not wait for the reader.
        # (Had it waited for the lease, it would fail ENGINE_READING after the 3 s lease timeout.)
        trainer.push(weights(6), version="v6", transport="inline", mode="staged")
        assert all(torch.equal(snapshot.tensors[k], v) for k, v in weights(5).items())  # still v5, untouched
        # IN_PLACE would write the bytes being read: it waits (3 s here), then gives up cleanly.
        with pytest.raises(UpdateFailed) as caught:
            trainer.push(weights(7), version="v7", transport="inline", mode="in_place")
        assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.UNAVAILABLE, "ENGINE_READING")
        # Released within the wait: the IN_PLACE update goes through.
        threading.Timer(0.5, lambda: snapshot.release(applied=True)).start()
        trainer.push(weights(8), version="v8", transport="inline", mode="in_place")
        with engine.acquire() as fresh:
            assert all(torch.equal(fresh.tensors[k], v) for k, v in weights(8).items())


def test_generation_during_staged_updates_never_sees_a_torn_version(node, trainer):
    versions = {seed: weights(seed) for seed in range(20, 26)}
    trainer.push(versions[20], version="s20", transport="inline", mode="staged")
    model = Net()
    tokens = torch.arange(32)
    expected = {}
    for seed, state in versions.items():
        reference = Net()
        reference.load_state_dict(state)
        expected[seed] = reference(tokens)
    seen: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        with EngineClient(server=node.address, name="server-loop") as engine:
            follower = ModuleFollower(engine, model)
            while not stop.is_set():
                follower.update()
                logits = model(tokens)
                match = [s for s, e in expected.items() if torch.equal(logits, e)]
                seen.append(match[0] if len(match) == 1 else -1)

    loop = threading.Thread(target=serve)
    loop.start()
    for seed in range(21, 26):
        trainer.push(versions[seed], version=f"s{seed}", transport="inline", mode="staged")
    wait_for(lambda: seen and seen[-1] == 25, timeout=20)
    stop.set()
    loop.join(10)
    assert -1 not in seen, "a forward pass saw weights of no single version"
    assert seen == sorted(seen) and len(set(seen)) >= 2


def test_the_store_survives_a_worker_crash_for_engines_too(node, trainer):
    trainer.push(weights(30), version="v30", transport="inline")
    victim = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).workers[0]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: (w := node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).workers[0]).pid
             not in (0, victim.pid) and w.state == pb.WORKER_STATE_RUNNING, timeout=60)
    model = Net()
    with EngineClient(server=node.address, name="after-crash") as engine:
        assert ModuleFollower(engine, model).update()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights(30).items())
