"""Wrong-sized and out-of-order broadcasts.

A trainer written against the protos (no SDK) gets every one of these wrong on
purpose. None commits, none hangs the trainer, and the node keeps its weights:
  - announced and broadcast at another length than the plan's: drained, refused;
  - shorter than announced, by any number of bytes: caught through the announced
    tail (the workers arm the complement of the bucket's last bytes), and no
    correct bucket is refused whatever its last bytes are;
  - announced without its tail: drained, refused;
  - longer than announced: Gloo aborts the receiving worker, the bucket's owner
    (that cannot be caught in Python); it restarts, and the store the server
    keeps loses nothing;
  - announced out of order or twice, then broadcast: drained, refused at once,
    the group stays usable;
  - announced for a bucket the plan does not have, with no length: nothing can
    drain it, so the group is marked BROKEN at once (and says so).
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from weightsync.common.collective import bucket_tail
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    PlainTrainer,
    error_info,
    local_checksums,
    pack,
    plan_buckets,
    server_checksums,
    wait_for,
)
from models import mixed_model

pytestmark = pytest.mark.timeout(300)

GROUP_TIMEOUT = 120.0
"""The trainer's group timeout: long enough for healthy pushes on a loaded host. What is drained or refused "at
once" ends well within half of it (AT_ONCE): a trainer that waited out the group timeout does not."""
AT_ONCE = GROUP_TIMEOUT / 2
BROKEN_GROUP_TIMEOUT = 30.0
"""The group timeout of the tests whose trainer sends into a broken group (it may wait the timeout out): long
enough for their rendezvous on a loaded host."""
Code = grpc.StatusCode
BUCKET = 1 << 20


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def group_state(server, group_id: str) -> int | None:
    groups = server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups
    return next((g.state for g in groups if g.group_id == group_id), None)


class Node:
    """A server with a committed model and a trainer group, checked after every bad broadcast."""

    def __init__(self, server, timeout: float = GROUP_TIMEOUT) -> None:
        self.server = server
        self.trainer = PlainTrainer([server], timeout=timeout)
        self.trainer.create_group()
        self.seed = 400
        self.model = self.commit()

    def commit(self, model: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        self.seed += 1
        model = mixed_model(self.seed) if model is None else model
        committed = self.trainer.push(model, f"v{self.seed}", mode=pb.UPDATE_MODE_STAGED, bucket_bytes=BUCKET)
        assert committed.version.version == f"v{self.seed}"
        self.model = model
        return model

    def begin(self, mode=pb.UPDATE_MODE_STAGED):
        model = mixed_model(self.seed + 100)
        plan = plan_buckets(list(model.items()), BUCKET)
        stream, _ = self.trainer.begin(self.server.stub(), plan, "bad", mode=mode)
        return stream, plan, model

    def assert_unharmed(self) -> None:
        """The committed model, bit for bit; then the next normal update on the same group."""
        wait_for(lambda: info(self.server).store_state != pb.STORE_STATE_UPDATING, timeout=10)
        assert server_checksums(self.server) == [local_checksums(self.model)]
        self.commit()
        assert server_checksums(self.server) == [local_checksums(self.model)]


def aborting(stream) -> pb.UpdateAborting:
    response = stream.recv()
    assert response.WhichOneof("message") == "aborting", response
    return response.aborting


def end(stream) -> grpc.RpcError:
    stream.send(abort=pb.AbortUpdate(reason="test"))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    return caught.value


@pytest.fixture
def node(server):
    state = Node(server)
    yield state
    state.trainer.delete_group()


def test_announced_length_differs_from_the_plan_drained_and_refused(node):
    stream, plan, model = node.begin()
    longer = torch.cat([pack(plan, model, 0), torch.zeros(64, dtype=torch.uint8)])
    pids = [w.pid for w in info(node.server).workers]
    started = time.monotonic()
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=longer.numel()))
    node.trainer.send_bucket(longer, 0)  # its owner receives exactly this length and drops it
    assert time.monotonic() - started < AT_ONCE
    report = aborting(stream)
    assert (report.code, report.reason) == (Code.INVALID_ARGUMENT.value[0], "BUCKET_SIZE_MISMATCH")
    error = end(stream)
    assert error.code() == Code.INVALID_ARGUMENT
    assert dict(error_info(error).metadata) == {
        "bucket": "0", "planned_bytes": str(plan.buckets[0].size_bytes), "announced_bytes": str(longer.numel())}
    assert [w.pid for w in info(node.server).workers] == pids  # nobody died
    assert group_state(node.server, node.trainer.group_id) == pb.GROUP_STATE_READY
    node.assert_unharmed()


MODES = pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])


@MODES
@pytest.mark.parametrize("short", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_any_shortfall_is_caught_through_the_announced_tail(node, mode, short):
    """Checksums off: only the tail can see it. 1-7 bytes short used to commit wrong bytes as CONSISTENT."""
    stream, plan, model = node.begin(mode)
    full = pack(plan, model, 0)
    stream.send(bucket_start=pb.BucketStart(sequence=0, tail=bucket_tail(full)))
    node.trainer.send_bucket(full[:-short].clone(), 0)
    report = aborting(stream)
    assert (report.code, report.reason) == (Code.DATA_LOSS.value[0], "BUCKET_TRUNCATED")
    error = end(stream)
    assert error.code() == Code.DATA_LOSS
    assert dict(error_info(error).metadata)["bucket"] == "0"
    state = info(node.server)
    if mode == pb.UPDATE_MODE_IN_PLACE:  # bucket 0 may be half-written: said, then repaired by a full update
        assert state.store_state == pb.STORE_STATE_INCONSISTENT
        node.commit()
    else:
        assert state.store_state == pb.STORE_STATE_CONSISTENT
    assert group_state(node.server, node.trainer.group_id) == pb.GROUP_STATE_READY
    node.assert_unharmed()


ENDINGS = {
    # The last 8 bytes of a bucket (lm_head.weight fills bucket 1 exactly, so they are its last bytes).
    "all-ones": bytes([0xFF] * 8),  # the complement the workers arm for a bucket ending in zeros
    "zeros": bytes(8),
    "shortfall-of-3-pattern": bytes([0] * 5 + [0xFF] * 3),  # what 3 bytes short of an all-zero end leaves
    "complement-of-the-bytes-before": None,  # its last 8 bytes are the complement of the 8 before them
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_no_correct_bucket_is_refused_whatever_its_last_bytes(node, ending):
    model = mixed_model(node.seed + 50)
    raw = model["lm_head.weight"].view(torch.uint8)
    plan = plan_buckets(list(model.items()), BUCKET)
    assert [t.name for t in plan.buckets[1].tensors] == ["lm_head.weight"]
    assert plan.buckets[1].size_bytes == raw.numel()  # the tensor's end is the bucket's end
    pattern = ENDINGS[ending]
    raw[-8:] = torch.tensor(list(pattern), dtype=torch.uint8) if pattern is not None else raw[-16:-8] ^ 0xFF
    node.commit(model)
    assert server_checksums(node.server) == [local_checksums(model)]
    assert info(node.server).store_state == pb.STORE_STATE_CONSISTENT
    node.assert_unharmed()


@pytest.mark.parametrize("tail", ["missing", "too-short"])
def test_an_announcement_without_its_tail_is_drained_and_refused(node, tail):
    stream, plan, model = node.begin()
    full = pack(plan, model, 0)
    pids = [w.pid for w in info(node.server).workers]
    started = time.monotonic()
    stream.send(bucket_start=pb.BucketStart(sequence=0, tail=b"" if tail == "missing" else bucket_tail(full)[:3]))
    node.trainer.send_bucket(full, 0)  # its owner receives it at its announced length and drops it
    report = aborting(stream)
    assert time.monotonic() - started < AT_ONCE, f"the trainer waited for the group timeout ({GROUP_TIMEOUT:g} s)"
    assert (report.code, report.reason) == (Code.INVALID_ARGUMENT.value[0], "BUCKET_TAIL_INVALID")
    error = end(stream)
    assert error.code() == Code.INVALID_ARGUMENT
    assert dict(error_info(error).metadata) == {"bucket": "0", "tail_bytes": "0" if tail == "missing" else "3",
                                                "expected": "8"}
    assert [w.pid for w in info(node.server).workers] == pids
    assert info(node.server).store_state == pb.STORE_STATE_CONSISTENT
    assert group_state(node.server, node.trainer.group_id) == pb.GROUP_STATE_READY
    node.assert_unharmed()


def test_longer_than_announced_kills_the_receivers_but_not_the_weights(server):
    """Gloo aborts a process that receives more than it posted: the node keeps its weights."""
    node = Node(server, timeout=BROKEN_GROUP_TIMEOUT)
    before = info(server)
    stream, plan, model = node.begin()
    stream.send(bucket_start=pb.BucketStart(sequence=0, tail=bucket_tail(pack(plan, model, 0))))
    longer = torch.cat([pack(plan, model, 0), torch.zeros(4096, dtype=torch.uint8)])
    try:
        node.trainer.send_bucket(longer, 0)
    except RuntimeError:
        pass  # the receivers died under it
    with pytest.raises(grpc.RpcError) as caught:
        while stream.recv().WhichOneof("message") != "aborting":
            pass
        end(stream)
        stream.recv()
    stream.close()
    def owner_restarted():
        """Bucket 0's owner (worker 0: common/ownership.py) received more than it posted and died; the
        other worker never received it (Gloo sends each bucket to its owner alone)."""
        now = info(server)
        done = all(w.state == pb.WORKER_STATE_RUNNING for w in now.workers) and [
            w.restart_count - b.restart_count for w, b in zip(now.workers, before.workers, strict=True)] == [1, 0]
        return now if done else None

    restarted = wait_for(owner_restarted, timeout=60)
    assert restarted.store_state == pb.STORE_STATE_CONSISTENT  # STAGED: the kept store, untouched
    assert restarted.current_version == before.current_version
    assert server_checksums(server) == [local_checksums(node.model)]
    assert caught.value.code() in (Code.UNAVAILABLE, Code.ABORTED), caught.value.details()
    assert group_state(server, node.trainer.group_id) == pb.GROUP_STATE_BROKEN
    node.trainer.delete_group()
    fresh = Node(server)  # a new group on the same workers: a full update works
    fresh.assert_unharmed()
    fresh.trainer.delete_group()


@pytest.mark.parametrize("wrong", ["duplicate", "ahead"])
def test_out_of_order_announcement_is_drained_and_refused_at_once(node, wrong):
    stream, plan, model = node.begin()
    if wrong == "duplicate":
        stream.send(bucket_start=pb.BucketStart(sequence=0, tail=bucket_tail(pack(plan, model, 0))))
        node.trainer.send_bucket(pack(plan, model, 0), 0)
        assert stream.recv().bucket_applied.sequence == 0
    started = time.monotonic()
    sequence = 0 if wrong == "duplicate" else 2
    stream.send(bucket_start=pb.BucketStart(sequence=sequence, tail=bucket_tail(pack(plan, model, sequence))))
    node.trainer.send_bucket(pack(plan, model, sequence), sequence)  # drained by its owner: returns at once
    report = aborting(stream)
    assert time.monotonic() - started < AT_ONCE, f"the trainer waited for the group timeout ({GROUP_TIMEOUT:g} s)"
    assert report.reason == "BUCKET_OUT_OF_ORDER"
    assert end(stream).code() == Code.INVALID_ARGUMENT
    assert group_state(node.server, node.trainer.group_id) == pb.GROUP_STATE_READY  # and it is: the next push works
    node.assert_unharmed()


def test_an_announcement_nothing_can_drain_breaks_the_group_at_once(server):
    node = Node(server, timeout=BROKEN_GROUP_TIMEOUT)
    stream, plan, _ = node.begin()
    started = time.monotonic()
    stream.send(bucket_start=pb.BucketStart(sequence=len(plan.buckets) + 5))  # no such bucket, no length
    report = aborting(stream)
    assert report.reason == "BUCKET_OUT_OF_RANGE"
    assert group_state(server, node.trainer.group_id) == pb.GROUP_STATE_BROKEN  # said at once, not READY
    assert time.monotonic() - started < BROKEN_GROUP_TIMEOUT / 2  # said at once, not at the group's timeout
    with pytest.raises(RuntimeError):  # the trainer's own broadcast has no receivers: its timeout
        node.trainer.send_bucket(torch.zeros(64, dtype=torch.uint8), len(plan.buckets) + 5)
    end(stream)
    wait_for(lambda: info(server).store_state == pb.STORE_STATE_CONSISTENT, timeout=10)
    assert server_checksums(server) == [local_checksums(node.model)]
    node.trainer.delete_group()
    fresh = Node(server)
    fresh.assert_unharmed()
    fresh.trainer.delete_group()
