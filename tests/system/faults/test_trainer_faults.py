"""Faults on the trainer's side: killed mid-bucket, never joins, cancels, drops its connection."""

from __future__ import annotations

import datetime
import socket
import time

import grpc
import pytest
from torch.distributed import TCPStore

from weightsync.common.collective import bucket_tail
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

from faultkit import (
    GROUP_TIMEOUT,
    MARGIN,
    TrainerProcess,
    delete_group,
    group_state,
    groups,
    info,
)
from helpers import (
    PlainTrainer,
    UpdateStream,
    error_info,
    local_checksums,
    pack,
    plan_buckets,
    server_checksums,
    wait_for,
)
from models import mixed_model

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

MODES = {"staged": pb.UPDATE_MODE_STAGED, "in_place": pb.UPDATE_MODE_IN_PLACE}


def full_update_succeeds(server, mode: int, seed: int, version: str, group_id: str | None = None) -> pb.UpdateCommitted:
    """A new group and a full update from this process; checks every worker's checksums."""
    trainer = PlainTrainer([server], timeout=GROUP_TIMEOUT, **({"group_id": group_id} if group_id else {}))
    trainer.create_group()
    try:
        model = mixed_model(seed)
        committed = trainer.push(model, version, mode=mode)
        assert committed.version.version == version
        assert server_checksums(server) == [local_checksums(model)]
        state = info(server)
        assert state.store_state == pb.STORE_STATE_CONSISTENT
        assert [w.store_state for w in state.workers] == [pb.STORE_STATE_CONSISTENT] * 2
        assert state.current_version == committed.version
        return committed
    finally:
        trainer.delete_group()


# -- 1. the trainer process is SIGKILLed inside a bucket's broadcast ------------------------------
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_trainer_sigkilled_mid_bucket(node, tmp_path, mode):
    trainer = TrainerProcess(node, stop="mid-bucket", mode=mode, seeds=(1, 2), log_dir=tmp_path)
    committed = trainer.expect("committed")
    applied = trainer.expect("applied")  # bucket 0 of v2 is in
    trainer.expect("announced")  # bucket 1 announced, never broadcast: the workers wait inside it
    assert info(node).store_state == pb.STORE_STATE_UPDATING
    assert group_state(node, trainer.group_id) == pb.GROUP_STATE_READY

    killed = time.monotonic()
    trainer.kill()
    # The workers' broadcast fails (the peer is gone, or the timeout), the update aborts, the group breaks.
    wait_for(lambda: group_state(node, trainer.group_id) == pb.GROUP_STATE_BROKEN, timeout=GROUP_TIMEOUT + MARGIN)
    wait_for(lambda: info(node).store_state != pb.STORE_STATE_UPDATING, timeout=GROUP_TIMEOUT + MARGIN)
    elapsed = time.monotonic() - killed
    assert elapsed < GROUP_TIMEOUT + MARGIN, elapsed
    (group,) = [g for g in groups(node) if g.group_id == trainer.group_id]
    assert group.broken_reason.startswith(("COLLECTIVE_FAILED", "COLLECTIVE_TIMEOUT")), group

    state = info(node)
    assert state.current_version.version == "v1"
    assert state.current_version.generation == committed["generation"]
    assert all(w.state == pb.WORKER_STATE_RUNNING for w in state.workers)  # nobody was restarted
    v1, v2 = mixed_model(1), mixed_model(2)
    if mode == "staged":
        # The last commit, bit for bit.
        assert state.store_state == pb.STORE_STATE_CONSISTENT
        assert server_checksums(node) == [local_checksums(v1)]
    else:
        # Bucket 0 of v2 landed in the live weights, the rest is still v1: INCONSISTENT, v1 still reported.
        assert state.store_state == pb.STORE_STATE_INCONSISTENT
        assert [w.store_state for w in state.workers] == [pb.STORE_STATE_INCONSISTENT] * 2
        expected = local_checksums(v1)
        expected.update({n: local_checksums(v2)[n] for n in applied["tensors"]})
        assert server_checksums(node) == [expected]

    # The broken group refuses updates, and can be deleted.
    stream = UpdateStream(node.stub())
    stream.send(begin=pb.BeginUpdate(group_id=trainer.group_id, version="v3", plan=plan_buckets(list(v1.items()), 1 << 20),
                                     mode=MODES[mode], transport=pb.TRANSPORT_COLLECTIVE))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(caught.value).reason == "GROUP_BROKEN"
    delete_group(node, trainer.group_id)
    assert group_state(node, trainer.group_id) is None

    # A new group and a full update succeed (IN_PLACE: back to CONSISTENT).
    full_update_succeeds(node, MODES[mode], seed=3, version="v3")


# -- 3. the trainer never joins the rendezvous ---------------------------------------------------
def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("rendezvous", ["store-up-rank0-absent", "store-unreachable"])
def test_trainer_never_joins(node, rendezvous):
    before = info(node)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    store = None
    if rendezvous == "store-up-rank0-absent":
        store = TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
        port = store.port
    else:
        port = closed_port()
    group_id = f"never-{rendezvous}"
    request = pb.CreateTransferGroupRequest(
        group_id=group_id, store_host="127.0.0.1", store_port=port, world_size=1 + len(before.workers),
        rank_offset=1, backend=pb.BACKEND_GLOO,
    )
    request.timeout.FromTimedelta(timeout)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        node.stub().CreateTransferGroup(request, timeout=GROUP_TIMEOUT + 30)
    elapsed = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
    assert error_info(caught.value).reason == "RENDEZVOUS_TIMEOUT"
    assert group_id in caught.value.details()
    # At the group timeout: not 2-3x it (torch's TCPStore client retries past its own deadline).
    assert GROUP_TIMEOUT * 0.9 <= elapsed < GROUP_TIMEOUT + MARGIN, elapsed

    # Nothing left behind: no group, the same workers, the store untouched.
    assert groups(node) == []
    after = info(node)
    assert [w.pid for w in after.workers] == [w.pid for w in before.workers]
    assert all(w.state == pb.WORKER_STATE_RUNNING for w in after.workers)
    assert after.store_state == before.store_state
    del store

    # The same group id is free again, and the workers serve it.
    full_update_succeeds(node, pb.UPDATE_MODE_STAGED, seed=31, version=f"after-{rendezvous}", group_id=group_id)


# -- 4. the trainer cancels its stream, or its connection drops ------------------------------------
@pytest.mark.parametrize("how", ["cancel", "close-channel"])
def test_trainer_cancels_update_stream(node, how):
    trainer = PlainTrainer([node], timeout=GROUP_TIMEOUT)
    trainer.create_group()
    try:
        v1, v2 = mixed_model(41), mixed_model(42)
        committed = trainer.push(v1, "c1", mode=pb.UPDATE_MODE_STAGED)
        channel = node.channel()
        plan = plan_buckets(list(v2.items()), 1 << 20)
        stream, _ = trainer.begin(pb_grpc.WeightSyncServiceStub(channel), plan, "c2", pb.UPDATE_MODE_STAGED)
        stream.send(bucket_start=pb.BucketStart(sequence=0, tail=bucket_tail(pack(plan, v2, 0))))
        trainer.send_bucket(pack(plan, v2, 0), 0)
        assert stream.recv().bucket_applied.sequence == 0
        assert info(node).store_state == pb.STORE_STATE_UPDATING

        started = time.monotonic()
        if how == "cancel":
            stream.cancel()
        else:
            channel.close()
        stream.close()  # ends our request iterator's thread
        # Aborted on every worker within the timeout: the last commit is back, bit for bit.
        state = wait_for(
            lambda: (s := info(node)).store_state != pb.STORE_STATE_UPDATING and s, timeout=GROUP_TIMEOUT + MARGIN
        )
        assert time.monotonic() - started < GROUP_TIMEOUT + MARGIN
        assert state.store_state == pb.STORE_STATE_CONSISTENT
        assert [w.store_state for w in state.workers] == [pb.STORE_STATE_CONSISTENT] * 2
        assert state.current_version == committed.version
        assert server_checksums(node) == [local_checksums(v1)]
        # The collective was idle, so the group is intact; the store lock is free: a new update commits.
        assert group_state(node, trainer.group_id) == pb.GROUP_STATE_READY
        v3 = mixed_model(43)
        again = trainer.push(v3, "c3", mode=pb.UPDATE_MODE_STAGED)
        assert again.version.generation == committed.version.generation + 1
        assert server_checksums(node) == [local_checksums(v3)]
    finally:
        trainer.delete_group()


def test_trainer_process_killed_before_commit(node, tmp_path):
    """The connection drops (the trainer process dies) with every bucket applied but no commit."""
    trainer = TrainerProcess(node, stop="before-commit", mode="staged", seeds=(51, 52), log_dir=tmp_path)
    committed = trainer.expect("committed")
    trainer.expect("all_applied")
    assert info(node).store_state == pb.STORE_STATE_UPDATING

    killed = time.monotonic()
    trainer.kill()
    state = wait_for(
        lambda: (s := info(node)).store_state != pb.STORE_STATE_UPDATING and s, timeout=GROUP_TIMEOUT + MARGIN
    )
    assert time.monotonic() - killed < GROUP_TIMEOUT + MARGIN
    # Aborted, not committed: every worker holds v1 exactly.
    assert state.store_state == pb.STORE_STATE_CONSISTENT
    assert [w.store_state for w in state.workers] == [pb.STORE_STATE_CONSISTENT] * 2
    assert state.current_version.version == "v1"
    assert state.current_version.generation == committed["generation"]
    assert server_checksums(node) == [local_checksums(mixed_model(51))]
    # Rank 0 is gone: the group is useless; delete it. The lock is free: a new group and update commit.
    delete_group(node, trainer.group_id)
    full_update_succeeds(node, pb.UPDATE_MODE_STAGED, seed=53, version="after-drop")
