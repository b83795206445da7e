"""An INLINE bucket reaches each server at that server's own pace (client/transports/inline.py, InlineSink.send).

A server may hold its stream back in the middle of a bucket: with more parts than ingress slots, a part's
stream is not read while the part waits its turn for a slot there. If the part sent its servers the bucket
chunk by chunk in lockstep, it would stop filling a slot it already holds on another server, and two parts
each holding a slot the other waits for would wait on each other until the transfer timeout. Here two fake
streams stand for two servers: server "b" takes nothing until server "a" has the whole bucket. Every chunk
must reach "a" first, then "b", each chunk the same bytes; in lockstep, "b" would block at chunk 0 and
"a" would never get chunk 1 (the bounded wait below fails the test)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.client.buckets.packing import PackBuffers, Payload
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.wire import encode_bucket_chunk
from weightsync.client.transports.inline import InlineSink
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

pytestmark = pytest.mark.timeout(60)
CHUNK = 1000
WAIT = 10.0  # every wait below is bounded by this


class Server:
    """What InlineSink uses of a stream, for one server: it records what it takes. `after`: it takes no chunk
    until that server took `whole` chunks."""

    failed = False
    unresponsive = False
    reported_error = None

    def __init__(self, name: str, whole: int, after: Server | None = None) -> None:
        self.name = name
        self.whole = whole
        self.after = after
        self.announced: list[pb.UpdateWeightsRequest] = []
        self.chunks: list[bytes] = []
        self.has_all = asyncio.Event()
        self.log: list[str] = []

    def stores(self, index: int) -> bool:
        return True

    def send(self, message: pb.UpdateWeightsRequest) -> None:
        self.announced.append(message)

    async def send_data(self, chunk: bytes) -> None:
        if self.after is not None:
            await asyncio.wait_for(self.after.has_all.wait(), WAIT)
        self.chunks.append(chunk)
        self.log.append(f"{self.name}{len(self.chunks) - 1}")
        if len(self.chunks) == self.whole:
            self.has_all.set()


def test_a_server_that_holds_its_stream_back_does_not_stop_the_bytes_to_another():
    loop = LoopThread()
    try:
        data = torch.arange(3500, dtype=torch.uint8)  # 4 chunks: 3 of 1000 bytes, 1 of 500
        sink = InlineSink(loop, PackBuffers(torch.device("cpu")), CHUNK)
        sink.frames.planned(7, tensor_pb2.BucketSpec(size_bytes=3500))
        a = loop.run(_make("a", 4))
        b = loop.run(_make("b", 4, after=a))
        failure = sink.send(7, Payload.own_memory(data), tensor_pb2.Checksum(), [a, b])  # type: ignore[list-item]
        assert failure is None
        assert a.log == ["a0", "a1", "a2", "a3"]  # all of it before "b" took anything
        assert b.log == ["b0", "b1", "b2", "b3"]
        view = memoryview(data.numpy())
        expected = [encode_bucket_chunk(7, offset, view[offset : offset + CHUNK]) for offset in range(0, 3500, CHUNK)]
        assert a.chunks == b.chunks == expected
        assert [m.bucket_start.sequence for m in a.announced] == [m.bucket_start.sequence for m in b.announced] == [7]
        assert a.announced[0].bucket_start.size_bytes == 3500
    finally:
        loop.stop()


async def _make(name: str, whole: int, after: Server | None = None) -> Server:
    return Server(name, whole, after)  # built on the loop: its Event belongs there


def test_a_bucket_of_cpu_tensors_is_encoded_from_the_tensors_in_one_copy(monkeypatch, tmp_path):
    """INLINE does not pack a bucket of contiguous CPU tensors: each chunk is encoded from the tensors where they
    lie, the padding between them zeros: the same messages as from the packed bucket, one copy per byte
    (counted: common/byte_passes.py), none into a pack buffer."""
    from weightsync.client.buckets.packing import TensorSource, fill_bucket
    from weightsync.client.buckets.planning import build_plan
    from weightsync.common import byte_passes

    monkeypatch.setattr(byte_passes, "_folder", str(tmp_path))
    tensors = {f"t{i}": torch.randn(101 + 37 * i, generator=torch.Generator().manual_seed(i)) for i in range(7)}
    (bucket,) = build_plan(list(tensors.items()), 1 << 20, zero_copy_min_bytes=0)
    assert any(a.offset_bytes + a.size_bytes < b.offset_bytes for a, b in zip(bucket.spec.tensors,
                                                                            bucket.spec.tensors[1:], strict=False))
    packed = fill_bucket(PackBuffers(torch.device("cpu"), slots=[torch.zeros(1 << 20, dtype=torch.uint8)] * 2),
                         bucket, 0, TensorSource(tensors, None)).read().clone()
    loop = LoopThread()
    try:
        sink = InlineSink(loop, PackBuffers(torch.device("cpu")), CHUNK)
        sink.buffers.ensure(bucket.spec.size_bytes)
        whole = -(-bucket.spec.size_bytes // CHUNK)
        server = loop.run(_make("a", whole))
        before = byte_passes.totals()
        payload = sink.fill(0, bucket, TensorSource(tensors, None), [server])  # type: ignore[list-item]
        assert payload.parts is not None
        assert sink.send(0, payload, tensor_pb2.Checksum(), [server]) is None  # type: ignore[list-item]
        counted = {k: v - before.get(k, 0) for k, v in byte_passes.totals().items() if v != before.get(k, 0)}
        view = memoryview(packed.numpy())
        assert server.chunks == [encode_bucket_chunk(0, offset, view[offset : offset + CHUNK])
                                 for offset in range(0, bucket.spec.size_bytes, CHUNK)]
        assert counted == {"copy trainer.encode": bucket.spec.size_bytes}
    finally:
        loop.stop()
