"""Two parts of one version over real gRPC (server/update/gathering.py, the session fed by two streams): each
part a raw UpdateWeights stream (no SDK), INLINE, whole tensors, disjoint halves. They commit once, with
one generation, after both asked; GetTensorChecksums shows both halves. A part failing mid-way aborts
both (the other learns PART_FAILED naming it; the failing part hears its own bucket index and `part`), a
part that stalls is named to every part in CLIENT_IDLE, the store stays bit for bit, and the next pushes
commit."""

from __future__ import annotations

import grpc
import pytest
import torch
from raw_updates import generation, push_whole, refused, refused_past_keepalives

from weightsync.common.checksum import tensor_checksum
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    UpdateStream,
    local_checksums,
    pack,
    plan_buckets,
    server_checksums,
    start_server,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("part-updates"), workers=2)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(1536, generator=g),
            "u": torch.randn(300, 8, generator=g)}


OWNS = (["w"], ["b", "u"])
"""Part 0 owns w, part 1 owns b and u."""


def send_buckets(stream: UpdateStream, plan, tensors, *, corrupt: int | None = None) -> list[str]:
    """Every bucket INLINE in one chunk (bucket `corrupt` with a checksum of other bytes); each answer's kind."""
    answers = []
    for k in range(len(plan.buckets)):
        data = pack(plan, tensors, k)
        checksum = tensor_checksum(data if k != corrupt else data + 1)
        stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=data.numel(), checksum=checksum))
        stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=0, data=data.numpy().tobytes()))
        answer = stream.recv()
        answers.append(answer.WhichOneof("message"))
        if answers[-1] == "bucket_applied":
            assert answer.bucket_applied.sequence == k  # the part's own sequence
        else:
            return answers
    return answers


def past_keepalives(stream: UpdateStream) -> pb.UpdateWeightsResponse:
    """The next answer that is not a keepalive: a part still waiting hears one again every 10 s, which a
    loaded machine can reach between two steps of a test."""
    while (answer := stream.recv()).WhichOneof("message") == "waiting":
        pass
    return answer


def begin_parts(node, key: str, tensors: dict[str, torch.Tensor], version: str):
    """Both parts' streams begun and joined: each part's (stream, plan, its tensors), both past ready."""
    parts = []
    for rank, names in enumerate(OWNS):
        own = {n: tensors[n] for n in names}
        plan = plan_buckets(list(own.items()), 8192)  # w alone takes a bucket of 8 KiB
        stream = UpdateStream(node.stub())
        stream.send(begin=pb.BeginUpdate(version=version, plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                         transport=pb.TRANSPORT_INLINE, allow_new_tensors=True,
                                         part=pb.UpdatePart(update_key=key, rank=rank, world=2,
                                                            whole_tensors=names)))
        parts.append((stream, plan, own))
        if rank == 0:  # part 0 waits for part 1 before part 1 begins
            first = stream.recv()
            assert first.WhichOneof("message") == "waiting" and list(first.waiting.joining) == [1], first
    for stream, plan, _ in parts:
        ready = past_keepalives(stream)
        assert ready.WhichOneof("message") == "ready", ready
        assert ready.ready.bucket_count == len(plan.buckets)
    return parts


def push_parts(node, tensors: dict[str, torch.Tensor], version: str, key: str) -> int:
    """Part 0 sends all of its buckets and asks to commit before part 1 sends any: both commit, once."""
    before = generation(node)
    (zero, plan0, own0), (one, plan1, own1) = begin_parts(node, key, tensors, version)
    assert send_buckets(zero, plan0, own0) == ["bucket_applied"] * len(plan0.buckets)
    zero.send(commit=pb.CommitUpdate())
    keepalive = zero.recv()  # part 0 waits for part 1, and hears so
    assert keepalive.WhichOneof("message") == "waiting" and list(keepalive.waiting.sending) == [1], keepalive
    assert len(plan1.buckets) == 2
    assert send_buckets(one, plan1, own1) == ["bucket_applied"] * 2
    one.send(commit=pb.CommitUpdate())
    answers = [past_keepalives(zero), past_keepalives(one)]
    zero.close()
    one.close()
    assert [a.WhichOneof("message") for a in answers] == ["committed", "committed"], answers
    generations = {a.committed.version.generation for a in answers}
    assert generations == {before + 1}  # one commit, one generation for both parts
    assert answers[0].committed.version.version == version
    assert server_checksums(node) == [local_checksums(tensors)]  # both halves, bit for bit
    return before + 1


def test_two_parts_push_disjoint_halves_of_one_version(node):
    push_whole(node, model(1), "base")
    push_parts(node, model(2), "v2", "k-halves")
    push_parts(node, model(3), "v3", "k-halves-again")


def test_a_part_failing_mid_way_aborts_both_and_the_store_is_unchanged(node):
    base = model(1)
    before = push_whole(node, base, "base")
    (zero, plan0, own0), (one, plan1, own1) = begin_parts(node, "k-fails", model(4), "v4")
    assert send_buckets(zero, plan0, own0) == ["bucket_applied"]  # part 0's half is in, then part 1 fails
    assert send_buckets(one, plan1, own1, corrupt=1) == ["bucket_applied", "aborting"]
    told = zero.recv()
    assert told.WhichOneof("message") == "aborting" and told.aborting.reason == "PART_FAILED", told
    one.send(abort=pb.AbortUpdate(reason="bucket refused"))
    zero.send(commit=pb.CommitUpdate())
    code, reason, metadata = refused(one)
    # Part 1's own bucket 1 (the store's plan has it at 2, after part 0's one bucket), and which part it is.
    assert (code, reason, metadata["bucket"], metadata["part"]) == (
        grpc.StatusCode.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH", "1", "1"), metadata
    assert refused(zero) == (grpc.StatusCode.ABORTED, "PART_FAILED", {
        "update_key": "k-fails", "part": "1", "part_reason": "BUCKET_CHECKSUM_MISMATCH", "part_code": "DATA_LOSS"})
    assert generation(node) == before
    assert server_checksums(node) == [local_checksums(base)]  # bit for bit: nothing of v4
    assert push_parts(node, model(5), "v5", "k-after-failure") == before + 1
    assert push_whole(node, model(6), "after") == before + 2


IDLE_SECONDS = 20
"""The idle node's transfer timeout (its CLIENT_IDLE bound): the time between two messages of a push's parts that
a loaded machine may take without failing the push that follows the stall."""


@pytest.fixture(scope="module")
def idle_node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("part-idle"), "--transfer-timeout-seconds", str(IDLE_SECONDS),
                          workers=1)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def test_a_part_that_stalls_is_named_to_every_part_in_client_idle(idle_node):
    """Part 0 sends everything and asks to commit; part 1 sends nothing: once nothing came from either for the
    idle bound, both end DEADLINE_EXCEEDED CLIENT_IDLE naming part 1 (`silent`; before: naming no part). Nothing
    is published, and the next push of both parts commits."""
    before = push_whole(idle_node, model(1), "base")
    (zero, plan0, own0), (one, _, _) = begin_parts(idle_node, "k-stalls", model(9), "v9")
    assert send_buckets(zero, plan0, own0) == ["bucket_applied"]
    zero.send(commit=pb.CommitUpdate())
    stalled = (grpc.StatusCode.DEADLINE_EXCEEDED, "CLIENT_IDLE", {"silent": "1"})
    assert refused_past_keepalives(zero) == stalled
    assert refused_past_keepalives(one) == stalled
    assert generation(idle_node) == before
    assert server_checksums(idle_node) == [local_checksums(model(1))]
    assert push_parts(idle_node, model(10), "v10", "k-after-stall") == before + 1


@pytest.mark.parametrize("leaving", [0, 1])
def test_a_part_whose_stream_ends_mid_way_is_named_to_the_other(node, leaving):
    """A part's client goes away (its stream cancelled) after one of its buckets was applied: the other part's
    stream ends PART_FAILED naming it (STREAM_CLOSED), nothing is published, and the next pushes commit."""
    base = model(1)
    before = push_whole(node, base, "base")
    (zero, plan0, own0), (one, plan1, own1) = begin_parts(node, f"k-leaves-{leaving}", model(7), "v7")
    streams, plans, owns = (zero, one), (plan0, plan1), (own0, own1)
    staying = 1 - leaving
    first_only = {n: t for n, t in owns[leaving].items() if n in {s.name for s in plans[leaving].buckets[0].tensors}}
    single = plan_buckets(list(first_only.items()), 8192)
    assert send_buckets(streams[leaving], single, first_only) == ["bucket_applied"]
    streams[leaving].cancel()
    told = past_keepalives(streams[staying])
    assert told.WhichOneof("message") == "aborting" and told.aborting.reason == "PART_FAILED", told
    streams[staying].send(abort=pb.AbortUpdate(reason="the other part left"))  # (part 0 leaving ended it already)
    assert refused(streams[staying]) == (grpc.StatusCode.ABORTED, "PART_FAILED", {
        "update_key": f"k-leaves-{leaving}", "part": str(leaving), "part_reason": "STREAM_CLOSED",
        "part_code": "ABORTED"})
    assert generation(node) == before
    assert server_checksums(node) == [local_checksums(base)]
    assert push_parts(node, model(8), "v8", f"k-after-leaving-{leaving}") == before + 1
