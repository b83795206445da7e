"""Two details docs/data-plane.md states, pinned over the raw protocol (INLINE, one 2-worker server):

  - "Deferred buckets": a layout's patches may be in any PATCH_* encoding (the plan's candidates
    say PATCH_XOR); here PATCH_POSITIONS, STAGED and IN_PLACE, land bit for bit;
  - "Compressed buckets": a frame that decompresses is an ordinary bucket, so under IN_PLACE a
    wrong bucket checksum on a bucket received straight into the store leaves it INCONSISTENT
    (the frame refusals, which write nothing, are tests/system/test_bucket_compression.py's); the next
    full push then commits and verifies.
"""

from __future__ import annotations

import pytest
import torch
import zstandard
from test_deferred_buckets import (
    GROUPS,
    announced,
    changed,
    committed,
    deferred_plan,
    dense_push,
    send,
    spec_of,
)

from weightsync.common import patches
from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    UpdateStream,
    local_checksums,
    mixed_model,
    pack,
    plan_buckets,
    server_checksums,
    start_server,
)

pytestmark = pytest.mark.timeout(180)
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("details"))
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def positions_layout(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], group
                     ) -> tuple[tensor_pb2.BucketSpec, bytes]:
    """The changed tensors of `group` as PATCH_POSITIONS patches at 64-byte offsets."""
    spec, data = tensor_pb2.BucketSpec(), b""
    for name in group:
        positions = patches.changed_positions(base[name], new[name])
        if not positions.numel():
            continue
        tensor = new[name]
        size = patches.patch_size_bytes(patches.POSITIONS, tensor.numel(), positions.numel(), tensor.element_size())
        out = torch.zeros(size, dtype=torch.uint8)
        patches.encode_patch(tensor, positions, patches.POSITIONS, out)
        data = data.ljust(-(-len(data) // 64) * 64, b"\0")
        spec.tensors.add().CopyFrom(spec_of(
            name, tensor, offset_bytes=len(data), size_bytes=size, encoding=patches.POSITIONS,
            patch_count=positions.numel(),
            checksum=tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=ws64(tensor))))
        data += out.numpy().tobytes()
    if data:
        data = data.ljust(max(8, len(data)), b"\0")
    spec.size_bytes = len(data)
    return spec, data


@pytest.mark.parametrize("mode", [pb.UPDATE_MODE_STAGED, pb.UPDATE_MODE_IN_PLACE], ids=["staged", "in-place"])
def test_a_deferred_layout_takes_a_patch_in_another_patch_encoding(node, mode):
    base = mixed_model(1)
    committed(dense_push(node, base, "base", allow_new=True))
    new = changed(base, seed=20 + mode)
    starts = [announced(k, *positions_layout(base, new, group)) for k, group in enumerate(GROUPS)]
    assert all(t.encoding == patches.POSITIONS for start, _ in starts for t in start.layout.tensors)
    committed(send(node, deferred_plan(new), starts, f"positions-{mode}", mode=mode))
    assert server_checksums(node, list(new)) == [local_checksums(new)]


def noisy(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randint(0, 256, (512, 512), generator=g, dtype=torch.int16).view(torch.bfloat16)
            for i in range(3)}


def inline_push(server, model: dict[str, torch.Tensor], version: str, mode: int, *,
                bad_checksum: bool = False) -> pb.UpdateWeightsResponse:
    """Every bucket a zstd frame in chunks; bucket 0's checksum wrong when asked. The last response."""
    plan = plan_buckets(list(model.items()), 1 << 20)
    stream = UpdateStream(server.stub())
    stream.send(begin=pb.BeginUpdate(version=version, plan=plan, mode=mode, transport=pb.TRANSPORT_INLINE,
                                     allow_new_tensors=True))
    ready = stream.recv()
    assert ready.WhichOneof("message") == "ready"
    for k in range(len(plan.buckets)):
        data = pack(plan, model, k)
        frame = zstandard.ZstdCompressor(level=1).compress(data.numpy().tobytes())
        checksum = tensor_checksum(data)
        if bad_checksum and k == 0:
            checksum.value ^= 1
        stream.send(bucket_start=pb.BucketStart(sequence=k, size_bytes=len(frame), checksum=checksum,
                                                compression=pb.BUCKET_COMPRESSION_ZSTD))
        for offset in range(0, len(frame), CHUNK):
            stream.send(bucket_chunk=pb.BucketChunk(sequence=k, offset_bytes=offset, data=frame[offset:offset + CHUNK]))
        response = stream.recv()
        if response.WhichOneof("message") != "bucket_applied":
            stream.send(abort=pb.AbortUpdate(reason="the server is aborting"))
            with pytest.raises(Exception):  # noqa: B017 - the stream ends with the aborting's status
                stream.recv()
            return response
    stream.send(commit=pb.CommitUpdate())
    response = stream.recv()
    stream.close()
    return response


def test_a_compressed_in_place_bucket_with_a_wrong_checksum_leaves_the_store_inconsistent(node):
    first = noisy(1)
    assert inline_push(node, first, "first", pb.UPDATE_MODE_STAGED).WhichOneof("message") == "committed"
    response = inline_push(node, noisy(2), "bad", pb.UPDATE_MODE_IN_PLACE, bad_checksum=True)
    assert (response.aborting.code, response.aborting.reason) == (15, "BUCKET_CHECKSUM_MISMATCH")  # DATA_LOSS
    state = info(node)
    assert state.store_state == pb.STORE_STATE_INCONSISTENT and state.current_version.version == "first"
    # The next full push rewrites what the failed one touched: CONSISTENT again, bit for bit.
    after = noisy(3)
    assert inline_push(node, after, "after", pb.UPDATE_MODE_IN_PLACE).WhichOneof("message") == "committed"
    assert info(node).store_state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(node, list(after)) == [local_checksums(after)]
