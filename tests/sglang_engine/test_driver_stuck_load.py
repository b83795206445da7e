"""A stuck SGLang load is in the driven entry as soon as the driver gives up on it, not after the cleanup.

A real weightsync server drives tests/fake_sglang.py with `?timeout_s=2`. The fake holds its answer to
/update_weights_from_tensor (a load that does not end) and to /continue_generation (an SGLang still busy
with it: the driver's cleanup waits up to RESUME_AFTER_FAILURE_SECONDS for its answers). While the
cleanup waits, GetServerInfo must already say ENGINE_UNREACHABLE for the update call (it said APPLYING,
no error, for timeout_s + 30 s). Then the held answers go, and the next commit is served, bit for bit.
Runs without SGLang.
"""

from __future__ import annotations

import threading

import pytest
import torch
from fake_sglang import FakeSglang

from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import sdk_client, start_server, wait_for

pytestmark = pytest.mark.timeout(240)
NAME = "sglang-http"


def driven(server) -> pb.EngineStatus:
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return {e.name: e for e in info.engines}[NAME]


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 8, generator=generator), "b": torch.randn(8, generator=generator)}


def test_a_stuck_load_is_reported_when_the_driver_gives_up_not_after_its_cleanup(tmp_path) -> None:
    fake = FakeSglang()
    server = start_server(tmp_path, "--engine", f"sglang-http={fake.url}?timeout_s=2", workers=1)
    stuck, busy = threading.Event(), threading.Event()
    try:
        fake.socket_path = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).local_socket
        fake.script["POST /update_weights_from_tensor"] = [(200, b'{"success": true, "message": "late"}', stuck)]
        fake.script["POST /continue_generation"] = [(200, b'{"status": "ok"}', busy)]
        with sdk_client(server) as trainer:
            trainer.push(weights(1), version="stuck", transport="inline", allow_new_tensors=True)
            # The driver gave up on the update (its 2 s bound) and its cleanup waits on /continue_generation.
            wait_for(lambda: "POST /continue_generation" in fake.routes(), timeout=120)
            status = driven(server)
            assert status.state == pb.ENGINE_STATE_UNREACHABLE, status
            assert status.last_error.startswith("ENGINE_UNREACHABLE: POST /update_weights_from_tensor: "), status
            assert "timed out" in status.last_error, status
            busy.set()
            stuck.set()

            good = weights(2)
            generation = trainer.push(good, version="good", transport="inline").servers[0].generation
            wait_for(lambda: driven(server).applied_version.generation == generation
                     and driven(server).state == pb.ENGINE_STATE_SERVING, timeout=120)
            assert fake.served == "good" and not fake.paused and not fake.session
            assert all(torch.equal(fake.weights[name], tensor) for name, tensor in good.items())
            assert driven(server).last_error == ""
    finally:
        busy.set()
        stuck.set()
        code = server.stop()
        fake.close()
    assert code == 0, server.log()[-3000:]
