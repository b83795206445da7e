"""UpdateWeights requests parsed without copying INLINE chunk bytes.

The generated parser copies a BucketChunk's data twice (into the message, and
out again when `.data` is read); at tens of MiB per chunk that is most of the
server's INLINE cost. `parse_update_request` reads the common shape - exactly
one `bucket_chunk` field holding only fields 1-3 - straight from the received
bytes, with the data as a view into them. Anything else (other messages,
unknown fields, odd encodings, damage) goes to the generated parser, so what
is accepted, and what is refused as malformed, stays protobuf's decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.v1 import weight_sync_service_pb2 as pb

UPDATE_WEIGHTS = "/weightsync.v1.WeightSyncService/UpdateWeights"

_CHUNK_KEY = 5 << 3 | 2  # UpdateWeightsRequest.bucket_chunk, length-delimited
_SEQUENCE_KEY = 1 << 3 | 0
_OFFSET_KEY = 2 << 3 | 0
_DATA_KEY = 3 << 3 | 2


@dataclass(frozen=True, slots=True)
class ChunkView:
    """BucketChunk's fields, `data` a view into the received message."""

    sequence: int
    offset_bytes: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    """An UpdateWeightsRequest holding a bucket_chunk, read the way the intake (intake.py) reads a message."""

    bucket_chunk: ChunkView

    @staticmethod
    def WhichOneof(_group: str) -> str:  # noqa: N802 - the protobuf message method it stands in for
        return "bucket_chunk"


class _Unusual(Exception):
    """Not the common shape: let the generated parser decide."""


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    """A varint of at most 9 bytes (63 bits: no negative int64 here; those take the generated parser)."""
    value = shift = 0
    for index in range(at, min(at + 9, len(raw))):
        byte = raw[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    raise _Unusual


def _chunk(raw: bytes) -> ChunkRequest:
    if not raw or raw[0] != _CHUNK_KEY:
        raise _Unusual
    length, at = _varint(raw, 1)
    if at + length != len(raw):
        raise _Unusual  # more than one field, or truncated
    sequence = offset = 0
    start = end = at  # empty data unless a data field comes
    while at < len(raw):
        key, at = _varint(raw, at)
        if key == _SEQUENCE_KEY:
            value, at = _varint(raw, at)
            sequence = value
        elif key == _OFFSET_KEY:
            value, at = _varint(raw, at)
            offset = value
        elif key == _DATA_KEY:
            size, at = _varint(raw, at)
            if at + size > len(raw):
                raise _Unusual
            start, end, at = at, at + size, at + size  # a repeated field: the last one wins, as in protobuf
        else:
            raise _Unusual
    return ChunkRequest(ChunkView(sequence, offset, memoryview(raw)[start:end]))


def parse_update_request(raw: bytes) -> pb.UpdateWeightsRequest | ChunkRequest:
    try:
        return _chunk(raw)
    except _Unusual:
        return pb.UpdateWeightsRequest.FromString(raw)
