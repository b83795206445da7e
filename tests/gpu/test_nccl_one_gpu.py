"""NCCL on one GPU: the trainer's own group code in a world of one rank, and why a trainer and a CUDA
worker that share a GPU use Gloo.

NCCL refuses two ranks of one communicator on one device: at init every rank gathers its peers' host
hash and PCI bus id, and two ranks with the same pair fail with ncclInvalidUsage ("Duplicate GPU
detected : rank 0 and rank 1 both on CUDA device ..."). A trainer and a CUDA worker on the same GPU
therefore cannot form an NCCL group at all: `backend="auto"` picks Gloo and logs why, `"nccl"` is
refused before any rendezvous (client/transfer_group.choose_backend), and the pair's test below checks
exactly that, then pushes over the Gloo group. What NCCL does run on one GPU is a group of one rank,
built as the trainer builds its own (client/rendezvous.Rendezvous -> common/collective.open_group:
weightsync's NCCL environment, a non-blocking communicator connected at once), a broadcast waited for by
polling against the group timeout, a broadcast that outlasts that timeout, and close() aborting the
communicator within its bound; after each failure a new group works.
"""

from __future__ import annotations

import datetime
import logging
import time

import pytest
import torch

from weightsync.client import WeightSyncClient, WeightSyncClientError
from weightsync.client.transports.rendezvous import Rendezvous
from weightsync.client.transports.transfer_group import gpu_uuid
from weightsync.common.collective import (
    CLOSE_JOIN_SECONDS,
    CollectiveError,
    CollectiveGroup,
    host_store,
)
from weightsync.common.device_identity import normalize_uuid
from weightsync.v1 import weight_sync_service_pb2 as pb

from gpukit import (
    SLEEP_CYCLES,
    assert_same_bytes,
    context_after_abort,
    context_sound,
    gpu_model,
    info,
    mapped_copy,
    record,
    written_behind_a_sleep,
)

pytestmark = pytest.mark.timeout(300)

DEVICE = torch.device("cuda", 0)
LAZY_PAIR_WARNING = "In lazy initialization mode, this will result in a new 2-rank"
"""torch's warning when a send or recv builds a two-rank communicator of its own (ProcessGroupNCCL::pointToPoint)."""


def open_alone(group_id: str, timeout_seconds: float) -> tuple[CollectiveGroup, object]:
    """A one-rank NCCL group, opened the way WeightSyncClient.create_group opens the trainer's rank 0,
    and its rendezvous store (kept for the group's life, as the SDK keeps it)."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    store = host_store("127.0.0.1", timeout)
    rendezvous = Rendezvous(group_id=group_id, backend=pb.BACKEND_NCCL, store=store, world_size=1,
                            timeout=timeout, device=DEVICE, local_address="127.0.0.1")
    return rendezvous.result(timeout_seconds + 10), store


@pytest.fixture
def polled(monkeypatch) -> list[str]:
    """Every NCCL wait that went through the polling path (group ids)."""
    calls: list[str] = []
    original = CollectiveGroup._wait_polling

    def spy(self: CollectiveGroup, work, deadline: float, stopped=None) -> None:
        calls.append(self.group_id)
        original(self, work, deadline, stopped)

    monkeypatch.setattr(CollectiveGroup, "_wait_polling", spy)
    return calls


def broadcast_and_check(group: CollectiveGroup, seed: int) -> None:
    """A broadcast queued behind a long kernel: wait() returns once it completed, the bytes as they were."""
    tensor = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device=DEVICE,
                           generator=torch.Generator(device="cuda").manual_seed(seed))
    expected = tensor.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES // 2)
    slept = torch.cuda.Event()
    slept.record()
    group.wait(group.broadcast_async(tensor))
    assert slept.query(), "wait() returned before the broadcast queued behind the kernel completed"
    assert_same_bytes({"t": tensor}, {"t": expected})  # a world of one: the root's own bytes


def test_a_one_rank_nccl_group_opens_broadcasts_waits_by_polling_and_closes(polled):
    group, _store = open_alone("solo-1", 30)
    try:
        assert group.backend == pb.BACKEND_NCCL and type(group._pg).__name__ == "ProcessGroupNCCL"
        broadcast_and_check(group, seed=1)
        broadcast_and_check(group, seed=2)
        assert polled == ["solo-1"] * 3  # the connect's 1-byte probe, then the two broadcasts
    finally:
        started = time.monotonic()
        assert group.close(), "aborting a healthy one-rank communicator did not finish within the bound"
        assert time.monotonic() - started < CLOSE_JOIN_SECONDS + 1
    assert group.close()  # twice is fine
    with pytest.raises(CollectiveError, match="closed"):
        group.broadcast_async(torch.zeros(8, dtype=torch.uint8, device=DEVICE))


@pytest.mark.aborts_queued_kernel
def test_a_broadcast_that_outlasts_the_group_timeout_fails_at_it_and_close_stays_bounded(polled):
    """The polling wait gives up at the group's timeout (never torch's timed wait, which would abort in this
    thread); close() aborts the communicator with the broadcast still queued, within CLOSE_JOIN_SECONDS;
    the device stays usable (recorded: context_after_abort) and the next group works."""
    context_sound()
    timeout = 2.0
    group, _store = open_alone("solo-late", timeout)
    tensor = torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda._sleep(6 * SLEEP_CYCLES)  # about 6 s: the broadcast completes only after it
    work = group.broadcast_async(tensor)
    started = time.monotonic()
    with pytest.raises(CollectiveError) as failed:
        group.wait(work)
    waited = time.monotonic() - started
    assert failed.value.timed_out and timeout <= waited < timeout + 1, waited
    assert polled == ["solo-late"] * 2  # the connect's probe, then this broadcast
    started = time.monotonic()
    closed = group.close()
    assert time.monotonic() - started < CLOSE_JOIN_SECONDS + 1, f"close() held its caller (finished: {closed})"
    context_after_abort("one_gpu_broadcast_outlasting_its_timeout")  # the kernel drains; the context is sound
    after, _after_store = open_alone("solo-next", 30)
    try:
        broadcast_and_check(after, seed=3)
    finally:
        assert after.close()


def test_a_batch_on_the_groups_communicator_waits_for_the_callers_stream_and_returns_a_work(capfd):
    """Review H3, F2: what every point-to-point transfer of parts over NCCL goes through, on one GPU: a batch (a send
    to itself and the matching receive) started by CollectiveGroup.start_batch on the communicator open_group's
    connect built, from a caller running on a side stream behind ~1 s of kernel. torch's _end_coalescing returns a
    real work (torch 2.11 included); the batch waits for the caller's stream (the start thread took it), not for
    the legacy default stream; is_completed() is False meanwhile; group.wait() reads its outcome (torch 2.11's
    fallback included) and orders the caller's stream after it; the bytes arrive; torch built no two-rank
    communicator (its lazy-mode warning absent). What one GPU cannot show, close() ending a pair's connect, is
    test_nccl_two_ranks.py's (a first send to a rank that never receives)."""
    from weightsync.common.nccl_p2p import PointToPoint

    group, _store = open_alone("batch-1", 30)
    try:
        sent = torch.arange(1 << 20, dtype=torch.int64, device=DEVICE).to(torch.uint8)
        received = torch.zeros_like(sent)
        side = torch.cuda.Stream(DEVICE)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)  # ~1 s on the caller's stream, not the default one
            slept = torch.cuda.Event()
            slept.record(side)
            work = group.start_batch([PointToPoint(True, sent, 0), PointToPoint(False, received, 0)])
            waiting = work is not None and not work.is_completed()
            group.wait(work)
            ordered = slept.query()  # the caller's stream is past the sleep once wait() returned
        same = bool(torch.equal(received, sent))
        err = capfd.readouterr().err
        record("batch_on_the_groups_communicator", work=type(work).__name__, completed_while_the_caller_slept=not waiting,
               caller_stream_ordered=ordered, bytes_ok=same, lazy_pair_warning=LAZY_PAIR_WARNING in err)
        assert work is not None and waiting, "the batch did not wait for the caller's (side) stream"
        assert ordered and same
        assert LAZY_PAIR_WARNING not in err
        assert group.peers == {0}
        again = torch.zeros_like(sent)  # the next batch runs at once (nothing left to connect)
        group.wait(group.start_batch([PointToPoint(True, sent, 0), PointToPoint(False, again, 0)]))
        assert torch.equal(again, sent)
    finally:
        assert group.close()


def test_a_trainer_and_a_cuda_worker_on_one_gpu_use_gloo_and_say_why(cuda_server, caplog):
    """NCCL cannot put this process (rank 0) and the server's worker on cuda:0 into one communicator
    (Duplicate GPU): `nccl` is refused naming the worker and the GPU, before any group exists; `auto`
    picks Gloo and logs the reason; the push then goes over that Gloo group, bit for bit."""
    caplog.set_level(logging.INFO, logger="weightsync.client")
    mine = gpu_uuid(DEVICE)
    server = info(cuda_server)
    assert pb.BACKEND_NCCL in server.backends, "the CUDA worker offers NCCL: only the shared GPU rules it out"
    assert normalize_uuid(server.workers[0].device_uuid) == mine
    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        with pytest.raises(WeightSyncClientError, match="NCCL cannot put two ranks of one group on one GPU") as refused:
            client.create_group(backend="nccl", timeout=60)
        assert "worker 0 of " in str(refused.value) and mine in str(refused.value)
        assert [groups for groups in client.list_groups().values()] == [[]]  # refused before any rendezvous
        client.create_group(backend="auto", timeout=60)
        [groups] = client.list_groups().values()
        assert [g.backend for g in groups] == [pb.BACKEND_GLOO]
        said = [r.weightsync for r in caplog.records if getattr(r, "weightsync", {}).get("event") == "nccl_not_chosen"]
        assert said and said[-1]["reason"] == "a worker shares this process's GPU" and said[-1]["gpu"] == mine
        model = written_behind_a_sleep(gpu_model(60))
        client.push(model, version="v1", transport="collective", allow_new_tensors=True)
        assert client.verify(model).ok
        assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), model)
