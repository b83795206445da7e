"""A local engine's connections, against a real server and real local-socket clients.

During the node's first update nothing is committed: an engine is told STORE_EMPTY, not that the store
is inconsistent.
"""

from __future__ import annotations

import pytest
import torch

from weightsync.engine import EngineClient, EngineError
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import UpdateStream, pack, plan_buckets, running_server

pytestmark = pytest.mark.timeout(180)


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 8, generator=generator), "b": torch.randn(8, generator=generator)}


def engines(server) -> dict[str, pb.EngineStatus]:
    return {e.name: e for e in server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}


def test_an_engine_during_the_first_update_is_told_the_store_is_empty(tmp_path):
    model = weights(1)
    with running_server(tmp_path, workers=1) as server, EngineClient(server=server.address, name="early") as engine:
        plan = plan_buckets(list(model.items()), 4096)
        stream = UpdateStream(server.stub())
        stream.send(begin=pb.BeginUpdate(version="first", plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                         transport=pb.TRANSPORT_INLINE, allow_new_tensors=True))
        assert stream.recv().WhichOneof("message") == "ready"
        assert engine.status().store_state == pb.STORE_STATE_UPDATING
        with pytest.raises(EngineError) as caught:
            engine.acquire(wait=1)
        assert (caught.value.reason, caught.value.metadata) == ("STORE_EMPTY", {"store_state": "STORE_STATE_UPDATING"})
        # The update goes on as if nobody had asked, and the engine reads what it committed.
        for k in range(len(plan.buckets)):
            data = pack(plan, model, k).numpy().tobytes()
            stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=len(data)))
            stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=0, data=data))
            assert stream.recv().bucket_applied.sequence == k
        stream.send(commit=pb.CommitUpdate())
        assert stream.recv().committed.version.generation == 1
        stream.close()
        with engine.acquire() as snapshot:
            assert snapshot.version.version == "first"
            assert all(torch.equal(snapshot.tensors[k], v) for k, v in model.items())

