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

from weightsync.client.transports import rendezvous as rendezvous_module
from weightsync.common import nccl_env
from weightsync.common.collective import (
    CollectiveError,
    CollectiveGroup,
    bucket_tail,
    nccl_options,
    open_group,
    tail_length,
)
from weightsync.common.shm_queue import OwnedQueue
from weightsync.gpu_worker.device_faults import (
    EXIT_DEVICE_FAULT,
    EXIT_DEVICE_LOST,
    DeviceFault,
    classify,
)
from weightsync.gpu_worker.memory import device_available_bytes
from weightsync.gpu_worker.worker import Worker
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

pytestmark = pytest.mark.timeout(120)


# -- torch's watchdog and monitor never see our groups; our waits decide ----------------------------------
OURS = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0"}


def test_a_worker_builds_its_groups_without_watchdog_and_bounds_readiness_unless_the_operator_did():
    assert nccl_env.worker_environment({}) == {**OURS, "TORCH_NCCL_NONBLOCKING_TIMEOUT": "120"}
    inherited = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "45"}
    assert nccl_env.worker_environment(inherited) == OURS  # 3 would terminate the worker; 45 is the operator's


@pytest.mark.parametrize("before", [{}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_BLOCKING_WAIT": "0"},
                                    {"NCCL_SOCKET_IFNAME": "ib0", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "45"}])
def test_the_trainers_own_groups_keep_their_settings(before):
    """Ours while our group is built; afterwards exactly what the trainer had, but the once-per-process
    readiness bound (it affects only non-blocking communicators, which torch makes only when asked)."""
    env = dict(before)
    with nccl_env.trainer_group_environment("lo", env):
        seen = dict(env)  # what ProcessGroupNCCL's constructor reads
    assert {k: seen[k] for k in OURS} == OURS
    assert seen["NCCL_SOCKET_IFNAME"] == before.get("NCCL_SOCKET_IFNAME", "=lo")  # an operator's value stays
    assert env == {**before, "TORCH_NCCL_NONBLOCKING_TIMEOUT": before.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "120")}
    with pytest.raises(RuntimeError), nccl_env.trainer_group_environment("lo", env):
        raise RuntimeError("the constructor failed")
    assert env == {**before, "TORCH_NCCL_NONBLOCKING_TIMEOUT": before.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "120")}


def test_the_rendezvous_sets_the_environment_from_the_callers_thread_and_restores_it(monkeypatch):
    """The group is built in the rendezvous thread with our settings; setenv happens only in the caller's."""
    for key in (*OURS, "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")  # the trainer's own choice for its groups
    writers: list[str] = []
    real_setitem = type(os.environ).__setitem__

    def recording_setitem(environ, key, value):
        writers.append(threading.current_thread().name)
        real_setitem(environ, key, value)

    seen: dict[str, str | None] = {}

    def fake_open_group(**kwargs):
        seen.update({k: os.environ.get(k) for k in (*OURS, "NCCL_SOCKET_IFNAME")})
        seen["thread"] = threading.current_thread().name
        raise RuntimeError("no NCCL in this build")

    monkeypatch.setattr(type(os.environ), "__setitem__", recording_setitem)
    monkeypatch.setattr(rendezvous_module, "open_group", fake_open_group)
    call = rendezvous_module.Rendezvous(group_id="g", backend=pb.BACKEND_NCCL, store=None, world_size=2,
                                        timeout=datetime.timedelta(seconds=5), device=torch.device("cpu"),
                                        local_address="127.0.0.1")
    with pytest.raises(RuntimeError, match="no NCCL"):
        call.result(10)
    assert seen["thread"] == "rendezvous-g" and {k: seen[k] for k in OURS} == OURS
    assert seen["NCCL_SOCKET_IFNAME"] == "=lo"
    assert set(writers) == {threading.current_thread().name}  # never from the rendezvous thread
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0" and "NCCL_SOCKET_IFNAME" not in os.environ


class PolledWork:
    """An NCCL work as CollectiveGroup.wait sees it: completes after `polls` polls, or never."""

    def __init__(self, polls: int | None, error: BaseException | None = None) -> None:
        self.polls, self.seen, self.waits, self.error, self.synced = polls, 0, [], error, 0

    def exception(self) -> BaseException | None:
        return self.error

    def synchronize(self) -> None:
        self.synced += 1

    def is_completed(self) -> bool:
        self.seen += 1
        return self.polls is not None and self.seen > self.polls

    def wait(self, *args) -> bool:
        self.waits.append(args)
        return True


def test_an_nccl_broadcast_is_waited_for_by_polling_and_never_by_torchs_timed_wait():
    """torch's wait(timeout) aborts the communicator in the waiting thread on expiry (ncclCommAbort can hang);
    ours polls against the group's deadline and leaves the abort to the bounded close."""
    group = CollectiveGroup("g", pb.BACKEND_NCCL, 1, 2, datetime.timedelta(seconds=0.3), torch.device("cpu"), object())
    done = PolledWork(polls=5)
    group.wait(done)
    assert done.waits == [] and done.synced == 1  # completed: its result read, the stream ordered, never wait()
    stuck = PolledWork(polls=None)
    with pytest.raises(CollectiveError) as caught:
        group.wait(stuck)
    assert caught.value.timed_out and stuck.waits == [] and stuck.seen > 10


def test_nccl_groups_use_a_non_blocking_communicator_with_the_group_timeout():
    class Config:
        blocking = -1

    class Options:
        config = Config()
        _timeout = None

    timeout = datetime.timedelta(seconds=7)
    options = nccl_options(Options(), timeout)
    assert (options._timeout, options.config.blocking) == (timeout, 0)


# -- NCCL_SOCKET_IFNAME: an exact match, the operator's value never replaced -----------------------------------
def test_the_nccl_interface_is_an_exact_match_and_set_once():
    assert nccl_env.ifname_setting(None, "eth1") == "=eth1"  # "eth1" alone would also match eth10
    assert nccl_env.ifname_setting("=eth0", "eth1") is None  # NCCL read the first one already
    assert nccl_env.ifname_setting("ib", "eth1") is None  # the operator's choice
    assert nccl_env.ifname_setting(None, None) is None  # no interface holds the address: NCCL picks
    env: dict[str, str] = {}
    assert nccl_env.pin_worker_interface("lo", env) == "=lo" and env == {"NCCL_SOCKET_IFNAME": "=lo"}
    assert nccl_env.pin_worker_interface("eth0", env) == "=lo"


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

    worker._handlers["unmap_arenas"] = crash
    worker._handlers["abort_update"] = crash
    commands.queue.put(wpb.WorkerCommand(command_id=7, unmap_arenas=wpb.UnmapArenasCommand())
                       .SerializeToString(), timeout=5)
    commands.queue.put(wpb.WorkerCommand(command_id=8, abort_update=wpb.AbortUpdateCommand()).SerializeToString(),
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
