"""Boxes in the store, over real gRPC (issue 35 item 3): two parts, each a raw INLINE UpdateWeights stream (no
SDK), send boxes of tensors (TensorSpec.box): row ranges (dim 0), column boxes (dim 1), a rank-3 box, boxes
larger than a bucket (pieces that end mid-row), beside a whole tensor. Each box lands at its place in the
stored whole tensor: the store's checksums equal the whole tensors' bit for bit, for a first push (every
boxed tensor new to the store), STAGED and IN_PLACE pushes (one with no checksum, whose boxes the worker
copies straight from the ingress), and a partial one (a shadow that starts as a copy of live). A part whose box fails its checksum aborts both, the store stays bit for bit, and the next
push commits. A node holding a subset (--tensors) stores the boxes of its tensors only. Boxes where the
server does not place them are refused at begin with their reason, and the next push commits."""

from __future__ import annotations

import grpc
import pytest
import torch
from raw_updates import generation, refused
from test_part_updates import past_keepalives

from weightsync.common.checksum import as_bytes, tensor_checksum, to_proto, ws64
from weightsync.common.dtypes import from_torch
from weightsync.common.plan_id import plan_id_of
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import UpdateStream, error_info, local_checksums, server_checksums, start_server

pytestmark = pytest.mark.timeout(180)

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) per dimension."""
BUCKET_BYTES = 2048
"""Small buckets: `big`'s boxes (5120 and 7168 bytes) travel as pieces of 2048 bytes, which end mid-row."""

OWNS: tuple[dict[str, list[Box] | None], dict[str, list[Box] | None]] = (
    {"w": [((0, 0), (10, 12))], "c": [((0, 0), (8, 4))], "big": [((0, 0), (64, 20))],
     "x": [((0, 0, 0), (4, 3, 5)), ((2, 3, 0), (2, 3, 5))]},
    {"w": [((10, 0), (6, 12))], "c": [((0, 4), (8, 6))], "big": [((0, 20), (64, 28))],
     "x": [((0, 3, 0), (2, 3, 5))], "b": None},
)
"""What each part owns: boxes of w (row ranges), c (column boxes), big (column boxes larger than a bucket),
x (rank 3, part 0 two boxes), and b whole (part 1); None: whole."""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("box-parts"), workers=2)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 12, generator=g), "c": torch.randn(8, 10, generator=g),
            "big": torch.randn(64, 48, generator=g), "x": torch.randn(4, 6, 5, generator=g),
            "b": torch.randn(300, generator=g).to(torch.bfloat16)}


def named(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + name: t for name, t in tensors.items()}


def _cut(tensor: torch.Tensor, box: Box | None) -> torch.Tensor:
    if box is None:
        return tensor
    return tensor[tuple(slice(o, o + s) for o, s in zip(*box, strict=True))]


def part_plan(items: list[tuple[str, torch.Tensor, Box | None]], *, corrupt: str = "", checked: bool = True
              ) -> tuple[tensor_pb2.WeightPlan, list[torch.Tensor]]:
    """A part's plan and its buckets' bytes: each item (a whole tensor, or one box of it, with the WS64 of
    its bytes unless not `checked`) packed at 64-byte offsets; one larger than a bucket alone, as pieces.
    `corrupt`: that item's checksum is of other bytes."""
    plan, datas = tensor_pb2.WeightPlan(), []
    current: list[tuple[tensor_pb2.TensorSpec, torch.Tensor]] = []

    def flush() -> None:
        if current:
            size = -(-(current[-1][0].offset_bytes + current[-1][0].size_bytes) // 64) * 64
            data = torch.zeros(size, dtype=torch.uint8)
            for spec, raw in current:
                data[spec.offset_bytes : spec.offset_bytes + spec.size_bytes] = raw
            plan.buckets.add(size_bytes=size, tensors=[spec for spec, _ in current])
            datas.append(data)
            current.clear()

    for name, whole, box in items:
        raw = as_bytes(_cut(whole, box))
        spec = tensor_pb2.TensorSpec(name=name, dtype=from_torch(whole.dtype), shape=list(whole.shape))
        if box is not None:
            spec.box.CopyFrom(tensor_pb2.TensorBox(offsets=box[0], sizes=box[1]))
        if raw.numel() > BUCKET_BYTES:
            flush()
            for start in range(0, raw.numel(), BUCKET_BYTES):
                piece = raw[start : start + BUCKET_BYTES].clone()
                spec.size_bytes = piece.numel()
                spec.piece.offset_bytes = start
                if checked:
                    spec.checksum.CopyFrom(to_proto(ws64(piece if name != corrupt else piece + 1)))
                plan.buckets.add(size_bytes=piece.numel(), tensors=[spec])
                datas.append(piece)
            continue
        offset = 0 if not current else -(-(current[-1][0].offset_bytes + current[-1][0].size_bytes) // 64) * 64
        if current and offset + raw.numel() > BUCKET_BYTES:
            flush()
            offset = 0
        spec.offset_bytes, spec.size_bytes = offset, raw.numel()
        if checked:
            spec.checksum.CopyFrom(to_proto(ws64(raw if name != corrupt else raw + 1)))
        current.append((spec, raw))
    flush()
    return plan, datas


def declared(owns: dict[str, list[Box] | None], prefix: str, **part) -> pb.UpdatePart:
    """A part's declaration: every box and whole tensor it owns, sent this time or not."""
    return pb.UpdatePart(
        whole_tensors=[prefix + n for n, boxes in owns.items() if boxes is None],
        boxed_tensors=[pb.PartBoxes(name=prefix + n, boxes=[tensor_pb2.TensorBox(offsets=o, sizes=s) for o, s in boxes])
                       for n, boxes in owns.items() if boxes is not None], **part)


def items_of(owns: dict[str, list[Box] | None], tensors: dict[str, torch.Tensor], prefix: str,
             only: set[str] | None = None) -> list[tuple[str, torch.Tensor, Box | None]]:
    """What a part sends: its boxes and whole tensors of `tensors` (those in `only`, when given)."""
    return [(prefix + n, tensors[n], box) for n, boxes in owns.items() if only is None or n in only
            for box in (boxes if boxes is not None else [None])]


def send(stream: UpdateStream, datas: list[torch.Tensor], not_stored: frozenset[int] = frozenset(), *,
         checked: bool = True) -> list[str]:
    """Every bucket INLINE in one chunk (none for one in UpdateReady.not_stored_buckets), with its WS64 unless
    not `checked` (then the worker copies the boxes straight from the ingress); each answer's kind, up to the
    first that is not applied."""
    answers = []
    for k, data in enumerate(datas):
        checksum = tensor_checksum(data) if checked else None
        stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=data.numel(), checksum=checksum))
        if k not in not_stored:
            stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=0, data=data.numpy().tobytes()))
        answers.append(past_keepalives(stream).WhichOneof("message"))
        if answers[-1] != "bucket_applied":
            break
    return answers


def begin(node, key: str, version: str, mode: int, plans: list[tensor_pb2.WeightPlan], prefix: str,
          owns=OWNS) -> list[tuple[UpdateStream, frozenset[int]]]:
    """Both parts begun and joined, past ready: each part's stream and its not_stored_buckets."""
    streams = []
    for rank, plan in enumerate(plans):
        stream = UpdateStream(node.stub())
        stream.send(begin=pb.BeginUpdate(version=version, plan=plan, mode=mode, transport=pb.TRANSPORT_INLINE,
                                         allow_new_tensors=True,
                                         part=declared(owns[rank], prefix, update_key=key, rank=rank, world=2)))
        streams.append(stream)
    readies = []
    for stream, plan in zip(streams, plans, strict=True):
        ready = past_keepalives(stream)
        assert ready.WhichOneof("message") == "ready", ready
        assert ready.ready.bucket_count == len(plan.buckets)
        readies.append(frozenset(ready.ready.not_stored_buckets))
    return list(zip(streams, readies, strict=True))


def push_boxes(node, tensors: dict[str, torch.Tensor], version: str, key: str, prefix: str, *,
               mode: int = pb.UPDATE_MODE_STAGED, only: tuple[set[str] | None, set[str] | None] = (None, None),
               owns=OWNS, checked: bool = True) -> int:
    """Both parts send their boxes of `tensors` (each only the names in `only[rank]`, when given; with no
    checksum at all unless `checked`) and commit once: the generation."""
    before = generation(node)
    built = [part_plan(items_of(owns[rank], tensors, prefix, only[rank]), checked=checked) for rank in range(2)]
    begun = begin(node, key, version, mode, [plan for plan, _ in built], prefix, owns)
    for (stream, not_stored), (_, datas) in zip(begun, built, strict=True):
        assert send(stream, datas, not_stored, checked=checked) == ["bucket_applied"] * len(datas)
        stream.send(commit=pb.CommitUpdate())
    answers = [past_keepalives(s) for s, _ in begun]
    for stream, _ in begun:
        stream.close()
    assert [a.WhichOneof("message") for a in answers] == ["committed", "committed"], answers
    assert {a.committed.version.generation for a in answers} == {before + 1}
    return before + 1


def stored(node, tensors: dict[str, torch.Tensor]) -> bool:
    """The store's checksums of these tensors equal theirs, bit for bit."""
    return server_checksums(node, list(tensors)) == [local_checksums(tensors)]


def test_boxes_from_two_parts_land_at_their_place_in_the_store(node):
    assert node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).parts is True
    first = model(1)
    push_boxes(node, first, "v1", "k-first", "a.")  # every tensor new to the store, boxed ones included
    assert stored(node, named(first, "a."))
    second = model(2)
    push_boxes(node, second, "v2", "k-staged", "a.")
    assert stored(node, named(second, "a."))
    third = model(3)
    push_boxes(node, third, "v3", "k-in-place", "a.", mode=pb.UPDATE_MODE_IN_PLACE, checked=False)
    assert stored(node, named(third, "a."))
    # STAGED, partial: part 0 sends its boxes of w and big, part 1 only b; the rest keeps v3's bytes (the
    # shadows of the segments these boxes write start as copies of live)
    fourth = model(4)
    push_boxes(node, fourth, "v4", "k-partial", "a.", only=({"w", "big"}, {"b"}))
    expected = {name: t.clone() for name, t in third.items()}
    expected["w"][0:10] = fourth["w"][0:10]
    expected["big"][:, 0:20] = fourth["big"][:, 0:20]
    expected["b"] = fourth["b"]
    assert stored(node, named(expected, "a."))
    push_boxes(node, fourth, "v5", "k-partial-in-place", "a.", mode=pb.UPDATE_MODE_IN_PLACE, only=({"c", "x"}, None))
    assert stored(node, named(fourth, "a."))


def test_a_box_failing_its_checksum_aborts_both_parts_and_the_store_is_unchanged(node):
    base = model(5)
    before = push_boxes(node, base, "base", "k-base", "f.")
    assert stored(node, named(base, "f."))
    plan0, datas0 = part_plan(items_of(OWNS[0], model(6), "f."))
    plan1, datas1 = part_plan(items_of(OWNS[1], model(6), "f."), corrupt="f.c")
    (zero, _), (one, _) = begin(node, "k-corrupt", "v6", pb.UPDATE_MODE_STAGED, [plan0, plan1], "f.")
    assert send(zero, datas0) == ["bucket_applied"] * len(datas0)  # part 0's boxes are in, then part 1 fails
    assert send(one, datas1) == ["aborting"]  # its first bucket holds c's box
    told = past_keepalives(zero)
    assert told.WhichOneof("message") == "aborting" and told.aborting.reason == "PART_FAILED", told
    one.send(abort=pb.AbortUpdate(reason="bucket refused"))
    zero.send(commit=pb.CommitUpdate())
    code, reason, metadata = refused(one)
    assert (code, reason, metadata["tensor"]) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH", "f.c")
    assert refused(zero)[:2] == (grpc.StatusCode.ABORTED, "PART_FAILED")
    assert generation(node) == before
    assert stored(node, named(base, "f."))  # bit for bit: nothing of v6, not even part 0's boxes
    after = model(7)
    assert push_boxes(node, after, "v7", "k-after-corrupt", "f.") == before + 1
    assert stored(node, named(after, "f."))


def test_a_node_holding_a_subset_stores_the_boxes_of_its_tensors_only(tmp_path):
    server = start_server(tmp_path, "--tensors", r"^s\.(w|b|big)$", workers=2)
    try:
        first = model(8)
        push_boxes(server, first, "v1", "k-subset", "s.")
        mine = {n: t for n, t in named(first, "s.").items() if n in {"s.w", "s.b", "s.big"}}
        answer = server.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(), timeout=60)
        assert {t.name: t.checksum.value for t in answer.tensors} == local_checksums(mine)
        second = model(9)
        push_boxes(server, second, "v2", "k-subset-2", "s.", mode=pb.UPDATE_MODE_IN_PLACE)
        # a part whose buckets hold no tensor of this node: c's and x's boxes alone (not stored here)
        push_boxes(server, model(10), "v3", "k-subset-3", "s.", only=({"c", "x"}, {"c"}))
        assert stored(server, {n: second[n[2:]] for n in mine})
        assert stored(server, {n: second[n[2:]] for n in mine})
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _refusal(node, begin_: pb.BeginUpdate) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    stream = UpdateStream(node.stub())
    stream.send(begin=begin_)
    return refused(stream)


def test_boxes_the_server_does_not_place_are_refused_at_begin(node):
    """A box without a part (sent, or in a plan named by its plan_id), a part's box over COLLECTIVE without a
    group, or among a deferred bucket's candidates: refused at begin, nothing changes, and the next push commits."""
    base = model(10)
    before = push_boxes(node, base, "base", "k-refusals-base", "r.")
    box = OWNS[0]["w"][0]
    plan, _ = part_plan([("r.w", base["w"], box)])
    part = declared({"w": [box]}, "r.", update_key="k-refused", rank=0, world=2)
    common = dict(version="v", plan=plan, mode=pb.UPDATE_MODE_STAGED)
    assert _refusal(node, pb.BeginUpdate(transport=pb.TRANSPORT_INLINE, **common)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "BOX_WITHOUT_PART", {"bucket": "0", "tensor": "r.w"})
    # A part's box over COLLECTIVE is placed (point-to-point to its owner): it needs a group, none named here.
    assert _refusal(node, pb.BeginUpdate(transport=pb.TRANSPORT_COLLECTIVE, part=part, **common)) == (
        grpc.StatusCode.NOT_FOUND, "GROUP_NOT_FOUND", {})
    epoch = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version.store_epoch
    candidate = tensor_pb2.TensorSpec(name="r.w", dtype=from_torch(base["w"].dtype), shape=list(base["w"].shape),
                                      encoding=tensor_pb2.TENSOR_ENCODING_PATCH_XOR,
                                      box=tensor_pb2.TensorBox(offsets=box[0], sizes=box[1]))
    deferred = tensor_pb2.WeightPlan(buckets=[tensor_pb2.BucketSpec(deferred=True, size_bytes=1024,
                                                                    tensors=[candidate])])
    assert _refusal(node, pb.BeginUpdate(version="v", plan=deferred, mode=pb.UPDATE_MODE_STAGED,
                                         base_generation=before, base_store_epoch=epoch,
                                         transport=pb.TRANSPORT_INLINE, part=part)) == (
        grpc.StatusCode.UNIMPLEMENTED, "BOX_PATCH_UNAVAILABLE", {"bucket": "0", "tensor": "r.w"})
    held = plan_id_of(part_plan(items_of(OWNS[0], base, "r."))[0])  # part 0's plan, held since its commit
    assert _refusal(node, pb.BeginUpdate(version="v", plan_id=held, mode=pb.UPDATE_MODE_STAGED,
                                         transport=pb.TRANSPORT_INLINE)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "BOX_WITHOUT_PART", {"bucket": "0", "tensor": "r.w"})
    assert generation(node) == before
    assert stored(node, named(base, "r."))
    after = model(11)
    assert push_boxes(node, after, "v11", "k-refusals-after", "r.") == before + 1
    assert stored(node, named(after, "r."))


def test_a_new_boxed_tensor_whose_box_is_not_sent_is_refused(node):
    """A tensor new to the store arrives whole: part 1 declares its box of n. but sends none, so every part
    ends BOX_NOT_SENT once both joined, nothing allocated; the next push of every box commits."""
    before = generation(node)
    tensors = model(12)
    owns = ({"w": [((0, 0), (10, 12))]}, {"w": [((10, 0), (6, 12))], "b": None})
    plans = [part_plan(items_of(owns[0], tensors, "n."))[0], part_plan(items_of(owns[1], tensors, "n.", {"b"}))[0]]
    streams = []
    for rank, plan in enumerate(plans):
        stream = UpdateStream(node.stub())
        stream.send(begin=pb.BeginUpdate(version="v", plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                         transport=pb.TRANSPORT_INLINE, allow_new_tensors=True,
                                         part=declared(owns[rank], "n.", update_key="k-not-sent", rank=rank, world=2)))
        streams.append(stream)
    for stream in streams:
        with pytest.raises(grpc.RpcError) as caught:
            past_keepalives(stream)
        stream.close()
        info = error_info(caught.value)
        assert (caught.value.code(), info.reason, dict(info.metadata)) == (
            grpc.StatusCode.INVALID_ARGUMENT, "BOX_NOT_SENT", {"tensor": "n.w", "part": "1", "box": "[10:16, 0:12]"})
    assert generation(node) == before
    assert "n.w" not in {t.name for t in node.stub().GetTensorChecksums(
        pb.GetTensorChecksumsRequest(), timeout=60).tensors}
    push_boxes(node, tensors, "v12", "k-all-sent", "n.", owns=owns)
    assert stored(node, {"n.w": tensors["w"], "n.b": tensors["b"]})


def test_a_first_push_of_boxed_tensors_that_fails_leaves_none_of_them(node):
    """Every boxed tensor new to the store, and part 0's box of big fails its checksum (its second piece):
    the update aborts, the store holds none of them (their segments released), and the same push then commits."""
    before = generation(node)
    tensors = model(13)
    plan0, datas0 = part_plan(items_of(OWNS[0], tensors, "g."), corrupt="g.big")
    plan1, _ = part_plan(items_of(OWNS[1], tensors, "g."))
    (zero, _), (one, _) = begin(node, "k-first-fails", "v13", pb.UPDATE_MODE_STAGED, [plan0, plan1], "g.")
    answers = send(zero, datas0)
    assert answers[-1] == "aborting" and set(answers[:-1]) <= {"bucket_applied"}, answers
    told = past_keepalives(one)
    assert told.WhichOneof("message") == "aborting" and told.aborting.reason == "PART_FAILED", told
    zero.send(abort=pb.AbortUpdate(reason="bucket refused"))
    one.send(abort=pb.AbortUpdate(reason="the other part failed"))
    code, reason, metadata = refused(zero)
    assert (code, reason, metadata["tensor"]) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH", "g.big")
    assert refused(one)[:2] == (grpc.StatusCode.ABORTED, "PART_FAILED")
    assert generation(node) == before
    held = {t.name for t in node.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(), timeout=60).tensors}
    assert not {n for n in held if n.startswith("g.")}
    assert push_boxes(node, tensors, "v13", "k-first-again", "g.") == before + 1
    assert stored(node, named(tensors, "g."))
