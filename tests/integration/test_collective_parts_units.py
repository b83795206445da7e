"""Parts over COLLECTIVE, piece by piece without processes: a part's CollectiveSink (sends point-to-point to its
owners in increasing rank, over NCCL too, never a broadcast with several trainer ranks; one trainer still
broadcasts over NCCL; a part that sent over NCCL breaks its group when its push fails), a part told by a server
that the update is aborting (through a real CollectiveGroup on a fake process group), and a worker's turns
(gpu_worker/receive_update.py: the receives of an update of several parts held to one global order; an update of
one part, or not COLLECTIVE, takes them as they come)."""

from __future__ import annotations

import datetime
import re
import threading
import time
from concurrent.futures import Future

import grpc
import pytest
import torch

from weightsync.client.buckets.packing import PackBuffers, Payload
from weightsync.client.errors import WeightSyncRpcError
from weightsync.client.transports.collective import CollectiveSink
from weightsync.common.collective import CollectiveGroup
from weightsync.gpu_worker.receive_update import ReceiveUpdate
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


class Loop:
    def call_soon(self, fn, *args):
        fn(*args)


class Stream:
    """One server's stream: its Ready names each bucket's owner rank (-1: none there)."""

    def __init__(self, owners: list[int]) -> None:
        self.ready: Future = Future()
        self.ready.set_result(pb.UpdateReady(bucket_owner_ranks=owners))
        self.server = "s:1"
        self.failed = False
        self.sent: list[pb.UpdateWeightsRequest] = []

    def send(self, message) -> None:
        self.sent.append(message)


class Work:
    def is_completed(self) -> bool:
        return True


class Collective:
    def __init__(self, backend: int, trainer_ranks: int) -> None:
        self.backend = backend
        self.trainer_ranks = trainer_ranks
        self.calls: list[tuple] = []

    def deadline(self) -> float:
        return float("inf")

    def broadcast_async(self, tensor):
        self.calls.append(("broadcast",))
        return Work()

    def send_many_async(self, tensor, destinations, tag: int, *, deadline=None, stopped=None):
        if self.backend == pb.BACKEND_NCCL:  # one batch: one work
            self.calls.append(("batch", list(destinations), tag))
            return [Work()] if destinations else []
        self.calls.extend(("send", destination, tag) for destination in destinations)
        return [Work() for _ in destinations]

    def wait(self, work, deadline=None, *, stopped=None) -> None:
        pass


SENDS = {  # what a part of two trainer ranks sends for three buckets, two servers (below)
    pb.BACKEND_GLOO: [("send", 3, 0), ("send", 7, 0), ("send", 6, 1), ("send", 4, 2), ("send", 7, 2)],
    # One batch per bucket, all its owners at once (review H3, F6: a batch per owner ran them one after the other).
    pb.BACKEND_NCCL: [("batch", [3, 7], 0), ("batch", [6], 1), ("batch", [4, 7], 2)],
}


@pytest.mark.parametrize("backend", [pb.BACKEND_NCCL, pb.BACKEND_GLOO])
def test_a_part_sends_each_bucket_to_its_owners_in_increasing_rank(backend):
    collective = Collective(backend, trainer_ranks=2)
    sink = CollectiveSink(Loop(), collective, PackBuffers(torch.device("cpu")))
    # Two servers: the second's workers have the lower ranks here; bucket 1 is stored by the first alone.
    streams = [Stream([7, 6, 7]), Stream([3, -1, 4])]
    for index in range(3):
        data = torch.arange(16, dtype=torch.uint8) + index
        payload = Payload(data, packed=True, source_devices=frozenset({torch.device("cpu")}))
        assert sink.send(index, payload, tensor_pb2.Checksum(), streams) is None
    assert sink.finish() is None
    assert collective.calls == SENDS[backend]
    assert [m.bucket_start.sequence for m in streams[0].sent] == [0, 1, 2]  # every bucket announced first


def test_one_trainer_over_nccl_still_broadcasts():
    collective = Collective(pb.BACKEND_NCCL, trainer_ranks=1)
    sink = CollectiveSink(Loop(), collective, PackBuffers(torch.device("cpu")))
    payload = Payload(torch.zeros(16, dtype=torch.uint8), packed=True, source_devices=frozenset({torch.device("cpu")}))
    sink.send(0, payload, tensor_pb2.Checksum(), [Stream([1]), Stream([2])])
    assert collective.calls == [("broadcast",)]


def zeros() -> Payload:
    return Payload(torch.zeros(16, dtype=torch.uint8), packed=True, source_devices=frozenset({torch.device("cpu")}))


@pytest.mark.parametrize(("backend", "trainer_ranks", "breaks"), [
    (pb.BACKEND_NCCL, 2, True), (pb.BACKEND_GLOO, 2, False), (pb.BACKEND_NCCL, 1, False)],
    ids=["part over nccl", "part over gloo", "one trainer over nccl"])
def test_a_part_that_sent_over_nccl_breaks_its_group_if_its_push_fails(backend, trainer_ranks, breaks):
    """NCCL completes a send that fits the connection's buffer before its receiver posts the receive: if the update
    then fails, an owner whose receive was never forwarded would take those bytes at its next receive on the same
    group (the next update's), every later bucket of that pair shifted by one. So a part that sent over NCCL reads
    as broken (client/push/job.py closes the group and refuses to push on it when the push fails); Gloo sends wait
    for their receiver, and one trainer broadcasts (every worker joins every broadcast)."""
    sink = CollectiveSink(Loop(), Collective(backend, trainer_ranks), PackBuffers(torch.device("cpu")))
    assert not sink.broken  # nothing sent yet
    assert sink.send(0, zeros(), tensor_pb2.Checksum(), [Stream([3])]) is None
    assert sink.finish() is None  # every send of this push completed
    assert sink.broken is breaks


def update(owned: list[int], lane_starts: list[int], group_id: str = "g") -> ReceiveUpdate:
    command = wpb.PrepareUpdateCommand(update_id="u", group_id=group_id, lane_starts=lane_starts,
                                       buckets=[wpb.OwnedBucket(sequence=s) for s in owned])
    return ReceiveUpdate(command, {s: b for s, b in zip(owned, command.buckets, strict=True)}, sorted(owned),
                         lane_starts=lane_starts or [0])


def test_a_workers_receives_of_several_parts_take_turns_in_the_global_order():
    # Part 0's buckets are the store's 0..2, part 1's 3..5: owned 0, 2 (part 0's 0 and 2), 3, 4 (part 1's 0, 1).
    receiving = update([0, 2, 3, 4], [0, 3])
    assert list(receiving.turns) == [0, 3, 4, 2]
    assert receiving.in_turn(0) and not receiving.in_turn(3) and not receiving.in_turn(2)
    assert receiving.in_turn(5)  # not one of its turns (not owned): runs at once, and is refused as it runs
    receiving.took_turn(0)
    assert receiving.in_turn(3) and not receiving.in_turn(4)
    receiving.took_turn(2)  # not its turn: nothing moves
    assert list(receiving.turns) == [3, 4, 2]
    for sequence in (3, 4, 2):
        receiving.took_turn(sequence)
    assert not receiving.turns and receiving.in_turn(0)  # taken already: runs, and is refused as it runs


@pytest.mark.parametrize(("lanes", "group"), [([], "g"), ([0, 3], "")], ids=["one part", "not collective"])
def test_receives_of_one_part_or_over_the_ingress_take_no_turns(lanes, group):
    receiving = update([0, 2, 3, 4], lanes, group)
    assert not receiving.turns and all(receiving.in_turn(s) for s in (4, 3, 2, 0))


class Pending:
    """A transfer nobody receives: it completes only when released (a Gloo wait ends at its timeout)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def is_completed(self) -> bool:
        return self.release.is_set()

    def exception(self) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def wait(self, timeout=None) -> bool:
        if not self.release.wait(timeout.total_seconds() if timeout is not None else 60):
            raise RuntimeError("Timed out waiting for send operation to complete")
        return True


class PendingPG:
    """A process group whose sends are on the wire until released (NCCL: a batch each); abort releases."""

    def __init__(self) -> None:
        self.work = Pending()
        self.sent: list[tuple[int, int]] = []
        self.aborted = threading.Event()

    def _start_coalescing(self) -> None:
        pass

    def _end_coalescing(self) -> Pending:
        return self.work

    def send(self, tensors, destination: int, tag: int) -> Pending:
        self.sent.append((destination, tag))
        return self.work

    def abort(self) -> None:
        self.aborted.set()


@pytest.mark.parametrize("backend", [pb.BACKEND_NCCL, pb.BACKEND_GLOO])
def test_a_part_stops_waiting_for_its_sends_once_a_server_says_the_update_is_aborting(backend):
    pg = PendingPG()
    group = CollectiveGroup("g", backend, 0, 4, datetime.timedelta(seconds=60), torch.device("cpu"), pg,
                            trainer_ranks=2)
    sink = CollectiveSink(Loop(), group, PackBuffers(torch.device("cpu")))
    streams = [Stream([5]), Stream([3])]
    assert sink.send(0, zeros(), tensor_pb2.Checksum(), streams) is None  # on the wire
    told = WeightSyncRpcError("s:1", grpc.StatusCode.ABORTED, "PART_FAILED", "part 1 failed", {"part": "1"})
    streams[1].failed, streams[1].reported_error = True, told
    started = time.monotonic()
    assert sink.finish() is told  # the server's word, long before the send's deadline (60 s)
    assert time.monotonic() - started < 5 and sink.broken and pg.sent == [(3, 0), (5, 0)]
    assert group.closed == (backend == pb.BACKEND_NCCL)  # NCCL's group aborted with its send
    assert pg.aborted.wait(5) == (backend == pb.BACKEND_NCCL)
    pg.work.release.set()
    # The next push on a new group goes through, its sends waited for to completion.
    fresh = PendingPG()
    fresh.work.release.set()
    group = CollectiveGroup("g2", backend, 0, 4, datetime.timedelta(seconds=60), torch.device("cpu"), fresh,
                            trainer_ranks=2)
    sink = CollectiveSink(Loop(), group, PackBuffers(torch.device("cpu")))
    assert sink.send(0, zeros(), tensor_pb2.Checksum(), [Stream([5]), Stream([3])]) is None
    assert sink.finish() is None and fresh.sent == [(3, 0), (5, 0)]


_RECEIVER = """
import datetime, sys
import torch
from torch.distributed import TCPStore
from weightsync.common.collective import open_group
from weightsync.v1 import weight_sync_service_pb2 as pb
port, group_id, timeout_s, leave = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] == "leave"
store = TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
group = open_group(group_id=group_id, backend=pb.BACKEND_GLOO, store=store, rank=1, world_size=2,
                   timeout=datetime.timedelta(seconds=timeout_s), device=torch.device("cpu"), local_address="127.0.0.1")
print("joined", flush=True)
sys.stdin.readline()  # the sender's send is under way
if leave:
    assert group.close(5.0)
print("done", flush=True)
sys.stdin.readline()  # held in the group (not receiving) until the sender is done
"""


def _gloo_pair(timeout_s: float, *, leave: bool):
    """Rank 0 of a Gloo group here, rank 1 (which never receives; it closes the group when `leave`) in a process
    of its own (a Gloo rendezvous holds the GIL: two ranks cannot join from threads of one process)."""
    import datetime
    import subprocess
    import sys
    import uuid

    from torch.distributed import TCPStore

    from weightsync.common.collective import open_group

    store = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    group_id = f"leave-{uuid.uuid4().hex}"
    child = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(store.port), group_id, str(timeout_s),
                              "leave" if leave else "stay"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sender = open_group(group_id=group_id, backend=pb.BACKEND_GLOO, store=store, rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds=timeout_s), device=torch.device("cpu"),
                        local_address="127.0.0.1")
    assert child.stdout is not None and child.stdout.readline() == "joined\n"
    return sender, child, store


def _told(child) -> None:
    child.stdin.write("go\n")
    child.stdin.flush()


@pytest.mark.parametrize("size", [8, 1 << 20])
def test_a_gloo_send_ends_when_its_receiver_leaves_the_group(size):
    """What CollectiveSink.finish relies on (and docs/data-plane.md says): a Gloo send nobody receives ends, with
    a CollectiveError, as soon as its receiver closes the group (the servers' workers do at the update's abort),
    not at the group's timeout. The control: the same send with the receiver still in the group (not receiving)
    ends only at its deadline."""
    from weightsync.common.collective import CollectiveError

    for leave, deadline_s in ((True, 30.0), (False, 1.0)):
        sender, child, _store = _gloo_pair(30.0, leave=leave)
        try:
            work = sender.send_async(torch.ones(size, dtype=torch.uint8), 1, 5)
            _told(child)
            assert child.stdout.readline() == "done\n"
            started = time.monotonic()
            with pytest.raises(CollectiveError) as failed:
                sender.wait(work, started + deadline_s)
            waited = time.monotonic() - started
            if leave:
                # Ended by the peer's leaving, not at its deadline (30 s); Gloo says so as "Connection closed by
                # peer" or, when the socket is reset under a pending read, "Connection reset by peer".
                assert not failed.value.timed_out
                assert re.search(r"Connection (closed|reset) by peer", str(failed.value)), str(failed.value)
            else:
                assert waited >= 0.9 and failed.value.timed_out
        finally:
            _told(child)
            assert child.wait(30.0) == 0
            sender.close(5.0)
