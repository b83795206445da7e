"""The rules of parts (server/parts/rules.py) by table: a part's identity, its join, the union of the parts'
declarations and the join's outcomes, each row with the exact decision written out by hand (the owners,
or the refusal's code, ErrorInfo reason and metadata). The union's box rules are also checked against
a brute-force coverage mask over generated tilings with overlaps and gaps injected. The join on a real
server is test_part_joins; a box refused at begin (PARTS_UNAVAILABLE, then a whole push) is in test_contract."""

from __future__ import annotations

import datetime
import hashlib
import random
import struct

import pytest
import torch
from google.protobuf import duration_pb2

from weightsync.common.errors import InvalidArgument, Unimplemented
from weightsync.common.plan_id import plan_id_of
from weightsync.server.parts.rules import (
    Box,
    Declaration,
    DtypeShape,
    Owners,
    Sent,
    Terms,
    boxes_refused,
    check_identity,
    check_join,
    check_tiling,
    check_union,
    client_idle,
    join_timeout,
    key_refused,
    late_part,
    missing,
    part_failed,
    parts_missing,
    parts_not_run,
    sent_by,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

F32, BF16 = tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_BFLOAT16


def decided(result):
    """A refusal as (code, reason, metadata); anything else as it is."""
    if isinstance(result, InvalidArgument.__mro__[1]):
        return result.code.name, result.reason, result.metadata
    return result


def box(*slices: tuple[int, int]) -> Box:
    """box((0, 4), (2, 6)) is rows 0..3 and columns 2..5."""
    return Box(tuple(a for a, _ in slices), tuple(b - a for a, b in slices))


# -- a part's identity ------------------------------------------------------------------------------
def part(**fields) -> pb.UpdatePart:
    return pb.UpdatePart(**{"update_key": "step-7.a1", "rank": 0, "world": 2, **fields})


@pytest.mark.parametrize(("given", "expected"), [
    (part(), None),
    (part(rank=1), None),
    (part(world=1, rank=0), None),  # one part: the whole update
    (part(world=65536, rank=65535), None),
    (part(join_timeout=duration_pb2.Duration(seconds=3600)), None),
    (part(join_timeout=duration_pb2.Duration(nanos=1)), None),
    (part(update_key=""), ("INVALID_ARGUMENT", "PART_KEY_INVALID", {})),
    (part(update_key="step 7"), ("INVALID_ARGUMENT", "PART_KEY_INVALID", {"update_key": "step 7"})),
    (part(update_key="k" * 129), ("INVALID_ARGUMENT", "PART_KEY_INVALID", {"update_key": "k" * 128})),
    (part(world=0), ("INVALID_ARGUMENT", "PART_WORLD_INVALID", {"update_key": "step-7.a1", "world": "0"})),
    (part(world=65537), ("INVALID_ARGUMENT", "PART_WORLD_INVALID", {"update_key": "step-7.a1", "world": "65537"})),
    (part(rank=2), ("INVALID_ARGUMENT", "PART_RANK_INVALID", {"update_key": "step-7.a1", "rank": "2", "world": "2"})),
    (part(rank=-1), ("INVALID_ARGUMENT", "PART_RANK_INVALID", {"update_key": "step-7.a1", "rank": "-1", "world": "2"})),
    (part(join_timeout=duration_pb2.Duration(seconds=0)),
     ("INVALID_ARGUMENT", "PART_JOIN_TIMEOUT_INVALID", {"update_key": "step-7.a1"})),
    (part(join_timeout=duration_pb2.Duration(seconds=3600, nanos=1)),
     ("INVALID_ARGUMENT", "PART_JOIN_TIMEOUT_INVALID", {"update_key": "step-7.a1"})),
    (part(join_timeout=duration_pb2.Duration(seconds=-5)),
     ("INVALID_ARGUMENT", "PART_JOIN_TIMEOUT_INVALID", {"update_key": "step-7.a1"})),
])
def test_a_part_s_identity(given, expected):
    assert decided(check_identity(given)) == expected


def test_the_join_timeout_defaults_to_a_minute():
    assert join_timeout(part()) == datetime.timedelta(seconds=60)
    assert join_timeout(part(join_timeout=duration_pb2.Duration(seconds=5))) == datetime.timedelta(seconds=5)


def _boxed_plan(**spec) -> tensor_pb2.WeightPlan:
    return tensor_pb2.WeightPlan(buckets=[
        tensor_pb2.BucketSpec(size_bytes=64, tensors=[tensor_pb2.TensorSpec(name="a")]),
        tensor_pb2.BucketSpec(size_bytes=64, tensors=[tensor_pb2.TensorSpec(name="b"), tensor_pb2.TensorSpec(
            name="c", box=tensor_pb2.TensorBox(), **spec)])])  # an empty box is still a box


INLINE = pb.TRANSPORT_INLINE


@pytest.mark.parametrize(("begin", "expected"), [
    (pb.BeginUpdate(version="v"), None),  # no part, no box: the whole update, as always
    (pb.BeginUpdate(version="v", plan=tensor_pb2.WeightPlan(buckets=[tensor_pb2.BucketSpec(
        size_bytes=64, tensors=[tensor_pb2.TensorSpec(name="w", shape=[4])])])), None),
    (pb.BeginUpdate(part=part(rank=1)), None),  # a part joins (server/parts/joins.py)
    (pb.BeginUpdate(part=part(rank=1), transport=INLINE, plan=_boxed_plan()), None),  # a part's box over INLINE
    (pb.BeginUpdate(transport=INLINE, plan=_boxed_plan()),
     ("INVALID_ARGUMENT", "BOX_WITHOUT_PART", {"bucket": "1", "tensor": "c"})),
    (pb.BeginUpdate(part=part(rank=1), transport=pb.TRANSPORT_SHM, plan=_boxed_plan()), None),  # on the host
    (pb.BeginUpdate(part=part(rank=1), transport=pb.TRANSPORT_COLLECTIVE, plan=_boxed_plan()),
     None),  # a part's box over COLLECTIVE (point-to-point to its owner, as a whole tensor's bucket)
    (pb.BeginUpdate(part=part(rank=1), transport=INLINE,
                    plan=_boxed_plan(encoding=tensor_pb2.TENSOR_ENCODING_PATCH_XOR)), None),  # a patch of a box
    (pb.BeginUpdate(part=part(rank=1), transport=INLINE,
                    plan=tensor_pb2.WeightPlan(buckets=[tensor_pb2.BucketSpec(deferred=True, tensors=[
                        tensor_pb2.TensorSpec(name="c", box=tensor_pb2.TensorBox())])])),
     ("UNIMPLEMENTED", "BOX_PATCH_UNAVAILABLE", {"bucket": "0", "tensor": "c"})),
])
def test_a_box_is_placed_only_from_a_part_over_the_ingress_and_never_deferred(begin, expected):
    assert decided(boxes_refused(begin, begin.plan)) == expected


# -- the join ---------------------------------------------------------------------------------------
FIRST = Terms(world=3, version="v7", mode=pb.UPDATE_MODE_STAGED, transport=pb.TRANSPORT_INLINE, group_id="",
              allow_new_tensors=False, base_generation=6, base_store_epoch=99)


def terms(**changed) -> Terms:
    return Terms(**{**{f: getattr(FIRST, f) for f in Terms.__slots__}, **changed})


def mismatch(rank: int, field: str, expected: str, got: str):
    return ("INVALID_ARGUMENT", "PART_MISMATCH",
            {"update_key": "k", "rank": str(rank), "field": field, "expected": expected, "got": got})


@pytest.mark.parametrize(("joined", "rank", "given", "expected"), [
    (frozenset({0}), 1, FIRST, None),
    (frozenset({2, 0}), 1, FIRST, None),
    (frozenset({0}), 0, FIRST, ("ALREADY_EXISTS", "PART_DUPLICATE", {"update_key": "k", "rank": "0"})),
    (frozenset({0, 1}), 1, terms(version="v8"),  # a duplicate before a mismatch
     ("ALREADY_EXISTS", "PART_DUPLICATE", {"update_key": "k", "rank": "1"})),
    (frozenset({0}), 1, terms(world=4), mismatch(1, "world", "3", "4")),
    (frozenset({0}), 2, terms(version="v8"), mismatch(2, "version", "v7", "v8")),
    (frozenset({0}), 1, terms(mode=pb.UPDATE_MODE_IN_PLACE), mismatch(1, "mode", "2", "1")),
    (frozenset({0}), 1, terms(transport=pb.TRANSPORT_SHM), mismatch(1, "transport", "3", "2")),
    (frozenset({0}), 1, terms(group_id="g"), ("INVALID_ARGUMENT", "PART_MISMATCH",  # empty values are left out
                                              {"update_key": "k", "rank": "1", "field": "group_id", "got": "g"})),
    (frozenset({0}), 1, terms(allow_new_tensors=True), mismatch(1, "allow_new_tensors", "False", "True")),
    (frozenset({0}), 1, terms(base_generation=5), mismatch(1, "base_generation", "6", "5")),
    (frozenset({0}), 1, terms(base_store_epoch=98), mismatch(1, "base_store_epoch", "99", "98")),
    (frozenset({0}), 1, terms(version="x", mode=1), mismatch(1, "version", "v7", "x")),  # the first field named
])
def test_a_part_joining(joined, rank, given, expected):
    assert decided(check_join(FIRST, joined, rank, given, update_key="k")) == expected


def test_terms_are_read_from_the_begin():
    begin = pb.BeginUpdate(version="v7", mode=pb.UPDATE_MODE_STAGED, transport=pb.TRANSPORT_INLINE,
                           base_generation=6, base_store_epoch=99, part=part(world=3, rank=2))
    assert Terms.of(begin) == FIRST


@pytest.mark.parametrize(("world", "joined", "expected"), [
    (1, [0], ()), (4, [], (0, 1, 2, 3)), (4, [2, 0], (1, 3)), (4, [3, 1, 0, 2], ()),
])
def test_the_missing_ranks(world, joined, expected):
    assert missing(world, joined) == expected


def test_parts_missing_at_the_deadline_names_them():
    refusal = parts_missing("k", 4, [0, 2], datetime.timedelta(seconds=30))
    assert decided(refusal) == ("DEADLINE_EXCEEDED", "PARTS_MISSING", {"update_key": "k", "world": "4", "missing": "1,3"})
    assert "2 of 4 parts did not join update 'k' within 30 s (ranks 1,3)" in refusal.message
    many = parts_missing("k", 100, [5], datetime.timedelta(seconds=1))
    assert many.metadata["missing"] == ",".join(str(r) for r in [0, 1, 2, 3, 4, *range(6, 21)]) + ",..."


def test_what_the_other_parts_learn_when_one_fails():
    failure = InvalidArgument("BUCKET_OUT_OF_ORDER", "bucket 3 announced, expected 2", bucket=3, expected=2)
    refusal = part_failed("k", 2, failure)
    assert decided(refusal) == ("ABORTED", "PART_FAILED", {"update_key": "k", "part": "2",
                                                           "part_reason": "BUCKET_OUT_OF_ORDER",
                                                           "part_code": "INVALID_ARGUMENT"})
    assert "part 2 of update 'k' failed (INVALID_ARGUMENT BUCKET_OUT_OF_ORDER: bucket 3 announced" in refusal.message


@pytest.mark.parametrize(("refusal", "expected", "message"), [
    (InvalidArgument("PART_MISMATCH", "rank 1 states version 'b'", update_key="k", rank=1, field="version",
                     expected="a", got="b"),
     ("INVALID_ARGUMENT", "PART_MISMATCH", {"update_key": "k", "rank": "1", "field": "version", "expected": "a",
                                            "got": "b", "part": "1"}),
     "part 1 of update 'k' was refused before it joined (rank 1 states version 'b'); every part of the update "
     "fails with its reason, nothing was allocated"),
    (InvalidArgument("MODE_UNSPECIFIED", "mode is required"),
     ("INVALID_ARGUMENT", "MODE_UNSPECIFIED", {"update_key": "k", "part": "1"}), None),
    (Unimplemented("BOX_PATCH_UNAVAILABLE", "a box among a deferred bucket's candidates", bucket=0, tensor="w"),
     ("UNIMPLEMENTED", "BOX_PATCH_UNAVAILABLE", {"bucket": "0", "tensor": "w", "update_key": "k", "part": "1"}),
     None),
])
def test_a_part_refused_before_it_joins_fails_its_key_with_its_own_reason(refusal, expected, message):
    failed = key_refused("k", 1, refusal)
    assert (type(failed), decided(failed)) == (type(refusal), expected)
    if message is not None:
        assert failed.message == message


@pytest.mark.parametrize(("silent", "expected", "message"), [
    ((), ("DEADLINE_EXCEEDED", "CLIENT_IDLE", {}), "no message from the client for 60 s"),
    ((1,), ("DEADLINE_EXCEEDED", "CLIENT_IDLE", {"silent": "1"}),
     "no message from any part for 60 s: part(s) 1 had not sent their commit (the others waited for them)"),
    ((3, 0), ("DEADLINE_EXCEEDED", "CLIENT_IDLE", {"silent": "0,3"}), None),
    (tuple(range(25)), ("DEADLINE_EXCEEDED", "CLIENT_IDLE", {"silent": ",".join(map(str, range(20))) + ",..."}),
     None),
])
def test_client_idle_names_the_silent_parts(silent, expected, message):
    refusal = client_idle(60, silent)
    assert decided(refusal) == expected
    if message is not None:
        assert refusal.message == message


def test_a_joined_world_larger_than_one_is_not_run_here():
    assert decided(parts_not_run("k", 4)) == ("UNIMPLEMENTED", "PARTS_UNAVAILABLE", {"update_key": "k", "world": "4"})


def test_a_late_part_gets_the_update_s_outcome():
    failure = parts_missing("k", 2, [0], datetime.timedelta(seconds=1))
    assert late_part("k", failure=failure) is failure
    assert decided(late_part("k", committed_generation=12)) == (
        "FAILED_PRECONDITION", "PART_KEY_USED", {"update_key": "k", "generation": "12"})


# -- what the plans send ----------------------------------------------------------------------------
def spec(name: str, shape: list[int], dtype: int = F32, **fields) -> tensor_pb2.TensorSpec:
    return tensor_pb2.TensorSpec(name=name, dtype=dtype, shape=shape, **fields)


def tbox(offsets: list[int], sizes: list[int]) -> tensor_pb2.TensorBox:
    return tensor_pb2.TensorBox(offsets=offsets, sizes=sizes)


def test_what_a_plan_sends_once_each():
    plan = tensor_pb2.WeightPlan(buckets=[
        tensor_pb2.BucketSpec(tensors=[spec("a", [2]), spec("w", [8, 4], box=tbox([0, 0], [4, 4]))]),
        tensor_pb2.BucketSpec(tensors=[spec("w", [8, 4], box=tbox([4, 0], [4, 4]), piece=tensor_pb2.TensorPiece())]),
        tensor_pb2.BucketSpec(tensors=[spec("w", [8, 4], box=tbox([4, 0], [4, 4]),
                                            piece=tensor_pb2.TensorPiece(offset_bytes=32))]),
        tensor_pb2.BucketSpec(tensors=[spec("b", [3], BF16)], deferred=True),
    ])
    w = DtypeShape(F32, (8, 4))
    assert sent_by(plan) == (
        Sent("a", None, DtypeShape(F32, (2,)), 0),
        Sent("w", box((0, 4), (0, 4)), w, 0),
        Sent("w", box((4, 8), (0, 4)), w, 1),  # its two pieces: one box, first seen in bucket 1
        Sent("b", None, DtypeShape(BF16, (3,)), 3),  # a deferred bucket's candidate
    )


# -- the union --------------------------------------------------------------------------------------
W = DtypeShape(F32, (8, 4))
STORED = {"w": W, "b": DtypeShape(F32, (4,)), "s": DtypeShape(F32, ())}
ROWS = (box((0, 4), (0, 4)), box((4, 8), (0, 4)))


def sends(rank: int, name: str, b: Box | None = None, meta: DtypeShape = W, bucket: int = 0) -> Sent:
    return Sent(name, b, meta, bucket)


@pytest.mark.parametrize(("declared", "sent", "expected"), [
    # two parts, dim-0 halves of w and b whole, nothing sent this time: all unchanged, all known from the store
    ([Declaration(0, ("b",), (("w", (ROWS[0],)),)), Declaration(1, (), (("w", (ROWS[1],)),))], {},
     Owners({"b": 0}, {"w": ((0, ROWS[0]), (1, ROWS[1]))})),
    # each sends its half, part 1 in two boxes of columns; a new tensor n known from the plan that sends it
    ([Declaration(0, ("n",), (("w", (ROWS[0],)),)),
      Declaration(1, (), (("w", (box((4, 8), (0, 1)), box((4, 8), (1, 4)))),))],
     {0: [sends(0, "w", ROWS[0]), sends(0, "n", None, DtypeShape(BF16, (5,)))],
      1: [sends(1, "w", box((4, 8), (1, 4)), bucket=2)]},
     Owners({"n": 0}, {"w": ((0, ROWS[0]), (1, box((4, 8), (0, 1))), (1, box((4, 8), (1, 4))))})),
    # a 0-d tensor's one box is the whole of it
    ([Declaration(0, (), (("s", (Box((), ()),)),))], {}, Owners({}, {"s": ((0, Box((), ())),)})),
    # whole names disjoint across parts, and once in a part
    ([Declaration(0, ("b",)), Declaration(1, ("b",))], {},
     ("INVALID_ARGUMENT", "TENSOR_OWNED_TWICE", {"tensor": "b", "parts": "0,1"})),
    ([Declaration(2, ("b", "b"))], {},
     ("INVALID_ARGUMENT", "TENSOR_OWNED_TWICE", {"tensor": "b", "parts": "2,2"})),
    ([Declaration(1, (), (("w", (ROWS[0],)), ("w", (ROWS[1],))))], {},
     ("INVALID_ARGUMENT", "TENSOR_OWNED_TWICE", {"tensor": "w", "parts": "1,1"})),
    # never both whole and boxed, in one part or two
    ([Declaration(0, ("w",)), Declaration(1, (), (("w", ROWS),))], {},
     ("INVALID_ARGUMENT", "TENSOR_WHOLE_AND_BOXED", {"tensor": "w", "whole_part": "0", "boxed_part": "1"})),
    ([Declaration(3, ("w",), (("w", ROWS),))], {},
     ("INVALID_ARGUMENT", "TENSOR_WHOLE_AND_BOXED", {"tensor": "w", "whole_part": "3", "boxed_part": "3"})),
    # a plan sends only what its part declares: a whole tensor owned whole, a box exactly as declared
    ([Declaration(0, ("b",), (("w", ROWS),)), Declaration(1)], {1: [sends(1, "b", None, STORED["b"], 4)]},
     ("INVALID_ARGUMENT", "PART_SENDS_UNOWNED", {"tensor": "b", "part": "1", "bucket": "4"})),
    ([Declaration(0, (), (("w", ROWS),))], {0: [sends(0, "w", None)]},
     ("INVALID_ARGUMENT", "PART_SENDS_UNOWNED", {"tensor": "w", "part": "0", "bucket": "0"})),
    ([Declaration(0, (), (("w", ROWS),))], {0: [sends(0, "w", box((0, 2), (0, 4)), bucket=1)]},
     ("INVALID_ARGUMENT", "PART_SENDS_UNOWNED", {"tensor": "w", "part": "0", "bucket": "1", "box": "[0:2, 0:4]"})),
    ([Declaration(0, ("w",))], {0: [sends(0, "w", ROWS[0])]},
     ("INVALID_ARGUMENT", "PART_SENDS_UNOWNED", {"tensor": "w", "part": "0", "bucket": "0", "box": "[0:4, 0:4]"})),
    # the plans agree on dtype and shape; a declared tensor is sent or stored
    ([Declaration(0, (), (("w", (ROWS[0],)),)), Declaration(1, (), (("w", (ROWS[1],)),))],
     {0: [sends(0, "w", ROWS[0])], 1: [sends(1, "w", ROWS[1], DtypeShape(BF16, (8, 4)))]},
     ("INVALID_ARGUMENT", "PART_TENSOR_MISMATCH", {"tensor": "w", "parts": "0,1"})),
    ([Declaration(0, ("new",))], {},
     ("INVALID_ARGUMENT", "PART_TENSOR_UNKNOWN", {"tensor": "new", "part": "0"})),
    ([Declaration(0, (), (("new", (box((0, 1)),)),))], {},
     ("INVALID_ARGUMENT", "PART_TENSOR_UNKNOWN", {"tensor": "new", "part": "0"})),
    # boxes: inside the shape (the plan's shape when a plan sends it), disjoint, covering
    ([Declaration(0, (), (("w", (box((0, 4), (0, 5)), ROWS[1])),))], {},
     ("INVALID_ARGUMENT", "BOX_OUT_OF_SHAPE",
      {"tensor": "w", "part": "0", "box": "[0:4, 0:5]", "shape": "[8, 4]"})),
    ([Declaration(0, (), (("w", (box((0, 8)),)),))], {},
     ("INVALID_ARGUMENT", "BOX_OUT_OF_SHAPE", {"tensor": "w", "part": "0", "box": "[0:8]", "shape": "[8, 4]"})),
    ([Declaration(0, (), (("w", (Box((0, 0), (8, 0)),)),))], {},  # a size below 1
     ("INVALID_ARGUMENT", "BOX_OUT_OF_SHAPE", {"tensor": "w", "part": "0", "box": "[0:8, 0:0]", "shape": "[8, 4]"})),
    ([Declaration(0, (), (("w", (Box((-1, 0), (8, 4)),)),))], {},
     ("INVALID_ARGUMENT", "BOX_OUT_OF_SHAPE", {"tensor": "w", "part": "0", "box": "[-1:7, 0:4]", "shape": "[8, 4]"})),
    ([Declaration(0, (), (("w", (ROWS[0],)),)), Declaration(1, (), (("w", (box((3, 8), (0, 4)),)),))], {},
     ("INVALID_ARGUMENT", "BOXES_OVERLAP", {"tensor": "w", "parts": "0,1", "boxes": "[0:4, 0:4] [3:8, 0:4]"})),
    ([Declaration(0, (), (("w", (ROWS[0], ROWS[0])),))], {},  # the same box twice
     ("INVALID_ARGUMENT", "BOXES_OVERLAP", {"tensor": "w", "parts": "0,0", "boxes": "[0:4, 0:4] [0:4, 0:4]"})),
    ([Declaration(0, (), (("s", (Box((), ()),)),)), Declaration(1, (), (("s", (Box((), ()),)),))], {},
     ("INVALID_ARGUMENT", "BOXES_OVERLAP", {"tensor": "s", "parts": "0,1", "boxes": "[] []"})),
    ([Declaration(0, (), (("w", (ROWS[0],)),))], {},
     ("INVALID_ARGUMENT", "BOXES_INCOMPLETE", {"tensor": "w", "covered": "16", "numel": "32"})),
    ([Declaration(0, (), (("w", (ROWS[0], box((4, 8), (0, 3)))),))], {},
     ("INVALID_ARGUMENT", "BOXES_INCOMPLETE", {"tensor": "w", "covered": "28", "numel": "32"})),
    # a boxed tensor new to the store arrives whole: every box of it sent, by its part
    ([Declaration(0, (), (("nw", (ROWS[0],)),)), Declaration(1, ("b",), (("nw", (ROWS[1],)),))],
     {0: [sends(0, "nw", ROWS[0])], 1: [sends(1, "b", None, STORED["b"])]},
     ("INVALID_ARGUMENT", "BOX_NOT_SENT", {"tensor": "nw", "part": "1", "box": "[4:8, 0:4]"})),
    ([Declaration(0, (), (("nw", (ROWS[0],)),)), Declaration(1, (), (("nw", (ROWS[1],)),))],
     {0: [sends(0, "nw", ROWS[0])], 1: [sends(1, "nw", ROWS[1])]},
     Owners({}, {"nw": ((0, ROWS[0]), (1, ROWS[1]))})),
    # a plan's shape wins over the store's for the tiling (the store check refuses the difference later)
    ([Declaration(0, (), (("w", (box((0, 2), (0, 4)),)),))], {0: [sends(0, "w", box((0, 2), (0, 4)), DtypeShape(F32, (2, 4)))]},
     Owners({}, {"w": ((0, box((0, 2), (0, 4))),)})),
])
def test_the_union_of_the_parts(declared, sent, expected):
    assert decided(check_union(declared, sent, STORED)) == expected


def test_a_tensor_this_server_does_not_store_is_checked_by_name_only():
    declared = [Declaration(0, ("other",), (("w", (ROWS[0],)),)), Declaration(1, (), (("w", (ROWS[1],)),))]
    assert check_union(declared, {}, {}, stores=lambda name: False) == Owners({"other": 0}, {"w": ((0, ROWS[0]), (1, ROWS[1]))})
    twice = [Declaration(0, ("other",)), Declaration(1, ("other",))]
    assert decided(check_union(twice, {}, {}, stores=lambda name: False))[1] == "TENSOR_OWNED_TWICE"


def test_a_declaration_is_read_from_the_part():
    given = pb.UpdatePart(rank=3, whole_tensors=["a", "b"], boxed_tensors=[
        pb.PartBoxes(name="w", boxes=[tbox([0, 2], [4, 2]), tbox([4, 0], [4, 4])])])
    assert Declaration.of(given) == Declaration(3, ("a", "b"), (("w", (box((0, 4), (2, 4)), box((4, 8), (0, 4)))),))


# -- the tiling against a brute-force coverage mask --------------------------------------------------
def _grid_tiling(rng: random.Random, shape: tuple[int, ...]) -> list[Box]:
    """A random exact tiling: cut each dimension at random points, then merge some neighbours along dim 0."""
    cuts = [sorted({0, d, *rng.sample(range(1, d), min(d - 1, rng.randint(0, 3)))}) for d in shape]
    cells = [[]]
    for points in cuts:
        cells = [c + [(a, b)] for c in cells for a, b in zip(points, points[1:], strict=False)]
    return [box(*c) for c in cells]


def _mutate(rng: random.Random, boxes: list[Box], shape: tuple[int, ...]) -> list[Box]:
    """Drop a box (a gap), duplicate one, or grow or shrink one by a step in one dimension (overlap or gap)."""
    boxes = list(boxes)
    kind = rng.choice(["drop", "duplicate", "grow", "shrink", "shift"])
    i = rng.randrange(len(boxes))
    b = boxes[i]
    d = rng.randrange(len(shape))
    if kind == "drop" and len(boxes) > 1:
        boxes.pop(i)
    elif kind == "duplicate":
        boxes.append(b)
    elif kind in ("grow", "shrink", "shift"):
        sizes, offsets = list(b.sizes), list(b.offsets)
        if kind == "grow" and offsets[d] + sizes[d] < shape[d]:
            sizes[d] += 1
        elif kind == "shrink" and sizes[d] > 1:
            sizes[d] -= 1
        elif kind == "shift" and offsets[d] + sizes[d] < shape[d]:
            offsets[d] += 1
        boxes[i] = Box(tuple(offsets), tuple(sizes))
    return boxes


def _mask_verdict(boxes: list[Box], shape: tuple[int, ...]) -> str:
    counts = torch.zeros(shape, dtype=torch.int32)
    for b in boxes:
        counts[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))] += 1
    if (counts > 1).any():
        return "BOXES_OVERLAP"
    return "BOXES_INCOMPLETE" if (counts == 0).any() else "ok"


def test_the_tiling_rule_agrees_with_a_coverage_mask():
    rng = random.Random(35)
    verdicts = {"ok": 0, "BOXES_OVERLAP": 0, "BOXES_INCOMPLETE": 0}
    for trial in range(600):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        boxes = _grid_tiling(rng, shape)
        for _ in range(rng.choice([0, 0, 1, 2])):
            boxes = _mutate(rng, boxes, shape)
        rng.shuffle(boxes)
        owners = [(rng.randrange(4), b) for b in boxes]
        expected = _mask_verdict(boxes, shape)
        refusal = check_tiling("t", shape, owners)
        assert (refusal.reason if refusal else "ok") == expected, (trial, shape, boxes)
        verdicts[expected] += 1
    assert min(verdicts.values()) >= 50, verdicts  # every verdict drawn often


# -- the plan id of a plan with boxes ---------------------------------------------------------------
def documented_plan_id(plan: tensor_pb2.WeightPlan) -> str:
    """The WeightPlan comment's encoding for dense tensors, pieces and boxes, written from the comment."""
    out = bytearray(b"WSPLAN1\n")
    for bucket in plan.buckets:
        out += struct.pack("<qI", bucket.size_bytes, len(bucket.tensors))
        for t in bucket.tensors:
            name = t.name.encode()
            out += struct.pack("<I", len(name)) + name + struct.pack("<II", t.dtype, len(t.shape))
            out += b"".join(struct.pack("<q", d) for d in t.shape)
            out += struct.pack("<qqIQ", t.offset_bytes, t.size_bytes, t.checksum.algorithm, t.checksum.value)
            if t.HasField("piece"):
                out += b"piece" + struct.pack("<q", t.piece.offset_bytes)
            if t.HasField("box"):
                out += b"box" + struct.pack(f"<I{len(t.box.offsets)}q", len(t.box.offsets), *t.box.offsets)
                out += struct.pack(f"<I{len(t.box.sizes)}q", len(t.box.sizes), *t.box.sizes)
    return hashlib.sha256(bytes(out)).hexdigest()[:32]


def test_a_box_is_part_of_the_plan_id_and_plans_without_one_keep_theirs():
    def plan(**fields) -> tensor_pb2.WeightPlan:
        return tensor_pb2.WeightPlan(buckets=[tensor_pb2.BucketSpec(size_bytes=64, tensors=[
            spec("w", [8, 4], size_bytes=64, **fields)])])

    whole, rows, cols = plan(), plan(box=tbox([0, 0], [4, 4])), plan(box=tbox([0, 0], [8, 2]))
    split = plan(box=tbox([0, 0], [4, 4]), piece=tensor_pb2.TensorPiece(offset_bytes=0))
    ids = [plan_id_of(p) for p in (whole, rows, cols, split)]
    assert len(set(ids)) == 4
    assert ids == [documented_plan_id(p) for p in (whole, rows, cols, split)]
    assert ids[0] == "a3b97b0ad875b7b37ae0821f848985ca"  # what the id was before boxes existed
