"""Pinning host memory that is already mapped (the node store's arenas) for a GPU's DMA engines.

cudaHostRegister through torch's binding, in chunks (one call of 512 GiB or more fails on
recent drivers). It pins every page (about 0.1 s per GB) so that copies between the host
mapping and a GPU are asynchronous and run at full speed; a read-only mapping needs the
READ_ONLY flag, which not every device supports (cudaDevAttrHostRegisterReadOnlySupported):
it is asked first, and where it is missing the mapping is left pageable without trying.
Where the driver refuses, nothing is pinned and copies still work, synchronously: the caller
is told by an empty result and a warning, once per mapping.

A refused cudaHostRegister also leaves its error as the thread's CUDA "last error", which
the next kernel launch's check (torch's C10_CUDA_KERNEL_LAUNCH_CHECK reads cudaGetLastError)
would raise as its own: an engine's next forward pass failing with the registration's error.
The error is read and cleared (cudaGetLastError, in the thread that registered) right away.

cudaHostRegister faults in every page it has to, about ten times slower than the kernel does
it ahead (bench/results/gpu-h200.md: 2.27 GB/s for a read-only mapping, 23.8 GB/s once
faulted): `pin_host(prefault=True)` faults the pages in first (`populate`: MADV_POPULATE_READ
for a read-only mapping, MADV_POPULATE_WRITE for a writable one, through libc so the GIL is
not held; Linux < 5.14 reads one byte of each page instead; any other refusal is raised, since
reading such a page would raise SIGBUS).

`pinned_host_empty` is pinned host memory of exactly the size asked (page-rounded), registered
portable (every device's context of the process), given back to the system when the last tensor
over it is gone: torch's pin_memory=True rounds every
allocation up to a power of two and keeps it cached for the process's life (a 2.32 GiB tensor
pins 4 GiB, never returned).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightsync.common.logging import get_logger

log = get_logger("weightsync.pinning")

DEFAULT = 0
"""cudaHostRegisterDefault: a read-write mapping."""
PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the registering thread's current
device's (one process driving several GPUs; the CUDA docs promise that portability to cudaHostAlloc, not to
cudaHostRegister without the flag)."""
READ_ONLY = 8
"""cudaHostRegisterReadOnly: a PROT_READ mapping (an engine's view of the store)."""
CHUNK_BYTES = 256 << 30
"""The largest single registration (one of 512 GiB or more fails): an arena up to this size is one
registration, so no copy of one of its segments spans two."""
HOST_REGISTER_READ_ONLY_SUPPORTED = 113
"""cudaDevAttrHostRegisterReadOnlySupported."""
MADV_POPULATE_READ = 22  # Linux 5.14+; mmap does not name them before Python 3.13
MADV_POPULATE_WRITE = 23
POPULATE_CHUNK_BYTES = 64 << 20
"""Pre-fault in chunks: each madvise call is short even where the GIL would be held."""
PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class CudaRuntime:
    """The CUDA runtime calls pinning makes (the real ones: `cuda_runtime()`)."""

    register: Callable[[int, int, int], int]
    """cudaHostRegister(ptr, size, flags) -> cudaError_t"""
    unregister: Callable[[int], int]
    """cudaHostUnregister(ptr) -> cudaError_t"""
    take_last_error: Callable[[], int]
    """cudaGetLastError() in this thread: returns the last error and clears it."""
    read_only_supported: Callable[[], bool]
    """Whether the current device takes cudaHostRegisterReadOnly."""


def registration_chunks(size: int, limit: int = CHUNK_BYTES, boundaries: Sequence[int] = ()) -> list[tuple[int, int]]:
    """(offset, length) of each registration covering `size` bytes, none longer than `limit`. Given segment
    `boundaries` (offsets where a segment starts), a chunk ends at the last one that fits, so no segment is
    split across two registrations unless it alone is longer than `limit`."""
    cuts = sorted(b for b in set(boundaries) if 0 < b < size)
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < size:
        end = min(size, start + limit)
        if end < size:
            fitting = [b for b in cuts if start < b <= end]
            if fitting:
                end = fitting[-1]
        chunks.append((start, end - start))
        start = end
    return chunks


def pin_host(data: torch.Tensor, flags: int = DEFAULT, *, runtime: CudaRuntime | None = None,
             boundaries: Sequence[int] = (), prefault: bool = False) -> list[int]:
    """Register a host mapping (uint8) with CUDA; the base addresses to unpin, or [] where refused.
    `boundaries`: offsets in `data` where its segments start (see registration_chunks). `prefault`: fault
    every page in first (populate), unless the registration is not tried at all."""
    cuda = runtime if runtime is not None else cuda_runtime()
    base, size = data.data_ptr(), data.numel()
    if flags & READ_ONLY and not cuda.read_only_supported():
        log.warning("host_pinning_unsupported", size_bytes=size, flags=flags,
                    why="the device does not take read-only registrations: copies from this mapping are synchronous")
        return []
    if prefault:
        populate(data, MADV_POPULATE_READ if flags & READ_ONLY else MADV_POPULATE_WRITE)
    registered: list[int] = []
    for offset, length in registration_chunks(size, boundaries=boundaries):
        code = _code(cuda.register(base + offset, length, flags))
        if code != 0:
            cleared = _code(cuda.take_last_error())  # or the next kernel launch raises it as its own
            unpin_host(registered, runtime=cuda)
            log.warning("host_pinning_refused", size_bytes=size, flags=flags, cuda_error=code, cleared=cleared)
            return []
        registered.append(base + offset)
    return registered


def unpin_host(bases: list[int], *, runtime: CudaRuntime | None = None) -> None:
    if not bases:
        return
    cuda = runtime if runtime is not None else cuda_runtime()
    for base in bases:
        if _code(cuda.unregister(base)) != 0:
            cuda.take_last_error()


def _code(result: object) -> int:
    return int(getattr(result, "value", result))  # type: ignore[call-overload]


# -- faulting pages in ----------------------------------------------------------------------------
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


POPULATE_UNKNOWN = (errno.EINVAL, errno.ENOSYS)
"""What a kernel without MADV_POPULATE_* (Linux < 5.14, gVisor) answers: the pages are then read one by one. Any
other refusal (EFAULT: the range runs past the file's end; EHWPOISON: a poisoned page; ENOMEM) says reading a page
would raise SIGBUS or fail too, which would kill the process (an engine's: the vLLM rank): it is raised instead."""
POPULATE_RETRIES = 3
"""EINTR and EAGAIN: the chunk is asked again, this many times at most."""


class PopulateRefused(OSError):
    """The kernel refused to fault a mapping's pages in for a reason reading them would not survive."""


def populate(data: torch.Tensor, advice: int = MADV_POPULATE_WRITE) -> bool:
    """Fault in every page of a host mapping, without writing it and without holding the GIL.

    `data` is a uint8 tensor over a page-aligned mapping whose bytes may be committed weights: nothing
    here may change one of them. Chunked, so even the fallback (a kernel without MADV_POPULATE_*: torch
    reads one byte of each page, which also releases the GIL) lets other threads run between chunks.
    Returns whether the madvise did the work (False: the pages were touched by reading); raises
    PopulateRefused when the kernel refused for another reason than not knowing the advice (POPULATE_UNKNOWN)."""
    size = data.numel()
    base = data.data_ptr()
    advised = _madvise is not None
    for start in range(0, size, POPULATE_CHUNK_BYTES):
        length = min(POPULATE_CHUNK_BYTES, size - start)
        if advised and _advise(base + start, length, advice):
            continue
        advised = False  # the kernel does not know the advice: its answer for every chunk
        touch_pages(data[start : start + length])
    return advised


def _advise(address: int, length: int, advice: int) -> bool:
    """One chunk's madvise: True once done, False where the kernel does not know the advice; raises otherwise."""
    assert _madvise is not None
    for _ in range(POPULATE_RETRIES):
        if _madvise(address, length, advice) == 0:
            return True
        code = ctypes.get_errno()
        if code in POPULATE_UNKNOWN:
            return False
        if code not in (errno.EINTR, errno.EAGAIN):
            break
    raise PopulateRefused(code, f"madvise({advice}) refused {length} bytes at {address:#x}: {os.strerror(code)}; "
                                "reading those pages instead would raise SIGBUS")


def touch_pages(chunk: torch.Tensor) -> None:
    """Read one byte of each page of `chunk` (page-aligned uint8): a read fault per page, no write."""
    chunk[::PAGE_BYTES].max()


# -- pinned memory of its exact size --------------------------------------------------------------
class _PinnedPages:
    """Anonymous pages registered with CUDA, held by the tensors over them (through their buffer): unregistered,
    then unmapped, once the last of those is gone."""

    def __init__(self, mapping: mmap.mmap, runtime: CudaRuntime | None) -> None:
        self.mapping = mapping
        self.runtime = runtime
        self.bases: list[int] = []

    def __del__(self) -> None:
        try:
            unpin_host(self.bases, runtime=self.runtime)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the process frees it all
            pass
        self.mapping.close()


def pinned_host_empty(size_bytes: int, *, runtime: CudaRuntime | None = None) -> torch.Tensor:
    """`size_bytes` of pinned host memory (uint8, contents undefined), exactly that size rounded up to a page,
    given back to the system (unpinned, unmapped) when the last tensor over it is gone. Where the driver
    refuses the registration it is pageable memory all the same (copies from it synchronous; pin_host warns)."""
    length = max(1, -(-size_bytes // PAGE_BYTES)) * PAGE_BYTES
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    exported = (ctypes.c_uint8 * length).from_buffer(mapping)
    address = ctypes.addressof(exported)
    del exported  # its export of the mapping ends here: the pages' owner closes the mapping
    pages = _PinnedPages(mapping, runtime)
    window = type("PinnedWindow", (ctypes.c_uint8 * length,), {}).from_address(address)
    window.pages = pages  # the tensor's buffer holds the window, the window the pages
    data = torch.frombuffer(window, dtype=torch.uint8)
    # Fresh pages: faulted, then pinned for every device's context (the refresh thread's current device is the last
    # one whose stream it entered).
    pages.bases = pin_host(data, PORTABLE, runtime=runtime, prefault=True)
    return data[:size_bytes]


# -- the real runtime ----------------------------------------------------------------------------
def cuda_runtime() -> CudaRuntime:
    """torch's cudart binding for (un)registering; cudaGetLastError and cudaDeviceGetAttribute (which torch
    does not bind) from the same libcudart torch loaded: the last error lives in that library's state."""
    cudart = torch.cuda.cudart()
    library = _loaded_cudart()

    def take_last_error() -> int:
        return int(library.cudaGetLastError()) if library is not None else -1

    def read_only_supported() -> bool:
        if library is None:
            return True  # cannot ask: try, and a refusal is cleared like any other
        value = ctypes.c_int(0)
        device = torch.cuda.current_device()
        if library.cudaDeviceGetAttribute(ctypes.byref(value), HOST_REGISTER_READ_ONLY_SUPPORTED, device) != 0:
            library.cudaGetLastError()
            return False
        return value.value == 1

    return CudaRuntime(register=cudart.cudaHostRegister, unregister=cudart.cudaHostUnregister,
                       take_last_error=take_last_error, read_only_supported=read_only_supported)


def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart already mapped into this process (torch's), opened without loading another copy."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
    return None
