"""A worker's assignment in one update: receive the buckets it owns and write them into the node store.

    (idle) --prepare--> RECEIVING: staging ready, this worker's shadow copies done
    RECEIVING --receive (owned buckets, in plan order within each lane)--> RECEIVING, or FAILED when a bucket
                fails its checks (every later bucket announced to it is received and dropped,
                so no sender hangs)
    RECEIVING --commit--> (idle): STAGED patches scattered into the live bytes, device copies done
    any --abort--> (idle)

The server decided everything before a byte moved (server/store/node_store.py): which buckets this
worker owns, and for each the places in the store its bytes go (straight into a segment or a
split tensor's place, or into staging and then one copy per tensor, and one strided copy per
sub-box of a box: a view of the whole tensor in the store, narrowed to the sub-box), the checks and
patches.
An update fed by several streams (the parts of a multi-sender update) names where each stream's
buckets start (PrepareUpdateCommand.lane_starts): the streams' buckets interleave, so each
stream's run of the plan is a lane here, its owned buckets taken in order, its general-path
bytes in a staging buffer of its own (the first lane's is the kept one; the others' live for
the update). This module only moves and checks bytes. Two paths:

  host     a Gloo receive, or the ingress (INLINE, SHM): bytes land in host memory, the store
           itself where they can, else a reused, pre-touched staging buffer; a compressed Gloo
           bucket (Gloo, or INLINE's pieces gathered) lands in a wire buffer of its own and is
           decompressed into either;
  device   an NCCL broadcast (CUDA workers): bytes land in one of two device staging buffers,
           then go to the store on a copy stream. A staging buffer is received into again only
           once the copy out of it completed (the current stream waits on its event), and the
           update's commit or abort waits for every copy: nothing reads the store's bytes before
           they are there. An abort gives the staging buffers back (and torch's cached blocks,
           `empty_cache`), as does the worker when a group is deleted with no update in flight;
           the next update that needs them allocates them again.

A bucket's bytes count as touching the store (an IN_PLACE abort marks its tensors dirty) from
the moment they can reach it: before the receive for one received straight into the store,
after every check passed for one that goes through staging.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightsync.common import byte_passes
from weightsync.common.errors import FailedPrecondition, InvalidArgument, WeightSyncError
from weightsync.common.patches import XOR
from weightsync.gpu_worker.bucket_checks import (
    arm_tail,
    check_tail,
    check_tail_announced,
    restore_tail,
    verify_bucket,
    verify_in_store,
)
from weightsync.gpu_worker.device_lane import DeviceLane
from weightsync.gpu_worker.frames import decompress_bucket
from weightsync.gpu_worker.patch_apply import CheckedPatch, FusedPatch, check_patch
from weightsync.gpu_worker.receive_update import Applied, ReceivePhase, ReceiveUpdate
from weightsync.gpu_worker.store_maps import StoreMaps
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


class Receiver:
    """The worker's update in flight, its staging, and the node store as this worker maps it."""

    def __init__(self, device: torch.device, memory_limit_bytes: int = 0) -> None:
        self.device = device
        self.memory_limit_bytes = memory_limit_bytes
        self.maps = StoreMaps()
        self.staging: torch.Tensor | None = None
        """Host lane: reused, pre-touched receive buffer of general-path buckets (never part of the store)."""
        self.wire: torch.Tensor | None = None
        """Host lane: reused receive buffer of compressed frames (gpu_worker/frames.py)."""
        self.lane = DeviceLane(device) if device.type == "cuda" else None
        self.update: ReceiveUpdate | None = None
        self.received_bytes = 0
        self.touched = False
        """The bucket being received may have reached the store (reported with its failure)."""

    # -- status ------------------------------------------------------------------------
    @property
    def staging_bytes(self) -> int:
        host = sum(b.numel() for b in (self.staging, self.wire) if b is not None)
        return host + (self.lane.held_bytes if self.lane is not None else 0)

    def status(self) -> wpb.WorkerStatus:
        return wpb.WorkerStatus(staging_bytes=self.staging_bytes, received_bytes=self.received_bytes)

    # -- the update's lifecycle -----------------------------------------------------------------
    def prepare(self, command: wpb.PrepareUpdateCommand, *, device_lane: bool) -> ReceiveUpdate:
        """Take this worker's assignment in: staging sized, shadow copies done (STAGED)."""
        if self.update is not None:
            raise FailedPrecondition("UPDATE_IN_PROGRESS", f"update {self.update.update_id} is still running",
                                     update_id=self.update.update_id)
        general = max((b.size_bytes for b in command.buckets if not b.HasField("receive_into")), default=0)
        if device_lane:
            assert self.lane is not None
            self._within_limit(2 * command.largest_bucket_bytes)
            self.lane.ensure(command.largest_bucket_bytes)  # every worker joins every NCCL broadcast
        elif general and (self.staging is None or self.staging.numel() < general):
            self._within_limit(general)
            self.staging = torch.zeros(general, dtype=torch.uint8)  # zeros() touches every page now
        for copy in command.shadow_copies:  # keep what this update does not rewrite
            self.maps.bytes_at(copy.destination, copy.size_bytes).copy_(self.maps.bytes_at(copy.source, copy.size_bytes))
        order = [b.sequence for b in command.buckets]
        self.update = ReceiveUpdate(command, {b.sequence: b for b in command.buckets}, order,
                                    lane_starts=list(command.lane_starts) or [0])
        return self.update

    def _within_limit(self, size: int) -> None:
        limit = self.memory_limit_bytes
        if limit and size > limit:
            from weightsync.common.errors import ResourceExhausted

            raise ResourceExhausted("WORKER_MEMORY_LIMIT", f"the update needs {size} bytes of staging; this worker's "
                                    f"limit is {limit} (--worker-memory-limit-bytes)", needed_bytes=size, limit=limit)

    def current(self, update_id: str) -> ReceiveUpdate:
        update = self.update
        if update is None or update.update_id != update_id:
            raise FailedPrecondition("UPDATE_NOT_PREPARED", f"update {update_id} is not prepared", update_id=update_id)
        return update

    def commit(self, update_id: str) -> None:
        """Every owned bucket is in: scatter STAGED patches (the server holds engines off), wait for every copy."""
        update = self.current(update_id)
        if update.phase is not ReceivePhase.RECEIVING or update.received != len(update.order):
            raise FailedPrecondition("BUCKETS_MISSING", f"commit after {update.received} of this worker's "
                                     f"{len(update.order)} buckets", received=update.received,
                                     expected=len(update.order))
        if self.lane is not None:
            self.lane.drain()
        for live, patch in update.kept:
            patch.apply(live)
        self.update = None

    def abort(self) -> None:
        """Drop the update: every copy out of device staging completed (none keeps writing into the store
        after the server took the abort), then the device staging is given back."""
        self.update = None
        self.release_staging()

    def release_staging(self) -> None:
        """Give the device staging back (and torch's cached blocks): at an abort, and when the worker leaves
        a group with no update in flight. A no-op while an update runs, and on a CPU worker."""
        if self.lane is not None and self.update is None:
            self.lane.release()

    # -- receiving ------------------------------------------------------------------------------
    def _expected(self, update: ReceiveUpdate, receive: wpb.ReceiveBucketCommand, *,
                  compressed: bool = False) -> wpb.OwnedBucket:
        """The owned bucket this receive is for: the next one, of its size. A deferred bucket's places come
        with the receive (its layout, no larger than the placeholder that sized staging)."""
        sequence, size = receive.sequence, receive.size_bytes
        owned = update.owned.get(sequence)
        expected = update.expected(sequence)
        if owned is not None and receive.HasField("layout"):
            fits = receive.layout.sequence == sequence and receive.layout.size_bytes <= owned.size_bytes
            owned = receive.layout if fits else None
        if owned is None or sequence != expected or not (
                0 < size < owned.size_bytes if compressed else size == owned.size_bytes):
            raise InvalidArgument("BUCKET_NOT_EXPECTED", f"bucket {sequence} of {size} bytes is not the next one "
                                  f"this worker owns ({expected})", bucket=sequence)
        return owned

    def scratch(self, size: int) -> torch.Tensor:
        """Bytes to receive a bucket into and drop (not owned, or the update is failing)."""
        if self.lane is not None and self.lane.slots and self.lane.slots[0].numel() >= size:
            return self.lane.take(size)[1]
        if self.staging is not None and self.staging.numel() >= size:
            return self.staging[:size]
        return torch.empty(size, dtype=torch.uint8)

    def receive_collective(self, receive: wpb.ReceiveBucketCommand, transfer: Callable[[torch.Tensor], None], *,
                           device_lane: bool) -> Applied | None:
        """Join the transfer of one announced bucket (a Gloo receive, an NCCL broadcast) and put it in place.
        A bucket that cannot be taken is still received at its announced length and dropped, so the sender
        never hangs; None when it was dropped on purpose (not owned, or after a failure)."""
        update = self.current(receive.update_id)
        self.touched = False
        if receive.discard or update.phase is ReceivePhase.FAILED:
            transfer(self.scratch(receive.size_bytes))
            return None
        compressed = receive.compression != pb.BUCKET_COMPRESSION_UNSPECIFIED
        try:
            owned = self._expected(update, receive, compressed=compressed)
            if compressed and device_lane:
                raise InvalidArgument("BUCKET_COMPRESSION_UNSUPPORTED", f"bucket {receive.sequence}: compressed "
                                      "buckets travel only over a Gloo group", bucket=receive.sequence)
            check_tail_announced(receive.sequence, receive.size_bytes if compressed else owned.size_bytes,
                                 receive.tail)
        except WeightSyncError:
            update.phase = ReceivePhase.FAILED
            if 0 <= receive.size_bytes <= update.command.largest_bucket_bytes:
                transfer(self.scratch(receive.size_bytes))
            raise
        if compressed:
            return self._receive_frame(update, owned, receive, transfer)
        slot, buffer = self._receive_buffer(owned, device_lane)
        covered = arm_tail(buffer, receive.tail)
        self.touched = buffer_is_store = owned.HasField("receive_into") and not device_lane
        try:
            transfer(buffer)
        except BaseException:
            if buffer_is_store:  # nothing may have arrived (a trainer killed before sending): put the tail back
                restore_tail(buffer, covered)
            raise
        try:
            check_tail(receive.sequence, buffer, receive.tail)
            if device_lane:
                return self._apply_from_device(update, owned, slot, buffer, receive.checksum)
            return self._apply(update, owned, buffer, receive.checksum)
        except WeightSyncError:
            update.phase = ReceivePhase.FAILED
            raise

    def _receive_frame(self, update: ReceiveUpdate, owned: wpb.OwnedBucket, receive: wpb.ReceiveBucketCommand,
                       transfer: Callable[[torch.Tensor], None]) -> Applied:
        """A compressed bucket over Gloo: the frame into the wire buffer, checked through its tail, then
        decompressed into the bucket's place (the store or staging) and put in place as any other."""
        try:
            frame = self._wire(receive.size_bytes)
        except WeightSyncError:  # over this worker's memory limit: still drained, so the sender never hangs
            update.phase = ReceivePhase.FAILED
            transfer(self.scratch(receive.size_bytes))
            raise
        arm_tail(frame, receive.tail)
        transfer(frame)  # the wire buffer is never part of the store: nothing to put back if this fails
        try:
            check_tail(receive.sequence, frame, receive.tail)
            return self._decompress_and_apply(update, owned, frame, receive.checksum)
        except WeightSyncError:
            update.phase = ReceivePhase.FAILED
            raise

    def _decompress_and_apply(self, update: ReceiveUpdate, owned: wpb.OwnedBucket, frame: torch.Tensor,
                              bucket_checksum: tensor_pb2.Checksum) -> Applied:
        """A whole frame: checked and decompressed (gpu_worker/frames.py), and only then written where the
        bucket lands uncompressed, and put in place."""
        bucket = decompress_bucket(owned.sequence, frame, owned.size_bytes)
        buffer = self._receive_buffer(owned, device_lane=False, update=update)[1]
        self.touched = owned.HasField("receive_into")  # from here on its bytes may reach the store
        buffer.numpy()[:] = bucket
        return self._apply(update, owned, buffer, bucket_checksum)

    def _wire(self, size: int, update: ReceiveUpdate | None = None, sequence: int = 0) -> torch.Tensor:
        """Host bytes to receive a compressed frame into (grown as needed, pre-touched, kept); a lane but the
        first has its own (_lane_buffer)."""
        if update is not None and update.lane_of(sequence):
            return self._lane_buffer(update, "wire", sequence, size)
        if self.wire is None or self.wire.numel() < size:
            self._within_limit(size + (0 if self.staging is None else self.staging.numel()))
            self.wire = torch.zeros(size, dtype=torch.uint8)
        return self.wire[:size]

    def _receive_buffer(self, owned: wpb.OwnedBucket, device_lane: bool,
                        update: ReceiveUpdate | None = None) -> tuple[int, torch.Tensor]:
        if device_lane:
            assert self.lane is not None
            return self.lane.take(owned.size_bytes)
        if owned.HasField("receive_into"):
            return -1, self.maps.bytes_at(owned.receive_into, owned.size_bytes)
        if update is not None and update.lane_of(owned.sequence):
            return -1, self._lane_buffer(update, "staging", owned.sequence, owned.size_bytes)
        assert self.staging is not None
        return -1, self.staging[: owned.size_bytes]

    def _lane_buffer(self, update: ReceiveUpdate, kind: str, sequence: int, size: int) -> torch.Tensor:
        """A lane but the first receives into a buffer of its own (its stream's pieces interleave with the
        other lanes'), made for this update at its first use and grown as needed; the update drops it."""
        key = (kind, update.lane_of(sequence))
        buffer = update.lane_buffers.get(key)
        if buffer is None or buffer.numel() < size:
            held = sum(b.numel() for b in update.lane_buffers.values())
            self._within_limit(size + held + self.staging_bytes)
            buffer = update.lane_buffers[key] = torch.zeros(size, dtype=torch.uint8)
        return buffer[:size]

    def receive_from_ingress(self, receive: wpb.ReceiveBucketCommand, ingress: torch.Tensor | None) -> Applied | None:
        """INLINE/SHM: the bucket (or one piece of it) is in the ingress already; copy it into the store.
        None while the bucket is not complete (a piece), or when it is dropped on purpose."""
        update = self.current(receive.update_id)
        self.touched = False
        if receive.discard or update.phase is ReceivePhase.FAILED:
            return None
        if ingress is None:
            raise FailedPrecondition("INGRESS_MISSING", "this worker has no ingress mapped")
        compressed = receive.compression != pb.BUCKET_COMPRESSION_UNSPECIFIED
        try:
            owned = self._expected(update, receive, compressed=compressed)
            sent = receive.size_bytes if compressed else owned.size_bytes  # what travels: the frame, or the bucket
            offset, length = receive.piece_offset_bytes, receive.piece_size_bytes or sent
            start = receive.ingress_offset_bytes
            if start < 0 or start + length > ingress.numel() or offset < 0 or offset + length > sent:
                raise InvalidArgument("INGRESS_OUT_OF_RANGE", f"bucket {receive.sequence}: piece [{offset}, +{length}) "
                                      f"at ingress offset {start} does not fit", bucket=receive.sequence)
            arrived = ingress[start : start + length]
            whole = offset == 0 and length == sent
            if compressed:  # gathered whole in the wire buffer, then decompressed into its place
                frame = self._wire(sent, update, receive.sequence)
                frame[offset : offset + length].copy_(arrived)
                if not whole and not receive.last_piece:
                    return None
                return self._decompress_and_apply(update, owned, frame, receive.checksum)
            direct = owned.HasField("receive_into")
            checked = (receive.checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED or bool(owned.checks)
                       or bool(owned.patches))
            if whole and not direct and not checked:
                received = arrived  # nothing to verify: each tensor is copied straight from the ingress
            else:
                # The store, or staging. Checked bytes are always checked in this copy, never in the ingress:
                # an SHM trainer can still write its slot, and a torn copy must fail its checksum rather than
                # pass it on bytes that then change under the copies.
                received = self._receive_buffer(owned, device_lane=False, update=update)[1]
                self.touched = direct
                received[offset : offset + length].copy_(arrived)
                byte_passes.copied("worker.from_ingress", length)
            if not whole and not receive.last_piece:
                return None
            return self._apply(update, owned, received, receive.checksum)
        except WeightSyncError:
            update.phase = ReceivePhase.FAILED
            raise

    def receive_in_store(self, receive: wpb.ReceiveBucketCommand) -> Applied | None:
        """SHM store writes: the trainer wrote the bucket at its places in the store (its receive_into, or its
        copies' destinations: server/store/writes.py); check it there, copy nothing. None when it is dropped on
        purpose (the update is failing)."""
        update = self.current(receive.update_id)
        self.touched = False
        if receive.discard or update.phase is ReceivePhase.FAILED:
            return None
        try:
            owned = self._expected(update, receive)  # never one with patches or boxes (server/store/writes.py)
            self.touched = True  # the trainer may have written its places whatever comes of the check
            if owned.HasField("receive_into"):
                pieces = [(0, self.maps.bytes_at(owned.receive_into, owned.size_bytes))]
            else:
                pieces = [(c.src_offset_bytes, self.maps.bytes_at(c.dst, c.size_bytes)) for c in owned.copies]
            verify_in_store(owned.sequence, owned.checks, pieces, owned.size_bytes, receive.checksum)
            return self._done(update, owned)
        except WeightSyncError:
            update.phase = ReceivePhase.FAILED
            raise

    # -- putting a bucket in place ----------------------------------------------------------------
    def _apply(self, update: ReceiveUpdate, owned: wpb.OwnedBucket, received: torch.Tensor,
               bucket_checksum: tensor_pb2.Checksum) -> Applied:
        """Check a bucket in host memory and put its tensors in place."""
        verify_bucket(owned.sequence, owned.checks, received, bucket_checksum)
        checked = self._check_patches(owned, received)
        # Every check passed (the fused patches' as they apply, taken back if refused): only now
        # may a byte of a staged bucket reach the store.
        self._take_patches(update, checked)
        for copy in owned.copies:
            self.maps.bytes_at(copy.dst, copy.size_bytes).copy_(
                received[copy.src_offset_bytes : copy.src_offset_bytes + copy.size_bytes])
            byte_passes.copied("worker.unpack", copy.size_bytes)
        for box in owned.box_copies:
            destination, source = self._box_pair(box, received)
            destination.copy_(source)
        return self._done(update, owned)

    def _box_pair(self, box: wpb.BoxCopy, received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Its place in the store: a strided view of the whole tensor, the sub-box's elements in the bucket
        viewed as the sub-box) of one BoxCopy."""
        whole = self.maps.tensor_at(box.tensor, box.dtype, box.shape, box.name)
        destination = whole
        for dim, (offset, size) in enumerate(zip(box.offsets, box.sizes, strict=True)):
            destination = destination.narrow(dim, offset, size)
        size_bytes = destination.numel() * whole.element_size()  # inside the bucket: the plan was validated
        source = received[box.src_offset_bytes : box.src_offset_bytes + size_bytes].view(whole.dtype)
        return destination, source.view(tuple(box.sizes))

    def _apply_from_device(self, update: ReceiveUpdate, owned: wpb.OwnedBucket, slot: int, received: torch.Tensor,
                           bucket_checksum: tensor_pb2.Checksum) -> Applied:
        """Check a bucket in device staging (on the device) and copy it to the store on the copy stream."""
        assert self.lane is not None
        verify_bucket(owned.sequence, owned.checks, received, bucket_checksum)
        patch_bytes = received.cpu() if owned.patches else received  # patches are decoded and checked on the host
        checked = self._check_patches(owned, patch_bytes)
        self._take_patches(update, checked)
        if owned.HasField("receive_into"):
            pairs = [(received, self.maps.bytes_at(owned.receive_into, owned.size_bytes))]
        else:
            pairs = [(received[c.src_offset_bytes : c.src_offset_bytes + c.size_bytes],
                      self.maps.bytes_at(c.dst, c.size_bytes)) for c in owned.copies]
            pairs += [(source, destination) for destination, source in
                      (self._box_pair(b, received) for b in owned.box_copies)]
        self.lane.copy_out(slot, pairs)  # on the copy stream, after the receive into staging
        return self._done(update, owned)

    def _done(self, update: ReceiveUpdate, owned: wpb.OwnedBucket) -> Applied:
        update.waiting[update.lane_of(owned.sequence)].popleft()  # _expected made it the lane's next
        update.received += 1
        self.received_bytes += owned.size_bytes
        return Applied(owned.size_bytes, owned.HasField("receive_into"))

    def _check_patches(self, owned: wpb.OwnedBucket,
                       received: torch.Tensor) -> list[tuple[torch.Tensor, CheckedPatch | FusedPatch, bool]]:
        """Check every patch of a bucket against its live tensor, writing nothing (gpu_worker.patch_apply),
        but for PATCH_XOR applied now: that one is checked as it applies (FusedPatch)."""
        checked: list[tuple[torch.Tensor, CheckedPatch | FusedPatch, bool]] = []
        for target in owned.patches:
            live = self.maps.tensor_at(target.live, target.dtype, target.shape, target.name)
            data = received[target.src_offset_bytes : target.src_offset_bytes + target.size_bytes]
            destination = self.maps.tensor_at(target.destination, target.dtype, target.shape, target.name)
            if target.encoding == XOR and not target.scatter_at_commit:
                checked.append((destination, FusedPatch(target, data, live, owned.sequence), False))
            else:
                checked.append((destination, check_patch(target, data, live, bucket=owned.sequence),
                                target.scatter_at_commit))
        return checked

    def _take_patches(self, update: ReceiveUpdate,
                      checked: list[tuple[torch.Tensor, CheckedPatch | FusedPatch, bool]]) -> None:
        """Patches applied now (IN_PLACE, or a STAGED one into its shadow), or kept for commit (a copy:
        the bucket's buffer is reused). A fused patch refused here takes back every patch of the
        bucket applied before it, so the store is as it was and the refusal says nothing was touched.
        Sets self.touched: from here on, bytes of this bucket may reach the store."""
        was_touched, self.touched = self.touched, True
        applied: list[tuple[torch.Tensor, FusedPatch]] = []
        try:
            for destination, patch, _ in checked:  # first: the only ones that can still be refused
                if isinstance(patch, FusedPatch):
                    patch.apply(destination)  # refused: taken back before it raises
                    applied.append((destination, patch))
        except Exception:
            for destination, patch in reversed(applied):
                patch.undo(destination)
            self.touched = was_touched
            raise
        for destination, patch, at_commit in checked:
            if isinstance(patch, CheckedPatch):
                if at_commit:
                    update.kept.append((destination, patch.kept()))
                else:
                    patch.apply(destination)

    def release(self) -> None:
        self.update = None
        if self.lane is not None:
            self.lane.release()
        self.maps.release()
