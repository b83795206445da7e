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
Pre-faulting a large arena takes seconds, and must never hold the GIL meanwhile:
the worker's heartbeat thread has to keep beating, or the server takes a busy
worker for a stalled one (mmap.madvise holds the GIL for the whole call; madvise
through ctypes, in chunks, does not).

The device helpers at the end are the CUDA decisions of the store (what memory
counts as available, when to wait for the device's copies), kept small and
pure where they can be, so they are tested on CPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from dataclasses import dataclass

import torch

MADV_POPULATE_WRITE = 23  # Linux 5.14+; mmap does not name it before Python 3.13
POPULATE_CHUNK_BYTES = 64 << 20
"""Pre-fault in chunks: each madvise call is short even where the GIL would be held."""
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


def _libc_madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def populate(data: torch.Tensor) -> None:
    """Fault in every page of a host mapping for writing, without holding the GIL.

    `data` is a uint8 tensor over a page-aligned mapping. Chunked, so even the
    fallback (a kernel without MADV_POPULATE_WRITE: torch zeroes each chunk, which
    also releases the GIL) lets other threads run between chunks."""
    size = data.numel()
    base = data.data_ptr()
    for start in range(0, size, POPULATE_CHUNK_BYTES):
        length = min(POPULATE_CHUNK_BYTES, size - start)
        if _madvise is None or _madvise(base + start, length, MADV_POPULATE_WRITE) != 0:
            data[start : start + length].zero_()  # older kernel: touch the pages by hand


def _map_host(fd: int, size_bytes: int, *, prefault: bool) -> tuple[mmap.mmap, torch.Tensor]:
    mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    if prefault:
        populate(data)
    return mapping, data


def allocate_arena(arena_id: int, size_bytes: int, device: torch.device) -> Arena:
    """A zero-filled, pre-faulted arena of at least one page."""
    size_bytes = align_segment(max(size_bytes, 1))
    if device.type != "cpu":
        return Arena(arena_id, torch.zeros(size_bytes, dtype=torch.uint8, device=device))
    fd = os.memfd_create(f"weightsync-arena-{arena_id}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size_bytes)
        mapping, data = _map_host(fd, size_bytes, prefault=True)
    except BaseException:
        os.close(fd)
        raise
    return Arena(arena_id, data, fd, mapping)


def map_arena(arena_id: int, fd: int, size_bytes: int) -> Arena:
    """Map an arena handed over by the server (a restarted worker's store)."""
    actual = os.fstat(fd).st_size
    if actual != size_bytes:
        raise ValueError(f"arena {arena_id}: descriptor holds {actual} bytes, the manifest says {size_bytes}")
    mapping, data = _map_host(fd, size_bytes, prefault=False)
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


# -- device memory (CUDA) -------------------------------------------------------------------
def device_available_bytes(free_bytes: int, reserved_bytes: int, allocated_bytes: int) -> int:
    """What this worker can still allocate on its device: the driver's free memory, plus what
    torch's caching allocator reserved but no tensor uses (torch hands that out first).
    Counting the cache as used made retries after an abort fail DEVICE_OUT_OF_MEMORY."""
    return max(0, free_bytes) + max(0, reserved_bytes - allocated_bytes)


def available_bytes(device: torch.device) -> int:
    """device_available_bytes of a CUDA device, as this process sees it."""
    free, _total = torch.cuda.mem_get_info(device)
    return device_available_bytes(int(free), torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def release_cached_device_memory(device: torch.device) -> None:
    """Give the blocks torch cached (e.g. an aborted update's arena) back to the device,
    so an engine on the same GPU can use them too. A no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synchronize_device(device: torch.device) -> None:
    """Wait until the copies enqueued on this device's current stream are done. The store
    enqueues every copy there, after the broadcast (the group waits on its own stream).
    A no-op on CPU, where copies are synchronous."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
