"""A failed push never lends its plan to the next one.

The SDK used to remember the plan id of an update that answered Ready even
when that update then failed, and the next push whose layout equalled the last
committed plan went out as a reference to the failed plan: silent corruption,
workers killed in Gloo, or every later push refused. Plan ids are now the
plan's content hash, and every cache changes on commit only.
"""

from __future__ import annotations

import grpc
import pytest

from weightsync.client import WeightSyncClient
from weightsync.common.plan_id import plan_id_of
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    PlainTrainer,
    UpdateStream,
    error_reason,
    local_checksums,
    plan_buckets,
    server_checksums,
)
from models import mixed_model

pytestmark = pytest.mark.timeout(180)
BUCKET = 4096


class Boom(Exception):
    pass


class RaiseAt:
    """A progress callback that raises once bucket `at` is on its way (the push then fails)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, report) -> None:
        if report.bucket == self.at:
            raise Boom(f"callback raised at bucket {self.at}")


def reversed_model(model):
    return dict(reversed(model.items()))


def first_three(model):
    return dict(list(model.items())[:3])


def with_extra(model):
    return {**model, "extra.weight": model["layers.0.attn.q_proj.bias"] * 2}


# (what the failed push sends, its bucket size, its allow_new_tensors) -- the outside testers' variants
FAILED_PUSHES = [
    pytest.param(reversed_model, BUCKET, False, id="reversed-dict"),  # old: success reported, every tensor wrong
    pytest.param(reversed_model, 2 * BUCKET, False, id="other-bucket-size"),  # old: workers SIGABRT in Gloo
    pytest.param(first_three, BUCKET, False, id="failed-subset"),  # old: BUCKET_OUT_OF_RANGE
    pytest.param(with_extra, BUCKET, True, id="added-a-name"),  # old: TENSOR_UNKNOWN forever after
]


@pytest.mark.parametrize(("failed", "bucket_size", "allow_new"), FAILED_PUSHES)
def test_a_failed_push_never_lends_its_plan_to_the_next(server, failed, bucket_size, allow_new):
    committed = mixed_model(1)
    with WeightSyncClient(server.address) as client:
        client.create_group(timeout=30)
        client.push(committed, version="m1", bucket_size_bytes=BUCKET, allow_new_tensors=True)
        workers_before = [w.pid for w in client.server_info()[0].workers]
        with pytest.raises(Boom):
            client.push(failed(committed), version="failed", bucket_size_bytes=bucket_size,
                        allow_new_tensors=allow_new, progress=RaiseAt(1))
        for seed in (2, 3):  # the layout of the last commit, new values, twice
            model = mixed_model(seed)
            result = client.push(model, version=f"m{seed}", bucket_size_bytes=BUCKET)
            assert result.servers[0].version == f"m{seed}"
            assert client.verify(model).ok
            assert server_checksums(server, sorted(model)) == [local_checksums(model)]
        assert result.plan_reused  # the committed plan is sent by id again, and it is the right one
        info = client.server_info()[0]
        assert info.store_state == pb.STORE_STATE_CONSISTENT
        assert [w.pid for w in info.workers] == workers_before  # nobody died in Gloo


def test_the_server_knows_plans_by_content_and_only_once_committed(server):
    """Server side: an id names one layout; a plan that only reached Ready is not held."""
    trainer = PlainTrainer([server])
    trainer.create_group()
    try:
        model = mixed_model(5)
        plan = plan_buckets(list(model.items()), 1 << 20)
        committed = trainer.push(model, "c1", plan=plan)
        assert committed.version.version == "c1"
        other = plan_buckets(list(reversed(model.items())), 1 << 20)
        stream, ready = trainer.begin(server.stub(), other, "never-committed")
        assert ready.plan_id == plan_id_of(other)  # content-derived: the client can compute it
        stream.send(abort=pb.AbortUpdate(reason="test"))
        with pytest.raises(grpc.RpcError):
            stream.recv()
        stream.close()
        for plan_id, expected in ((plan_id_of(other), "PLAN_NOT_FOUND"), ("0" * 32, "PLAN_NOT_FOUND")):
            stream = UpdateStream(server.stub())
            stream.send(begin=pb.BeginUpdate(group_id=trainer.group_id, version="by-id", plan_id=plan_id,
                                             mode=pb.UPDATE_MODE_IN_PLACE, transport=pb.TRANSPORT_COLLECTIVE))
            with pytest.raises(grpc.RpcError) as caught:
                stream.recv()
            stream.close()
            assert (caught.value.code(), error_reason(caught.value)) == (grpc.StatusCode.NOT_FOUND, expected)
        stream = UpdateStream(server.stub())
        stream.send(begin=pb.BeginUpdate(group_id=trainer.group_id, version="by-id", plan_id=plan_id_of(plan),
                                         mode=pb.UPDATE_MODE_IN_PLACE, transport=pb.TRANSPORT_COLLECTIVE))
        assert stream.recv().ready.plan_id == plan_id_of(plan)
        stream.send(abort=pb.AbortUpdate(reason="test"))
        with pytest.raises(grpc.RpcError):
            stream.recv()
        stream.close()
        assert server_checksums(server) == [local_checksums(model)]
    finally:
        trainer.delete_group()
