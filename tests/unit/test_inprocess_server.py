"""The in-process server (tests/inprocess_server.py) serves the real RPC surface with no process:
an INLINE push commits bit for bit, GetServerInfo answers, and a refusal is the real one, followed
by the next push and a verify."""

from __future__ import annotations

import pytest
import torch
from inprocess_server import inprocess_server

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}


@pytest.fixture(scope="module")
def server():
    with inprocess_server() as running:
        yield running


def test_an_inline_push_commits_and_reads_back_bit_for_bit(server):
    with WeightSyncClient(server.address, timeout=30) as client:
        client.push(model(1), version="v1", transport="inline", allow_new_tensors=True)
        assert client.verify(model(1)).ok
    assert server_checksums(server) == [local_checksums(model(1))]
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.current_version.version, len(info.workers)) == ("v1", 2)
    assert all(w.state == pb.WORKER_STATE_RUNNING for w in info.workers)


def test_a_new_tensor_without_allow_new_tensors_is_refused_and_the_next_push_lands(server):
    with WeightSyncClient(server.address, timeout=30) as client:
        client.push(model(2), version="v2", transport="inline", allow_new_tensors=True)
        with pytest.raises(UpdateFailed) as refused:
            client.push(dict(model(3), extra=torch.ones(4)), version="bad", transport="inline")
        assert refused.value.reason == "TENSOR_UNKNOWN"
        client.push(model(3), version="v3", transport="inline")
        assert client.verify(model(3)).ok
    assert server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version.version == "v3"
