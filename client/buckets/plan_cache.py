"""The SDK's one plan cache.

Planning a push costs a pass over every tensor; sending its plan costs a message
of up to tens of MB. Both are skipped while the tensors' layout repeats:

  - the plan is looked up by the tensors' fingerprint (names, dtypes, shapes,
    strides, devices, and which tensors share a storage at which offsets) and
    rebound to the new tensors, which holds no tensor between pushes. Where the
    storages lie is not in it: a trainer that casts its weights afresh every
    step (new tensors, the same layout) plans once;
  - the plan is sent by its content id (weightsync.common.plan_id) to servers
    that committed it before (each server's record keeps the ids: client/servers/records.py).

The cache changes on commit only. A push that fails leaves it as it was, so
the next push can neither reuse a layout the servers never committed nor name
a plan by an id the servers do not hold under that content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.client.buckets.planning import PlannedBucket, storage_bytes
from weightsync.v1 import tensor_pb2


def fingerprint(named: Sequence[tuple[str, torch.Tensor]], bucket_size_bytes: int, zero_copy_min_bytes: int) -> tuple:
    """Everything a plan depends on: names, dtypes, shapes, strides, devices, and the storage
    layout as planning sees it (which tensors share a storage, by the same test as its flat runs,
    and where in it they start), never an address: the plan binds bytes by tensor name and
    storage offset (CachedPlan.rebind)."""
    storages: dict[tuple[int, torch.device], int] = {}
    return (
        bucket_size_bytes,
        zero_copy_min_bytes,
        tuple(
            (name, t.dtype, tuple(t.shape), tuple(t.stride()), t.device, t.storage_offset(),
             storages.setdefault((t.untyped_storage().data_ptr(), t.device), len(storages)))
            for name, t in named
        ),
    )


@dataclass(frozen=True, slots=True)
class FlatSource:
    """Where a flat bucket's bytes sit: a byte range of the storage of tensor `name`."""

    name: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """A committed plan, holding no tensor."""

    fingerprint: tuple
    plan: tensor_pb2.WeightPlan
    plan_id: str
    flat: tuple[FlatSource | None, ...]
    """Per bucket: where its bytes already are (flat buckets), or None (packed)."""

    @staticmethod
    def of(planned: Sequence[PlannedBucket], key: tuple, plan: tensor_pb2.WeightPlan, plan_id: str) -> CachedPlan:
        flat = tuple(
            None if p.flat_source is None else FlatSource(
                p.spec.tensors[0].name, p.flat_source.storage_offset(),
                p.flat_source.storage_offset() + p.flat_source.numel(),
            )
            for p in planned
        )
        return CachedPlan(key, plan, plan_id, flat)

    def rebind(self, tensors: dict[str, torch.Tensor]) -> list[PlannedBucket]:
        """The plan over these tensors (same layout: same fingerprint)."""
        return [
            PlannedBucket(spec, None if where is None else storage_bytes(tensors[where.name])[where.start : where.end])
            for spec, where in zip(self.plan.buckets, self.flat, strict=True)
        ]

    def unbound(self) -> list[PlannedBucket]:
        """The plan with no tensor attached (a streamed push packs everything)."""
        return [PlannedBucket(spec, None) for spec in self.plan.buckets]


@dataclass(slots=True)
class PlanCache:
    """The last committed plan (which servers hold which plan ids: servers.records.ServerState.plan_ids)."""

    last: CachedPlan | None = None

    def lookup(self, key: tuple) -> CachedPlan | None:
        return self.last if self.last is not None and self.last.fingerprint == key else None

    def committed(self, plan: CachedPlan) -> None:
        self.last = plan
