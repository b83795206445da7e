"""Message size limits on both sides: an oversized message is RESOURCE_EXHAUSTED."""

from __future__ import annotations

import grpc
import pytest
import torch

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import UpdateStream, start_server
from models import mixed_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("limits"), "--max-message-bytes", "65536", workers=1)
    yield server
    assert server.stop() == 0


def big_plan(tensors: int) -> tensor_pb2.WeightPlan:
    plan = tensor_pb2.WeightPlan()
    bucket = plan.buckets.add(size_bytes=64 * tensors)
    for i in range(tensors):
        bucket.tensors.add(name=f"layer.{i:06d}.a_rather_long_parameter_name.weight", dtype=tensor_pb2.DTYPE_FLOAT32,
                           shape=[16], offset_bytes=64 * i, size_bytes=64)
    return plan


def test_server_refuses_an_oversized_message(small_server):
    plan = big_plan(2000)
    assert plan.ByteSize() > 65536
    stream = UpdateStream(small_server.stub())
    stream.send(begin=pb.BeginUpdate(group_id="g", version="v", plan=plan, mode=pb.UPDATE_MODE_IN_PLACE,
                                     transport=pb.TRANSPORT_COLLECTIVE))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server keeps serving and reports its limit.
    info = small_server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.limits.max_message_bytes == 65536


def test_sdk_surfaces_the_limit_as_a_typed_error(small_server):
    model = {f"layer.{i:05d}.a_rather_long_parameter_name.weight": torch.zeros(4) for i in range(2000)}
    with WeightSyncClient(small_server.address) as client:
        client.create_group(timeout=30)
        with pytest.raises(UpdateFailed) as caught:
            client.push(model, version="too-big")
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A plan under the limit still works on the same group.
        small = mixed_model(3)
        client.push(small, version="fits", bucket_size_bytes=1 << 20)
        assert client.verify(small).ok


def test_client_refuses_to_receive_an_oversized_message(small_server):
    with WeightSyncClient(small_server.address, max_message_bytes=64) as client, pytest.raises(Exception) as caught:
        client.server_info()
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
