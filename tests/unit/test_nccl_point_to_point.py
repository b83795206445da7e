"""Parts over NCCL, bounded and cheap (issue 44), decided on CPU against fakes of torch's process groups and works.

What a GPU shows instead is in tests/gpu (docs/gpus.md). Here: every NCCL point-to-point operation runs as a batch
of one on the group's own communicator (no per-pair communicator), its start bounded by the transfer's deadline,
by close() from another thread and by a part's streams (C1); torch 2.11's failed work read within a bound (C3); a
process refusing a new NCCL group while two earlier ones are still being released, a failed connect reported
without waiting for its abort (C4); a failed transfer's cached device blocks held back until its work can no
longer be queued (P2); a receive held for its turn gets what is left of its timeout (P3); the device of a torch
group's collectives (P5); the frozen TORCH_NCCL_NONBLOCKING_TIMEOUT named (F4)."""

from __future__ import annotations

import datetime
import threading
import time

import grpc
import pytest
import torch
from test_collective_parts_units import Loop, Stream

from weightsync.client.buckets.packing import PackBuffers, Payload
from weightsync.client.errors import WeightSyncRpcError
from weightsync.client.transports.collective import CollectiveSink
from weightsync.common import nccl_env, nccl_groups
from weightsync.common.collective import CollectiveGroup, RendezvousTimeout, open_group
from weightsync.common.nccl_connect import pair_byte, pair_peers
from weightsync.common.nccl_groups import (
    GroupsStillClosing,
    process_group_device,
    refuse_while_closing,
)
from weightsync.common.transfer_waits import (
    FAILED_CLOSE_JOIN_SECONDS,
    CollectiveError,
    completed_failure,
)
from weightsync.gpu_worker import device_lane
from weightsync.gpu_worker.device_lane import DeviceLane
from weightsync.gpu_worker.group_table import GroupTable
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

pytestmark = pytest.mark.timeout(120)

NCCL, GLOO = pb.BACKEND_NCCL, pb.BACKEND_GLOO


class Work:
    """An NCCL work: completes when `done` is set."""

    def __init__(self, done: bool = True) -> None:
        self.done = threading.Event()
        if done:
            self.done.set()
        self.synced = 0

    def is_completed(self) -> bool:
        return self.done.is_set()

    def exception(self) -> None:
        return None

    def synchronize(self) -> None:
        self.synced += 1


class Communicator:
    """A ProcessGroupNCCL as CollectiveGroup drives it. `connects`: how each batch's end waits, the way torch waits in
    ncclGroupEnd for a peer's first transfer (set: at once; never set: until torch's non-blocking timeout)."""

    def __init__(self, *, connects: bool = True) -> None:
        self.calls: list[tuple] = []
        self.threads: list[int] = []
        """The thread of each call."""
        self.connected = threading.Event()
        if connects:
            self.connected.set()
        self.aborted = threading.Event()
        self.work = Work()

    def _note(self, *call) -> None:
        self.calls.append(call)
        self.threads.append(threading.get_ident())

    def _start_coalescing(self) -> None:
        self._note("start")

    def send(self, tensors, peer: int, tag: int) -> None:
        self._note("send", peer, tag)

    def recv(self, tensors, peer: int, tag: int) -> None:
        self._note("recv", peer, tag)

    def _end_coalescing(self) -> Work:
        self._note("end")
        self.connected.wait(60)  # torch's spin: an abort does not end it (the state it polls stays in progress)
        return self.work

    def abort(self) -> None:
        self.aborted.set()


def nccl_group(pg: object, *, timeout: float = 30.0, trainer_ranks: int = 2) -> CollectiveGroup:
    return CollectiveGroup("g", NCCL, 0, 4, datetime.timedelta(seconds=timeout), torch.device("cpu"), pg,
                           trainer_ranks=trainer_ranks)


# -- C1: batched on the group's communicator, its start bounded ----------------------------------------------
def test_nccl_point_to_point_runs_as_a_batch_of_one_on_the_groups_communicator():
    """A bare send/recv would make torch build a two-rank communicator per pair inside the call (lazy mode)."""
    pg = Communicator()
    group = nccl_group(pg)
    tensor = torch.zeros(8, dtype=torch.uint8)
    work = group.send_async(tensor, 2, 5)
    group.wait(work)
    group.receive(tensor, 3, 7)
    assert pg.calls == [("start",), ("send", 2, 5), ("end",), ("start",), ("recv", 3, 7), ("end",)]
    # Each batch in one thread of its own (torch counts open batches per thread), never the caller's.
    first, second = pg.threads[:3], pg.threads[3:]
    assert len(set(first)) == 1 and len(set(second)) == 1 and threading.get_ident() not in pg.threads
    assert work.synced == 2 and group.peers == {2, 3}  # the caller's stream ordered after each transfer
    group.send_async(tensor, 2, 6)
    assert group.peers == {2, 3} and pg.calls[-2] == ("send", 2, 6)
    # Gloo: torch's own send, at once.
    gloo = Communicator()
    gloo_work = CollectiveGroup("g", GLOO, 0, 4, datetime.timedelta(seconds=30), torch.device("cpu"), gloo)
    gloo.send = lambda tensors, peer, tag: (gloo._note("send", peer, tag), gloo.work)[1]
    assert gloo_work.send_async(tensor, 2, 5) is gloo.work and gloo.calls == [("send", 2, 5)]


def test_a_bucket_goes_to_all_its_owners_in_one_batch():
    """Review H3, F6: a batch per owner, each completed before the next started on the communicator's one stream,
    ran a bucket to S servers S times as long; in one batch NCCL runs the sends in one kernel, all at once."""
    pg = Communicator()
    group = nccl_group(pg)
    tensor = torch.zeros(8, dtype=torch.uint8)
    [work] = group.send_many_async(tensor, [4, 6, 9], 3)
    group.wait(work)
    assert pg.calls == [("start",), ("send", 4, 3), ("send", 6, 3), ("send", 9, 3), ("end",)]
    assert len(set(pg.threads)) == 1 and group.peers == {4, 6, 9}
    assert group.send_many_async(tensor, [], 4) == [] and len(pg.calls) == 5  # no owner: nothing started
    group.receive(tensor, 0, 0)  # and the next transfer runs
    assert pg.calls[-3:] == [("start",), ("recv", 0, 0), ("end",)]


def test_one_batch_is_started_at_a_time_on_a_group():
    """torch keeps a batch's state on the process group (coalescing_state_, coalescedComm_): a second start while
    one given up on is still inside torch would corrupt it. Every caller closes a group whose start it gave up
    on; one that did not is refused rather than run."""
    pg = Communicator(connects=False)
    group = nccl_group(pg)
    tensor = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(CollectiveError):
        group.send_async(tensor, 2, 0, deadline=time.monotonic() + 0.2)  # abandoned inside torch's end
    with pytest.raises(CollectiveError, match="another one"):
        group.send_async(tensor, 3, 0)
    assert pg.calls.count(("start",)) == 1
    pg.connected.set()
    deadline = time.monotonic() + 5
    while group._starting.locked() and time.monotonic() < deadline:
        time.sleep(0.01)  # the abandoned start ends once torch lets go
    group.wait(group.send_async(tensor, 3, 0))  # then the next one runs
    assert pg.calls[-3:] == [("start",), ("send", 3, 0), ("end",)]


def test_a_first_send_whose_peer_never_comes_ends_at_its_deadline():
    pg = Communicator(connects=False)
    group = nccl_group(pg)
    started = time.monotonic()
    with pytest.raises(CollectiveError) as failed:
        group.send_async(torch.zeros(8, dtype=torch.uint8), 2, 0, deadline=time.monotonic() + 0.3)
    assert failed.value.timed_out and time.monotonic() - started < 5  # not torch's spin (60 s here)
    assert group.close(5.0) and pg.aborted.is_set()  # the caller closes it: nothing of it is used again
    pg.connected.set()
    # The next group works: a send, waited for.
    fresh = Communicator()
    after = nccl_group(fresh)
    after.wait(after.send_async(torch.zeros(8, dtype=torch.uint8), 2, 0))
    assert fresh.calls[-2:] == [("send", 2, 0), ("end",)]


@pytest.mark.parametrize("side", ["send", "receive"])
def test_close_from_another_thread_ends_a_blocked_first_transfer(side):
    pg = Communicator(connects=False)
    group = nccl_group(pg)
    tensor = torch.zeros(8, dtype=torch.uint8)
    closer = threading.Timer(0.2, group.close)
    closer.start()
    started = time.monotonic()
    with pytest.raises(CollectiveError) as failed:
        if side == "send":
            group.send_async(tensor, 2, 0)
        else:
            group.receive(tensor, 0, 0)
    assert not failed.value.timed_out and "closed" in str(failed.value)
    assert time.monotonic() - started < 5  # the group's 30 s, and torch's spin, not waited for
    closer.join()
    assert pg.aborted.wait(5) and group.released.wait(5)
    pg.connected.set()
    with pytest.raises(CollectiveError, match="closed"):
        group.send_async(tensor, 2, 0)  # closed: nothing more runs on it
    fresh = Communicator()
    nccl_group(fresh).receive(tensor, 0, 0)  # the next group receives
    assert fresh.calls == [("start",), ("recv", 0, 0), ("end",)]


def test_a_part_told_to_stop_while_its_first_send_connects_returns_the_servers_word():
    """The owner never reaches its receive (another part failed first): the part learns the server's word while its
    send's start still waits, not at the transfer's deadline, and the group is aborted."""
    pg = Communicator(connects=False)
    group = nccl_group(pg)
    sink = CollectiveSink(Loop(), group, PackBuffers(torch.device("cpu")))
    streams = [Stream([4]), Stream([5])]
    told = WeightSyncRpcError("s:1", grpc.StatusCode.ABORTED, "PART_FAILED", "part 1 failed", {"part": "1"})

    def say() -> None:
        streams[0].reported_error = told
        streams[0].failed = True

    threading.Timer(0.2, say).start()
    payload = Payload(torch.zeros(16, dtype=torch.uint8), packed=True, source_devices=frozenset({torch.device("cpu")}))
    started = time.monotonic()
    assert sink.send(0, payload, tensor_pb2.Checksum(), streams) is told
    assert time.monotonic() - started < 5 and sink.broken and group.closed and pg.aborted.wait(5)
    pg.connected.set()


# -- F7 (review H3): a work that completed because its group was closed ------------------------------------------
class CompletesWhenAborted(Work):
    """torch after close() from another thread: the abort makes the kernel exit, so the work's end event completes with
    no exception set (torch reads no communicator error once it is aborted). `closes_at`: the close lands between the
    first poll and the second ("poll"), or between the last poll and the stream's synchronize ("synchronize")."""

    def __init__(self, closes_at: str) -> None:
        super().__init__(done=False)
        self.closes_at = closes_at
        self.group: CollectiveGroup | None = None
        self.polls = 0

    def is_completed(self) -> bool:
        self.polls += 1
        if self.closes_at == "poll" and self.polls == 2:
            self._close()
        return self.done.is_set() or self.closes_at == "synchronize"

    def synchronize(self) -> None:
        super().synchronize()
        if self.closes_at == "synchronize":
            self._close()

    def _close(self) -> None:
        assert self.group is not None
        self.group.close(5.0)
        self.done.set()  # the aborted kernel exited


@pytest.mark.parametrize("closes_at", ["poll", "synchronize"])
def test_a_transfer_that_completed_because_its_group_was_closed_is_a_failure_not_a_success(closes_at):
    pg = Communicator()
    group = nccl_group(pg)
    pg.work = work = CompletesWhenAborted(closes_at)
    work.group = group
    with pytest.raises(CollectiveError, match="closed") as failed:
        group.receive(torch.zeros(8, dtype=torch.uint8), 0, 0)
    assert not failed.value.timed_out and pg.aborted.is_set() and group.unfinished_work is work
    fresh = Communicator()  # the next group receives
    nccl_group(fresh).receive(torch.zeros(8, dtype=torch.uint8), 0, 0)
    assert fresh.work.synced == 1


# -- F4, F5 (review H3): every (trainer rank, worker) pair connected inside open_group --------------------------------
PAIRS = [  # rank, world, trainer ranks -> (sends, the ranks it connects to)
    (0, 5, 2, (True, [2, 3, 4])),
    (1, 5, 2, (True, [2, 3, 4])),
    (3, 5, 2, (False, [0, 1])),
    (0, 3, 1, (False, [])),  # one trainer: it broadcasts
    (2, 3, 1, (False, [])),
    (1, 2, 2, (False, [])),  # no worker
]


@pytest.mark.parametrize(("rank", "world", "trainers", "pairs"), PAIRS)
def test_which_pairs_a_rank_connects(rank, world, trainers, pairs):
    assert pair_peers(rank, world, trainers) == pairs


def test_the_pairs_first_bytes_name_their_sender():
    assert [pair_byte(r) for r in (0, 1, 254, 255, 256)] == [1, 2, 255, 1, 2]


class Joinable(Communicator):
    """A ProcessGroupNCCL every rank of which joined: the connect's broadcast completes, a receive gets the byte its
    sender's pair_byte names (`swapped`: from the ranks in the other order)."""

    swapped = False

    class Options:
        def __init__(self) -> None:
            self.config = type("Config", (), {"blocking": 1})()
            self._timeout = None

    made: list[Joinable] = []

    def __init__(self, store=None, rank=0, world_size=1, options=None) -> None:
        super().__init__()
        Joinable.made.append(self)

    def broadcast(self, tensors, options) -> Work:
        self._note("broadcast")
        return Work()

    def recv(self, tensors, peer: int, tag: int) -> None:
        super().recv(tensors, peer, tag)
        tensors[0].fill_(pair_byte(1 - peer if self.swapped else peer))


@pytest.mark.parametrize(("rank", "calls"), [
    (3, [("broadcast",), ("start",), ("recv", 0, 0), ("recv", 1, 0), ("end",)]),
    (1, [("broadcast",), ("start",), ("send", 2, 0), ("send", 3, 0), ("send", 4, 0), ("end",)]),
], ids=["worker", "part"])
def test_a_parts_group_connects_every_pair_in_its_join_in_one_batch(monkeypatch, rank, calls):
    """Left to the first push, a pair's first transfer waits in torch's spin (bounded only by
    TORCH_NCCL_NONBLOCKING_TIMEOUT, read once per process) until the peer reaches its matching operation. A worker
    learns the trainer ranks from its JoinGroupCommand (the server copies CreateTransferGroupRequest's)."""
    import torch._C._distributed_c10d as c10d

    from weightsync.common.collective import host_store
    from weightsync.gpu_worker.group_table import _open

    monkeypatch.setattr(c10d, "ProcessGroupNCCL", Joinable, raising=False)
    Joinable.made.clear()
    store = host_store("127.0.0.1", datetime.timedelta(seconds=10))
    join = wpb.JoinGroupCommand(group_id=f"pairs-{rank}", store_host="127.0.0.1", store_port=store.port,
                                world_size=5, rank=rank, backend=NCCL, trainer_ranks=2)
    join.timeout.FromSeconds(10)
    if rank == 3:
        group = _open(join, torch.device("cpu"))
    else:  # a part joins through open_group with its own trainer_ranks
        group = open_group(group_id=join.group_id, backend=NCCL, store=store, rank=rank, world_size=5,
                           timeout=datetime.timedelta(seconds=10), device=torch.device("cpu"),
                           local_address="127.0.0.1", trainer_ranks=2)
    [pg] = Joinable.made
    assert pg.calls == calls and group.trainer_ranks == 2
    assert group.peers == ({0, 1} if rank == 3 else {2, 3, 4})
    assert len(set(pg.threads[1:])) == 1  # the batch in one thread
    assert group.close(5.0)
    # One trainer: no pairs (it broadcasts every bucket).
    alone = open_group(group_id="one-trainer", backend=NCCL, store=store, rank=1, world_size=3,
                       timeout=datetime.timedelta(seconds=10), device=torch.device("cpu"), local_address="127.0.0.1")
    assert Joinable.made[-1].calls == [("broadcast",)] and alone.close(5.0)


def test_a_worker_whose_pairs_bytes_come_from_other_ranks_fails_its_join(monkeypatch):
    import torch._C._distributed_c10d as c10d

    from weightsync.common.collective import host_store

    monkeypatch.setattr(c10d, "ProcessGroupNCCL", Joinable, raising=False)
    monkeypatch.setattr(Joinable, "swapped", True)
    Joinable.made.clear()
    store = host_store("127.0.0.1", datetime.timedelta(seconds=10))
    with pytest.raises(RuntimeError, match="came from other ranks"):
        open_group(group_id="swapped", backend=NCCL, store=store, rank=2, world_size=3,
                   timeout=datetime.timedelta(seconds=10), device=torch.device("cpu"), local_address="127.0.0.1",
                   trainer_ranks=2)
    assert Joinable.made[-1].aborted.is_set()  # the group it built is closed
    monkeypatch.setattr(Joinable, "swapped", False)
    ok = open_group(group_id="in-order", backend=NCCL, store=store, rank=2, world_size=3,
                    timeout=datetime.timedelta(seconds=10), device=torch.device("cpu"), local_address="127.0.0.1",
                    trainer_ranks=2)
    assert ok.peers == {0, 1} and ok.close(5.0)


def test_pairs_that_never_connect_fail_the_join_at_its_timeout(monkeypatch):
    import torch._C._distributed_c10d as c10d

    from weightsync.common.collective import host_store

    class Unconnected(Joinable):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.connected.clear()  # a batch's end waits (a worker that never joins the pairs' round)

    monkeypatch.setattr(c10d, "ProcessGroupNCCL", Unconnected, raising=False)
    Joinable.made.clear()
    store = host_store("127.0.0.1", datetime.timedelta(seconds=10))
    started = time.monotonic()
    with pytest.raises(RendezvousTimeout, match="not every pair connected"):
        open_group(group_id="no-pairs", backend=NCCL, store=store, rank=0, world_size=3,
                   timeout=datetime.timedelta(seconds=0.5), device=torch.device("cpu"), local_address="127.0.0.1",
                   trainer_ranks=2)
    assert time.monotonic() - started < 0.5 + FAILED_CLOSE_JOIN_SECONDS + 2
    Joinable.made[-1].connected.set()


# -- C3: torch 2.11's failed work, read within a bound ------------------------------------------------------
class Torch211Work:
    """torch 2.11: exception() cannot convert its result (TypeError); wait() on a completed failed work aborts the
    communicator in the waiting thread (here: an abort that hangs), then raises."""

    def __init__(self, *, success: bool) -> None:
        self.success = success
        self.release = threading.Event()

    def exception(self):
        raise TypeError("Unable to convert function return value to a Python type!")

    def wait(self, *args) -> bool:
        if self.success:
            return True
        self.release.wait(30)
        raise RuntimeError("NCCL communicator was aborted")


def test_torch_211s_failed_work_is_read_within_a_bound_even_when_its_abort_hangs():
    hanging = Torch211Work(success=False)
    started = time.monotonic()
    failure = completed_failure(hanging)
    assert isinstance(failure, CollectiveError) and "abort did not end" in str(failure)
    assert time.monotonic() - started < FAILED_CLOSE_JOIN_SECONDS + 2  # not the abort's 30 s
    hanging.release.set()
    assert completed_failure(Torch211Work(success=True)) is None  # the next, successful one reads as such


# -- C4: a failed connect, and the groups still being released ---------------------------------------------
REFUSALS = [([], False), (["a"], False), (["a", "b"], True), (["a", "b", "c"], True)]  # still closing -> refused


@pytest.mark.parametrize(("still", "refused"), REFUSALS)
def test_a_new_nccl_group_is_refused_while_two_are_still_being_released(still, refused):
    if refused:
        with pytest.raises(GroupsStillClosing, match="TORCH_NCCL_NONBLOCKING_TIMEOUT"):
            refuse_while_closing(still)
    else:
        refuse_while_closing(still)


class NeverReady:
    """A ProcessGroupNCCL whose init never completes: the connect's broadcast is held inside torch (waitReady holds the
    communicator's lock), so its abort waits too, until `release` (torch's non-blocking timeout)."""

    class Options:
        def __init__(self) -> None:
            self.config = type("Config", (), {"blocking": 1})()
            self._timeout = None

    instances: list[NeverReady] = []

    def __init__(self, store, rank, world_size, options) -> None:
        self.release = threading.Event()
        NeverReady.instances.append(self)

    def broadcast(self, tensors, options):
        self.release.wait(60)
        raise RuntimeError("NCCL communicator was aborted")

    def abort(self) -> None:
        self.release.wait(60)


def test_a_failed_connect_is_reported_without_waiting_for_its_abort_and_counts_until_released(monkeypatch):
    import torch._C._distributed_c10d as c10d
    from torch.distributed import TCPStore

    monkeypatch.setattr(c10d, "ProcessGroupNCCL", NeverReady, raising=False)
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    NeverReady.instances.clear()
    try:
        for attempt in ("a", "b"):
            started = time.monotonic()
            with pytest.raises(RendezvousTimeout):
                open_group(group_id=attempt, backend=NCCL, store=store, rank=0, world_size=2,
                           timeout=datetime.timedelta(seconds=0.3), device=torch.device("cpu"),
                           local_address="127.0.0.1")
            # The timeout and the short join (not CLOSE_JOIN_SECONDS: the abort waits for torch's init).
            assert time.monotonic() - started < 0.3 + FAILED_CLOSE_JOIN_SECONDS + 2
        assert set(nccl_groups.UNRELEASED.ids()) >= {"a", "b"}
        with pytest.raises(GroupsStillClosing):
            open_group(group_id="c", backend=NCCL, store=store, rank=0, world_size=2,
                       timeout=datetime.timedelta(seconds=0.3), device=torch.device("cpu"), local_address="127.0.0.1")
        assert len(NeverReady.instances) == 2  # refused before any communicator was made
    finally:
        for pg in NeverReady.instances:
            pg.release.set()
    deadline = time.monotonic() + 10
    while {"a", "b"} & set(nccl_groups.UNRELEASED.ids()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the releases finish in their threads once torch lets go
    assert not {"a", "b"} & set(nccl_groups.UNRELEASED.ids())
    refuse_while_closing(nccl_groups.UNRELEASED.ids())  # a new group may be made again


# -- P2: a failed transfer's cached blocks ---------------------------------------------------------------------
class Broadcasting:
    def __init__(self) -> None:
        self.work = Work(done=False)

    def broadcast(self, tensors, options) -> Work:
        return self.work

    def abort(self) -> None:
        pass


def test_the_lanes_cached_blocks_wait_while_a_failed_transfer_may_still_be_queued(monkeypatch):
    """torch's empty_cache waits for the events recorded on NCCL's stream behind a receive that failed: the abort's
    answer would wait for that kernel. The blocks go back once its work is done."""
    released: list[torch.device] = []
    monkeypatch.setattr(device_lane, "release_cached_device_memory", released.append)
    device = torch.device("cuda", 0)  # only named: nothing here touches CUDA
    table = GroupTable(device)
    pg = Broadcasting()
    table.groups["g"] = group = CollectiveGroup("g", NCCL, 1, 2, datetime.timedelta(seconds=0.2), device, pg)
    lane = DeviceLane(device)
    lane.hold_cache = table.device_busy
    with pytest.raises(Exception) as failed:
        table.transfer(group, torch.empty(4, dtype=torch.uint8), wpb.ReceiveBucketCommand(sequence=0),
                       point_to_point=False)
    assert getattr(failed.value, "reason", "") == "COLLECTIVE_TIMEOUT" and "g" not in table.groups
    assert group.released.wait(5) and table.device_busy()  # released, but its broadcast may still be queued
    lane.release()
    assert released == [] and lane.cache_release_pending  # the abort is answered without waiting for it
    pg.work.done.set()  # its kernel ended
    assert not table.device_busy()
    lane.release_cache()
    assert released == [device] and not lane.cache_release_pending
    lane.release()  # the next release goes straight through
    assert released == [device, device]


# -- P3: a receive held for its turn --------------------------------------------------------------------------
def test_a_receive_held_for_its_turn_gets_what_is_left_of_the_groups_timeout():
    """The server's bound for a receive runs from when it forwarded the command: a receive held for its turn and
    then given a whole new timeout could outlive it (the worker killed, WORKER_TIMEOUT) instead of failing as a
    timed-out transfer."""
    from test_worker_part_turns import Harness

    harness = Harness(timeout=5.0)
    waited: list[float] = []

    class Timed:
        def wait(self, timeout=None) -> bool:
            waited.append(timeout.total_seconds())
            return True

    original = harness.pg.recv
    harness.pg.recv = lambda tensors, source, tag: (original(tensors, source, tag), Timed())[1]
    try:
        harness.prepare()
        harness.receive(2)  # part 1's bucket 0: held for part 0's bucket 0
        key, (payload, since) = next(iter(harness.worker._held.items()))
        harness.worker._held[key] = (payload, since - 4.0)  # it has waited 4 of its 5 s
        harness.receive(0)
        assert [e.bucket_received.sequence for e in harness.answers()] == [0, 2]
        fresh, held = waited
        assert 4.0 < fresh <= 5.0 and 0 < held <= 1.0, waited
    finally:
        harness.close()


ARRIVALS = [  # WorkerCommand.sent_monotonic_ns, when the worker read it -> when it arrived (time.monotonic())
    (0, 100.0, 100.0),  # not stamped: when it was read
    (96_500_000_000, 100.0, 96.5),  # queued 3.5 s before it was read
    (101_000_000_000, 100.0, 100.0),  # never later than when it was read
]


@pytest.mark.parametrize(("sent_ns", "read_at", "arrived"), ARRIVALS)
def test_a_commands_arrival_is_when_the_server_queued_it(sent_ns, read_at, arrived):
    from weightsync.gpu_worker.worker import command_arrival

    assert command_arrival(sent_ns, read_at) == arrived


def test_the_server_stamps_each_command_with_when_it_queued_it():
    import asyncio

    from test_supervision import make_supervisor

    async def scenario() -> wpb.WorkerCommand:
        supervisor = make_supervisor()
        supervisor._loop = asyncio.get_running_loop()  # not started: no worker process, only its queue
        worker = supervisor.workers[0]
        worker.state = pb.WORKER_STATE_RUNNING
        try:
            before = time.monotonic_ns()
            supervisor.submit(worker, abort_update=wpb.AbortUpdateCommand(update_id="u"))
            command = wpb.WorkerCommand.FromString(worker.commands.queue.get(timeout=5))
            assert before <= command.sent_monotonic_ns <= time.monotonic_ns()
            return command
        finally:
            for queue in (worker.commands, worker.events):
                queue.close()

    assert asyncio.run(scenario()).abort_update.update_id == "u"


def test_a_receive_that_waited_in_the_queue_gets_what_is_left_of_the_groups_timeout():
    """Review H3, F3: the server's bound for a receive runs from when it queued the command; a worker busy with an
    earlier receive reads the next one later. Two receives queued back to back 4 s before the worker reads them
    (the first one's sender was that late), the second's turn held for the first: each transfer gets the 1 s left
    of the group's 5 s, not a fresh 5 s from when it was read (which outlives the server's bound: the worker is
    killed, WORKER_TIMEOUT, instead of answering COLLECTIVE_TIMEOUT)."""
    from test_worker_part_turns import LANES, SIZE, Harness, payload_of

    from weightsync.common.collective import bucket_tail

    harness = Harness(timeout=5.0)
    waited: list[float] = []

    class Timed:
        def wait(self, timeout=None) -> bool:
            waited.append(timeout.total_seconds())
            return True

    original = harness.pg.recv
    harness.pg.recv = lambda tensors, source, tag: (original(tensors, source, tag), Timed())[1]

    def queued(sequence: int, sent_ns: int) -> None:
        part = 1 if sequence >= LANES[1] else 0
        harness.dispatch(sent_monotonic_ns=sent_ns, receive_bucket=wpb.ReceiveBucketCommand(
            update_id="u", sequence=sequence, size_bytes=SIZE, tail=bucket_tail(payload_of(sequence)),
            source_rank=part, source_sequence=sequence - LANES[part]))

    try:
        harness.prepare()
        sent = time.monotonic_ns() - 4_000_000_000
        queued(2, sent)  # part 1's bucket 0: held for part 0's bucket 0
        queued(0, sent)
        assert [e.bucket_received.sequence for e in harness.answers()] == [0, 2]
        assert len(waited) == 2 and all(0 < w <= 1.0 for w in waited), waited
        queued(1, time.monotonic_ns())  # one read as soon as it was queued: the whole timeout
        assert [e.bucket_received.sequence for e in harness.answers()] == [1] and 4.0 < waited[-1] <= 5.0
    finally:
        harness.close()


# -- P5: the device of a torch group's collectives ---------------------------------------------------------
class TorchGroup:
    def __init__(self, backend: str, bound: torch.device | None = None) -> None:
        self.backend, self.bound_device_id = backend, bound


DEVICES = [  # group -> device its collectives take
    (TorchGroup("gloo"), "cpu"),
    (TorchGroup("nccl", torch.device("cuda", 3)), "cuda:3"),
    (TorchGroup("nccl"), "cuda:1"),  # unbound: this thread's current device
]


@pytest.mark.parametrize(("group", "device"), DEVICES, ids=["gloo", "nccl bound", "nccl unbound"])
def test_a_groups_collectives_run_on_its_bound_device(monkeypatch, group, device):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda g: g.backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert process_group_device(group) == torch.device(device)


# -- F4: the non-blocking timeout a trainer's own NCCL froze ------------------------------------------------
FROZEN = [  # variable now, group timeout, process ran NCCL -> what torch kept (None: ours applies)
    (None, 30.0, True, 1800),
    ("600", 30.0, True, 600),
    ("20", 30.0, True, None),
    (None, 30.0, False, None),
    ("junk", 30.0, True, None),
    (None, None, True, 1800),
]


@pytest.mark.parametrize(("current", "timeout", "used", "kept"), FROZEN)
def test_the_frozen_nonblocking_timeout_is_named(current, timeout, used, kept):
    assert nccl_env.frozen_nonblocking_timeout(current, timeout, nccl_used=used) == kept


CUT_SHORT = [  # torch's value, group timeout -> the group's connects end before its timeout
    (20, 60.0, True),  # the kit's 20 s, a 60 s group
    (120, 300.0, True),  # a worker's cap, a long group
    (59, 60.0, False),  # what nccl_env sets for a 60 s group
    (1800, 60.0, False),  # torch's default (it lingers instead)
]


@pytest.mark.parametrize(("kept", "timeout", "short"), CUT_SHORT)
def test_a_nonblocking_timeout_below_the_groups_cuts_its_connects_short(kept, timeout, short):
    assert nccl_env.connects_cut_short(kept, timeout) is short


def test_the_kept_nonblocking_timeout_is_the_first_one_torch_read(monkeypatch):
    monkeypatch.setattr(nccl_env, "_kept", None)
    assert nccl_env.kept_nonblocking_timeout({}) == 1800  # none read yet: what the next NCCL call reads
    assert nccl_env.kept_nonblocking_timeout({nccl_env.NONBLOCKING_TIMEOUT: "45"}) == 45
    nccl_env.note_nonblocking_read("20")
    nccl_env.note_nonblocking_read("90")  # torch reads once: a later value changes nothing
    assert nccl_env.kept_nonblocking_timeout({nccl_env.NONBLOCKING_TIMEOUT: "45"}) == 20


def events(caplog, name: str) -> list[dict]:
    return [r.weightsync for r in caplog.records if getattr(r, "weightsync", {}).get("event") == name]


@pytest.mark.parametrize(("kept", "warned"), [(20, True), (1800, False)])
def test_a_group_whose_connects_torch_ends_before_its_timeout_says_so(monkeypatch, caplog, kept, warned):
    """Review H3, F4: torch's value, read once per process, ends a group's connects (the communicator's init, its
    pairs') at that value, whatever the group's own timeout: a worker's is its first group's, a trainer's its own."""
    import logging

    import torch._C._distributed_c10d as c10d

    from weightsync.common.collective import host_store

    caplog.set_level(logging.INFO, logger="weightsync.collective")
    monkeypatch.setattr(c10d, "ProcessGroupNCCL", Joinable, raising=False)
    monkeypatch.setattr(nccl_env, "_kept", kept)
    store = host_store("127.0.0.1", datetime.timedelta(seconds=10))
    group = open_group(group_id=f"cut-{kept}", backend=NCCL, store=store, rank=0, world_size=1,
                       timeout=datetime.timedelta(seconds=60), device=torch.device("cpu"), local_address="127.0.0.1")
    said = events(caplog, "nccl_connect_cut_short")
    assert bool(said) is warned
    if warned:
        assert (said[0]["nonblocking_timeout"], said[0]["group_timeout"]) == (20, 60.0)
    assert group.close(5.0)


def test_a_group_left_unreleased_says_how_long_and_what_it_blocks(monkeypatch, caplog):
    """Review H3, F11: two unreleased groups refuse every new one (verl regroups at every sync) until torch lets go."""
    import logging

    caplog.set_level(logging.INFO, logger="weightsync.collective")
    monkeypatch.setattr(nccl_env, "_kept", 1800)
    pg = Communicator()
    hang = threading.Event()
    pg.abort = lambda: hang.wait(30)
    group = nccl_group(pg)
    try:
        assert group.close(0.1) is False
        [said] = events(caplog, "nccl_group_unreleased")
        assert said["group_id"] == "g" and said["nonblocking_timeout"] == 1800 and "g" in said["unreleased"]
        assert said["refused_from"] == nccl_groups.MAX_UNRELEASED_NCCL_GROUPS
    finally:
        hang.set()
    assert group.released.wait(5) and "g" not in nccl_groups.UNRELEASED.ids()
    fresh = Communicator()  # the next group works
    nccl_group(fresh).receive(torch.zeros(8, dtype=torch.uint8), 0, 0)
    assert fresh.work.synced == 1
