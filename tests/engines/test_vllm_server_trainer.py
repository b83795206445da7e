"""vLLM's own trainer API with weightsync as its backend, against a real vLLM API server (TP 1).

The trainer is driven only through vLLM's classes: WeightTransferTrainerFactory.trainer_init with
WeightSyncTrainerInitInfo (engine/vllm_trainer.py), HTTPVLLMWeightSyncClient and ModuleSource over
a transformers Qwen2 (the checkpoints' names). The vLLM API server is conftest's session one (its
driven node of test_vllm_server.py is gone by now); this module's weightsync server drives nothing.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tiny_model
import torch

if problem := tiny_model.vllm_problem():
    pytest.skip(problem, allow_module_level=True)

from vllm.distributed.weight_transfer import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm.plugins import load_general_plugins  # noqa: E402

from weightsync.engine.vllm_trainer import WeightSyncTrainerInitInfo, WeightSyncTransferError  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import start_server  # noqa: E402

pytestmark = pytest.mark.timeout(300)
BOGUS = "model.layers.1.self_attn.bogus_proj"


class Node:
    """A weightsync server that can be stopped and started again on the same port."""

    def __init__(self, root) -> None:
        self.root = root
        self.server = start_server(root, workers=1)
        self.port = self.server.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def engines(self) -> dict[str, pb.EngineStatus]:
        info = self.server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        return {e.name: e for e in info.engines}

    def stop(self) -> None:
        assert self.server.stop() == 0, self.server.log()[-3000:]

    def start(self) -> None:
        self.server = start_server(self.root, "--listen", self.address, workers=1)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    node = Node(tmp_path_factory.mktemp("trainer-node"))
    yield node
    node.stop()


@pytest.fixture(scope="module")
def model(versions):
    net = tiny_model.model(0)
    net.load_state_dict(versions["v1"])
    return net


@pytest.fixture(scope="module")
def engine(vllm, node, model):
    load_general_plugins()  # what vLLM does in its own processes: registers both sides of "weightsync"
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(servers=[node.address], rank=0, timeout_s=60.0),
        client=HTTPVLLMWeightSyncClient(vllm.url, timeout=120), source=ModuleSource(model))
    yield engine
    engine.shutdown()


def set_weights(model, state: dict) -> None:
    with torch.no_grad():
        model.load_state_dict(state)


def staged_lines(vllm, label: str) -> list[str]:
    return [line for line in vllm.log().splitlines()
            if f"applied version '{label}'" in line and "prepared while serving" in line]


def test_send_weights_serves_each_version_as_a_cold_start_would(vllm, node, engine, model, versions, cold):
    for label, version in (("step-1", "v1"), ("step-2", "v2")):
        set_weights(model, versions[version])
        engine.send_weights()
        assert vllm.tokens() == cold[version], version
        assert vllm.weight_version() == label
        status = node.engines()["vllm"]
        assert (status.state, status.applied_version.version) == (pb.ENGINE_STATE_SERVING, label)
        # vLLM's rank staged the version while serving; the pause was the swap.
        assert [line for line in staged_lines(vllm, label) if "swapped in" in line], vllm.log()[-3000:]


def test_a_version_vllm_refuses_is_a_typed_error_and_the_next_push_works(vllm, node, engine, model, versions, cold):
    set_weights(model, versions["v3"])
    model.model.layers[1].self_attn.bogus_proj = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    try:
        with pytest.raises(WeightSyncTransferError) as refused:
            engine.send_weights()
    finally:
        del model.model.layers[1].self_attn.bogus_proj
    assert refused.value.reason == "TENSOR_NOT_IN_MODEL" and refused.value.pushed, refused.value
    assert f"{BOGUS}.weight" in str(refused.value)
    assert vllm.tokens() == cold["v2"]  # vLLM serves the version before, exactly
    assert vllm.weight_version() == "step-2"
    status = node.engines()["vllm"]
    assert status.state == pb.ENGINE_STATE_FAILED and "TENSOR_NOT_IN_MODEL" in status.last_error

    engine.send_weights()  # step-4: v3 without the stray tensor
    assert vllm.tokens() == cold["v3"]
    assert vllm.weight_version() == "step-4"


def test_an_unreachable_weightsync_server_is_a_typed_error_then_a_new_one_takes_over(vllm, node, engine, model,
                                                                                     versions, cold):
    node.stop()
    set_weights(model, versions["good"])
    started = time.monotonic()
    with pytest.raises(WeightSyncTransferError) as unreachable:
        engine.send_weights()
    assert unreachable.value.reason == "SERVER_UNREACHABLE" and not unreachable.value.pushed, unreachable.value
    assert time.monotonic() - started < 60  # the init info's bound
    assert vllm.tokens() == cold["v3"] and vllm.weight_version() == "step-4"

    node.start()  # an empty store on the same address: vLLM's ranks attach to it again
    engine.send_weights()
    assert vllm.tokens() == cold["good"]
    assert vllm.weight_version() == "step-6"
    assert node.engines()["vllm"].applied_version.version == "step-6"


def test_a_vllm_restarted_between_steps_is_a_typed_error_then_loads_every_tensor(vllm, node, engine, model,
                                                                                 versions, cold):
    vllm.stop()
    set_weights(model, versions["v1"])
    with pytest.raises(WeightSyncTransferError) as down:
        engine.send_weights()
    assert down.value.reason == "ENGINE_UNREACHABLE" and down.value.pushed, down.value

    vllm.start()  # the base checkpoint again: it serves "default" until the next send
    assert vllm.weight_version() == "default"
    engine.send_weights()  # attaches the new instance and loads every tensor, not what changed since v1
    assert vllm.tokens() == cold["v1"]
    assert vllm.weight_version() == "step-8"


class HeldSource(ModuleSource):
    """A WeightSource of a rank that holds part of the model (vLLM's contract: metadata() is the whole
    model on every rank, iteration yields None for what this rank does not hold)."""

    def __init__(self, module, held: set[str]) -> None:
        super().__init__(module)
        self.held = held

    def held_names(self):
        return self.held

    def __iter__(self):
        for name, tensor in super().__iter__():
            yield name, tensor if name in self.held else None


def test_a_sharded_trainer_pushes_a_part_from_every_rank(vllm, node, versions, cold):
    model = tiny_model.model(0)
    set_weights(model, versions["v2"])
    names = [name for name, _ in model.named_parameters()]
    halves = [{n for n in names if ".layers.1." not in n}, {n for n in names if ".layers.1." in n}]
    engines = [WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(servers=[node.address], rank=rank, trainer_ranks=2, version_prefix="parts",
                                  timeout_s=60.0),
        client=HTTPVLLMWeightSyncClient(vllm.url, timeout=120), source=HeldSource(model, halves[rank]))
        for rank in (0, 1)]
    assert engines[0].is_sender and not engines[1].is_sender
    try:
        with ThreadPoolExecutor(2) as ranks:  # every rank calls send_weights, as vLLM's contract says
            for done in [ranks.submit(e.send_weights) for e in engines]:
                done.result(timeout=120)
        assert vllm.tokens() == cold["v2"]
        assert vllm.weight_version() == "parts-1"
        info = node.server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert (info.current_version.version, info.engines[0].applied_version.version) == ("parts-1", "parts-1")
    finally:
        for engine in engines:
            engine.shutdown()
