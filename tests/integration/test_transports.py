"""INLINE and SHM, through the SDK and byte by byte through the protos.

A server with 1 MiB ingress slots, so buckets larger than a slot go through
in pieces; every chunk rule of the contract is broken once, each followed by
proof that nothing changed and that the next update commits exactly.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.common.checksum import tensor_checksum
from weightsync.common.local_wire import LocalConnection
from weightsync.v1 import local_pb2
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
SLOT = 1 << 20
MAX_MESSAGE = 2 << 20
MAX_CHUNK = MAX_MESSAGE - (64 << 10)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("transports"), "--ingress-slot-bytes", str(SLOT),
                          "--max-message-bytes", str(MAX_MESSAGE))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(node):
    with WeightSyncClient(node.address, max_message_bytes=MAX_MESSAGE) as client:
        yield client


@dataclass
class Held:
    """What the node's store holds: a test that commits something sets `model` to what it committed."""
    model: dict[str, torch.Tensor]


@pytest.fixture
def committed(client, node, request) -> Iterator[Held]:
    """Before: a committed model of this test's own (its seed from the test's id, whatever ran
    before it). After: the store holds `model` bit for bit, and the next push commits."""
    seed = 1000 + zlib.crc32(request.node.nodeid.encode()) % 100_000
    held = Held(mixed_model(seed))
    client.push(held.model, version=f"c{seed}", transport="inline", allow_new_tensors=True,
                bucket_size_bytes=256 << 10)
    yield held
    info = client.server_info()[0]
    assert info.store_state == pb.STORE_STATE_CONSISTENT, pb.StoreState.Name(info.store_state)
    assert server_checksums(node, sorted(held.model)) == [local_checksums(held.model)]
    after = mixed_model(seed + 1)
    client.push(after, version="after", transport="inline", bucket_size_bytes=256 << 10)
    assert client.verify(after).ok


# -- through the SDK ------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["inline", "shm"])
@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_sdk_pushes_and_verifies(client, node, committed, transport, mode):
    model = {k: v for k, v in mixed_model(7).items() if k != "lm_head.weight"}  # SHM: every bucket fits a slot
    first = client.push(model, version=f"{transport}-1", transport=transport, mode=mode, bucket_size_bytes=1024)
    second = client.push(model, version=f"{transport}-2", transport=transport, mode=mode, bucket_size_bytes=1024)
    assert second.plan_reused and second.bucket_count == first.bucket_count > 1
    assert client.verify(model).ok
    info = client.server_info()[0]
    assert info.current_version.version == f"{transport}-2"
    assert info.store_state == pb.STORE_STATE_CONSISTENT
    committed.model = {**committed.model, **model}


def test_inline_bucket_larger_than_a_slot_streams_in_pieces(client, committed):
    big = {"big.weight": torch.randn(3 * SLOT // 4 + 100)}  # 3 MiB + 400 bytes: four slot-sized pieces
    result = client.push(big, version="big", transport="inline", allow_new_tensors=True, mode="staged",
                         checksums=True)
    assert result.bucket_count == 1 and result.size_bytes > 3 * SLOT
    assert client.verify(big).ok
    committed.model = {**committed.model, **big}


def test_inline_needs_no_group_and_collective_still_does(client):
    assert client.group_id is None
    with pytest.raises(Exception, match="create_group"):
        client.push(mixed_model(3), version="x", transport="collective")


def test_shm_sends_a_tensor_larger_than_a_slot_as_pieces_and_refuses_a_bucket_that_is(node, client, committed):
    client.push(committed.model, version="pieces", transport="shm")  # lm_head.weight is 1.2 MB > 1 MiB slot
    assert client.verify(committed.model).ok
    plan = plan_buckets(list(committed.model.items()), 2 << 20)  # one bucket holds the whole 1.2 MB tensor
    stream = UpdateStream(node.stub())
    stream.send(begin=pb.BeginUpdate(version="too-big", plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                     transport=pb.TRANSPORT_SHM))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    assert (caught.value.code(), error_info(caught.value).reason) == (Code.INVALID_ARGUMENT,
                                                                      "BUCKET_TOO_LARGE_FOR_INGRESS")
    assert client.verify(committed.model).ok


# -- INLINE byte by byte: every chunk rule ----------------------------------------------------------
def begin_inline(node, model, mode=pb.UPDATE_MODE_STAGED, bucket=4096):
    plan = plan_buckets(list(model.items()), bucket)
    stream = UpdateStream(node.stub())
    stream.send(begin=pb.BeginUpdate(version="raw", plan=plan, mode=mode, transport=pb.TRANSPORT_INLINE))
    assert stream.recv().WhichOneof("message") == "ready"
    return stream, plan


def send_bucket(stream, plan, model, k, chunk=1000):
    data = pack(plan, model, k).numpy().tobytes()
    stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=len(data)))
    for offset in range(0, len(data), chunk):
        stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=offset, data=data[offset : offset + chunk]))
    return data


def refused(stream, reason: str, code=Code.INVALID_ARGUMENT) -> pb.UpdateAborting:
    while (response := stream.recv()).WhichOneof("message") == "bucket_applied":
        pass
    assert response.WhichOneof("message") == "aborting", response
    assert (response.aborting.code, response.aborting.reason) == (code.value[0], reason), response.aborting
    stream.send(abort=pb.AbortUpdate(reason="test"))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    assert caught.value.code() == code and error_info(caught.value).reason == reason
    return response.aborting


def test_inline_byte_by_byte_commits_exactly(node, committed):
    model = mixed_model(77)
    stream, plan = begin_inline(node, model, mode=pb.UPDATE_MODE_IN_PLACE)
    for k in range(len(plan.buckets)):
        send_bucket(stream, plan, model, k, chunk=777)  # chunks that never line up with tensors
        assert stream.recv().bucket_applied.sequence == k
    stream.send(commit=pb.CommitUpdate())
    assert stream.recv().committed.version.version == "raw"
    stream.close()
    assert server_checksums(node, sorted(model)) == [local_checksums(model)]
    committed.model = model


CHUNK_MISTAKES = [
    # (what the client does after Begin, the reason); ("chunk", bucket, offset, length): offset -8 = 8 bytes
    # before the bucket's end, length None = the rest of the bucket
    ("a chunk before any BucketStart", [("chunk", 0, 0, 8)], "CHUNK_UNEXPECTED"),
    ("a chunk for another bucket", ["start", ("chunk", 1, 0, 8)], "CHUNK_UNEXPECTED"),
    ("a chunk at the wrong offset", ["start", ("chunk", 0, 8, 8)], "CHUNK_OUT_OF_ORDER"),
    ("an empty chunk", ["start", ("chunk", 0, 0, 0)], "CHUNK_SIZE_INVALID"),
    ("a chunk over the limit", ["start", ("chunk", 0, 0, MAX_CHUNK + 16)], "CHUNK_SIZE_INVALID"),
    ("a chunk past the bucket's end", ["start", "most", ("chunk", 0, -8, 9000)], "CHUNK_OVERFLOW"),
    ("the next BucketStart before the bucket is complete", ["start", "most", "start1"], "BUCKET_INCOMPLETE"),
    ("a commit before the bucket is complete", ["start", "most", "commit"], "BUCKET_INCOMPLETE"),
]


@pytest.mark.parametrize(("steps", "reason"), [(m[1], m[2]) for m in CHUNK_MISTAKES], ids=[m[0] for m in CHUNK_MISTAKES])
@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_inline_chunk_mistakes_are_refused_and_change_nothing(node, committed, steps, reason, mode):
    model = mixed_model(88)
    stream, plan = begin_inline(node, model, mode=mode)
    data = pack(plan, model, 0).numpy().tobytes()
    for step in steps:
        if step == "start":
            stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=len(data)))
        elif step == "most":
            stream.send(bucket_chunk=pb.BucketChunk(sequence=0, offset_bytes=0, data=data[:-8]))
        elif step == "start1":
            stream.send(bucket_start=pb.BucketStart(sequence=1))
        elif step == "commit":
            stream.send(commit=pb.CommitUpdate())
        else:
            _, bucket, offset, length = step
            offset = len(data) + offset if offset < 0 else offset
            stream.send(bucket_chunk=pb.BucketChunk(sequence=bucket, offset_bytes=offset, data=b"z" * length))
    refused(stream, reason)
    # IN_PLACE too: bucket 0 never completed, so none of its bytes reached the store (the fixture checks).


def test_inline_wrong_bucket_checksum_is_data_loss(node, committed):
    model = mixed_model(89)
    stream, plan = begin_inline(node, model)
    data = pack(plan, model, 0).numpy().tobytes()
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=len(data),
                                            checksum=tensor_checksum(torch.zeros(len(data), dtype=torch.uint8))))
    stream.send(bucket_chunk=pb.BucketChunk(sequence=0, offset_bytes=0, data=data))
    refused(stream, "BUCKET_CHECKSUM_MISMATCH", Code.DATA_LOSS)


def test_inline_stream_that_stops_mid_bucket_aborts(node, committed):
    model = mixed_model(90)
    stream, plan = begin_inline(node, model)
    send_bucket(stream, plan, model, 0)
    assert stream.recv().bucket_applied.sequence == 0
    data = pack(plan, model, 1).numpy().tobytes()
    stream.send(bucket_start=pb.BucketStart(sequence=1, size_bytes=len(data)))
    stream.send(bucket_chunk=pb.BucketChunk(sequence=1, offset_bytes=0, data=data[:100]))
    stream.close()  # half-closes: the server sees the end of the stream mid-bucket
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    assert caught.value.code() in (Code.INVALID_ARGUMENT, Code.ABORTED)


# -- SHM misuse ------------------------------------------------------------------------------------------
def test_shm_announcing_a_busy_slot_is_refused(node, committed):
    """Bucket 2 reuses bucket 0's slot: announcing it before BucketApplied(0) came back is refused."""
    model = {k: v for k, v in mixed_model(91).items() if k != "lm_head.weight"}
    plan = plan_buckets(list(model.items()), 256)
    assert len(plan.buckets) >= 3
    stream = UpdateStream(node.stub())
    stream.send(begin=pb.BeginUpdate(version="shm-raw", plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                     transport=pb.TRANSPORT_SHM))
    assert stream.recv().WhichOneof("message") == "ready"
    # The workers are held so that bucket 0 cannot complete: the client cannot have seen its BucketApplied.
    workers = [w.pid for w in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).workers]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        for k in range(3):  # never waits for BucketApplied (and writes nothing: the bytes do not matter here)
            stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=plan.buckets[k].size_bytes,
                                                    checksum=tensor_checksum(pack(plan, model, k))))
        response = stream.recv()
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    assert response.WhichOneof("message") == "aborting", response
    assert (response.aborting.code, response.aborting.reason) == (Code.INVALID_ARGUMENT.value[0], "SHM_SLOT_BUSY")
    stream.send(abort=pb.AbortUpdate(reason="test"))
    with pytest.raises(grpc.RpcError) as caught:
        stream.recv()
    stream.close()
    assert error_info(caught.value).reason == "SHM_SLOT_BUSY"


# -- the local socket ---------------------------------------------------------------------------------------
def local_request(path: str, **kwargs) -> local_pb2.LocalResponse:
    connection = LocalConnection(path)
    try:
        response, fds = connection.request(local_pb2.LocalRequest(**kwargs))
        for fd in fds:
            os.close(fd)
        return response
    finally:
        connection.close()


PEER = """
import socket, sys
peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
peer.connect(sys.argv[1])
try:
    peer.sendall(bytes.fromhex(sys.argv[2]))
except BrokenPipeError:  # the server may answer and close before reading a byte
    pass
sys.stdout.write(peer.recv(65536).hex())
"""


def test_local_socket_is_private_to_the_servers_uid(node, committed):
    path = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).local_socket
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    request = local_pb2.LocalRequest(open_ingress=local_pb2.OpenIngressRequest()).SerializeToString()
    frame = struct.pack("<I", len(request)) + request
    # A peer of another uid is refused by the uid check itself (the file mode is opened here on purpose).
    os.chmod(path, 0o666)
    try:
        # The system Python: the project's interpreter may sit where another uid cannot reach (e.g. /root).
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        answer = subprocess.run([python, "-I", "-c", PEER, path, frame.hex()], user=65534, group=65534,
                                capture_output=True, text=True, timeout=30, cwd="/")
    finally:
        os.chmod(path, 0o600)
    assert answer.returncode == 0, answer.stderr
    response = local_pb2.LocalResponse()
    response.ParseFromString(bytes.fromhex(answer.stdout)[4:])
    assert (response.error.code, response.error.reason) == (Code.PERMISSION_DENIED.value[0], "PEER_UID_REFUSED")
    assert response.error.metadata["uid"] == "65534"


def test_local_socket_needs_attach_first_and_refuses_garbage(node, committed):
    path = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).local_socket
    response = local_request(path, open_ingress=local_pb2.OpenIngressRequest())
    assert (response.error.code, response.error.reason) == (Code.FAILED_PRECONDITION.value[0], "NOT_ATTACHED")
    response = local_request(path, attach_store=local_pb2.AttachStoreRequest(engine_name="bad name!"))
    assert (response.error.code, response.error.reason) == (Code.INVALID_ARGUMENT.value[0], "ENGINE_NAME_INVALID")
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a frame that is no LocalRequest
    garbage.connect(path)
    garbage.sendall(struct.pack("<I", 3) + b"\xff\xff\xff")
    answer = garbage.recv(4096)
    garbage.close()
    parsed = local_pb2.LocalResponse()
    parsed.ParseFromString(answer[4:])
    assert parsed.error.reason == "MESSAGE_MALFORMED"


def test_shm_pushes_with_the_default_keep_no_copy_and_send_dense_while_delta_true_patches(node, committed):
    """Over SHM auto neither samples nor keeps a copy, and the push is dense (at the densities RL
    steps have, keeping patches in reach cost more than they saved: DeltaBase.cannot_pay);
    delta=True still sends patches, which verify."""
    with WeightSyncClient(node.address, max_message_bytes=MAX_MESSAGE) as own:
        own.push(committed.model, version="shm-auto-0", transport="shm")
        assert own._delta.memory_bytes == 0 and own._delta.samples == {}
        step = {n: t.clone() for n, t in committed.model.items()}
        flat = step["lm_head.weight"].view(-1)
        flat[::997] = flat[::997] + 1
        auto = own.push(step, version="shm-auto-1", transport="shm")
        assert auto.bytes_sent >= auto.dense_bytes and own._delta.memory_bytes == 0
        own.push(step, version="shm-kept", transport="shm", delta=True)
        assert own._delta.memory_bytes > 0
        flat[::991] = flat[::991] - 1
        forced = own.push(step, version="shm-patched", transport="shm", delta=True)
        assert forced.bytes_sent < 0.2 * forced.dense_bytes
        assert own.verify(step).ok
    committed.model = step
