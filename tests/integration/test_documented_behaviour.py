"""What docs/data-plane.md promises a trainer written from the doc and the protos alone.

Each test pins one statement of the doc, over raw gRPC and the raw local socket (never the
SDK), against one 2-worker server that has a bearer token (read from a file ending in a
newline) and 64 KiB ingress slots. Every test runs between two proofs that nothing was
harmed (the `committed` fixture): before, a fresh model is pushed; after, every worker
holds exactly the last committed weights and the next push commits and verifies.

Statements of the doc pinned by tests elsewhere:
  - an INLINE bucket larger than ingress_slot_bytes (within max_bucket_bytes) commits:
    tests/integration/test_transports.py::test_inline_bucket_larger_than_a_slot_streams_in_pieces
  - max_tensors, max_plan_bytes, max_bucket_bytes and their reasons:
    tests/integration/test_bad_input.py::test_plan_limits
  - a tensor cannot reach past its bucket's end (so never spans two buckets):
    tests/integration/test_bad_input.py::test_bad_plan[out-of-bounds] and [bucket-too-short]
  - allow_new_tensors adds names but never changes a dtype or shape:
    tests/integration/test_bad_input.py::test_bad_plan_staged_with_new_tensors_allowed
  - every reason a trainer can meet is in the doc's table: tests/repo/test_docs.py
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import socket
import struct

import grpc
import pytest
import torch

from weightsync.common.checksum import tensor_checksum
from weightsync.common.plan_id import plan_id_of
from weightsync.v1 import local_pb2, tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import ServerProcess, error_info, local_checksums, pack, plan_buckets, start_server

pytestmark = pytest.mark.timeout(180)
Code = grpc.StatusCode

TOKEN = "documented-token-5f1c"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SLOT = 64 << 10
BUCKET = 4096
CHUNK = 1000
MAX_FDS = 250


# -- the server, and a trainer written from the doc -------------------------------------------------
@pytest.fixture(scope="module")
def node(tmp_path_factory) -> ServerProcess:
    directory = tmp_path_factory.mktemp("documented")
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")  # as `echo "$TOKEN" > token` writes it
    server = start_server(directory, "--token-file", str(token_file), "--ingress-slot-bytes", str(SLOT))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def small_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),  # 4096 bytes: bucket 0 alone
        "layers.0.q.weight": torch.randn(32, 32, generator=g).to(torch.float16),
        "layers.0.q.bias": torch.randn(32, generator=g),
        "layers.0.norm.weight": torch.randn(32, generator=g).double(),
        "quant.int8": torch.randint(-128, 127, (33,), generator=g, dtype=torch.int8),
        "step": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "head.weight": torch.randn(3000, generator=g),  # 12000 bytes: a bucket of its own
    }


class Stream:
    """The client side of UpdateWeights, message by message, with the bearer token."""

    def __init__(self, node: ServerProcess) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = node.stub().UpdateWeights(iter(self._requests.get, None), metadata=AUTH, timeout=120)

    def send(self, **kwargs) -> None:
        self._requests.put(pb.UpdateWeightsRequest(**kwargs))

    def recv(self) -> pb.UpdateWeightsResponse:
        return next(self._responses)

    def rest(self) -> tuple[list[pb.UpdateWeightsResponse], grpc.RpcError | None]:
        """Every message until the stream ends, and the status it ended with (None: OK)."""
        messages = []
        try:
            for message in self._responses:
                messages.append(message)
        except grpc.RpcError as error:
            return messages, error
        finally:
            self._requests.put(None)
        return messages, None

    def close(self) -> None:
        self._requests.put(None)


def begin(node: ServerProcess, **fields) -> tuple[Stream, pb.UpdateWeightsResponse]:
    fields.setdefault("mode", pb.UPDATE_MODE_STAGED)
    fields.setdefault("transport", pb.TRANSPORT_INLINE)
    stream = Stream(node)
    stream.send(begin=pb.BeginUpdate(**fields))
    return stream, stream.recv()


def refused_at_begin(node: ServerProcess, **fields) -> grpc.RpcError:
    """A begin the server refuses: the stream ends with the status, and nothing came before it."""
    fields.setdefault("mode", pb.UPDATE_MODE_STAGED)
    fields.setdefault("transport", pb.TRANSPORT_INLINE)
    stream = Stream(node)
    stream.send(begin=pb.BeginUpdate(**fields))
    messages, error = stream.rest()
    assert messages == [] and error is not None, messages
    return error


def push_inline(node: ServerProcess, model: dict[str, torch.Tensor], version: str, *,
                plan: tensor_pb2.WeightPlan | None = None, by_id: bool = False,
                allow_new: bool = False) -> pb.UpdateReady:
    """One INLINE update, every bucket in CHUNK-byte chunks; returns its `ready`."""
    plan = plan if plan is not None else plan_buckets(list(model.items()), BUCKET)
    source = {"plan_id": plan_id_of(plan)} if by_id else {"plan": plan}
    stream, first = begin(node, version=version, allow_new_tensors=allow_new, **source)
    assert first.WhichOneof("message") == "ready", first
    for k in range(len(plan.buckets)):
        data = pack(plan, model, k).numpy().tobytes()
        stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=len(data)))
        for offset in range(0, len(data), CHUNK):
            stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=offset, data=data[offset : offset + CHUNK]))
        assert stream.recv().bucket_applied.sequence == k
    stream.send(commit=pb.CommitUpdate())
    done = stream.recv()
    assert done.committed.version.version == version, done
    stream.close()
    return first.ready


def info(node: ServerProcess) -> pb.GetServerInfoResponse:
    return node.stub().GetServerInfo(pb.GetServerInfoRequest(), metadata=AUTH, timeout=10)


def assert_holds(node: ServerProcess, model: dict[str, torch.Tensor]) -> None:
    """The node's store holds exactly these bytes under these names."""
    response = node.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(names=sorted(model)), metadata=AUTH,
                                              timeout=60)
    assert {t.name: t.checksum.value for t in response.tensors} == local_checksums(model)


class Committed:
    seed = 100
    model: dict[str, torch.Tensor] = {}


@pytest.fixture
def committed(node):
    """Before: a fresh model committed. After: still held bit for bit, and the next push commits exactly."""
    Committed.seed += 1
    Committed.model = small_model(Committed.seed)
    push_inline(node, Committed.model, f"before-{Committed.seed}", allow_new=True)
    yield Committed.model
    assert info(node).store_state == pb.STORE_STATE_CONSISTENT
    assert_holds(node, Committed.model)
    after = small_model(Committed.seed + 500)
    push_inline(node, after, f"after-{Committed.seed}")
    assert_holds(node, after)
    Committed.model = after


def assert_reason(error: grpc.RpcError, code: grpc.StatusCode, reason: str, **metadata: object) -> None:
    details = error_info(error)
    assert (error.code(), details.domain, details.reason) == (code, "weightsync", reason), (error, details)
    for key, value in metadata.items():
        assert details.metadata[key] == str(value), (key, dict(details.metadata))


# -- the token --------------------------------------------------------------------------------------
def test_the_token_file_newline_is_not_part_of_the_token(node, committed):
    """`authorization: Bearer <token>`, the file's trailing newline stripped; the local socket takes the bare token."""
    assert [w.index for w in info(node).workers] == [0, 1]
    for metadata in ((), (("authorization", TOKEN),), (("authorization", f"bearer {TOKEN}"),),
                     (("authorization", f"Bearer {TOKEN} "),)):
        with pytest.raises(grpc.RpcError) as caught:
            node.stub().GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata, timeout=10)
        assert_reason(caught.value, Code.UNAUTHENTICATED, "TOKEN_INVALID")
    path = info(node).local_socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        refused, _ = local_call(conn, attach_store=local_pb2.AttachStoreRequest(token=f"Bearer {TOKEN}"))
        assert (refused.error.code, refused.error.reason) == (Code.UNAUTHENTICATED.value[0], "TOKEN_INVALID")
        attached, _ = local_call(conn, attach_store=local_pb2.AttachStoreRequest(token=TOKEN))
        assert attached.WhichOneof("response") == "attach_store", attached


# -- the plan id ------------------------------------------------------------------------------------
def documented_plan_id(plan: tensor_pb2.WeightPlan) -> str:
    """The WeightPlan comment's encoding, written out from the comment alone."""
    out = bytearray(b"WSPLAN1\n")
    for bucket in plan.buckets:
        out += struct.pack("<qI", bucket.size_bytes, len(bucket.tensors))
        for t in bucket.tensors:
            name = t.name.encode()
            out += struct.pack("<I", len(name)) + name + struct.pack("<II", t.dtype, len(t.shape))
            out += b"".join(struct.pack("<q", d) for d in t.shape)
            out += struct.pack("<qqIQ", t.offset_bytes, t.size_bytes, t.checksum.algorithm, t.checksum.value)
    return hashlib.sha256(bytes(out)).hexdigest()[:32]


def with_tensor_checksums(plan: tensor_pb2.WeightPlan, model: dict[str, torch.Tensor]) -> tensor_pb2.WeightPlan:
    checked = tensor_pb2.WeightPlan()
    checked.CopyFrom(plan)
    for bucket in checked.buckets:
        for spec in bucket.tensors:
            spec.checksum.CopyFrom(tensor_checksum(model[spec.name]))
    return checked


def test_tensor_checksums_are_part_of_the_plan_id():
    a, b = small_model(1), small_model(2)
    plan = plan_buckets(list(a.items()), BUCKET)
    with_a, with_b = with_tensor_checksums(plan, a), with_tensor_checksums(plan, b)
    # The same layout, only the checksum values differ: three plans, three ids.
    assert len({plan_id_of(plan), plan_id_of(with_a), plan_id_of(with_b)}) == 3
    for p in (plan, with_a, with_b):
        assert plan_id_of(p) == documented_plan_id(p)


def test_a_plan_with_tensor_checksums_cannot_carry_new_values(node, committed):
    """Reusing such a plan's id sends the old checksums with the new bytes: DATA_LOSS, nothing changes."""
    new = small_model(Committed.seed + 1000)
    plan = plan_buckets(list(committed.items()), BUCKET)
    old_plan = with_tensor_checksums(plan, committed)
    push_inline(node, committed, "checked", plan=old_plan)
    stream, ready = begin(node, version="stale-checksums", plan_id=plan_id_of(old_plan))
    assert ready.WhichOneof("message") == "ready", ready
    data = pack(old_plan, new, 0).numpy().tobytes()
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=len(data)))
    for offset in range(0, len(data), CHUNK):
        stream.send(bucket_chunk=pb.BucketChunk(sequence=0, offset_bytes=offset, data=data[offset : offset + CHUNK]))
    aborting = stream.recv()
    assert (aborting.aborting.code, aborting.aborting.reason) == (Code.DATA_LOSS.value[0], "TENSOR_CHECKSUM_MISMATCH")
    stream.send(abort=pb.AbortUpdate(reason="test"))
    _, error = stream.rest()
    assert_reason(error, Code.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH", bucket=0, tensor="embed.weight")
    assert_holds(node, committed)  # STAGED: bit for bit
    new_plan = with_tensor_checksums(plan, new)  # new values, new checksums: a new plan, sent in full
    assert push_inline(node, new, "checked-again", plan=new_plan).plan_id == plan_id_of(new_plan) != plan_id_of(old_plan)
    assert_holds(node, new)
    Committed.model = new


# -- PLAN_NOT_FOUND -----------------------------------------------------------------------------------
def test_an_unknown_plan_id_ends_the_stream_not_found_with_no_ready(node, committed):
    plan = plan_buckets(list(committed.items()), 3 * BUCKET)  # a layout no test commits before this one
    plan_id = plan_id_of(plan)
    error = refused_at_begin(node, version="by-unknown-id", plan_id=plan_id)
    assert_reason(error, Code.NOT_FOUND, "PLAN_NOT_FOUND", plan_id=plan_id)
    # What the doc says to do: send the plan in full on a new stream; from then on the id is known.
    model = small_model(Committed.seed + 2000)
    assert push_inline(node, model, "in-full", plan=plan).plan_id == plan_id
    assert_holds(node, model)
    model = small_model(Committed.seed + 3000)
    assert push_inline(node, model, "by-id", plan=plan, by_id=True).plan_id == plan_id
    assert_holds(node, model)
    Committed.model = model


# -- abort ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_a_client_abort_in_the_middle_of_an_inline_bucket_is_aborted_by_client(node, committed, mode):
    model = small_model(Committed.seed + 4000)
    plan = plan_buckets(list(model.items()), BUCKET)
    stream, ready = begin(node, version="aborted", plan=plan, mode=mode)
    assert ready.WhichOneof("message") == "ready", ready
    data = pack(plan, model, 0).numpy().tobytes()
    assert len(data) > CHUNK  # the abort falls inside the bucket
    stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=len(data)))
    stream.send(bucket_chunk=pb.BucketChunk(sequence=0, offset_bytes=0, data=data[:CHUNK]))
    stream.send(abort=pb.AbortUpdate(reason="the trainer changed its mind"))
    messages, error = stream.rest()
    assert error is not None and not [m for m in messages if m.WhichOneof("message") == "committed"]
    # Whatever the status, nothing changed and the next update commits (the fixture verifies it too).
    assert_holds(node, committed)
    assert_reason(error, Code.ABORTED, "ABORTED_BY_CLIENT")


# -- offsets ----------------------------------------------------------------------------------------
def spec(name: str, dtype: int, shape: list[int], offset: int, size: int) -> tensor_pb2.TensorSpec:
    return tensor_pb2.TensorSpec(name=name, dtype=dtype, shape=shape, offset_bytes=offset, size_bytes=size)


F32, I8 = tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_INT8


def test_an_empty_tensor_may_share_the_next_tensors_offset(node, committed):
    model = {
        "offsets.before": torch.arange(10, dtype=torch.int8),  # [0, 10)
        "offsets.empty": torch.empty(0, 3),  # at 64, ends at 64
        "offsets.after": torch.randn(16),  # at 64 too: [64, 128)
    }
    plan = tensor_pb2.WeightPlan()
    plan.buckets.add(size_bytes=128, tensors=[
        spec("offsets.before", I8, [10], 0, 10), spec("offsets.empty", F32, [0, 3], 64, 0),
        spec("offsets.after", F32, [16], 64, 64),
    ])
    push_inline(node, model, "shared-offset", plan=plan, allow_new=True)
    assert_holds(node, model)
    Committed.model = {**committed, **model}


OVERLAPS = [
    # (what, tensors of one 128-byte bucket, the tensor named in the refusal, its offset)
    ("two non-empty tensors overlap", [("a", [16], 0, 64), ("b", [16], 32, 64)], "b", 32),
    ("an empty tensor inside the previous one", [("a", [16], 0, 64), ("b", [0], 32, 0)], "b", 32),
    ("offsets go back", [("a", [16], 64, 64), ("b", [4], 0, 16)], "b", 0),
]


@pytest.mark.parametrize(("tensors", "culprit", "offset"), [o[1:] for o in OVERLAPS], ids=[o[0] for o in OVERLAPS])
def test_each_tensor_starts_at_or_after_the_end_of_the_one_before(node, committed, tensors, culprit, offset):
    plan = tensor_pb2.WeightPlan()
    plan.buckets.add(size_bytes=128, tensors=[spec(f"overlap.{n}", F32, s, o, z) for n, s, o, z in tensors])
    counts = [w.tensor_count for w in info(node).workers]
    error = refused_at_begin(node, version="overlap", plan=plan, allow_new_tensors=True)
    assert_reason(error, Code.INVALID_ARGUMENT, "TENSOR_OVERLAP", bucket=0, tensor=f"overlap.{culprit}",
                  offset_bytes=offset)
    assert [w.tensor_count for w in info(node).workers] == counts


# -- partial updates --------------------------------------------------------------------------------
def test_a_partial_update_rewrites_only_the_names_it_sends(node, committed):
    part = {k: v for k, v in small_model(Committed.seed + 5000).items() if k in ("layers.0.q.bias", "step")}
    push_inline(node, part, "partial")
    assert_holds(node, {**committed, **part})
    Committed.model = {**committed, **part}


def test_a_new_name_needs_allow_new_tensors(node, committed):
    model = {"partial.new": torch.randn(8), "step": torch.tensor(-1, dtype=torch.int64)}
    plan = plan_buckets(list(model.items()), BUCKET)
    counts = [w.tensor_count for w in info(node).workers]
    error = refused_at_begin(node, version="new-name", plan=plan)
    assert_reason(error, Code.INVALID_ARGUMENT, "TENSOR_UNKNOWN", bucket=0, tensor="partial.new")
    assert [w.tensor_count for w in info(node).workers] == counts
    push_inline(node, model, "new-name", plan=plan, allow_new=True)
    assert [w.tensor_count for w in info(node).workers] == [c + 1 for c in counts]
    assert_holds(node, {**committed, **model})
    Committed.model = {**committed, **model}


# -- the local socket and the SHM ingress ----------------------------------------------------------------
def local_call(conn: socket.socket, **request) -> tuple[local_pb2.LocalResponse, list[int]]:
    """One request; the response's descriptors arrive with its 4-byte length prefix, and only there."""
    payload = local_pb2.LocalRequest(**request).SerializeToString()
    conn.sendall(struct.pack("<I", len(payload)) + payload)
    header, ancillary, flags, _ = conn.recvmsg(4, socket.CMSG_SPACE(MAX_FDS * 4))
    assert len(header) == 4 and not flags & socket.MSG_CTRUNC
    fds = [fd for level, kind, data in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
           for fd in struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4])]
    (length,) = struct.unpack("<I", header)
    body = b""
    while len(body) < length:
        data, later, _, _ = conn.recvmsg(length - len(body), socket.CMSG_SPACE(MAX_FDS * 4))
        assert data and not later, "descriptors came after the length prefix"
        body += data
    response = local_pb2.LocalResponse()
    response.ParseFromString(body)
    return response, fds


def open_ingress(node: ServerProcess) -> tuple[int, local_pb2.OpenIngressResponse]:
    """attach_store{token} then open_ingress on a connection closed right after."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(info(node).local_socket)
        attached, fds = local_call(conn, attach_store=local_pb2.AttachStoreRequest(token=TOKEN))
        assert attached.WhichOneof("response") == "attach_store" and fds == [], attached
        opened, fds = local_call(conn, open_ingress=local_pb2.OpenIngressRequest())
    assert opened.WhichOneof("response") == "open_ingress" and len(fds) == 1, opened
    return fds[0], opened.open_ingress


def push_shm(node: ServerProcess, ingress: mmap.mmap, slots: int, model: dict[str, torch.Tensor], version: str,
             stream: Stream | None = None) -> None:
    """Bucket k into slot k % slots once BucketApplied(k - slots) came back, then its BucketStart."""
    plan = plan_buckets(list(model.items()), BUCKET)
    if stream is None:
        stream, ready = begin(node, version=version, plan=plan, transport=pb.TRANSPORT_SHM)
        assert ready.WhichOneof("message") == "ready", ready
    applied = 0
    for k in range(len(plan.buckets)):
        while applied < k - slots + 1:
            assert stream.recv().bucket_applied.sequence == applied
            applied += 1
        data = pack(plan, model, k).numpy().tobytes()
        start = (k % slots) * SLOT
        ingress[start : start + len(data)] = data
        # SHM buckets carry their WS64 (the workers check their own copy: BUCKET_CHECKSUM_REQUIRED otherwise).
        stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=len(data),
                                                checksum=tensor_checksum(pack(plan, model, k))))
    while applied < len(plan.buckets):
        assert stream.recv().bucket_applied.sequence == applied
        applied += 1
    stream.send(commit=pb.CommitUpdate())
    assert stream.recv().committed.version.version == version
    stream.close()


def test_the_ingress_descriptor_rides_on_the_length_prefix(node, committed):
    fd, opened = open_ingress(node)  # local_call asserts where the descriptor came
    try:
        limits = info(node).limits
        assert (opened.slot_bytes, opened.slot_count) == (limits.ingress_slot_bytes, limits.ingress_slot_count) == (SLOT, 2)
        assert os.fstat(fd).st_size == SLOT * 2
    finally:
        os.close(fd)


def test_two_shm_trainers_share_one_ingress_that_outlives_their_connections(node, committed):
    (fd_a, opened), (fd_b, _) = open_ingress(node), open_ingress(node)
    size = opened.slot_bytes * opened.slot_count
    maps = [mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) for fd in (fd_a, fd_b)]
    try:
        a, b = maps
        stat_a, stat_b = os.fstat(fd_a), os.fstat(fd_b)
        assert (stat_a.st_dev, stat_a.st_ino) == (stat_b.st_dev, stat_b.st_ino)  # one memory, the server's
        a[:8] = b"trainerA"
        assert b[:8] == b"trainerA"
        # Both connections are closed: the descriptors still carry updates, one after another.
        model = small_model(Committed.seed + 6000)
        push_shm(node, a, opened.slot_count, model, "shm-a")
        assert_holds(node, model)
        # One update at a time: B's begin while A's update runs is refused before `ready`.
        model = small_model(Committed.seed + 7000)
        plan = plan_buckets(list(model.items()), BUCKET)
        running, ready = begin(node, version="shm-a2", plan=plan, transport=pb.TRANSPORT_SHM)
        assert ready.WhichOneof("message") == "ready", ready
        error = refused_at_begin(node, version="shm-b", plan=plan, transport=pb.TRANSPORT_SHM)
        assert_reason(error, Code.FAILED_PRECONDITION, "UPDATE_IN_PROGRESS", update_id=ready.ready.update_id)
        push_shm(node, a, opened.slot_count, model, "shm-a2", stream=running)
        assert_holds(node, model)
        model = small_model(Committed.seed + 8000)
        push_shm(node, b, opened.slot_count, model, "shm-b")
        assert_holds(node, model)
        Committed.model = model
    finally:
        for m in maps:
            m.close()
        os.close(fd_a)
        os.close(fd_b)
