"""A worker's memory: its mappings of the node store, its staging buffers, and the device helpers.

The node store is the server's (server/store/arenas.py): memfd arenas it creates and keeps. A
worker maps every arena read-write (the descriptors come over its fd channel) and writes
the buckets it owns into them; the memory outlives the worker, so its death loses nothing.
A mapping's pages are faulted in when it is made, so the first bucket received into it
does not pay a page fault per 4 KiB (on CPU that costs Gloo about 4x its throughput).
That takes a while for a large arena and must never hold the GIL meanwhile: the worker's
heartbeat thread has to keep beating, or the server takes a busy worker for a stalled one
(mmap.madvise holds the GIL for the whole call; madvise through ctypes, in chunks, does not:
common/host_pinning.populate).

Faulting pages in never writes them: an arena a worker maps may already hold committed
weights (every mapping after a worker restart does), and only an update may write the
store. Where MADV_POPULATE_WRITE is missing (Linux < 5.14, gVisor) the pages are touched
by reading one byte of each. The server allocated every page of an arena (fallocate), so a
read fault maps the page itself, writable in a shared mapping without a write-notify hook
(shmem has none): the later write pays no second fault worth measuring.

A CUDA worker copies what NCCL delivered into its device staging buffers to the store
with the device's DMA engines: it pins each mapping (cudaHostRegister) when it maps it,
so those copies are asynchronous and at full speed. If pinning fails the copies still
work, synchronously, and the worker says so once.

The device helpers at the end are the CUDA decisions (what memory counts as available,
when to wait for the device's copies), kept small and pure where they can be, so they
are tested on CPU.
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass

import torch

from weightsync.common.host_pinning import MADV_POPULATE_WRITE, pin_host, populate, unpin_host
from weightsync.common.logging import get_logger

log = get_logger("weightsync.worker.memory")



@dataclass(slots=True)
class MappedArena:
    """One arena of the node store, mapped read-write in this worker."""

    arena_id: int
    data: torch.Tensor
    """uint8 over the whole arena."""
    mapping: mmap.mmap
    pinned: list[int]
    """CUDA: base addresses registered with cudaHostRegister (unregistered when unmapped)."""

    @property
    def size_bytes(self) -> int:
        return self.data.numel()

    def region(self, offset_bytes: int, size_bytes: int) -> torch.Tensor:
        return self.data[offset_bytes : offset_bytes + size_bytes]

    def release(self) -> None:
        """Unpin and unmap. Views handed out before must be dropped first."""
        unpin_host(self.pinned)
        self.pinned = []
        self.data = torch.empty(0, dtype=torch.uint8)
        try:
            self.mapping.close()
        except BufferError:  # a view is still alive: the GC unmaps it later
            pass


def map_arena(arena_id: int, fd: int, size_bytes: int, device: torch.device) -> MappedArena:
    """Map an arena the server sent, fault its pages in, and pin it on a CUDA worker; closes `fd`."""
    try:
        actual = os.fstat(fd).st_size
        if actual != size_bytes:
            raise ValueError(f"arena {arena_id}: its descriptor holds {actual} bytes, the server says {size_bytes}")
        mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory; the server holds the arena itself
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    # Pages first, then pinning: on the first GPU machine (H200 host, 8 GiB, bench/results/gpu-h200.md)
    # MADV_POPULATE_WRITE then cudaHostRegister took 2.33 + 0.36 s, cudaHostRegister faulting the pages
    # in itself 3.71 s.
    populated = populate(data, MADV_POPULATE_WRITE)
    pinned = pin_host(data) if device.type == "cuda" else []
    if not populated:
        log.info("arena_pages_touched_by_reading", arena_id=arena_id, size_bytes=size_bytes,
                 reason="MADV_POPULATE_WRITE refused (Linux < 5.14?)")
    return MappedArena(arena_id, data, mapping, pinned)


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
