"""Host memory pinned for a GPU's DMA engines (issue 44: L2, L4), decided on CPU against a fake CUDA runtime: the
kept delta copy of CUDA tensors pinned at its own size and given back with its last tensor (torch's pin_memory=True
rounds each allocation up to a power of two and keeps it), and a mapping faulted in before cudaHostRegister (the
driver faulting it itself ran ~10x slower). tests/gpu/test_host_memory.py measures both on a GPU."""

from __future__ import annotations

import errno

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
    # Portable: pinned for every device's context, not only the registering thread's current one (review H3, F13).
    assert cuda.calls == [("register", rounded, host_pinning.PORTABLE)]
    view = data[4096:].view(torch.int16)
    del data
    gc.collect()
    view.fill_(7)  # the view keeps it pinned and mapped
    assert cuda.calls == [("register", rounded, host_pinning.PORTABLE)]
    del view
    gc.collect()
    assert cuda.calls == [("register", rounded, host_pinning.PORTABLE), ("unregister",)]
    again = host_pinning.pinned_host_empty(4, runtime=cuda.runtime())  # the next one is pinned as the first
    assert again.numel() == 4 and cuda.calls[-1] == ("register", page, host_pinning.PORTABLE)


def test_a_cuda_tensors_kept_copy_is_pinned_at_its_own_size(monkeypatch):
    from weightsync.client.delta.base import _Home

    cuda = FakeCudaRuntime()
    monkeypatch.setattr(host_pinning, "cuda_runtime", cuda.runtime)
    kept = _Home(torch.device("cpu"), pinned=True).empty((3, 1000), torch.bfloat16)
    assert kept.shape == (3, 1000) and kept.dtype == torch.bfloat16
    page = host_pinning.PAGE_BYTES
    assert kept.untyped_storage().nbytes() == -(-6000 // page) * page  # not 8192 rounded up to a power of two
    assert cuda.calls == [("register", kept.untyped_storage().nbytes(), host_pinning.PORTABLE)]
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


# -- F12 (review H3): which madvise refusals fall back to reading the pages ------------------------------------
def refusing(code: int, calls: list[int], *, times: int = 10**9):
    """A madvise that refuses its first `times` calls with errno `code`, then does the work."""
    import ctypes

    def madvise(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        if len(calls) <= times:
            ctypes.set_errno(code)
            return -1
        return 0

    return madvise


REFUSALS = [  # errno -> what populate does: "read" the pages one by one, or "raise" (reading would SIGBUS)
    (errno.EINVAL, "read"),  # Linux < 5.14 does not know the advice
    (errno.ENOSYS, "read"),
    (errno.EFAULT, "raise"),  # the range runs past the file's end
    (133, "raise"),  # EHWPOISON (Linux; Python names it only from 3.14)
    (errno.ENOMEM, "raise"),
]


@pytest.mark.parametrize(("code", "outcome"), REFUSALS, ids=[errno.errorcode.get(c, "EHWPOISON") for c, _ in REFUSALS])
def test_only_a_kernel_that_does_not_know_the_advice_gets_its_pages_read(monkeypatch, code, outcome):
    calls: list[int] = []
    touched: list[int] = []
    monkeypatch.setattr(host_pinning, "_madvise", refusing(code, calls))
    monkeypatch.setattr(host_pinning, "touch_pages", lambda chunk: touched.append(chunk.numel()))
    monkeypatch.setattr(host_pinning, "POPULATE_CHUNK_BYTES", 4 * host_pinning.PAGE_BYTES)
    data = torch.zeros(10 * host_pinning.PAGE_BYTES, dtype=torch.uint8)
    if outcome == "read":
        assert host_pinning.populate(data, host_pinning.MADV_POPULATE_READ) is False
        assert calls == [host_pinning.MADV_POPULATE_READ] and sum(touched) == data.numel()  # asked once, then read
    else:
        with pytest.raises(host_pinning.PopulateRefused) as refused:
            host_pinning.populate(data, host_pinning.MADV_POPULATE_READ)
        assert refused.value.errno == code and touched == []  # never read: that would be SIGBUS
    monkeypatch.undo()  # the real madvise: the next mapping is faulted in
    assert host_pinning.populate(torch.zeros(host_pinning.PAGE_BYTES, dtype=torch.uint8)) in (True, False)


def test_an_interrupted_madvise_is_asked_again(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(host_pinning, "_madvise", refusing(errno.EINTR, calls, times=2))
    monkeypatch.setattr(host_pinning, "touch_pages", lambda chunk: pytest.fail("read after an EINTR"))
    assert host_pinning.populate(torch.zeros(host_pinning.PAGE_BYTES, dtype=torch.uint8)) is True
    assert len(calls) == 3


# -- F8 (review H3): the kept copy's pages outlive the copies queued into them ------------------------------------
def test_a_background_take_given_up_on_keeps_the_tensors_it_copies_into_until_its_thread_ended(monkeypatch):
    """A kept CUDA tensor's copy is pinned host memory, unmapped with its last tensor; a take given up on may still
    have DMAs queued into it (tests/gpu/test_delta_cuda.py shows the failed take's side on a GPU)."""
    import gc
    import threading
    import weakref

    from weightsync.client.delta import base as delta_module
    from weightsync.client.delta.base import DeltaBase

    base = DeltaBase()
    named = [("a", torch.arange(4096, dtype=torch.float32))]
    base.committed(named, None)
    kept = weakref.ref(base.tensors["a"])
    release = threading.Event()
    with monkeypatch.context() as patched:
        patched.setattr(delta_module, "_TAKE_TIMEOUT", 0.1)
        patched.setattr(base, "_take", lambda *args: release.wait(30))
        base.take_in_background(named, None)
        assert base._settle() is False and base.tensors == {} and not base.claims
    gc.collect()
    assert kept() is not None  # its take may still be copying into it
    taking = base._abandoned[0][0]
    release.set()
    assert taking.wait(5)
    base.forget()  # any later call lets go of what the ended take held
    gc.collect()
    assert kept() is None and base._abandoned == []
    base.committed(named, None)  # the next push's copy, claimed
    assert base.claims and torch.equal(base.tensors["a"], named[0][1])
