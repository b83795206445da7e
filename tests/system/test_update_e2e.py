"""Main scenario: a plain torch.distributed trainer against a real 2-worker server."""

from __future__ import annotations

import grpc
import pytest

from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import PlainTrainer, local_checksums, plan_buckets, server_checksums, start_server
from models import mixed_model

pytestmark = pytest.mark.timeout(180)


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def test_server_info_before_any_update(tmp_path):
    fresh = start_server(tmp_path)  # its own: the module's server may already hold another test's pushes
    try:
        response = info(fresh)
    finally:
        assert fresh.stop() == 0, fresh.log()[-2000:]
    assert [w.index for w in response.workers] == [0, 1]
    assert all(w.device == "cpu" and w.state == pb.WORKER_STATE_RUNNING for w in response.workers)
    assert list(response.backends) == [pb.BACKEND_GLOO]
    assert list(response.transports) == [pb.TRANSPORT_COLLECTIVE, pb.TRANSPORT_INLINE, pb.TRANSPORT_SHM]
    assert response.limits.ingress_slot_bytes == 64 << 20 and response.limits.ingress_slot_count == 2
    assert response.limits.max_chunk_bytes == (32 << 20) - (64 << 10)
    assert response.local_socket.endswith(".sock") and list(response.engines) == []
    assert response.store_state == pb.STORE_STATE_EMPTY
    assert response.current_version.generation == 0


def test_versions_staged_abort_and_in_place_abort(server):
    base = info(server).current_version.generation  # the module's server: other tests may have pushed first
    trainer = PlainTrainer([server])
    (created,) = trainer.create_group()
    assert created.group.state == pb.GROUP_STATE_READY
    assert created.group.world_size == 3

    v1 = mixed_model(1)
    plan = plan_buckets(list(v1.items()), 1 << 20)
    assert len(plan.buckets) == 3  # lm_head needs a bucket of its own
    assert [t.name for t in plan.buckets[1].tensors] == ["lm_head.weight"]
    committed = trainer.push(v1, "v1")
    assert committed.version.version == "v1"
    assert committed.version.generation == base + 1
    assert committed.size_bytes == sum(b.size_bytes for b in plan.buckets)
    expected = local_checksums(v1)
    assert server_checksums(server) == [expected]
    state = info(server)
    assert state.store_state == pb.STORE_STATE_CONSISTENT
    assert [w.tensor_count for w in state.workers] == [len(v1), len(v1)]

    v2 = mixed_model(2)
    assert local_checksums(v2) != expected
    committed = trainer.push(v2, "v2")
    assert (committed.version.version, committed.version.generation) == ("v2", base + 2)
    assert server_checksums(server) == [local_checksums(v2)]

    # STAGED, aborted after the first of three buckets: live weights untouched.
    assert trainer.push(mixed_model(3), "v3", mode=pb.UPDATE_MODE_STAGED, abort_after=1) is None
    assert server_checksums(server) == [local_checksums(v2)]
    state = info(server)
    assert state.store_state == pb.STORE_STATE_CONSISTENT
    assert (state.current_version.version, state.current_version.generation) == ("v2", base + 2)

    # A STAGED update that commits flips to the new values.
    v4 = mixed_model(4)
    committed = trainer.push(v4, "v4", mode=pb.UPDATE_MODE_STAGED)
    assert committed.version.generation == base + 3
    assert server_checksums(server) == [local_checksums(v4)]

    # IN_PLACE, aborted after the first bucket: INCONSISTENT, last good version visible.
    assert trainer.push(mixed_model(5), "v5", abort_after=1) is None
    state = info(server)
    assert state.store_state == pb.STORE_STATE_INCONSISTENT
    assert (state.current_version.version, state.current_version.generation) == ("v4", base + 3)

    # A full update restores CONSISTENT.
    v6 = mixed_model(6)
    committed = trainer.push(v6, "v6")
    assert committed.version.generation == base + 4
    assert info(server).store_state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(server) == [local_checksums(v6)]

    # Filtered checksums.
    names = ["step", "mask"]
    assert server_checksums(server, names) == [{n: local_checksums(v6)[n] for n in names}]
    trainer.delete_group()
    groups = server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10)
    assert trainer.group_id not in [g.group_id for g in groups.groups]
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().DeleteTransferGroup(pb.DeleteTransferGroupRequest(group_id=trainer.group_id), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
