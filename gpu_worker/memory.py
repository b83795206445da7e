"""Store memory: arenas, each one contiguous block that holds many segments.

On CPU an arena is a memfd (anonymous shared memory): the worker maps it, and
at commit hands the descriptor to the server, which keeps it open. The memory
therefore outlives the worker process: a restarted worker maps the same bytes
again, and an engine on the host can map them read-only. A memfd is not a
file in /dev/shm, so nothing is left behind and no /dev/shm size limit
applies; it counts against the container's memory limit like any memory.

On CUDA an arena is plain device memory owned by the worker process, and dies
with it (the store reads LOST until refilled).

Arenas are pre-faulted when created, so the first broadcast into them does not
pay a page fault per 4 KiB (on CPU that costs Gloo about 4x its throughput).
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass

import torch

MADV_POPULATE_WRITE = 23  # Linux 5.14+; mmap does not name it before Python 3.13
SEGMENT_ALIGN_BYTES = 4096
"""Segments start on page boundaries inside an arena (engines map whole arenas)."""


def align_segment(size: int) -> int:
    return -(-size // SEGMENT_ALIGN_BYTES) * SEGMENT_ALIGN_BYTES


@dataclass(slots=True)
class Arena:
    """One block of store memory; segments are byte ranges of `data`."""

    arena_id: int
    data: torch.Tensor
    """uint8 over the whole arena."""
    fd: int = -1
    """The memfd (host arenas); -1 for device memory."""
    mapping: mmap.mmap | None = None

    @property
    def size_bytes(self) -> int:
        return self.data.numel()

    @property
    def shareable(self) -> bool:
        """Whether the server can keep this arena alive (host shared memory)."""
        return self.fd >= 0

    def region(self, offset_bytes: int, size_bytes: int) -> torch.Tensor:
        return self.data[offset_bytes : offset_bytes + size_bytes]

    def release(self) -> None:
        """Unmap and close. Views handed out before must be dropped first."""
        self.data = torch.empty(0, dtype=torch.uint8)
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a view is still alive: the GC unmaps it later
                pass
            self.mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _map_host(fd: int, size_bytes: int, *, populate: bool) -> tuple[mmap.mmap, torch.Tensor]:
    mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if populate:
        try:
            mapping.madvise(MADV_POPULATE_WRITE, 0, size_bytes)
        except (OSError, ValueError):  # older kernel: touch every page by hand
            torch.frombuffer(mapping, dtype=torch.uint8).zero_()
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def allocate_arena(arena_id: int, size_bytes: int, device: torch.device) -> Arena:
    """A zero-filled, pre-faulted arena of at least one page."""
    size_bytes = align_segment(max(size_bytes, 1))
    if device.type != "cpu":
        return Arena(arena_id, torch.zeros(size_bytes, dtype=torch.uint8, device=device))
    fd = os.memfd_create(f"weightsync-arena-{arena_id}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size_bytes)
        mapping, data = _map_host(fd, size_bytes, populate=True)
    except BaseException:
        os.close(fd)
        raise
    return Arena(arena_id, data, fd, mapping)


def map_arena(arena_id: int, fd: int, size_bytes: int) -> Arena:
    """Map an arena handed over by the server (a restarted worker's store)."""
    actual = os.fstat(fd).st_size
    if actual != size_bytes:
        raise ValueError(f"arena {arena_id}: descriptor holds {actual} bytes, the manifest says {size_bytes}")
    mapping, data = _map_host(fd, size_bytes, populate=False)
    return Arena(arena_id, data, fd, mapping)


def map_ingress(fd: int, size_bytes: int) -> torch.Tensor | None:
    """The server's ingress, read-only (INLINE and SHM buckets arrive there)."""
    if fd <= 0 or size_bytes <= 0:
        return None
    mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    with warnings.catch_warnings():  # read-only on purpose: torch warns that it cannot write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)
