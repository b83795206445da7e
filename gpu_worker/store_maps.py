"""The arenas of the node store a worker has mapped, and its bytes and tensors there."""

from __future__ import annotations

import torch

from weightsync.common import dtypes
from weightsync.common.errors import FailedPrecondition
from weightsync.gpu_worker.memory import MappedArena
from weightsync.worker.v1 import worker_pb2 as wpb


class StoreMaps:
    """The arenas of the node store this worker has mapped."""

    def __init__(self) -> None:
        self.arenas: dict[int, MappedArena] = {}

    def add(self, arena: MappedArena) -> None:
        old = self.arenas.pop(arena.arena_id, None)
        if old is not None:
            old.release()
        self.arenas[arena.arena_id] = arena

    def drop(self, arena_ids) -> None:
        for arena_id in arena_ids:
            arena = self.arenas.pop(arena_id, None)
            if arena is not None:
                arena.release()

    def bytes_at(self, region: wpb.Region, size: int) -> torch.Tensor:
        arena = self.arenas.get(region.arena_id)
        if arena is None or region.offset_bytes < 0 or region.offset_bytes + size > arena.size_bytes:
            raise FailedPrecondition("ARENA_NOT_MAPPED", f"store bytes [{region.offset_bytes}, +{size}) of arena "
                                     f"{region.arena_id} are not mapped in this worker", arena=region.arena_id)
        return arena.region(region.offset_bytes, size)

    def tensor_at(self, region: wpb.Region, dtype: int, shape, name: str) -> torch.Tensor:
        torch_dtype = dtypes.to_torch(dtype, tensor=name)
        numel = 1
        for dim in shape:
            numel *= dim
        data = self.bytes_at(region, numel * torch_dtype.itemsize)
        return data.view(torch_dtype).view(tuple(shape)) if numel else torch.empty(tuple(shape), dtype=torch_dtype)

    def release(self) -> None:
        self.drop(list(self.arenas))
