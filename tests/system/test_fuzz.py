"""Property-based bad input. Every example gets a clear status (never
INTERNAL or UNKNOWN, never a crash or a hang), and a valid update afterwards
still commits with correct checksums."""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.common.shm_queue import OwnedQueue, QueueCorrupted, ShmQueue
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import PlainTrainer, UpdateStream, local_checksums, server_checksums
from models import mixed_model

pytestmark = pytest.mark.timeout(600)

# 1,000 plans through the whole Begin path, plus raw bytes and framing cases.
EXAMPLES = int(os.environ.get("WEIGHTSYNC_FUZZ_EXAMPLES", "1000"))
CLEAR_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.ABORTED,
}
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SMALL = st.integers(min_value=-4, max_value=4096)
names = st.one_of(
    st.sampled_from(["embed.weight", "step", "mask", "lm_head.weight", ""]),
    st.text(min_size=0, max_size=8),
    st.text(alphabet="ab", min_size=1020, max_size=1030),
    st.just("é" * 600),
)
tensor_specs = st.builds(
    tensor_pb2.TensorSpec,
    name=names,
    dtype=st.one_of(st.sampled_from(list(tensor_pb2.Dtype.values())), st.integers(-3, 40)),
    shape=st.lists(st.one_of(SMALL, INT64), max_size=4),
    offset_bytes=st.one_of(SMALL, INT64),
    size_bytes=st.one_of(SMALL, INT64),
    checksum=st.builds(tensor_pb2.Checksum, algorithm=st.integers(0, 3), value=st.integers(0, 2**64 - 1)),
)
buckets = st.builds(tensor_pb2.BucketSpec, size_bytes=st.one_of(SMALL, INT64), tensors=st.lists(tensor_specs, max_size=4))
plans = st.builds(tensor_pb2.WeightPlan, buckets=st.lists(buckets, max_size=3))


@pytest.fixture(scope="module")
def trainer(server):
    t = PlainTrainer([server])
    t.create_group()
    t.push(mixed_model(1), "fuzz-base")
    yield t
    t.delete_group()


def begin_once(stub, begin: pb.BeginUpdate) -> grpc.StatusCode:
    stream = UpdateStream(stub)
    stream.send(begin=begin)
    try:
        first = stream.recv()
    except grpc.RpcError as error:
        return error.code()
    assert first.WhichOneof("message") == "ready"
    stream.send(abort=pb.AbortUpdate(reason="fuzz"))
    stream.close()
    try:
        stream.recv()
    except grpc.RpcError as error:
        return error.code()
    raise AssertionError("stream continued after abort")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    plan=plans,
    mode=st.integers(-1, 4),
    transport=st.integers(-1, 5),
    allow_new=st.booleans(),
    version=st.text(max_size=300),
    use_known_group=st.booleans(),
)
def test_random_plans_get_clear_statuses(server, trainer, plan, mode, transport, allow_new, version, use_known_group):
    begin = pb.BeginUpdate(
        group_id=trainer.group_id if use_known_group else "nope",
        version=version, plan=plan, mode=mode, transport=transport, allow_new_tensors=allow_new,
    )
    code = begin_once(server.stub(), begin)
    assert code in CLEAR_CODES, code


@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    method=st.sampled_from(
        ["GetServerInfo", "CreateTransferGroup", "DeleteTransferGroup", "ListTransferGroups", "GetTensorChecksums"]
    ),
    payload=st.binary(max_size=64),
)
def test_random_bytes_to_unary_methods(server, method, payload):
    channel = server.channel()
    call = channel.unary_unary(f"/weightsync.v1.WeightSyncService/{method}")
    try:
        call(payload, timeout=10)
    except grpc.RpcError as error:
        assert error.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (error.code(), error.details())
    finally:
        channel.close()


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(frames=st.lists(st.binary(max_size=300), min_size=1, max_size=8), corrupt_at=st.integers(0, 4095), byte=st.integers(0, 255), cut=st.booleans())
def test_shared_memory_framing_never_trusts_bad_bytes(frames, corrupt_at, byte, cut):
    owned = OwnedQueue(4096)
    reader = ShmQueue(owned.segment.buf, owned.doorbell_fd, initialise=False)
    try:
        written = [f for f in frames if owned.queue.try_put(f)]
        ring = owned.segment.buf
        if cut:  # a writer that died mid-frame: head claims more than was written
            head = int.from_bytes(ring[16:24], "little")
            ring[16:24] = (head + 1 + corrupt_at % 64).to_bytes(8, "little")
        else:
            ring[64 + corrupt_at] = byte
        got = []
        try:
            while (payload := reader.try_get()) is not None:
                got.append(payload)
        except QueueCorrupted:
            pass
        # Whatever came out is a prefix of what went in, byte for byte.
        assert got == written[: len(got)]
    finally:
        reader.release()
        owned.close()


def test_valid_update_after_fuzzing(server, trainer):
    model = mixed_model(99)
    committed = trainer.push(model, "after-fuzz")
    assert committed.version.version == "after-fuzz"
    assert server_checksums(server) == [local_checksums(model)]
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert [w.restart_count for w in info.workers] == [0, 0]
