"""The weightsync server drives a real SGLang (CPU, TP 2): --engine sglang-http=URL (server/engines/sglang.py).

The weightsync server starts first, pointed at the port SGLang will listen on, and a version is
pushed before SGLang exists (the driver reports it UNREACHABLE). SGLang then starts with
weightsync's loader (sglang_server.py) and the driver warm-starts it with every tensor of the
node's version; later pushes are driven without any call from the test. After each, SGLang's own
/weights_checker checksums on both ranks equal the pushed tensors as SGLang shards them, and
/model_info's weight_version is the pushed label. A version the loader refuses leaves SGLang
serving its last one, typed in the driven entry; the next push is served. No generation: see
sglang_server.py.
"""

from __future__ import annotations

import pytest
import sglang_server
import tiny_model
from sharding import expected_checksums

if problem := sglang_server.sglang_problem():
    pytest.skip(problem, allow_module_level=True)

import torch  # noqa: E402

from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server, sdk_client, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(900)
DRIVEN = "sglang-http"
TP = sglang_server.TP


@pytest.fixture(scope="module")
def port() -> int:
    return tiny_model.free_port()


@pytest.fixture(scope="module")
def node(tmp_path_factory, port):
    with running_server(tmp_path_factory.mktemp("sglang-driven-node"), "--engine",
                        f"sglang-http=http://127.0.0.1:{port}?timeout_s=120", workers=1) as server:
        yield server


def driven(node) -> pb.EngineStatus:
    info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return {e.name: e for e in info.engines}[DRIVEN]


def serving(node, label: str) -> bool:
    status = driven(node)
    return status.state == pb.ENGINE_STATE_SERVING and status.applied_version.version == label


def assert_holds(sglang, state: dict[str, torch.Tensor], label: str) -> None:
    assert sglang.alive(), sglang.log()[-4000:]
    actual = sglang.checksums()
    for rank in range(TP):
        expected = expected_checksums(state, rank, TP)
        assert actual[rank] == expected, (rank, sorted(n for n in expected if actual[rank].get(n) != expected[n]))
    assert sglang.weight_version() == label


def test_the_server_warm_starts_and_drives_sglang(node, port, tmp_path):
    base = tiny_model.weights(0)
    with sdk_client(node) as trainer:
        v1 = tiny_model.weights(1)
        trainer.push(v1, version="v1", transport="inline", allow_new_tensors=True)
        wait_for(lambda: driven(node).state == pb.ENGINE_STATE_UNREACHABLE, timeout=60)
        assert driven(node).last_error.startswith("ENGINE_UNREACHABLE: GET /model_info: "), driven(node)

        sglang = sglang_server.SGLang(tiny_model.save(tmp_path / "base", base), port,
                                      sglang_server.environment(node.address, "sgl"), tmp_path / "sglang.log")
        try:
            sglang.wait_ready(timeout=600)
            # Up with its checkpoint ("default"); the driver's next poll loads v1 whole.
            wait_for(lambda: serving(node, "v1"), timeout=120)
            assert_holds(sglang, v1, "v1")

            state = {**v1, **tiny_model.layer(tiny_model.weights(2), 0)}
            trainer.push(tiny_model.layer(tiny_model.weights(2), 0), version="v2", transport="inline",
                         mode="in_place")
            wait_for(lambda: serving(node, "v2"), timeout=120)
            assert_holds(sglang, state, "v2")

            bad = {"model.layers.0.self_attn.extra.weight": torch.ones(4, 4, dtype=torch.bfloat16)}
            trainer.push(bad, version="bad", transport="inline", allow_new_tensors=True)
            wait_for(lambda: driven(node).state == pb.ENGINE_STATE_FAILED, timeout=120)
            error = driven(node).last_error
            assert error.startswith("ENGINE_REFUSED: POST /update_weights_from_tensor: HTTP 400: "), error
            assert "TENSOR_NOT_IN_MODEL" in error and "model.layers.0.self_attn.extra.weight" in error, error
            assert_holds(sglang, state, "v2")  # and it generates again: continue_generation was called

            v3 = tiny_model.layer(tiny_model.weights(3), 1)
            trainer.push(v3, version="v3", transport="inline", mode="staged")
            wait_for(lambda: serving(node, "v3"), timeout=120)
            assert_holds(sglang, {**state, **v3}, "v3")
            assert driven(node).last_error == ""
        finally:
            sglang.stop()
