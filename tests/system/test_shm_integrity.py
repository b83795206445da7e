"""An SHM trainer can still write its ingress slot while the workers copy it (same uid, shared
memory): no such mistake may commit torn weights. SHM buckets carry a WS64, and every worker
checks it on its own copy of the slot; a bucket without one is refused.

Before: a trainer that wrote a slot before its bucket_applied committed torn weights that the
store reported CONSISTENT (1 of 8 pushes with bucket checksums off), and the workers differed.
"""

from __future__ import annotations

import mmap
import os
import signal
import warnings

import grpc
import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.client.transports.shm_lease import IngressLease, open_ingress
from weightsync.common.checksum import tensor_checksum
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    UpdateStream,
    error_info,
    local_checksums,
    pack,
    plan_buckets,
    server_checksums,
    start_server,
)
from models import mixed_model

pytestmark = pytest.mark.timeout(180)
Code = grpc.StatusCode
SLOT = 2 << 20  # lm_head.weight (1.2 MB) fits one slot


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("shm"), "--ingress-slot-bytes", str(SLOT))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(node):
    with WeightSyncClient(node.address) as client:
        yield client


class Committed:
    seed = 700
    model: dict[str, torch.Tensor] = {}


@pytest.fixture
def committed(client, node):
    """Before: a committed model. After: still it, bit for bit; then the next SDK push over SHM
    (checksums off: the SHM sink sends one anyway) commits and verifies."""
    Committed.seed += 1
    Committed.model = mixed_model(Committed.seed)
    client.push(Committed.model, version=f"c{Committed.seed}", transport="shm", mode="staged",
                allow_new_tensors=True, checksums=False)
    yield Committed.model
    info = client.server_info()[0]
    assert info.store_state == pb.STORE_STATE_CONSISTENT, pb.StoreState.Name(info.store_state)
    assert info.current_version.version == f"c{Committed.seed}"
    assert server_checksums(node, sorted(Committed.model)) == [local_checksums(Committed.model)]
    after = mixed_model(Committed.seed + 500)
    client.push(after, version="after", transport="shm", mode="staged", checksums=False)
    assert client.verify(after).ok
    Committed.model = after


class RawShmTrainer:
    """A trainer written against the protos: writes slots itself, announces when it likes."""

    def __init__(self, node) -> None:
        self.node = node
        info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        self.workers = [w.pid for w in info.workers]
        self.lease: IngressLease = open_ingress(node.address, info.local_socket, None)
        self.map = mmap.mmap(self.lease.fd, self.lease.slot_bytes * self.lease.slot_count, flags=mmap.MAP_SHARED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.ingress = torch.frombuffer(self.map, dtype=torch.uint8)

    def slot(self, sequence: int, size: int) -> torch.Tensor:
        start = (sequence % self.lease.slot_count) * self.lease.slot_bytes
        return self.ingress[start : start + size]

    def begin(self, plan) -> UpdateStream:
        stream = UpdateStream(self.node.stub())
        stream.send(begin=pb.BeginUpdate(version="raw-shm", plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                         transport=pb.TRANSPORT_SHM))
        assert stream.recv().WhichOneof("message") == "ready"
        return stream

    def pause_workers(self) -> None:
        for pid in self.workers:
            os.kill(pid, signal.SIGSTOP)

    def resume_workers(self) -> None:
        for pid in self.workers:
            os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        del self.ingress
        self.map.close()
        os.close(self.lease.fd)
        self.lease.close()


@pytest.fixture
def trainer(node):
    raw = RawShmTrainer(node)
    yield raw
    raw.resume_workers()
    raw.close()


def refused(stream: UpdateStream, code: grpc.StatusCode, reason: str) -> dict[str, str]:
    response = stream.recv()
    assert response.WhichOneof("message") == "aborting", response
    assert (response.aborting.code, response.aborting.reason) == (code.value[0], reason), response.aborting
    stream.send(abort=pb.AbortUpdate(reason="test"))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    assert (caught.value.code(), error_info(caught.value).reason) == (code, reason)
    return dict(error_info(caught.value).metadata)


def test_an_shm_bucket_without_its_checksum_is_refused(node, committed, trainer):
    model = mixed_model(Committed.seed + 100)
    plan = plan_buckets(list(model.items()), 1 << 20)
    stream = trainer.begin(plan)
    data = pack(plan, model, 0)
    trainer.slot(0, data.numel()).copy_(data)
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=data.numel()))
    assert refused(stream, Code.INVALID_ARGUMENT, "BUCKET_CHECKSUM_REQUIRED") == {"bucket": "0"}


def test_an_shm_bucket_announced_compressed_is_refused(node, committed, trainer):
    """Frames travel over Gloo and INLINE only: the slot is the server's memory, nothing to save."""
    model = mixed_model(Committed.seed + 150)
    plan = plan_buckets(list(model.items()), 1 << 20)
    stream = trainer.begin(plan)
    data = pack(plan, model, 0)
    trainer.slot(0, data.numel()).copy_(data)
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=data.numel() // 2, checksum=tensor_checksum(data),
                                            compression=pb.BUCKET_COMPRESSION_ZSTD))
    assert refused(stream, Code.INVALID_ARGUMENT, "BUCKET_COMPRESSION_UNSUPPORTED") == {"bucket": "0"}


@pytest.mark.parametrize("bucket", [0, 1], ids=["packed-bucket", "one-tensor-bucket"])
def test_a_slot_rewritten_after_its_announcement_is_data_loss_and_changes_nothing(node, committed, trainer, bucket):
    """The trainer announces bucket k, then writes its slot again before the workers copied it."""
    model = mixed_model(Committed.seed + 200)
    plan = plan_buckets(list(model.items()), 1 << 20)
    stream = trainer.begin(plan)
    for k in range(bucket + 1):
        data = pack(plan, model, k)
        slot = trainer.slot(k, data.numel())
        slot.copy_(data)
        if k < bucket:
            stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=data.numel(), checksum=tensor_checksum(data)))
            assert stream.recv().bucket_applied.sequence == k
    # The workers cannot copy the slot before the rewrite below, whenever the server forwards the
    # announcement: they are stopped (briefly: well under the 3 s after which the server calls
    # them unresponsive).
    trainer.pause_workers()
    try:
        stream.send(bucket_start=pb.BucketStart(sequence=bucket, size_bytes=data.numel(), checksum=tensor_checksum(data)))
        slot[: data.numel() // 2].copy_(pack(plan, mixed_model(Committed.seed + 300), bucket)[: data.numel() // 2])
    finally:
        trainer.resume_workers()
    metadata = refused(stream, Code.DATA_LOSS, "BUCKET_CHECKSUM_MISMATCH")
    assert metadata["bucket"] == str(bucket) and metadata["expected"] == f"{tensor_checksum(data).value:#018x}"
    # The committed fixture checks the store kept the committed model, then pushes and verifies.
