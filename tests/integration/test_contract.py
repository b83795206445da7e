"""The dtype table, the bucket layout helpers, stub freshness, and the data-plane revision the server
reports and the SDK checks."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from weightsync.client import WeightSyncClient, WeightSyncClientError
from weightsync.client.channels.revision import DataPlaneRevisionUnsupported
from weightsync.common import dtypes
from weightsync.common.data_plane import DATA_PLANE_REVISION
from weightsync.common.errors import InvalidArgument
from weightsync.common.layout import ALIGN_BYTES, TensorMeta, align_up, plan_buckets
from weightsync.v1 import tensor_pb2, weight_sync_service_pb2_grpc
from weightsync.v1 import weight_sync_service_pb2 as wpb

from helpers import UpdateStream, error_info, local_checksums, pack, server_checksums, start_server
from helpers import plan_buckets as helper_plan_buckets

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", [v for v in tensor_pb2.Dtype.values() if v != tensor_pb2.DTYPE_UNSPECIFIED])
def test_every_dtype_round_trips(value):
    torch_dtype = dtypes.to_torch(value)
    assert dtypes.from_torch(torch_dtype) == value
    assert dtypes.itemsize(value) == torch_dtype.itemsize
    assert torch.empty(3, dtype=torch_dtype).element_size() == dtypes.itemsize(value)


def test_table_covers_the_whole_enum():
    assert set(dtypes.SUPPORTED_PROTO_DTYPES) == set(tensor_pb2.Dtype.values()) - {tensor_pb2.DTYPE_UNSPECIFIED}
    assert len(dtypes.SUPPORTED_PROTO_DTYPES) >= 12


def test_unspecified_and_unknown_dtypes_are_rejected():
    with pytest.raises(InvalidArgument) as caught:
        dtypes.to_torch(tensor_pb2.DTYPE_UNSPECIFIED, tensor="w")
    assert caught.value.reason == "DTYPE_UNSPECIFIED"
    assert caught.value.metadata == {"tensor": "w"}
    with pytest.raises(InvalidArgument) as caught:
        dtypes.to_torch(999)
    assert caught.value.reason == "DTYPE_UNKNOWN"


def test_unsupported_torch_dtype_names_the_supported_ones():
    with pytest.raises(ValueError, match="complex64 is not supported"):
        dtypes.from_torch(torch.complex64)


@pytest.mark.parametrize(
    ("value", "alignment", "expected"),
    [(0, 64, 0), (1, 64, 64), (63, 64, 64), (64, 64, 64), (65, 64, 128), (5, 8, 8), (16, 8, 16)],
)
def test_align_up(value, alignment, expected):
    assert align_up(value, alignment) == expected


def meta(name: str, numel: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return TensorMeta(name, dtype, (numel,))


@pytest.mark.parametrize(
    ("sizes", "bucket", "expected"),
    [
        # (numel of float32 tensors), bucket bytes -> [(offsets...), size] per bucket
        ([16], 1024, [((0,), 64)]),
        ([16, 16], 1024, [((0, 64), 128)]),
        ([1, 1, 1], 1024, [((0, 64, 128), 192)]),  # each tensor starts on a 64-byte boundary
        ([200, 100], 1024, [((0,), 832), ((0,), 448)]),  # 800 B + 400 B > 1 KiB: two buckets
        ([1000], 1024, [((0,), 4032)]),  # bigger than the bucket: alone, its size, aligned
        ([10, 1000, 10], 1024, [((0,), 64), ((0,), 4032), ((0,), 64)]),
        ([0, 16], 1024, [((0, 0), 64)]),  # an empty tensor takes no room
    ],
)
def test_plan_buckets(sizes, bucket, expected):
    buckets = plan_buckets([meta(f"t{i}", n) for i, n in enumerate(sizes)], bucket)
    assert [(tuple(p.offset_bytes for p in b.tensors), b.size_bytes) for b in buckets] == expected


def test_plan_buckets_keeps_order_and_sizes_in_proto():
    metas = [meta("a", 3, torch.bfloat16), TensorMeta("b", torch.int64, ()), meta("c", 0, torch.bool)]
    (bucket,) = plan_buckets(metas, 1 << 20)
    proto = bucket.to_proto()
    assert [(t.name, t.dtype, list(t.shape), t.offset_bytes, t.size_bytes) for t in proto.tensors] == [
        ("a", tensor_pb2.DTYPE_BFLOAT16, [3], 0, 6),
        ("b", tensor_pb2.DTYPE_INT64, [], ALIGN_BYTES, 8),
        ("c", tensor_pb2.DTYPE_BOOL, [0], 2 * ALIGN_BYTES, 0),
    ]
    assert proto.size_bytes == 2 * ALIGN_BYTES


def test_bucket_size_below_alignment_is_refused():
    with pytest.raises(ValueError, match="at least 64"):
        plan_buckets([meta("a", 1)], 32)


def test_generated_stubs_are_fresh(tmp_path):
    """Regenerate every stub and compare bytes with the committed ones (make proto fixes it)."""
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert len(generated) == 3 * len(protos)
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (ROOT / "protos" / p).read_bytes()]
    assert stale == [], f"stale generated stubs (run `make proto`): {stale}"


# -- the data-plane revision (GetServerInfo.data_plane_revision) ----------------------------------
class _FakeServer(weight_sync_service_pb2_grpc.WeightSyncServiceServicer):
    """Answers GetServerInfo with a given data-plane revision and counts every other call; an update
    that reaches it is refused at once (FAILED_PRECONDITION), so a push that gets this far fails
    for another reason than the revision."""

    def __init__(self, revision: int) -> None:
        self.revision = revision
        self.calls: list[str] = []

    def GetServerInfo(self, request, context):
        return wpb.GetServerInfoResponse(
            server_version="fake", data_plane_revision=self.revision,
            workers=[wpb.WorkerInfo(index=0, device="cpu", backend=wpb.BACKEND_GLOO,
                                    state=wpb.WORKER_STATE_RUNNING)],
            backends=[wpb.BACKEND_GLOO], transports=[wpb.TRANSPORT_COLLECTIVE, wpb.TRANSPORT_INLINE],
            limits=wpb.ServerLimits(max_tensors=1000, max_plan_bytes=1 << 30, max_bucket_bytes=1 << 30,
                                    max_message_bytes=32 << 20, max_chunk_bytes=(32 << 20) - (64 << 10),
                                    ingress_slot_bytes=1 << 20, ingress_slot_count=2))

    def UpdateWeights(self, request_iterator, context):
        self.calls.append("UpdateWeights")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a fake server takes no update")

    def CreateTransferGroup(self, request, context):
        self.calls.append("CreateTransferGroup")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a fake server joins no group")


@pytest.fixture
def fake_server():
    servers = []

    def start(revision: int) -> tuple[str, _FakeServer]:
        servicer = _FakeServer(revision)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        weight_sync_service_pb2_grpc.add_WeightSyncServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for server in servers:
        server.stop(grace=None).wait(10)


@pytest.mark.parametrize("revision", [0, DATA_PLANE_REVISION - 1, DATA_PLANE_REVISION + 1],
                         ids=["unset", "older", "newer"])
def test_the_sdk_refuses_a_server_of_another_data_plane_revision_before_a_byte_moves(fake_server, revision):
    address, servicer = fake_server(revision)
    with WeightSyncClient(address, timeout=10) as client:
        with pytest.raises(DataPlaneRevisionUnsupported) as caught:
            client.push({"w": torch.ones(16)}, version="v1", transport="inline", delta=False,
                        allow_new_tensors=True)
        assert (caught.value.server, caught.value.revision) == (address, revision)
        assert caught.value.reason == "DATA_PLANE_REVISION_UNSUPPORTED"
        assert f"this SDK speaks [{DATA_PLANE_REVISION}]" in str(caught.value)
        with pytest.raises(DataPlaneRevisionUnsupported):
            client.create_group(backend="gloo", timeout=10)
    assert servicer.calls == []  # refused before any update or group: nothing reached the server


def test_a_server_of_the_sdk_s_revision_gets_the_update(fake_server):
    """The control: the same fake server, speaking the SDK's revision, is sent the update (which it
    refuses for its own reason), so the refusal above is the revision's."""
    address, servicer = fake_server(DATA_PLANE_REVISION)
    with WeightSyncClient(address, timeout=10) as client:
        with pytest.raises(WeightSyncClientError) as caught:
            client.push({"w": torch.ones(16)}, version="v1", transport="inline", delta=False,
                        allow_new_tensors=True)
        assert not isinstance(caught.value, DataPlaneRevisionUnsupported)
    assert servicer.calls == ["UpdateWeights"]


def test_the_server_reports_its_data_plane_revision_and_a_push_follows(tmp_path):
    server = start_server(tmp_path, workers=1)
    try:
        info = server.stub().GetServerInfo(wpb.GetServerInfoRequest(), timeout=10)
        assert info.data_plane_revision == DATA_PLANE_REVISION
        model = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
        with WeightSyncClient(server.address, timeout=30) as client:
            result = client.push(model, version="v1", transport="inline", allow_new_tensors=True)
            assert result.version == "v1"
            assert client.verify(model).ok
    finally:
        assert server.stop() == 0, server.log()[-3000:]


# -- parts (issue 35 item 3): appended fields, refused until the server joins parts -----------------
def test_the_parts_fields_are_appended_and_an_old_client_s_messages_read_as_one_part():
    """Field numbers appended after the last ones in use, nothing renumbered: a message an old client
    writes (no part, no box) parses unchanged, as the whole update (the case of one part)."""
    numbers = {
        (wpb.BeginUpdate, "part"): 10, (tensor_pb2.TensorSpec, "box"): 10,
        (wpb.GetServerInfoResponse, "parts"): 15, (wpb.UpdateWeightsResponse, "waiting"): 5,
        (wpb.UpdatePart, "update_key"): 1, (wpb.UpdatePart, "rank"): 2, (wpb.UpdatePart, "world"): 3,
        (wpb.UpdatePart, "whole_tensors"): 4, (wpb.UpdatePart, "boxed_tensors"): 5,
        (wpb.UpdatePart, "join_timeout"): 6, (wpb.PartBoxes, "name"): 1, (wpb.PartBoxes, "boxes"): 2,
        (tensor_pb2.TensorBox, "offsets"): 1, (tensor_pb2.TensorBox, "sizes"): 2,
        (wpb.PartsWaiting, "joining"): 1, (wpb.PartsWaiting, "sending"): 2,
        # the fields before them keep their numbers
        (wpb.BeginUpdate, "base_store_epoch"): 9, (tensor_pb2.TensorSpec, "piece"): 9,
        (wpb.GetServerInfoResponse, "data_plane_revision"): 14, (wpb.UpdateWeightsResponse, "committed"): 4,
    }
    assert {key: key[0].DESCRIPTOR.fields_by_name[key[1]].number for key in numbers} == numbers
    spec = tensor_pb2.TensorSpec(name="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4], size_bytes=16)
    old = wpb.BeginUpdate(version="v1", plan=tensor_pb2.WeightPlan(buckets=[
        tensor_pb2.BucketSpec(size_bytes=64, tensors=[spec])]), mode=wpb.UPDATE_MODE_STAGED,
        transport=wpb.TRANSPORT_INLINE)
    # What an old client sends, written byte by byte: tag (field 2, length), "v1", then the plan ...
    wire = old.SerializeToString()
    assert wire.startswith(b"\x12\x02v1\x1a") and wire.endswith(b"\x28\x02\x30\x03")
    parsed = wpb.BeginUpdate.FromString(wire)
    assert not parsed.HasField("part") and not parsed.plan.buckets[0].tensors[0].HasField("box")
    assert parsed == old


def _refusal(stub, begin: wpb.BeginUpdate):
    stream = UpdateStream(stub)
    stream.send(begin=begin)
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    info = error_info(caught.value)
    return caught.value.code(), info.reason, dict(info.metadata)


def _push_whole(stub, model: dict[str, torch.Tensor], version: str) -> wpb.UpdateWeightsResponse:
    """One whole INLINE update over the raw stream (no part): the committed response."""
    plan = helper_plan_buckets(list(model.items()), 1 << 20)
    stream = UpdateStream(stub)
    stream.send(begin=wpb.BeginUpdate(version=version, plan=plan, mode=wpb.UPDATE_MODE_STAGED,
                                      transport=wpb.TRANSPORT_INLINE, allow_new_tensors=True))
    assert stream.recv().WhichOneof("message") == "ready"
    for k in range(len(plan.buckets)):
        data = pack(plan, model, k).numpy().tobytes()
        stream.send(bucket_start=wpb.BucketStart(sequence=k, size_bytes=len(data)))
        stream.send(bucket_chunk=wpb.BucketChunk(sequence=k, offset_bytes=0, data=data))
        assert stream.recv().WhichOneof("message") == "bucket_applied"
    stream.send(commit=wpb.CommitUpdate())
    committed = stream.recv()
    stream.close()
    assert committed.WhichOneof("message") == "committed", committed
    return committed


def test_a_boxed_plan_is_refused_where_the_store_does_not_place_boxes(tmp_path):
    """GetServerInfo.parts is true (parts over INLINE, whole tensors and boxes), and a plan sending a box is
    refused before the part joins where the server does not place it: without a part (INVALID_ARGUMENT
    BOX_WITHOUT_PART: a box's bytes would otherwise pass for the whole tensor's). A part's box over COLLECTIVE is
    placed (parts send point-to-point to its owner): it needs a group (NOT_FOUND GROUP_NOT_FOUND here). Nothing
    changes, and the next whole push commits and verifies.
    (Boxes placed: test_box_parts; the join of parts: test_part_joins.)"""
    server = start_server(tmp_path, workers=1)
    try:
        stub = server.stub()
        model = {"w": torch.arange(64, dtype=torch.float32)}
        assert _push_whole(stub, model, "v1").committed.version.generation == 1
        info = stub.GetServerInfo(wpb.GetServerInfoRequest(), timeout=10)
        assert info.parts is True and info.current_version.generation == 1
        box = tensor_pb2.TensorSpec(name="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[64], size_bytes=128,
                                    box=tensor_pb2.TensorBox(offsets=[0], sizes=[32]))
        boxed = tensor_pb2.WeightPlan(buckets=[tensor_pb2.BucketSpec(size_bytes=128, tensors=[box])])
        part = wpb.UpdatePart(update_key="v2-3f9a", rank=1, world=2,
                              boxed_tensors=[wpb.PartBoxes(name="w", boxes=[box.box])])
        common = dict(version="v2", mode=wpb.UPDATE_MODE_STAGED)
        assert _refusal(stub, wpb.BeginUpdate(plan=boxed, part=part, transport=wpb.TRANSPORT_COLLECTIVE,
                                              **common)) == (  # before the part joins
            grpc.StatusCode.NOT_FOUND, "GROUP_NOT_FOUND", {})
        assert _refusal(stub, wpb.BeginUpdate(plan=boxed, transport=wpb.TRANSPORT_INLINE, **common)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "BOX_WITHOUT_PART", {"bucket": "0", "tensor": "w"})
        after = stub.GetServerInfo(wpb.GetServerInfoRequest(), timeout=10)
        assert (after.current_version, after.store_state) == (info.current_version, info.store_state)
        assert server_checksums(server) == [local_checksums(model)]
        model["w"] += 1
        assert _push_whole(stub, model, "v3").committed.version.generation == 2
        assert server_checksums(server) == [local_checksums(model)]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
