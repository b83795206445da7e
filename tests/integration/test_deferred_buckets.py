"""Deferred buckets through the raw protocol, as a trainer in any language sends them: the plan
lists each deferred bucket's candidates and its room; BucketStart.layout says which of them the
bytes hold, as PATCH_XOR patches (built with the reference encoder, common.patch_format). INLINE,
one server with two workers. Every refusal is followed by the next normal update and a verify."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from weightsync.common import patch_format
from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.common.patches import XOR
from weightsync.common.plan_id import plan_id_of
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import DTYPE, UpdateStream, error_info, local_checksums, server_checksums, start_server
from helpers import mixed_model as model

pytestmark = pytest.mark.timeout(180)
EXAMPLE_DOC = Path(__file__).resolve().parents[2] / "docs" / "data-plane.md"
CHUNK = 1 << 20
GROUPS = (("embed", "w"), ("steps", "flags"))
"""The candidates of the two deferred buckets."""
ROOM = 64 << 10


def changed(base: dict[str, torch.Tensor], seed: int, names=("embed", "w", "steps", "flags"),
            fraction: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in base.items()}
    for name in names:
        flat = new[name].view(-1)
        picks = torch.nonzero(torch.rand(flat.numel(), generator=g) < fraction).reshape(-1)
        if not picks.numel():
            picks = torch.tensor([0])
        flat[picks] = ~flat[picks] if flat.dtype == torch.bool else flat[picks] + torch.ones((), dtype=flat.dtype)
    return new


def spec_of(name: str, tensor: torch.Tensor, **fields) -> tensor_pb2.TensorSpec:
    return tensor_pb2.TensorSpec(name=name, dtype=DTYPE[tensor.dtype], shape=list(tensor.shape), **fields)


def deferred_plan(named: dict[str, torch.Tensor], room: int = ROOM) -> tensor_pb2.WeightPlan:
    plan = tensor_pb2.WeightPlan()
    for group in GROUPS:
        bucket = plan.buckets.add(size_bytes=room, deferred=True)
        for name in group:
            bucket.tensors.add().CopyFrom(spec_of(name, named[name], encoding=XOR))
    return plan


def layout(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], group) -> tuple[tensor_pb2.BucketSpec, bytes]:
    """The changed tensors of `group` as PATCH_XOR patches at 64-byte offsets (unchanged ones left out)."""
    spec, data = tensor_pb2.BucketSpec(), b""
    for name in group:
        raw, count, _ = patch_format.encode(base[name], new[name])
        if not count:
            continue
        data = data.ljust(-(-len(data) // 64) * 64, b"\0")
        spec.tensors.add().CopyFrom(spec_of(name, new[name], offset_bytes=len(data), size_bytes=len(raw), encoding=XOR,
                                            patch_count=count, checksum=tensor_pb2.Checksum(
                                                algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=ws64(new[name]))))
        data += raw
    if data:
        data = data.ljust(max(8, len(data)), b"\0")
    spec.size_bytes = len(data)
    return spec, data


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def send(server, plan: tensor_pb2.WeightPlan | str, starts: list[tuple[pb.BucketStart, bytes]], version: str, *,
         mode=pb.UPDATE_MODE_STAGED, base: bool = True, stop_after: int | None = None,
         allow_new: bool = False) -> grpc.RpcError | pb.UpdateCommitted:
    """One update: the plan (or a plan id), then each BucketStart with its bytes in chunks."""
    current = info(server).current_version
    begin = pb.BeginUpdate(version=version, mode=mode, transport=pb.TRANSPORT_INLINE, allow_new_tensors=allow_new,
                           base_generation=current.generation if base else 0,
                           base_store_epoch=current.store_epoch if base else 0)
    if isinstance(plan, str):
        begin.plan_id = plan
    else:
        begin.plan.CopyFrom(plan)
    stream = UpdateStream(server.stub())
    stream.send(begin=begin)
    try:
        ready = stream.recv()
        assert ready.WhichOneof("message") == "ready"
        for k, (start, data) in enumerate(starts):
            if k in ready.ready.not_stored_buckets:  # none of its tensors is this node's: no bytes follow
                data = b""
            if k == stop_after:
                stream.send(abort=pb.AbortUpdate(reason="trainer stops half-way"))
                stream.recv()
                raise AssertionError("abort did not end the stream")
            stream.send(bucket_start=start)
            for offset in range(0, len(data), CHUNK):
                stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=offset,
                                                        data=data[offset: offset + CHUNK]))
            response = stream.recv()
            if response.WhichOneof("message") != "bucket_applied":
                stream.send(abort=pb.AbortUpdate(reason="server is aborting"))
                stream.recv()
                raise AssertionError(f"unexpected {response}")
            assert response.bucket_applied.size_bytes == len(starts[k][1])  # the layout's bytes, not the room
        stream.send(commit=pb.CommitUpdate())
        committed = stream.recv().committed
        stream.close()
        return committed
    except grpc.RpcError as error:
        stream.close()
        return error


def announced(k: int, spec: tensor_pb2.BucketSpec, data: bytes) -> tuple[pb.BucketStart, bytes]:
    checksum = tensor_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8)) if data else tensor_pb2.Checksum()
    return pb.BucketStart(sequence=k, size_bytes=len(data), checksum=checksum, layout=spec), data


def deferred_push(server, base, new, version: str, **kwargs):
    starts = [announced(k, *layout(base, new, group)) for k, group in enumerate(GROUPS)]
    return send(server, kwargs.pop("plan", None) or deferred_plan(new), starts, version, **kwargs)


def dense_push(server, named: dict[str, torch.Tensor], version: str, *, allow_new: bool = False):
    plan, starts = tensor_pb2.WeightPlan(), []
    for k, (name, tensor) in enumerate(named.items()):
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        data = data.ljust(max(8, len(data)), b"\0")
        bucket = plan.buckets.add(size_bytes=len(data))
        bucket.tensors.add().CopyFrom(spec_of(name, tensor, size_bytes=tensor.numel() * tensor.element_size()))
        starts.append((pb.BucketStart(sequence=k, size_bytes=len(data)), data))
    return send(server, plan, starts, version, base=False, allow_new=allow_new)


def committed(result) -> pb.UpdateCommitted:
    assert isinstance(result, pb.UpdateCommitted), result
    return result


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("deferred"))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture
def base(node) -> dict[str, torch.Tensor]:
    weights = model(1)
    committed(dense_push(node, weights, "base", allow_new=True))
    return weights


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_deferred_buckets_land_bit_for_bit_and_their_plan_is_reused_by_id(node, base, mode):
    """Three steps; the second changes only `embed` (its bucket's other candidate and the whole
    second bucket go as empty layouts), and is sent by plan id: a deferred plan's id is the same
    every step (no count, size or checksum in it)."""
    received = [w.received_bytes for w in info(node).workers]
    current = base
    plan = deferred_plan(base)
    for step, names in enumerate([("embed", "w", "steps", "flags"), ("embed",), ("w", "flags")]):
        new = changed(current, seed=10 + step, names=names)
        result = committed(deferred_push(node, current, new, f"d{step}", mode=mode,
                                         plan=plan_id_of(plan) if step else plan))
        assert result.size_bytes == sum(len(layout(current, new, g)[1]) for g in GROUPS)
        assert server_checksums(node) == [local_checksums(new)]
        current = new
    # Each deferred bucket was received by its owner alone: the two buckets, two workers.
    gained = [w.received_bytes - r for w, r in zip(info(node).workers, received, strict=True)]
    assert all(g > 0 for g in gained), gained


@pytest.mark.parametrize("field,value,reason", [
    ("size_bytes", 8, "DEFERRED_CANDIDATE_INVALID"),
    ("patch_count", 1, "DEFERRED_CANDIDATE_INVALID"),
    ("encoding", tensor_pb2.TENSOR_ENCODING_DENSE, "DEFERRED_CANDIDATE_INVALID"),
    ("name", "nope", "TENSOR_UNKNOWN"),
    ("shape", [4096, 65], "TENSOR_SHAPE_MISMATCH"),
])
def test_a_bad_candidate_is_refused_at_begin(node, base, field, value, reason):
    plan = deferred_plan(base)
    candidate = plan.buckets[0].tensors[0]
    if field == "shape":
        del candidate.shape[:]
        candidate.shape.extend(value)
    else:
        setattr(candidate, field, value)
    error = send(node, plan, [], "bad")
    assert isinstance(error, grpc.RpcError) and error_info(error).reason == reason
    assert server_checksums(node) == [local_checksums(base)]
    new = changed(base, seed=3)
    committed(deferred_push(node, base, new, "next"))
    assert server_checksums(node) == [local_checksums(new)]


def test_a_deferred_plan_needs_a_base(node, base):
    error = send(node, deferred_plan(base), [], "no-base", base=False)
    assert error_info(error).reason == "BASE_GENERATION_MISSING"
    new = changed(base, seed=4)
    committed(deferred_push(node, base, new, "next"))
    assert server_checksums(node) == [local_checksums(new)]


def _bad_layout(case: str, base, new) -> tuple[tensor_pb2.WeightPlan, pb.BucketStart, bytes]:
    plan = deferred_plan(base)
    spec, data = layout(base, new, GROUPS[0])
    start, data = announced(0, spec, data)
    if case == "missing":
        start.ClearField("layout")
    elif case == "unexpected":
        plan.buckets[0].deferred = False
        plan.buckets[0].CopyFrom(spec)
    elif case == "not a candidate":
        start.layout.tensors[1].name = "steps"
    elif case == "out of order":
        first, second = (tensor_pb2.TensorSpec(), tensor_pb2.TensorSpec())
        first.CopyFrom(start.layout.tensors[1])
        second.CopyFrom(start.layout.tensors[0])
        del start.layout.tensors[:]
        start.layout.tensors.extend([first, second])
    elif case == "dense":
        start.layout.tensors[1].encoding = tensor_pb2.TENSOR_ENCODING_DENSE
    elif case == "over the room":
        plan.buckets[0].size_bytes = len(data) - 8
    elif case == "overlap":
        start.layout.tensors[1].offset_bytes = 0
    elif case == "announced size":
        start.size_bytes = len(data) + 8
    elif case == "deferred layout":
        start.layout.deferred = True
    return plan, start, data


@pytest.mark.parametrize("case,reason", [
    ("missing", "BUCKET_LAYOUT_MISSING"), ("unexpected", "BUCKET_LAYOUT_UNEXPECTED"),
    ("not a candidate", "BUCKET_LAYOUT_INVALID"), ("out of order", "BUCKET_LAYOUT_INVALID"),
    ("dense", "BUCKET_LAYOUT_INVALID"), ("deferred layout", "BUCKET_LAYOUT_INVALID"),
    ("over the room", "BUCKET_TOO_LARGE"), ("overlap", "TENSOR_OVERLAP"), ("announced size", "BUCKET_SIZE_MISMATCH"),
])
@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_a_bad_layout_is_refused_and_writes_nothing(node, base, case, reason, mode):
    """Refused at its BucketStart, before a byte of it reaches a worker: the store keeps the base
    bit for bit, CONSISTENT whatever the mode, and the next deferred push patches it."""
    new = changed(base, seed=5)
    plan, start, data = _bad_layout(case, base, new)
    generation = info(node).current_version.generation
    error = send(node, plan, [(start, data)], "bad", mode=mode)
    assert isinstance(error, grpc.RpcError) and error_info(error).reason == reason, error
    assert info(node).store.state == pb.STORE_STATE_CONSISTENT
    assert info(node).current_version.generation == generation
    assert server_checksums(node) == [local_checksums(base)]
    committed(deferred_push(node, base, new, "next", mode=mode))
    assert server_checksums(node) == [local_checksums(new)]


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_a_layout_whose_checksum_is_wrong_is_data_loss_and_changes_nothing(node, base, mode):
    new = changed(base, seed=6)
    spec, data = layout(base, new, GROUPS[0])
    spec.tensors[1].checksum.value ^= 1
    starts = [announced(0, spec, data), announced(1, *layout(base, new, GROUPS[1]))]
    error = send(node, deferred_plan(base), starts, "bad", mode=mode)
    assert error.code() == grpc.StatusCode.DATA_LOSS and error_info(error).reason == "TENSOR_CHECKSUM_MISMATCH"
    assert info(node).store.state == pb.STORE_STATE_CONSISTENT  # the bucket's patches were taken back
    assert server_checksums(node) == [local_checksums(base)]
    committed(deferred_push(node, base, new, "next", mode=mode))
    assert server_checksums(node) == [local_checksums(new)]


def test_an_in_place_update_aborted_after_a_layout_dirties_only_what_it_laid_out(node, base):
    """Bucket 0 is laid out with `embed` alone (its other candidate, `w`, is unchanged); the
    trainer stops before bucket 1. Only `embed` is dirty: rewriting it alone makes the store
    CONSISTENT again (the other candidates were never written)."""
    new = changed(base, seed=7, names=("embed", "steps"))
    error = deferred_push(node, base, new, "torn", mode=pb.UPDATE_MODE_IN_PLACE, stop_after=1)
    assert error_info(error).reason == "ABORTED_BY_CLIENT"
    assert info(node).store.state == pb.STORE_STATE_INCONSISTENT
    committed(dense_push(node, {"embed": new["embed"]}, "embed again"))
    assert info(node).store.state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(node) == [local_checksums({**base, "embed": new["embed"]})]


def test_a_staged_update_aborted_after_a_layout_keeps_the_base(node, base):
    new = changed(base, seed=8)
    error = deferred_push(node, base, new, "torn", mode=pb.UPDATE_MODE_STAGED, stop_after=1)
    assert error_info(error).reason == "ABORTED_BY_CLIENT"
    assert info(node).store.state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(node) == [local_checksums(base)]
    committed(deferred_push(node, base, new, "next"))
    assert server_checksums(node) == [local_checksums(new)]


def test_the_documented_example_is_what_the_server_takes(tmp_path):
    """docs/data-plane.md, "Deferred buckets": the plan, the layout and the 8 bytes, as written there."""
    server = start_server(tmp_path, workers=1)
    try:
        a, b = torch.zeros(16, dtype=torch.bfloat16), torch.randn(8).to(torch.bfloat16)
        committed(dense_push(server, {"a": a, "b": b}, "base", allow_new=True))
        plan = tensor_pb2.WeightPlan()
        bucket = plan.buckets.add(size_bytes=64, deferred=True)
        bucket.tensors.add(name="a", dtype=tensor_pb2.DTYPE_BFLOAT16, shape=[16], encoding=XOR)
        bucket.tensors.add(name="b", dtype=tensor_pb2.DTYPE_BFLOAT16, shape=[8], encoding=XOR)
        spec = tensor_pb2.BucketSpec(size_bytes=8)
        spec.tensors.add(name="a", dtype=tensor_pb2.DTYPE_BFLOAT16, shape=[16], offset_bytes=0, size_bytes=7,
                         encoding=XOR, patch_count=2,
                         checksum=tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64,
                                                      value=0xF9F5744000000020))
        data = bytes.fromhex("00 03 06 01 00 01 01 00")
        committed(send(server, plan, [(pb.BucketStart(sequence=0, size_bytes=8, layout=spec), data)], "example"))
        new_a = a.clone()
        new_a.view(torch.int16)[[3, 10]] = 1
        assert server_checksums(server) == [local_checksums({"a": new_a, "b": b})]
        text = (EXAMPLE_DOC).read_text()
        assert "and sends `00 03 06 01 00 01 01 00`" in text and "value: 0xf9f5744000000020" in text
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_node_that_stores_a_subset_takes_the_layouts_patches_of_its_tensors_only(tmp_path):
    """`--tensors 'embed|steps'`: each deferred bucket has one candidate of the node's; its layout
    names both of its bucket's changed tensors, and the node patches its own, bit for bit (the
    others' patches arrive with the bucket and are not written anywhere)."""
    server = start_server(tmp_path, "--tensors", "embed|steps", workers=2)
    try:
        weights = model(2)
        committed(dense_push(server, weights, "base", allow_new=True))
        mine = {n: weights[n] for n in ("embed", "steps")}
        assert server_checksums(server) == [local_checksums(mine)]
        current = weights
        for step in range(2):
            new = changed(current, seed=30 + step)
            committed(deferred_push(server, current, new, f"d{step}"))
            assert server_checksums(server) == [local_checksums({n: new[n] for n in mine})]
            current = new
    finally:
        assert server.stop() == 0, server.log()[-3000:]
