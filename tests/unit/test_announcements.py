"""The announcement rules (server/intake/announcements.py) by table: each row a message and what the stream said
before, and the exact decision written out by hand (sizes accepted, or the refusal's code, ErrorInfo reason
and metadata). The real-process suites (test_bad_input, test_bucket_compression, test_deferred_buckets,
test_shm_integrity, ...) check that a refused message changes nothing and the next push commits."""

from __future__ import annotations

import pytest

from weightsync.server.intake.announcements import (
    Accepted,
    Filling,
    Link,
    check_chunk,
    check_commit,
    check_slot,
    check_start,
    drain_length,
    incomplete,
    unexpected,
)
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

PLAN = tensor_pb2.WeightPlan(buckets=[
    tensor_pb2.BucketSpec(size_bytes=4096),
    tensor_pb2.BucketSpec(size_bytes=4096, deferred=True),  # its room; the layout gives its size
    tensor_pb2.BucketSpec(size_bytes=5),  # shorter than a tail
    tensor_pb2.BucketSpec(size_bytes=1000),
])
"""Four buckets, the largest 4096 bytes (what a refused broadcast may be drained at)."""

COLLECTIVE = Link(pb.TRANSPORT_COLLECTIVE)
NCCL = Link(pb.TRANSPORT_COLLECTIVE, broadcast_to_all=True)
INLINE = Link(pb.TRANSPORT_INLINE)
SHM = Link(pb.TRANSPORT_SHM, slot_count=2)
WS64 = tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=7)
UNKNOWN = tensor_pb2.Checksum(algorithm=99)
ZSTD = pb.BUCKET_COMPRESSION_ZSTD
TAIL8 = b"\1" * 8


def start(sequence: int, *, layout: tensor_pb2.BucketSpec | None = None, **fields) -> pb.BucketStart:
    message = pb.BucketStart(sequence=sequence, **fields)
    if layout is not None:
        message.layout.CopyFrom(layout)
    return message


def refused(code: str, reason: str, **metadata: str) -> tuple[str, str, dict[str, str]]:
    return code, reason, metadata


def decided(result) -> Accepted | tuple[str, str, dict[str, str]]:
    if isinstance(result, Accepted):
        return result
    return result.code.name, result.reason, result.metadata


# (what, the BucketStart, the bucket expected next, the link, BucketApplied the client saw, the decision)
STARTS = [
    # sequence
    ("first, size as planned", start(0, size_bytes=4096), 0, INLINE, 0, Accepted(0, 4096, 4096)),
    ("size 0 means as planned", start(0), 0, INLINE, 0, Accepted(0, 4096, 4096)),
    ("last bucket", start(3), 3, INLINE, 0, Accepted(3, 1000, 1000)),
    ("already announced", start(0), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_OUT_OF_ORDER", bucket="0", expected="1")),
    ("negative", start(-1), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_OUT_OF_ORDER", bucket="-1", expected="0")),
    ("skips one", start(2), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_OUT_OF_ORDER", bucket="2", expected="1")),
    ("past the plan", start(4), 4, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_OUT_OF_RANGE", bucket="4", buckets="4")),
    ("far past the plan, skipping", start(9), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_OUT_OF_RANGE", bucket="9", buckets="4")),
    ("order before range", start(3), 4, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_OUT_OF_ORDER", bucket="3", expected="4")),
    # deferred layouts
    ("deferred, empty layout", start(1, layout=tensor_pb2.BucketSpec()), 1, INLINE, 0, Accepted(1, 0, 0)),
    ("deferred, 64-byte layout", start(1, layout=tensor_pb2.BucketSpec(size_bytes=64)), 1, COLLECTIVE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_TAIL_INVALID", bucket="1", tail_bytes="0", expected="8")),
    ("deferred, 64-byte layout, its tail", start(1, layout=tensor_pb2.BucketSpec(size_bytes=64), tail=TAIL8), 1,
     COLLECTIVE, 0, Accepted(1, 64, 64)),
    ("deferred, size of its layout", start(1, size_bytes=64, layout=tensor_pb2.BucketSpec(size_bytes=64)), 1, INLINE,
     0, Accepted(1, 64, 64)),
    ("deferred, size of its room", start(1, size_bytes=4096, layout=tensor_pb2.BucketSpec(size_bytes=64)), 1, INLINE,
     0, refused("INVALID_ARGUMENT", "BUCKET_SIZE_MISMATCH", bucket="1", planned_bytes="64", announced_bytes="4096")),
    ("deferred without layout", start(1), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_LAYOUT_MISSING", bucket="1")),
    ("planned with layout", start(0, layout=tensor_pb2.BucketSpec(size_bytes=64)), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_LAYOUT_UNEXPECTED", bucket="0")),
    ("layout itself deferred", start(1, layout=tensor_pb2.BucketSpec(deferred=True)), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_LAYOUT_INVALID", bucket="1")),
    ("layout under 8 bytes", start(1, layout=tensor_pb2.BucketSpec(size_bytes=4)), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_TOO_SMALL", bucket="1", size_bytes="4")),
    ("layout past its room", start(1, layout=tensor_pb2.BucketSpec(size_bytes=4104)), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_TOO_LARGE", bucket="1", size_bytes="4104", limit="4096")),
    ("layout before order", start(2, layout=tensor_pb2.BucketSpec(size_bytes=4)), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_OUT_OF_ORDER", bucket="2", expected="1")),
    # sizes and checksums
    ("one byte short", start(0, size_bytes=4095), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_SIZE_MISMATCH", bucket="0", planned_bytes="4096", announced_bytes="4095")),
    ("negative size", start(0, size_bytes=-1), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_SIZE_MISMATCH", bucket="0", planned_bytes="4096", announced_bytes="-1")),
    ("unknown checksum", start(0, checksum=UNKNOWN), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "CHECKSUM_ALGORITHM_UNKNOWN", bucket="0")),
    ("size before checksum", start(0, size_bytes=1, checksum=UNKNOWN), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_SIZE_MISMATCH", bucket="0", planned_bytes="4096", announced_bytes="1")),
    ("WS64 checksum", start(0, checksum=WS64), 0, INLINE, 0, Accepted(0, 4096, 4096)),
    # tails: over a group only
    ("group, its tail", start(0, tail=TAIL8), 0, COLLECTIVE, 0, Accepted(0, 4096, 4096)),
    ("NCCL, its tail", start(0, tail=TAIL8), 0, NCCL, 0, Accepted(0, 4096, 4096)),
    ("group, no tail", start(0), 0, COLLECTIVE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_TAIL_INVALID", bucket="0", tail_bytes="0", expected="8")),
    ("group, 9-byte tail", start(0, tail=b"\1" * 9), 0, NCCL, 0,
     refused("INVALID_ARGUMENT", "BUCKET_TAIL_INVALID", bucket="0", tail_bytes="9", expected="8")),
    ("group, 5-byte bucket, 5-byte tail", start(2, tail=b"\1" * 5), 2, COLLECTIVE, 0, Accepted(2, 5, 5)),
    ("group, 5-byte bucket, 8-byte tail", start(2, tail=TAIL8), 2, COLLECTIVE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_TAIL_INVALID", bucket="2", tail_bytes="8", expected="5")),
    ("checksum before tail", start(0, checksum=UNKNOWN), 0, COLLECTIVE, 0,
     refused("INVALID_ARGUMENT", "CHECKSUM_ALGORITHM_UNKNOWN", bucket="0")),
    ("INLINE ignores a tail", start(0, tail=b"\1" * 3), 0, INLINE, 0, Accepted(0, 4096, 4096)),
    # SHM: a WS64 checksum and a free slot
    ("SHM, WS64, slot free", start(0, checksum=WS64), 0, SHM, 0, Accepted(0, 4096, 4096)),
    ("SHM, no checksum", start(0), 0, SHM, 0,
     refused("INVALID_ARGUMENT", "BUCKET_CHECKSUM_REQUIRED", bucket="0")),
    ("SHM, unknown checksum", start(0, checksum=UNKNOWN), 0, SHM, 0,
     refused("INVALID_ARGUMENT", "CHECKSUM_ALGORITHM_UNKNOWN", bucket="0")),
    ("SHM, slot of bucket 0 not applied", start(2, checksum=WS64), 2, SHM, 0,
     refused("INVALID_ARGUMENT", "SHM_SLOT_BUSY", bucket="2", slot="0")),
    ("SHM, slot of bucket 0 applied", start(2, checksum=WS64), 2, SHM, 1, Accepted(2, 5, 5)),
    ("SHM ignores a tail", start(0, checksum=WS64, tail=b"\1"), 0, SHM, 0, Accepted(0, 4096, 4096)),
    # compressed: one zstd frame, shorter than the bucket, on a Gloo group or INLINE
    ("INLINE, zstd frame", start(0, size_bytes=100, compression=ZSTD), 0, INLINE, 0, Accepted(0, 4096, 100, ZSTD)),
    ("group, zstd frame and its tail", start(0, size_bytes=100, compression=ZSTD, tail=TAIL8), 0, COLLECTIVE, 0,
     Accepted(0, 4096, 100, ZSTD)),
    ("group, 5-byte frame, 5-byte tail", start(3, size_bytes=5, compression=ZSTD, tail=b"\1" * 5), 3, COLLECTIVE,
     0, Accepted(3, 1000, 5, ZSTD)),
    ("group, frame without tail", start(0, size_bytes=100, compression=ZSTD), 0, COLLECTIVE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_TAIL_INVALID", bucket="0", tail_bytes="0", expected="8")),
    ("group, 5-byte frame, the bucket's tail", start(3, size_bytes=5, compression=ZSTD, tail=TAIL8), 3, COLLECTIVE,
     0, refused("INVALID_ARGUMENT", "BUCKET_TAIL_INVALID", bucket="3", tail_bytes="8", expected="5")),
    ("unknown compression", start(0, size_bytes=100, compression=99), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_COMPRESSION_UNKNOWN", bucket="0", compression="99")),
    ("unknown compression over SHM", start(0, size_bytes=100, compression=99), 0, SHM, 0,
     refused("INVALID_ARGUMENT", "BUCKET_COMPRESSION_UNKNOWN", bucket="0", compression="99")),
    ("zstd over SHM", start(0, size_bytes=100, compression=ZSTD, checksum=WS64), 0, SHM, 0,
     refused("INVALID_ARGUMENT", "BUCKET_COMPRESSION_UNSUPPORTED", bucket="0")),
    ("zstd over NCCL", start(0, size_bytes=100, compression=ZSTD, tail=TAIL8), 0, NCCL, 0,
     refused("INVALID_ARGUMENT", "BUCKET_COMPRESSION_UNSUPPORTED", bucket="0")),
    ("frame of 0 bytes", start(0, compression=ZSTD), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_SIZE_MISMATCH", bucket="0", planned_bytes="4096", announced_bytes="0")),
    ("frame as long as the bucket", start(0, size_bytes=4096, compression=ZSTD), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_SIZE_MISMATCH", bucket="0", planned_bytes="4096", announced_bytes="4096")),
    ("frame one byte shorter", start(0, size_bytes=4095, compression=ZSTD), 0, INLINE, 0,
     Accepted(0, 4096, 4095, ZSTD)),
    ("frame, unknown checksum", start(0, size_bytes=100, compression=ZSTD, checksum=UNKNOWN), 0, INLINE, 0,
     refused("INVALID_ARGUMENT", "CHECKSUM_ALGORITHM_UNKNOWN", bucket="0")),
    ("deferred, zstd frame of its layout", start(1, size_bytes=10, compression=ZSTD,
                                                 layout=tensor_pb2.BucketSpec(size_bytes=64)), 1, INLINE, 0,
     Accepted(1, 64, 10, ZSTD)),
    ("deferred, frame as long as its layout", start(1, size_bytes=64, compression=ZSTD,
                                                    layout=tensor_pb2.BucketSpec(size_bytes=64)), 1, INLINE, 0,
     refused("INVALID_ARGUMENT", "BUCKET_SIZE_MISMATCH", bucket="1", planned_bytes="64", announced_bytes="64")),
]


@pytest.mark.parametrize(("what", "message", "expected", "link", "applied_sent", "decision"), STARTS,
                         ids=[row[0] for row in STARTS])
def test_a_bucket_start(what, message, expected, link, applied_sent, decision):
    assert decided(check_start(message, PLAN, expected=expected, link=link, applied_sent=applied_sent)) == decision


def test_a_refusal_says_what_to_do():
    error = check_start(start(0, size_bytes=100, compression=ZSTD, tail=b""), PLAN, expected=0, link=COLLECTIVE)
    assert error.message == "bucket 0: tail has 0 bytes; send the frame's last 8 bytes"
    error = check_start(start(2, checksum=WS64), PLAN, expected=2, link=SHM)
    assert error.message == ("bucket 2 was announced before bucket 0 (same ingress slot) was applied: wait for its "
                             "BucketApplied before writing the slot")


SLOTS = [
    # (sequence, slots, BucketApplied the client saw, the busy slot or None)
    (0, 2, 0, None),
    (1, 2, 0, None),
    (2, 2, 0, "0"),
    (2, 2, 1, None),
    (3, 2, 1, "1"),
    (5, 4, 0, "1"),
    (5, 4, 1, "1"),
    (5, 4, 2, None),
]


@pytest.mark.parametrize(("sequence", "slots", "applied_sent", "busy"), SLOTS)
def test_an_shm_slot(sequence, slots, applied_sent, busy):
    refusal = check_slot(sequence, slots, applied_sent)
    assert (refusal and (refusal.reason, refusal.metadata["slot"])) == (busy and ("SHM_SLOT_BUSY", busy))


DRAINS = [
    # (what, the refused BucketStart, the length its broadcast is drained at, None: the group breaks)
    ("as announced", start(0, size_bytes=100), 100),
    ("0: as planned", start(3), 1000),
    ("0 past the plan", start(9), None),
    ("announced, past the plan", start(9, size_bytes=4096), 4096),
    ("negative", start(0, size_bytes=-1), None),
    ("more than the largest bucket", start(0, size_bytes=4097), None),
    ("deferred: its layout's", start(1, layout=tensor_pb2.BucketSpec(size_bytes=64)), 64),
]


@pytest.mark.parametrize(("what", "message", "length"), DRAINS, ids=[row[0] for row in DRAINS])
def test_a_refused_broadcast_is_drained_at(what, message, length):
    assert drain_length(message, PLAN) == length


CHUNKS = [
    # (what, the bucket filling, sequence, offset, size, the decision: None accepted)
    ("first", Filling(0, 0, 100), 0, 0, 60, None),
    ("ends the bucket", Filling(0, 60, 100), 0, 60, 40, None),
    ("largest chunk", Filling(0, 0, 100), 0, 0, 64, None),
    ("no bucket filling", None, 0, 0, 10, refused("INVALID_ARGUMENT", "CHUNK_UNEXPECTED", bucket="0")),
    ("another bucket", Filling(0, 0, 100), 1, 0, 10, refused("INVALID_ARGUMENT", "CHUNK_UNEXPECTED", bucket="1")),
    ("a gap", Filling(0, 60, 100), 0, 70, 10,
     refused("INVALID_ARGUMENT", "CHUNK_OUT_OF_ORDER", bucket="0", offset_bytes="70", expected="60")),
    ("again", Filling(0, 60, 100), 0, 0, 10,
     refused("INVALID_ARGUMENT", "CHUNK_OUT_OF_ORDER", bucket="0", offset_bytes="0", expected="60")),
    ("empty", Filling(0, 0, 100), 0, 0, 0,
     refused("INVALID_ARGUMENT", "CHUNK_SIZE_INVALID", bucket="0", size_bytes="0")),
    ("over the chunk limit", Filling(0, 0, 100), 0, 0, 65,
     refused("INVALID_ARGUMENT", "CHUNK_SIZE_INVALID", bucket="0", size_bytes="65")),
    ("past the bucket", Filling(0, 60, 100), 0, 60, 41,
     refused("INVALID_ARGUMENT", "CHUNK_OVERFLOW", bucket="0", size_bytes="100")),
    ("offset before size", Filling(0, 60, 100), 0, 10, 0,
     refused("INVALID_ARGUMENT", "CHUNK_OUT_OF_ORDER", bucket="0", offset_bytes="10", expected="60")),
]


@pytest.mark.parametrize(("what", "filling", "sequence", "offset", "size", "decision"), CHUNKS,
                         ids=[row[0] for row in CHUNKS])
def test_a_chunk(what, filling, sequence, offset, size, decision):
    refusal = check_chunk(filling, sequence=sequence, offset_bytes=offset, size_bytes=size, max_chunk_bytes=64)
    assert (refusal and decided(refusal)) == decision


def test_a_message_before_the_bucket_is_complete():
    assert decided(incomplete(Filling(2, 60, 100))) == refused(
        "INVALID_ARGUMENT", "BUCKET_INCOMPLETE", bucket="2", received="60", size_bytes="100")


@pytest.mark.parametrize(("kind", "message"), [("begin", "unexpected begin message after begin"),
                                               ("", "unexpected empty message after begin")])
def test_a_message_no_update_takes(kind, message):
    refusal = unexpected(kind)
    assert (refusal.code.name, refusal.reason, refusal.message) == ("INVALID_ARGUMENT", "UNEXPECTED_MESSAGE", message)


@pytest.mark.parametrize(("applied", "buckets", "decision"), [
    (4, 4, None),
    (0, 0, None),
    (3, 4, refused("FAILED_PRECONDITION", "BUCKETS_MISSING", received="3", expected="4")),
    (0, 4, refused("FAILED_PRECONDITION", "BUCKETS_MISSING", received="0", expected="4")),
])
def test_a_commit(applied, buckets, decision):
    refusal = check_commit(applied, buckets)
    assert (refusal and decided(refusal)) == decision
