"""server/store/update_plan.py routes a box (TensorSpec.box) through staging into strided copies of its sub-boxes:
never straight into the store; a boxed tensor new to the store gets a segment of its own at its first box;
STAGED shadows count the bytes a box writes; IN_PLACE overwrites name it; a subset node routes only its own.
Plan validation (common/plan_validation.py) checks a spec with a box as the box."""

from __future__ import annotations

import pytest
import torch

from weightsync.common.errors import InvalidArgument
from weightsync.common.plan_validation import PlanLimits, validate_plan
from weightsync.server.store.update_plan import (
    BoxCopy,
    PatchTarget,
    StoredTensor,
    derive_update_plan,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

F32 = tensor_pb2.DTYPE_FLOAT32


def spec(name: str, shape: list[int], offsets: list[int] | None = None, sizes: list[int] | None = None, *,
         offset_bytes: int = 0, piece: int | None = None, size_bytes: int | None = None) -> tensor_pb2.TensorSpec:
    out = tensor_pb2.TensorSpec(name=name, dtype=F32, shape=shape, offset_bytes=offset_bytes)
    numel = 1
    for d in sizes if sizes is not None else shape:
        numel *= d
    out.size_bytes = size_bytes if size_bytes is not None else 4 * numel
    if offsets is not None:
        out.box.CopyFrom(tensor_pb2.TensorBox(offsets=offsets, sizes=sizes))
    if piece is not None:
        out.piece.offset_bytes = piece
    return out


def plan_of(*buckets: list[tensor_pb2.TensorSpec]) -> tensor_pb2.WeightPlan:
    plan = tensor_pb2.WeightPlan()
    for specs in buckets:
        end = max(s.offset_bytes + s.size_bytes for s in specs)
        plan.buckets.add(size_bytes=end, tensors=specs)
    return plan


def derive(plan, tensors=None, sizes=None, *, mode=pb.UPDATE_MODE_STAGED, stores=lambda name: True):
    tensors = tensors or {}
    sizes = sizes or []
    return derive_update_plan(plan=plan, plan_id="p", mode=mode, allow_new_tensors=True, tensors=tensors,
                              segment_signatures=[b""] * len(sizes), segment_sizes=sizes, layout_version=1,
                              stores=stores)


W = StoredTensor("w", torch.float32, (4, 6), 0, 0, 96)
B = StoredTensor("b", torch.float32, (8,), 0, 128, 32)


def test_a_row_box_and_a_column_box_of_stored_tensors():
    plan = plan_of([spec("w", [4, 6], [2, 0], [2, 6]), spec("b", [8], [0], [4], offset_bytes=64)],
                   [spec("w", [4, 6], [0, 0], [2, 6])])
    derived = derive(plan, {"w": W, "b": B}, [160])
    first, second = derived.routes
    assert first.receive_into is None and first.copies == () and first.overwrites == ("w", "b")
    assert first.box_copies == (
        BoxCopy("w", 0, 48, 0, 0, torch.float32, (4, 6), (2, 0), (2, 6)),
        BoxCopy("b", 64, 16, 0, 128, torch.float32, (8,), (0,), (4,)))
    assert second.box_copies == (BoxCopy("w", 0, 48, 0, 0, torch.float32, (4, 6), (0, 0), (2, 6)),)
    assert derived.staging_bytes == 80
    assert derived.shadowed_segments == (0,) and derived.copied_to_shadow == (0,)  # b's other half, the padding
    assert derived.new_segments == () and derived.names == frozenset({"w", "b"})


def test_a_segment_every_byte_of_which_boxes_rewrite_needs_no_shadow_copy():
    plan = plan_of([spec("w", [4, 6], [0, 0], [4, 3])], [spec("w", [4, 6], [0, 3], [4, 3])])
    derived = derive(plan, {"w": W}, [96])
    assert derived.shadowed_segments == (0,) and derived.copied_to_shadow == ()
    assert [c.offsets for r in derived.routes for c in r.box_copies] == [(0, 0), (0, 3)]
    in_place = derive(plan, {"w": W}, [96], mode=pb.UPDATE_MODE_IN_PLACE)
    assert in_place.shadowed_segments == () and [r.overwrites for r in in_place.routes] == [("w",), ("w",)]


def test_a_box_in_pieces_cuts_each_piece_s_range_into_sub_boxes():
    """A [0:4, 1:6] box of w (20 elements) in pieces of 28 and 52 bytes: 7 elements end mid-row of the box."""
    plan = plan_of([spec("w", [4, 6], [0, 1], [4, 5], piece=0, size_bytes=28)],
                   [spec("w", [4, 6], [0, 1], [4, 5], piece=28, size_bytes=52)])
    first, second = derive(plan, {"w": W}, [96]).routes
    assert [(c.src_offset, c.size_bytes, c.offsets, c.sizes) for c in first.box_copies] == [
        (0, 20, (0, 1), (1, 5)), (20, 8, (1, 1), (1, 2))]
    assert [(c.src_offset, c.size_bytes, c.offsets, c.sizes) for c in second.box_copies] == [
        (0, 12, (1, 3), (1, 3)), (12, 40, (2, 1), (2, 5))]


def test_a_boxed_tensor_new_to_the_store_gets_a_segment_of_its_own_at_its_first_box():
    plan = plan_of([spec("n", [4, 6], [0, 0], [2, 6]), spec("m", [8], offset_bytes=64)],
                   [spec("n", [4, 6], [2, 0], [2, 6])])
    derived = derive(plan)
    first, second = derived.routes
    assert first.receive_into is None and first.overwrites == () and second.overwrites == ()
    assert [s.size_bytes for s in derived.new_segments] == [64, 96]  # m packed by the general path, then n
    (n,) = [t for t in derived.new_tensors if t.name == "n"]
    assert (n.segment, n.offset_bytes, n.size_bytes) == (1, 0, 96)
    assert {(c.segment, c.tensor_offset, c.offsets) for r in derived.routes for c in r.box_copies} == {
        (1, 0, (0, 0)), (1, 0, (2, 0))}


def test_a_subset_node_routes_the_boxes_of_its_tensors_only():
    plan = plan_of([spec("w", [4, 6], [0, 0], [2, 6]), spec("other", [8], [0], [8], offset_bytes=64)],
                   [spec("other", [8], [0], [8])])
    derived = derive(plan, {"w": W}, [96], stores=lambda name: name == "w")
    assert [c.name for c in derived.routes[0].box_copies] == ["w"]
    assert derived.not_stored == (1,)


def patch(name: str, shape: list[int], offsets: list[int], sizes: list[int], *, count: int, size_bytes: int,
          offset_bytes: int = 0, checksum: int = 0xABC) -> tensor_pb2.TensorSpec:
    """A POSITIONS patch of a box: count changed elements, its checksum the box's once patched."""
    out = spec(name, shape, offsets, sizes, offset_bytes=offset_bytes, size_bytes=size_bytes)
    out.encoding, out.patch_count = tensor_pb2.TENSOR_ENCODING_PATCH_POSITIONS, count
    out.checksum.algorithm, out.checksum.value = tensor_pb2.CHECKSUM_ALGORITHM_WS64, checksum
    return out


def test_a_patch_of_a_box_is_scattered_from_staging_with_its_box_and_never_shadowed():
    plan = plan_of([patch("w", [4, 6], [0, 2], [4, 2], count=2, size_bytes=16),
                    spec("b", [8], [0], [4], offset_bytes=64)])
    derived = derive(plan, {"w": W, "b": B}, [160])
    (route,) = derived.routes
    assert route.receive_into is None and route.copies == () and route.checks == ()
    assert route.patches == (PatchTarget("w", 0, 16, tensor_pb2.TENSOR_ENCODING_PATCH_POSITIONS, 2, 0xABC,
                                         ((0, 2), (4, 2))),)
    assert [c.name for c in route.box_copies] == ["b"]  # the dense box beside it: strided copies
    assert route.overwrites == ("w", "b") and derived.staging_bytes == 80
    # STAGED: b's box writes the segment (shadowed, its shadow starting as live), w's patch goes where the
    # segment's other writes go; a bucket of patches only shadows nothing (scattered at commit)
    assert derived.shadowed_segments == (0,) and derived.copied_to_shadow == (0,)
    alone = derive(plan_of([patch("w", [4, 6], [1, 0], [1, 6], count=1, size_bytes=8)]), {"w": W}, [160])
    assert alone.shadowed_segments == () and alone.routes[0].overwrites == ("w",)
    assert alone.routes[0].patches[0].box == ((1, 0), (1, 6))


def test_a_patch_of_a_box_of_a_tensor_the_store_lacks_is_refused():
    with pytest.raises(InvalidArgument) as caught:
        derive(plan_of([patch("n", [4, 6], [0, 0], [2, 6], count=1, size_bytes=8)]), {"w": W}, [96])
    assert (caught.value.reason, caught.value.metadata) == ("TENSOR_UNKNOWN", {"bucket": "0", "tensor": "n"})
    with pytest.raises(InvalidArgument) as caught:  # its shape is the whole tensor's, as the store holds it
        derive(plan_of([patch("w", [4, 7], [0, 0], [2, 6], count=1, size_bytes=8)]), {"w": W}, [96])
    assert caught.value.reason == "TENSOR_SHAPE_MISMATCH"


# -- plan validation: a spec with a box is checked as the box ------------------------------------------
LIMITS = PlanLimits(max_tensors=10, max_plan_bytes=1 << 20, max_bucket_bytes=1 << 20)


def refusal(plan) -> tuple[str, dict[str, str]]:
    with pytest.raises(InvalidArgument) as caught:
        validate_plan(plan, LIMITS)
    return caught.value.reason, caught.value.metadata


def test_a_box_is_validated_as_the_box():
    # two boxes of one tensor in one plan; the box's size is its elements'
    summary = validate_plan(plan_of([spec("w", [4, 6], [0, 0], [2, 6]), spec("w", [4, 6], [2, 0], [2, 6],
                                                                            offset_bytes=64)]), LIMITS)
    assert (summary.tensor_count, summary.total_bytes) == (2, 112)
    assert refusal(plan_of([spec("w", [4, 6], [0, 0], [2, 6], size_bytes=96)]))[0] == "TENSOR_SIZE_MISMATCH"
    assert refusal(plan_of([spec("w", [4, 6], [0, 0], [2, 6]), spec("w", [4, 6], [0, 0], [2, 6], offset_bytes=64)])
                   ) == ("TENSOR_NAME_DUPLICATE", {"bucket": "0", "tensor": "w"})
    assert refusal(plan_of([spec("w", [4, 6], [3, 0], [2, 6])])) == (
        "BOX_OUT_OF_SHAPE", {"bucket": "0", "tensor": "w", "box": "[3:5, 0:6]", "shape": "[4, 6]"})
    assert refusal(plan_of([spec("w", [4, 6], [0], [4], size_bytes=16)]))[0] == "BOX_OUT_OF_SHAPE"  # another rank


def test_a_box_s_pieces_cover_the_box():
    whole = plan_of([spec("w", [4, 6], [0, 1], [4, 5], piece=0, size_bytes=28)],
                    [spec("w", [4, 6], [0, 1], [4, 5], piece=28, size_bytes=52)])
    assert validate_plan(whole, LIMITS).tensor_count == 1
    short = plan_of([spec("w", [4, 6], [0, 1], [4, 5], piece=0, size_bytes=28)])
    assert refusal(short) == ("PIECES_INCOMPLETE", {"bucket": "1", "tensor": "w", "received_bytes": "28",
                                                    "size_bytes": "80"})
    past = plan_of([spec("w", [4, 6], [0, 1], [4, 5], piece=0, size_bytes=28)],
                   [spec("w", [4, 6], [0, 1], [4, 5], piece=28, size_bytes=68)])  # the whole tensor's end
    assert refusal(past)[0] == "PIECE_INVALID"
    other = plan_of([spec("w", [4, 6], [0, 1], [4, 5], piece=0, size_bytes=28)],
                    [spec("w", [4, 6], [0, 0], [4, 5], piece=28, size_bytes=52)])  # another box's piece
    assert refusal(other)[0] == "PIECES_INCOMPLETE"
