"""Patched updates through the raw protocol, as a trainer in any language sends them:
INLINE, patches built with the documented byte layouts (the overwriting encodings with
common.patches, PATCH_XOR with its reference encoder common.patch_format), checked bit for bit
on every worker. Every refusal is followed by the next normal update and a verify."""

from __future__ import annotations

import grpc
import pytest
import torch

from weightsync.common import patch_format
from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.common.patches import (
    BITMASK,
    GAPS,
    POSITIONS,
    XOR,
    changed_positions,
    encode_patch,
    patch_size_bytes,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import DTYPE, UpdateStream, error_info, local_checksums, server_checksums, start_server
from helpers import mixed_model as model

pytestmark = pytest.mark.timeout(180)
CHUNK = 1 << 20


def changed(base: dict[str, torch.Tensor], seed: int, fraction: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in base.items()}
    for tensor in new.values():
        flat = tensor.view(-1)
        picks = torch.nonzero(torch.rand(flat.numel(), generator=g) < fraction).reshape(-1)
        if tensor.dtype == torch.bool:
            flat[picks] = ~flat[picks]
        else:
            flat[picks] = flat[picks] + torch.ones((), dtype=tensor.dtype)
    return new


def dense_buckets(named: dict[str, torch.Tensor]) -> list[tuple[tensor_pb2.TensorSpec, bytes]]:
    out = []
    for name, tensor in named.items():
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out.append((tensor_pb2.TensorSpec(name=name, dtype=DTYPE[tensor.dtype], shape=list(tensor.shape),
                                          offset_bytes=0, size_bytes=len(data)), data))
    return out


def patch_buckets(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], encoding: int,
                  checksum_of=None) -> list[tuple[tensor_pb2.TensorSpec, bytes]]:
    """One bucket per changed tensor, each a patch (unchanged tensors are not sent)."""
    out = []
    for name, tensor in new.items():
        positions = changed_positions(base[name], tensor)
        if not positions.numel():
            continue
        if encoding == XOR:
            raw, count, _ = patch_format.encode(base[name], tensor)
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        else:
            count = positions.numel()
            data = torch.empty(patch_size_bytes(encoding, tensor.numel(), count, tensor.element_size()),
                               dtype=torch.uint8)
            encode_patch(tensor, positions, encoding, data)
        size = data.numel()
        checksum = ws64(tensor) if checksum_of is None else checksum_of(name, tensor)
        out.append((tensor_pb2.TensorSpec(name=name, dtype=DTYPE[tensor.dtype], shape=list(tensor.shape),
                                          offset_bytes=0, size_bytes=size, encoding=encoding,
                                          patch_count=count,
                                          checksum=tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64,
                                                                       value=checksum)),
                    data.numpy().tobytes()))
    return out


def padded(data: bytes) -> bytes:
    return data + b"\0" * (max(8, len(data)) - len(data))


def send(server, buckets, version: str, *, mode=pb.UPDATE_MODE_STAGED, base_generation: int = 0,
         stop_after: int | None = None, allow_new: bool = False) -> grpc.RpcError | pb.UpdateCommitted:
    """One update of these buckets; a base generation is named in the server's own store epoch."""
    epoch = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version.store_epoch
    plan = tensor_pb2.WeightPlan()
    for spec, data in buckets:
        bucket = plan.buckets.add(size_bytes=len(padded(data)))
        for each in spec if isinstance(spec, list) else [spec]:
            bucket.tensors.add().CopyFrom(each)
    stream = UpdateStream(server.stub())
    stream.send(begin=pb.BeginUpdate(version=version, plan=plan, mode=mode, transport=pb.TRANSPORT_INLINE,
                                     base_generation=base_generation, allow_new_tensors=allow_new,
                                     base_store_epoch=epoch if base_generation else 0))
    try:
        assert stream.recv().WhichOneof("message") == "ready"
        for k, (_, data) in enumerate(buckets):
            if k == stop_after:
                stream.send(abort=pb.AbortUpdate(reason="trainer stops half-way"))
                stream.recv()
                raise AssertionError("abort did not end the stream")
            data = padded(data)
            stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=len(data),
                                                    checksum=tensor_checksum(torch.frombuffer(bytearray(data),
                                                                                              dtype=torch.uint8))))
            for offset in range(0, len(data), CHUNK):
                stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=offset,
                                                        data=data[offset: offset + CHUNK]))
            response = stream.recv()
            if response.WhichOneof("message") != "bucket_applied":
                stream.send(abort=pb.AbortUpdate(reason="server is aborting"))
                stream.recv()
                raise AssertionError(f"unexpected {response}")
        stream.send(commit=pb.CommitUpdate())
        committed = stream.recv().committed
        stream.close()
        return committed
    except grpc.RpcError as error:
        stream.close()
        return error


def one_bucket(buckets: list[tuple[tensor_pb2.TensorSpec, bytes]]) -> tuple[list[tensor_pb2.TensorSpec], bytes]:
    """These tensors in one bucket, one after the other at 64-byte offsets."""
    specs, data = [], b""
    for spec, part in buckets:
        data = data.ljust(-(-len(data) // 64) * 64, b"\0")
        placed = tensor_pb2.TensorSpec()
        placed.CopyFrom(spec)
        placed.offset_bytes = len(data)
        specs.append(placed)
        data += part
    return specs, data


def generation(server) -> int:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version.generation


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("patches"))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture
def base(node) -> dict[str, torch.Tensor]:
    committed = model(1)
    result = send(node, dense_buckets(committed), "base", allow_new=True)
    assert isinstance(result, pb.UpdateCommitted), result
    return committed


@pytest.mark.parametrize("encoding", [POSITIONS, GAPS, BITMASK, XOR], ids=["positions", "gaps", "bitmask", "xor"])
@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_patches_land_bit_for_bit(node, base, encoding, mode):
    current = base
    for step in range(3):
        new = changed(current, seed=10 + step)
        result = send(node, patch_buckets(current, new, encoding), f"p{step}", mode=mode,
                      base_generation=generation(node))
        assert isinstance(result, pb.UpdateCommitted), result
        assert server_checksums(node) == [local_checksums(new)]
        current = new


def test_a_patch_to_another_generation_is_refused_before_any_byte_moves(node, base):
    new = changed(base, seed=20)
    # A committed generation before the current one (>= 1: 0 would mean "no base" and be refused as
    # BASE_GENERATION_MISSING), whatever ran on this module's server before.
    again = send(node, dense_buckets(base), "base-again")
    assert isinstance(again, pb.UpdateCommitted), again
    stale = generation(node) - 1
    result = send(node, patch_buckets(base, new, POSITIONS), "stale", base_generation=stale)
    assert isinstance(result, grpc.RpcError)
    assert result.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(result)
    assert info.reason == "BASE_MISMATCH"
    assert info.metadata["base_generation"] == str(stale)
    assert server_checksums(node) == [local_checksums(base)]
    missing = send(node, patch_buckets(base, new, POSITIONS), "no-base")
    assert (missing.code(), error_info(missing).reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BASE_GENERATION_MISSING")
    result = send(node, patch_buckets(base, new, POSITIONS), "right", base_generation=generation(node))
    assert isinstance(result, pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


@pytest.mark.parametrize(("positions", "reason"), [
    ([5, 10_000_000], "PATCH_INDEX_OUT_OF_RANGE"),
    ([9, 5], "PATCH_INDEX_UNSORTED"),
    ([5, 5], "PATCH_INDEX_UNSORTED"),
])
def test_bad_positions_are_refused_and_change_nothing(node, base, positions, reason):
    target = base["w"]
    values = torch.tensor([1.5, 2.5])
    data = torch.cat([torch.tensor(positions, dtype=torch.int32).view(torch.uint8), values.view(torch.uint8)])
    spec = tensor_pb2.TensorSpec(name="w", dtype=DTYPE[target.dtype], shape=list(target.shape), size_bytes=16,
                                 encoding=POSITIONS, patch_count=2,
                                 checksum=tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=1))
    result = send(node, [(spec, data.numpy().tobytes())], "bad", base_generation=generation(node))
    assert isinstance(result, grpc.RpcError)
    assert (result.code(), error_info(result).reason) == (grpc.StatusCode.INVALID_ARGUMENT, reason)
    assert server_checksums(node) == [local_checksums(base)]
    new = changed(base, seed=30)
    assert isinstance(send(node, patch_buckets(base, new, GAPS), "next", base_generation=generation(node)),
                      pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


def test_a_wrong_whole_tensor_checksum_is_data_loss_and_staged_keeps_the_base(node, base):
    new = changed(base, seed=40)
    wrong = patch_buckets(base, new, BITMASK, checksum_of=lambda name, t: ws64(t) ^ (1 if name == "w" else 0))
    result = send(node, wrong, "wrong", base_generation=generation(node))
    assert isinstance(result, grpc.RpcError)
    assert (result.code(), error_info(result).reason) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH")
    assert error_info(result).metadata["tensor"] == "w"
    assert server_checksums(node) == [local_checksums(base)]
    assert isinstance(send(node, patch_buckets(base, new, BITMASK), "right", base_generation=generation(node)),
                      pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


def test_a_staged_patch_aborted_half_way_leaves_the_base_bit_for_bit(node, base):
    new = changed(base, seed=50)
    buckets = patch_buckets(base, new, POSITIONS)
    assert len(buckets) >= 3
    aborted = send(node, buckets, "aborted", base_generation=generation(node), stop_after=2)
    assert isinstance(aborted, grpc.RpcError) and aborted.code() == grpc.StatusCode.ABORTED
    state = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).store_state
    assert state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(node) == [local_checksums(base)]
    assert isinstance(send(node, buckets, "whole", base_generation=generation(node)), pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


def test_an_aborted_in_place_patch_leaves_the_store_inconsistent_and_refuses_patches(node, base):
    new = changed(base, seed=60)
    buckets = patch_buckets(base, new, POSITIONS)
    aborted = send(node, buckets, "aborted", mode=pb.UPDATE_MODE_IN_PLACE, base_generation=generation(node),
                   stop_after=2)
    assert isinstance(aborted, grpc.RpcError) and aborted.code() == grpc.StatusCode.ABORTED
    info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.store_state == pb.STORE_STATE_INCONSISTENT
    refused = send(node, buckets, "patch-on-dirty", base_generation=generation(node))
    assert error_info(refused).reason == "BASE_MISMATCH"  # half-written bytes are no base
    assert isinstance(send(node, dense_buckets(new), "repair"), pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


def test_an_in_place_patch_refused_on_arrival_writes_nothing_and_the_store_stays_consistent(node, base):
    """The first bucket's patch fails its whole-tensor check when it arrives: no byte of it was written,
    so the store is not torn (it was marked INCONSISTENT, and patches refused, until a dense push)."""
    new = changed(base, seed=70)
    buckets = patch_buckets(base, new, GAPS, checksum_of=lambda name, t: ws64(t) ^ 1)
    before = generation(node)
    result = send(node, buckets, "refused", mode=pb.UPDATE_MODE_IN_PLACE, base_generation=before)
    assert (result.code(), error_info(result).reason) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH")
    info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.store_state, info.current_version.generation) == (pb.STORE_STATE_CONSISTENT, before)
    assert server_checksums(node) == [local_checksums(base)]
    # Still a base: the right patch, IN_PLACE, applies to it.
    right = send(node, patch_buckets(base, new, GAPS), "right", mode=pb.UPDATE_MODE_IN_PLACE, base_generation=before)
    assert isinstance(right, pb.UpdateCommitted), right
    assert server_checksums(node) == [local_checksums(new)]


def xor_spec(name: str, target: torch.Tensor, data: bytes, count: int, checksum: int = 1) -> tensor_pb2.TensorSpec:
    return tensor_pb2.TensorSpec(name=name, dtype=DTYPE[target.dtype], shape=list(target.shape),
                                 size_bytes=len(data), encoding=XOR, patch_count=count,
                                 checksum=tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64,
                                                              value=checksum))


def w_bitmask(*positions: int) -> bytes:
    """The bitmask index of "w" (3001 elements: 376 bytes) marking these positions."""
    mask = bytearray(376)
    for p in positions:
        mask[p // 8] |= 1 << (p % 8)
    return bytes(mask)


@pytest.mark.parametrize(("data", "count", "reason"), [
    # gaps: one varint that never ends (nine continuation bytes, then nothing)
    (b"\x00" + b"\x80" * 9, 1, "PATCH_MALFORMED"),
    # gaps 5 and 4, then plane kinds DENSE ZERO ZERO ZERO and two low bytes: one byte left over
    (b"\x00\x05\x04" + bytes([1, 0, 0, 0]) + b"\x01\x01" + b"\x07", 2, "PATCH_MALFORMED"),
    # the same with a count of 3: the dense plane is cut short
    (b"\x00\x05\x04" + bytes([1, 0, 0, 0]) + b"\x01\x01", 3, "PATCH_MALFORMED"),
    # a bitmask marking 2 elements for a count of 3 (the planes hold 3 bytes)
    (b"\x01" + w_bitmask(5, 10) + bytes([1, 0, 0, 0]) + b"\x01\x01\x01", 3, "PATCH_COUNT_MISMATCH"),
    # gaps 3000 and 5: the second position is past the tensor's 3001 elements
    (b"\x00\xb8\x17\x05" + bytes([1, 0, 0, 0]) + b"\x01\x01", 2, "PATCH_INDEX_OUT_OF_RANGE"),
    # an index kind no one defined
    (b"\x02\x05" + bytes([1, 0, 0, 0]) + b"\x01", 1, "PATCH_MALFORMED"),
    # a plane kind no one defined
    (b"\x00\x05" + bytes([3, 0, 0, 0]) + b"\x01", 1, "PATCH_MALFORMED"),
])
@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_malformed_xor_patches_are_refused_and_change_nothing(node, base, data, count, reason, mode):
    before = generation(node)
    result = send(node, [(xor_spec("w", base["w"], data, count), data)], "bad", mode=mode, base_generation=before)
    assert isinstance(result, grpc.RpcError), result
    assert (result.code(), error_info(result).reason) == (grpc.StatusCode.INVALID_ARGUMENT, reason)
    assert error_info(result).metadata["tensor"] == "w"
    info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.store_state, info.current_version.generation) == (pb.STORE_STATE_CONSISTENT, before)
    assert server_checksums(node) == [local_checksums(base)]
    new = changed(base, seed=80)
    assert isinstance(send(node, patch_buckets(base, new, XOR), "next", mode=mode, base_generation=before),
                      pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


def test_an_xor_patch_size_outside_what_its_count_can_take_is_refused_before_any_byte_moves(node, base):
    data = b"\x00\x05" + bytes([1, 0, 0, 0]) + b"\x01"
    for size in (5, 390):  # count 1 of float32 in 3001 elements: 6 to 389 bytes
        spec = xor_spec("w", base["w"], data, 1)
        spec.size_bytes = size
        result = send(node, [(spec, data.ljust(size, b"\0")[:size])], "bad-size", base_generation=generation(node))
        assert (result.code(), error_info(result).reason) == (grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_SIZE_MISMATCH")
        assert error_info(result).metadata["min_bytes"] == "6" and error_info(result).metadata["max_bytes"] == "389"
    assert server_checksums(node) == [local_checksums(base)]
    new = changed(base, seed=81)
    assert isinstance(send(node, patch_buckets(base, new, XOR), "next", base_generation=generation(node)),
                      pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_xor_values_made_against_another_base_are_data_loss_and_change_nothing(node, base, mode):
    """The trainer names the right generation but XORs against tensors the store does not hold: the
    XOR lands on other bits, the whole-tensor WS64 says so (DATA_LOSS) before any byte is written."""
    before = generation(node)
    elsewhere = changed(base, seed=90)  # what the trainer wrongly believes the store holds
    new = changed(elsewhere, seed=91)
    result = send(node, patch_buckets(elsewhere, new, XOR), "wrong-base", mode=mode, base_generation=before)
    assert isinstance(result, grpc.RpcError), result
    assert (result.code(), error_info(result).reason) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH")
    info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.store_state, info.current_version.generation) == (pb.STORE_STATE_CONSISTENT, before)
    assert server_checksums(node) == [local_checksums(base)]
    assert isinstance(send(node, patch_buckets(base, new, XOR), "right", mode=mode, base_generation=before),
                      pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums(new)]


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_a_bucket_whose_second_patch_is_refused_takes_back_its_first(node, base, mode):
    """Two PATCH_XOR patches in one bucket, the first right, the second's whole-tensor WS64 wrong: a
    worker applies each while it checks it, so the first is in the store when the second is refused;
    it is taken back (XORed in again), and the store is the base bit for bit, CONSISTENT."""
    before = generation(node)
    new = changed(base, seed=95)
    right = {spec.name: (spec, data) for spec, data in patch_buckets(base, new, XOR)}
    wrong = {spec.name: (spec, data) for spec, data in
             patch_buckets(base, new, XOR, checksum_of=lambda name, t: ws64(t) ^ (name == "w"))}
    bucket = one_bucket([right["embed"], wrong["w"]])
    result = send(node, [bucket], "second-refused", mode=mode, base_generation=before)
    assert isinstance(result, grpc.RpcError), result
    assert (result.code(), error_info(result).reason) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH")
    assert error_info(result).metadata["tensor"] == "w"
    info = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert (info.store_state, info.current_version.generation) == (pb.STORE_STATE_CONSISTENT, before)
    assert server_checksums(node) == [local_checksums(base)]
    both = one_bucket([right["embed"], right["w"]])
    assert isinstance(send(node, [both], "both-right", mode=mode, base_generation=before), pb.UpdateCommitted)
    assert server_checksums(node) == [local_checksums({**base, "embed": new["embed"], "w": new["w"]})]
