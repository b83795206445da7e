"""Host memory a GPU pins (issue 44: L2, L4, P4), measured where only a GPU can: the kept delta copy of CUDA tensors
pins its own size and gives it back; a read-only mapping (an engine's view of the store) faulted in before it is
registered, against cudaHostRegister faulting it itself; several processes pre-faulting and pinning the same arena
at once, each above the server's floor (server/store/arenas.py). The rates are recorded (gpukit.record), not asserted
beyond that floor: speed is the bench's (bench/gpu.py)."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from weightsync.client.delta.base import DeltaBase
from weightsync.common import host_pinning
from weightsync.server.store.arenas import MAP_FLOOR_BYTES_PER_SECOND

from gpukit import record

pytestmark = pytest.mark.timeout(240)

GIB = 1 << 30
ARENA_BYTES = 4 * GIB
"""The memfd each registration test maps (the lent machine has 128 GiB: 256 GiB arenas cannot be tried there)."""
FLOOR_BYTES_PER_SECOND = MAP_FLOOR_BYTES_PER_SECOND
"""The slowest map the server allows a worker: slower, and the worker is killed."""


def resident_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_the_kept_copy_of_cuda_tensors_pins_its_own_size_and_gives_it_back():
    """torch's pin_memory=True would round each tensor up to a power of two (1.16 GiB -> 2 GiB) and keep it."""
    g = torch.Generator(device="cuda").manual_seed(44)
    named = [("embed", torch.randn(151936, 4096, device="cuda", generator=g).to(torch.bfloat16)),  # 1.16 GiB
             ("mlp", torch.randn(80 << 20, device="cuda", generator=g)),  # 0.31 GiB
             ("norm", torch.randn(24 << 20, device="cuda", generator=g).half())]  # 48 MiB
    total = sum(t.numel() * t.element_size() for _, t in named)
    torch.cuda.synchronize()
    gc.collect()
    before = resident_bytes()
    host_before = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0)
    base = DeltaBase()  # WeightSyncClient's default: delta_host_copy=True
    started = time.monotonic()
    base.committed(named, None)
    took = time.monotonic() - started
    grown = resident_bytes() - before
    host_after = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0)
    for name, tensor in named:
        kept = base.tensors[name]
        assert kept.is_pinned() and torch.equal(kept, tensor.cpu()), name
    page = host_pinning.PAGE_BYTES
    assert base.memory_bytes <= total + len(named) * page
    base.drop()
    gc.collect()
    left = resident_bytes() - before
    record("kept_copy_pinned", bytes=total, resident_grown=grown, resident_left_after_drop=left, seconds=took,
           torch_host_reserved_grown=host_after - host_before)
    assert grown <= 1.1 * total and host_after - host_before < 64 << 20  # its own size, not torch's cache
    assert left <= 0.1 * total  # given back


@pytest.fixture
def arena():
    """A fallocated memfd, as the server makes each arena."""
    fd = os.memfd_create("ws-l4")
    os.ftruncate(fd, ARENA_BYTES)
    os.posix_fallocate(fd, 0, ARENA_BYTES)
    yield fd
    os.close(fd)


def read_only_view(fd: int) -> tuple[mmap.mmap, torch.Tensor]:
    mapping = mmap.mmap(fd, ARENA_BYTES, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only on purpose
        warnings.simplefilter("ignore", UserWarning)
        return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def test_a_read_only_mapping_faulted_in_first_pins_faster(arena):
    """L4: an engine pins each arena of the store READ_ONLY; faulted in first with MADV_POPULATE_READ (what
    EngineClient does now) against cudaHostRegister faulting every page itself."""
    if not host_pinning.cuda_runtime().read_only_supported():
        pytest.skip("this GPU does not take read-only registrations (cudaDevAttrHostRegisterReadOnlySupported)")
    rates = {}
    for prefault in (False, True):
        mapping, data = read_only_view(arena)
        started = time.monotonic()
        pinned = host_pinning.pin_host(data, host_pinning.READ_ONLY, prefault=prefault)
        seconds = time.monotonic() - started
        assert pinned, "the registration was refused"
        host_pinning.unpin_host(pinned)
        rates["faulted_first" if prefault else "unfaulted"] = ARENA_BYTES / seconds
        del data
        mapping.close()
    record("read_only_registration", bytes=ARENA_BYTES, gb_per_s={k: v / 1e9 for k, v in rates.items()})
    assert rates["faulted_first"] >= FLOOR_BYTES_PER_SECOND


MAPPER = textwrap.dedent('''
    import mmap, sys, time
    import torch
    from weightsync.common import host_pinning
    fd, size = int(sys.argv[1]), int(sys.argv[2])
    torch.cuda.init()
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    host_pinning.populate(data, host_pinning.MADV_POPULATE_WRITE)
    faulted = time.monotonic() - started
    pinned = host_pinning.pin_host(data)
    print(f"{faulted} {time.monotonic() - started} {len(pinned)}", flush=True)
''')


def test_four_processes_pre_fault_and_pin_one_arena_at_once_each_above_the_floor(arena):
    """P4: a node's workers (and its engines) map the same arenas at once; only one process was ever measured."""
    children = [subprocess.Popen([sys.executable, "-c", MAPPER, str(arena), str(ARENA_BYTES)], pass_fds=(arena,),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        for child in children:  # all at once
            child.stdin.write("go\n")
            child.stdin.flush()
        results = [child.stdout.readline().split() for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait(30)
    seconds = [float(total) for _, total, _ in results]
    record("concurrent_populate_register", processes=4, bytes=ARENA_BYTES,
           gb_per_s=[ARENA_BYTES / s / 1e9 for s in seconds], faulted_seconds=[float(f) for f, _, _ in results])
    assert all(int(chunks) >= 1 for _, _, chunks in results), results
    assert all(ARENA_BYTES / s >= FLOOR_BYTES_PER_SECOND for s in seconds), seconds
