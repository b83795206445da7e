"""Host memory pinned for a GPU's DMA engines (issue 44: L2, L4), decided on CPU against a fake CUDA runtime: the
kept delta copy of CUDA tensors pinned at its own size and given back with its last tensor (torch's pin_memory=True
rounds each allocation up to a power of two and keeps it), and a mapping faulted in before cudaHostRegister (the
driver faulting it itself ran ~10x slower). tests/gpu/test_host_memory.py measures both on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_collective_bounds import FakeCudaRuntime

from weightsync.common import host_pinning


def test_pinned_host_memory_is_its_exact_size_and_goes_back_when_its_last_tensor_does():
    """torch's pin_memory=True rounds each allocation up to a power of two and keeps it for the process's life."""
    import gc

    cuda = FakeCudaRuntime()
    data = host_pinning.pinned_host_empty(10_000, runtime=cuda.runtime())
    page = host_pinning.PAGE_BYTES
    rounded = -(-10_000 // page) * page
    assert data.numel() == 10_000 and data.untyped_storage().nbytes() == rounded
    assert cuda.calls == [("register", rounded, host_pinning.DEFAULT)]
    view = data[4096:].view(torch.int16)
    del data
    gc.collect()
    view.fill_(7)  # the view keeps it pinned and mapped
    assert cuda.calls == [("register", rounded, host_pinning.DEFAULT)]
    del view
    gc.collect()
    assert cuda.calls == [("register", rounded, host_pinning.DEFAULT), ("unregister",)]
    again = host_pinning.pinned_host_empty(4, runtime=cuda.runtime())  # the next one is pinned as the first
    assert again.numel() == 4 and cuda.calls[-1] == ("register", page, host_pinning.DEFAULT)


def test_a_cuda_tensors_kept_copy_is_pinned_at_its_own_size(monkeypatch):
    from weightsync.client.delta import _Home

    cuda = FakeCudaRuntime()
    monkeypatch.setattr(host_pinning, "cuda_runtime", cuda.runtime)
    kept = _Home(torch.device("cpu"), pinned=True).empty((3, 1000), torch.bfloat16)
    assert kept.shape == (3, 1000) and kept.dtype == torch.bfloat16
    page = host_pinning.PAGE_BYTES
    assert kept.untyped_storage().nbytes() == -(-6000 // page) * page  # not 8192 rounded up to a power of two
    assert cuda.calls == [("register", kept.untyped_storage().nbytes(), host_pinning.DEFAULT)]
    kept.copy_(torch.ones(3, 1000, dtype=torch.bfloat16))
    assert float(kept.float().sum()) == 3000.0


@pytest.mark.parametrize(("flags", "advice"), [(host_pinning.READ_ONLY, host_pinning.MADV_POPULATE_READ),
                                               (host_pinning.DEFAULT, host_pinning.MADV_POPULATE_WRITE)])
def test_a_mapping_is_faulted_in_before_it_is_pinned(monkeypatch, flags, advice):
    """cudaHostRegister faulting the pages itself ran ~10x slower than faulting them first (2.27 vs 23.8 GB/s on
    the H200's host, read-only)."""
    cuda = FakeCudaRuntime()
    monkeypatch.setattr(host_pinning, "populate", lambda data, how: cuda.calls.append(("populate", how)) or True)
    host_pinning.pin_host(torch.zeros(8, dtype=torch.uint8), flags, runtime=cuda.runtime(), prefault=True)
    assert cuda.calls == [("populate", advice), ("register", 8, flags)]
    unsupported = FakeCudaRuntime(read_only=False)
    host_pinning.pin_host(torch.zeros(8, dtype=torch.uint8), host_pinning.READ_ONLY, runtime=unsupported.runtime(),
                          prefault=True)
    assert unsupported.calls == [] and len(cuda.calls) == 2  # not registered: not faulted for it either
