"""Exporting a CUDA store's arenas to engines on the same GPU (CUDA IPC).

torch's `_share_cuda_()` puts the storage behind a new cross-process
reference counter every time it is called, and the memory of an exported
block is only given back once every reader dropped it and the exporter
collected it (torch.cuda.ipc_collect). So each arena is shared once per
worker process and its handle reused; only committed arenas are shared (the
arenas of an update in flight hold no version an engine may read, and an
aborted update frees them); arenas that left the store are collected.

The handle names the GPU by UUID: an engine's ordinal for the same GPU may
differ (its own CUDA_VISIBLE_DEVICES), see common/device_identity.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from weightsync.gpu_worker.memory import Arena
from weightsync.gpu_worker.store import WeightStore
from weightsync.v1 import local_pb2

ShareFn = Callable[[torch.Tensor], tuple]
"""torch's (device, handle, size, offset, ref counter, ref counter offset, event handle, sync required)."""


def committed_arena_ids(store: WeightStore) -> set[int]:
    """Arenas holding the live bytes of committed segments. During an update, segments appended by
    it are not committed, and its shadows are not live (commit swaps them in)."""
    segments = store.segments
    count = len(segments) if store.update is None else min(store.update.plan.first_new_segment, len(segments))
    return {segments[i].live.arena_id for i in range(count)}


def _share(data: torch.Tensor) -> tuple:
    return data.untyped_storage()._share_cuda_()  # noqa: SLF001 - torch's own IPC entry point


def _collect() -> None:
    torch.cuda.ipc_collect()


@dataclass(slots=True)
class ArenaExporter:
    """The IPC handles this worker process handed out, one per arena."""

    device_uuid: str
    share: ShareFn = _share
    collect: Callable[[], None] = _collect
    handles: dict[int, tuple[int, local_pb2.ArenaHandle]] = field(default_factory=dict)
    """arena id -> (data pointer it was shared at, its handle)."""

    @staticmethod
    def for_device(device: torch.device) -> ArenaExporter:
        if device.type != "cuda":
            return ArenaExporter("")
        from weightsync.common.device_identity import cuda_uuid

        return ArenaExporter(cuda_uuid(device.index if device.index is not None else torch.cuda.current_device()))

    def export(self, arenas: Mapping[int, Arena], committed: set[int]) -> list[local_pb2.ArenaHandle]:
        """Handles of the committed device arenas, sorted by id; shares only what was not shared yet."""
        gone = [a for a in self.handles if a not in arenas or arenas[a].data.data_ptr() != self.handles[a][0]]
        for arena_id in gone:
            del self.handles[arena_id]
        if gone:
            self.collect()  # their memory goes back once the engines that mapped it let go
        out = []
        for arena_id in sorted(committed):
            arena = arenas[arena_id]
            if arena.shareable:
                continue  # host memory travels as a descriptor, not a handle
            held = self.handles.get(arena_id)
            if held is None:
                held = (arena.data.data_ptr(), self._handle(arena))
                self.handles[arena_id] = held
            out.append(held[1])
        return out

    def _handle(self, arena: Arena) -> local_pb2.ArenaHandle:
        (device, ipc, size, offset, counter, counter_offset, ipc_event, sync) = self.share(arena.data)
        handle = local_pb2.ArenaHandle(arena_id=arena.arena_id, size_bytes=arena.size_bytes, fd_index=-1)
        cuda = handle.cuda
        cuda.device = int(device)
        cuda.handle = bytes(ipc)
        cuda.allocation_size_bytes = int(size)
        cuda.offset_bytes = int(offset)
        cuda.ref_counter_handle = bytes(counter)
        cuda.ref_counter_offset = int(counter_offset)
        cuda.event_handle = bytes(ipc_event or b"")
        cuda.event_sync_required = bool(sync)
        cuda.device_uuid = self.device_uuid
        return handle
