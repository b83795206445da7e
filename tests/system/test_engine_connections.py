"""A local engine's connections, against a real server and real local-socket clients.

During the node's first update nothing is committed: an engine is told STORE_EMPTY, not that the store
is inconsistent. An engine is one record per name, whatever its connections: when the last one closes
it is UNREACHABLE, and it is back to what it served when one attaches again.
"""

from __future__ import annotations

import pytest
import torch

from weightsync.engine import EngineClient, EngineError
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import UpdateStream, pack, plan_buckets, running_server, sdk_client, wait_for

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


def test_an_engine_whose_last_connection_closes_is_unreachable_until_it_attaches_again(tmp_path):
    with running_server(tmp_path, workers=1) as server, sdk_client(server) as trainer:
        trainer.push(weights(1), version="v1", transport="inline", allow_new_tensors=True)
        first = EngineClient(server=server.address, name="rank")
        second = EngineClient(server=server.address, name="rank")
        with first.acquire() as snapshot:
            snapshot.applied = True
        assert engines(server)["rank"].state == pb.ENGINE_STATE_SERVING
        first.close()  # no lease held; another connection of the name is still open
        status = engines(server)["rank"]
        assert (status.state, status.applied_version.version) == (pb.ENGINE_STATE_SERVING, "v1")
        second.close()  # the last one: nobody of that name is left to serve
        status = wait_for(lambda: (e := engines(server)["rank"]).state != pb.ENGINE_STATE_SERVING and e)
        assert (status.state, status.last_error) == (pb.ENGINE_STATE_UNREACHABLE,
                                                     "DISCONNECTED: no connection of this engine is open")
        assert list(engines(server)) == ["rank"]  # one record per name, whatever its connections
        with EngineClient(server=server.address, name="rank") as again:
            status = engines(server)["rank"]
            assert (status.state, status.applied_version.version, status.last_error) == (
                pb.ENGINE_STATE_SERVING, "v1", "")
            trainer.push(weights(2), version="v2", transport="inline")
            with again.acquire() as snapshot:
                assert all(torch.equal(snapshot.tensors[k], v) for k, v in weights(2).items())
                snapshot.applied = True
            assert engines(server)["rank"].applied_version.version == "v2"


def test_a_reading_connection_that_closes_beside_another_leaves_the_engine_failed_not_applying():
    from weightsync.server.published.engine_registry import EngineRegistry

    registry = EngineRegistry()
    registry.attached("e", "local", "node-store")
    registry.attached("e", "local", "node-store")
    registry.applying("e")
    registry.detached("e", holding=True)
    record = registry.records["e"]
    assert (record.state, registry.connections) == (pb.ENGINE_STATE_FAILED, {"e": 1})
    registry.detached("e", holding=False)
    assert (record.state, registry.connections) == (pb.ENGINE_STATE_UNREACHABLE, {})
    registry.attached("e", "local", "node-store")
    assert (record.state, record.last_error) == (
        pb.ENGINE_STATE_FAILED, "DISCONNECTED: a connection of this engine closed while it read a version")
