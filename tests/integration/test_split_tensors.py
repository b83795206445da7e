"""A tensor larger than a bucket travels as pieces in consecutive buckets (tensor.proto, WeightPlan):
on every transport, STAGED and IN_PLACE, bit-exact in the store and for an engine; an update stopped
between its pieces leaves the store as any aborted update does, and the next push is exact."""

from __future__ import annotations

import grpc
import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.client.buckets.planning import build_plan
from weightsync.common.errors import InvalidArgument
from weightsync.common.plan_validation import PlanLimits, validate_plan
from weightsync.engine import EngineClient
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    DTYPE,
    UpdateStream,
    error_info,
    local_checksums,
    running_server,
    server_checksums,
)

pytestmark = pytest.mark.timeout(300)
BUCKET = 64 << 10
"""Small buckets: "big" is 2.5 of them."""


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, generator=g),
        "big": torch.randn(40960, generator=g),  # 160 KiB: pieces of 64, 64 and 32 KiB
        "big_t": torch.randn(96, 256, generator=g).to(torch.bfloat16).t(),  # 48 KiB, not split, not contiguous
        "wide_t": torch.randn(256, 300, generator=g).t(),  # 300 KiB, not contiguous: packed pieces
        "norm": torch.ones(64),
    }


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("split"), "--ingress-slot-bytes", str(BUCKET)) as server:
        yield server


def engine_view(node) -> dict[str, torch.Tensor]:
    with EngineClient(server=node.address, name="split-reader") as engine, engine.acquire() as snapshot:
        return {name: tensor.clone() for name, tensor in snapshot.tensors.items()}


def test_the_sdk_plans_a_large_tensor_as_pieces_that_validate():
    planned = build_plan(list(model(0).items()), BUCKET, 4 << 20)
    pieces = [(b.spec.tensors[0].name, b.spec.tensors[0].piece.offset_bytes, b.spec.size_bytes)
              for b in planned if b.spec.tensors[0].HasField("piece")]
    assert [p for p in pieces if p[0] == "big"] == [("big", 0, BUCKET), ("big", BUCKET, BUCKET),
                                                    ("big", 2 * BUCKET, 32 << 10)]
    assert sum(size for name, _, size in pieces if name == "wide_t") == 300 * 256 * 4
    plan = tensor_pb2.WeightPlan(buckets=[b.spec for b in planned])
    summary = validate_plan(plan, PlanLimits(max_tensors=5, max_plan_bytes=1 << 30, max_bucket_bytes=BUCKET))
    assert summary.tensor_count == 5  # a split tensor counts once


@pytest.mark.parametrize("transport", ["collective", "inline", "shm"])
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_tensor_of_two_and_a_half_buckets_lands_whole(node, transport, mode):
    with WeightSyncClient(node.address, timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=30)
        for step in range(2):
            current = model(10 * len(mode) + step)
            client.push(current, version=f"{transport}-{mode}-{step}", transport=transport, mode=mode,
                        bucket_size_bytes=BUCKET, allow_new_tensors=True)
            assert client.verify(current).ok
            assert server_checksums(node) == [local_checksums(current)]
            seen = engine_view(node)
            assert all(torch.equal(seen[n].view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8))
                       for n, t in current.items())


class StopAt(Exception):
    pass


@pytest.mark.parametrize("transport", ["collective", "inline"])
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_an_update_stopped_between_pieces_and_the_next_push(node, transport, mode):
    with WeightSyncClient(node.address, timeout=60) as client:
        if transport == "collective":
            client.create_group(timeout=30)
        before = model(1)
        client.push(before, version="before", transport=transport, bucket_size_bytes=BUCKET, allow_new_tensors=True)
        planned = build_plan(list(before.items()), BUCKET, 4 << 20)
        second_piece = next(i for i, b in enumerate(planned)
                            if b.spec.tensors[0].HasField("piece") and b.spec.tensors[0].piece.offset_bytes == BUCKET)

        def stop(progress) -> None:
            if progress.bucket == second_piece:
                raise StopAt()

        with pytest.raises(StopAt):
            client.push(model(2), version="stopped", transport=transport, mode=mode, bucket_size_bytes=BUCKET,
                        progress=stop)
        info = client.server_info()[0]
        assert info.current_version.version == "before"
        if mode == "staged":
            assert info.store_state == pb.STORE_STATE_CONSISTENT
            assert server_checksums(node) == [local_checksums(before)]
        else:
            assert info.store_state == pb.STORE_STATE_INCONSISTENT  # "big" was half-written
        after = model(3)
        client.push(after, version="after", transport=transport, mode=mode, bucket_size_bytes=BUCKET)
        assert client.verify(after).ok
        assert client.server_info()[0].store_state == pb.STORE_STATE_CONSISTENT


def piece_plan(pieces: list[tuple[int, int]], numel: int = 64, extra: bool = False) -> tensor_pb2.WeightPlan:
    """A float32 tensor of `numel` elements as pieces (offset, size)."""
    plan = tensor_pb2.WeightPlan()
    for start, size in pieces:
        bucket = plan.buckets.add(size_bytes=size)
        spec = bucket.tensors.add(name="w", dtype=DTYPE[torch.float32], shape=[numel], size_bytes=size)
        spec.piece.offset_bytes = start
        if extra:
            bucket.tensors.add(name="x", dtype=DTYPE[torch.float32], shape=[1], offset_bytes=size, size_bytes=4)
            bucket.size_bytes += 8
    return plan


@pytest.mark.parametrize(("plan", "reason"), [
    (piece_plan([(0, 128), (128, 128)], extra=True), "PIECE_NOT_ALONE"),
    (piece_plan([(128, 128), (0, 128)]), "PIECE_OUT_OF_ORDER"),
    (piece_plan([(0, 128), (192, 64)]), "PIECE_OUT_OF_ORDER"),
    (piece_plan([(0, 128)]), "PIECES_INCOMPLETE"),
    (piece_plan([(0, 128), (128, 192)]), "PIECE_INVALID"),
    (piece_plan([(0, 130), (130, 126)]), "PIECE_INVALID"),
])
def test_pieces_out_of_the_rules_are_refused(plan, reason):
    with pytest.raises(InvalidArgument) as caught:
        validate_plan(plan, PlanLimits(max_tensors=10, max_plan_bytes=1 << 20, max_bucket_bytes=1 << 20))
    assert caught.value.reason == reason


def test_a_bad_piece_plan_is_refused_by_the_server_and_changes_nothing(node):
    with WeightSyncClient(node.address, timeout=60) as client:
        held = model(5)
        client.push(held, version="held", transport="inline", bucket_size_bytes=BUCKET, allow_new_tensors=True)
    stream = UpdateStream(node.stub())
    stream.send(begin=pb.BeginUpdate(version="bad", plan=piece_plan([(0, 128)]), mode=pb.UPDATE_MODE_STAGED,
                                     transport=pb.TRANSPORT_INLINE))
    with pytest.raises(grpc.RpcError) as refused:
        stream.recv()
    stream.close()
    assert (refused.value.code(), error_info(refused.value).reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                                        "PIECES_INCOMPLETE")
    assert server_checksums(node) == [local_checksums(held)]
