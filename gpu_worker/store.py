"""The weight store of one worker, and the lifecycle of the one update in flight.

    EMPTY / CONSISTENT / INCONSISTENT --prepare_update--> same state, update SIZED
                      (derived and sized, nothing allocated: waits for admission)
    SIZED --allocate_update--> UPDATING, update RECEIVING
    RECEIVING --receive_broadcast / receive_from_ingress (k = 0..n-1)--> RECEIVING,
                      or FAILED when bucket k fails its checks (every later bucket
                      announced is received and dropped, so no sender hangs)
    RECEIVING --commit_update (all n buckets in)--> CONSISTENT, or INCONSISTENT
                      while a dirty tensor was not rewritten
    SIZED / RECEIVING / FAILED --abort_update--> as before (STAGED: the live bytes
                      were never touched), or INCONSISTENT (IN_PLACE: the tensors of
                      every bucket that started to arrive are dirty)

Only this module changes the store: segments, tensors, shadows, the dirty set
and the update in flight (one StoreUpdate, from prepare to commit or abort)
move in these methods and nowhere else; the worker's command loop only
dispatches to them. Tensors live in segments (usually one per bucket of the
plan that created them); segments live in arenas (see memory.py), so the
whole store can be described by a StoreManifest and mapped again after the
worker process died.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from weightsync.common import dtypes
from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.common.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    WeightSyncError,
)
from weightsync.common.patches import DecodedPatch, apply_patch, decode_patch, ws64_after_patch
from weightsync.gpu_worker.bucket_checks import (
    arm_tail,
    check_tail,
    check_tail_announced,
    restore_tail,
    verify_bucket,
)
from weightsync.gpu_worker.memory import (
    Arena,
    align_segment,
    allocate_arena,
    map_arena,
    release_cached_device_memory,
    synchronize_device,
)
from weightsync.gpu_worker.update_plan import BucketRoute, PatchTarget, StoredTensor, UpdatePlan
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


@dataclass(slots=True)
class Region:
    arena_id: int
    offset_bytes: int


@dataclass(slots=True)
class Segment:
    """One contiguous stretch of store memory; STAGED updates write its shadow."""

    size_bytes: int
    live: Region
    shadow: Region | None
    signature: bytes
    """Fingerprint of the bucket this segment mirrors (fast path); b"" if packed otherwise."""


class Phase(enum.Enum):
    SIZED = "sized"
    """Derived and sized; nothing allocated, the store untouched (waits for the server's admission)."""
    RECEIVING = "receiving"
    """Allocated; buckets 0..next_sequence-1 are in place."""
    FAILED = "failed"
    """A bucket failed its checks: later announced buckets are received and dropped."""


@dataclass(slots=True)
class StoreUpdate:
    """The one update in flight: where each bucket lands, and how far it got."""

    update_id: str
    group_id: str
    plan: UpdatePlan
    needed_bytes: int
    """What allocate_update allocates (new segments, missing shadows, staging growth)."""
    layout_before: int
    phase: Phase = Phase.SIZED
    new_arena: Arena | None = None
    receive_into: list[torch.Tensor | None] = field(default_factory=list)
    """Per bucket: the segment bytes the broadcast lands in, or None for the staging buffer."""
    copies: list[list[tuple[int, int, torch.Tensor]]] = field(default_factory=list)
    """Per general-path bucket: (offset in the bucket, size, destination bytes)."""
    next_sequence: int = 0
    started_through: int = -1
    """Last bucket whose bytes may have reached the store (IN_PLACE abort marks it dirty)."""
    received_bytes: int = 0
    patches: list[tuple[str, DecodedPatch | None, int]] = field(default_factory=list)
    """Verified patches: (tensor, the patch still to scatter at commit (STAGED) or None (IN_PLACE:
    scattered already), WS64 of the patched tensor)."""


@dataclass(frozen=True, slots=True)
class Applied:
    """A bucket in place."""

    size_bytes: int
    fast_path: bool


@dataclass(slots=True)
class WeightStore:
    """All tensors held by one worker on one device."""

    device: torch.device
    arenas: dict[int, Arena] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    """Tensors an aborted IN_PLACE update may have half-written."""
    layout_version: int = 0
    """Bumped whenever segments or tensors are added (derived plans are keyed by it)."""
    update: StoreUpdate | None = None
    staging: torch.Tensor | None = None
    """Reused, pre-touched receive buffer of the general path (never part of the store)."""
    persisted_arenas: set[int] = field(default_factory=set)
    """Arenas whose descriptors the server already holds."""
    tensor_checksums: dict[str, int] = field(default_factory=dict)
    """WS64 of live tensors, computed once and kept across patches (a patch is checked against it
    in O(changed)); a tensor leaves it whenever anything but a patch writes it."""
    _next_arena_id: int = 1
    _tensors_sent_for: int = -1

    # -- reading -------------------------------------------------------------------
    @property
    def state(self) -> int:
        if self.update is not None and self.update.phase is not Phase.SIZED:
            return pb.STORE_STATE_UPDATING
        if not self.tensors:
            return pb.STORE_STATE_EMPTY
        return pb.STORE_STATE_INCONSISTENT if self.dirty else pb.STORE_STATE_CONSISTENT

    @property
    def live_bytes(self) -> int:
        return sum(s.size_bytes for s in self.segments)

    @property
    def held_bytes(self) -> int:
        staging = 0 if self.staging is None else self.staging.numel()
        return sum(a.size_bytes for a in self.arenas.values()) + staging

    def status(self) -> wpb.StoreStatus:
        return wpb.StoreStatus(state=self.state, tensor_count=len(self.tensors), store_bytes=self.live_bytes)

    def _bytes(self, region: Region, size: int) -> torch.Tensor:
        return self.arenas[region.arena_id].region(region.offset_bytes, size)

    def segment_bytes(self, index: int, *, shadow: bool = False) -> torch.Tensor:
        segment = self.segments[index]
        region = segment.shadow if shadow else segment.live
        assert region is not None, f"segment {index} has no shadow"
        return self._bytes(region, segment.size_bytes)

    def view(self, name: str) -> torch.Tensor:
        """The live tensor, typed and shaped."""
        stored = self.tensors[name]
        if stored.size_bytes == 0:
            return torch.empty(stored.shape, dtype=stored.dtype, device=self.device)
        raw = self.segment_bytes(stored.segment)[stored.offset_bytes : stored.offset_bytes + stored.size_bytes]
        return raw.view(stored.dtype).view(stored.shape)

    def checksums(self, names: list[str]) -> list[pb.TensorChecksum]:
        """Per-tensor WS64 of the live weights, sorted by name; unknown names are NOT_FOUND."""
        missing = sorted(n for n in set(names) if n not in self.tensors)
        if missing:
            raise NotFound(
                "TENSOR_NOT_FOUND",
                f"{len(missing)} tensor(s) not in the store, e.g. {missing[0]!r}",
                count=len(missing), tensors=",".join(missing[:20]),
            )
        return [
            pb.TensorChecksum(
                name=name,
                dtype=dtypes.from_torch(self.tensors[name].dtype),
                shape=list(self.tensors[name].shape),
                checksum=tensor_checksum(self.view(name)),
            )
            for name in sorted(set(names) if names else self.tensors)
        ]

    # -- memory --------------------------------------------------------------------
    def _shadow_bytes_missing(self, plan: UpdatePlan) -> int:
        return sum(align_segment(self.segments[i].size_bytes) for i in plan.shadowed_segments
                   if self.segments[i].shadow is None)

    def needed_bytes(self, plan: UpdatePlan) -> int:
        """What allocate_update would allocate for plan: new segments, missing shadows, staging growth."""
        staging = 0 if self.staging is None else self.staging.numel()
        grow = plan.staging_bytes if plan.staging_bytes > staging else 0
        return plan.new_segment_bytes + self._shadow_bytes_missing(plan) + grow

    def _allocate(self, size: int) -> Arena:
        arena = allocate_arena(self._next_arena_id, size, self.device)
        self._next_arena_id += 1
        self.arenas[arena.arena_id] = arena
        return arena

    def scratch(self, size: int) -> torch.Tensor:
        """Bytes to receive a broadcast into and drop (a failing update's announced buckets)."""
        if self.staging is not None and self.staging.numel() >= size:
            return self.staging[:size]
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    # -- the update lifecycle ----------------------------------------------------------
    def require_idle(self) -> None:
        """FAILED_PRECONDITION while an update (sized or allocated) is in flight: one at a time."""
        if self.update is not None:
            raise FailedPrecondition("UPDATE_IN_PROGRESS", f"update {self.update.update_id} is still running",
                                     update_id=self.update.update_id)

    def prepare_update(self, plan: UpdatePlan, update_id: str, group_id: str) -> StoreUpdate:
        """Take the update in (SIZED): what it needs is known, nothing is allocated yet."""
        self.require_idle()
        if plan.layout_version != self.layout_version:
            raise AssertionError("derived plan is stale: the store layout changed")
        self.update = StoreUpdate(update_id, group_id, plan, self.needed_bytes(plan), plan.layout_version)
        return self.update

    def allocate_update(self, update_id: str) -> StoreUpdate:
        """SIZED -> RECEIVING: allocate what the plan needs and decide where every bucket lands."""
        update = self.update
        if update is None or update.update_id != update_id or update.phase is not Phase.SIZED:
            raise FailedPrecondition("UPDATE_NOT_PREPARED", f"update {update_id} is not sized", update_id=update_id)
        plan = update.plan
        if plan.staging_bytes and (self.staging is None or self.staging.numel() < plan.staging_bytes):
            # zeros() touches every page now, not during the first receive.
            self.staging = torch.zeros(plan.staging_bytes, dtype=torch.uint8, device=self.device)
        missing = [i for i in plan.shadowed_segments if self.segments[i].shadow is None]
        if missing:  # shadows stay once made: the next STAGED update reuses them
            arena = self._allocate(sum(align_segment(self.segments[i].size_bytes) for i in missing))
            cursor = 0
            for i in missing:
                self.segments[i].shadow = Region(arena.arena_id, cursor)
                cursor += align_segment(self.segments[i].size_bytes)
        for i in plan.copied_to_shadow:  # keep what this update does not rewrite
            self.segment_bytes(i, shadow=True).copy_(self.segment_bytes(i))
        if plan.new_segments:
            update.new_arena = self._allocate(plan.new_segment_bytes)
            cursor = 0
            for new in plan.new_segments:
                self.segments.append(Segment(new.size_bytes, Region(update.new_arena.arena_id, cursor), None,
                                             new.signature))
                cursor += align_segment(new.size_bytes)
            self.layout_version += 1
        shadowed = set(plan.shadowed_segments)

        def target(segment: int) -> torch.Tensor:
            return self.segment_bytes(segment, shadow=segment in shadowed)

        update.receive_into = [
            None if r.receive_into is None
            else target(r.receive_into.segment)[r.receive_into.offset_bytes : r.receive_into.offset_bytes + r.size_bytes]
            for r in plan.routes
        ]
        update.copies = [
            [(c.src_offset, c.size_bytes, target(c.segment)[c.dst_offset : c.dst_offset + c.size_bytes])
             for c in route.copies]
            for route in plan.routes
        ]
        update.phase = Phase.RECEIVING
        return update

    def begin_update(self, plan: UpdatePlan, update_id: str, group_id: str) -> StoreUpdate:
        """prepare_update and allocate_update at once (an update that needs no admission)."""
        self.prepare_update(plan, update_id, group_id)
        return self.allocate_update(update_id)

    def current(self, update_id: str) -> StoreUpdate:
        """The update in flight, allocated (RECEIVING or FAILED)."""
        update = self.update
        if update is None or update.update_id != update_id or update.phase is Phase.SIZED:
            raise FailedPrecondition("UPDATE_NOT_PREPARED", f"update {update_id} is not prepared", update_id=update_id)
        return update

    def receive_buffer(self, sequence: int) -> torch.Tensor:
        """Where bucket `sequence` of the current update is received: exactly its size."""
        update = self.update
        assert update is not None
        route = update.plan.routes[sequence]
        direct = update.receive_into[sequence]
        if direct is not None:
            return direct
        assert self.staging is not None
        return self.staging[: route.size_bytes]

    def mark_started(self, sequence: int) -> None:
        """The bucket's bytes may reach the store from now on (the broadcast is posted)."""
        assert self.update is not None
        self.update.started_through = sequence

    def _expected_route(self, update: StoreUpdate, sequence: int, size_bytes: int) -> BucketRoute:
        route = update.plan.routes[sequence] if 0 <= sequence < len(update.plan.routes) else None
        if sequence != update.next_sequence or route is None or size_bytes != route.size_bytes:
            raise InvalidArgument("BUCKET_NOT_EXPECTED", f"bucket {sequence} of {size_bytes} bytes is not "
                                  f"the next one ({update.next_sequence})", bucket=sequence)
        return route

    def _drainable(self, update: StoreUpdate, size: int) -> bool:
        return 0 <= size <= max((r.size_bytes for r in update.plan.routes), default=0)

    def receive_broadcast(self, receive: wpb.ReceiveBucketCommand,
                          broadcast: Callable[[torch.Tensor], None]) -> Applied | None:
        """Join the broadcast of one announced bucket (COLLECTIVE) and put it in place.

        A bucket that cannot be taken (the update already failing, out of order, a bad
        tail) is still received at its announced length and dropped, so the sender never
        hangs; None when it was dropped on purpose (discard, or after a failure)."""
        update = self.current(receive.update_id)
        sequence = receive.sequence
        if receive.discard or update.phase is Phase.FAILED:
            broadcast(self.scratch(receive.size_bytes))
            return None
        try:
            route = self._expected_route(update, sequence, receive.size_bytes)
            check_tail_announced(sequence, route.size_bytes, receive.tail)
        except WeightSyncError:
            update.phase = Phase.FAILED
            if self._drainable(update, receive.size_bytes):
                broadcast(self.scratch(receive.size_bytes))
            raise
        received = self.receive_buffer(sequence)
        covered = arm_tail(received, receive.tail)
        if route.direct:
            self.mark_started(sequence)  # the broadcast lands in the store itself
        try:
            broadcast(received)
        except BaseException:
            # Nothing may have arrived (a trainer killed before sending): put back what the tail covered.
            restore_tail(received, covered)
            raise
        try:
            check_tail(sequence, received, receive.tail)
        except WeightSyncError:
            update.phase = Phase.FAILED
            raise
        return Applied(self.apply_bucket(sequence, received, receive.checksum), route.direct)

    def receive_from_ingress(self, receive: wpb.ReceiveBucketCommand, ingress: torch.Tensor | None) -> Applied | None:
        """INLINE/SHM: the bucket (or one piece of it) is in the ingress already; copy it into the store.

        None while the bucket is not complete (a piece), or when it is dropped on purpose."""
        update = self.current(receive.update_id)
        sequence = receive.sequence
        if receive.discard or update.phase is Phase.FAILED:
            return None
        if ingress is None:
            raise FailedPrecondition("INGRESS_MISSING", "this worker has no ingress mapped")
        try:
            route = self._expected_route(update, sequence, receive.size_bytes)
            offset, length = receive.piece_offset_bytes, receive.piece_size_bytes or route.size_bytes
            start = receive.ingress_offset_bytes
            if start < 0 or start + length > ingress.numel() or offset < 0 or offset + length > route.size_bytes:
                raise InvalidArgument("INGRESS_OUT_OF_RANGE", f"bucket {sequence}: piece [{offset}, +{length}) at "
                                      f"ingress offset {start} does not fit", bucket=sequence)
        except WeightSyncError:
            update.phase = Phase.FAILED
            raise
        arrived = ingress[start : start + length]
        whole = offset == 0 and length == route.size_bytes
        if offset == 0 and route.direct:
            self.mark_started(sequence)  # pieces are copied into the store itself
        checked = receive.checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED or bool(route.checks)
        if whole and not route.direct and not checked:
            received = arrived  # nothing to verify: each tensor is copied straight from the ingress
        else:
            # The segment, or staging. Checked bytes are always checked in this copy, never in
            # the ingress: an SHM trainer can still write its slot, and a torn copy must fail
            # its checksum rather than pass it on bytes that then change under the copies.
            received = self.receive_buffer(sequence)
            received[offset : offset + length].copy_(arrived)
        if not whole and not receive.last_piece:
            return None
        return Applied(self.apply_bucket(sequence, received, receive.checksum), route.direct)

    def apply_bucket(self, sequence: int, received: torch.Tensor, bucket_checksum: tensor_pb2.Checksum) -> int:
        """Check a received bucket and put its tensors in place; returns its size.

        The device's copies are complete when this returns: BucketApplied (and a later
        commit) must never let an engine read bytes still being written."""
        update = self.update
        assert update is not None and update.phase is Phase.RECEIVING and sequence == update.next_sequence
        route = update.plan.routes[sequence]
        try:
            verify_bucket(sequence, route.checks, received, bucket_checksum)
            taken = self._check_patches(sequence, route.patches, received)
        except Exception:
            update.phase = Phase.FAILED
            raise
        # Every check passed: only now may a byte of this bucket reach the store (a refused bucket of
        # the general path leaves an IN_PLACE store as it was, CONSISTENT).
        self.mark_started(sequence)
        for offset, size, destination in update.copies[sequence]:
            destination.copy_(received[offset : offset + size])
        self._take_patches(update, taken)
        synchronize_device(self.device)
        update.next_sequence += 1
        update.received_bytes += route.size_bytes
        return route.size_bytes

    def live_checksum(self, name: str) -> int:
        """WS64 of a live tensor (kept, see tensor_checksums)."""
        value = self.tensor_checksums.get(name)
        if value is None:
            value = self.tensor_checksums[name] = ws64(self.view(name))
        return value

    def _check_patches(self, sequence: int, targets: tuple[PatchTarget, ...],
                       received: torch.Tensor) -> list[tuple[str, DecodedPatch, int]]:
        """Decode and verify every patch of a bucket against the live tensor, writing nothing: its
        WS64 once patched must be the one the plan names (the end-to-end proof, in O(changed))."""
        taken = []
        for target in targets:
            live = self.view(target.name)
            patch = decode_patch(received[target.src_offset : target.src_offset + target.size_bytes],
                                 encoding=target.encoding, numel=live.numel(), count=target.count,
                                 itemsize=live.element_size(), tensor=target.name)
            actual = ws64_after_patch(self.live_checksum(target.name), live, patch)
            if actual != target.expected:
                raise DataLoss(
                    "TENSOR_CHECKSUM_MISMATCH",
                    f"tensor {target.name!r} in bucket {sequence}: once patched its WS64 would be {actual:#018x}, "
                    f"the plan says {target.expected:#018x} (was the base what the trainer thinks?)",
                    bucket=sequence, tensor=target.name,
                )
            taken.append((target.name, patch, actual))
        return taken

    def _take_patches(self, update: StoreUpdate, taken: list[tuple[str, DecodedPatch, int]]) -> None:
        """Checked patches: IN_PLACE scatters them now; STAGED keeps them (a copy: the bucket's
        buffer is reused) for commit."""
        for name, patch, actual in taken:
            if update.plan.staged:
                kept = DecodedPatch(patch.positions.clone(), patch.values.clone())
                update.patches.append((name, kept, actual))
            else:
                apply_patch(self.view(name), patch)
                self.tensor_checksums.pop(name, None)  # half-applied until commit: no claim meanwhile
                update.patches.append((name, None, actual))

    def commit_update(self) -> UpdatePlan:
        """Publish: flip shadows (STAGED), add new tensors, clear what was rewritten."""
        update = self.update
        assert update is not None
        routes = update.plan.routes
        if update.phase is not Phase.RECEIVING or update.next_sequence != len(routes):
            raise FailedPrecondition(
                "BUCKETS_MISSING", f"commit after {update.next_sequence} of {len(routes)} buckets"
                + (" (a bucket failed its checks)" if update.phase is Phase.FAILED else ""),
                received=update.next_sequence, expected=len(routes),
            )
        synchronize_device(self.device)  # the shadow copies of allocate_update, if no bucket came after them
        for index in update.plan.shadowed_segments:
            segment = self.segments[index]
            segment.live, segment.shadow = segment.shadow, segment.live  # type: ignore[assignment]
        for tensor in update.plan.new_tensors:
            self.tensors[tensor.name] = tensor
        for name in update.plan.names:
            self.tensor_checksums.pop(name, None)
        scattered = False
        for name, patch, checksum in update.patches:
            if patch is not None:  # STAGED: the live bytes change only now (the server holds the engines off)
                apply_patch(self.view(name), patch)
                scattered = True
            self.tensor_checksums[name] = checksum
        if scattered:
            synchronize_device(self.device)
        self.dirty -= update.plan.names
        self.update = None
        return update.plan

    def abort_update(self) -> None:
        """Undo what can be undone; IN_PLACE writes leave their tensors dirty."""
        update = self.update
        assert update is not None
        self.update = None
        if update.phase is Phase.SIZED:
            return  # nothing was allocated or written
        if not update.plan.staged:
            for route in update.plan.routes[: update.started_through + 1]:
                self.dirty.update(route.overwrites)
                for name in route.overwrites:
                    self.tensor_checksums.pop(name, None)
        update.receive_into.clear()
        update.copies.clear()
        if update.new_arena is not None:
            del self.segments[update.plan.first_new_segment :]
            self.arenas.pop(update.new_arena.arena_id)
            update.new_arena.release()
        self.layout_version = update.layout_before  # the layout is exactly what it was
        # Device memory this update held goes back to the device, not to torch's cache:
        # the next admission, and an engine on the same GPU, can use it.
        release_cached_device_memory(self.device)

    # -- persistence ---------------------------------------------------------------------
    def unsent_arenas(self) -> list[Arena]:
        """Host arenas the server does not hold yet (sent on the fd channel before a manifest)."""
        return [a for a in self.arenas.values() if a.shareable and a.arena_id not in self.persisted_arenas]

    def mark_persisted(self, arena_ids: list[int]) -> None:
        """The server holds these arenas' descriptors now."""
        self.persisted_arenas.update(arena_ids)

    def manifest(self) -> wpb.StoreManifest:
        """The store as the server must keep it; tensors only when the layout changed."""
        manifest = wpb.StoreManifest(layout_version=self.layout_version, dirty=sorted(self.dirty))
        for arena in self.arenas.values():
            manifest.arenas.add(arena_id=arena.arena_id, size_bytes=arena.size_bytes)
        for segment in self.segments:
            spec = manifest.segments.add(size_bytes=segment.size_bytes, signature=segment.signature)
            spec.live.arena_id, spec.live.offset_bytes = segment.live.arena_id, segment.live.offset_bytes
            if segment.shadow is not None:
                spec.shadow.arena_id, spec.shadow.offset_bytes = segment.shadow.arena_id, segment.shadow.offset_bytes
        if self._tensors_sent_for != self.layout_version:
            manifest.tensors_included = True
            for t in self.tensors.values():
                manifest.tensors.add(name=t.name, dtype=dtypes.from_torch(t.dtype), shape=list(t.shape),
                                     segment=t.segment, offset_bytes=t.offset_bytes, size_bytes=t.size_bytes)
            self._tensors_sent_for = self.layout_version
        return manifest

    def restore(self, manifest: wpb.StoreManifest, fds: dict[int, int], dirty: list[str]) -> None:
        """Map a store that survived its previous worker process."""
        if self.tensors or self.arenas:
            raise FailedPrecondition("STORE_NOT_EMPTY", "restore needs an empty store")
        for spec in manifest.arenas:
            if spec.arena_id not in fds:
                raise ValueError(f"no descriptor for arena {spec.arena_id}")
            self.arenas[spec.arena_id] = map_arena(spec.arena_id, fds[spec.arena_id], spec.size_bytes)
        for spec in manifest.segments:
            shadow = Region(spec.shadow.arena_id, spec.shadow.offset_bytes) if spec.HasField("shadow") else None
            self.segments.append(Segment(spec.size_bytes, Region(spec.live.arena_id, spec.live.offset_bytes),
                                         shadow, spec.signature))
        for t in manifest.tensors:
            self.tensors[t.name] = StoredTensor(t.name, dtypes.to_torch(t.dtype, tensor=t.name), tuple(t.shape),
                                                t.segment, t.offset_bytes, t.size_bytes)
        self.dirty = set(manifest.dirty) | set(dirty)
        self.layout_version = manifest.layout_version
        self._tensors_sent_for = manifest.layout_version
        self.persisted_arenas = set(self.arenas)
        self._next_arena_id = max(self.arenas, default=0) + 1
