"""SHM at the copy limit (issue 45): a trainer on the server's host writes each bucket the server places in the
node store straight there, in one copy of each byte with its WS64 computed as it copies; the bucket's owner
checks it where it lies, before the bucket counts as applied; a bucket the server does not place goes
through an ingress slot, in one copy too.

The rules as tables (which buckets the server places, the padding a trainer writes as zeros, the WS64 of a
bucket from its pieces), the order in which the sink announces what it copies from CUDA (fake events), then
a real server: the bytes each process of a push copies and reads, counted (common/byte_passes.py), and the
guarantees over this path: a trainer killed halfway through writing the store, a byte that changes in the
store after the trainer wrote it, a second trainer on the node while the first writes. Each failure is
followed by the next push and a verify.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.client.buckets.packing import TensorSource
from weightsync.client.buckets.planning import build_plan
from weightsync.client.push.run import PushRun
from weightsync.client.transports import store_writes
from weightsync.client.transports.shm import IN_FLIGHT, ShmSink
from weightsync.client.transports.store_writes import SMALL_TENSOR_BYTES, Region, gaps
from weightsync.common import byte_passes, ws64_host
from weightsync.common.checksum import ws64_reference, ws64_terms, ws64_terms_torch
from weightsync.common.ws64_host import copy_ws64_terms
from weightsync.server.store.update_plan import (
    BoxCopy,
    BucketRoute,
    DirectTarget,
    PatchTarget,
    TensorCopy,
)
from weightsync.server.store.writes import ClientRegion, client_regions
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server, wait_for
from models import mixed_model

pytestmark = pytest.mark.timeout(240)
BUCKET_BYTES = 1 << 20
SLOT = 16 << 20
MASK = (1 << 64) - 1


def model(seed: int) -> dict[str, torch.Tensor]:
    """mixed_model (every dtype, odd sizes, a tensor split in pieces) and six 512 KiB tensors: 5 buckets, large
    tensors copied one by one and small ones by groups (client/store_writes.StoreWriter._copy_host)."""
    g = torch.Generator().manual_seed(seed + 1)
    return mixed_model(seed) | {f"layers.{i}.mlp.weight": torch.randn(131072, generator=g) for i in range(6)}


# -- which buckets the server places in the store -------------------------------------------------------
def spec(*tensors: tuple[int, int], deferred: bool = False) -> tensor_pb2.BucketSpec:
    """A bucket of tensors (offset, size)."""
    bucket = tensor_pb2.BucketSpec(size_bytes=max(o + s for o, s in tensors), deferred=deferred)
    for i, (offset, size) in enumerate(tensors):
        bucket.tensors.add(name=f"t{i}", offset_bytes=offset, size_bytes=size)
    return bucket


def route(size: int, *, into: DirectTarget | None = None, copies=(), stored: bool = True, patches=(),
          boxes=()) -> BucketRoute:
    return BucketRoute(size, into, tuple(copies), (), (), patches=tuple(patches), stored=stored, box_copies=tuple(boxes))


PATCH = PatchTarget("t0", 0, 8, tensor_pb2.TENSOR_ENCODING_PATCH_XOR, 1, 0)
BOX = BoxCopy("t0", 0, 8, 0, 0, torch.float32, (4,), (0,), (2,))


@pytest.mark.parametrize(("bucket", "routed", "expected"), [
    # a segment's layout: the whole bucket, padding included, at the segment (or its shadow)
    (spec((0, 100), (128, 60)), route(188, into=DirectTarget(3, 0)), (ClientRegion(0, 188, 3, 0),)),
    # a piece of a split tensor: its place in the tensor
    (spec((0, 4096)), route(4096, into=DirectTarget(5, 8192)), (ClientRegion(0, 4096, 5, 8192),)),
    # the general path: each tensor to its own place, in bucket order
    (spec((0, 100), (128, 60)), route(188, copies=[TensorCopy(128, 60, 2, 640), TensorCopy(0, 100, 1, 0)]),
     (ClientRegion(0, 100, 1, 0), ClientRegion(128, 60, 2, 640))),
    # a tensor that starts off a word of the bucket: its terms are not its own
    (spec((0, 100), (100, 60)), route(160, copies=[TensorCopy(0, 100, 1, 0), TensorCopy(100, 60, 1, 104)]), None),
    # a tensor of the bucket this node does not store: no place for its bytes
    (spec((0, 100), (128, 60)), route(188, copies=[TensorCopy(0, 100, 1, 0)]), None),
    (spec((0, 100)), route(100, stored=False), None),
    (spec((0, 100), deferred=True), route(100), None),
    (spec((0, 8)), route(8, copies=[TensorCopy(0, 8, 1, 0)], patches=[PATCH]), None),
    (spec((0, 8)), route(8, boxes=[BOX]), None),
    (spec((0, 0)), route(0, copies=[]), None),
], ids=["segment", "piece", "general", "unaligned", "partly-stored", "not-stored", "deferred", "patch", "box",
        "empty"])
def test_which_buckets_a_trainer_writes_into_the_store(bucket, routed, expected):
    assert client_regions(routed, bucket) == expected


@pytest.mark.parametrize(("regions", "written", "expected"), [
    ([Region(0, 188, 1, 0)], [(0, 100), (128, 60)], [(100, 28)]),
    ([Region(0, 200, 1, 0)], [(0, 100), (128, 60)], [(100, 28), (188, 12)]),
    ([Region(0, 100, 1, 0), Region(128, 60, 1, 500)], [(0, 100), (128, 60)], []),
    ([Region(0, 64, 1, 0)], [(0, 0), (0, 64)], []),
    ([Region(0, 64, 1, 0)], [], [(0, 64)]),
])
def test_the_padding_a_trainer_writes_as_zeros(regions, written, expected):
    assert gaps(regions, written) == expected


@pytest.mark.parametrize("size", [0, 5, 8, 4096, 4101, 512 * 8 * 3 + 13, 100_003])
def test_a_buckets_ws64_is_its_length_plus_its_pieces_terms(size):
    """Pieces starting on words, each copied and summed in one pass (host) or summed on the device's own
    torch reductions (here the CPU's), add up to the WS64 of the whole bucket."""
    raw = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    expected = ws64_reference(raw.tobytes())
    cuts = sorted({0, size, *(c for c in (8, 4096, 8 * 511, 8 * 513, 8 * 1030) if c < size)})
    out = np.zeros_like(raw)
    host = device = 0
    for start, end in zip(cuts, cuts[1:], strict=False):
        host += copy_ws64_terms(out[start:end], raw[start:end], start // 8)
        device += int(ws64_terms_torch(torch.from_numpy(raw[start:end]), start // 8))
    assert (size + host) & MASK == (size + device) & MASK == expected
    assert (size + ws64_terms(torch.from_numpy(raw))) & MASK == expected
    assert out.tobytes() == raw.tobytes()
    if size > 9:  # an unaligned source or destination: copied, then summed
        odd = np.zeros(size, np.uint8)
        assert (size - 1 + copy_ws64_terms(odd[1:], raw[1:])) & MASK == ws64_reference(raw[1:].tobytes())
        assert odd[1:].tobytes() == raw[1:].tobytes()


@pytest.mark.parametrize(("size", "chunk"), [(100_003, 8), (100_003, 4096), (100_003, 4100), (4096, 1 << 20),
                                             (0, 64)])
def test_a_checksum_split_over_threads_is_the_same_sum(size, chunk):
    """The owner splits a large check over threads (gpu_worker/bucket_checks.py): chunks of whole words, each
    summed at the word where it starts, add up to the terms of the whole."""
    raw = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    calls = []

    def run(fn, chunks, firsts):
        calls.append(len(chunks))
        return map(fn, chunks, firsts)

    assert ws64_host.ws64_terms_split(raw, 77, run, chunk_bytes=chunk) == ws64_host.ws64_terms(raw, 77)
    assert calls == [max(1, -(-size // (chunk - chunk % 8 or 8)))]


# -- the sink: what is copied from CUDA is announced once its copies completed ---------------------------
class FakeEvent:
    """A CUDA event that completes when waited for (the host blocks until the copies are done)."""

    def __init__(self, log: list[str], sequence: int) -> None:
        self.completed = False
        self._log = log
        self._sequence = sequence

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        if not self.completed:
            self._log.append(f"waited {self._sequence}")
        self.completed = True


class FakeLoop:
    def call_soon(self, fn, *args) -> None:
        fn(*args)


class FakeStream:
    server = "fake:1"
    failed = False
    unresponsive = False
    reported_error = None

    def __init__(self, log: list[str], writes: dict, ready: pb.UpdateReady) -> None:
        import concurrent.futures

        self.ready: concurrent.futures.Future[pb.UpdateReady] = concurrent.futures.Future()
        self.ready.set_result(ready)
        self.announced: list[pb.BucketStart] = []
        self._log = log
        self._writes = writes

    def send(self, message: pb.UpdateWeightsRequest) -> None:
        start = message.bucket_start
        write = self._writes[start.sequence]
        assert all(c.event.completed for c in write.device), f"bucket {start.sequence} announced before its copies"
        self._log.append(f"announced {start.sequence}")
        self.announced.append(start)

    def wait_applied(self, count: int, timeout: float) -> bool:
        """The server applies what it was told of at once: a bucket never announced is never applied."""
        assert count <= len(self.announced), f"waits for bucket {count - 1}, which was never announced"
        self._log.append(f"applied {count - 1}")
        return True


def push_copied_from_cuda(monkeypatch, ready: pb.UpdateReady, slots: int, arena: int | None = None):
    """PushRun over an ShmSink whose every bucket's copies are 'queued' (fake events, completed only when waited
    for), as from a CUDA trainer: the log of what happened, the announcements, the plan and the tensors."""
    log: list[str] = []
    writes: dict = {}
    real_write = store_writes.StoreWriter.write

    def queued(self, sequence, bucket, source, regions):
        write = real_write(self, sequence, bucket, source, regions)
        write.device.append(store_writes._DeviceCopies(FakeEvent(log, sequence), torch.zeros((), dtype=torch.int64)))
        writes[sequence] = write
        pending = sum(1 for w in writes.values() if not all(c.event.completed for c in w.device))
        assert pending <= IN_FLIGHT, f"{pending} buckets in flight at bucket {sequence}"
        log.append(f"queued {sequence}")
        return write

    monkeypatch.setattr(store_writes.StoreWriter, "write", queued)
    fd = os.memfd_create("ingress")
    os.ftruncate(fd, slots * 4096)
    opener = None if arena is None else lambda ids: ([(1, 1 << 20, os.dup(arena))] if ids else [], [1])
    sink = ShmSink(FakeLoop(), fd, 4096, slots, timeout=5, open_arenas=opener)  # type: ignore[arg-type]
    try:
        tensors = {f"t{i}": torch.randn(100 + i, generator=torch.Generator().manual_seed(i)) for i in range(12)}
        planned = build_plan(list(tensors.items()), 512, zero_copy_min_bytes=0)
        stream = FakeStream(log, writes, ready)
        plan = tensor_pb2.WeightPlan(buckets=[b.spec for b in planned])
        run = PushRun(loop=FakeLoop(), servers=[], metadata=(), rpc_timeout=5, commit_timeout=5, group_id="",  # type: ignore[arg-type]
                      sink=sink, planned=planned, plan=plan, plan_id="p", source=TensorSource(tensors, None),
                      version="v", mode=pb.UPDATE_MODE_STAGED, allow_new_tensors=False, checksums=False,
                      progress=None, bar=None, started=0.0)
        assert run._send_buckets([stream]) is None  # type: ignore[list-item]
        return log, stream.announced, planned, tensors
    finally:
        sink.close()
        os.close(fd)


def zero_padded(bucket, tensors) -> bytes:
    packed = bytearray(bucket.spec.size_bytes)
    for t in bucket.spec.tensors:
        packed[t.offset_bytes : t.offset_bytes + t.size_bytes] = tensors[t.name].numpy().tobytes()
    return bytes(packed)


def test_a_bucket_written_into_the_store_from_cuda_is_announced_once_its_copies_completed(monkeypatch):
    """Bucket k is announced after its own copies' event, while bucket k+1's copies run (two in flight), in plan
    order, with the checksum of the bucket as it lies in the store, zero-padded."""
    arena = os.memfd_create("arena")
    os.ftruncate(arena, 1 << 20)
    try:
        sizes = [b.spec.size_bytes for b in build_plan([(f"t{i}", torch.empty(100 + i)) for i in range(12)], 512,
                                                        zero_copy_min_bytes=0)]
        ready = pb.UpdateReady()
        for k, size in enumerate(sizes):  # every bucket placed, bucket k at 4 KiB * k of arena 1
            ready.store_places.add(sequence=k).regions.add(bucket_offset_bytes=0, size_bytes=size, arena_id=1,
                                                             offset_bytes=4096 * k)
        log, announced, planned, tensors = push_copied_from_cuda(monkeypatch, ready, slots=2, arena=arena)
        n = len(planned)
        assert n >= 4
        expected = ["queued 0", "queued 1", "waited 0", "announced 0"]
        for k in range(2, n):
            expected += [f"queued {k}", f"waited {k - 1}", f"announced {k - 1}"]
        assert log == [*expected, f"waited {n - 1}", f"announced {n - 1}"]
        assert [s.sequence for s in announced] == list(range(n))
        for start, bucket in zip(announced, planned, strict=True):
            placed = os.pread(arena, bucket.spec.size_bytes, 4096 * start.sequence)
            assert placed == zero_padded(bucket, tensors)
            assert start.checksum.value == ws64_reference(placed)
    finally:
        os.close(arena)


def test_a_slot_is_reused_only_once_the_bucket_before_in_it_was_applied(monkeypatch):
    """Through two ingress slots from CUDA: bucket k waits for the BucketApplied of bucket k-2, whose slot it
    reuses; k-2 was announced when k-1 was sent, so the wait is never on a bucket still held back for its
    copies (FakeStream.wait_applied checks it), and k-1's copies still overlap the wait."""
    log, announced, planned, tensors = push_copied_from_cuda(monkeypatch, pb.UpdateReady(), slots=2)
    n = len(planned)
    expected = ["queued 0", "queued 1", "waited 0", "announced 0"]
    for k in range(2, n):
        expected += [f"applied {k - 2}", f"queued {k}", f"waited {k - 1}", f"announced {k - 1}"]
    assert log == [*expected, f"waited {n - 1}", f"announced {n - 1}"]
    for start, bucket in zip(announced, planned, strict=True):
        assert start.checksum.value == ws64_reference(zero_padded(bucket, tensors))


# -- a real server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def passes(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("passes")


@pytest.fixture(scope="module")
def node(tmp_path_factory, passes):
    env = dict(os.environ, **{byte_passes.ENV: str(passes)})
    server = start_server(tmp_path_factory.mktemp("shm-writes"), "--ingress-slot-bytes", str(SLOT), workers=1,
                          env=env)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(node):
    with WeightSyncClient(node.address) as client:
        yield client


class Seeds:
    next = 900


def push(client: WeightSyncClient, tensors: dict[str, torch.Tensor], mode: str = "in_place", **options):
    Seeds.next += 1
    return client.push(tensors, version=f"v{Seeds.next}", transport="shm", mode=mode, delta=False,
                       bucket_size_bytes=BUCKET_BYTES, **options)


def committed(client: WeightSyncClient, seed: int) -> dict[str, torch.Tensor]:
    """A model committed over SHM STAGED (the store defined by the first one: every later push of this
    model's plan is placed in it)."""
    tensors = model(seed)
    push(client, tensors, mode="staged", allow_new_tensors=True)
    return tensors


def store_state(node) -> int:
    return node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).store_state


def holds(node, client, tensors: dict[str, torch.Tensor]) -> None:
    """The store is CONSISTENT and holds `tensors` bit for bit."""
    assert store_state(node) == pb.STORE_STATE_CONSISTENT, pb.StoreState.Name(store_state(node))
    assert server_checksums(node, sorted(tensors)) == [local_checksums(tensors)]


def wrote_the_store(passes: Path, before: dict[str, int]) -> bool:
    """The trainer copied bytes into the store (not into a slot) since `before` (byte_passes.collect)."""
    after = byte_passes.collect(passes)
    return (after.get("copy trainer.store", 0) > before.get("copy trainer.store", 0)
            and after.get("copy trainer.slot", 0) == before.get("copy trainer.slot", 0))


def next_push_verifies(node, client, seed: int, mode: str) -> None:
    after = model(seed)
    push(client, after, mode=mode)
    assert client.verify(after).ok
    holds(node, client, after)


def test_an_shm_push_copies_each_byte_once_and_its_owner_reads_it_once(node, client, passes, monkeypatch):
    """Counted in every process of the push: the trainer copies each tensor byte once, into the store, reading
    nothing back (its checksum is summed as it copies); the owner copies nothing and reads each bucket byte
    once (its check); the server touches none. (Before: the trainer packed into a slot and read it for the
    WS64, the owner copied the slot into the store and read its copy: 2 copies and 2 read passes.)"""
    monkeypatch.setattr(byte_passes, "_folder", str(passes))  # this process is the trainer: count here too
    committed(client, 1)
    tensors = model(2)
    before = byte_passes.collect(passes)
    result = push(client, tensors)
    after = byte_passes.collect(passes)
    counted = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    planned = build_plan(list(tensors.items()), BUCKET_BYTES, zero_copy_min_bytes=0)
    bucket_bytes = sum(b.spec.size_bytes for b in planned)
    small_bytes = sum(t.size_bytes for b in planned for t in b.spec.tensors if t.size_bytes < SMALL_TENSOR_BYTES)
    assert result.bucket_count == len(planned) >= 4
    assert counted.pop("copy trainer.store") == tensor_bytes
    assert counted.pop("read worker.check") == bucket_bytes
    # Small tensors grouped in a bucket are summed from their place right after one call copied the group, from
    # the cache (a small one alone in its bucket is copied and summed in one pass).
    assert 0 < counted.pop("read trainer.cached") <= small_bytes + (bucket_bytes - tensor_bytes)
    assert counted == {}
    assert bucket_bytes < tensor_bytes * 1.01  # the padding a segment has between its tensors
    assert client.verify(tensors).ok


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_trainer_killed_while_writing_the_store(node, client, passes, mode):
    """STAGED writes the shadows: the committed version stays bit for bit. IN_PLACE writes the live bytes: the
    store is INCONSISTENT (every placed bucket counts as written) until the next full push."""
    kept = committed(client, 10)
    before = byte_passes.collect(passes)
    script = Path(__file__).with_name("shm_writes_trainer.py")
    env = dict(os.environ, **{byte_passes.ENV: str(passes)})
    done = subprocess.run([sys.executable, str(script), node.address, mode, "11", "6"], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-3000:]
    assert wrote_the_store(passes, before)
    wait_for(lambda: store_state(node) != pb.STORE_STATE_UPDATING, timeout=60)
    if mode == "staged":
        holds(node, client, kept)
    else:
        assert store_state(node) == pb.STORE_STATE_INCONSISTENT
    next_push_verifies(node, client, 12, mode)


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_byte_changed_in_the_store_after_the_trainer_wrote_it_fails_the_owners_check(node, client, passes,
                                                                                      monkeypatch, mode):
    """The trainer's checksum is its source's: a byte of the store that is not what the trainer read (here
    flipped right after the copy) is DATA_LOSS BUCKET_CHECKSUM_MISMATCH from the owner, before commit."""
    monkeypatch.setattr(byte_passes, "_folder", str(passes))
    kept = committed(client, 20)
    before = byte_passes.collect(passes)
    real = store_writes.copy_ws64_terms
    calls = 0

    def corrupting(dst, src, first_word=0):
        nonlocal calls
        terms = real(dst, src, first_word)
        calls += 1
        if calls == 3:
            dst[src.size // 2] ^= 0x40
        return terms

    monkeypatch.setattr(store_writes, "copy_ws64_terms", corrupting)
    with pytest.raises(UpdateFailed) as caught:
        push(client, model(21), mode=mode)
    assert wrote_the_store(passes, before)
    monkeypatch.undo()
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH")
    if mode == "staged":
        holds(node, client, kept)
    else:
        assert store_state(node) == pb.STORE_STATE_INCONSISTENT
    next_push_verifies(node, client, 22, mode)


def test_a_second_trainer_on_the_node_is_refused_while_the_first_writes_the_store(node, client, passes,
                                                                                   monkeypatch):
    """One update at a time: a second SHM trainer's push is refused (UPDATE_IN_PROGRESS) while the first is
    writing its buckets into the store; the first commits what it wrote; the second then pushes."""
    monkeypatch.setattr(byte_passes, "_folder", str(passes))
    committed(client, 30)
    before = byte_passes.collect(passes)
    first, second_model = model(31), model(32)
    refusals: list[UpdateFailed] = []
    with WeightSyncClient(node.address) as second:

        def progress(report) -> None:
            if report.bucket == 1 and not refusals:
                with pytest.raises(UpdateFailed) as caught:
                    push(second, second_model)
                refusals.append(caught.value)

        push(client, first, progress=progress)
        assert wrote_the_store(passes, before)
        assert [(r.code, r.reason) for r in refusals] == [(grpc.StatusCode.FAILED_PRECONDITION, "UPDATE_IN_PROGRESS")]
        holds(node, client, first)
        push(second, second_model)
        assert second.verify(second_model).ok
        holds(node, client, second_model)


def test_an_shm_push_packs_large_tensors_into_few_buckets(node, client):
    """SHM copies every byte once anyway: a tensor gains nothing from a bucket of its own (the zero copy the
    other transports make of a large one), so the SDK packs them, up to the bucket size: 1 bucket here, not 4
    (three of 5 MiB alone, the small ones together), and the store takes them all the same."""
    g = torch.Generator().manual_seed(45)
    tensors = {f"big.{i}": torch.randn(5 << 18, generator=g) for i in range(3)} | {"small": torch.randn(9, generator=g)}
    first = client.push(tensors, version="packed-0", transport="shm", allow_new_tensors=True, delta=False,
                        bucket_size_bytes=SLOT)
    tensors = {name: t + 1 for name, t in tensors.items()}
    result = client.push(tensors, version="packed-1", transport="shm", delta=False, bucket_size_bytes=SLOT)
    assert (first.bucket_count, result.bucket_count, result.zero_copy_buckets) == (1, 1, 0)
    assert client.verify(tensors).ok
