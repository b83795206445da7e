"""What an update will do to a store, derived from its plan before any byte moves.

`derive_update_plan` checks every tensor of the plan against the store and
decides, for each bucket, where its bytes go:
  - straight into an existing segment whose layout equals the bucket (the fast
    path): the live side for IN_PLACE, the shadow side for STAGED;
  - straight into a new segment, when every tensor of the bucket is new (the
    first update, or allow_new_tensors);
  - straight into its place in the tensor, for a piece of a split tensor (a
    new split tensor gets a segment of its own at its first piece);
  - into the staging buffer, then one copy per tensor (the general path);
  - into the staging buffer, then one strided copy per sub-box, for a box of a tensor (TensorSpec.box,
    sent by a part): the box's elements (or a piece's range of them) land at their place in the whole
    stored tensor (boxes.py); a boxed tensor new to the store gets a segment of its own at its
    first box, which the other boxes (every one of them sent: parts.rules.check_union) fill; a patch of a box
    (of a stored tensor) is scattered from staging as a whole tensor's patch is, its positions mapped from
    the box into the whole tensor by the receiver (PatchTarget.box);
  - nowhere, when the node stores none of its tensors (a server started with
    `--tensors REGEX` holds a subset): the bucket has no owner on this node. A
    bucket with some of the node's tensors takes the general path for those;
  - into staging, for a deferred bucket (BucketSpec.deferred): its candidates are
    checked against the store now, and its patches routed once its layout is
    announced (deferred_route), before its bytes move.
STAGED: a shadowed segment this update does not rewrite whole starts as a copy
of its live bytes (a box counts the bytes it writes: boxes are disjoint, so a segment
counts as rewritten whole only when every byte of it is).

It allocates nothing and reads nothing but the store's layout, so the result
depends only on (plan id, layout version, mode): the node store keeps it in its
DerivedPlans and reuses it while the layout holds. Memory needs are computed
separately (node_store.py), against the store as it is at prepare time.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightsync.common import dtypes, patches
from weightsync.common.errors import InvalidArgument
from weightsync.common.layout import align_segment, align_up
from weightsync.server.store.boxes import sub_boxes
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor lives: a byte range of a segment."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    segment: int
    offset_bytes: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class TensorCheck:
    """A tensor whose spec carries a WS64 checksum, checked in the received bucket."""

    name: str
    offset_bytes: int
    size_bytes: int
    expected: int


@dataclass(frozen=True, slots=True)
class TensorCopy:
    """General path: bucket bytes [src_offset, +size) go to segment bytes [dst_offset, +size)."""

    src_offset: int
    size_bytes: int
    segment: int
    dst_offset: int


@dataclass(frozen=True, slots=True)
class BoxCopy:
    """A box (TensorSpec.box), from staging: bucket bytes [src_offset, +size_bytes) are the row-major
    elements of the sub-box (offsets, sizes) of tensor `name`, whose whole bytes (dtype, shape) start at
    segment bytes tensor_offset (boxes.sub_boxes cut the box, or a piece of it, into such)."""

    name: str
    src_offset: int
    size_bytes: int
    segment: int
    tensor_offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PatchTarget:
    """A tensor that arrives as a patch (tensor.proto, TensorEncoding): bucket bytes
    [src_offset, +size) hold it; it overwrites elements of the stored tensor `name`."""

    name: str
    src_offset: int
    size_bytes: int
    encoding: int
    count: int
    expected: int
    """WS64 of the whole tensor once patched (of the box's elements, row-major, for a patch of a box)."""
    box: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """(offsets, sizes): a patch of this box of the tensor (TensorSpec.box, from a part), its positions
    row-major in the box; the receiver maps them into the whole tensor. None: the whole tensor."""


@dataclass(frozen=True, slots=True)
class DirectTarget:
    """Where a bucket received straight into the store lands: segment bytes [offset_bytes, +size)."""

    segment: int
    offset_bytes: int = 0


@dataclass(frozen=True, slots=True)
class BucketRoute:
    """Where one bucket's bytes go."""

    size_bytes: int
    receive_into: DirectTarget | None
    """Receive the bytes straight into the store (a segment, or a split tensor's place); None: staging + copies."""
    copies: tuple[TensorCopy, ...]
    checks: tuple[TensorCheck, ...]
    overwrites: tuple[str, ...]
    """Tensors already in the store that this bucket rewrites (IN_PLACE abort marks them dirty)."""
    patches: tuple[PatchTarget, ...] = ()
    """Tensors of this bucket sent as patches: never copied whole, never shadowed."""
    stored: bool = True
    """False: none of the bucket's tensors belongs to this node's subset; nobody receives it here."""
    box_copies: tuple[BoxCopy, ...] = ()
    """Boxes of tensors (and pieces of boxes), from staging: one strided copy per sub-box."""

    @property
    def direct(self) -> bool:
        return self.receive_into is not None


def _not_stored(bucket: tensor_pb2.BucketSpec) -> BucketRoute:
    return BucketRoute(bucket.size_bytes, None, (), (), (), stored=False)


def stores_everything(name: str) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class NewSegment:
    size_bytes: int
    signature: bytes


@dataclass(frozen=True, slots=True)
class UpdatePlan:
    """Everything an update does to the store, decided before any byte moves."""

    plan_id: str
    layout_version: int
    staged: bool
    routes: tuple[BucketRoute, ...]
    first_new_segment: int
    new_segments: tuple[NewSegment, ...]
    new_tensors: tuple[StoredTensor, ...]
    shadowed_segments: tuple[int, ...]
    """STAGED: existing segments this update writes through their shadow (swapped at commit)."""
    copied_to_shadow: tuple[int, ...]
    """STAGED: shadowed segments not fully rewritten, so their shadow starts as a copy of live."""
    staging_bytes: int
    """Largest general-path bucket: the staging buffer must hold it."""
    names: frozenset[str]

    @property
    def fast_path_count(self) -> int:
        return sum(1 for r in self.routes if r.direct)

    @property
    def not_stored(self) -> tuple[int, ...]:
        """Buckets with nothing for this node (see BucketRoute.stored)."""
        return tuple(k for k, r in enumerate(self.routes) if not r.stored)

    @property
    def new_segment_bytes(self) -> int:
        return sum(align_segment(s.size_bytes) for s in self.new_segments)


def bucket_signature(bucket: tensor_pb2.BucketSpec) -> bytes:
    """What must be equal for a bucket to be received straight into a segment (dense tensors only:
    a bucket holding a patch never is)."""
    digest = hashlib.blake2b(str(bucket.size_bytes).encode(), digest_size=16)
    for t in bucket.tensors:
        digest.update(f"\0{t.name}\0{t.dtype}\0{list(t.shape)}\0{t.offset_bytes}\0{t.size_bytes}".encode())
        if patches.is_patch(t.encoding):
            digest.update(f"\0patch{t.encoding}".encode())
    return digest.digest()


def _check_against_store(index: int, spec: tensor_pb2.TensorSpec, stored: StoredTensor) -> None:
    want = dtypes.to_torch(spec.dtype, tensor=spec.name)
    if want != stored.dtype:
        raise InvalidArgument(
            "TENSOR_DTYPE_MISMATCH",
            f"tensor {spec.name!r} is {stored.dtype} in the store but {want} in the plan",
            bucket=index, tensor=spec.name, store_dtype=stored.dtype, plan_dtype=want,
        )
    if tuple(spec.shape) != stored.shape:
        raise InvalidArgument(
            "TENSOR_SHAPE_MISMATCH",
            f"tensor {spec.name!r} has shape {list(stored.shape)} in the store but {list(spec.shape)} in the plan",
            bucket=index, tensor=spec.name, store_shape=list(stored.shape), plan_shape=list(spec.shape),
        )


def _checks(specs: list[tensor_pb2.TensorSpec]) -> tuple[TensorCheck, ...]:
    """Dense tensors (and pieces) with a WS64 (a patch's checksum is of the patched tensor: see PatchTarget)."""
    return tuple(
        TensorCheck(s.name, s.offset_bytes, s.size_bytes, s.checksum.value)
        for s in specs
        if s.checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_WS64 and not patches.is_patch(s.encoding)
    )


def _new_tensor(spec: tensor_pb2.TensorSpec, segment: int, offset: int) -> StoredTensor:
    whole = math.prod(spec.shape) * dtypes.itemsize(spec.dtype, tensor=spec.name)
    return StoredTensor(spec.name, dtypes.to_torch(spec.dtype, tensor=spec.name), tuple(spec.shape), segment, offset,
                        whole)


class _Derivation:
    """One derive_update_plan call: the store's layout, and what the plan's buckets add to it so far."""

    def __init__(self, tensors: dict[str, StoredTensor], segment_signatures: list[bytes],
                 segment_sizes: list[int], *, staged: bool, allow_new: bool, stores: Callable[[str], bool]) -> None:
        self.tensors = tensors
        self.stores = stores
        self.segment_sizes = segment_sizes
        self.staged = staged
        self.allow_new = allow_new
        self.by_signature = {sig: i for i, sig in enumerate(segment_signatures) if sig}
        self.first_new = len(segment_signatures)
        self.new_segments: list[NewSegment] = []
        self.new_tensors: dict[str, StoredTensor] = {}
        self.routes: list[BucketRoute] = []
        self.touched: set[int] = set()
        self.written: dict[int, int] = {}
        """Existing segment -> bytes of it this update rewrites (a segment rewritten whole needs no shadow copy)."""
        self.staging = 0
        self.names: set[str] = set()

    def _write(self, segment: int, size: int) -> None:
        self.touched.add(segment)
        self.written[segment] = self.written.get(segment, 0) + size

    def _new_segment(self, size: int, signature: bytes) -> int:
        self.new_segments.append(NewSegment(size, signature))
        return self.first_new + len(self.new_segments) - 1

    def bucket(self, index: int, bucket: tensor_pb2.BucketSpec) -> None:
        specs = [s for s in bucket.tensors if self.stores(s.name)]
        if bucket.tensors and not specs:
            self.routes.append(_not_stored(bucket))
            return
        if bucket.deferred:
            self.routes.append(self._deferred(index, bucket, specs))
            return
        for spec in specs:
            self.names.add(spec.name)
        checks = _checks(specs)
        if any(s.HasField("box") for s in specs):
            self.routes.append(self._boxed(index, bucket, specs, checks))
            return
        if specs and specs[0].HasField("piece"):
            self.routes.append(self._piece(index, specs[0], checks))
            return
        existing, patched = self._existing_and_patched(index, specs)
        if patched or len(specs) < len(bucket.tensors):  # a patch, or only some of the bucket is this node's
            self.routes.append(self._general(bucket.size_bytes, specs, checks, existing, tuple(patched)))
        elif not existing:  # every tensor is new: the bucket defines a segment of its own
            segment = self._new_segment(bucket.size_bytes, bucket_signature(bucket))
            self.new_tensors.update((s.name, _new_tensor(s, segment, s.offset_bytes)) for s in bucket.tensors)
            self.routes.append(BucketRoute(bucket.size_bytes, DirectTarget(segment), (), checks, ()))
        elif (segment := self.by_signature.get(bucket_signature(bucket))) is not None and all(
                self.tensors[n].segment == segment for n in existing):
            self._write(segment, self.segment_sizes[segment])
            self.routes.append(BucketRoute(bucket.size_bytes, DirectTarget(segment), (), checks, tuple(existing)))
        else:
            self.routes.append(self._general(bucket.size_bytes, specs, checks, existing, ()))

    def _existing_and_patched(self, index: int, specs: list[tensor_pb2.TensorSpec]) -> tuple[list[str], list[PatchTarget]]:
        """The bucket's tensors already in the store (checked against it), and its patches."""
        existing: list[str] = []
        patched: list[PatchTarget] = []
        for spec in specs:
            stored = self.tensors.get(spec.name)
            if patches.is_patch(spec.encoding):
                if stored is None:
                    raise InvalidArgument("TENSOR_UNKNOWN", f"tensor {spec.name!r} is sent as a patch but is not in "
                                          "the store: send it dense", bucket=index, tensor=spec.name)
                _check_against_store(index, spec, stored)
                patched.append(PatchTarget(spec.name, spec.offset_bytes, spec.size_bytes, spec.encoding,
                                           spec.patch_count, spec.checksum.value))
            elif stored is None:
                self._require_new_allowed(index, spec)
            else:
                _check_against_store(index, spec, stored)
                existing.append(spec.name)
        return existing, patched

    def _deferred(self, index: int, bucket: tensor_pb2.BucketSpec, specs: list[tensor_pb2.TensorSpec]) -> BucketRoute:
        """Candidates are tensors of the store (a patch has a base); what the bucket writes, and which of
        its tensors, is known once its layout is announced."""
        for spec in specs:
            stored = self.tensors.get(spec.name)
            if stored is None:
                raise InvalidArgument("TENSOR_UNKNOWN", f"tensor {spec.name!r} is a candidate patch but is not in "
                                      "the store: send it dense", bucket=index, tensor=spec.name)
            _check_against_store(index, spec, stored)
        self.staging = max(self.staging, bucket.size_bytes)
        return BucketRoute(bucket.size_bytes, None, (), (), ())  # size_bytes: the room its layout may take

    def _require_new_allowed(self, index: int, spec: tensor_pb2.TensorSpec) -> None:
        if not self.allow_new:
            raise InvalidArgument("TENSOR_UNKNOWN", f"tensor {spec.name!r} is not in the store; set "
                                  "allow_new_tensors to add it", bucket=index, tensor=spec.name)

    def _piece(self, index: int, spec: tensor_pb2.TensorSpec, checks: tuple[TensorCheck, ...]) -> BucketRoute:
        """A piece of a split tensor goes straight to its place in the tensor (validation made the bucket
        exactly the piece); a new split tensor gets a segment of its own at its first piece."""
        tensor, is_new = self._whole_tensor(index, spec)
        if not is_new:
            self._write(tensor.segment, spec.size_bytes)
        target = DirectTarget(tensor.segment, tensor.offset_bytes + spec.piece.offset_bytes)
        return BucketRoute(spec.size_bytes, target, (), checks, () if is_new else (spec.name,))

    def _general(self, size_bytes: int, specs: list[tensor_pb2.TensorSpec], checks: tuple[TensorCheck, ...],
                 existing: list[str], patched: tuple[PatchTarget, ...]) -> BucketRoute:
        """Staging, then one copy per dense tensor of this node (new ones get one packed segment of their
        own); patches are scattered from staging."""
        self.staging = max(self.staging, size_bytes)
        copies: list[TensorCopy] = []
        fresh = [s for s in specs if s.name not in self.tensors]
        if fresh:
            fresh_segment = self.first_new + len(self.new_segments)
            cursor = 0
            for spec in fresh:
                start = align_up(cursor)
                self.new_tensors[spec.name] = _new_tensor(spec, fresh_segment, start)
                copies.append(TensorCopy(spec.offset_bytes, spec.size_bytes, fresh_segment, start))
                cursor = start + spec.size_bytes
            self._new_segment(align_up(cursor), b"")
        for spec in specs:
            stored = self.tensors.get(spec.name)
            if stored is not None and not patches.is_patch(spec.encoding):
                copies.append(TensorCopy(spec.offset_bytes, spec.size_bytes, stored.segment, stored.offset_bytes))
                self._write(stored.segment, spec.size_bytes)
        overwrites = (*existing, *(p.name for p in patched))
        return BucketRoute(size_bytes, None, tuple(copies), checks, overwrites, patched)

    def _boxed(self, index: int, bucket: tensor_pb2.BucketSpec, specs: list[tensor_pb2.TensorSpec],
               checks: tuple[TensorCheck, ...]) -> BucketRoute:
        """A bucket with boxes (or one piece of a box): never received straight into the store. Its whole
        tensors go as the general path's; each box (its piece's range of elements) as strided copies of
        sub-boxes into its place in the whole tensor."""
        whole = [s for s in specs if not s.HasField("box")]
        existing, patched = self._existing_and_patched(index, whole)
        general = self._general(bucket.size_bytes, whole, checks, existing, tuple(patched))
        box_copies: list[BoxCopy] = []
        overwrites = list(general.overwrites)
        box_patches: list[PatchTarget] = []
        for spec in specs:
            if not spec.HasField("box"):
                continue
            if patches.is_patch(spec.encoding):  # never shadowed: written where the tensor's patches go
                box_patches.append(self._box_patch(index, spec))
                overwrites.append(spec.name)
                continue
            target, fresh = self._whole_tensor(index, spec)
            if not fresh:
                self._write(target.segment, spec.size_bytes)
                overwrites.append(spec.name)
            itemsize = target.dtype.itemsize
            first = spec.piece.offset_bytes // itemsize if spec.HasField("piece") else 0
            for cut in sub_boxes(tuple(spec.box.offsets), tuple(spec.box.sizes), first, spec.size_bytes // itemsize):
                box_copies.append(BoxCopy(spec.name, spec.offset_bytes + cut.start * itemsize, cut.numel * itemsize,
                                          target.segment, target.offset_bytes, target.dtype, target.shape,
                                          cut.offsets, cut.sizes))
        return BucketRoute(bucket.size_bytes, None, general.copies, checks, tuple(dict.fromkeys(overwrites)),
                           (*general.patches, *box_patches), box_copies=tuple(box_copies))

    def _box_patch(self, index: int, spec: tensor_pb2.TensorSpec) -> PatchTarget:
        """A patch of a box: of a tensor the store holds (its base), as the plan says it."""
        stored = self.tensors.get(spec.name)
        if stored is None:
            raise InvalidArgument("TENSOR_UNKNOWN", f"tensor {spec.name!r} is sent as a patch of a box but is not "
                                  "in the store: send the box dense", bucket=index, tensor=spec.name)
        _check_against_store(index, spec, stored)
        return PatchTarget(spec.name, spec.offset_bytes, spec.size_bytes, spec.encoding, spec.patch_count,
                           spec.checksum.value, (tuple(spec.box.offsets), tuple(spec.box.sizes)))

    def _whole_tensor(self, index: int, spec: tensor_pb2.TensorSpec) -> tuple[StoredTensor, bool]:
        """The whole tensor a piece or a box lands in, and whether it is new to the store (its first piece
        or box gives it a segment of its own; nothing of it is live, so nothing to overwrite or shadow)."""
        stored = self.tensors.get(spec.name)
        if stored is not None:
            _check_against_store(index, spec, stored)
            return stored, False
        new = self.new_tensors.get(spec.name)
        if new is None:
            self._require_new_allowed(index, spec)
            new = _new_tensor(spec, self.first_new + len(self.new_segments), 0)
            self._new_segment(new.size_bytes, b"")
            self.new_tensors[spec.name] = new
        return new, True

    def result(self, plan_id: str, layout_version: int) -> UpdatePlan:
        shadowed = tuple(sorted(self.touched)) if self.staged else ()
        return UpdatePlan(
            plan_id=plan_id,
            layout_version=layout_version,
            staged=self.staged,
            routes=tuple(self.routes),
            first_new_segment=self.first_new,
            new_segments=tuple(self.new_segments),
            new_tensors=tuple(self.new_tensors.values()),
            shadowed_segments=shadowed,
            copied_to_shadow=tuple(s for s in shadowed if self.written.get(s, 0) < self.segment_sizes[s]),
            staging_bytes=self.staging,
            names=frozenset(self.names),
        )


def deferred_route(layout: tensor_pb2.BucketSpec, stores: Callable[[str], bool] = stores_everything, *,
                   stored: bool = True) -> BucketRoute:
    """Where a deferred bucket's announced layout goes (validate_layout checked it against its
    candidates, which the store holds): its patches of this node's tensors, from staging. `stored`:
    as the plan's route (False: none of its candidates is this node's, nobody receives it)."""
    patched = tuple(PatchTarget(s.name, s.offset_bytes, s.size_bytes, s.encoding, s.patch_count, s.checksum.value)
                    for s in layout.tensors if stores(s.name))
    return BucketRoute(layout.size_bytes, None, (), (), tuple(p.name for p in patched), patched, stored=stored)


def derive_update_plan(
    *,
    plan: tensor_pb2.WeightPlan,
    plan_id: str,
    mode: int,
    allow_new_tensors: bool,
    tensors: dict[str, StoredTensor],
    segment_signatures: list[bytes],
    segment_sizes: list[int],
    layout_version: int,
    stores: Callable[[str], bool] = stores_everything,
) -> UpdatePlan:
    """Validate the plan against the store's layout and route every bucket (see the module docstring).
    `stores(name)`: whether this node holds that tensor (a server's --tensors subset)."""
    derivation = _Derivation(tensors, segment_signatures, segment_sizes, staged=mode == pb.UPDATE_MODE_STAGED,
                             allow_new=allow_new_tensors or not tensors, stores=stores)
    for index, bucket in enumerate(plan.buckets):
        derivation.bucket(index, bucket)
    return derivation.result(plan_id, layout_version)


class DerivedPlans:
    """The node store's derived plans, keyed by (plan id, layout version, mode): an entry can only
    match the layout it was derived from. Filled on commit only (caches change on success)."""

    def __init__(self, capacity: int = 8) -> None:
        self._entries: OrderedDict[tuple[str, int, bool], UpdatePlan] = OrderedDict()
        self._capacity = capacity

    def get(self, plan_id: str, layout_version: int, staged: bool) -> UpdatePlan | None:
        if not plan_id:
            return None
        key = (plan_id, layout_version, staged)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def remember(self, plan: UpdatePlan, layout_version: int) -> None:
        """Cache a committed update's plan under the layout the store has after the commit.

        A plan that added tensors derived new segments; after its commit the same plan id
        routes every bucket through those segments, so it is derived again then."""
        if not plan.plan_id or plan.new_segments:
            return
        key = (plan.plan_id, layout_version, plan.staged)
        self._entries[key] = plan
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
