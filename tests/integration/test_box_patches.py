"""Patches of boxes (TensorSpec.box with a patch encoding, sent by a part): the positions of a patch are
row-major in the box, and the worker maps them into the whole tensor (gpu_worker.patch_apply.box_positions).

First the mapping itself, by tables: literal ones, then a brute force against torch indexing of a box view
over many generated boxes. Then over real gRPC, two parts as raw INLINE streams (no SDK, the boxes of
tests/integration/test_box_parts.py: row ranges, column boxes, a rank-3 box, boxes larger than a bucket) send patches of
their boxes in every encoding, STAGED and IN_PLACE: the store equals the whole tensors bit for bit. A patch
of a box whose checksum is not the box's once patched is refused (DATA_LOSS TENSOR_CHECKSUM_MISMATCH) and the
store stays bit for bit, STAGED and IN_PLACE (where another box patch of the same bucket, already applied, is
taken back), and the next push commits. Patches of boxes beside another part's dense boxes of the same tensors
(STAGED: into the shadows those boxes open) land too. (How the server routes a patch of a box: tests/unit/test_box_routes.py.)"""

from __future__ import annotations

import math
import random

import grpc
import pytest
import torch
from raw_updates import generation, refused
from test_box_parts import (
    OWNS,
    Box,
    _cut,
    declared,
    items_of,
    model,
    named,
    part_plan,
    push_boxes,
    send,
    stored,
)
from test_part_updates import past_keepalives

from weightsync.common import patch_kernels
from weightsync.common.checksum import as_bytes, to_proto, ws64
from weightsync.common.dtypes import from_torch
from weightsync.common.patches import (
    BITMASK,
    GAPS,
    POSITIONS,
    XOR,
    changed_positions,
    encode_patch,
    patch_size_bytes,
)
from weightsync.gpu_worker.patch_apply import box_positions
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import UpdateStream

pytestmark = pytest.mark.timeout(180)


# -- the mapping ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "offsets", "sizes", "positions", "whole"), [
    ((), (), (), [0], [0]),  # a 0-d tensor's one box
    ((10,), (3,), (4,), [0, 1, 3], [3, 4, 6]),
    ((4, 5), (1, 0), (2, 5), [0, 4, 5, 9], [5, 9, 10, 14]),  # rows 1..2: contiguous in the tensor
    ((4, 5), (0, 2), (4, 2), [0, 1, 2, 3, 7], [2, 3, 7, 8, 18]),  # columns 2..3 of every row
    ((4, 5), (2, 3), (2, 2), [0, 1, 2, 3], [13, 14, 18, 19]),  # a corner
    ((2, 3, 4), (1, 1, 1), (1, 2, 3), [0, 2, 3, 5], [17, 19, 21, 23]),
    ((2, 3, 4), (0, 0, 3), (2, 3, 1), [0, 1, 2, 5], [3, 7, 11, 23]),  # the last column of a rank-3 tensor
    ((3, 1, 2), (0, 0, 0), (3, 1, 2), [0, 5], [0, 5]),  # the whole tensor as its box
])
def test_box_positions_table(shape, offsets, sizes, positions, whole):
    got = box_positions(torch.tensor(positions, dtype=torch.int64), shape, offsets, sizes)
    assert got.dtype == torch.int64 and got.tolist() == whole


def _random_box(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    rank = rng.randint(1, 4)
    shape = tuple(rng.randint(1, 7) for _ in range(rank))
    offsets = tuple(rng.randint(0, d - 1) for d in shape)
    sizes = tuple(rng.randint(1, d - o) for d, o in zip(shape, offsets, strict=True))
    return shape, offsets, sizes


def test_box_positions_equal_torch_indexing_of_a_box_view_over_many_boxes():
    rng = random.Random(35)
    for _ in range(500):
        shape, offsets, sizes = _random_box(rng)
        index = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        view = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
        every = torch.arange(view.numel(), dtype=torch.int64)
        assert torch.equal(box_positions(every, shape, offsets, sizes), view), (shape, offsets, sizes)
        some = torch.tensor(sorted(rng.sample(range(view.numel()), rng.randint(1, view.numel()))))
        mapped = box_positions(some, shape, offsets, sizes)
        assert torch.equal(mapped, view[some]) and bool((mapped[1:] > mapped[:-1]).all())


# -- over real gRPC ------------------------------------------------------------------------------------
BUCKET_BYTES = 4096
ENCODINGS = {"w": POSITIONS, "c": GAPS, "big": BITMASK, "x": XOR}
"""The encoding each boxed tensor's patches use (b, whole, is sent as a whole tensor's XOR patch)."""


def changed(tensors: dict[str, torch.Tensor], seed: int, every: int = 7) -> dict[str, torch.Tensor]:
    """A copy with every `every`-th element of each tensor (from a seeded start) changed."""
    out = {}
    for k, (name, tensor) in enumerate(sorted(tensors.items())):
        t = tensor.clone()
        t.view(-1)[(seed + k) % every :: every] += 1
        out[name] = t
    return out


def _patch(old: torch.Tensor, new: torch.Tensor, encoding: int) -> tuple[torch.Tensor, int]:
    """The patch from old to new (contiguous, one layout) in `encoding`, and its count."""
    if encoding == XOR:
        encoded = patch_kernels.compare_and_encode(old.clone(), new)
        assert encoded is not None and encoded.count
        return encoded.data, encoded.count
    positions = changed_positions(old, new)
    out = torch.zeros(patch_size_bytes(encoding, new.numel(), positions.numel(), new.element_size()), dtype=torch.uint8)
    encode_patch(new, positions, encoding, out)
    return out, positions.numel()


def patch_plan(items: list[tuple[str, torch.Tensor, torch.Tensor, Box | None, int]], *, corrupt: str = ""
               ) -> tuple[tensor_pb2.WeightPlan, list[torch.Tensor]]:
    """A part's plan of patches, each (name, base, new, box or None, encoding) the patch of the box (its
    positions row-major in the box, its checksum the box's once patched), packed at 64-byte offsets into
    buckets of at most BUCKET_BYTES. `corrupt`: the checksum of that tensor's last item is off by one."""
    plan, datas = tensor_pb2.WeightPlan(), []
    current: list[tuple[tensor_pb2.TensorSpec, torch.Tensor]] = []

    def flush() -> None:
        size = -(-(current[-1][0].offset_bytes + current[-1][0].size_bytes) // 64) * 64
        data = torch.zeros(size, dtype=torch.uint8)
        for spec, raw in current:
            data[spec.offset_bytes : spec.offset_bytes + spec.size_bytes] = raw
        plan.buckets.add(size_bytes=size, tensors=[spec for spec, _ in current])
        datas.append(data)
        current.clear()

    last = max((k for k, item in enumerate(items) if item[0] == corrupt), default=-1)
    for k, (name, base, new, box, encoding) in enumerate(items):
        old_local, new_local = _cut(base, box).contiguous(), _cut(new, box).contiguous()
        raw, count = _patch(old_local, new_local, encoding)
        spec = tensor_pb2.TensorSpec(name=name, dtype=from_torch(new.dtype), shape=list(new.shape), encoding=encoding,
                                     patch_count=count, size_bytes=raw.numel(),
                                     checksum=to_proto((ws64(new_local) + (k == last)) % (1 << 64)))
        if box is not None:
            spec.box.CopyFrom(tensor_pb2.TensorBox(offsets=box[0], sizes=box[1]))
        assert raw.numel() <= BUCKET_BYTES
        offset = 0 if not current else -(-(current[-1][0].offset_bytes + current[-1][0].size_bytes) // 64) * 64
        if current and offset + raw.numel() > BUCKET_BYTES:
            flush()
            offset = 0
        spec.offset_bytes = offset
        current.append((spec, raw))
    if current:
        flush()
    return plan, datas


def patch_items(rank: int, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], prefix: str
                ) -> list[tuple[str, torch.Tensor, torch.Tensor, Box | None, int]]:
    return [(prefix + n, base[n], new[n], box, ENCODINGS.get(n, XOR)) for n, boxes in OWNS[rank].items()
            for box in (boxes if boxes is not None else [None])]


def begin_patches(node, key: str, mode: int, plans: list[tensor_pb2.WeightPlan], prefix: str, base: int
                  ) -> list[UpdateStream]:
    """Both parts begun on `base` and joined, past ready."""
    epoch = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version.store_epoch
    streams = []
    for rank, plan in enumerate(plans):
        stream = UpdateStream(node.stub())
        stream.send(begin=pb.BeginUpdate(version=key, plan=plan, mode=mode, transport=pb.TRANSPORT_INLINE,
                                         base_generation=base, base_store_epoch=epoch,
                                         part=declared(OWNS[rank], prefix, update_key=key, rank=rank, world=2)))
        streams.append(stream)
    for stream in streams:
        ready = past_keepalives(stream)
        assert ready.WhichOneof("message") == "ready", ready
    return streams


def push_patches(node, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], key: str, prefix: str, *,
                 mode: int, dense: int | None = None) -> int:
    """Both parts send patches of every box and whole tensor they own, from base to new (but part `dense`,
    which sends its boxes and tensors dense); the generation."""
    before = generation(node)
    built = [part_plan(items_of(OWNS[rank], new, prefix)) if rank == dense
             else patch_plan(patch_items(rank, base, new, prefix)) for rank in range(2)]
    streams = begin_patches(node, key, mode, [plan for plan, _ in built], prefix, before)
    for stream, (_, datas) in zip(streams, built, strict=True):
        assert send(stream, datas) == ["bucket_applied"] * len(datas)
        stream.send(commit=pb.CommitUpdate())
    answers = [past_keepalives(s) for s in streams]
    for stream in streams:
        stream.close()
    assert [a.WhichOneof("message") for a in answers] == ["committed", "committed"], answers
    assert {a.committed.version.generation for a in answers} == {before + 1}
    return before + 1


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from helpers import start_server

    server = start_server(tmp_path_factory.mktemp("box-patches"), workers=2)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in_place"])
def test_patches_of_boxes_land_at_their_place_in_the_whole_tensor(node, mode):
    prefix = f"p{mode}."
    steps = [model(20)]
    push_boxes(node, steps[0], "v0", f"k-{mode}-dense", prefix)
    for step in range(1, 4):
        steps.append(changed(steps[-1], step))
        push_patches(node, steps[-2], steps[-1], f"k-{mode}-patch-{step}", prefix, mode=mode)
        assert stored(node, named(steps[-1], prefix)), step
    # the plans really were patches: far fewer bytes than the boxes
    plan, datas = patch_plan(patch_items(0, steps[-2], steps[-1], prefix))
    assert all(s.encoding != tensor_pb2.TENSOR_ENCODING_UNSPECIFIED for b in plan.buckets for s in b.tensors)
    assert sum(d.numel() for d in datas) < 0.5 * sum(as_bytes(_cut(steps[-1][n], box)).numel()
                                                     for n, boxes in OWNS[0].items() for box in boxes or [None])


def test_patches_of_boxes_beside_dense_boxes_of_the_same_tensors_go_into_their_shadows(node):
    """STAGED, part 1 dense: its boxes write the boxed tensors' segments, which the update then shadows (a copy
    of live first: part 0's boxes are not rewritten), and part 0's box patches go into those shadows at once
    (the other test's patches-only updates shadow nothing and scatter at commit)."""
    prefix = "m."
    steps = [model(50)]
    push_boxes(node, steps[0], "v0", "k-mixed-dense", prefix)
    for step, dense in ((1, 1), (2, 0)):
        steps.append(changed(steps[-1], step))
        push_patches(node, steps[-2], steps[-1], f"k-mixed-{step}", prefix, mode=pb.UPDATE_MODE_STAGED, dense=dense)
        assert stored(node, named(steps[-1], prefix)), step


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in_place"])
def test_a_box_patch_failing_its_checksum_changes_nothing_and_the_next_push_commits(node, mode):
    prefix = f"q{mode}."
    base = model(30)
    before = push_boxes(node, base, "v0", f"k-{mode}-corrupt-base", prefix)
    new = changed(base, 1)
    # part 0: x's two boxes in one bucket, the second one's checksum wrong: IN_PLACE, the XOR patches before it
    # in the bucket (big's, x's first box) are applied as they are checked, then taken back
    plan0, datas0 = patch_plan(patch_items(0, base, new, prefix), corrupt=prefix + "x")
    plan1, datas1 = patch_plan(patch_items(1, base, new, prefix))
    x_buckets = [k for k, b in enumerate(plan0.buckets) if any(s.name == prefix + "x" for s in b.tensors)]
    assert len(x_buckets) == 1 and sum(s.name == prefix + "x" for s in plan0.buckets[x_buckets[0]].tensors) == 2
    zero, one = begin_patches(node, f"k-{mode}-corrupt", mode, [plan0, plan1], prefix, before)
    assert send(one, datas1) == ["bucket_applied"] * len(datas1)  # part 1's patches are in, then part 0 fails
    assert send(zero, datas0) == ["bucket_applied"] * x_buckets[0] + ["aborting"]
    told = past_keepalives(one)
    assert told.WhichOneof("message") == "aborting" and told.aborting.reason == "PART_FAILED", told
    zero.send(abort=pb.AbortUpdate(reason="bucket refused"))
    one.send(commit=pb.CommitUpdate())
    code, reason, metadata = refused(zero)
    assert (code, reason, metadata["tensor"]) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH", prefix + "x")
    assert refused(one)[:2] == (grpc.StatusCode.ABORTED, "PART_FAILED")
    assert generation(node) == before
    if mode == pb.UPDATE_MODE_STAGED:  # nothing of it reached the live store
        assert stored(node, named(base, prefix))
    else:  # IN_PLACE: part 1's applied patches stay (the update is torn), nothing of part 0's refused bucket
        expected = {name: t.clone() for name, t in base.items()}
        for name, boxes in OWNS[1].items():
            for box in boxes if boxes is not None else [None]:
                _cut(expected[name], box).copy_(_cut(new[name], box))
        assert stored(node, named(expected, prefix))
    after = changed(base, 2)
    assert push_boxes(node, after, "v2", f"k-{mode}-after-corrupt", prefix, mode=mode) == before + 1
    assert stored(node, named(after, prefix))
