"""Issue 33 item 16: an abandoned rendezvous keeps weightsync's NCCL settings in the environment until its
join has ended (the join reads them), then the environment is exactly what it was before weightsync set
anything, even when rendezvous overlap. No NCCL here: open_group is a fake that blocks until released."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch

from weightsync.client.transports import rendezvous as rendezvous_module
from weightsync.common import nccl_env
from weightsync.v1 import weight_sync_service_pb2 as pb

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0  # every wait below is bounded by this
OURS = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0", "NCCL_SOCKET_IFNAME": "=lo"}
WATCHED = tuple(OURS)
ORIGINALS = {"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
             "TORCH_NCCL_DUMP_ON_TIMEOUT": None, "TORCH_NCCL_ENABLE_MONITORING": None, "NCCL_SOCKET_IFNAME": None}
"""The trainer's own values (None: unset, and unset again afterwards)."""


def watched() -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in WATCHED}


class BlockingJoins:
    """open_group as a join that blocks until its test releases it, reading the environment at its start
    and again as it ends (what the real join does: the constructor's reads, the first communicator's)."""

    def __init__(self) -> None:
        self.started: dict[str, threading.Event] = {}
        self.release: dict[str, threading.Event] = {}
        self.seen_at_start: dict[str, dict[str, str | None]] = {}
        self.seen_at_end: dict[str, dict[str, str | None]] = {}

    def expect(self, group_id: str) -> None:
        self.started[group_id], self.release[group_id] = threading.Event(), threading.Event()

    def __call__(self, *, group_id: str, **_kwargs):
        self.seen_at_start[group_id] = watched()
        self.started[group_id].set()
        released = self.release[group_id].wait(WAIT)
        self.seen_at_end[group_id] = watched()
        if not released:
            raise TimeoutError("the test never released this join")
        raise RuntimeError("no NCCL in this build")  # a real join's failure at its deadline


@pytest.fixture
def joins(monkeypatch) -> BlockingJoins:
    for key, value in ORIGINALS.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", "10")  # lowered and left set by design: not watched here
    fake = BlockingJoins()
    monkeypatch.setattr(rendezvous_module, "open_group", fake)
    yield fake
    for event in fake.release.values():  # a failed test leaves no join blocked
        event.set()


def start(joins: BlockingJoins, group_id: str) -> rendezvous_module.Rendezvous:
    joins.expect(group_id)
    call = rendezvous_module.Rendezvous(group_id=group_id, backend=pb.BACKEND_NCCL, store=None, world_size=2,
                                        timeout=datetime.timedelta(seconds=5), device=torch.device("cpu"),
                                        local_address="127.0.0.1")
    assert joins.started[group_id].wait(WAIT)
    return call


def join_thread(group_id: str) -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == f"rendezvous-{group_id}"]
    return thread


def end(joins: BlockingJoins, group_id: str) -> None:
    thread = join_thread(group_id)
    joins.release[group_id].set()
    thread.join(WAIT)
    assert not thread.is_alive()


@pytest.mark.parametrize("give_up", ["abandon", "result_timed_out"])
def test_a_join_the_caller_gave_up_on_keeps_our_settings_until_it_ends(joins, give_up):
    assert watched() == ORIGINALS
    call = start(joins, "g")
    assert joins.seen_at_start["g"] == OURS
    if give_up == "abandon":
        call.abandon()
    else:
        with pytest.raises(TimeoutError, match="did not finish in 0.01 s"):
            call.result(0.01)
    assert join_thread("g").is_alive() and watched() == OURS  # the join still reads them
    end(joins, "g")
    assert joins.seen_at_end["g"] == OURS
    assert watched() == ORIGINALS  # exactly the trainer's: the unset ones unset again
    assert nccl_env._held == {}


def test_overlapping_rendezvous_bring_back_the_environment_from_before_the_first(joins):
    first = start(joins, "first")
    first.abandon()
    second = start(joins, "second")  # the first's join is still running: the environment holds ours
    assert joins.seen_at_start["second"] == OURS
    end(joins, "first")
    assert watched() == OURS  # the second's join still reads them
    joins.release["second"].set()
    with pytest.raises(RuntimeError, match="no NCCL"):
        second.result(WAIT)
    assert joins.seen_at_end == {"first": OURS, "second": OURS}
    assert watched() == ORIGINALS  # not the first's settings, which the second saw as "before"
    assert nccl_env._held == {}


def test_a_join_that_ended_before_the_caller_let_go_is_restored_by_the_caller(joins, monkeypatch):
    """The usual path: result() returns or raises once the join ended; the caller's thread restores."""
    restorers: list[str] = []
    real_release = nccl_env.TrainerSettings.release

    def recording_release(holder):
        restorers.append(threading.current_thread().name)
        real_release(holder)

    monkeypatch.setattr(nccl_env.TrainerSettings, "release", recording_release)
    call = start(joins, "g")
    joins.release["g"].set()
    with pytest.raises(RuntimeError, match="no NCCL"):
        call.result(WAIT)
    call.abandon()  # after result(): nothing more to put back
    assert restorers == [threading.current_thread().name]
    assert watched() == ORIGINALS and nccl_env._held == {}
    # and the next rendezvous is unharmed: ours while it joins, the trainer's after
    after = start(joins, "next")
    assert joins.seen_at_start["next"] == OURS
    joins.release["next"].set()
    with pytest.raises(RuntimeError, match="no NCCL"):
        after.result(WAIT)
    assert watched() == ORIGINALS
