"""Issue 9, defect 7: memory admission counts every worker that shares the host's memory.

Each CPU worker used to compare its own needs with the same MemAvailable, so two
workers each admitted an update that only one of them could hold. The server
now sums what every worker would allocate and admits it against the host
(MemAvailable minus a reserve, and --host-memory-limit-bytes), before any
worker allocates a byte.
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


def test_two_workers_are_admitted_together_not_each_alone(limited):
    # 16 MiB fits one worker under the 24 MiB host limit, but the node has two workers: 32 MiB.
    too_big, fits = model(16, 1), model(8, 2)
    with WeightSyncClient(limited.address) as client:
        client.create_group(timeout=30)
        with pytest.raises(UpdateFailed) as caught:
            client.push(too_big, version="too-big", allow_new_tensors=True)
        error = caught.value
        assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "HOST_OUT_OF_MEMORY")
        assert "2 CPU worker(s)" in str(error)
        needed = int(error.cause.metadata["needed_bytes"])
        assert needed >= 2 * 16 * MIB > HOST_LIMIT >= int(error.cause.metadata["available_bytes"])
        info = client.server_info()[0]
        assert info.store_state == pb.STORE_STATE_EMPTY  # refused before anything was allocated or moved
        assert [w.store_bytes for w in info.workers] == [0, 0]
        # The next normal update: 2 x 8 MiB fits.
        client.push(fits, version="fits", allow_new_tensors=True)
        assert client.verify(fits).ok
        assert server_checksums(limited) == [local_checksums(fits)] * 2
        # And a second STAGED update needs shadows (2 x 8 MiB more): over the limit again, refused cleanly.
        with pytest.raises(UpdateFailed) as caught:
            client.push(model(8, 3), version="staged", mode="staged")
        assert caught.value.reason == "HOST_OUT_OF_MEMORY"
        assert server_checksums(limited) == [local_checksums(fits)] * 2
        client.push(model(8, 4), version="in-place")  # no extra memory: admitted
        assert client.verify(model(8, 4)).ok
