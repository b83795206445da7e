"""One source of truth for the token: a SIGHUP rotation reaches the local socket and the vLLM driver.

A real server with --token-file and --engine vllm-http pointing at a fake vLLM (tests/fake_vllm.py)
that really attaches to the local socket with the token the driver hands it. After the token file
is rewritten and SIGHUP sent, the new token attaches over the local socket (an engine, and an SHM
trainer opening the ingress) and the old one is refused (UNAUTHENTICATED TOKEN_INVALID), also on a
connection attached before the rotation; the driver initializes vLLM again with the new token, so
the next commit is served.
"""

from __future__ import annotations

import signal

import grpc
import pytest
import torch
from fake_vllm import FakeVllm

from weightsync.client import WeightSyncClient
from weightsync.engine import EngineClient, EngineError
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import start_server, wait_for

pytestmark = pytest.mark.timeout(180)
TOKEN_ONE = "token-one-0123456789abcdef"
TOKEN_TWO = "token-two-fedcba9876543210"


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(8, 16, generator=generator),
            "layer.bias": torch.randn(16, generator=generator).to(torch.bfloat16)}


def info(server, token: str) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), metadata=(("authorization", f"Bearer {token}"),),
                                       timeout=10)


def serving(server, token: str, version: str) -> bool:
    driven = {e.name: e for e in info(server, token).engines}["vllm-http"]
    return driven.state == pb.ENGINE_STATE_SERVING and driven.applied_version.version == version


@pytest.fixture
def rotated(tmp_path):
    fake = FakeVllm()
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN_ONE}\n")
    server = start_server(tmp_path, "--token-file", str(token_file), "--engine", f"vllm-http={fake.url}", workers=1)
    try:
        yield server, token_file, fake
    finally:
        code = server.stop()
        fake.close()
    assert code == 0, server.log()[-3000:]


def test_a_refused_token_is_an_engine_error_not_a_raw_rpc_error(rotated):
    server, _, _ = rotated
    for token in ("not-the-token", None):
        with pytest.raises(EngineError) as caught:
            EngineClient(server=server.address, token=token, name="refused")
        assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")
    with EngineClient(server=server.address, token=TOKEN_ONE, name="accepted") as engine:  # the next call works
        assert engine.status().version.store_epoch > 0


def test_sighup_rotates_the_token_of_the_local_socket_and_the_driver(rotated):
    server, token_file, fake = rotated
    with WeightSyncClient(server.address, token=TOKEN_ONE) as trainer:
        trainer.push(weights(1), version="v1", transport="inline", allow_new_tensors=True)
    wait_for(lambda: serving(server, TOKEN_ONE, "v1"))
    assert fake.tokens() == [TOKEN_ONE]
    assert all(torch.equal(fake.weights[k], v) for k, v in weights(1).items())
    attached_before = EngineClient(server=server.address, token=TOKEN_ONE, name="before")
    held = attached_before.acquire()

    token_file.write_text(f"{TOKEN_TWO}\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "credentials_reloaded" in server.log(), timeout=10)

    socket_path = info(server, TOKEN_TWO).local_socket
    with pytest.raises(EngineError) as caught:  # the old token no longer attaches
        EngineClient(socket_path=socket_path, token=TOKEN_ONE, name="old-token")
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")
    with pytest.raises(EngineError) as caught:  # nor does a connection that attached with it
        attached_before.acquire(wait=1)
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")
    held.release(applied=True)  # giving a lease back needs no token
    attached_before.close()
    with EngineClient(socket_path=socket_path, token=TOKEN_TWO, name="new-token") as engine:
        with engine.acquire() as snapshot:
            assert all(torch.equal(snapshot.tensors[k], v) for k, v in weights(1).items())

    # An SHM trainer attaches to the local socket with the new token too (its ingress comes from
    # there), and the driver hands vLLM the token in force: vLLM attaches with it and serves the
    # next commit.
    with WeightSyncClient(server.address, token=TOKEN_TWO) as trainer:
        trainer.push(weights(2), version="v2", transport="shm")
    wait_for(lambda: serving(server, TOKEN_TWO, "v2"))
    assert fake.tokens() == [TOKEN_ONE, TOKEN_TWO] and fake.attach_errors == []
    assert all(torch.equal(fake.weights[k], v) for k, v in weights(2).items())
    assert TOKEN_ONE not in server.log() and TOKEN_TWO not in server.log()
