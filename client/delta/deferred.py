"""Comparing while sending: a push's patches in deferred buckets (BucketSpec.deferred).

A patched push used to compare every tensor before Begin (the plan carried each patch's size,
count and WS64), so it cost the comparison plus the transfer plus the owners' apply. Here the
plan lists, per deferred bucket, the tensors whose samples predict a patch (its candidates) and
how many bytes their patches may take (its capacity); a thread compares them group by group
(DeltaBase.compare_deferred) from before Begin on, and each group's layout goes with its
BucketStart as soon as it is compared, while the groups after it are still being compared and
the ones before it are being applied by their owners.

    group k:   compare (both copies read, the copy brought up to date) -> layout k
    sender:    ... bucket k-1 on the wire -> waits for layout k -> bucket k announced with it

A group whose patches outgrow its capacity (the samples were far off), or one with a tensor
whose patch would be larger than the tensor, cannot be sent: PatchesOverflow, and the SDK
sends the update dense instead.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from weightsync.client.delta.base import DeltaBase, DeltaChoice, TensorPatch
from weightsync.client.errors import WeightSyncClientError
from weightsync.common import dtypes
from weightsync.common.checksum import to_proto
from weightsync.common.layout import align_up
from weightsync.common.logging import get_logger
from weightsync.common.plan_validation import MIN_BUCKET_BYTES
from weightsync.v1 import tensor_pb2

log = get_logger("weightsync.client.delta")

ROOM_PER_PATCH_BELOW = 2.0
"""A candidate's room in its bucket, in multiples of the patch it would still be sent as
(Worth.patch_below of its dense bytes), at most the tensor's own bytes: the samples' estimate
may be off that much for the bucket as a whole before the push goes dense instead."""
DEFERRED_GROUPS = 8
"""Candidates are cut into about this many deferred buckets (more where a node has more
workers): the first waits for its comparison alone, the others overlap the earlier ones' transfer
and apply. Each bucket costs an announcement (~1 ms on the benchmark machine)."""
MIN_GROUP_BYTES = 16 << 20
"""Dense bytes of candidates below which a group is not cut again."""
WAIT_SECONDS = 3600.0
"""A comparison reads memory: it ends; the bound only keeps a stuck thread from hanging a push."""


def compare_threads() -> int:
    """Threads of the deferred comparison: torch's but one, which the sender keeps busy (packing,
    framing, the transfers' own threads)."""
    return max(1, torch.get_num_threads() - 1)


class PatchesOverflow(WeightSyncClientError):
    """A deferred bucket's patches do not fit it: the update goes dense."""


@dataclass(frozen=True, slots=True)
class DeferredGroup:
    """One deferred bucket: its candidates, in push order, and the most its layout may take."""

    names: tuple[str, ...]
    capacity: int

    def spec(self, shapes: dict[str, torch.Tensor]) -> tensor_pb2.BucketSpec:
        """The plan's bucket: the candidates by name, dtype and shape, PATCH_XOR, nothing laid out."""
        bucket = tensor_pb2.BucketSpec(size_bytes=self.capacity, deferred=True)
        for name in self.names:
            tensor = shapes[name]
            bucket.tensors.add(name=name, dtype=dtypes.from_torch(tensor.dtype), shape=list(tensor.shape),
                               encoding=tensor_pb2.TENSOR_ENCODING_PATCH_XOR)
        return bucket


def room_for(tensor: torch.Tensor, patch_below: float) -> int:
    dense = tensor.numel() * tensor.element_size()
    return align_up(max(MIN_BUCKET_BYTES, min(dense, int(ROOM_PER_PATCH_BELOW * patch_below * dense))))


def deferred_groups(choice: DeltaChoice, *, groups: int, bucket_size_bytes: int) -> list[DeferredGroup]:
    """Cut the candidates, in order, into about `groups` of equal dense bytes (none under
    MIN_GROUP_BYTES unless it is the last), each within bucket_size_bytes of room."""
    dense = sum(t.numel() * t.element_size() for _, t in choice.deferred)
    target = max(MIN_GROUP_BYTES, -(-dense // max(1, groups)))
    out: list[DeferredGroup] = []
    names: list[str] = []
    held = room = 0
    for name, tensor in choice.deferred:
        size, need = tensor.numel() * tensor.element_size(), room_for(tensor, choice.patch_below[name])
        if names and (held + size > target or room + need > bucket_size_bytes):
            out.append(DeferredGroup(tuple(names), room))
            names, held, room = [], 0, 0
        names.append(name)
        held += size
        room += min(need, bucket_size_bytes)
    if names:
        out.append(DeferredGroup(tuple(names), room))
    return out


@dataclass(frozen=True, slots=True)
class Layout:
    """A compared group: its BucketStart.layout, and the bytes of each patch it holds."""

    spec: tensor_pb2.BucketSpec
    patches: dict[str, TensorPatch]


class DeferredCompare:
    """Compares the groups in order, in a thread of its own, from start() on (see the module docstring)."""

    def __init__(self, delta: DeltaBase, choice: DeltaChoice, groups: list[DeferredGroup]) -> None:
        self._delta = delta
        self._tensors = dict(choice.deferred)
        self.groups = groups
        self._results: list[Future[Layout]] = [Future() for _ in groups]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightsync-delta-compare", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def layout(self, group: int) -> Layout:
        """Group `group`'s layout, once compared; PatchesOverflow if it cannot be sent."""
        return self._results[group].result(timeout=WAIT_SECONDS)

    def stop(self) -> None:
        """No further group is compared; waits for the one under way (it writes the kept copy)."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(WAIT_SECONDS)

    def _run(self) -> None:
        for index, group in enumerate(self.groups):
            if self._stop.is_set():
                self._fail_from(index, WeightSyncClientError("the push stopped before this group was compared"))
                return
            try:
                found = self._delta.compare_deferred([(name, self._tensors[name]) for name in group.names],
                                                     compare_threads())
                self._results[index].set_result(self._lay_out(index, group, found))
            except BaseException as error:  # noqa: BLE001 - handed to the sender, which aborts the push
                self._fail_from(index, error)
                return

    def _fail_from(self, index: int, error: BaseException) -> None:
        for result in self._results[index:]:
            result.set_exception(error)

    def _lay_out(self, index: int, group: DeferredGroup, found: dict) -> Layout:
        spec = tensor_pb2.BucketSpec()
        patches: dict[str, TensorPatch] = {}
        cursor = 0
        for name in group.names:
            patch = found[name]
            if patch is None:
                raise PatchesOverflow(f"tensor {name!r}: its patch would be larger than the tensor")
            if patch == "unchanged":
                continue  # left out of the layout: its generation stays
            tensor = self._tensors[name]
            start = align_up(cursor)
            size = patch.data.numel()
            spec.tensors.add(name=name, dtype=dtypes.from_torch(tensor.dtype), shape=list(tensor.shape),
                             offset_bytes=start, size_bytes=size, encoding=patch.encoding, patch_count=patch.count,
                             checksum=to_proto(patch.checksum))
            patches[name] = patch
            cursor = start + size
        spec.size_bytes = max(cursor, MIN_BUCKET_BYTES) if cursor else 0
        if spec.size_bytes > group.capacity:
            raise PatchesOverflow(f"deferred bucket {index}: its patches take {spec.size_bytes} bytes, more than the "
                                  f"{group.capacity} it was planned with")
        return Layout(spec, patches)
