"""Which plan a push sends, and where its tensors come from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from weightsync.client.buckets.packing import TensorSource
from weightsync.client.buckets.plan_cache import CachedPlan, PlanCache, fingerprint
from weightsync.client.buckets.planning import PlannedBucket, build_plan, check_tensors, plan_proto
from weightsync.client.delta.base import DeltaChoice
from weightsync.client.delta.deferred import DeferredCompare
from weightsync.common import dtypes
from weightsync.common.checksum import to_proto
from weightsync.common.plan_id import plan_id_of


@dataclass(frozen=True, slots=True)
class PlanChoice:
    cached: CachedPlan
    """The plan as it will be cached once committed (and its content id)."""
    planned: list[PlannedBucket]
    """Its buckets, bound to this push's tensors where their bytes can be sent as they lie."""
    source: TensorSource

    @property
    def total_bytes(self) -> int:
        return sum(b.spec.size_bytes for b in self.planned)


def choose_plan(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    plans: PlanCache,
    *,
    may_stream: bool,
    bucket_size_bytes: int,
    zero_copy_min_bytes: int,
) -> PlanChoice:
    """An iterator is streamed against the last committed plan when `may_stream` (STAGED, no new
    tensors: a divergence aborts with the committed weights intact); anything else is materialised
    and checked first, then planned, or matched to the cached plan when its layout repeats."""
    last = plans.last
    if not isinstance(named_tensors, Mapping) and may_stream and last is not None:
        return PlanChoice(last, last.unbound(), TensorSource(None, iter(named_tensors)))
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    check_tensors(items)
    if not items:
        raise ValueError("nothing to push: no tensors")
    key = fingerprint(items, bucket_size_bytes, zero_copy_min_bytes)
    cached = plans.lookup(key)
    if cached is not None:
        planned = cached.rebind(dict(items))
    else:
        planned = build_plan(items, bucket_size_bytes, zero_copy_min_bytes)
        plan = plan_proto(planned)
        cached = CachedPlan.of(planned, key, plan, plan_id_of(plan))
    return PlanChoice(cached, planned, TensorSource(dict(items), None))


MIN_PATCH_BUCKET_BYTES = 256 << 10
"""patched_plan does not cut the patches into buckets smaller than this (each costs an announcement)."""


def split_patches(patches: list[tuple[str, torch.Tensor]], buckets: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The patches in `buckets` shares of about equal bytes (fewer where that would leave a share under
    MIN_PATCH_BUCKET_BYTES): largest first, each to the share holding the fewest bytes so far; each
    share keeps the patches' order."""
    total = sum(data.numel() for _, data in patches)
    count = max(1, min(buckets, total // MIN_PATCH_BUCKET_BYTES))
    held = [0] * count
    where: dict[str, int] = {}
    for name, data in sorted(patches, key=lambda p: -p[1].numel()):
        share = held.index(min(held))
        where[name] = share
        held[share] += data.numel()
    return [s for s in ([p for p in patches if where[p[0]] == k] for k in range(count)) if s]


def patched_plan(items: list[tuple[str, torch.Tensor]], delta: DeltaChoice, *, bucket_size_bytes: int,
                 zero_copy_min_bytes: int, patch_buckets: int = 1,
                 deferred: DeferredCompare | None = None) -> PlanChoice:
    """The plan of a push that sends patches: unchanged tensors left out, each patch as its bytes
    (tensor.proto, TensorEncoding) under its tensor's name, dtype and shape. Never cached: its
    counts and checksums are this step's.

    The tensors sent whole come first, planned as a dense push would plan them; then the patches,
    shared out into `patch_buckets` buckets of about equal bytes where they are large enough
    (split_patches; a patch is never split): the owners are balanced by bytes (common/ownership.py),
    so with one bucket per worker every worker of a node checks and applies its share at once. At
    1% changed a model's patches fit one bucket many times over, and one worker applied all of
    them while the others waited. Exactly one per worker, not more: a worker receives its next
    bucket only once it applied the one before, and a sender that waits on that apply takes it for
    a slow link (LinkTimings.link_timed).

    `deferred`: the tensors DeltaChoice.deferred lists go last, in its deferred buckets, each
    laid out once compared (client/delta/deferred.py; the source hands out their layouts)."""
    later = {name for group in deferred.groups for name in group.names} if deferred is not None else set()
    whole = [(name, tensor) for name, tensor in items
             if name not in delta.unchanged and name not in delta.patches and name not in later]
    patches = [(name, delta.patches[name].data) for name, _ in items if name in delta.patches]
    planned = build_plan(whole, bucket_size_bytes, zero_copy_min_bytes) if whole else []
    for share in split_patches(patches, patch_buckets):
        planned += build_plan(share, bucket_size_bytes, zero_copy_min_bytes=0)  # packed: one bucket a share
    first_deferred = len(planned)
    if deferred is not None:
        shapes = dict(items)
        planned += [PlannedBucket(group.spec(shapes), None) for group in deferred.groups]
    sent = whole + patches
    originals = dict(items)
    for bucket in planned:
        for spec in bucket.spec.tensors:
            patch = delta.patches.get(spec.name)
            if patch is None:
                continue
            original = originals[spec.name]
            spec.dtype = dtypes.from_torch(original.dtype)
            del spec.shape[:]
            spec.shape.extend(original.shape)
            spec.encoding = patch.encoding
            spec.patch_count = patch.count
            spec.checksum.CopyFrom(to_proto(patch.checksum))
    plan = plan_proto(planned)
    source = TensorSource(dict(sent), None, deferred=(deferred, first_deferred) if deferred is not None else None)
    return PlanChoice(CachedPlan.of(planned, (), plan, plan_id_of(plan)), planned, source)
