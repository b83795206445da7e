"""The parts of an update join on a real server (server/parts/joins.py, over gRPC): keepalives while they
wait, a rank twice refused to that part alone, a part refused before it joins (other terms, its begin)
failing its key at once for every part with its own reason, the union refused to every part, a part
that never comes fails every joined part naming it (and a later one too), a part that fails or leaves
is named to the others, and a one-part update commits. This server runs parts over INLINE (more parts than
ingress slots take turns) and over SHM with a run of slots each: more SHM parts than slots, once joined and
checked, end UNIMPLEMENTED PARTS_UNAVAILABLE for every part (test_part_updates.py runs two parts). Every
refusal leaves the store as it was, and the next whole push commits bit for bit."""

from __future__ import annotations

import grpc
import pytest
import torch
from google.protobuf import duration_pb2
from raw_updates import commit_buckets, generation, push_whole, refused, refused_past_keepalives

from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import UpdateStream, local_checksums, plan_buckets, server_checksums, start_server


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("parts"), workers=1)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 4, generator=g), "b": torch.randn(8, generator=g)}


@pytest.fixture
def committed(node):
    """The store holds model(1) whole; after the test it still does (the refusals changed nothing), and the
    next whole push commits."""
    tensors = model(1)
    before = push_whole(node, tensors, "base")
    yield tensors
    assert generation(node) == before
    assert server_checksums(node) == [local_checksums(tensors)]
    assert push_whole(node, model(2), "after") == before + 1


def begin_part(node, key: str, rank: int, world: int, *, whole=(), sends=None, version="v-parts",
               join_timeout_s: int | None = None, plan_id: str = "",
               transport: int = pb.TRANSPORT_INLINE) -> tuple[UpdateStream, object]:
    """A part's stream: its begin sent (INLINE unless `transport`, STAGED, new tensors allowed), declaring `whole` and sending
    `sends` (name -> tensor; default: nothing of its own, a plan of the declared tensors' values)."""
    tensors = sends if sends is not None else {n: model(1)[n] for n in whole}
    plan = plan_buckets(list(tensors.items()), 1 << 20) if tensors and not plan_id else None
    part = pb.UpdatePart(update_key=key, rank=rank, world=world, whole_tensors=list(whole))
    if join_timeout_s is not None:
        part.join_timeout.CopyFrom(duration_pb2.Duration(seconds=join_timeout_s))
    stream = UpdateStream(node.stub())
    stream.send(begin=pb.BeginUpdate(version=version, plan=plan, plan_id=plan_id, mode=pb.UPDATE_MODE_STAGED,
                                     transport=transport, allow_new_tensors=True, part=part))
    return stream, plan


def waiting(stream: UpdateStream) -> list[int]:
    response = stream.recv()
    assert response.WhichOneof("message") == "waiting", response
    return list(response.waiting.joining)


def test_parts_wait_for_each_other_then_this_server_refuses_more_shm_parts_than_ingress_slots(node, committed):
    """SHM parts each write a run of the ingress slots of their own: 2 slots (the default), so an SHM world
    of 3 is refused once joined and checked (INLINE takes turns: test_sdk_parts_shm.py runs both)."""
    shm = {"transport": pb.TRANSPORT_SHM}
    first, _ = begin_part(node, "k-run", 0, 3, whole=["w"], **shm)
    assert waiting(first) == [1, 2]
    twice, _ = begin_part(node, "k-run", 0, 3, whole=["w"], **shm)  # refused alone: rank 0 is in
    assert refused(twice) == (grpc.StatusCode.ALREADY_EXISTS, "PART_DUPLICATE", {"update_key": "k-run", "rank": "0"})
    second, _ = begin_part(node, "k-run", 1, 3, whole=["b"], **shm)
    assert waiting(second) == [2]
    third, _ = begin_part(node, "k-run", 2, 3, whole=["x"], sends={"x": torch.ones(4)}, **shm)
    unavailable = (grpc.StatusCode.UNIMPLEMENTED, "PARTS_UNAVAILABLE", {"update_key": "k-run", "world": "3"})
    assert refused(third) == unavailable
    assert refused(second) == unavailable
    assert refused(first) == unavailable
    late, _ = begin_part(node, "k-run", 1, 3, whole=["b"], **shm)
    assert refused(late) == unavailable


LONG_JOIN_S = 600
"""The join timeout of the refused-before-joining tests: far past the streams' own deadline (UpdateStream, 120 s),
so a part that waited for the join deadline would end DEADLINE_EXCEEDED from gRPC, not with the refusal."""


def deferred_box_plan() -> tensor_pb2.WeightPlan:
    """A plan whose only bucket is deferred and holds a box: BOX_PATCH_UNAVAILABLE at begin."""
    return tensor_pb2.WeightPlan(buckets=[tensor_pb2.BucketSpec(size_bytes=64, deferred=True, tensors=[
        tensor_pb2.TensorSpec(name="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[16, 4], size_bytes=64,
                              box=tensor_pb2.TensorBox(offsets=[0, 0], sizes=[4, 4]))])])


def begin_refused_part(node, key: str, how: str) -> UpdateStream:
    """Part 1 of 2 under `key`, refused at its begin: other terms (PART_MISMATCH), no mode, or a box in a
    deferred bucket."""
    part = pb.UpdatePart(update_key=key, rank=1, world=2, whole_tensors=["b"])
    part.join_timeout.CopyFrom(duration_pb2.Duration(seconds=LONG_JOIN_S))
    begin = pb.BeginUpdate(version="v-parts", plan=plan_buckets([("b", model(1)["b"])], 1 << 20),
                           mode=pb.UPDATE_MODE_STAGED, transport=pb.TRANSPORT_INLINE, allow_new_tensors=True, part=part)
    if how == "mismatch":
        begin.version = "v-other"
    elif how == "no_mode":
        begin.mode = pb.UPDATE_MODE_UNSPECIFIED
    else:
        part.ClearField("whole_tensors")
        part.boxed_tensors.add(name="w", boxes=[tensor_pb2.TensorBox(offsets=[0, 0], sizes=[4, 4])])
        begin.plan.CopyFrom(deferred_box_plan())
    stream = UpdateStream(node.stub())
    stream.send(begin=begin)
    return stream


REFUSED = {
    "mismatch": (grpc.StatusCode.INVALID_ARGUMENT, "PART_MISMATCH",
                 {"rank": "1", "field": "version", "expected": "v-parts", "got": "v-other"}),
    "no_mode": (grpc.StatusCode.INVALID_ARGUMENT, "MODE_UNSPECIFIED", {}),
    "deferred_box": (grpc.StatusCode.UNIMPLEMENTED, "BOX_PATCH_UNAVAILABLE", {"bucket": "0", "tensor": "w"}),
}


@pytest.mark.parametrize("how", sorted(REFUSED))
def test_a_part_refused_before_it_joins_fails_every_part_of_its_key_at_once_with_its_reason(node, committed, how):
    """Part 0 waits (join timeout 600 s); part 1 is refused at its begin: part 0 ends at once with part 1's code
    and reason, naming it, and so does a part that comes later under the key (before: part 0 waited out the
    join timeout, then PARTS_MISSING naming part 1). Nothing changed (`committed`), and the next push commits."""
    key = f"k-refused-{how}"
    first, _ = begin_part(node, key, 0, 2, whole=["w"], join_timeout_s=LONG_JOIN_S)
    assert waiting(first) == [1]
    code, reason, metadata = REFUSED[how]
    own = {**metadata, "update_key": key} if how == "mismatch" else metadata
    assert refused(begin_refused_part(node, key, how)) == (code, reason, own)
    told = (code, reason, {**metadata, "update_key": key, "part": "1"})
    assert refused_past_keepalives(first) == told  # before the join deadline (600 s): the stream's own 120 s
    late, _ = begin_part(node, key, 1, 2, whole=["b"], join_timeout_s=LONG_JOIN_S)
    assert refused(late) == told


def test_a_part_refused_before_any_other_came_fails_the_ones_that_come(node, committed):
    key = "k-refused-first"
    assert refused(begin_refused_part(node, key, "no_mode"))[1] == "MODE_UNSPECIFIED"
    first, _ = begin_part(node, key, 0, 2, whole=["w"], join_timeout_s=LONG_JOIN_S)
    assert refused(first) == (grpc.StatusCode.INVALID_ARGUMENT, "MODE_UNSPECIFIED", {"update_key": key, "part": "1"})


JOIN_DEADLINE_S = 20
"""The join timeout of the test that waits it out: long enough for its second part's begin on a loaded host."""


def test_a_part_that_never_joins_fails_every_joined_part_naming_it(node, committed):
    first, _ = begin_part(node, "k-deadline", 0, 3, whole=["w"], join_timeout_s=JOIN_DEADLINE_S)
    assert waiting(first) == [1, 2]
    third, _ = begin_part(node, "k-deadline", 2, 3, whole=["b"])
    assert waiting(third) == [1]
    missing = (grpc.StatusCode.DEADLINE_EXCEEDED, "PARTS_MISSING", {"update_key": "k-deadline", "world": "3",
                                                                    "missing": "1"})
    assert refused_past_keepalives(first) == missing  # a keepalive every 10 s while they wait
    assert refused_past_keepalives(third) == missing
    late, _ = begin_part(node, "k-deadline", 1, 3)
    assert refused(late) == missing


def test_the_union_is_refused_to_every_part(node, committed):
    first, _ = begin_part(node, "k-union", 0, 2, whole=["w"])
    assert waiting(first) == [1]
    second, _ = begin_part(node, "k-union", 1, 2, whole=["w", "b"])
    owned_twice = (grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_OWNED_TWICE", {"tensor": "w", "parts": "0,1"})
    assert refused(second) == owned_twice
    assert refused(first) == owned_twice


def test_a_part_s_own_refusal_is_named_to_the_others(node, committed):
    first, _ = begin_part(node, "k-plan", 0, 2, whole=["w"])
    assert waiting(first) == [1]
    second, _ = begin_part(node, "k-plan", 1, 2, whole=["b"], plan_id="0" * 32)
    assert refused(second) == (grpc.StatusCode.NOT_FOUND, "PLAN_NOT_FOUND", {"plan_id": "0" * 32})
    assert refused(first) == (grpc.StatusCode.ABORTED, "PART_FAILED", {
        "update_key": "k-plan", "part": "1", "part_reason": "PLAN_NOT_FOUND", "part_code": "NOT_FOUND"})


def test_a_part_that_leaves_while_waiting_is_named_to_the_others(node, committed):
    first, _ = begin_part(node, "k-left", 0, 3, whole=["w"])
    assert waiting(first) == [1, 2]
    second, _ = begin_part(node, "k-left", 1, 3, whole=["b"])
    assert waiting(second) == [2]
    first.cancel()
    assert refused(second) == (grpc.StatusCode.ABORTED, "PART_FAILED", {
        "update_key": "k-left", "part": "0", "part_reason": "STREAM_CLOSED", "part_code": "ABORTED"})


def test_a_part_whose_plan_sends_what_it_does_not_declare_is_refused(node, committed):
    alone, _ = begin_part(node, "k-unowned", 0, 1, whole=["w"], sends={"w": model(3)["w"], "b": model(3)["b"]})
    assert refused(alone) == (grpc.StatusCode.INVALID_ARGUMENT, "PART_SENDS_UNOWNED",
                              {"tensor": "b", "part": "0", "bucket": "0"})


def test_one_part_commits_and_its_key_is_used_once(node):
    """A world of one declares w and b and sends only w (b unchanged): it commits; the key is spent, and the
    next whole push commits."""
    base = model(1)
    before = push_whole(node, base, "base")
    new_w = model(4)["w"]
    alone, plan = begin_part(node, "k-one", 0, 1, whole=["w", "b"], sends={"w": new_w})
    assert alone.recv().WhichOneof("message") == "ready"
    assert commit_buckets(alone, plan, {"w": new_w}).committed.version.generation == before + 1
    assert server_checksums(node) == [local_checksums({"w": new_w, "b": base["b"]})]
    again, _ = begin_part(node, "k-one", 0, 1, whole=["w"])
    assert refused(again) == (grpc.StatusCode.FAILED_PRECONDITION, "PART_KEY_USED",
                              {"update_key": "k-one", "generation": str(before + 1)})
    assert generation(node) == before + 1
    assert push_whole(node, model(5), "after") == before + 2
