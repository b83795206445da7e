"""An offline vllm.LLM follows a weightsync node (engine/vllm_follow.py, the "weightsync" backend).

Real processes: a weightsync server, a trainer pushing with the SDK (this process; a
subprocess for the one that is killed), and vLLM (in this process,
VLLM_ENABLE_V1_MULTIPROCESSING=0, worker included). Every check compares vLLM's greedy
tokens with those of a vLLM cold-started from a checkpoint of the same version.
"""

from __future__ import annotations

import pytest
import tiny_model
import torch

if problem := tiny_model.vllm_problem():
    pytest.skip(problem, allow_module_level=True)

from weightsync.engine.vllm_backend import (  # noqa: E402
    WeightSyncInitInfo,
    WeightSyncUpdateError,
    WeightSyncUpdateInfo,
)
from weightsync.engine.vllm_follow import VllmFollower, follow  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server, sdk_client, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
NAME = "offline"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("vllm-offline"), workers=1) as server:
        yield server


@pytest.fixture(scope="module")
def trainer(node):
    with sdk_client(node) as client:
        yield client


@pytest.fixture(scope="module")
def llm(checkpoints, cold):  # cold first: its LLMs come and go before this one starts
    engine = tiny_model.make_llm(checkpoints["base"])
    yield engine
    tiny_model.shutdown_llm(engine)


@pytest.fixture(scope="module")
def follower(llm, node):
    with follow(llm, server=node.address, name=NAME) as handle:
        yield handle


def engine_status(node, name: str = NAME) -> pb.EngineStatus:
    engines = {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}
    return engines[name]


def backend(llm):
    """The WeightSyncEngine inside vLLM's worker (in this process)."""
    return llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine


def push_and_apply(trainer, follower, state, version, **kw):
    trainer.push(state, version=version, transport="inline", **kw)
    assert follower.apply_pending(raise_errors=True) is True
    assert follower.apply_pending() is False  # nothing newer


def test_hot_updates_equal_cold_starts(llm, follower, trainer, node, versions, cold):
    assert tiny_model.generate(llm) == cold["base"]
    assert follower.apply_pending() is False  # the store is empty: nothing to apply
    seen = []
    for version in ("v1", "v2", "v3"):
        push_and_apply(trainer, follower, versions[version], version, allow_new_tensors=version == "v1")
        tokens = tiny_model.generate(llm)
        assert tokens == cold[version], version
        seen.append(tokens)
        assert llm.get_weight_version() == version
        status = engine_status(node)
        assert (status.kind, status.state, status.applied_version.version) == ("local", pb.ENGINE_STATE_SERVING, version)
        assert status.commit_to_serving.ToTimedelta().total_seconds() > 0
        stats = backend(llm).last_apply
        assert stats.tensors == len(versions[version]) and stats.completed_from_store == 0
    assert seen[0] != seen[1] != seen[2] != seen[0]


def test_partial_update_of_one_layer(llm, follower, trainer, versions, cold):
    layer0 = tiny_model.layer(versions["layer0"], 0)
    push_and_apply(trainer, follower, layer0, "layer0")
    assert backend(llm).last_apply.tensors == len(layer0) == 12  # only what changed
    assert tiny_model.generate(llm) == cold["layer0"]
    assert llm.get_weight_version() == "layer0"


def test_part_of_a_fused_layer_takes_the_rest_from_the_store(llm, follower, trainer, versions, cold):
    # q_proj alone would leave vLLM's qkv_proj half-loaded (k, v garbage); gate_proj likewise gate_up_proj.
    names = ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight")
    push_and_apply(trainer, follower, {n: versions["fused"][n] for n in names}, "fused")
    stats = backend(llm).last_apply
    assert stats.tensors == 2 + 6 and stats.completed_from_store == 6  # q bias, k and v w/b; up_proj
    assert tiny_model.generate(llm) == cold["fused"]


def test_staged_update_aborted_by_a_killed_trainer_changes_nothing(llm, follower, node, cold):
    before, info = tiny_model.kill_a_trainer_mid_push(node)
    assert info.current_version.version == before.current_version.version == "fused"
    assert info.current_version.generation == before.current_version.generation
    assert follower.apply_pending() is False
    assert tiny_model.generate(llm) == cold["fused"]
    assert llm.get_weight_version() == "fused"


def test_a_tensor_the_model_lacks_is_refused_then_a_correct_push_works(llm, follower, trainer, node, versions, cold):
    bogus = "model.layers.0.mlp.bogus_proj.weight"
    trainer.push({bogus: torch.randn(8, 8).to(torch.bfloat16)}, version="bad", transport="inline",
                 allow_new_tensors=True)
    with pytest.raises(WeightSyncUpdateError) as caught:
        follower.apply_pending(raise_errors=True)
    assert caught.value.reason == "TENSOR_NOT_IN_MODEL" and bogus in str(caught.value)
    assert bogus in follower.last_error
    status = engine_status(node)
    assert status.state == pb.ENGINE_STATE_FAILED and bogus in status.last_error, status
    assert status.applied_version.version == "fused"
    # Still serving the previous version, exactly; the failed version is not tried again.
    assert tiny_model.generate(llm) == cold["fused"]
    assert llm.get_weight_version() == "fused"
    assert follower.apply_pending() is False

    # The store keeps the name for good; the next correct version applies (skipping it, with a warning).
    push_and_apply(trainer, follower, versions["good"], "good")
    assert backend(llm).last_apply.skipped == [bogus]
    assert tiny_model.generate(llm) == cold["good"]
    assert llm.get_weight_version() == "good"
    status = engine_status(node)
    assert (status.state, status.applied_version.version, status.last_error) == (pb.ENGINE_STATE_SERVING, "good", "")


def test_checkpoint_shapes_are_checked(llm):
    names = backend(llm)._model_names()  # noqa: SLF001 - the check the engine runs before loading
    assert names.checkpoint is not None and len(names.checkpoint) == 27
    assert names.shape_problem("model.norm.weight", torch.empty(128)) is None
    assert "model.norm.weight" in names.shape_problem("model.norm.weight", torch.empty(64))
    assert names.vllm_name("model.layers.0.self_attn.k_proj.bias") == "model.layers.0.self_attn.qkv_proj.bias"
    assert names.group("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj"
    assert not names.known("model.layers.0.mlp.bogus_proj.weight")


def test_bad_init_and_update_info_are_refused_and_the_engine_keeps_serving(llm, follower, node, cold):
    for bad in ({"worker": 0}, {"local_socket": "relative.sock"}, {"server": "x", "local_socket": "/a"},
                {"server": "127.0.0.1:1", "worker": "0"}, {"server": "127.0.0.1:1", "engine_name": "a b"},
                {"server": "127.0.0.1:1", "nope": 1}):
        with pytest.raises(ValueError):
            llm.init_weight_transfer_engine({"init_info": bad})
    for bad in ({"generation": -1}, {"since_generation": -2}, {"generation": 3, "since_generation": 3},
                {"generation": True}, {"strict": "no"}, {"version": "x"}):
        llm.start_weight_update()
        with pytest.raises(ValueError):
            llm.update_weights({"update_info": bad})
    # A generation the store has not committed yet (a future one): VERSION_NOT_COMMITTED, nothing touched
    # (a generation the store moved past is VERSION_GONE: tests/sglang_engine/test_loader.py).
    llm.start_weight_update()
    with pytest.raises(WeightSyncUpdateError) as caught:
        llm.update_weights({"update_info": {"generation": 999, "since_generation": -1}})
    assert caught.value.reason == "VERSION_NOT_COMMITTED"
    assert tiny_model.generate(llm) == cold["good"]
    assert llm.get_weight_version() == "good"
    # The dataclasses are the wire schema.
    assert WeightSyncInitInfo(local_socket="/tmp/x.sock").worker == -1
    assert WeightSyncUpdateInfo().since_generation == -1


def test_background_mode_applies_between_generate_calls(llm, follower, trainer, versions, cold):
    follower.start(poll=0.05)
    try:
        trainer.push(versions["v2"], version="again-v2", transport="inline")
        wait_for(lambda: follower.applied_version == "again-v2", timeout=30)
        with follower.serving():
            assert tiny_model.generate(llm) == cold["v2"]
        assert llm.get_weight_version() == "again-v2"
    finally:
        follower.stop()


class ReplacedWhileRanksRead:
    """Stands in for vllm.LLM: the first update_weights fails the way a tensor-parallel vLLM's does
    when a commit lands between two ranks' acquires (one rank applied the version, the other got
    VERSION_GONE; vLLM's collective_rpc raises the failed rank's error as text)."""

    def __init__(self, commit_meanwhile) -> None:
        self.commit_meanwhile = commit_meanwhile
        self.calls: list[tuple] = []

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.calls.append(("init", request["init_info"]["engine_name"]))

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, request: dict) -> None:
        info = request["update_info"]
        self.calls.append(("update", info["generation"], info["since_generation"]))
        if len([c for c in self.calls if c[0] == "update"]) == 1:
            self.commit_meanwhile()
            raise RuntimeError(f"Worker failed with error 'VERSION_GONE: generation {info['generation']} is not "
                               "held', please check the stack trace above for the root cause")

    def finish_weight_update(self, weight_version: str) -> None:
        self.calls.append(("finish", weight_version))


def test_a_version_replaced_while_the_ranks_read_it_is_followed_by_the_newer_one_at_once(tmp_path, versions):
    with running_server(tmp_path, workers=1) as server, sdk_client(server) as pusher:
        first = pusher.push(versions["v1"], version="r1", transport="inline", allow_new_tensors=True)
        llm = ReplacedWhileRanksRead(lambda: pusher.push(versions["v2"], version="r2", transport="inline"))
        follower = VllmFollower(llm, server=server.address, name="replaced")
        try:
            # Before returning, every rank serves r2: vLLM never generates with ranks on r1 and r0.
            assert follower.apply_pending(raise_errors=True) is True
            assert (follower.applied_version, follower.last_error) == ("r2", "")
            assert follower.apply_pending() is False
        finally:
            follower.close()
    generation = first.servers[0].generation
    assert llm.calls == [("init", "replaced"), ("start",), ("update", generation, -1), ("start",),
                         ("update", generation + 1, -1), ("finish", "r2")]


class BusyOnce(ReplacedWhileRanksRead):
    """The first update_weights finds the store busy past the lease wait (an IN_PLACE update writing)."""

    def update_weights(self, request: dict) -> None:
        info = request["update_info"]
        self.calls.append(("update", info["generation"], info["since_generation"]))
        if len([c for c in self.calls if c[0] == "update"]) == 1:
            raise RuntimeError("Worker failed with error 'STORE_UPDATING: an update kept writing or publishing the "
                               "store for 30 s'")


def test_a_store_kept_busy_past_the_lease_wait_is_tried_again_not_given_up(tmp_path, versions):
    with running_server(tmp_path, workers=1) as server, sdk_client(server) as pusher:
        generation = pusher.push(versions["v1"], version="r1", transport="inline",
                                 allow_new_tensors=True).servers[0].generation
        llm = BusyOnce(lambda: None)
        with VllmFollower(llm, server=server.address, name="busy") as follower:
            assert follower.apply_pending() is False
            assert "STORE_UPDATING" in follower.last_error
            assert follower.apply_pending() is True  # the same version: it was never refused
            assert (follower.applied_version, follower.last_error) == ("r1", "")
    assert [c for c in llm.calls if c[0] in ("update", "finish")] == [
        ("update", generation, -1), ("update", generation, -1), ("finish", "r1")]
