"""Issue 45's step 1 without a GPU: a trainer pins (cudaHostRegister) its mapping of a store arena once, when it
first copies a device tensor into it, so that the copies are DMAs; an arena it only writes from CPU tensors,
and the ingress, are never pinned; a refused registration is not asked again; closing unpins what was pinned.

The device copies are faked here (meta-device sources, the side stream's work replaced by a completed event):
tests/gpu/test_host_path.py runs them on a GPU (client/transports/store_writes.py)."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from weightsync.client.buckets.packing import TensorSource
from weightsync.client.transports import store_writes
from weightsync.client.transports.store_writes import INGRESS, Region, StoreMappings, StoreWriter
from weightsync.v1 import tensor_pb2

ARENA_BYTES = 1 << 20


class Completed:
    """A CUDA event whose copies already ran."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def bucket_of(names: list[str], nbytes: int) -> tensor_pb2.BucketSpec:
    spec = tensor_pb2.BucketSpec(size_bytes=nbytes * len(names))
    for i, name in enumerate(names):
        spec.tensors.add(name=name, offset_bytes=i * nbytes, size_bytes=nbytes)
    return spec


@pytest.fixture
def arenas():
    fds = {arena_id: os.memfd_create(f"arena-{arena_id}") for arena_id in (INGRESS, 1, 2)}
    for fd in fds.values():
        os.ftruncate(fd, ARENA_BYTES)
    yield fds
    for fd in fds.values():
        os.close(fd)


def writer_over(arenas, monkeypatch, pin_answer: list[int] | None = None):
    """A StoreWriter over arenas 1 and 2 with a recording pin (which answers `pin_answer`, or the base it was
    given) and the device copies faked; the pins, the unpins and the queued copies' places."""
    pins: list[int] = []
    unpins: list[int] = []
    queued: list[tuple[int, torch.device]] = []

    def pin(data: torch.Tensor) -> list[int]:
        pins.append(data.data_ptr())
        return [data.data_ptr()] if pin_answer is None else pin_answer

    def opener(ids):
        return [(arena_id, ARENA_BYTES, os.dup(arenas[arena_id])) for arena_id in ids], [1, 2]

    def queue(self, device, copies, held):
        queued.extend((place.data_ptr(), data.device) for place, data, _ in copies)
        return store_writes._DeviceCopies(Completed(), torch.zeros((), dtype=torch.int64))

    monkeypatch.setattr(StoreWriter, "_queue", queue)
    ingress = mmap.mmap(arenas[INGRESS], ARENA_BYTES, flags=mmap.MAP_SHARED)
    mappings = StoreMappings(ingress, opener, pin=pin, unpin=unpins.extend)
    mappings.refresh({1, 2})
    return StoreWriter(mappings), pins, unpins, queued


def test_an_arena_is_pinned_once_when_a_device_tensor_is_first_copied_into_it(arenas, monkeypatch):
    writer, pins, unpins, queued = writer_over(arenas, monkeypatch)
    mappings = writer.mappings
    on_device = {f"d{i}": torch.empty(64, device="meta") for i in range(4)}
    on_host = {f"h{i}": torch.randn(64) for i in range(2)}
    source = TensorSource(on_device | on_host, None)
    # Buckets 0 and 1 from the device into arena 1, bucket 2 from CPU tensors into arena 2.
    for sequence, (names, arena_id, offset) in enumerate([(["d0", "d1"], 1, 0), (["d2", "d3"], 1, 4096),
                                                          (["h0", "h1"], 2, 0)]):
        spec = bucket_of(names, 256)
        write = writer.write(sequence, spec, source, (Region(0, spec.size_bytes, arena_id, offset),))
        write.checksum()
    arena_1 = mappings.arenas[1].data.data_ptr()
    assert pins == [arena_1], "arena 1 pinned once, at its first device copy; nothing else pinned"
    assert queued == [(arena_1 + offset, torch.device("meta")) for offset in (0, 256, 4096, 4352)]
    assert (mappings.arenas[1].pinned, mappings.arenas[2].pinned, mappings.arenas[INGRESS].pinned) == (
        [arena_1], None, None)
    assert bytes(mappings.arenas[2].data[:512].numpy()) == b"".join(t.numpy().tobytes() for t in on_host.values())
    mappings.close()
    assert unpins == [arena_1]


def test_a_refused_registration_is_not_asked_again_and_the_copies_go_on(arenas, monkeypatch):
    """The driver refuses (pin_host answers no registration): the copies still run, synchronously and correct,
    and later buckets do not ask again; nothing to unpin."""
    writer, pins, unpins, queued = writer_over(arenas, monkeypatch, pin_answer=[])
    source = TensorSource({f"d{i}": torch.empty(64, device="meta") for i in range(3)}, None)
    for sequence, name in enumerate(["d0", "d1", "d2"]):
        spec = bucket_of([name], 256)
        writer.write(sequence, spec, source, (Region(0, 256, 1, 1024 * sequence),)).checksum()
    assert len(pins) == 1 and len(queued) == 3
    assert writer.mappings.arenas[1].pinned == []
    writer.mappings.close()
    assert unpins == []
