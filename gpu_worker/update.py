"""One prepared weight update inside a worker.

Preparing checks the plan against the store and decides, per bucket, where
its bytes go:
  - fast path: the bucket's layout equals a segment, so the broadcast lands
    straight in the segment (IN_PLACE) or its shadow (STAGED), no copy;
  - general path: the broadcast lands in the worker's reused staging buffer,
    then each tensor is copied to its place.
New tensors (first update, or allow_new_tensors) get new segments that only
become visible on commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weightsync.common import dtypes
from weightsync.common.checksum import ws64
from weightsync.common.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from weightsync.common.layout import align_up, bucket_signature
from weightsync.gpu_worker.store import StoredTensor, WeightStore
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass(slots=True)
class TensorCopy:
    """General path: bytes [src_offset, src_offset+size) of the received bucket go to dst."""

    src_offset: int
    size_bytes: int
    dst: torch.Tensor


@dataclass(slots=True)
class BucketTarget:
    """Where one bucket's bytes go."""

    size_bytes: int
    direct: torch.Tensor | None
    copies: list[TensorCopy]
    checks: list[tuple[str, int, int, int]]
    """(tensor name, offset, size, expected WS64) for tensors whose spec carries a checksum."""
    existing_names: list[str]


@dataclass(slots=True)
class PreparedUpdate:
    update_id: str
    group_id: str
    mode: int
    targets: list[BucketTarget]
    first_new_segment: int
    pending: dict[str, StoredTensor]
    staged_segments: list[int]
    plan_names: set[str]
    staging_bytes: int
    next_sequence: int = 0
    started_through: int = -1
    received_bytes: int = 0
    failed: bool = False
    """A bucket failed verification: later buckets are received and dropped."""
    fast_path_count: int = field(default=0)


def available_memory_bytes(device: torch.device) -> int:
    """What the device can still hold (free CUDA memory, or MemAvailable on CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def prepare_update(
    store: WeightStore,
    command,  # worker_pb2.PrepareUpdateCommand
    staging: torch.Tensor | None,
    memory_limit_bytes: int,
) -> PreparedUpdate:
    """Validate against the store, allocate, and build per-bucket targets.

    Raises before allocating anything if a tensor does not match the store or
    the device cannot hold what the update needs.
    """
    plan: tensor_pb2.WeightPlan = command.plan
    staged = command.mode == pb.UPDATE_MODE_STAGED
    allow_new = command.allow_new_tensors or not store.tensors
    segment_by_signature = {
        s.signature: i for i, s in enumerate(store.segments) if s.signature is not None
    }

    # Pass 1: check every tensor against the store and size the allocations.
    new_bytes = 0
    shadow_bytes = 0
    staging_needed = 0
    fast: dict[int, int] = {}
    for index, bucket in enumerate(plan.buckets):
        all_new = True
        for spec in bucket.tensors:
            stored = store.tensors.get(spec.name)
            if stored is None:
                if not allow_new:
                    raise InvalidArgument(
                        "TENSOR_UNKNOWN",
                        f"tensor {spec.name!r} is not in the store; set allow_new_tensors to add it",
                        bucket=index,
                        tensor=spec.name,
                    )
                continue
            all_new = False
            want_dtype = dtypes.to_torch(spec.dtype, tensor=spec.name)
            if want_dtype != stored.dtype:
                raise InvalidArgument(
                    "TENSOR_DTYPE_MISMATCH",
                    f"tensor {spec.name!r} is {stored.dtype} in the store but {want_dtype} in the plan",
                    bucket=index,
                    tensor=spec.name,
                    store_dtype=stored.dtype,
                    plan_dtype=want_dtype,
                )
            if tuple(spec.shape) != stored.shape:
                raise InvalidArgument(
                    "TENSOR_SHAPE_MISMATCH",
                    f"tensor {spec.name!r} has shape {list(stored.shape)} in the store but "
                    f"{list(spec.shape)} in the plan",
                    bucket=index,
                    tensor=spec.name,
                    store_shape=list(stored.shape),
                    plan_shape=list(spec.shape),
                )
        segment = segment_by_signature.get(bucket_signature(bucket))
        if all_new:
            new_bytes += bucket.size_bytes
        elif segment is not None:
            fast[index] = segment
            if staged and store.segments[segment].shadow is None:
                shadow_bytes += bucket.size_bytes
        else:
            staging_needed = max(staging_needed, bucket.size_bytes)
            new_bytes += sum(
                align_up(s.size_bytes) for s in bucket.tensors if s.name not in store.tensors
            )
    if staged:
        touched = _touched_segments(store, plan, set(fast.values()))
        shadow_bytes += sum(
            store.segments[i].live.numel() for i in touched if store.segments[i].shadow is None
        )
    staging_have = 0 if staging is None else staging.numel()
    staging_alloc = staging_needed if staging_needed > staging_have else 0
    needed = new_bytes + shadow_bytes + staging_alloc
    available = available_memory_bytes(store.device)
    if memory_limit_bytes:
        available = min(available, memory_limit_bytes - store.live_bytes)
    if needed > available:
        raise ResourceExhausted(
            "DEVICE_OUT_OF_MEMORY",
            f"the update needs {needed} more bytes on {store.device} (new tensors {new_bytes}, "
            f"shadow {shadow_bytes}, staging {staging_alloc}) but only {max(available, 0)} are available",
            needed_bytes=needed,
            available_bytes=max(available, 0),
        )

    # Pass 2: allocate and build targets.
    first_new = len(store.segments)
    pending: dict[str, StoredTensor] = {}
    targets: list[BucketTarget] = []
    staged_segments: list[int] = []
    if staged:
        for i in sorted(_touched_segments(store, plan, set())):
            shadow = store.shadow_of(i)
            if i not in fast.values():
                shadow.copy_(store.segments[i].live)  # keep what this update does not rewrite
            staged_segments.append(i)
    for index, bucket in enumerate(plan.buckets):
        checks = [
            (s.name, s.offset_bytes, s.size_bytes, s.checksum.value)
            for s in bucket.tensors
            if s.checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_WS64
        ]
        existing = [s.name for s in bucket.tensors if s.name in store.tensors]
        if not existing:
            seg = store.allocate_segment(bucket.size_bytes, bucket_signature(bucket))
            for s in bucket.tensors:
                pending[s.name] = _stored(s, seg, s.offset_bytes)
            targets.append(BucketTarget(bucket.size_bytes, store.segments[seg].live, [], checks, []))
        elif index in fast:
            seg = fast[index]
            raw = store.shadow_of(seg) if staged else store.segments[seg].live
            targets.append(BucketTarget(bucket.size_bytes, raw, [], checks, existing))
        else:
            copies = []
            new_specs = [s for s in bucket.tensors if s.name not in store.tensors]
            new_seg = -1
            if new_specs:
                layout, cursor = [], 0
                for s in new_specs:
                    start = align_up(cursor)
                    layout.append((s, start))
                    cursor = start + s.size_bytes
                new_seg = store.allocate_segment(align_up(cursor), None)
                for s, start in layout:
                    pending[s.name] = _stored(s, new_seg, start)
            for s in bucket.tensors:
                if s.name in pending:
                    stored = pending[s.name]
                    raw = store.segments[stored.segment].live
                else:
                    stored = store.tensors[s.name]
                    raw = store.segments[stored.segment].shadow if staged else store.segments[stored.segment].live
                    assert raw is not None
                dst = raw[stored.offset_bytes : stored.offset_bytes + stored.size_bytes]
                copies.append(TensorCopy(s.offset_bytes, s.size_bytes, dst))
            targets.append(BucketTarget(bucket.size_bytes, None, copies, checks, existing))
    return PreparedUpdate(
        update_id=command.update_id,
        group_id=command.group_id,
        mode=command.mode,
        targets=targets,
        first_new_segment=first_new,
        pending=pending,
        staged_segments=staged_segments,
        plan_names={s.name for b in plan.buckets for s in b.tensors},
        staging_bytes=staging_needed,
        fast_path_count=len(fast) + sum(1 for t in targets if t.direct is not None and not t.existing_names),
    )


@dataclass(frozen=True, slots=True)
class FastPlan:
    """What prepare_update derived from a plan whose every bucket lands straight in
    an existing segment: valid while the store's layout_version is unchanged."""

    plan_id: str
    layout_version: int
    buckets: tuple[tuple[int, int, tuple[tuple[str, int, int, int], ...], tuple[str, ...]], ...]
    """(segment, size_bytes, checks, existing names) per bucket."""
    plan_names: frozenset[str]


def remember_fast_plan(store: WeightStore, plan_id: str, update: PreparedUpdate) -> FastPlan | None:
    """A FastPlan for this update, if every bucket took the fast path into an existing segment."""
    if not plan_id or update.pending or not all(t.direct is not None and t.existing_names for t in update.targets):
        return None
    by_tensor = {id(s.live): i for i, s in enumerate(store.segments)} | {
        id(s.shadow): i for i, s in enumerate(store.segments) if s.shadow is not None
    }
    buckets = []
    for target in update.targets:
        segment = by_tensor.get(id(target.direct))
        if segment is None:
            return None
        buckets.append((segment, target.size_bytes, tuple(target.checks), tuple(target.existing_names)))
    return FastPlan(plan_id, store.layout_version, tuple(buckets), frozenset(update.plan_names))


def prepare_from_fast_plan(store: WeightStore, command, fast: FastPlan) -> PreparedUpdate | None:
    """O(buckets) prepare for a plan seen before; None when the full path is needed."""
    if command.plan_id != fast.plan_id or store.layout_version != fast.layout_version:
        return None
    staged = command.mode == pb.UPDATE_MODE_STAGED
    if staged and any(store.segments[seg].shadow is None for seg, *_ in fast.buckets):
        return None  # shadows to allocate: the full path checks memory first
    targets = [
        BucketTarget(size, store.shadow_of(seg) if staged else store.segments[seg].live, [], list(checks), list(names))
        for seg, size, checks, names in fast.buckets
    ]
    return PreparedUpdate(
        update_id=command.update_id,
        group_id=command.group_id,
        mode=command.mode,
        targets=targets,
        first_new_segment=len(store.segments),
        pending={},
        staged_segments=sorted({seg for seg, *_ in fast.buckets}) if staged else [],
        plan_names=set(fast.plan_names),
        staging_bytes=0,
        fast_path_count=len(targets),
    )


def _touched_segments(store: WeightStore, plan: tensor_pb2.WeightPlan, exclude: set[int]) -> set[int]:
    touched = {
        store.tensors[s.name].segment
        for b in plan.buckets
        for s in b.tensors
        if s.name in store.tensors
    }
    return touched - exclude


def _stored(spec: tensor_pb2.TensorSpec, segment: int, offset: int) -> StoredTensor:
    return StoredTensor(
        name=spec.name,
        dtype=dtypes.to_torch(spec.dtype, tensor=spec.name),
        shape=tuple(spec.shape),
        segment=segment,
        offset_bytes=offset,
        size_bytes=spec.size_bytes,
    )


def verify_bucket(
    sequence: int, target: BucketTarget, received: torch.Tensor, bucket_checksum: tensor_pb2.Checksum
) -> None:
    """DATA_LOSS naming the bucket or tensor whose bytes do not match."""
    if bucket_checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_WS64:
        actual = ws64(received)
        if actual != bucket_checksum.value:
            raise DataLoss(
                "BUCKET_CHECKSUM_MISMATCH",
                f"bucket {sequence} arrived with WS64 {actual:#018x}, expected {bucket_checksum.value:#018x}",
                bucket=sequence,
                expected=f"{bucket_checksum.value:#018x}",
                actual=f"{actual:#018x}",
            )
    elif bucket_checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED:
        raise InvalidArgument(
            "CHECKSUM_ALGORITHM_UNKNOWN",
            f"bucket {sequence} has unknown checksum algorithm {bucket_checksum.algorithm}",
            bucket=sequence,
        )
    for name, offset, size, expected in target.checks:
        actual = ws64(received[offset : offset + size])
        if actual != expected:
            raise DataLoss(
                "TENSOR_CHECKSUM_MISMATCH",
                f"tensor {name!r} in bucket {sequence} arrived with WS64 {actual:#018x}, "
                f"expected {expected:#018x}",
                bucket=sequence,
                tensor=name,
            )


def commit_update(store: WeightStore, update: PreparedUpdate) -> None:
    """Publish: flip shadows (STAGED), add new tensors, clear what was rewritten."""
    if update.next_sequence != len(update.targets):
        raise FailedPrecondition(
            "BUCKETS_MISSING",
            f"commit after {update.next_sequence} of {len(update.targets)} buckets",
            received=update.next_sequence,
            expected=len(update.targets),
        )
    for index in update.staged_segments:
        segment = store.segments[index]
        segment.live, segment.shadow = segment.shadow, segment.live
    if update.pending:
        store.tensors.update(update.pending)
        store.layout_version += 1
    store.dirty -= update.plan_names
    store.updating = False


def abort_update(store: WeightStore, update: PreparedUpdate) -> None:
    """Undo what can be undone; IN_PLACE writes mark their tensors dirty."""
    if update.mode == pb.UPDATE_MODE_IN_PLACE:
        for target in update.targets[: update.started_through + 1]:
            store.dirty.update(target.existing_names)
    store.drop_segments_from(update.first_new_segment)
    store.updating = False
