"""Host registration, where only a GPU can show it (issue 33: items 13, 14).

The decisions behind these are tested on CPU in tests/unit/test_collective_bounds.py; here the CUDA runtime
confirms what its documentation says. A group whose other rank never connects is in test_nccl_pairs.py (in a
process of its own: the failed communicator lingers until TORCH_NCCL_NONBLOCKING_TIMEOUT). Skipped without
CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import dataclasses
import mmap
import os
import warnings

import pytest
import torch

from weightsync.common import host_pinning

pytestmark = pytest.mark.timeout(120)


def test_a_refused_registration_leaves_no_error_for_the_next_kernel():
    """Registering the same range twice is refused (cudaErrorHostMemoryAlreadyRegistered): without clearing
    the thread's last error, the next kernel launch's check raised it."""
    data = torch.zeros(1 << 20, dtype=torch.uint8)
    first = host_pinning.pin_host(data)
    assert first, "the first registration of a fresh mapping should be taken"
    try:
        assert host_pinning.pin_host(data) == []  # refused: registered already
        x = torch.ones(16, device="cuda")
        assert float((x + 1).sum()) == 32.0  # launches a kernel: its launch check must find no stale error
    finally:
        host_pinning.unpin_host(first)


def test_read_only_registration_is_asked_about_and_used_only_where_supported():
    runtime = host_pinning.cuda_runtime()
    supported = runtime.read_only_supported()
    fd = os.memfd_create("ws-read-only")
    try:
        os.ftruncate(fd, 1 << 20)
        os.posix_fallocate(fd, 0, 1 << 20)  # as the server makes every arena: no holes under the mapping
        view = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # read-only on purpose
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(view, dtype=torch.uint8)
        codes: list[int] = []

        def register(pointer: int, size: int, flags: int) -> int:
            codes.append(int(getattr(result := runtime.register(pointer, size, flags), "value", result)))
            return result

        recording = dataclasses.replace(runtime, register=register)
        pinned = host_pinning.pin_host(data, host_pinning.READ_ONLY, runtime=recording)
        assert bool(pinned) is supported, (f"read-only supported: {supported}, cudaHostRegister returned {codes}, "
                                           f"libcudart found: {host_pinning._loaded_cudart() is not None}")
        host_pinning.unpin_host(pinned)
        assert float(torch.ones(4, device="cuda").sum()) == 4.0  # nothing stale either way
        del data
        view.close()
    finally:
        os.close(fd)
