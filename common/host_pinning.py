"""Pinning host memory that is already mapped (the node store's arenas) for a GPU's DMA engines.

cudaHostRegister through torch's binding, in chunks (one call of 512 GiB or more fails on
recent drivers). It pins every page (about 0.1 s per GB) so that copies between the host
mapping and a GPU are asynchronous and run at full speed; a read-only mapping needs the
READ_ONLY flag. Where the driver refuses, nothing is pinned and copies still work,
synchronously: the caller is told by an empty result and a warning, once per mapping.
"""

from __future__ import annotations

import torch

from weightsync.common.logging import get_logger

log = get_logger("weightsync.pinning")

DEFAULT = 0
"""cudaHostRegisterDefault: a read-write mapping."""
READ_ONLY = 8
"""cudaHostRegisterReadOnly: a PROT_READ mapping (an engine's view of the store)."""
CHUNK_BYTES = 64 << 30


def pin_host(data: torch.Tensor, flags: int = DEFAULT) -> list[int]:
    """Register a host mapping (uint8) with CUDA; the base addresses to unpin, or [] where refused."""
    registered: list[int] = []
    base, size = data.data_ptr(), data.numel()
    cudart = torch.cuda.cudart()
    for start in range(0, size, CHUNK_BYTES):
        length = min(CHUNK_BYTES, size - start)
        result = cudart.cudaHostRegister(base + start, length, flags)
        code = int(getattr(result, "value", result))
        if code != 0:
            unpin_host(registered)
            log.warning("host_pinning_refused", size_bytes=size, flags=flags, cuda_error=code)
            return []
        registered.append(base + start)
    return registered


def unpin_host(bases: list[int]) -> None:
    for base in bases:
        torch.cuda.cudart().cudaHostUnregister(base)
