"""The node store's memory: arenas, host memory the server creates and keeps.

An arena is a memfd: anonymous shared memory with no name in /dev/shm (nothing is
left behind, and /dev/shm's size limit does not apply), counted against the
container's memory like any memory. The server holds each arena's descriptor,
which keeps its memory alive whatever happens to the workers: they map the arenas
(the descriptors travel to them over the fd channel) and write buckets into them;
engines map them read-only (local socket). The server maps them read-only too, to
compute checksums.

A new arena's pages are allocated when it is created (fallocate), so admission's
"it fits" is true when the bytes arrive, and nothing is zeroed on the hot path.
That takes about a tenth of a second per GB and runs in a thread: the event loop
keeps serving.

No arena is larger than one cudaHostRegister call takes (host_pinning.CHUNK_BYTES, 256 GiB):
an update's segments are packed into as many arenas as that needs (pack_segments), a segment
never split. A larger arena would be pinned in pieces, and a copy of a segment lying across
two registrations is not one pinned range to the driver.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.common.errors import ResourceExhausted
from weightsync.common.host_pinning import CHUNK_BYTES
from weightsync.common.layout import align_segment

ARENA_MAX_BYTES = CHUNK_BYTES
"""The largest arena the store makes for several segments (see the module docstring)."""


def pack_segments(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """The arenas for segments of `sizes` (aligned, in their order): lists of consecutive indexes whose sizes
    add up to at most `limit` each; a segment larger than `limit` alone in its arena."""
    arenas: list[list[int]] = []
    held = 0
    for index, size in enumerate(sizes):
        if arenas and held + size <= limit:
            arenas[-1].append(index)
            held += size
        else:
            arenas.append([index])
            held = size
    return arenas


MAP_FLOOR_BYTES_PER_SECOND = 1 << 30
"""The slowest rate at which a worker is expected to map arenas: fault every page in, or pin it
with cudaHostRegister (which faults pages in itself). Either runs at several GB/s on one
process; 1 GiB/s leaves room for every worker and engine of a node doing it at once."""


def map_timeout(base_seconds: float, size_bytes: int) -> float:
    """How long a worker may take to map `size_bytes` of new arenas: the command bound, plus the
    bytes at the floor rate. A fixed bound does not scale: a 140 GB model with its STAGED shadow
    is ~280 GB to map, and a worker killed for taking longer maps it all again after its restart."""
    return base_seconds + max(0, size_bytes) / MAP_FLOOR_BYTES_PER_SECOND


@dataclass(slots=True)
class HostArena:
    """One arena: its descriptor (the server's hold on the memory) and size."""

    arena_id: int
    fd: int
    size_bytes: int
    _read: mmap.mmap | None = None
    _data: torch.Tensor | None = None

    def readable(self) -> torch.Tensor:
        """The arena's bytes, mapped read-only in the server (uint8)."""
        if self._data is None:
            self._read = mmap.mmap(self.fd, self.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with warnings.catch_warnings():  # read-only on purpose: torch warns that it cannot write
                warnings.simplefilter("ignore", UserWarning)
                self._data = torch.frombuffer(self._read, dtype=torch.uint8)
        return self._data

    def close(self) -> None:
        self._data = None
        if self._read is not None:
            try:
                self._read.close()
            except BufferError:  # a view is still alive (a checksum in flight): the GC unmaps it
                pass
            self._read = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _create(arena_id: int, size_bytes: int) -> HostArena:
    fd = os.memfd_create(f"weightsync-arena-{arena_id}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size_bytes)
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as error:
        os.close(fd)
        raise ResourceExhausted("HOST_OUT_OF_MEMORY", f"could not allocate a {size_bytes}-byte store arena: {error}",
                                needed_bytes=size_bytes) from error
    return HostArena(arena_id, fd, size_bytes)


class ArenaTable:
    """Every arena of the node store, by id; ids are never reused in a server's life."""

    def __init__(self) -> None:
        self.arenas: dict[int, HostArena] = {}
        self._next_id = 1

    @property
    def held_bytes(self) -> int:
        return sum(a.size_bytes for a in self.arenas.values())

    async def allocate(self, size_bytes: int) -> HostArena:
        """A zero-filled arena of at least one page, its memory allocated (in a thread)."""
        arena_id = self._next_id
        self._next_id += 1
        arena = await asyncio.to_thread(_create, arena_id, align_segment(max(size_bytes, 1)))
        self.arenas[arena_id] = arena
        return arena

    def release(self, arena_id: int) -> None:
        arena = self.arenas.pop(arena_id, None)
        if arena is not None:
            arena.close()

    def close(self) -> None:
        for arena_id in list(self.arenas):
            self.release(arena_id)
