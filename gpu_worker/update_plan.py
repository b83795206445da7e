"""What an update will do to a store, derived from its plan before any byte moves.

`derive_update_plan` checks every tensor of the plan against the store and
decides, for each bucket, where its bytes go:
  - straight into an existing segment whose layout equals the bucket (the fast
    path): the live side for IN_PLACE, the shadow side for STAGED;
  - straight into a new segment, when every tensor of the bucket is new (the
    first update, or allow_new_tensors);
  - into the staging buffer, then one copy per tensor (the general path).

It allocates nothing and reads nothing but the store's layout, so the result
depends only on (plan id, layout version, mode): the worker keeps it in its
one PlanCache and reuses it while the layout holds. Memory needs are computed
separately (`needed_bytes`), against the store as it is at prepare time.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from weightsync.common import dtypes, patches
from weightsync.common.errors import InvalidArgument
from weightsync.common.layout import align_up
from weightsync.gpu_worker.memory import align_segment
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
class PatchTarget:
    """A tensor that arrives as a patch (tensor.proto, TensorEncoding): bucket bytes
    [src_offset, +size) hold it; it overwrites elements of the stored tensor `name`."""

    name: str
    src_offset: int
    size_bytes: int
    encoding: int
    count: int
    expected: int
    """WS64 of the whole tensor once patched."""


@dataclass(frozen=True, slots=True)
class BucketRoute:
    """Where one bucket's bytes go."""

    size_bytes: int
    receive_into_segment: int | None
    """Receive the broadcast straight into this segment (existing or new); None: staging + copies."""
    copies: tuple[TensorCopy, ...]
    checks: tuple[TensorCheck, ...]
    overwrites: tuple[str, ...]
    """Tensors already in the store that this bucket rewrites (IN_PLACE abort marks them dirty)."""
    patches: tuple[PatchTarget, ...] = ()
    """Tensors of this bucket sent as patches: never copied whole, never shadowed."""


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
        return sum(1 for r in self.routes if r.receive_into_segment is not None)

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


def _checks(bucket: tensor_pb2.BucketSpec) -> tuple[TensorCheck, ...]:
    """Dense tensors with a WS64 (a patch's checksum is of the patched tensor: see PatchTarget)."""
    return tuple(
        TensorCheck(s.name, s.offset_bytes, s.size_bytes, s.checksum.value)
        for s in bucket.tensors
        if s.checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_WS64 and not patches.is_patch(s.encoding)
    )


def _new_tensor(spec: tensor_pb2.TensorSpec, segment: int, offset: int) -> StoredTensor:
    return StoredTensor(
        spec.name, dtypes.to_torch(spec.dtype, tensor=spec.name), tuple(spec.shape), segment, offset, spec.size_bytes
    )


def derive_update_plan(
    *,
    plan: tensor_pb2.WeightPlan,
    plan_id: str,
    mode: int,
    allow_new_tensors: bool,
    tensors: dict[str, StoredTensor],
    segment_signatures: list[bytes],
    layout_version: int,
) -> UpdatePlan:
    """Validate the plan against the store's layout and route every bucket (see the module docstring)."""
    staged = mode == pb.UPDATE_MODE_STAGED
    allow_new = allow_new_tensors or not tensors
    by_signature = {sig: i for i, sig in enumerate(segment_signatures) if sig}
    first_new = len(segment_signatures)
    new_segments: list[NewSegment] = []
    new_tensors: list[StoredTensor] = []
    routes: list[BucketRoute] = []
    touched: set[int] = set()
    rewritten: set[int] = set()
    staging = 0
    names: set[str] = set()
    for index, bucket in enumerate(plan.buckets):
        existing: list[str] = []
        patched: list[PatchTarget] = []
        for spec in bucket.tensors:
            names.add(spec.name)
            stored = tensors.get(spec.name)
            if patches.is_patch(spec.encoding):
                if stored is None:
                    raise InvalidArgument("TENSOR_UNKNOWN", f"tensor {spec.name!r} is sent as a patch but is not in "
                                          "the store: send it dense", bucket=index, tensor=spec.name)
                _check_against_store(index, spec, stored)
                patched.append(PatchTarget(spec.name, spec.offset_bytes, spec.size_bytes, spec.encoding,
                                           spec.patch_count, spec.checksum.value))
                continue  # its segment is neither copied nor shadowed: the patch is scattered (store.py)
            if stored is None:
                if not allow_new:
                    raise InvalidArgument(
                        "TENSOR_UNKNOWN",
                        f"tensor {spec.name!r} is not in the store; set allow_new_tensors to add it",
                        bucket=index, tensor=spec.name,
                    )
                continue
            _check_against_store(index, spec, stored)
            existing.append(spec.name)
            touched.add(stored.segment)
        signature = bucket_signature(bucket)
        checks = _checks(bucket)
        if patched:
            routes.append(_general_route(bucket, tensors, first_new, new_segments, new_tensors, checks, existing,
                                         tuple(patched)))
            staging = max(staging, bucket.size_bytes)
            continue
        if not existing:  # every tensor is new: the bucket defines a segment of its own
            segment = first_new + len(new_segments)
            new_segments.append(NewSegment(bucket.size_bytes, signature))
            new_tensors.extend(_new_tensor(s, segment, s.offset_bytes) for s in bucket.tensors)
            routes.append(BucketRoute(bucket.size_bytes, segment, (), checks, ()))
            continue
        segment = by_signature.get(signature)
        if segment is not None and all(tensors[n].segment == segment for n in existing):
            rewritten.add(segment)
            routes.append(BucketRoute(bucket.size_bytes, segment, (), checks, tuple(existing)))
            continue
        routes.append(_general_route(bucket, tensors, first_new, new_segments, new_tensors, checks, existing, ()))
        staging = max(staging, bucket.size_bytes)
    shadowed = tuple(sorted(touched | rewritten)) if staged else ()
    return UpdatePlan(
        plan_id=plan_id,
        layout_version=layout_version,
        staged=staged,
        routes=tuple(routes),
        first_new_segment=first_new,
        new_segments=tuple(new_segments),
        new_tensors=tuple(new_tensors),
        shadowed_segments=shadowed,
        copied_to_shadow=tuple(s for s in shadowed if s not in rewritten),
        staging_bytes=staging,
        names=frozenset(names),
    )


def _general_route(bucket: tensor_pb2.BucketSpec, tensors: dict[str, StoredTensor], first_new: int,
                   new_segments: list[NewSegment], new_tensors: list[StoredTensor], checks: tuple[TensorCheck, ...],
                   existing: list[str], patched: tuple[PatchTarget, ...]) -> BucketRoute:
    """Staging, then one copy per dense tensor (new tensors of the bucket get one packed segment
    of their own); patches are scattered from staging."""
    copies: list[TensorCopy] = []
    fresh = [s for s in bucket.tensors if s.name not in tensors]
    fresh_segment = first_new + len(new_segments)
    cursor = 0
    for spec in fresh:
        start = align_up(cursor)
        new_tensors.append(_new_tensor(spec, fresh_segment, start))
        copies.append(TensorCopy(spec.offset_bytes, spec.size_bytes, fresh_segment, start))
        cursor = start + spec.size_bytes
    if fresh:
        new_segments.append(NewSegment(align_up(cursor), b""))
    for spec in bucket.tensors:
        stored = tensors.get(spec.name)
        if stored is not None and not patches.is_patch(spec.encoding):
            copies.append(TensorCopy(spec.offset_bytes, spec.size_bytes, stored.segment, stored.offset_bytes))
    overwrites = (*existing, *(p.name for p in patched))
    return BucketRoute(bucket.size_bytes, None, tuple(copies), checks, overwrites, patched)


class PlanCache:
    """The worker's derived plans, keyed by (plan id, layout version, mode): an entry can only
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
