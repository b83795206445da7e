"""A refusal of the store's plan in an update of several parts names the part whose bucket it is
(update_streams.attributed): that part hears its own bucket index and `part`, every other part
ABORTED PART_FAILED naming it, so a sharded trainer (or verl's actor) can say which rank sent what
the store refused. Before, every part got the same refusal naming no part, with the bucket's index
in the store's concatenated plan, which no part's plan has."""

from __future__ import annotations

import grpc
import pytest
from raw_updates import generation, push_whole
from test_part_updates import OWNS, model, push_parts

from weightsync.common.errors import FailedPrecondition, InvalidArgument
from weightsync.server.update.streams import Stream, attributed
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    UpdateStream,
    error_info,
    local_checksums,
    plan_buckets,
    server_checksums,
    start_server,
)

pytestmark = pytest.mark.timeout(120)


def streams(*counts: int) -> list[Stream]:
    """One stream per part with `counts[r]` buckets, one after another in the store's plan."""
    out, first = [], 0
    for rank, count in enumerate(counts):
        plan = tensor_pb2.WeightPlan(buckets=[tensor_pb2.BucketSpec() for _ in range(count)])
        out.append(Stream(rank=rank, plan=plan, plan_id=f"p{rank}", first=first))
        first += count
    return out


@pytest.mark.parametrize(("counts", "metadata", "expected_part", "expected_metadata"), [
    # store bucket 3 is part 1's bucket 1 (part 0 has 2 buckets)
    ((2, 3), {"bucket": "3", "tensor": "u"}, 1, {"bucket": "1", "tensor": "u", "part": "1"}),
    ((2, 3), {"bucket": "0"}, 0, {"bucket": "0", "part": "0"}),
    ((2, 3), {"bucket": "4"}, 1, {"bucket": "2", "part": "1"}),
    # a part with no buckets owns none: store bucket 0 is part 1's
    ((0, 1, 1), {"bucket": "1"}, 2, {"bucket": "0", "part": "2"}),
    # no bucket named, or one past every plan: as it was, no part
    ((2, 3), {"tensor": "u"}, None, {"tensor": "u"}),
    ((2, 3), {"bucket": "5"}, None, {"bucket": "5"}),
    # one stream (no parts): as it was
    ((4,), {"bucket": "3"}, None, {"bucket": "3"}),
])
def test_attributed_table(counts, metadata, expected_part, expected_metadata) -> None:
    error = InvalidArgument("TENSOR_SHAPE_MISMATCH", "tensor 'u' has shape [300, 8] in the store", **metadata)
    named, part = attributed(error, streams(*counts))
    assert part == expected_part
    assert named.metadata == expected_metadata
    assert (type(named), named.code, named.reason) == (InvalidArgument, error.code, "TENSOR_SHAPE_MISMATCH")
    if part is None:
        assert named is error
    else:
        assert named.message == f"part {part}, bucket {expected_metadata['bucket']}: {error.message}"
        assert error.metadata == metadata  # the original is not changed


@pytest.mark.parametrize(("counts", "failing", "metadata", "expected_metadata", "prefix"), [
    # a worker's failure of part 1's bucket: store bucket 3 is its bucket 1
    ((2, 3), 1, {"bucket": "3", "expected": "0x1"}, {"bucket": "1", "expected": "0x1", "part": "1"},
     "part 1, bucket 1: "),
    # no bucket named: the part still is
    ((2, 3), 0, {"tensor": "w"}, {"tensor": "w", "part": "0"}, "part 0: "),
    # one stream (no parts): as it was
    ((4,), 0, {"bucket": "3"}, {"bucket": "3"}, ""),
])
def test_attributed_to_the_stream_whose_bucket_failed(counts, failing, metadata, expected_metadata, prefix) -> None:
    error = InvalidArgument("BUCKET_CHECKSUM_MISMATCH", "the bucket's bytes do not match", **metadata)
    parts = streams(*counts)
    named, part = attributed(error, parts, parts[failing])
    assert named.metadata == expected_metadata
    assert part == (failing if len(counts) > 1 else None)
    assert named.message == prefix + error.message


def test_attributed_keeps_the_error_s_class_and_attributes() -> None:
    error = FailedPrecondition("TENSOR_NEW", "tensor 'x' is not in the store", bucket=2)
    error.worker_index = 1
    named, part = attributed(error, streams(1, 2))
    assert (part, type(named), named.worker_index, str(named)) == (
        1, FailedPrecondition, 1, "FAILED_PRECONDITION TENSOR_NEW: part 1, bucket 1: tensor 'x' is not in the store")


def ended(stream: UpdateStream) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """How a part's stream ended, past the keepalives it heard while the parts joined."""
    with pytest.raises(grpc.RpcError) as caught:
        while (answer := stream.recv()).WhichOneof("message") == "waiting":
            pass
        pytest.fail(f"expected the stream to end with a refusal, got {answer}")
    stream.close()
    info = error_info(caught.value)
    return caught.value.code(), info.reason, dict(info.metadata)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("part-blame"), workers=2)
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def test_a_part_whose_tensor_the_store_refuses_is_named_to_every_part(node) -> None:
    base = model(1)
    before = push_whole(node, base, "base")
    tensors = model(2)
    tensors["u"] = tensors["u"][:299]  # part 1 sends u one row short of the stored [300, 8]
    parts = []
    for rank, names in enumerate(OWNS):
        own = {n: tensors[n] for n in names}
        plan = plan_buckets(list(own.items()), 8192)
        stream = UpdateStream(node.stub())
        stream.send(begin=pb.BeginUpdate(version="short", plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                         transport=pb.TRANSPORT_INLINE,
                                         part=pb.UpdatePart(update_key="k-short", rank=rank, world=2,
                                                            whole_tensors=names)))
        parts.append((stream, plan))
    u_bucket = next(k for k, b in enumerate(parts[1][1].buckets) if any(t.name == "u" for t in b.tensors))
    code1, reason1, meta1 = ended(parts[1][0])
    code0, reason0, meta0 = ended(parts[0][0])
    assert (code1, reason1, meta1["part"], meta1["bucket"], meta1["tensor"]) == (
        grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_SHAPE_MISMATCH", "1", str(u_bucket), "u")
    assert (code0, reason0, meta0) == (grpc.StatusCode.ABORTED, "PART_FAILED", {
        "update_key": "k-short", "part": "1", "part_reason": "TENSOR_SHAPE_MISMATCH", "part_code": "INVALID_ARGUMENT"})
    assert generation(node) == before
    assert server_checksums(node) == [local_checksums(base)]
    assert push_parts(node, model(3), "v3", "k-after-short") == before + 1
    assert push_whole(node, model(4), "after") == before + 2
