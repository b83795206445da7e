"""Bounds of a transfer group's failure paths, decided on CPU (issue 33: items 7, 11, 13-16).

Each decision is a small function checked against a literal table; the fakes stand in for torch's
works and process groups where only a GPU could run the real ones (tests/gpu/test_nccl_group.py)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from weightsync.client.transports.collective import CollectiveSink
from weightsync.common import host_pinning, nccl_env
from weightsync.common.collective import (
    FAILED_CLOSE_JOIN_SECONDS,
    CollectiveError,
    CollectiveGroup,
    RendezvousTimeout,
    failure_report_bound,
    nonblocking_timeout_seconds,
)
from weightsync.common.nccl_connect import connect
from weightsync.common.transfer_waits import completed_failure, gloo_wait_seconds
from weightsync.gpu_worker.device_faults import DeviceFault, DeviceLeftBusy, classify
from weightsync.gpu_worker.group_table import GroupTable, abort_overdue
from weightsync.server.update.session import BUCKET_MARGIN_SECONDS
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

pytestmark = pytest.mark.timeout(60)

GLOO, NCCL = pb.BACKEND_GLOO, pb.BACKEND_NCCL


class FakeWork:
    """A torch Work as CollectiveGroup.wait sees it."""

    def __init__(self, *, completes: bool = True, error: BaseException | None = None, gloo_error: str = "") -> None:
        self.completes, self.error, self.gloo_error = completes, error, gloo_error
        self.waits: list[tuple] = []
        self.synced = 0

    def is_completed(self) -> bool:
        return self.completes

    def exception(self) -> BaseException | None:
        return self.error

    def synchronize(self) -> None:
        self.synced += 1

    def wait(self, *args) -> bool:
        self.waits.append(args)
        if self.gloo_error:
            raise RuntimeError(self.gloo_error)
        return True


class Torch211Work(FakeWork):
    """torch 2.11's WorkNCCL: exception() cannot convert what it returns (TypeError, every call) and
    is_success() refuses NCCL works; wait() on a completed work returns, or raises its failure."""

    def __init__(self, *, success: bool) -> None:
        super().__init__(gloo_error="" if success else "NCCL communicator encountered an error")

    def exception(self) -> BaseException | None:
        raise TypeError("Unable to convert function return value to a Python type! The signature was\n\t"
                        "(self: torch._C._distributed_c10d.Work) -> std::__exception_ptr::exception_ptr")

    def is_success(self) -> bool:
        raise RuntimeError("WorkNCCL::isSuccess() is deprecated")


COMPLETED = [  # a completed work -> failed?
    (FakeWork(), False),
    (FakeWork(error=RuntimeError("NCCL error: remote process exited")), True),
    (Torch211Work(success=True), False),
    (Torch211Work(success=False), True),
]


@pytest.mark.parametrize(("work", "failed"), COMPLETED, ids=["ok", "failed", "2.11 ok", "2.11 failed"])
def test_a_completed_works_outcome_is_read_on_every_torch(work, failed):
    assert (completed_failure(work) is not None) is failed


class FakePG:
    def __init__(self) -> None:
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()


def group(backend: int, timeout: float = 5.0, pg: object | None = None) -> CollectiveGroup:
    return CollectiveGroup("g", backend, 0, 3, datetime.timedelta(seconds=timeout), torch.device("cpu"),
                           pg if pg is not None else FakePG())


# -- 33.14: a completed NCCL work's result is read without wait() ------------------------------------------
def test_a_failed_nccl_work_raises_without_torchs_wait_which_would_abort_in_this_thread():
    failed = FakeWork(error=RuntimeError("NCCL error: remote process exited"))
    with pytest.raises(CollectiveError) as caught:
        group(NCCL).wait(failed)
    assert not caught.value.timed_out and failed.waits == [] and failed.synced == 0
    fine = FakeWork()
    group(NCCL).wait(fine)
    assert fine.waits == [] and fine.synced == 1


# -- 33.11: the first failure closes an NCCL group; nothing in flight is waited for twice -------------------
def sink_with(collective: CollectiveGroup, transfers: list[tuple[FakeWork, float]]) -> CollectiveSink:
    sink = CollectiveSink.__new__(CollectiveSink)
    sink._collective, sink._in_flight, sink._frames, sink._broken = collective, transfers, [], False
    sink._sent_point_to_point_over_nccl = False
    return sink


def test_nccl_the_first_failure_closes_the_group_and_the_bucket_behind_it_is_not_waited_for():
    pg = FakePG()
    failing, behind = FakeWork(completes=False), FakeWork(completes=False)
    now = time.monotonic()
    sink = sink_with(group(NCCL, pg=pg), [(failing, now - 0.001), (behind, now + 60)])
    started = time.monotonic()
    failure = sink.finish()
    assert isinstance(failure, CollectiveError) and failure.timed_out
    assert sink.broken and pg.aborted.is_set()  # closed at the first failure
    assert time.monotonic() - started < 30  # bucket k's own 60 s were not waited for (the bound is the point)
    assert sink.finish() is None  # nothing left in flight


def test_gloo_each_send_in_flight_is_waited_for_until_its_own_deadline_only():
    """Before: the send behind a failed one got a whole group timeout more, from when its wait began."""
    timed_out = "Timed out waiting 5000ms for send operation to complete"
    first, second = FakeWork(gloo_error=timed_out), FakeWork(gloo_error=timed_out)
    now = time.monotonic()
    sink = sink_with(group(GLOO), [(first, now + 0.5), (second, now + 0.7)])
    failure = sink.finish()
    assert isinstance(failure, CollectiveError) and failure.timed_out and sink.broken
    [(first_timeout,)], [(second_timeout,)] = first.waits, second.waits
    assert 0 < first_timeout.total_seconds() <= 0.5 and 0 < second_timeout.total_seconds() <= 0.7


GLOO_WAITS = [(3.0, 3.0), (0.0005, 0.001), (0.0, 0.001), (-2.0, 0.001)]  # remaining -> timeout (never 0: "none")


@pytest.mark.parametrize(("remaining", "seconds"), GLOO_WAITS)
def test_a_gloo_wait_past_its_deadline_still_has_a_timeout(remaining, seconds):
    assert gloo_wait_seconds(remaining) == seconds


# -- 33.7: the communicator is built inside open_group, within the group timeout --------------------------
class NeverConnects(FakePG):
    def broadcast(self, tensors, options):
        return FakeWork(completes=False)


class RaisesOnInit(FakePG):
    def broadcast(self, tensors, options):
        raise RuntimeError("NCCL timeout in: ProcessGroupNCCL.cpp")  # torch's waitReady past the bound


class BlocksInTheCall(FakePG):
    """torch waiting for a non-blocking init inside the collective call, for TORCH_NCCL_NONBLOCKING_TIMEOUT
    (read once per process: a trainer that used NCCL first keeps torch's 30 min)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def broadcast(self, tensors, options):
        self.go.wait(60)
        raise RuntimeError("NCCL communicator was aborted")


@pytest.mark.parametrize("pg", [NeverConnects(), RaisesOnInit(), BlocksInTheCall()],
                         ids=["never completes", "init times out", "blocks in the call"])
def test_a_group_whose_ranks_never_connect_fails_its_connect_within_the_timeout(pg):
    g = group(NCCL, timeout=0.3, pg=pg)
    started = time.monotonic()
    try:
        with pytest.raises(RendezvousTimeout):
            connect(g, time.monotonic() + 0.3)
        assert time.monotonic() - started < 5  # the deadline, not the call's own wait (60 s here)
    finally:
        if isinstance(pg, BlocksInTheCall):
            pg.go.set()


NONBLOCKING = [  # group timeout -> TORCH_NCCL_NONBLOCKING_TIMEOUT (torch fails after more than that many whole s)
    (60.0, 59), (30.5, 29), (2.0, 1), (1.5, 1), (0.5, 1), (600.0, 599)]


@pytest.mark.parametrize(("timeout", "value"), NONBLOCKING)
def test_the_nonblocking_bound_ends_within_the_group_timeout(timeout, value):
    assert nonblocking_timeout_seconds(timeout) == value


LOWERED = [  # already set, group timeout -> set
    (None, None, "120"), (None, 30.0, "29"), ("45", 30.0, "29"), ("10", 30.0, "10"), ("1800", 600.0, "120"),
    ("junk", 30.0, "29")]


@pytest.mark.parametrize(("current", "timeout", "value"), LOWERED)
def test_the_nonblocking_bound_is_only_ever_lowered(current, timeout, value):
    assert nccl_env.lowered_nonblocking_timeout(current, timeout) == value


def test_a_worker_lowers_the_bound_for_its_group_and_the_trainer_around_its_rendezvous():
    env = {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "120"}
    assert nccl_env.lower_nonblocking_timeout(10.0, env) == "9" and env == {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "9"}
    trainer: dict[str, str] = {}
    with nccl_env.trainer_group_environment(None, trainer, group_timeout=20.0):
        assert trainer["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "19"
    assert trainer == {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "19"}  # read once per process: left set


# -- 33.15: a worker reports a failed transfer before the server gives up on it -----------------------------
REPORTS = [  # close join, server margin -> reported in time
    (FAILED_CLOSE_JOIN_SECONDS, BUCKET_MARGIN_SECONDS, True),  # what the code uses
    (10.0, 2.0, False),  # before: the abort held the report for up to 10 s past the server's 2 s
    (0.5, 1.0, False),
]


@pytest.mark.parametrize(("close_join", "margin", "in_time"), REPORTS)
def test_a_timed_out_worker_reports_within_the_servers_margin(close_join, margin, in_time):
    for timeout in (1.0, 30.0, 600.0):
        assert failure_report_bound(timeout, margin=margin, close_join=close_join) is in_time


class HangingAbort(FakePG):
    """A communicator whose broadcast never completes and whose abort hangs until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def broadcast(self, tensors, options):
        return FakeWork(completes=False)

    def abort(self) -> None:
        self.aborted.set()
        self.release.wait(30)


def test_a_failed_transfer_is_reported_at_once_and_an_abort_that_never_ends_exits_the_worker_later(monkeypatch):
    from weightsync.gpu_worker import group_table

    pg = HangingAbort()
    table = GroupTable(torch.device("cpu"))
    stuck = CollectiveGroup("g", NCCL, 1, 2, datetime.timedelta(seconds=0.2), torch.device("cpu"), pg)
    table.groups["g"] = stuck
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        table.transfer(stuck, torch.empty(4, dtype=torch.uint8), wpb.ReceiveBucketCommand(sequence=0),
                       point_to_point=False)
    assert getattr(caught.value, "reason", "") == "COLLECTIVE_TIMEOUT"
    assert time.monotonic() - started < 5  # the abort's hang did not hold the report (bound: 0.5 s join)
    assert pg.aborted.is_set() and [g for g, _ in table.closing] == [stuck]
    table.check_closing()  # a CPU device: nothing of NCCL's can be left running there
    overdue = {"now": True}
    monkeypatch.setattr(group_table, "abort_overdue", lambda *a, **k: overdue["now"])
    with pytest.raises(DeviceLeftBusy) as busy:
        table.check_closing()
    assert classify(busy.value) is DeviceFault.LOST  # reported, then the worker exits EXIT_DEVICE_LOST
    pg.release.set()
    assert stuck.released.wait(5)
    table.check_closing()  # the abort ended: nothing is left
    assert table.closing == []


OVERDUE = [  # backend, device, finished, waited -> a kernel may be left running for good
    (NCCL, "cuda", False, 10.0, True),
    (NCCL, "cuda", False, 9.9, False),
    (NCCL, "cuda", True, 60.0, False),
    (GLOO, "cuda", False, 60.0, False),
    (NCCL, "cpu", False, 60.0, False),
]


@pytest.mark.parametrize(("backend", "device", "finished", "waited", "overdue"), OVERDUE)
def test_an_abort_not_done_in_time_leaves_an_nccl_kernel_only(backend, device, finished, waited, overdue):
    assert abort_overdue(backend, torch.device(device), finished=finished, waited=waited, bound=10.0) is overdue


# -- 33.13 and 33.16: host registration -------------------------------------------------------------------
class FakeCudaRuntime:
    def __init__(self, *, refuse_at: int | None = None, read_only: bool = True) -> None:
        self.refuse_at, self.read_only = refuse_at, read_only
        self.calls: list[tuple] = []
        self.last_error = 0

    def runtime(self) -> host_pinning.CudaRuntime:
        return host_pinning.CudaRuntime(register=self.register, unregister=self.unregister,
                                        take_last_error=self.take_last_error,
                                        read_only_supported=lambda: self.read_only)

    def register(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", size, flags))
        if self.refuse_at is not None and len([c for c in self.calls if c[0] == "register"]) > self.refuse_at:
            self.last_error = 1  # cudaErrorInvalidValue, left for the next launch check to find
            return 1
        return 0

    def unregister(self, ptr: int) -> int:
        self.calls.append(("unregister",))
        return 0

    def take_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        self.calls.append(("take_last_error",))
        return error


def test_a_refused_registration_clears_cudas_last_error_and_unpins_what_it_pinned(monkeypatch):
    monkeypatch.setattr(host_pinning, "CHUNK_BYTES", 4)
    monkeypatch.setattr(host_pinning, "registration_chunks",
                        lambda size, limit=4, boundaries=(): [(0, 4), (4, 4)])
    cuda = FakeCudaRuntime(refuse_at=1)
    assert host_pinning.pin_host(torch.zeros(8, dtype=torch.uint8), runtime=cuda.runtime()) == []
    assert cuda.last_error == 0  # the next kernel launch does not raise the registration's error
    assert [c[0] for c in cuda.calls] == ["register", "register", "take_last_error", "unregister"]


def test_read_only_registration_is_asked_about_before_it_is_tried():
    cuda = FakeCudaRuntime(read_only=False)
    assert host_pinning.pin_host(torch.zeros(8, dtype=torch.uint8), host_pinning.READ_ONLY, runtime=cuda.runtime()) == []
    assert cuda.calls == []  # nothing tried, no error left
    supported = FakeCudaRuntime()
    assert len(host_pinning.pin_host(torch.zeros(8, dtype=torch.uint8), host_pinning.READ_ONLY,
                                     runtime=supported.runtime())) == 1
    assert supported.calls == [("register", 8, host_pinning.READ_ONLY)]


CHUNKS = [  # size, limit, segment starts -> (offset, length) of each registration
    (10, 4, (), [(0, 4), (4, 4), (8, 2)]),
    (10, 4, (3, 6, 9), [(0, 3), (3, 3), (6, 4)]),  # never across a segment
    (10, 4, (5,), [(0, 4), (4, 1), (5, 4), (9, 1)]),  # a segment longer than the limit is cut (no choice)
    (10, 100, (3, 6), [(0, 10)]),  # one registration when it fits
    (0, 4, (), []),
]


@pytest.mark.parametrize(("size", "limit", "boundaries", "chunks"), CHUNKS)
def test_registration_chunks_end_at_segment_boundaries(size, limit, boundaries, chunks):
    assert host_pinning.registration_chunks(size, limit, boundaries) == chunks


def test_an_arena_up_to_hundreds_of_gib_is_one_registration():
    """64 GiB chunks split the segment crossing each 64 GiB mark of a 140 GB arena between two registrations;
    one call is refused only from 512 GiB."""
    assert host_pinning.registration_chunks(140 << 30) == [(0, 140 << 30)]
    assert host_pinning.CHUNK_BYTES < 512 << 30
