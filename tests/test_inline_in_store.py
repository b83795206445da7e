"""INLINE fast-path buckets: the server writes their chunks straight into their place in the store
and the owner checks them there. A bad one fails the update like any other bucket: IN_PLACE marks
what it wrote dirty, STAGED keeps the committed bytes; the next push commits and verifies."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import torch

from weightsync.common.checksum import tensor_checksum
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    UpdateStream,
    local_checksums,
    pack,
    plan_buckets,
    running_server,
    server_checksums,
)

pytestmark = pytest.mark.timeout(120)
TENSOR_BYTES = 16 << 10
CHUNK = 5000  # not a divisor of a bucket: every bucket takes several chunks, the last one short


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(TENSOR_BYTES // 4, generator=g) for i in range(4)}


def send_bucket(stream: UpdateStream, plan, named, k: int, *, corrupt: bool = False) -> None:
    data = pack(plan, named, k)
    checksum = tensor_checksum(data)
    if corrupt:
        checksum.value ^= 1
    stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=data.numel(), checksum=checksum))
    raw = data.numpy().tobytes()
    for offset in range(0, len(raw), CHUNK):
        stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=offset, data=raw[offset : offset + CHUNK]))


def begin(server, plan, version: str, mode: int, *, allow_new: bool = False) -> tuple[UpdateStream, pb.UpdateReady]:
    stream = UpdateStream(server.stub())
    begin = pb.BeginUpdate(version=version, mode=mode, transport=pb.TRANSPORT_INLINE, allow_new_tensors=allow_new)
    begin.plan.CopyFrom(plan)
    stream.send(begin=begin)
    return stream, stream.recv().ready


def push(server, plan, named, version: str, mode: int, *, allow_new: bool = False) -> pb.UpdateReady:
    stream, ready = begin(server, plan, version, mode, allow_new=allow_new)
    for k in range(len(plan.buckets)):
        send_bucket(stream, plan, named, k)
        assert stream.recv().bucket_applied.sequence == k
    stream.send(commit=pb.CommitUpdate())
    assert stream.recv().committed.version.version == version
    stream.close()
    return ready


def ingress_pages_bytes(server) -> int:
    """Bytes of the server's ingress memfd that were ever written (allocated pages)."""
    fds = Path(f"/proc/{server.process.pid}/fd")
    for fd in fds.iterdir():
        if "weightsync-ingress" in os.readlink(fd):
            return os.stat(fd).st_blocks * 512
    raise AssertionError("the server has no ingress memfd")


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_IN_PLACE, pb.UPDATE_MODE_STAGED], ids=["in-place", "staged"])
def test_a_fast_path_bucket_is_checked_in_the_store_and_a_bad_one_changes_only_what_it_may(tmp_path, mode):
    v1, v2, v3 = model(1), model(2), model(3)
    plan = plan_buckets(list(v1.items()), TENSOR_BYTES)
    assert len(plan.buckets) == 4
    with running_server(tmp_path, workers=2) as server:
        push(server, plan, v1, "v1", pb.UPDATE_MODE_IN_PLACE, allow_new=True)  # one segment per bucket
        ready = push(server, plan, v2, "v2", mode)
        assert ready.fast_path_bucket_count == 4  # every bucket went straight into the store
        assert server_checksums(server) == [local_checksums(v2)]
        assert sum(w.received_bytes for w in info(server).workers) == 2 * 4 * TENSOR_BYTES
        assert ingress_pages_bytes(server) == 0  # one copy: no byte went through an ingress slot

        stream, ready = begin(server, plan, "bad", mode)
        assert ready.fast_path_bucket_count == 4
        send_bucket(stream, plan, v3, 0)
        assert stream.recv().bucket_applied.sequence == 0
        send_bucket(stream, plan, v3, 1, corrupt=True)
        aborting = stream.recv().aborting
        assert (aborting.reason, aborting.code) == ("BUCKET_CHECKSUM_MISMATCH", 15)  # DATA_LOSS
        stream.send(abort=pb.AbortUpdate(reason="bucket 1 was refused"))
        with pytest.raises(grpc.RpcError) as ended:
            stream.recv()
        assert ended.value.code() == grpc.StatusCode.DATA_LOSS
        stream.close()
        state = info(server)
        assert state.current_version.version == "v2"
        if mode == pb.UPDATE_MODE_STAGED:
            assert state.store_state == pb.STORE_STATE_CONSISTENT  # written into shadows only
            assert server_checksums(server) == [local_checksums(v2)]
        else:
            assert state.store_state == pb.STORE_STATE_INCONSISTENT  # buckets 0 and 1 reached the live bytes

        push(server, plan, v3, "v3", mode)
        assert info(server).store_state == pb.STORE_STATE_CONSISTENT
        assert server_checksums(server) == [local_checksums(v3)]
