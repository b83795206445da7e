"""The node's store: every tensor once, in host memory the server keeps, for every worker and engine.

    EMPTY / CONSISTENT / INCONSISTENT --prepare--> same state, an update SIZED
                 (derived from the plan, owners chosen, memory counted: waits for admission)
    SIZED --allocate--> UPDATING: new arenas and shadows exist; each owner gets its assignment
    UPDATING --commit--> CONSISTENT, or INCONSISTENT while a dirty tensor was not rewritten
    SIZED / UPDATING --abort--> as before (STAGED: the live bytes were never touched), or
                 INCONSISTENT (IN_PLACE: the tensors of every bucket whose bytes may have
                 reached the store are dirty)

One object owns the server's view of the store: its arenas (arenas.py), segments (one per
bucket of the plan that created them, so a bucket of the same layout is received straight
into its segment), tensors, dirty set, the generation that last wrote each tensor, and the
one update in flight. The update session, the intake and the local socket use it through
the methods below; nothing else changes it. Workers hold no store of their own: each gets,
per update, where the bytes of the buckets it owns go (common/ownership.py), as places in
the arenas they map. A worker's death therefore loses nothing, whatever its device.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

import torch

from weightsync.common import dtypes, patches
from weightsync.common.checksum import ws64
from weightsync.common.errors import FailedPrecondition, NotFound
from weightsync.common.layout import align_segment
from weightsync.common.ownership import bucket_owners
from weightsync.server.store.arenas import ARENA_MAX_BYTES, ArenaTable, HostArena, pack_segments
from weightsync.server.store.update_plan import (
    BucketRoute,
    DerivedPlans,
    StoredTensor,
    UpdatePlan,
    deferred_route,
    derive_update_plan,
)
from weightsync.server.store.writes import client_regions
from weightsync.v1 import local_pb2, tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


@dataclass(slots=True)
class Region:
    arena_id: int
    offset_bytes: int

    def at(self, offset: int) -> wpb.Region:
        return wpb.Region(arena_id=self.arena_id, offset_bytes=self.offset_bytes + offset)


@dataclass(slots=True)
class Segment:
    """One contiguous stretch of the store; STAGED updates write its shadow, swapped live at commit."""

    size_bytes: int
    live: Region
    shadow: Region | None
    signature: bytes
    """Fingerprint of the bucket this segment mirrors (the fast path); b"" if packed otherwise."""


class StorePhase(enum.Enum):
    SIZED = "sized"
    """Derived and sized: nothing allocated, the store untouched (waits for the server's admission)."""
    ALLOCATED = "allocated"
    """New arenas and shadows exist; the owners have their assignments."""


@dataclass(slots=True)
class StoreUpdate:
    """The one update in flight."""

    update_id: str
    plan: UpdatePlan
    owners: list[int]
    """Per bucket: the worker that receives it (common/ownership.py)."""
    workers: int
    needed_bytes: int
    """What allocate adds to the store: new segments and missing shadows."""
    phase: StorePhase = StorePhase.SIZED
    new_arenas: list[int] = field(default_factory=list)
    """The arenas of the update's new segments (released by an abort)."""
    touched: set[int] = field(default_factory=set)
    """Buckets whose bytes may have reached the store (an IN_PLACE abort marks their tensors dirty)."""
    laid_out: dict[int, BucketRoute] = field(default_factory=dict)
    """Deferred buckets announced so far: the route of the layout each was announced with."""
    client_written: set[int] = field(default_factory=set)
    """Buckets the SHM trainer writes straight into the store (place_for_client): its owner checks them there."""

    @property
    def staged(self) -> bool:
        return self.plan.staged

    def route(self, sequence: int) -> BucketRoute:
        """Where bucket `sequence` goes: the plan's route, or a deferred bucket's announced layout's."""
        laid_out = self.laid_out.get(sequence)
        return laid_out if laid_out is not None else self.plan.routes[sequence]

    @property
    def routes(self) -> list[BucketRoute]:
        return [self.route(k) for k in range(len(self.plan.routes))]

    @property
    def names(self) -> set[str]:
        """The tensors this update writes."""
        return set(self.plan.names).union(*(r.overwrites for r in self.laid_out.values()))


class NodeStore:
    """The node's store (see the module docstring)."""

    def __init__(self, tensor_filter: str = "") -> None:
        self.tensor_filter = tensor_filter
        """A regex (Python re.search) a tensor's name must match to be stored here; empty: every tensor."""
        self._filter = re.compile(tensor_filter) if tensor_filter else None
        self.arenas = ArenaTable()
        self.segments: list[Segment] = []
        self.tensors: dict[str, StoredTensor] = {}
        self.dirty: set[str] = set()
        """Tensors an aborted IN_PLACE update (or a failed commit) may have half-written."""
        self.written: dict[str, int] = {}
        """Tensor name -> generation of the commit that last wrote it (engines copy only what changed)."""
        self.layout_version = 0
        """Bumped whenever segments or tensors are added (derived plans are keyed by it)."""
        self.checksums: dict[str, int] = {}
        """WS64 of live tensors a patch proved (kept so the next patch is checked in O(changed));
        a tensor leaves it whenever anything but a patch writes it."""
        self.plans = DerivedPlans()
        self.update: StoreUpdate | None = None

    # -- reading -------------------------------------------------------------------------
    @property
    def state(self) -> int:
        if self.update is not None and self.update.phase is StorePhase.ALLOCATED:
            return pb.STORE_STATE_UPDATING
        if not self.tensors:
            return pb.STORE_STATE_EMPTY
        return pb.STORE_STATE_INCONSISTENT if self.dirty else pb.STORE_STATE_CONSISTENT

    @property
    def live_bytes(self) -> int:
        return sum(s.size_bytes for s in self.segments[: self._committed_segments])

    @property
    def held_bytes(self) -> int:
        """Host memory the store holds: every arena, shadows included."""
        return self.arenas.held_bytes

    @property
    def _committed_segments(self) -> int:
        update = self.update
        if update is not None and update.phase is StorePhase.ALLOCATED:
            return update.plan.first_new_segment
        return len(self.segments)

    def arena_ids(self) -> list[int]:
        return sorted(self.arenas.arenas)

    def arena(self, arena_id: int) -> HostArena:
        return self.arenas.arenas[arena_id]

    def readable(self) -> bool:
        """Whether engines may read the committed tensors (an UPDATING store's live bytes are the
        committed version: only STAGED updates leave it readable, the lease table holds IN_PLACE off)."""
        return bool(self.tensors) and not self.dirty

    def locations(self) -> list[local_pb2.StoredTensorLocation]:
        """Where every committed tensor's live bytes are, sorted by name (what an engine maps)."""
        out = []
        for name in sorted(self.tensors):
            t = self.tensors[name]
            live = self.segments[t.segment].live
            out.append(local_pb2.StoredTensorLocation(
                name=name, dtype=dtypes.from_torch(t.dtype), shape=list(t.shape), arena_id=live.arena_id,
                offset_bytes=live.offset_bytes + t.offset_bytes, size_bytes=t.size_bytes,
                written_generation=self.written.get(name, 0)))
        return out

    def live_arena_ids(self) -> list[int]:
        """The arenas that hold committed tensors' live bytes (what an engine maps), sorted."""
        return sorted({self.segments[t.segment].live.arena_id for t in self.tensors.values()})

    def view(self, name: str) -> torch.Tensor:
        """A committed tensor's live bytes, read-only, typed and shaped (the server's own reads)."""
        t = self.tensors[name]
        if t.size_bytes == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        live = self.segments[t.segment].live
        data = self.arena(live.arena_id).readable()
        start = live.offset_bytes + t.offset_bytes
        return data[start : start + t.size_bytes].view(t.dtype).view(t.shape)

    def checksum_targets(self, names: list[str]) -> tuple[list[str], list[str]]:
        """(The names to checksum (all when none asked), the names asked for that this node does not
        store by design (outside its --tensors subset)), both sorted; other unknown ones are NOT_FOUND."""
        asked = set(names)
        not_stored = sorted(n for n in asked if not self.stores(n))
        missing = sorted(n for n in asked if n not in self.tensors and self.stores(n))
        if missing:
            raise NotFound("TENSOR_NOT_FOUND", f"{len(missing)} tensor(s) not in the store, e.g. {missing[0]!r}",
                           count=len(missing), tensors=",".join(missing[:20]))
        return sorted(asked - set(not_stored) if names else self.tensors), not_stored

    def compute_checksums(self, names: list[str]) -> list[pb.TensorChecksum]:
        """WS64 of each committed tensor's live bytes. Runs in a thread; the caller pins the bytes (a lease)."""
        return [pb.TensorChecksum(name=name, dtype=dtypes.from_torch(self.tensors[name].dtype),
                                  shape=list(self.tensors[name].shape), checksum=tensor_pb2.Checksum(
                                      algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=ws64(self.view(name))))
                for name in names]

    # -- an update -------------------------------------------------------------------------
    def require_idle(self) -> None:
        if self.update is not None:
            raise FailedPrecondition("UPDATE_IN_PROGRESS", f"update {self.update.update_id} is still running",
                                     update_id=self.update.update_id)

    def stores(self, name: str) -> bool:
        """Whether this node holds tensor `name` (its --tensors subset)."""
        return self._filter is None or self._filter.search(name) is not None

    def prepare(self, *, update_id: str, plan: tensor_pb2.WeightPlan, plan_id: str, mode: int,
                allow_new_tensors: bool, workers: int) -> StoreUpdate:
        """Derive the update (or take it from the cache), choose its owners, count its memory: SIZED."""
        self.require_idle()
        staged = mode == pb.UPDATE_MODE_STAGED
        derived = self.plans.get(plan_id, self.layout_version, staged) or derive_update_plan(
            plan=plan, plan_id=plan_id, mode=mode, allow_new_tensors=allow_new_tensors, tensors=self.tensors,
            segment_signatures=[s.signature for s in self.segments],
            segment_sizes=[s.size_bytes for s in self.segments], layout_version=self.layout_version,
            stores=self.stores,
        )
        self._require_some_stored(plan, derived)
        missing_shadows = sum(align_segment(self.segments[i].size_bytes) for i in derived.shadowed_segments
                              if self.segments[i].shadow is None)
        owners = bucket_owners([r.size_bytes for r in derived.routes], workers, frozenset(derived.not_stored))
        self.update = StoreUpdate(update_id, derived, owners, workers, derived.new_segment_bytes + missing_shadows)
        return self.update

    def _require_some_stored(self, plan: tensor_pb2.WeightPlan, derived: UpdatePlan) -> None:
        """A subset node with nothing stored yet must get some of its tensors: otherwise its --tensors
        pattern matches none of the model's names, and it would commit an EMPTY store (engines would
        find nothing, verify nothing to compare) at every push. A node that holds tensors may sit out
        a partial update (a plan of the other stages' tensors)."""
        if self._filter is None or self.tensors or derived.names:
            return
        listed = list(dict.fromkeys(t.name for b in plan.buckets for t in b.tensors))  # a split tensor once
        raise FailedPrecondition(
            "TENSOR_FILTER_MATCHES_NOTHING",
            f"this node stores only the tensors matching --tensors {self.tensor_filter!r} and holds none yet, but "
            f"none of the plan's {len(listed)} tensors (e.g. {listed[0][:64]!r}) matches it: check the pattern "
            "against the model's names (re.search), or send this node its tensors",
            tensor_filter=self.tensor_filter[:256], tensors=len(listed), tensor=listed[0][:64],
        )

    async def allocate(self, update: StoreUpdate) -> list[HostArena]:
        """SIZED -> ALLOCATED: the arenas the update needs (missing shadows, new segments), none larger than
        ARENA_MAX_BYTES unless one segment is; returns them. All are made before any is used: a refusal
        (HOST_OUT_OF_MEMORY) releases those made and leaves the store as it was."""
        plan = update.plan
        missing = [i for i in plan.shadowed_segments if self.segments[i].shadow is None]
        shadow_sizes = [align_segment(self.segments[i].size_bytes) for i in missing]
        new_sizes = [align_segment(new.size_bytes) for new in plan.new_segments]
        created: list[HostArena] = []
        try:
            shadow_arenas = await self._arenas_for(shadow_sizes, created)
            new_arenas = await self._arenas_for(new_sizes, created)
        except BaseException:
            for arena in created:
                self.arenas.release(arena.arena_id)
            raise
        for arena, indexes in shadow_arenas:  # shadows stay once made: the next STAGED update reuses them
            cursor = 0
            for k in indexes:
                self.segments[missing[k]].shadow = Region(arena.arena_id, cursor)
                cursor += shadow_sizes[k]
        for arena, indexes in new_arenas:
            cursor = 0
            for k in indexes:
                new = plan.new_segments[k]
                self.segments.append(Segment(new.size_bytes, Region(arena.arena_id, cursor), None, new.signature))
                cursor += new_sizes[k]
        if new_arenas:
            update.new_arenas = [arena.arena_id for arena, _ in new_arenas]
            self.layout_version += 1
        update.phase = StorePhase.ALLOCATED
        return created

    async def _arenas_for(self, sizes: list[int], created: list[HostArena]) -> list[tuple[HostArena, list[int]]]:
        """One arena per pack of consecutive segments (pack_segments), each added to `created` once made."""
        arenas: list[tuple[HostArena, list[int]]] = []
        for indexes in pack_segments(sizes, ARENA_MAX_BYTES):
            arena = await self.arenas.allocate(sum(sizes[k] for k in indexes))
            created.append(arena)
            arenas.append((arena, indexes))
        return arenas

    def _place(self, update: StoreUpdate, segment: int, offset: int, *, writes: bool = True) -> wpb.Region:
        """Where bytes written at `offset` of `segment` land: its shadow for a STAGED update's shadowed
        segments, its live bytes otherwise (new segments are not live until commit anyway)."""
        s = self.segments[segment]
        if writes and update.staged and segment in update.plan.shadowed_segments:
            assert s.shadow is not None
            return s.shadow.at(offset)
        return s.live.at(offset)

    def assignment(self, update: StoreUpdate, worker: int, *, update_id: str, group_id: str) -> wpb.PrepareUpdateCommand:
        """What worker `worker` does in this update: its buckets, each byte's place, its shadow copies."""
        plan = update.plan
        command = wpb.PrepareUpdateCommand(update_id=update_id, group_id=group_id, staged=update.staged,
                                           largest_bucket_bytes=max((r.size_bytes for r in plan.routes), default=0))
        for sequence, route in enumerate(plan.routes):
            if update.owners[sequence] == worker:  # a deferred one: a placeholder its layout replaces
                self._owned(update, sequence, route, command.buckets.add())
        copies = list(plan.copied_to_shadow)
        for segment, owner in zip(copies, bucket_owners([self.segments[i].size_bytes for i in copies],
                                                        update.workers), strict=True):
            if owner == worker:
                s = self.segments[segment]
                assert s.shadow is not None
                command.shadow_copies.add(source=s.live.at(0), destination=s.shadow.at(0), size_bytes=s.size_bytes)
        return command

    def lay_out(self, update: StoreUpdate, sequence: int, layout: tensor_pb2.BucketSpec) -> wpb.OwnedBucket:
        """A deferred bucket is announced with this layout (validated against its candidates): where its
        bytes go, for its owner. From here on the update writes what it names."""
        route = deferred_route(layout, self.stores, stored=update.plan.routes[sequence].stored)
        update.laid_out[sequence] = route
        return self._owned(update, sequence, route, wpb.OwnedBucket())

    def _owned(self, update: StoreUpdate, sequence: int, route: BucketRoute, owned: wpb.OwnedBucket) -> wpb.OwnedBucket:
        """Every byte's place in the store, for the owner of bucket `sequence`."""
        owned.sequence, owned.size_bytes = sequence, route.size_bytes
        if route.receive_into is not None:
            owned.receive_into.CopyFrom(self._place(update, route.receive_into.segment,
                                                    route.receive_into.offset_bytes))
        for copy in route.copies:
            owned.copies.add(src_offset_bytes=copy.src_offset, size_bytes=copy.size_bytes,
                             dst=self._place(update, copy.segment, copy.dst_offset))
        for box in route.box_copies:
            owned.box_copies.add(name=box.name, src_offset_bytes=box.src_offset,
                                 tensor=self._place(update, box.segment, box.tensor_offset),
                                 dtype=dtypes.from_torch(box.dtype), shape=list(box.shape), offsets=list(box.offsets),
                                 sizes=list(box.sizes))
        for check in route.checks:
            owned.checks.add(name=check.name, offset_bytes=check.offset_bytes, size_bytes=check.size_bytes,
                             expected=check.expected)
        for target in route.patches:
            stored = self.tensors[target.name]
            patch = owned.patches.add(
                name=target.name, src_offset_bytes=target.src_offset, size_bytes=target.size_bytes,
                encoding=target.encoding, count=target.count, expected=target.expected,
                live=self._place(update, stored.segment, stored.offset_bytes, writes=False),
                destination=self._place(update, stored.segment, stored.offset_bytes),
                scatter_at_commit=self.scatters_at_commit(update, target.name),
                dtype=dtypes.from_torch(stored.dtype), shape=list(stored.shape))
            known = self.checksums.get(target.name)
            if target.box is not None:  # a patch of a box: its positions and its WS64 are the box's
                patch.box.SetInParent()  # set even for a 0-d tensor's box (no offsets, no sizes)
                patch.box.offsets.extend(target.box[0])
                patch.box.sizes.extend(target.box[1])
            elif known is not None:
                patch.live_checksum = known
        return owned

    def place_for_client(self, update: StoreUpdate, buckets) -> list[pb.StorePlace]:
        """The buckets (the plan's `buckets`) an SHM trainer writes straight into the store
        (server/store/writes.py), each with its regions at their places: a STAGED update's shadows, the live bytes
        otherwise. From now on each counts as touched: the trainer may write any of them at any time, so an
        IN_PLACE abort marks all of their tensors dirty."""
        places = []
        for sequence, (route, bucket) in enumerate(zip(update.plan.routes, buckets, strict=True)):
            regions = client_regions(route, bucket)
            if regions is None:
                continue
            place = pb.StorePlace(sequence=sequence)
            for region in regions:
                at = self._place(update, region.segment, region.segment_offset)
                place.regions.add(bucket_offset_bytes=region.bucket_offset, size_bytes=region.size_bytes,
                                  arena_id=at.arena_id, offset_bytes=at.offset_bytes)
            update.client_written.add(sequence)
            update.touched.add(sequence)
            places.append(place)
        return places

    def touched(self, update: StoreUpdate, sequence: int) -> None:
        """Bytes of bucket `sequence` may have reached the store."""
        update.touched.add(sequence)

    def commit(self, update: StoreUpdate, generation: int) -> None:
        """Publish: flip the shadows (STAGED), add the new tensors, clear what was rewritten. Synchronous:
        the caller publishes the version in the same step, so no lease sees one without the other."""
        assert update is self.update and update.phase is StorePhase.ALLOCATED
        plan = update.plan
        for index in plan.shadowed_segments:
            segment = self.segments[index]
            segment.live, segment.shadow = segment.shadow, segment.live  # type: ignore[assignment]
        for tensor in plan.new_tensors:
            self.tensors[tensor.name] = tensor
        names = update.names
        for name in names:
            self.checksums.pop(name, None)
            self.written[name] = generation
        for route in update.routes:
            for target in route.patches:  # proved by every owner's check: the next patch starts from it
                if target.box is None:  # a box's WS64 is not the tensor's
                    self.checksums[target.name] = target.expected
        self.dirty -= names
        self.plans.remember(plan, self.layout_version)
        self.update = None

    def abort(self, update: StoreUpdate, *, torn: set[str] = frozenset()) -> list[int]:
        """Undo what can be undone; returns the arenas released (workers unmap them). IN_PLACE bytes that
        may have been written, and `torn` (a commit that failed half-way), stay dirty."""
        assert update is self.update
        self.update = None
        if update.phase is StorePhase.SIZED:
            return []
        dirtied = set(torn)
        if not update.staged:
            for sequence in update.touched:
                dirtied.update(update.route(sequence).overwrites)
        dirtied &= set(self.tensors)
        self.dirty |= dirtied
        for name in dirtied:
            self.checksums.pop(name, None)
        released = []
        if update.new_arenas:
            del self.segments[update.plan.first_new_segment :]
            for arena_id in update.new_arenas:
                self.arenas.release(arena_id)
            released.extend(update.new_arenas)
            self.layout_version = update.plan.layout_version  # the layout is exactly what it was
        return released

    def patched_names(self, update: StoreUpdate) -> set[str]:
        return {t.name for r in update.routes for t in r.patches}

    def scatters_at_commit(self, update: StoreUpdate, name: str) -> bool:
        """A STAGED patch of a tensor whose segment this update does not shadow writes the live bytes: only
        at commit (its other patches go into the shadow copy at once)."""
        return update.staged and self.tensors[name].segment not in update.plan.shadowed_segments

    def live_writes_at_commit(self, update: StoreUpdate) -> bool:
        """Whether the commit writes live bytes (engines reading them must be held off)."""
        return any(self.scatters_at_commit(update, name) for name in self.patched_names(update))

    def close(self) -> None:
        self.arenas.close()


def owned_sequences(update: StoreUpdate, worker: int) -> list[int]:
    return [k for k, owner in enumerate(update.owners) if owner == worker]


__all__ = ["NodeStore", "StoreUpdate", "StorePhase", "owned_sequences", "patches"]
