"""The server's hold on each worker's store, so the store outlives the worker.

A CPU worker's store lives in memfd arenas. Whenever the worker reports a
manifest (at commit and abort) it first sends the descriptors of arenas the
server does not hold yet; the keeper keeps one descriptor per arena (keeping
the memory alive) and the last manifest. When the worker dies, the restarted
one inherits the descriptors and maps the same bytes (RestoreStoreCommand):
the store stays CONSISTENT, or INCONSISTENT when an IN_PLACE update was
writing. Engines on the host map the same arenas read-only (issue 10).

A CUDA worker's store is device memory: nothing is kept, and a dead worker's
store is LOST. What the server does keep for it is the worker's GPU UUID and
the CUDA IPC handles it exported (DeviceExports): they are valid for that
worker process only, so they are keyed by its incarnation (restart count)
and dropped with the store when it dies. A restarted worker numbers its
arenas from 1 again; a handle of its predecessor would name dead memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from weightsync.v1 import local_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


@dataclass(slots=True)
class DeviceExports:
    """A CUDA worker's GPU UUID and exported arena handles, for one incarnation of the worker."""

    incarnation: int = -1
    """The worker's restart count when these were exported; -1: nothing held."""
    device_uuid: str = ""
    handles: dict[int, local_pb2.ArenaHandle] = field(default_factory=dict)
    """arena id -> its IPC handle (committed arenas only)."""

    def valid_for(self, incarnation: int) -> bool:
        return self.incarnation == incarnation and incarnation >= 0

    def uuid(self, incarnation: int) -> str:
        """The GPU UUID if known for this incarnation, else ""."""
        return self.device_uuid if self.valid_for(incarnation) else ""

    def lookup(self, incarnation: int, arena_ids) -> dict[int, local_pb2.ArenaHandle] | None:
        """The handles of these arenas, or None if one is not held for this incarnation."""
        if not self.valid_for(incarnation) or not all(a in self.handles for a in arena_ids):
            return None
        return {a: self.handles[a] for a in arena_ids}

    def absorb(self, incarnation: int, current: int, device_uuid: str,
               arenas: list[local_pb2.ArenaHandle]) -> bool:
        """Take what incarnation `incarnation` exported, unless the worker restarted meanwhile
        (`current` is its incarnation now); True if taken."""
        if incarnation != current:
            return False  # answered by a process that is gone: its handles name dead memory
        if not self.valid_for(incarnation):
            self.clear()
            self.incarnation = incarnation
        self.device_uuid = device_uuid
        for handle in arenas:
            self.handles[handle.arena_id] = handle
        return True

    def clear(self) -> None:
        self.incarnation = -1
        self.device_uuid = ""
        self.handles = {}


@dataclass(slots=True)
class KeptStore:
    """One worker's store as the server holds it."""

    fds: dict[int, int] = field(default_factory=dict)
    """arena id -> descriptor the server owns."""
    layout: wpb.StoreManifest | None = None
    """The last manifest without its tensors (segments, arenas, dirty: what every commit changes)."""
    tensors: list[wpb.StoredTensorSpec] = field(default_factory=list)
    """The tensors, as last sent (only when the layout changed): not copied on every commit."""
    written: dict[str, int] = field(default_factory=dict)
    """Tensor name -> generation of the commit that last wrote it (engines read only what changed)."""
    exports: DeviceExports = field(default_factory=DeviceExports)
    """CUDA workers: IPC handles and GPU UUID of the live worker process (cleared when it dies)."""

    @property
    def manifest(self) -> wpb.StoreManifest | None:
        """The whole store: layout and tensors."""
        if self.layout is None:
            return None
        whole = wpb.StoreManifest()
        whole.CopyFrom(self.layout)
        whole.tensors.extend(self.tensors)
        whole.tensors_included = True
        return whole

    @property
    def restorable(self) -> bool:
        return self.layout is not None and bool(self.tensors) and all(
            a.arena_id in self.fds for a in self.layout.arenas
        )

    def absorb(self, manifest: wpb.StoreManifest, sent_arena_ids: list[int], fds: list[int]) -> None:
        """Take a reported manifest and the descriptors sent just before it."""
        if len(sent_arena_ids) != len(fds):
            for fd in fds:
                os.close(fd)
            raise ValueError(f"expected {len(sent_arena_ids)} arena descriptors, got {len(fds)}")
        for arena_id, fd in zip(sent_arena_ids, fds, strict=True):
            old = self.fds.pop(arena_id, None)
            if old is not None:
                os.close(old)
            self.fds[arena_id] = fd
        if manifest.tensors_included:
            self.tensors = list(manifest.tensors)
        self.layout = wpb.StoreManifest()
        self.layout.CopyFrom(manifest)
        self.layout.ClearField("tensors")
        self.layout.tensors_included = False
        live = {a.arena_id for a in manifest.arenas}
        for arena_id in [a for a in self.fds if a not in live]:
            os.close(self.fds.pop(arena_id))

    def restore_command(self, dirty: set[str]) -> tuple[wpb.RestoreStoreCommand, list[int]]:
        """The command for a restarted worker, and the descriptors it must inherit."""
        manifest = self.manifest
        assert manifest is not None
        names = {t.name for t in self.tensors}
        command = wpb.RestoreStoreCommand(manifest=manifest, dirty=sorted(dirty & names))
        for arena in manifest.arenas:
            command.arenas.add(arena_id=arena.arena_id, fd=self.fds[arena.arena_id])
        return command, [self.fds[a.arena_id] for a in manifest.arenas]

    def mark_written(self, names, generation: int) -> None:
        for name in names:
            self.written[name] = generation

    def live_arena_ids(self) -> list[int]:
        """The arenas holding the committed tensors' bytes (what an engine maps), sorted."""
        assert self.layout is not None
        segments = self.layout.segments
        return sorted({segments[t.segment].live.arena_id for t in self.tensors})

    def locations(self) -> list[local_pb2.StoredTensorLocation]:
        """Where every tensor's live bytes are, by arena (what an engine maps), sorted by name."""
        assert self.layout is not None
        segments = self.layout.segments
        out = []
        for t in sorted(self.tensors, key=lambda t: t.name):
            live = segments[t.segment].live
            out.append(local_pb2.StoredTensorLocation(
                name=t.name, dtype=t.dtype, shape=t.shape, arena_id=live.arena_id,
                offset_bytes=live.offset_bytes + t.offset_bytes, size_bytes=t.size_bytes,
                written_generation=self.written.get(t.name, 0),
            ))
        return out

    def status(self, dirty: set[str]) -> wpb.StoreStatus:
        """The state the kept store will have once mapped again (dirty: half-written by a crash)."""
        assert self.layout is not None
        names = {t.name for t in self.tensors}
        torn = bool(self.layout.dirty) or bool(dirty & names)
        return wpb.StoreStatus(
            state=pb.STORE_STATE_INCONSISTENT if torn else pb.STORE_STATE_CONSISTENT,
            tensor_count=len(names),
            store_bytes=sum(s.size_bytes for s in self.layout.segments),
        )

    def forget(self) -> None:
        """Drop the store (its memory goes when no process maps it), and the dead worker's exports."""
        self.exports.clear()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.layout = None
        self.tensors = []
        self.written = {}
