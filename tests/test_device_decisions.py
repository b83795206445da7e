"""The CUDA/NCCL decisions of a worker and of the trainer's groups, tested on CPU.

There is no GPU here: each decision is a small function or class, tested with fakes, and
what can run for real on CPU (a Gloo group's close, a worker process on a missing device)
runs for real.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.distributed import TCPStore

import weightsync.gpu_worker.store as store_module
from weightsync.client.planning import build_plan, plan_proto
from weightsync.common.collective import (
    NCCL_CLEAN_UP_ONLY,
    NCCL_ERROR_HANDLING,
    NCCL_NONBLOCKING_TIMEOUT,
    CollectiveGroup,
    bucket_tail,
    group_construction_environment,
    nccl_ifname_setting,
    nccl_options,
    open_group,
    pin_nccl_interface,
    tail_length,
    worker_nccl_environment,
)
from weightsync.common.plan_id import plan_id_of
from weightsync.common.shm_queue import OwnedQueue
from weightsync.gpu_worker.device_faults import (
    EXIT_DEVICE_FAULT,
    EXIT_DEVICE_LOST,
    DeviceFault,
    classify,
)
from weightsync.gpu_worker.memory import device_available_bytes
from weightsync.gpu_worker.store import WeightStore
from weightsync.gpu_worker.update_plan import derive_update_plan
from weightsync.gpu_worker.worker import Worker
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

pytestmark = pytest.mark.timeout(120)


# -- torch's watchdog must not kill the process: CleanUpOnly for our groups only ----------------------
def test_a_worker_forces_clean_up_only_and_bounds_readiness_unless_the_operator_did():
    assert worker_nccl_environment({}) == {NCCL_ERROR_HANDLING: "2", NCCL_NONBLOCKING_TIMEOUT: "120"}
    inherited = {NCCL_ERROR_HANDLING: "3", NCCL_NONBLOCKING_TIMEOUT: "45"}  # 3 would terminate the worker
    assert worker_nccl_environment(inherited) == {NCCL_ERROR_HANDLING: "2"}


@pytest.mark.parametrize("before", [None, "3", "0", NCCL_CLEAN_UP_ONLY])
def test_the_trainers_groups_keep_their_own_error_handling(before):
    """CleanUpOnly while our group is constructed; afterwards exactly what the trainer had."""
    env = {} if before is None else {NCCL_ERROR_HANDLING: before}
    seen = []
    with group_construction_environment(env):
        seen.append(env.get(NCCL_ERROR_HANDLING))  # what ProcessGroupNCCL's constructor reads
    assert seen == [NCCL_CLEAN_UP_ONLY]
    assert env == ({} if before is None else {NCCL_ERROR_HANDLING: before})
    with pytest.raises(RuntimeError), group_construction_environment(env):
        raise RuntimeError("the constructor failed")
    assert env == ({} if before is None else {NCCL_ERROR_HANDLING: before})


def test_nccl_groups_use_a_non_blocking_communicator_with_the_group_timeout():
    class Config:
        blocking = -1

    class Options:
        config = Config()
        _timeout = None

    timeout = datetime.timedelta(seconds=7)
    options = nccl_options(Options(), timeout)
    assert (options._timeout, options.config.blocking) == (timeout, 0)


# -- NCCL_SOCKET_IFNAME: once per process, from the caller's thread, an exact match ---------------------------
def test_the_nccl_interface_is_an_exact_match_and_set_once():
    assert nccl_ifname_setting(None, "eth1") == "=eth1"  # "eth1" alone would also match eth10
    assert nccl_ifname_setting("=eth0", "eth1") is None  # NCCL read the first one already
    assert nccl_ifname_setting("ib", "eth1") is None  # the operator's choice
    assert nccl_ifname_setting(None, None) is None  # no interface holds the address: NCCL picks
    env: dict[str, str] = {}
    assert pin_nccl_interface("127.0.0.1", env) == "=lo" and env == {"NCCL_SOCKET_IFNAME": "=lo"}
    assert pin_nccl_interface("127.0.0.1", env) == "=lo"
    assert pin_nccl_interface("192.0.2.77", {}) is None  # TEST-NET: no local interface


# -- closing a group never holds its caller longer than the bound ------------------------------------------------
class HangingGroup:
    """A process group whose abort hangs (ncclCommAbort can), then returns when released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.aborted = threading.Event()
        self.thread: str | None = None

    def abort(self) -> None:
        self.thread = threading.current_thread().name
        self.aborted.set()
        self.release.wait(30)


def test_closing_a_group_whose_abort_hangs_returns_at_the_bound():
    pg = HangingGroup()
    group = CollectiveGroup("g", pb.BACKEND_NCCL, 1, 2, datetime.timedelta(seconds=5), torch.device("cpu"), pg)
    assert group.close(join_seconds=0.2) is False  # abandoned, not waited for
    assert pg.aborted.wait(5) and pg.thread == "close-g"  # the abort ran in a thread of its own
    pg.release.set()
    assert group.close() is True  # closed already: nothing to do


def join_pair(store: TCPStore, group_id: str, timeout: datetime.timedelta) -> list[CollectiveGroup]:
    """Rank 0 and rank 1 of a two-rank Gloo group, sorted by rank."""
    groups: list[CollectiveGroup] = []

    def join(rank: int) -> None:
        client = store if rank == 0 else TCPStore("127.0.0.1", store.port, None, False, timeout)
        groups.append(open_group(group_id=group_id, backend=pb.BACKEND_GLOO, store=client, rank=rank, world_size=2,
                                 timeout=timeout, device=torch.device("cpu"), local_address="127.0.0.1"))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return sorted(groups, key=lambda g: g.rank)


def test_a_real_gloo_group_closes_within_the_bound_and_the_next_group_works():
    timeout = datetime.timedelta(seconds=20)
    store = TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    for attempt in range(2):
        groups = join_pair(store, f"close-{attempt}", timeout)
        assert len(groups) == 2
        data = [torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
        works = [g.broadcast_async(d) for g, d in zip(groups, data, strict=True)]
        for g, w in zip(groups, works, strict=True):
            g.wait(w)
        assert torch.equal(data[1], data[0])
        assert all(g.close() for g in groups)


# -- the framing both sides share ---------------------------------------------------------------------------------
def test_the_tail_is_the_buckets_last_bytes():
    assert [tail_length(n) for n in (0, 1, 7, 8, 9, 1 << 20)] == [0, 1, 7, 8, 8, 8]
    data = torch.arange(100, dtype=torch.uint8)
    assert bucket_tail(data) == bytes(range(92, 100))
    assert bucket_tail(data[:3]) == bytes([0, 1, 2]) and bucket_tail(data[:0]) == b""


# -- admission counts torch's cache as available; aborts give the memory back -----------------------------------
def test_cached_but_unused_device_memory_counts_as_available():
    gib = 1 << 30
    assert device_available_bytes(free_bytes=2 * gib, reserved_bytes=10 * gib, allocated_bytes=3 * gib) == 9 * gib
    assert device_available_bytes(free_bytes=2 * gib, reserved_bytes=3 * gib, allocated_bytes=3 * gib) == 2 * gib
    assert device_available_bytes(free_bytes=0, reserved_bytes=0, allocated_bytes=0) == 0


def small_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(300, generator=g) for i in range(4)}


def derive(store: WeightStore, plan, mode=pb.UPDATE_MODE_STAGED, allow_new=False):
    return derive_update_plan(plan=plan, plan_id=plan_id_of(plan), mode=mode, allow_new_tensors=allow_new,
                              tensors=store.tensors, segment_signatures=[s.signature for s in store.segments],
                              layout_version=store.layout_version)


def bucket_bytes(spec, named) -> torch.Tensor:
    buf = torch.zeros(spec.size_bytes, dtype=torch.uint8)
    for t in spec.tensors:
        buf[t.offset_bytes : t.offset_bytes + t.size_bytes].copy_(named[t.name].view(torch.uint8))
    return buf


def test_every_apply_and_commit_waits_for_the_devices_copies_and_an_abort_releases_the_cache(monkeypatch):
    """BucketApplied and commit must not race the device-to-device copies (an engine could read
    unwritten bytes); an aborted update's memory goes back to the device."""
    events: list[str] = []
    monkeypatch.setattr(store_module, "synchronize_device", lambda device: events.append("sync"))
    monkeypatch.setattr(store_module, "release_cached_device_memory", lambda device: events.append("release"))
    store = WeightStore(torch.device("cpu"))
    plan = plan_proto(build_plan(list(small_model(0).items()), bucket_size_bytes=2048, zero_copy_min_bytes=0))
    store.begin_update(derive(store, plan, allow_new=True), "u0", "")
    for sequence, spec in enumerate(plan.buckets):
        events.append(f"apply {sequence}")
        store.apply_bucket(sequence, bucket_bytes(spec, small_model(0)), tensor_pb2.Checksum())
    events.append("commit")
    store.commit_update()
    assert len(plan.buckets) > 1
    assert events == [e for k in range(len(plan.buckets)) for e in (f"apply {k}", "sync")] + ["commit", "sync"]
    events.clear()
    store.begin_update(derive(store, plan), "u1", "")
    store.abort_update()
    assert events == ["release"]


# -- a sticky CUDA error ends the worker with a status the supervisor can tell apart -------------------------------
class AcceleratorError(RuntimeError):
    def __init__(self, message: str, error_code: int | None = None) -> None:
        super().__init__(message)
        if error_code is not None:
            self.error_code = error_code


@pytest.mark.parametrize(("error", "fault"), [
    (AcceleratorError("CUDA error: an illegal memory access was encountered", 700), DeviceFault.STICKY),
    (AcceleratorError("CUDA error: unspecified launch failure"), DeviceFault.STICKY),
    (RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA"), DeviceFault.STICKY),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:123, unhandled cuda error"), DeviceFault.STICKY),
    (AcceleratorError("something else", 214), DeviceFault.STICKY),  # the code decides
    (AcceleratorError("CUDA error: no CUDA-capable device is detected", 100), DeviceFault.LOST),
    (RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable"), DeviceFault.LOST),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), None),
    (RuntimeError("Gloo: misaligned address in a message"), None),  # not a CUDA error
    (ValueError("bad plan"), None),
])
def test_device_faults_are_classified(error, fault):
    assert classify(error) is fault
    assert (EXIT_DEVICE_FAULT, EXIT_DEVICE_LOST) == (DeviceFault.STICKY.exit_code, DeviceFault.LOST.exit_code)
    assert len({0, 1, EXIT_DEVICE_FAULT, EXIT_DEVICE_LOST}) == 4


def test_a_cuda_worker_reports_a_sticky_error_then_exits_with_its_status():
    """Before: it kept answering WORKER_INTERNAL while its heartbeat said it was fine."""
    commands, events = OwnedQueue(1 << 16), OwnedQueue(1 << 16)
    config = wpb.WorkerConfig(index=0, device="cuda:0", queue_capacity_bytes=1 << 16, parent_pid=os.getpid())
    worker = Worker(config, commands.queue, events.queue, None)  # nothing touches the device until a command

    def crash(command, event):
        raise AcceleratorError("CUDA error: an illegal memory access was encountered", 700)

    worker._handlers["compute_checksums"] = crash
    worker._handlers["export_store"] = crash
    commands.queue.put(wpb.WorkerCommand(command_id=7, compute_checksums=wpb.ComputeChecksumsCommand())
                       .SerializeToString(), timeout=5)
    commands.queue.put(wpb.WorkerCommand(command_id=8, export_store=wpb.ExportStoreCommand()).SerializeToString(),
                       timeout=5)
    assert worker.run(parent_alive=lambda: True) == EXIT_DEVICE_FAULT
    started = wpb.WorkerEvent.FromString(events.queue.get(timeout=5))
    failed = wpb.WorkerEvent.FromString(events.queue.get(timeout=5))
    assert started.WhichOneof("event") == "started"
    assert (failed.command_id, failed.command_failed.reason) == (7, "DEVICE_FAILED")
    assert "illegal memory access" in failed.command_failed.message
    assert events.queue.get(timeout=0.2) is None  # command 8 was never run: the worker is gone
    commands.close()
    events.close()


def test_a_worker_whose_device_is_missing_exits_device_lost_at_start():
    """No CUDA here: exactly what a worker sees when its device disappeared (the supervisor backs off)."""
    commands, events = OwnedQueue(1 << 16), OwnedQueue(1 << 16)
    config = wpb.WorkerConfig(index=0, device="cuda:0", log_level="warning", queue_capacity_bytes=1 << 16,
                              parent_pid=os.getpid())
    cmd = (commands.segment_fd, commands.doorbell_fd)
    evt = (events.segment_fd, events.doorbell_fd)
    process = subprocess.run(
        [sys.executable, "-m", "weightsync.gpu_worker", "--config-hex", config.SerializeToString().hex(),
         "--command-fds", f"{cmd[0]},{cmd[1]}", "--event-fds", f"{evt[0]},{evt[1]}"],
        pass_fds=(*cmd, *evt), stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
    )
    assert process.returncode == EXIT_DEVICE_LOST, process.stderr.decode()[-2000:]
    assert b"device_unusable_at_start" in process.stdout + process.stderr
    commands.close()
    events.close()
