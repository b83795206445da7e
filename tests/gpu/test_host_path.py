"""A CUDA trainer's push over SHM (issue 45), where only a GPU can show it: the store's arenas (and the ingress)
the trainer maps are pinned once per mapping, each tensor is copied into its place on a side stream after
the work queued before it, its WS64 summed on the device (equal to the host's), and a bucket is announced
only once its copies' event completed. Speed is bench/gpu.py's (push_shm against d2h_pinned)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.client.buckets.packing import TensorSource
from weightsync.client.transports import store_writes
from weightsync.common.checksum import ws64_reference, ws64_terms_torch
from weightsync.v1 import tensor_pb2

from gpukit import gpu_model, written_behind_a_sleep

pytestmark = pytest.mark.timeout(180)
MASK = (1 << 64) - 1


@pytest.mark.parametrize("size", [1, 7, 8, 4096, 4101, 512 * 8 * 3 + 13, 3 << 20])
@pytest.mark.parametrize("first_word", [0, 1, 511, 512, 100_003])
def test_the_device_ws64_terms_equal_the_host_definition(size, first_word):
    raw = np.random.default_rng(size + first_word).integers(0, 256, size + 1, dtype=np.uint8)
    for data in (raw[:size], raw[1:]):  # aligned, and starting one byte in (the device view is then cloned)
        on_device = torch.from_numpy(data.copy()).cuda()[: data.size]
        terms = int(ws64_terms_torch(on_device, first_word).item()) & MASK
        # The same bytes as the words of a bucket that starts with `first_word` zero words.
        padded = bytes(8 * first_word) + data.tobytes()
        assert (len(padded) + terms) & MASK == ws64_reference(padded)


def _arena(size: int) -> tuple[mmap.mmap, int]:
    fd = os.memfd_create("test-host-path")
    os.ftruncate(fd, size)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED), fd


def test_the_trainers_mapping_is_pinned_once_and_a_bucket_is_read_only_after_its_copies():
    """Two buckets of CUDA tensors written behind a second of queued GPU work into one arena: it is pinned
    once (cudaHostRegister: the copies are DMAs), each write returns before its copies ran, and its checksum
    (which waits for the event) is the WS64 of the bucket as it then lies in the arena, zero padding included."""
    ingress, ingress_fd = _arena(1 << 20)
    arena_map, arena_fd = _arena(8 << 20)
    pins: list[int] = []

    def pin(data: torch.Tensor) -> list[int]:
        pins.append(data.data_ptr())
        return store_writes.pin_host(data)

    def open_arenas(ids):
        return [(1, len(arena_map), os.dup(arena_fd))], [1]

    mappings = store_writes.StoreMappings(ingress, open_arenas, pin=pin)
    try:
        mappings.refresh({1})
        writer = store_writes.StoreWriter(mappings)
        model = written_behind_a_sleep(gpu_model(45))
        names = sorted(model)
        for sequence, offset in enumerate((0, 4 << 20)):
            bucket = tensor_pb2.BucketSpec()
            cursor = 0
            for name in names:
                size = model[name].numel() * model[name].element_size()
                bucket.tensors.add(name=name, offset_bytes=cursor, size_bytes=size)
                cursor = -(-(cursor + size) // 64) * 64
            bucket.size_bytes = cursor
            regions = (store_writes.Region(0, bucket.size_bytes, 1, offset),)
            write = writer.write(sequence, bucket, TensorSource(model, None), regions)
            assert not write.done(), "the copies ran before the GPU work queued ahead of them"
            checksum = write.checksum()
            assert write.done()
            placed = mappings.arenas[1].data[offset : offset + bucket.size_bytes]
            assert checksum.value == ws64_reference(bytes(placed.numpy()))
            for spec in bucket.tensors:
                expected = model[spec.name].contiguous().view(-1).view(torch.uint8).cpu()
                assert torch.equal(placed[spec.offset_bytes : spec.offset_bytes + spec.size_bytes], expected)
            model = written_behind_a_sleep(model)
        assert len(pins) == 1 and mappings.arenas[1].pinned, "the arena is pinned once, and pinned"
        assert mappings.arenas[1].data.is_pinned()
    finally:
        mappings.close()
        os.close(arena_fd)
        os.close(ingress_fd)


def test_a_cuda_model_pushed_over_shm_is_in_the_store_bit_for_bit(cpu_server):
    """The SDK end to end: the first push defines the store, the next ones write straight into it (written
    behind queued GPU work each time), STAGED and IN_PLACE; every one verified."""
    with WeightSyncClient(cpu_server.address) as client:
        model = gpu_model(46, scale=64)  # 8 MiB of embedding: several buckets of 1 MiB
        client.push(model, version="define", transport="shm", allow_new_tensors=True, delta=False,
                    bucket_size_bytes=1 << 20)
        for step, mode in enumerate(("staged", "in_place", "staged")):
            model = written_behind_a_sleep(model)
            result = client.push(model, version=f"step-{step}", transport="shm", mode=mode, delta=False,
                                 bucket_size_bytes=1 << 20)
            assert result.bucket_count >= 4
            assert client.verify(model).ok
        sink = client._fleet.states[0].ingress.sink  # noqa: SLF001 - which mappings the push pinned
        arenas = sink._store.arenas  # noqa: SLF001
        assert [a for a in arenas.values() if a.arena_id > 0 and a.pinned], "no store arena was pinned"
