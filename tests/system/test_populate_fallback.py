"""A worker that maps the node store on a kernel without MADV_POPULATE_WRITE (Linux < 5.14: RHEL 8,
Ubuntu 20.04; gVisor) must not write one byte of it.

Every mapping a restarted worker makes is over arenas that already hold committed weights: a
pre-fault that writes (the old fallback zeroed each chunk) silently zero-filled them while the
store said CONSISTENT. These tests make this kernel refuse that madvise the way an old one does
(an LD_PRELOAD shim, compiled here, that fails `madvise(..., 23)` with EINVAL) and check, after a
worker restart, that every committed byte is still there: for STAGED and IN_PLACE, for a partial
push owned by the restarted worker and by the other, across two partial pushes, and for an engine
that holds the committed version while the restarted worker maps the store and a push runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.common.ownership import bucket_owners
from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server, wait_for

pytestmark = pytest.mark.timeout(240)
BUCKET = 256 << 10
TENSORS = 8

SHIM = textwrap.dedent("""
    #define _GNU_SOURCE
    #include <dlfcn.h>
    #include <errno.h>
    #include <stddef.h>
    /* A kernel older than 5.14 answers MADV_POPULATE_READ (22) and _WRITE (23) with EINVAL. */
    int madvise(void *addr, size_t length, int advice) {
        static int (*real)(void *, size_t, int);
        if (advice == 22 || advice == 23) { errno = EINVAL; return -1; }
        if (!real) real = (int (*)(void *, size_t, int))dlsym(RTLD_NEXT, "madvise");
        return real(addr, length, advice);
    }
""")


@pytest.fixture(scope="module")
def old_kernel_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process whose madvise refuses MADV_POPULATE_WRITE, as Linux < 5.14 does."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the madvise shim")
    directory = tmp_path_factory.mktemp("shim")
    source, library = directory / "no_populate.c", directory / "no_populate.so"
    source.write_text(SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True)
    return {**os.environ, "LD_PRELOAD": str(library)}


def test_the_shim_makes_populate_fall_back_and_the_fallback_writes_nothing(old_kernel_env):
    """The shim really refuses the madvise (else every test below tests the kernel's path), and the
    fallback leaves a mapping's bytes exactly as they were."""
    probe = textwrap.dedent("""
        import mmap, os, torch
        from weightsync.gpu_worker.memory import populate
        size = 3 * (64 << 20) + 4096  # several chunks and a partial one
        fd = os.memfd_create("probe")
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        data = torch.frombuffer(mapping, dtype=torch.uint8)
        pattern = torch.arange(size, dtype=torch.int64).remainder_(251).to(torch.uint8) + 1
        data.copy_(pattern)
        advised = populate(data)
        print(advised, bool(torch.equal(data, pattern)))
    """)
    out = subprocess.run([sys.executable, "-c", probe], env=old_kernel_env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def model(seed: int) -> dict[str, torch.Tensor]:
    """8 tensors of 384 KiB, one bucket each at 256 KiB buckets (a tensor larger than a bucket gets its own)."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(96 * 1024, generator=g) for i in range(TENSORS)}


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def engine_bytes(server) -> dict[str, torch.Tensor]:
    with EngineClient(server=server.address, name="reader") as engine, engine.acquire() as snapshot:
        return {n: t.clone() for n, t in snapshot.tensors.items()}


def assert_holds(server, expected: dict[str, torch.Tensor]) -> None:
    """What an engine reads is `expected`, bit for bit, and so are the store's own checksums."""
    seen = engine_bytes(server)
    assert sorted(seen) == sorted(expected)
    wrong = [n for n, t in expected.items() if not torch.equal(seen[n].view(torch.int32), t.view(torch.int32))]
    assert wrong == []
    assert server_checksums(server) == [local_checksums(expected)]
    assert info(server).store.state == pb.STORE_STATE_CONSISTENT


def restart_worker(server, index: int) -> None:
    """SIGKILL worker `index` and wait until its successor runs."""
    victim = info(server).workers[index]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: (w := info(server).workers[index]).state == pb.WORKER_STATE_RUNNING and w.pid != victim.pid,
             timeout=60)


def owner_of_a_one_tensor_push(workers: int) -> int:
    """A push of one 384 KiB tensor is one bucket; the worker that owns it."""
    return bucket_owners([96 * 1024 * 4], workers)[0]


@pytest.fixture
def node(tmp_path, old_kernel_env):
    server = start_server(tmp_path, workers=2, env=old_kernel_env)
    yield server
    if server.process.poll() is None:
        assert server.stop() == 0, server.log()[-2000:]


@pytest.mark.parametrize("mode", ["staged", "in_place"])
@pytest.mark.parametrize("restarted", ["owner", "other"])
def test_a_restarted_worker_keeps_every_committed_byte(node, mode, restarted):
    v1 = model(1)
    changed = "layers.3.w"
    owner = owner_of_a_one_tensor_push(2)
    with WeightSyncClient(node.address, timeout=60) as client:
        client.push(v1, version="v1", mode=mode, transport="inline", bucket_size_bytes=BUCKET,
                    allow_new_tensors=True)
        restart_worker(node, owner if restarted == "owner" else 1 - owner)
        partial = {changed: model(2)[changed]}
        client.push(partial, version="v2", mode=mode, transport="inline", bucket_size_bytes=BUCKET, delta=False)
        expected = {**v1, **partial}
        assert "arena_pages_touched_by_reading" in node.log()  # the restarted worker took the fallback
        assert_holds(node, expected)
        assert client.verify(expected).ok
        # The next full push after it, and its verify: the node is whole.
        v3 = model(3)
        client.push(v3, version="v3", mode=mode, transport="inline", bucket_size_bytes=BUCKET)
        assert_holds(node, v3)
        assert client.verify(v3).ok


def test_a_restart_between_two_partial_pushes_loses_nothing(node):
    v1, v2 = model(4), model(5)
    with WeightSyncClient(node.address, timeout=60) as client:
        client.push(v1, version="v1", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
        first = {"layers.0.w": v2["layers.0.w"]}
        client.push(first, version="v2", transport="inline", bucket_size_bytes=BUCKET, delta=False)
        restart_worker(node, 0)
        restart_worker(node, 1)
        second = {"layers.7.w": v2["layers.7.w"]}
        client.push(second, version="v3", mode="staged", transport="inline", bucket_size_bytes=BUCKET, delta=False)
        expected = {**v1, **first, **second}
        assert_holds(node, expected)
        assert client.verify(expected).ok


def test_an_engine_reading_while_a_restarted_worker_maps_the_store_sees_the_committed_bytes(node):
    v1 = model(6)
    with WeightSyncClient(node.address, timeout=60) as client:
        client.push(v1, version="v1", mode="staged", transport="inline", bucket_size_bytes=BUCKET,
                    allow_new_tensors=True)
        with EngineClient(server=node.address, name="steady") as engine, engine.acquire() as snapshot:
            restart_worker(node, 0)
            restart_worker(node, 1)
            # The restarted workers map every arena at this push's prepare, under the engine's lease.
            partial = {"layers.5.w": model(7)["layers.5.w"]}
            client.push(partial, version="v2", mode="staged", transport="inline", bucket_size_bytes=BUCKET,
                        delta=False)
            assert snapshot.version.version == "v1"
            wrong = [n for n, t in v1.items()
                     if not torch.equal(snapshot.tensors[n].view(torch.int32), t.view(torch.int32))]
            assert wrong == []
        expected = {**v1, **partial}
        assert_holds(node, expected)
        assert client.verify(expected).ok
