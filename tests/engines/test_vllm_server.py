"""The weightsync server drives a real vLLM API server (--engine vllm-http=URL, server/engines/driver.py).

Real processes: vLLM's OpenAI-compatible server (launcher module, VLLM_SERVER_DEV_MODE=1,
--weight-transfer-config '{"backend": "weightsync"}', --skip-tokenizer-init: prompts are
token ids), a weightsync server started with --engine, and a trainer pushing with the SDK
(this process; a subprocess for the one that is killed). The trainer never talks to vLLM.
"""

from __future__ import annotations

import time

import pytest
import tiny_model
import torch

if problem := tiny_model.vllm_problem():
    pytest.skip(problem, allow_module_level=True)

from weightsync.engine.vllm_follow import follow  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server, sdk_client, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
DRIVEN = "vllm-http"  # the driver's engine name (the first --engine)


@pytest.fixture(scope="module")
def node(vllm, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("vllm-node"), "--engine", f"vllm-http={vllm.url}",
                        workers=1) as server:
        yield server


@pytest.fixture(scope="module")
def trainer(node):
    with sdk_client(node) as client:
        yield client


def engines(node) -> dict[str, pb.EngineStatus]:
    return {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}


def wait_engine(node, predicate, name: str = DRIVEN, timeout: float = 60.0) -> pb.EngineStatus:
    def check():
        status = engines(node).get(name)
        return status if status is not None and predicate(status) else None

    return wait_for(check, timeout=timeout, interval=0.05)


def wait_serving(node, version: str, name: str = DRIVEN) -> pb.EngineStatus:
    return wait_engine(node, lambda s: s.state == pb.ENGINE_STATE_SERVING and s.applied_version.version == version,
                       name)


def test_driven_hot_updates_equal_cold_starts(vllm, node, trainer, versions, cold):
    assert vllm.tokens() == cold["base"]
    assert vllm.weight_version() == "default"
    seen = []
    for version in ("v1", "v2", "v3"):
        started = time.monotonic()
        result = trainer.push(versions[version], version=version, transport="inline",
                              allow_new_tensors=version == "v1")
        status = wait_serving(node, version)
        served_after = time.monotonic() - started
        tokens = vllm.tokens()
        assert tokens == cold[version], version
        seen.append(tokens)
        assert vllm.weight_version() == version
        assert status.kind == "vllm-http" and status.endpoint == vllm.url
        assert status.applied_version.generation == result.servers[0].generation
        lag = status.commit_to_serving.ToTimedelta().total_seconds()
        assert 0 < lag < served_after, (lag, served_after)
    assert seen[0] != seen[1] != seen[2] != seen[0]


def test_driven_partial_updates(vllm, node, trainer, versions, cold):
    trainer.push(tiny_model.layer(versions["layer0"], 0), version="layer0", transport="inline")
    wait_serving(node, "layer0")
    assert vllm.tokens() == cold["layer0"]
    names = ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight")
    trainer.push({n: versions["fused"][n] for n in names}, version="fused", transport="inline")
    wait_serving(node, "fused")
    assert vllm.tokens() == cold["fused"]
    assert vllm.weight_version() == "fused"


def test_staged_update_aborted_by_a_killed_trainer_leaves_vllm_serving(vllm, node, cold):
    before, info = tiny_model.kill_a_trainer_mid_push(node)
    assert info.current_version == before.current_version
    assert vllm.tokens() == cold["fused"]
    assert vllm.weight_version() == "fused"
    status = engines(node)[DRIVEN]
    assert (status.state, status.applied_version.version) == (pb.ENGINE_STATE_SERVING, "fused")


def test_a_tensor_vllm_lacks_is_refused_then_a_correct_push_works(vllm, node, trainer, versions, cold):
    bogus = "model.layers.1.self_attn.bogus_proj.weight"
    trainer.push({bogus: torch.randn(4, 4).to(torch.bfloat16)}, version="bad", transport="inline",
                 allow_new_tensors=True)
    status = wait_engine(node, lambda s: s.state == pb.ENGINE_STATE_FAILED)
    assert "TENSOR_NOT_IN_MODEL" in status.last_error and bogus in status.last_error, status.last_error
    assert status.applied_version.version == "fused"
    assert vllm.tokens() == cold["fused"]  # vLLM serves the previous version, exactly
    assert vllm.weight_version() == "fused"
    time.sleep(2.0)  # the driver does not hammer vLLM with a version it refused
    assert node.log().count('"engine_apply_failed"') == 1

    trainer.push(versions["good"], version="good", transport="inline")
    status = wait_serving(node, "good")
    assert status.last_error == ""
    assert vllm.tokens() == cold["good"]
    assert vllm.weight_version() == "good"


def test_a_second_instance_warm_starts_from_the_node(vllm, node, checkpoints, cold):
    second = tiny_model.make_llm(checkpoints["base"])  # offline, in this process
    try:
        with follow(second, server=node.address, name="second") as follower:
            assert follower.apply_pending(raise_errors=True) is True  # every tensor, from the node's store
            assert tiny_model.generate(second) == vllm.tokens() == cold["good"]
            assert second.get_weight_version() == "good"
            both = engines(node)
            assert both["second"].kind == "local" and both[DRIVEN].kind == "vllm-http"
            assert both["second"].applied_version == both[DRIVEN].applied_version
            assert both["second"].state == both[DRIVEN].state == pb.ENGINE_STATE_SERVING
    finally:
        tiny_model.shutdown_llm(second)


def test_a_restarted_vllm_is_warm_started_by_the_driver(vllm, node, cold):
    vllm.stop()
    wait_engine(node, lambda s: s.state == pb.ENGINE_STATE_UNREACHABLE, timeout=30)
    vllm.start()  # the base checkpoint again: it serves "default" until the driver applies "good"
    wait_for(lambda: vllm.weight_version() == "good", timeout=30, interval=0.1)  # the driver polls every 5 s
    status = wait_serving(node, "good")
    assert vllm.tokens() == cold["good"]
    assert status.applied_time.ToDatetime().timestamp() > time.time() - 30
