"""Memory admission: the node's store is one copy in host memory, whatever the worker count.

Each worker used to hold a replica, so a node of two workers needed twice the model (and
twice again for STAGED shadows). The node now holds every tensor once: an update is
admitted against the host (MemAvailable minus a reserve, and --host-memory-limit-bytes)
for what the store adds once, before anything is allocated.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
HOST_LIMIT = 24 * MIB


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("limited"), "--host-memory-limit-bytes", str(HOST_LIMIT))
    yield server
    assert server.stop() == 0


def model(mib: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MIB // 4, generator=g), "b": torch.randn(16, generator=g)}


def test_a_node_of_two_workers_holds_one_copy_and_its_shadow_is_counted(limited):
    too_big, fits = model(32, 1), model(16, 2)
    with WeightSyncClient(limited.address) as client:
        client.create_group(timeout=30)
        with pytest.raises(UpdateFailed) as caught:
            client.push(too_big, version="too-big", allow_new_tensors=True)
        error = caught.value
        assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "HOST_OUT_OF_MEMORY")
        needed = int(error.cause.metadata["needed_bytes"])
        assert needed >= 32 * MIB > HOST_LIMIT >= int(error.cause.metadata["available_bytes"])
        info = client.server_info()[0]
        assert info.store_state == pb.STORE_STATE_EMPTY  # refused before anything was allocated or moved
        assert info.store.held_bytes == 0
        # 16 MiB fits under 24 MiB with two workers (two replicas, 32 MiB, did not).
        client.push(fits, version="fits", allow_new_tensors=True)
        assert client.verify(fits).ok
        assert server_checksums(limited) == [local_checksums(fits)]
        info = client.server_info()[0]
        assert 16 * MIB <= info.store.held_bytes < 17 * MIB  # once, not per worker
        # A STAGED update needs a shadow (16 MiB more): over the limit, refused cleanly.
        with pytest.raises(UpdateFailed) as caught:
            client.push(model(16, 3), version="staged", mode="staged")
        assert caught.value.reason == "HOST_OUT_OF_MEMORY"
        assert server_checksums(limited) == [local_checksums(fits)]
        client.push(model(16, 4), version="in-place")  # no extra memory: admitted
        assert client.verify(model(16, 4)).ok
