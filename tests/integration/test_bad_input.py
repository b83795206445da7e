"""Every bad input gets its status code and ErrorInfo reason, and changes nothing.

One 2-worker server for the whole module, started with small limits so the
limit checks can be reached with small plans. One transfer group (the module
trainer) carries the good updates. After every test, an autouse check proves
that nothing was harmed: the last good version is still published, every
worker still holds exactly the last committed weights, and a fresh full update
commits with correct checksums on both workers.
"""

from __future__ import annotations

import datetime
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable

import grpc
import pytest
import torch
from torch.distributed import TCPStore

from weightsync.common.checksum import tensor_checksum
from weightsync.common.collective import bucket_tail
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    PlainTrainer,
    ServerProcess,
    UpdateStream,
    error_info,
    local_checksums,
    pack,
    plan_buckets,
    server_checksums,
    shm_segments,
    start_server,
    wait_for,
)
from models import mixed_model

pytestmark = pytest.mark.timeout(120)

MAX_TENSORS = 20
MAX_BUCKET_BYTES = 4 << 20
MAX_PLAN_BYTES = 16 << 20
WORKER_MEMORY_LIMIT = 2 << 20
"""A worker's staging (a general-path bucket is received there)."""
HOST_MEMORY_LIMIT = 12 << 20
"""The node's store and host staging together."""
BUCKET_BYTES = 1 << 20  # the module's good plans: 3 buckets (see mixed_model)
SERVICE = "/weightsync.v1.WeightSyncService/"

Code = grpc.StatusCode


# -- fixtures -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    """Overrides conftest's `server`: the same checks, plus small plan and memory limits."""
    proc = start_server(
        tmp_path_factory.mktemp("server"),
        "--max-tensors", str(MAX_TENSORS),
        "--max-bucket-bytes", str(MAX_BUCKET_BYTES),
        "--max-plan-bytes", str(MAX_PLAN_BYTES),
        "--worker-memory-limit-bytes", str(WORKER_MEMORY_LIMIT),
        "--host-memory-limit-bytes", str(HOST_MEMORY_LIMIT),
    )
    segments = proc.segments()
    assert len(segments) == 4  # a command and an event queue per worker
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()
    assert shm_segments() & segments == set()


class Tracker:
    """The last committed weights, and a way to commit fresh ones."""

    def __init__(self, server: ServerProcess, trainer: PlainTrainer) -> None:
        self.server = server
        self.trainer = trainer
        self.seed = 100
        self.model: dict[str, torch.Tensor] = {}
        self.version = pb.WeightVersion()
        self.expect_consistent = True

    def next_model(self) -> dict[str, torch.Tensor]:
        self.seed += 1
        return mixed_model(self.seed)

    def committed(self, model: dict[str, torch.Tensor], committed: pb.UpdateCommitted) -> None:
        assert committed.version.generation == self.version.generation + 1
        self.model = model
        self.version = committed.version

    def push_fresh(self) -> None:
        model = self.next_model()
        committed = self.trainer.push(model, f"v{self.seed}", bucket_bytes=BUCKET_BYTES)
        assert isinstance(committed, pb.UpdateCommitted), committed
        self.committed(model, committed)
        self.expect_consistent = True
        assert server_checksums(self.server) == [local_checksums(model)]

    def assert_unchanged(self) -> None:
        """The last good version is published and (unless told otherwise) held bit for bit."""
        info = server_info(self.server)
        assert [(w.state, w.restart_count) for w in info.workers] == [(pb.WORKER_STATE_RUNNING, 0)] * 2
        assert info.current_version.version == self.version.version
        assert info.current_version.generation == self.version.generation
        if self.expect_consistent:
            assert info.store_state == pb.STORE_STATE_CONSISTENT
            assert server_checksums(self.server) == [local_checksums(self.model)]


@pytest.fixture(scope="module")
def tracker(server) -> Tracker:
    trainer = PlainTrainer([server])
    trainer.create_group()
    state = Tracker(server, trainer)
    state.push_fresh()
    yield state
    trainer.delete_group()


@pytest.fixture(autouse=True)
def unharmed(tracker):
    """After each test: nothing changed, and a full update still commits correctly."""
    yield
    tracker.assert_unchanged()
    tracker.push_fresh()


# -- helpers --------------------------------------------------------------------------
def server_info(server: ServerProcess) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def group_ids(server: ServerProcess) -> list[str]:
    return [g.group_id for g in server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups]


def assert_error(error: grpc.RpcError, code: grpc.StatusCode, reason: str, **metadata: object) -> None:
    """The exact status code and ErrorInfo reason, and the given metadata values."""
    assert error.code() == code, (error.code(), error.details())
    info = error_info(error)
    assert info.reason == reason, (info.reason, error.details())
    assert info.domain == "weightsync"
    for key, value in metadata.items():
        assert key in info.metadata, (key, dict(info.metadata))
        assert info.metadata[key] == str(value), (key, dict(info.metadata))


def good_plan(model: dict[str, torch.Tensor] | None = None) -> tensor_pb2.WeightPlan:
    return plan_buckets(list((model or mixed_model(0)).items()), BUCKET_BYTES)


def begin_message(group_id: str, plan: tensor_pb2.WeightPlan | None = None, **fields) -> pb.BeginUpdate:
    values = dict(group_id=group_id, version="bad", mode=pb.UPDATE_MODE_IN_PLACE, transport=pb.TRANSPORT_COLLECTIVE)
    values.update(fields)
    begin = pb.BeginUpdate(**values)
    if plan is not None:
        begin.plan.CopyFrom(plan)
    return begin


def begin_error(server: ServerProcess, begin: pb.BeginUpdate) -> grpc.RpcError:
    """Open UpdateWeights with `begin`; the stream must end with an error before `ready`."""
    stream = UpdateStream(server.stub())
    stream.send(begin=begin)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            response = stream.recv()
            raise AssertionError(f"expected an error, got {response}")
    finally:
        stream.close()
    return caught.value


def group_request(group_id: str, port: int = 29999, **fields) -> pb.CreateTransferGroupRequest:
    values = dict(group_id=group_id, store_host="127.0.0.1", store_port=port, world_size=3, rank_offset=1,
                  backend=pb.BACKEND_GLOO)
    values.update(fields)
    request = pb.CreateTransferGroupRequest(**values)
    if "timeout" not in fields:
        request.timeout.FromTimedelta(datetime.timedelta(seconds=5))
    return request


def create_error(server: ServerProcess, request: pb.CreateTransferGroupRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().CreateTransferGroup(request, timeout=30)
    return caught.value


def ws64(buf: torch.Tensor) -> tensor_pb2.Checksum:
    return tensor_checksum(buf)


def wrong(checksum: tensor_pb2.Checksum) -> tensor_pb2.Checksum:
    return tensor_pb2.Checksum(algorithm=checksum.algorithm, value=checksum.value ^ 0x5A5A)


def send_bucket(trainer: PlainTrainer, stream: UpdateStream, plan, model, index: int, checksum=None) -> None:
    buf = pack(plan, model, index)
    stream.send(bucket_start=pb.BucketStart(sequence=index, checksum=ws64(buf) if checksum is None else checksum,
                                            tail=bucket_tail(buf)))
    trainer.send_bucket(buf, index)


def finish(trainer: PlainTrainer, stream: UpdateStream, plan, model, first: int) -> pb.UpdateCommitted:
    """Send buckets first.. with correct checksums, then commit."""
    for index in range(first, len(plan.buckets)):
        send_bucket(trainer, stream, plan, model, index)
        response = stream.recv()
        assert response.WhichOneof("message") == "bucket_applied", response
        assert response.bucket_applied.sequence == index
    stream.send(commit=pb.CommitUpdate())
    response = stream.recv()
    assert response.WhichOneof("message") == "committed", response
    stream.close()
    return response.committed


def expect_aborting(stream: UpdateStream, code: grpc.StatusCode, reason: str) -> pb.UpdateAborting:
    response = stream.recv()
    assert response.WhichOneof("message") == "aborting", response
    assert response.aborting.code == code.value[0]
    assert response.aborting.reason == reason
    return response.aborting


def end_with_abort(stream: UpdateStream) -> grpc.RpcError:
    """The client's side of the handshake after `aborting`: send abort, the stream ends with the status."""
    stream.send(abort=pb.AbortUpdate(reason="server said aborting"))
    try:
        with pytest.raises(grpc.RpcError) as caught:
            response = stream.recv()
            raise AssertionError(f"expected the stream to end, got {response}")
    finally:
        stream.close()
    return caught.value


# -- transfer groups --------------------------------------------------------------------
def test_unknown_group(server, tracker):
    error = begin_error(server, begin_message("no-such-group", good_plan()))
    assert_error(error, Code.NOT_FOUND, "GROUP_NOT_FOUND", group_id="no-such-group")
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().DeleteTransferGroup(pb.DeleteTransferGroupRequest(group_id="no-such-group"), timeout=10)
    assert_error(caught.value, Code.NOT_FOUND, "GROUP_NOT_FOUND", group_id="no-such-group")


def test_duplicate_group_id(server, tracker):
    error = create_error(server, group_request(tracker.trainer.group_id))
    assert_error(error, Code.ALREADY_EXISTS, "GROUP_ALREADY_EXISTS", group_id=tracker.trainer.group_id)
    groups = server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups
    assert [(g.group_id, g.state) for g in groups] == [(tracker.trainer.group_id, pb.GROUP_STATE_READY)]


@pytest.mark.parametrize(
    ("world_size", "rank_offset"),
    [
        (2, 1),  # two workers need ranks 1 and 2: world_size 3
        (3, 0),  # rank 0 is the trainer
        (3, 2),  # ranks 2, 3 do not fit in 3
        (1, 1),
        (0, 0),
        (5, -1),
        (-3, 1),
    ],
)
def test_ranks_do_not_fit(server, tracker, world_size, rank_offset):
    error = create_error(server, group_request("g-ranks", world_size=world_size, rank_offset=rank_offset))
    assert_error(error, Code.INVALID_ARGUMENT, "RANKS_DO_NOT_FIT", world_size=world_size, rank_offset=rank_offset, workers=2)
    assert group_ids(server) == [tracker.trainer.group_id]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"backend": pb.BACKEND_UNSPECIFIED}, "BACKEND_UNSPECIFIED"),
        ({"backend": pb.BACKEND_NCCL}, "BACKEND_UNSUPPORTED"),  # CPU workers
        ({"backend": 42}, "BACKEND_UNSUPPORTED"),
        ({"group_id": ""}, "GROUP_ID_INVALID"),
        ({"group_id": "has space"}, "GROUP_ID_INVALID"),
        ({"group_id": "slash/y"}, "GROUP_ID_INVALID"),
        ({"group_id": "ünïcode"}, "GROUP_ID_INVALID"),
        ({"group_id": "g" * 129}, "GROUP_ID_INVALID"),
        ({"store_host": ""}, "STORE_HOST_MISSING"),
        ({"store_port": 0}, "STORE_PORT_INVALID"),
        ({"store_port": 65536}, "STORE_PORT_INVALID"),
        ({"timeout": datetime.timedelta(0)}, "TIMEOUT_INVALID"),
        ({"timeout": datetime.timedelta(seconds=-1)}, "TIMEOUT_INVALID"),
        ({"timeout": datetime.timedelta(hours=1, seconds=1)}, "TIMEOUT_INVALID"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={str(x)[:12]}" for k, x in v.items()),
)
def test_bad_group_request(server, tracker, fields, reason):
    timeout = fields.pop("timeout", None)
    request = group_request(fields.pop("group_id", "g-bad"), **fields)
    if timeout is not None:
        request.timeout.FromTimedelta(timeout)
    error = create_error(server, request)
    assert_error(error, Code.INVALID_ARGUMENT, reason)
    assert group_ids(server) == [tracker.trainer.group_id]


def test_group_id_of_128_characters_is_valid(server, tracker):
    """The boundary of the id rule: 128 characters pass validation; no TCPStore listens, so joining times out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    group_id = "G." + "x-_9" * 31 + "ab"
    assert len(group_id) == 128
    request = group_request(group_id, port=port)
    request.timeout.FromTimedelta(datetime.timedelta(seconds=1))
    error = create_error(server, request)
    assert_error(error, Code.DEADLINE_EXCEEDED, "RENDEZVOUS_TIMEOUT", group_id=group_id)
    assert group_ids(server) == [tracker.trainer.group_id]


def test_rendezvous_timeout_leaves_nothing_behind(server, tracker):
    """Rank 0 opens its TCPStore but never creates its process group."""
    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    group_id = f"g-never-{uuid.uuid4().hex[:6]}"
    request = group_request(group_id, port=store.port)
    # Long enough that the checks below (five RPCs on fresh channels) run while it still joins,
    # even on a loaded machine.
    request.timeout.FromTimedelta(datetime.timedelta(seconds=8))
    outcome: dict = {}

    def create() -> None:
        started = time.monotonic()
        try:
            outcome["response"] = server.stub().CreateTransferGroup(request, timeout=60)
        except grpc.RpcError as error:
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=create)
    thread.start()
    try:
        # While it is joining: listed as JOINING, not deletable, not usable, not creatable twice.
        joining = wait_for(lambda: [g for g in server.stub().ListTransferGroups(
            pb.ListTransferGroupsRequest(), timeout=10).groups if g.group_id == group_id], timeout=10)
        assert joining[0].state == pb.GROUP_STATE_JOINING
        with pytest.raises(grpc.RpcError) as caught:
            server.stub().DeleteTransferGroup(pb.DeleteTransferGroupRequest(group_id=group_id), timeout=10)
        assert_error(caught.value, Code.FAILED_PRECONDITION, "GROUP_JOINING", group_id=group_id)
        error = begin_error(server, begin_message(group_id, good_plan(tracker.model)))
        assert_error(error, Code.FAILED_PRECONDITION, "GROUP_NOT_READY", group_id=group_id)
        error = create_error(server, group_request(group_id, port=store.port))
        assert_error(error, Code.ALREADY_EXISTS, "GROUP_ALREADY_EXISTS", group_id=group_id)
    finally:
        thread.join(60)
    assert "error" in outcome, outcome
    assert_error(outcome["error"], Code.DEADLINE_EXCEEDED, "RENDEZVOUS_TIMEOUT", group_id=group_id)
    assert 7.5 < outcome["seconds"] < 20, outcome["seconds"]
    assert group_id not in group_ids(server)

    # A new group, even under the same id, then works end to end.
    fresh = PlainTrainer([server], group_id=group_id)
    (created,) = fresh.create_group()
    assert created.group.state == pb.GROUP_STATE_READY
    try:
        model = tracker.next_model()
        committed = fresh.push(model, "after-rendezvous-timeout", bucket_bytes=BUCKET_BYTES)
        tracker.committed(model, committed)
        assert server_checksums(server) == [local_checksums(model)]
    finally:
        fresh.delete_group()
    assert group_ids(server) == [tracker.trainer.group_id]


# -- BeginUpdate fields -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "code", "reason"),
    [
        ({"mode": pb.UPDATE_MODE_UNSPECIFIED}, Code.INVALID_ARGUMENT, "MODE_UNSPECIFIED"),
        ({"mode": 7}, Code.INVALID_ARGUMENT, "MODE_UNKNOWN"),
        ({"transport": pb.TRANSPORT_UNSPECIFIED}, Code.INVALID_ARGUMENT, "TRANSPORT_UNSPECIFIED"),
        # INLINE and SHM carry no transfer group: a group id with them is a mistake, said as such.
        ({"transport": pb.TRANSPORT_SHM}, Code.INVALID_ARGUMENT, "GROUP_ID_UNEXPECTED"),
        ({"transport": pb.TRANSPORT_INLINE}, Code.INVALID_ARGUMENT, "GROUP_ID_UNEXPECTED"),
        ({"transport": 9}, Code.INVALID_ARGUMENT, "TRANSPORT_UNKNOWN"),
        ({"version": ""}, Code.INVALID_ARGUMENT, "VERSION_INVALID"),
        ({"version": "v" * 257}, Code.INVALID_ARGUMENT, "VERSION_INVALID"),
        ({"no_plan": True}, Code.INVALID_ARGUMENT, "PLAN_MISSING"),
        ({"plan_id": "0123456789abcdef0123456789abcdef"}, Code.INVALID_ARGUMENT, "PLAN_AND_PLAN_ID"),
    ],
    ids=lambda v: v if isinstance(v, str) else str(v)[:40] if not isinstance(v, grpc.StatusCode) else v.name,
)
def test_bad_begin(server, tracker, fields, code, reason):
    plan = None if fields.pop("no_plan", False) else good_plan(tracker.model)
    error = begin_error(server, begin_message(tracker.trainer.group_id, plan, **fields))
    assert_error(error, code, reason)


@pytest.mark.parametrize("with_base", [True, False], ids=["with-base-generation", "without"])
def test_a_negative_base_store_epoch_is_invalid_not_missing(server, tracker, with_base):
    """No store has a negative epoch: the field is malformed (BASE_EPOCH_INVALID, naming it), not
    absent (BASE_EPOCH_MISSING would tell a client to add the epoch it sent)."""
    generation = tracker.version.generation if with_base else 0
    begin = begin_message(tracker.trainer.group_id, good_plan(tracker.model), base_generation=generation,
                          base_store_epoch=-tracker.version.store_epoch)
    assert_error(begin_error(server, begin), Code.INVALID_ARGUMENT, "BASE_EPOCH_INVALID",
                 base_store_epoch=-tracker.version.store_epoch)


def test_plan_id_not_cached(server, tracker):
    group_id = tracker.trainer.group_id
    error = begin_error(server, begin_message(group_id, plan_id="0123456789abcdef0123456789abcdef"))
    assert_error(error, Code.NOT_FOUND, "PLAN_NOT_FOUND", plan_id="0123456789abcdef0123456789abcdef")

    # A plan that was accepted is cached under the id `ready` returned, and can be reused.
    model = tracker.next_model()
    plan = good_plan(model)
    stream, ready = tracker.trainer.begin(server.stub(), plan, "by-plan")
    assert ready.plan_id
    tracker.committed(model, finish(tracker.trainer, stream, plan, model, 0))
    model = tracker.next_model()
    stream = UpdateStream(server.stub())
    stream.send(begin=begin_message(group_id, plan_id=ready.plan_id, version="by-plan-id"))
    response = stream.recv()
    assert response.WhichOneof("message") == "ready", response
    assert response.ready.plan_id == ready.plan_id
    assert response.ready.bucket_count == len(plan.buckets)
    tracker.committed(model, finish(tracker.trainer, stream, plan, model, 0))
    assert server_checksums(server) == [local_checksums(model)]

    # A plan rejected by the workers is not cached.
    bad = good_plan(model)
    bad.buckets[0].tensors[0].shape[:] = [32, 64]  # same size, other shape
    error = begin_error(server, begin_message(group_id, bad))
    assert_error(error, Code.INVALID_ARGUMENT, "TENSOR_SHAPE_MISMATCH")
    from weightsync.common.plan_id import plan_id_of

    error = begin_error(server, begin_message(group_id, plan_id=plan_id_of(bad)))
    assert_error(error, Code.NOT_FOUND, "PLAN_NOT_FOUND")


# -- the plan --------------------------------------------------------------------------
# Plan of mixed_model with 1 MiB buckets:
#   bucket 0: embed.weight (bf16 64x32 at 0), layers.0.attn.q_proj.weight (fp16 32x32 at 4096),
#             layers.0.attn.q_proj.bias (f32 32 at 6144), ... , empty (fp16 0x4)
#   bucket 1: lm_head.weight (f32 300000)
#   bucket 2: final_norm.weight (bf16 32, 64 bytes)
Mutation = Callable[[tensor_pb2.WeightPlan], None]


def _set(bucket: int, tensor: int, **fields) -> Mutation:
    def mutate(plan: tensor_pb2.WeightPlan) -> None:
        spec = plan.buckets[bucket].tensors[tensor]
        for key, value in fields.items():
            if key == "shape":
                spec.shape[:] = value
            elif key == "checksum":
                spec.checksum.CopyFrom(value)
            else:
                setattr(spec, key, value)

    return mutate


def _shift(bucket: int, tensor: int, delta: int) -> Mutation:
    def mutate(plan: tensor_pb2.WeightPlan) -> None:
        plan.buckets[bucket].tensors[tensor].offset_bytes += delta

    return mutate


def _overlap(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets[0].tensors[1].offset_bytes = plan.buckets[0].tensors[0].offset_bytes + 64


def _out_of_bounds(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets[2].tensors[0].offset_bytes = 64  # 64 bytes at 64 in a 64-byte bucket


def _short_bucket(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets[1].size_bytes -= 4


def _duplicate_across(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets[2].tensors[0].name = "embed.weight"


def _duplicate_within(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets[0].tensors[2].name = plan.buckets[0].tensors[1].name


def _empty_bucket(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets.add(size_bytes=64)


def _empty_plan(plan: tensor_pb2.WeightPlan) -> None:
    del plan.buckets[:]


def _negative_bucket(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets[2].size_bytes = -64


def _unknown_tensor(plan: tensor_pb2.WeightPlan) -> None:
    plan.buckets[2].tensors[0].name = "not.in.the.store"


LONG_OK = "n" * 1024  # exactly at the limit: valid, so the worker says it is unknown


PLAN_CASES = [
    # (id, mutation, reason, metadata)
    ("dtype-unspecified", _set(0, 2, dtype=tensor_pb2.DTYPE_UNSPECIFIED), "DTYPE_UNSPECIFIED",
     {"tensor": "layers.0.attn.q_proj.bias", "bucket": 0}),
    ("dtype-unknown", _set(0, 2, dtype=99), "DTYPE_UNKNOWN",
     {"tensor": "layers.0.attn.q_proj.bias", "bucket": 0, "dtype": 99}),
    ("shape-negative", _set(0, 0, shape=[-64, -32]), "TENSOR_SHAPE_NEGATIVE", {"tensor": "embed.weight", "bucket": 0}),
    ("shape-too-large", _set(0, 0, shape=[1 << 40, 1 << 40]), "TENSOR_SHAPE_TOO_LARGE",
     {"tensor": "embed.weight", "bucket": 0}),
    ("shape-overflows-int64", _set(0, 0, shape=[1 << 62, 1 << 62, 1 << 62]), "TENSOR_SHAPE_TOO_LARGE",
     {"tensor": "embed.weight", "bucket": 0}),
    ("size-mismatch", _set(0, 2, size_bytes=132), "TENSOR_SIZE_MISMATCH",
     {"tensor": "layers.0.attn.q_proj.bias", "bucket": 0, "size_bytes": 132, "expected_bytes": 128}),
    ("size-negative", _set(0, 2, size_bytes=-128), "TENSOR_SIZE_MISMATCH",
     {"tensor": "layers.0.attn.q_proj.bias", "bucket": 0}),
    ("overlap", _overlap, "TENSOR_OVERLAP",
     {"tensor": "layers.0.attn.q_proj.weight", "bucket": 0, "offset_bytes": 64}),
    ("offset-unaligned", _shift(0, 2, 2), "TENSOR_OFFSET_UNALIGNED",
     {"tensor": "layers.0.attn.q_proj.bias", "bucket": 0, "offset_bytes": 6146}),
    ("offset-negative", _set(0, 0, offset_bytes=-64), "TENSOR_OFFSET_UNALIGNED", {"tensor": "embed.weight", "bucket": 0}),
    ("out-of-bounds", _out_of_bounds, "TENSOR_OUT_OF_BOUNDS",
     {"tensor": "final_norm.weight", "bucket": 2, "offset_bytes": 64, "size_bytes": 64}),
    ("bucket-too-short", _short_bucket, "TENSOR_OUT_OF_BOUNDS", {"tensor": "lm_head.weight", "bucket": 1}),
    ("duplicate-across-buckets", _duplicate_across, "TENSOR_NAME_DUPLICATE", {"tensor": "embed.weight", "bucket": 2}),
    ("duplicate-within-bucket", _duplicate_within, "TENSOR_NAME_DUPLICATE",
     {"tensor": "layers.0.attn.q_proj.weight", "bucket": 0}),
    ("name-empty", _set(2, 0, name=""), "TENSOR_NAME_EMPTY", {"bucket": 2}),
    ("name-1025-bytes", _set(2, 0, name="n" * 1025), "TENSOR_NAME_TOO_LONG", {"bucket": 2}),
    ("name-1026-utf8-bytes", _set(2, 0, name="é" * 513), "TENSOR_NAME_TOO_LONG", {"bucket": 2}),
    ("bucket-empty", _empty_bucket, "BUCKET_EMPTY", {"bucket": 3}),
    ("bucket-negative", _negative_bucket, "BUCKET_SIZE_NEGATIVE", {"bucket": 2}),
    ("plan-empty", _empty_plan, "PLAN_EMPTY", {}),
    ("checksum-algorithm-unknown", _set(2, 0, checksum=tensor_pb2.Checksum(algorithm=9, value=1)),
     "CHECKSUM_ALGORITHM_UNKNOWN", {"tensor": "final_norm.weight", "bucket": 2}),
    # Checked by the workers, against the store:
    ("shape-differs-from-store", _set(0, 0, shape=[32, 64]), "TENSOR_SHAPE_MISMATCH",
     {"tensor": "embed.weight", "bucket": 0}),
    ("dtype-differs-from-store", _set(0, 2, dtype=tensor_pb2.DTYPE_INT32), "TENSOR_DTYPE_MISMATCH",
     {"tensor": "layers.0.attn.q_proj.bias", "bucket": 0}),
    ("unknown-tensor", _unknown_tensor, "TENSOR_UNKNOWN", {"tensor": "not.in.the.store", "bucket": 2}),
    ("name-1024-bytes-is-valid", _set(2, 0, name=LONG_OK), "TENSOR_UNKNOWN", {"tensor": LONG_OK, "bucket": 2}),
]


@pytest.mark.parametrize(("mutate", "reason", "metadata"), [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_bad_plan(server, tracker, mutate, reason, metadata):
    plan = good_plan(tracker.next_model())
    mutate(plan)
    error = begin_error(server, begin_message(tracker.trainer.group_id, plan))
    assert_error(error, Code.INVALID_ARGUMENT, reason, **metadata)


def test_bad_plan_staged_with_new_tensors_allowed(server, tracker):
    """A plan error is found before anything is allocated, whatever the mode."""
    plan = good_plan(tracker.model)
    _set(0, 0, shape=[32, 64])(plan)
    plan.buckets[2].tensors[0].name = "new.tensor"
    error = begin_error(server, begin_message(tracker.trainer.group_id, plan, mode=pb.UPDATE_MODE_STAGED,
                                              allow_new_tensors=True))
    assert_error(error, Code.INVALID_ARGUMENT, "TENSOR_SHAPE_MISMATCH", tensor="embed.weight", bucket=0)
    assert [w.tensor_count for w in server_info(server).workers] == [len(tracker.model)] * 2


# -- limits ----------------------------------------------------------------------------
def _one_tensor_buckets(count: int, size: int, prefix: str) -> tensor_pb2.WeightPlan:
    plan = tensor_pb2.WeightPlan()
    for i in range(count):
        bucket = plan.buckets.add(size_bytes=size)
        bucket.tensors.add(name=f"{prefix}.{i}", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[size // 4], offset_bytes=0,
                           size_bytes=size)
    return plan


def _many_tensors(count: int) -> tensor_pb2.WeightPlan:
    plan = tensor_pb2.WeightPlan()
    bucket = plan.buckets.add(size_bytes=64 * count)
    for i in range(count):
        bucket.tensors.add(name=f"many.{i}", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[16], offset_bytes=64 * i,
                           size_bytes=64)
    return plan


def test_limits_are_reported(server, tracker):
    limits = server_info(server).limits
    assert (limits.max_tensors, limits.max_bucket_bytes, limits.max_plan_bytes) == (
        MAX_TENSORS, MAX_BUCKET_BYTES, MAX_PLAN_BYTES)


@pytest.mark.parametrize(
    ("plan", "code", "reason", "metadata"),
    [
        (_many_tensors(MAX_TENSORS + 1), Code.INVALID_ARGUMENT, "PLAN_TOO_MANY_TENSORS",
         {"limit": MAX_TENSORS, "bucket": 0}),
        # At the limit the plan is fine; its names are unknown to the store.
        (_many_tensors(MAX_TENSORS), Code.INVALID_ARGUMENT, "TENSOR_UNKNOWN", {"tensor": "many.0", "bucket": 0}),
        (_one_tensor_buckets(5, MAX_BUCKET_BYTES, "big"), Code.INVALID_ARGUMENT, "PLAN_TOO_MANY_BYTES",
         {"limit": MAX_PLAN_BYTES, "bucket": 4}),
        (_one_tensor_buckets(1, MAX_BUCKET_BYTES + 64, "huge"), Code.INVALID_ARGUMENT, "BUCKET_TOO_LARGE",
         {"bucket": 0, "size_bytes": MAX_BUCKET_BYTES + 64, "limit": MAX_BUCKET_BYTES}),
    ],
    ids=["too-many-tensors", "max-tensors-ok", "too-many-bytes", "bucket-too-large"],
)
def test_plan_limits(server, tracker, plan, code, reason, metadata):
    error = begin_error(server, begin_message(tracker.trainer.group_id, plan))
    assert_error(error, code, reason, **metadata)


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_IN_PLACE, pb.UPDATE_MODE_STAGED], ids=["in-place", "staged"])
def test_store_memory_limit(server, tracker, mode):
    """Three new 4 MiB tensors on top of the store do not fit the 12 MiB host limit (the node's store and
    host staging together): refused before any arena is allocated."""
    held = server_info(server).store.held_bytes
    plan = _one_tensor_buckets(3, MAX_BUCKET_BYTES, "oom")
    error = begin_error(server, begin_message(tracker.trainer.group_id, plan, mode=mode, allow_new_tensors=True))
    assert_error(error, Code.RESOURCE_EXHAUSTED, "HOST_OUT_OF_MEMORY", needed_bytes=3 * MAX_BUCKET_BYTES,
                 available_bytes=HOST_MEMORY_LIMIT - held)
    info = server_info(server)
    assert (info.store.tensor_count, info.store.held_bytes) == (len(tracker.model), held)


def test_worker_staging_limit(server, tracker):
    """A bucket that goes through staging (its layout is no segment's) larger than a worker's 2 MiB limit."""
    plan = plan_buckets(list(tracker.next_model().items()), MAX_BUCKET_BYTES)
    plan.buckets[0].size_bytes = MAX_BUCKET_BYTES  # padded: its layout is no segment's
    assert len(plan.buckets) == 1
    error = begin_error(server, begin_message(tracker.trainer.group_id, plan, mode=pb.UPDATE_MODE_STAGED))
    assert_error(error, Code.RESOURCE_EXHAUSTED, "WORKER_MEMORY_LIMIT", needed_bytes=MAX_BUCKET_BYTES,
                 limit=WORKER_MEMORY_LIMIT)


# -- checksums -------------------------------------------------------------------------
def test_bucket_checksum_mismatch_staged(server, tracker):
    """Bucket 0 has a wrong checksum; the client already announced bucket 1 too (pipelining)."""
    trainer = tracker.trainer
    model = tracker.next_model()
    plan = good_plan(model)
    stream, _ = trainer.begin(server.stub(), plan, "bad-bucket", mode=pb.UPDATE_MODE_STAGED)
    buf = pack(plan, model, 0)
    send_bucket(trainer, stream, plan, model, 0, checksum=wrong(ws64(buf)))
    send_bucket(trainer, stream, plan, model, 1)  # announced before `aborting` arrived: still broadcast
    aborting = expect_aborting(stream, Code.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH")
    assert "bucket 0" in aborting.message
    error = end_with_abort(stream)
    assert_error(error, Code.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH", bucket=0,
                 expected=f"{wrong(ws64(buf)).value:#018x}", actual=f"{ws64(buf).value:#018x}")
    # STAGED: the last commit is untouched, bit for bit (checked by the autouse fixture too).
    info = server_info(server)
    assert info.store_state == pb.STORE_STATE_CONSISTENT
    assert info.current_version == tracker.version
    assert server_checksums(server) == [local_checksums(tracker.model)]


def test_bucket_checksum_mismatch_in_place(server, tracker):
    """IN_PLACE: the failed bucket may have been written: INCONSISTENT, last good version still reported."""
    trainer = tracker.trainer
    model = tracker.next_model()
    plan = good_plan(model)
    stream, _ = trainer.begin(server.stub(), plan, "bad-bucket-in-place")
    send_bucket(trainer, stream, plan, model, 0)
    assert stream.recv().bucket_applied.sequence == 0
    send_bucket(trainer, stream, plan, model, 1, checksum=wrong(ws64(pack(plan, model, 1))))
    expect_aborting(stream, Code.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH")
    assert_error(end_with_abort(stream), Code.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH", bucket=1)
    info = server_info(server)
    assert info.store_state == pb.STORE_STATE_INCONSISTENT
    assert info.current_version == tracker.version
    tracker.expect_consistent = False  # the autouse full update restores CONSISTENT


def test_tensor_checksum_mismatch_staged(server, tracker):
    trainer = tracker.trainer
    model = tracker.next_model()
    plan = good_plan(model)
    for bucket in plan.buckets:
        for spec in bucket.tensors:
            spec.checksum.CopyFrom(ws64(model[spec.name].contiguous().reshape(-1).view(torch.uint8)))
    spec = plan.buckets[0].tensors[3]
    spec.checksum.value ^= 1
    stream, _ = trainer.begin(server.stub(), plan, "bad-tensor", mode=pb.UPDATE_MODE_STAGED)
    send_bucket(trainer, stream, plan, model, 0)
    expect_aborting(stream, Code.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH")
    assert_error(end_with_abort(stream), Code.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH", bucket=0, tensor=spec.name)
    info = server_info(server)
    assert info.store_state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(server) == [local_checksums(tracker.model)]

    # The same plan with correct tensor checksums commits.
    spec.checksum.value ^= 1
    stream, _ = trainer.begin(server.stub(), plan, "good-tensor", mode=pb.UPDATE_MODE_STAGED)
    tracker.committed(model, finish(trainer, stream, plan, model, 0))
    assert server_checksums(server) == [local_checksums(model)]


def test_bucket_checksum_algorithm_unknown(server, tracker):
    trainer = tracker.trainer
    model = tracker.next_model()
    plan = good_plan(model)
    stream, _ = trainer.begin(server.stub(), plan, "bad-algorithm", mode=pb.UPDATE_MODE_STAGED)
    send_bucket(trainer, stream, plan, model, 0, checksum=tensor_pb2.Checksum(algorithm=5, value=1))
    expect_aborting(stream, Code.INVALID_ARGUMENT, "CHECKSUM_ALGORITHM_UNKNOWN")
    assert_error(end_with_abort(stream), Code.INVALID_ARGUMENT, "CHECKSUM_ALGORITHM_UNKNOWN", bucket=0)


# -- stream protocol -------------------------------------------------------------------
def test_bucket_announced_out_of_order(server, tracker):
    model = tracker.next_model()
    plan = good_plan(model)
    stream, _ = tracker.trainer.begin(server.stub(), plan, "out-of-order", mode=pb.UPDATE_MODE_STAGED)
    # Announced and broadcast out of order: the workers drain it, so the broadcast completes.
    send_bucket(tracker.trainer, stream, plan, model, 1)
    expect_aborting(stream, Code.INVALID_ARGUMENT, "BUCKET_OUT_OF_ORDER")
    assert_error(end_with_abort(stream), Code.INVALID_ARGUMENT, "BUCKET_OUT_OF_ORDER", bucket=1, expected=0)


def test_commit_before_every_bucket(server, tracker):
    trainer = tracker.trainer
    model = tracker.next_model()
    plan = good_plan(model)
    stream, _ = trainer.begin(server.stub(), plan, "early-commit", mode=pb.UPDATE_MODE_STAGED)
    send_bucket(trainer, stream, plan, model, 0)
    assert stream.recv().bucket_applied.sequence == 0
    stream.send(commit=pb.CommitUpdate())
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    assert_error(caught.value, Code.FAILED_PRECONDITION, "BUCKETS_MISSING", received=1, expected=3)


def test_stream_dropped_mid_update(server, tracker):
    """A client that disappears after bucket 0 of a STAGED update: aborted on every worker, nothing changed."""
    trainer = tracker.trainer
    model = tracker.next_model()
    plan = good_plan(model)
    stream, _ = trainer.begin(server.stub(), plan, "dropped", mode=pb.UPDATE_MODE_STAGED)
    send_bucket(trainer, stream, plan, model, 0)
    assert stream.recv().bucket_applied.sequence == 0
    stream.cancel()
    stream.close()
    wait_for(lambda: server_info(server).store_state == pb.STORE_STATE_CONSISTENT, timeout=10)
    assert server_checksums_when_idle(server) == [local_checksums(tracker.model)]


def server_checksums_when_idle(server: ServerProcess) -> list[dict[str, int]]:
    """Checksums, waiting out the instant between the workers' abort and the server releasing the store."""
    def attempt():
        try:
            return server_checksums(server)
        except grpc.RpcError as error:
            if error_info(error).reason != "STORE_UPDATING":
                raise
            return None

    return wait_for(attempt, timeout=10)


def test_begin_missing(server, tracker):
    stream = UpdateStream(server.stub())
    stream.send(bucket_start=pb.BucketStart(sequence=0))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    assert_error(caught.value, Code.INVALID_ARGUMENT, "BEGIN_MISSING")
    stream = UpdateStream(server.stub())
    stream.close()
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    assert_error(caught.value, Code.INVALID_ARGUMENT, "BEGIN_MISSING")


def test_update_while_another_runs(server, tracker):
    """A second update on the same store is refused at once; the first one commits correctly."""
    trainer = tracker.trainer
    other = PlainTrainer([server])
    other.create_group()
    try:
        model = tracker.next_model()
        plan = good_plan(model)
        stream, ready = trainer.begin(server.stub(), plan, "first", mode=pb.UPDATE_MODE_STAGED)
        intruder = mixed_model(999)
        for group_id in (trainer.group_id, other.group_id):
            error = begin_error(server, begin_message(group_id, good_plan(intruder), version="second"))
            assert_error(error, Code.FAILED_PRECONDITION, "UPDATE_IN_PROGRESS", update_id=ready.update_id)
        with pytest.raises(grpc.RpcError) as caught:
            server.stub().DeleteTransferGroup(pb.DeleteTransferGroupRequest(group_id=trainer.group_id), timeout=10)
        assert_error(caught.value, Code.FAILED_PRECONDITION, "UPDATE_IN_PROGRESS", group_id=trainer.group_id)
        # A STAGED update writes only shadows: the committed version is read meanwhile, as committed.
        committed = server.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(), timeout=10)
        assert committed.version == tracker.version
        assert {t.name: t.checksum.value for t in committed.tensors} == local_checksums(tracker.model)
        assert server_info(server).store_state == pb.STORE_STATE_UPDATING

        send_bucket(trainer, stream, plan, model, 0)
        assert stream.recv().bucket_applied.sequence == 0
        # Mid-update, between buckets: still refused.
        error = begin_error(server, begin_message(other.group_id, good_plan(intruder), version="third"))
        assert_error(error, Code.FAILED_PRECONDITION, "UPDATE_IN_PROGRESS", update_id=ready.update_id)

        committed = finish(trainer, stream, plan, model, 1)
        assert committed.version.version == "first"
        tracker.committed(model, committed)
        assert server_checksums(server) == [local_checksums(model)]
    finally:
        other.delete_group()


# -- malformed messages ------------------------------------------------------------------
GARBAGE = b"\xff\xff\xff\xff\x0f"


@pytest.mark.parametrize(
    ("method", "payload"),
    [
        ("GetServerInfo", GARBAGE),
        ("CreateTransferGroup", GARBAGE),
        ("CreateTransferGroup", b"\x0a\x02\xc3\x28"),  # group_id: invalid UTF-8
        ("DeleteTransferGroup", b"\x0a\x09short"),  # length runs past the end
        ("ListTransferGroups", GARBAGE),
        ("GetTensorChecksums", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"),  # bad varint length
    ],
)
def test_malformed_unary(server, tracker, method, payload):
    call = server.channel().unary_unary(SERVICE + method)  # no serializers: raw bytes
    with pytest.raises(grpc.RpcError) as caught:
        call(payload, timeout=10)
    assert_error(caught.value, Code.INVALID_ARGUMENT, "MESSAGE_MALFORMED")


def test_malformed_watch(server, tracker):
    call = server.channel().unary_stream(SERVICE + "WatchWeights")
    with pytest.raises(grpc.RpcError) as caught:
        list(call(GARBAGE, timeout=10))
    assert_error(caught.value, Code.INVALID_ARGUMENT, "MESSAGE_MALFORMED")


def test_malformed_update_stream(server, tracker):
    call = server.channel().stream_stream(SERVICE + "UpdateWeights")
    # As the first message.
    with pytest.raises(grpc.RpcError) as caught:
        list(call(iter([GARBAGE]), timeout=10))
    assert_error(caught.value, Code.INVALID_ARGUMENT, "MESSAGE_MALFORMED")

    # After a valid begin: the update aborts (workers were prepared) and reports it.
    requests: queue.Queue = queue.Queue()
    begin = pb.UpdateWeightsRequest(begin=begin_message(tracker.trainer.group_id, good_plan(tracker.next_model())))
    requests.put(begin.SerializeToString())
    responses = call(iter(requests.get, None), timeout=30)
    ready = pb.UpdateWeightsResponse.FromString(next(responses))
    assert ready.WhichOneof("message") == "ready", ready
    requests.put(GARBAGE)
    aborting = pb.UpdateWeightsResponse.FromString(next(responses))
    assert aborting.WhichOneof("message") == "aborting", aborting
    assert aborting.aborting.reason == "MESSAGE_MALFORMED"
    with pytest.raises(grpc.RpcError) as caught:
        next(responses)
    requests.put(None)
    assert_error(caught.value, Code.INVALID_ARGUMENT, "MESSAGE_MALFORMED")
    assert server_info(server).store_state == pb.STORE_STATE_CONSISTENT


# -- GetTensorChecksums --------------------------------------------------
def test_checksums_of_unknown_names_are_not_found(server, tracker):
    request = pb.GetTensorChecksumsRequest(names=["embed.weight", "no.such.a", "no.such.b"])
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().GetTensorChecksums(request, timeout=30)
    assert_error(caught.value, Code.NOT_FOUND, "TENSOR_NOT_FOUND", count=2, tensors="no.such.a,no.such.b")


def test_checksums_of_a_name_twice_are_refused(server, tracker):
    request = pb.GetTensorChecksumsRequest(names=["embed.weight", "final_norm.weight", "embed.weight"])
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().GetTensorChecksums(request, timeout=30)
    assert_error(caught.value, Code.INVALID_ARGUMENT, "TENSOR_NAME_DUPLICATE", tensor="embed.weight")


def test_checksums_of_known_names_answer_exactly_those(server, tracker):
    names = ["final_norm.weight", "embed.weight"]
    response = server.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(names=names), timeout=30)
    expected = {n: v for n, v in local_checksums(tracker.model).items() if n in names}
    assert {t.name: t.checksum.value for t in response.tensors} == expected
    assert [t.name for t in response.tensors] == sorted(names)
    assert not response.workers
