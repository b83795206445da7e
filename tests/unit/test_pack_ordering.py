"""Every read of a pack buffer is ordered after the copies into it, whatever the devices (CPU-only tests).

The decision (read_order) is table-tested for every (source device, buffer device)
pair; then the real hot loop (PushRun over the real sinks and pack buffers) runs with
a fake CUDA event API and packing's one device check faked to say "cuda:0", and every
reader - the checksum, Gloo's broadcast, INLINE's chunks, the SHM announcement - is
checked to come after a wait on every event recorded after the copies into its buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from dataclasses import dataclass, field

import pytest
import torch

from weightsync.client.buckets import packing
from weightsync.client.buckets.packing import PackBuffers, TensorSource
from weightsync.client.buckets.planning import build_plan, plan_proto
from weightsync.client.buckets.read_order import (
    BufferFence,
    ReadOrder,
    Wait,
    read_order,
    wants_checksum,
)
from weightsync.client.push import run as push
from weightsync.client.push.run import PushRun
from weightsync.client.transports.collective import CollectiveSink
from weightsync.client.transports.inline import InlineSink
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

CPU = torch.device("cpu")
GPU0 = torch.device("cuda", 0)
GPU1 = torch.device("cuda", 1)


# -- the decision, for every pair -------------------------------------------------------------------------
ORDERS = [
    # name, source devices, buffer device, events recorded on, how a reader waits
    ("cpu -> cpu", {CPU}, CPU, (), Wait.NONE),
    ("cuda -> pinned cpu", {GPU0}, CPU, (GPU0,), Wait.HOST),
    ("cuda -> cuda", {GPU0}, GPU0, (GPU0,), Wait.STREAM),
    ("cpu -> cuda", {CPU}, GPU0, (GPU0,), Wait.STREAM),
    ("cuda:1 -> cuda:0", {GPU1}, GPU0, (GPU0, GPU1), Wait.STREAM),
    ("cpu and cuda -> cpu", {CPU, GPU0}, CPU, (GPU0,), Wait.HOST),
    ("cuda:0 and cuda:1 -> cpu", {GPU1, GPU0}, CPU, (GPU0, GPU1), Wait.HOST),
    ("only empty tensors -> cpu", set(), CPU, (), Wait.NONE),
    ("only empty tensors -> cuda", set(), GPU0, (GPU0,), Wait.STREAM),
]


@pytest.mark.parametrize(("sources", "buffer", "record_on", "wait"), [o[1:] for o in ORDERS], ids=[o[0] for o in ORDERS])
def test_read_order_for_every_device_pair(sources, buffer, record_on, wait):
    assert read_order(sources, buffer) == ReadOrder(record_on, wait, buffer)


CHECKSUMS = [
    ("asked on, cpu", True, {CPU}, CPU, True),
    ("asked off, cuda", False, {GPU0}, CPU, False),
    ("default, cpu -> cpu (Gloo)", None, {CPU}, CPU, False),
    ("default, cuda -> pinned cpu (Gloo)", None, {GPU0}, CPU, True),
    ("default, mixed -> cpu", None, {CPU, GPU0}, CPU, True),
    ("default, cuda -> cuda (NCCL)", None, {GPU0}, GPU0, True),
    ("default, cpu -> cuda (NCCL)", None, {CPU}, GPU0, True),
]


@pytest.mark.parametrize(("explicit", "sources", "buffer", "expected"), [c[1:] for c in CHECKSUMS],
                         ids=[c[0] for c in CHECKSUMS])
def test_checksums_default_on_whenever_bytes_come_from_or_through_cuda(explicit, sources, buffer, expected):
    assert wants_checksum(explicit, sources, buffer) is expected


# -- a fake CUDA -----------------------------------------------------------------------------------------
@dataclass(eq=False)
class FakeEvent:
    device: torch.device
    waited_by: list[str] = field(default_factory=list)


@dataclass
class FakeEvents:
    """Records what a real CUDA event API would be asked to do."""

    log: list[tuple] = field(default_factory=list)

    def record(self, device: torch.device) -> FakeEvent:
        event = FakeEvent(device)
        self.log.append(("record", device))
        return event

    def host_wait(self, event: FakeEvent) -> None:
        event.waited_by.append("host")
        self.log.append(("host_wait", event.device))

    def stream_wait(self, device: torch.device, event: FakeEvent) -> None:
        event.waited_by.append(f"stream {device}")
        self.log.append(("stream_wait", device, event.device))


@pytest.mark.parametrize(("buffer", "waiter"), [(CPU, "host"), (GPU0, "stream cuda:0")])
def test_a_fence_makes_every_read_wait_for_the_last_copies(buffer, waiter):
    events = FakeEvents()
    fence = BufferFence(events)
    fence.before_read()  # nothing copied yet: nothing to wait for
    assert events.log == []
    fence.after_copies(read_order({GPU0, GPU1}, buffer))
    recorded = list(fence._recorded)
    assert [e.device for e in recorded] == [GPU0, GPU1]
    assert all(not e.waited_by for e in recorded)
    fence.before_read()
    fence.before_read()  # a second reader of the same bytes waits too
    assert [e.waited_by for e in recorded] == [[waiter, waiter]] * 2
    fence.after_copies(read_order({CPU}, CPU))  # the next bucket in this buffer: CPU to CPU
    fence.before_read()
    assert len(events.log) == 6  # 2 records + 4 waits, nothing for the CPU copy


# -- the real hot loop, every reader ------------------------------------------------------------------------
class Readers:
    """Checks, at each read, that every event recorded after the last copies into that buffer was waited on."""

    def __init__(self, buffers: PackBuffers) -> None:
        self.buffers = buffers
        self.reads: list[tuple[str, int]] = []

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        for index, slot in enumerate(self.buffers.slots):
            if slot.numel() and tensor.data_ptr() == slot.data_ptr():
                return index
        return None

    def check(self, who: str, slot: int | None) -> None:
        assert slot is not None, f"{who} read memory that is no pack buffer"
        recorded = self.buffers.fences[slot]._recorded
        assert recorded, f"{who}: no event was recorded after the copies into buffer {slot}"
        unwaited = [e for e in recorded if not e.waited_by]
        assert not unwaited, f"{who} read buffer {slot} before the copies into it completed"
        self.reads.append((who, slot))


class FakeLoop:
    def run(self, coro, timeout=None):
        return asyncio.run(coro)  # a loop of its own for each call: InlineSink gathers its servers' sends

    def call_soon(self, fn, *args):
        fn(*args)


class FakeStream:
    server = "fake:1"
    failed = False
    unresponsive = False
    reported_error = None

    def __init__(self, on_announce) -> None:
        self.ready: concurrent.futures.Future[pb.UpdateReady] = concurrent.futures.Future()
        self.ready.set_result(pb.UpdateReady())  # no run of slots named: SHM packs into the whole ingress
        self.announced: list[pb.BucketStart] = []
        self._on_announce = on_announce
        self.chunks: list[bytes] = []
        self.on_chunk = None

    def stores(self, index: int) -> bool:
        return True  # a server that stores every tensor

    def send(self, message: pb.UpdateWeightsRequest) -> None:
        assert message.WhichOneof("message") == "bucket_start"
        self.announced.append(message.bucket_start)
        self._on_announce(message.bucket_start)

    async def send_data(self, chunk: bytes) -> None:
        if self.on_chunk is not None:
            self.on_chunk(chunk)
        self.chunks.append(chunk)

    def wait_applied(self, count: int, timeout: float) -> bool:
        return True


class FakeCollective:
    backend = pb.BACKEND_NCCL
    trainer_ranks = 1
    """One trainer: NCCL broadcasts (parts send point-to-point)."""

    def __init__(self, readers: Readers) -> None:
        self._readers = readers

    def broadcast_async(self, tensor: torch.Tensor) -> object:
        self._readers.check("gloo broadcast", self._readers.slot_of(tensor))
        return object()

    def deadline(self) -> float:
        return float("inf")  # these transfers never time out: what is checked is the order of reads

    def wait(self, work: object, deadline: float | None = None) -> None:
        pass


def small_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"t{i}": torch.randn(100 + i, generator=g) for i in range(12)}


def make_sink(transport: str, events: FakeEvents, tmp_fd_holder: list[int]):
    if transport == "collective":
        buffers = PackBuffers(CPU, events=events)
        readers = Readers(buffers)
        return CollectiveSink(FakeLoop(), FakeCollective(readers), buffers), readers
    buffers = PackBuffers(CPU, events=events)
    return InlineSink(FakeLoop(), buffers, max_chunk_bytes=256), Readers(buffers)


@pytest.mark.parametrize("checksums", [None, False], ids=["checksums by default", "checksums off"])
@pytest.mark.parametrize("transport", ["collective", "inline"])
def test_every_reader_waits_for_the_copies_from_cuda(monkeypatch, transport, checksums):
    """A CUDA trainer over Gloo/INLINE: copies into a (pinned) CPU buffer run on cuda:0's stream. (SHM writes
    no pack buffer: each bucket is announced once its own copies' events completed, tests/test_shm_writes.py.)"""
    monkeypatch.setattr(packing, "devices_of", lambda tensors: frozenset({GPU0}))
    events = FakeEvents()
    fds: list[int] = []
    sink, readers = make_sink(transport, events, fds)
    try:
        real_checksum = push.tensor_checksum

        def checksum(tensor: torch.Tensor) -> tensor_pb2.Checksum:
            readers.check("checksum", readers.slot_of(tensor))
            return real_checksum(tensor)

        monkeypatch.setattr(push, "tensor_checksum", checksum)
        model = small_model()
        planned = build_plan(list(model.items()), 512, zero_copy_min_bytes=0)  # every bucket packed
        assert len(planned) >= 4
        buffers = sink.buffers
        buffers.ensure(max(b.spec.size_bytes for b in planned))
        stream = FakeStream(lambda start: None)
        if transport == "inline":
            # Chunks of bucket k (the last announced) are cut from buffer k % 2.
            stream.on_chunk = lambda chunk: readers.check("inline chunk",
                                                          (len(stream.announced) - 1) % len(buffers.slots))
        run = PushRun(loop=FakeLoop(), servers=[], metadata=(), rpc_timeout=5, commit_timeout=5, group_id="",
                      sink=sink, planned=planned, plan=plan_proto(planned), plan_id="p",
                      source=TensorSource(model, None), version="v", mode=pb.UPDATE_MODE_STAGED,
                      allow_new_tensors=False, checksums=checksums, progress=None, bar=None, started=0.0)
        assert run._send_buckets([stream]) is None
        # Every bucket was read by its transport, after its copies; checksums by default (bytes from CUDA).
        reader = {"collective": "gloo broadcast", "inline": "inline chunk"}[transport]
        assert sum(1 for who, _ in readers.reads if who == reader) >= len(planned)
        expected_checksums = len(planned) if checksums is None else 0
        assert sum(1 for who, _ in readers.reads if who == "checksum") == expected_checksums
        assert [s.checksum.algorithm != 0 for s in stream.announced] == [checksums is None] * len(planned)
        assert [s.size_bytes for s in stream.announced] == [b.spec.size_bytes for b in planned]
        assert ("record", GPU0) in events.log and ("host_wait", GPU0) in events.log
    finally:
        for fd in fds:
            os.close(fd)


def test_cpu_tensors_over_gloo_record_nothing_and_skip_checksums(monkeypatch):
    events = FakeEvents()
    sink, readers = make_sink("collective", events, [])
    model = small_model()
    planned = build_plan(list(model.items()), 512, zero_copy_min_bytes=0)
    sink.buffers.ensure(max(b.spec.size_bytes for b in planned))
    stream = FakeStream(lambda start: None)
    monkeypatch.setattr(FakeCollective, "broadcast_async", lambda self, tensor: object())
    run = PushRun(loop=FakeLoop(), servers=[], metadata=(), rpc_timeout=5, commit_timeout=5, group_id="",
                  sink=sink, planned=planned, plan=plan_proto(planned), plan_id="p",
                  source=TensorSource(model, None), version="v", mode=pb.UPDATE_MODE_STAGED,
                  allow_new_tensors=False, checksums=None, progress=None, bar=None, started=0.0)
    assert run._send_buckets([stream]) is None
    assert events.log == []
    assert all(s.checksum.algorithm == 0 for s in stream.announced)


class InFlightCollective(FakeCollective):
    """Broadcasts complete only when waited for: which pack buffers are still being read."""

    def __init__(self, readers: Readers) -> None:
        super().__init__(readers)
        self.in_flight: dict[int, int] = {}  # work id -> pack buffer it reads
        self.most_in_flight = 0

    def broadcast_async(self, tensor: torch.Tensor) -> object:
        super().broadcast_async(tensor)
        work = object()
        self.in_flight[id(work)] = self._readers.slot_of(tensor)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return work

    def wait(self, work: object, deadline: float | None = None) -> None:
        del self.in_flight[id(work)]


def test_bucket_k_starts_before_k_minus_1_is_waited_and_no_pack_buffer_is_refilled_while_read(monkeypatch):
    """The SDK starts bucket k's broadcast, then waits for k-1's: two in flight at most, and the pack
    of bucket k+1 (into k-1's buffer) only once nothing reads that buffer any more."""
    monkeypatch.setattr(packing, "devices_of", lambda tensors: frozenset({GPU0}))  # copies from a CUDA stream
    events = FakeEvents()
    buffers = PackBuffers(CPU, events=events)
    readers = Readers(buffers)
    collective = InFlightCollective(readers)
    sink = CollectiveSink(FakeLoop(), collective, buffers)
    real_fill = sink.fill

    def fill(index, bucket, source, streams):
        slot = index % len(buffers.slots)
        assert slot not in collective.in_flight.values(), f"bucket {index} packed into buffer {slot} while it is sent"
        return real_fill(index, bucket, source, streams)

    monkeypatch.setattr(sink, "fill", fill)
    model = small_model()
    planned = build_plan(list(model.items()), 512, zero_copy_min_bytes=0)  # every bucket packed
    assert len(planned) >= 4
    buffers.ensure(max(b.spec.size_bytes for b in planned))
    stream = FakeStream(lambda start: None)
    run = PushRun(loop=FakeLoop(), servers=[], metadata=(), rpc_timeout=5, commit_timeout=5, group_id="",
                  sink=sink, planned=planned, plan=plan_proto(planned), plan_id="p",
                  source=TensorSource(model, None), version="v", mode=pb.UPDATE_MODE_STAGED,
                  allow_new_tensors=False, checksums=False, progress=None, bar=None, started=0.0)
    assert run._send_buckets([stream]) is None
    assert collective.most_in_flight == 2 and not collective.in_flight
    assert [s.sequence for s in stream.announced] == list(range(len(planned)))
