"""Compressed buckets (BucketStart.compression ZSTD, COLLECTIVE over Gloo and INLINE).

The SDK sends buckets of patches as zstd frames on a slow link (or when asked), every owner
decompresses its own, and the bytes land bit for bit. A trainer that speaks the protos can
compress any bucket; every malformed frame is refused with its reason, changes nothing, and the
next update and a verify follow.
"""

from __future__ import annotations

import grpc
import pytest
import torch
import zstandard
from test_broadcast_framing import aborting, end, group_state, info

from weightsync.client import WeightSyncClient
from weightsync.common.checksum import tensor_checksum
from weightsync.common.collective import bucket_tail
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    PlainTrainer,
    error_info,
    local_checksums,
    pack,
    plan_buckets,
    server_checksums,
    start_server,
)

pytestmark = pytest.mark.timeout(240)
Code = grpc.StatusCode
BUCKET = 1 << 20


def compressible(seed: int) -> dict[str, torch.Tensor]:
    """Two buckets of 1 MiB and a small third, mostly runs: zstd shrinks every one of them."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randint(0, 4, (256, 1024), generator=g, dtype=torch.int16).to(torch.bfloat16),
        "head": torch.full((512, 1024), float(seed), dtype=torch.bfloat16),
        "norm": torch.arange(1000, dtype=torch.float32) + seed,
    }


def frame(data: torch.Tensor, **options) -> torch.Tensor:
    raw = zstandard.ZstdCompressor(level=1, **options).compress(data.numpy().tobytes())
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class Node:
    """A server with a committed model and a plain Gloo trainer (no SDK)."""

    def __init__(self, server) -> None:
        self.server = server
        self.trainer = PlainTrainer([server])  # its group timeout: helpers.PlainTrainer's (long)
        self.trainer.create_group()
        self.seed = 700
        self.model = self.commit()

    def commit(self, *, compressed: bool = False) -> dict[str, torch.Tensor]:
        """The next model, each bucket as a zstd frame when `compressed`."""
        self.seed += 1
        model = compressible(self.seed)
        plan = plan_buckets(list(model.items()), BUCKET)
        stream, _ = self.trainer.begin(self.server.stub(), plan, f"v{self.seed}", mode=pb.UPDATE_MODE_STAGED)
        for index in range(len(plan.buckets)):
            data = pack(plan, model, index)
            sent, compression = (frame(data), pb.BUCKET_COMPRESSION_ZSTD) if compressed else \
                (data, pb.BUCKET_COMPRESSION_UNSPECIFIED)
            assert sent.numel() < data.numel() or not compressed
            stream.send(bucket_start=pb.BucketStart(sequence=index, checksum=tensor_checksum(data),
                                                    size_bytes=sent.numel(), tail=bucket_tail(sent),
                                                    compression=compression))
            self.trainer.send_bucket(sent, index)
            assert stream.recv().bucket_applied.sequence == index
        stream.send(commit=pb.CommitUpdate())
        assert stream.recv().committed.version.version == f"v{self.seed}"
        stream.close()
        self.model = model
        return model

    def begin(self, mode=pb.UPDATE_MODE_STAGED):
        model = compressible(self.seed + 100)
        plan = plan_buckets(list(model.items()), BUCKET)
        stream, _ = self.trainer.begin(self.server.stub(), plan, "bad", mode=mode)
        return stream, plan, model

    def assert_unharmed(self) -> None:
        """The committed model bit for bit, then the next update, compressed, and its bytes."""
        assert server_checksums(self.server) == [local_checksums(self.model)]
        self.commit(compressed=True)
        assert server_checksums(self.server) == [local_checksums(self.model)]


@pytest.fixture
def node(server):
    state = Node(server)
    yield state
    state.trainer.delete_group()


def test_the_server_says_it_takes_zstd(server):
    assert list(info(server).bucket_compressions) == [pb.BUCKET_COMPRESSION_ZSTD]


def test_every_bucket_compressed_lands_bit_exact(node):
    before = {w.index: w.received_bytes for w in info(node.server).workers}
    node.commit(compressed=True)
    assert server_checksums(node.server) == [local_checksums(node.model)]
    after = {w.index: w.received_bytes for w in info(node.server).workers}
    plan = plan_buckets(list(node.model.items()), BUCKET)
    # Workers count what they put in the store: the decompressed buckets, once per node.
    assert sum(after.values()) - sum(before.values()) == sum(b.size_bytes for b in plan.buckets)


BAD_FRAMES = {
    # name: (make the frame from the bucket's bytes, the reason)
    "garbage": (lambda data: torch.full((data.numel() // 2,), 7, dtype=torch.uint8), "BUCKET_FRAME_MALFORMED"),
    "no-content-size": (lambda data: frame(data, write_content_size=False), "BUCKET_FRAME_MALFORMED"),
    "another-bucket": (lambda data: frame(data[: data.numel() // 2]), "BUCKET_FRAME_MALFORMED"),
    "cut-short": (lambda data: frame(data)[:-5].clone(), "BUCKET_FRAME_MALFORMED"),
    "trailing-bytes": (lambda data: torch.cat([frame(data), torch.zeros(3, dtype=torch.uint8)]),
                       "BUCKET_FRAME_MALFORMED"),
    "two-frames": (lambda data: torch.cat([frame(data), frame(data[:64])]), "BUCKET_FRAME_MALFORMED"),
}


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
@pytest.mark.parametrize("bad", list(BAD_FRAMES))
def test_a_malformed_frame_is_refused_and_changes_nothing(node, bad, mode):
    make, reason = BAD_FRAMES[bad]
    stream, plan, model = node.begin(mode)
    sent = make(pack(plan, model, 0))
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=sent.numel(), tail=bucket_tail(sent),
                                            compression=pb.BUCKET_COMPRESSION_ZSTD))
    node.trainer.send_bucket(sent, 0)
    report = aborting(stream)
    assert (report.code, report.reason) == (Code.INVALID_ARGUMENT.value[0], reason)
    error = end(stream)
    assert error.code() == Code.INVALID_ARGUMENT
    assert dict(error_info(error).metadata)["bucket"] == "0"
    # Refused before a byte reached the store, IN_PLACE too.
    assert info(node.server).store_state == pb.STORE_STATE_CONSISTENT
    assert group_state(node.server, node.trainer.group_id) == pb.GROUP_STATE_READY
    node.assert_unharmed()


@pytest.mark.parametrize("case", ["not-smaller", "unknown-compression"])
def test_an_announcement_the_server_refuses_is_drained(node, case):
    stream, plan, model = node.begin()
    data = pack(plan, model, 0)
    compression = pb.BUCKET_COMPRESSION_ZSTD if case == "not-smaller" else 7
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=data.numel(), tail=bucket_tail(data),
                                            compression=compression))
    node.trainer.send_bucket(data, 0)  # its owner receives it at the announced length and drops it
    report = aborting(stream)
    expected = "BUCKET_SIZE_MISMATCH" if case == "not-smaller" else "BUCKET_COMPRESSION_UNKNOWN"
    assert (report.code, report.reason) == (Code.INVALID_ARGUMENT.value[0], expected)
    end(stream)
    assert group_state(node.server, node.trainer.group_id) == pb.GROUP_STATE_READY
    node.assert_unharmed()


INLINE_SLOT = 64 << 10
CHUNK = 16 << 10


@pytest.fixture(scope="module")
def inline_node(tmp_path_factory):
    """Ingress slots of 64 KiB: a frame of ~0.5 MB arrives in pieces, gathered by its owner."""
    server = start_server(tmp_path_factory.mktemp("inline-zstd"), "--ingress-slot-bytes", str(INLINE_SLOT))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def noisy(seed: int) -> dict[str, torch.Tensor]:
    """Low bytes random, high bytes zero: every bucket compresses about 2x and its frame spans pieces."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randint(0, 256, (512, 512), generator=g, dtype=torch.int16).view(torch.bfloat16)
            for i in range(3)}


def inline_update(server, model: dict[str, torch.Tensor], version: str, *, mode=pb.UPDATE_MODE_STAGED,
                  bad: str | None = None) -> pb.UpdateWeightsResponse:
    """One INLINE update, every bucket a zstd frame in CHUNK-byte chunks (bucket 0's made `bad`); the
    last response: committed, or aborting."""
    from helpers import UpdateStream

    plan = plan_buckets(list(model.items()), BUCKET)
    stream = UpdateStream(server.stub())
    stream.send(begin=pb.BeginUpdate(version=version, plan=plan, mode=mode, transport=pb.TRANSPORT_INLINE,
                                     allow_new_tensors=True))
    assert stream.recv().WhichOneof("message") == "ready"
    for k in range(len(plan.buckets)):
        data = pack(plan, model, k)
        sent = BAD_FRAMES[bad][0](data) if bad and k == 0 else frame(data)
        assert INLINE_SLOT < sent.numel() < data.numel()
        stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=sent.numel(), checksum=tensor_checksum(data),
                                                compression=pb.BUCKET_COMPRESSION_ZSTD))
        raw = sent.numpy().tobytes()
        for offset in range(0, len(raw), CHUNK):
            stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=offset, data=raw[offset : offset + CHUNK]))
        response = stream.recv()
        if response.WhichOneof("message") != "bucket_applied":
            end(stream)  # abort, then the status
            return response
    stream.send(commit=pb.CommitUpdate())
    response = stream.recv()
    stream.close()
    return response


def test_inline_frames_arrive_in_pieces_and_land_bit_exact(inline_node):
    model = noisy(1)
    for mode in (pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE):
        assert inline_update(inline_node, model, f"inline-{mode}", mode=mode).committed.version.version == \
            f"inline-{mode}"
        assert server_checksums(inline_node) == [local_checksums(model)]
        model = noisy(2)


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
@pytest.mark.parametrize("bad", ["cut-short", "another-bucket", "trailing-bytes"])
def test_a_malformed_inline_frame_is_refused_and_changes_nothing(inline_node, bad, mode):
    committed = noisy(10)
    assert inline_update(inline_node, committed, "base").committed.version.version == "base"
    response = inline_update(inline_node, noisy(11), "bad", mode=mode, bad=bad)
    assert response.WhichOneof("message") == "aborting", response
    assert (response.aborting.code, response.aborting.reason) == (Code.INVALID_ARGUMENT.value[0],
                                                                  "BUCKET_FRAME_MALFORMED")
    state = info(inline_node)
    assert state.store_state == pb.STORE_STATE_CONSISTENT and state.current_version.version == "base"
    assert server_checksums(inline_node) == [local_checksums(committed)]
    after = noisy(12)
    assert inline_update(inline_node, after, "after").committed.version.version == "after"
    assert server_checksums(inline_node) == [local_checksums(after)]


# -- the SDK ---------------------------------------------------------------------------------------


def ulp_step(named: dict[str, torch.Tensor], seed: int, fraction: float = 0.05) -> dict[str, torch.Tensor]:
    """What a small optimizer step does to bf16 weights: `fraction` of them move by one ulp."""
    g = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in named.items()}
    for tensor in new.values():
        if tensor.dtype == torch.bfloat16:
            bits = tensor.view(torch.int16).view(-1)
            picks = torch.randperm(bits.numel(), generator=g)[: int(bits.numel() * fraction)]
            bits[picks] += 1
    return new


@pytest.fixture
def two_servers(tmp_path):
    servers = [start_server(tmp_path, workers=2), start_server(tmp_path, workers=1)]
    yield servers
    for server in servers:
        assert server.stop() == 0, server.log()[-2000:]


@pytest.mark.parametrize("transport", ["collective", "inline"])
def test_the_sdk_compresses_buckets_of_patches_and_every_step_lands_bit_exact(two_servers, transport):
    g = torch.Generator().manual_seed(5)
    current = {f"layers.{i}.w": torch.randn(512, 512, generator=g).to(torch.bfloat16) for i in range(8)}
    current["norm"] = torch.randn(512, generator=g)
    with WeightSyncClient([s.address for s in two_servers], timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=30)
        client.push(current, version="v0", allow_new_tensors=True, transport=transport)
        received = [w.received_bytes for w in info(two_servers[0]).workers]
        for step in range(1, 7):
            current = ulp_step(current, seed=step)
            mode = "staged" if step % 2 else "in_place"
            result = client.push(current, version=f"v{step}", mode=mode, delta=True, compress=True,
                                 bucket_size_bytes=64 << 10, transport=transport)
            assert result.bucket_count >= 3 and result.compressed_bytes > 0, result
            # The frames are what moved: fewer bytes than the patches they hold.
            assert result.bytes_sent < result.size_bytes < 0.1 * result.dense_bytes, result
            assert client.verify(current).ok
            for server in two_servers:
                assert server_checksums(server) == [local_checksums(current)]
        # Both workers of the first node own buckets, and decompressed theirs.
        assert all(w.received_bytes > r for w, r in zip(info(two_servers[0]).workers, received, strict=True))
        # On loopback the default does not compress (the link is faster than the compressor).
        current = ulp_step(current, seed=99)
        result = client.push(current, version="plain", delta=True, bucket_size_bytes=64 << 10, transport=transport)
        assert result.compressed_bytes == 0 and result.bytes_sent == result.size_bytes, result
        assert client.verify(current).ok


def test_the_sdk_compresses_only_what_shrinks_and_only_on_a_slow_link():
    from weightsync.client.transports.compression import compressed_frame, worth_compressing

    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert compressed_frame(noise) is None  # sent as it is
    runs = torch.zeros(1 << 16, dtype=torch.uint8)
    runs[::7] = 5
    sent = compressed_frame(runs)
    assert sent is not None and sent.numel() < runs.numel() // 10
    assert zstandard.frame_content_size(sent.numpy().tobytes()) == runs.numel()
    assert zstandard.ZstdDecompressor().decompress(sent.numpy().tobytes()) == runs.numpy().tobytes()
    assert not worth_compressing(None) and not worth_compressing(3e9)  # loopback, assumed or timed
    assert worth_compressing(1.25e8)  # 1 Gbit/s


def test_a_frame_over_the_workers_memory_limit_is_drained_and_refused(tmp_path):
    """The owner cannot hold the frame (its wire buffer would pass --worker-memory-limit-bytes): it
    still receives the frame's bytes and drops them, so the trainer does not wait out the group's
    timeout; the update fails with the reason, and an uncompressed update follows."""
    import time

    server = start_server(tmp_path, "--worker-memory-limit-bytes", str(64 << 10))
    try:
        node = Node(server)  # committed uncompressed: every bucket goes straight into the store
        stream, plan, model = node.begin()
        sent = frame(pack(plan, model, 0))
        assert sent.numel() > 64 << 10
        started = time.monotonic()
        stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=sent.numel(), tail=bucket_tail(sent),
                                                compression=pb.BUCKET_COMPRESSION_ZSTD))
        node.trainer.send_bucket(sent, 0)
        report = aborting(stream)
        assert time.monotonic() - started < node.trainer.timeout / 2, "the trainer waited for the group timeout"
        assert (report.code, report.reason) == (Code.RESOURCE_EXHAUSTED.value[0], "WORKER_MEMORY_LIMIT")
        end(stream)
        assert group_state(server, node.trainer.group_id) == pb.GROUP_STATE_READY
        assert server_checksums(server) == [local_checksums(node.model)]
        node.commit()
        assert server_checksums(server) == [local_checksums(node.model)]
        node.trainer.delete_group()
    finally:
        assert server.stop() == 0, server.log()[-2000:]


def test_a_push_that_patches_one_server_and_sends_another_dense_compresses_only_the_patches(two_servers):
    """The dense run to a server without the base numbers its buckets from 0 again: none of them is
    compressed (they would shrink: these weights' high bytes are all zero)."""
    a, b = two_servers
    current = noisy(30)
    with WeightSyncClient([a.address, b.address], timeout=60) as client, \
            WeightSyncClient(b.address, timeout=60) as other:
        client.push(current, version="v0", transport="inline", allow_new_tensors=True)
        other.push(noisy(31), version="other", transport="inline")  # b no longer holds client's base
        step = ulp_step(current, seed=3)
        result = client.push(step, version="v1", transport="inline", delta=True, compress=True,
                             bucket_size_bytes=64 << 10)
        assert 0 < result.compressed_bytes < 0.1 * result.dense_bytes, result
        assert client.verify(step).ok
