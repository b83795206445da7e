"""UpdateWeights messages the SDK encodes itself, for INLINE's bulk bytes.

A BucketChunk built as a protobuf message costs three copies of its data in
Python (bytes from the tensor, into the message, out by SerializeToString); the
same wire bytes built here cost one. The encoding is plain protobuf (field 5
of UpdateWeightsRequest, fields 1-3 of BucketChunk), so the server - or any
other implementation - parses it with its ordinary generated code.
"""

from __future__ import annotations

import grpc

from weightsync.common import byte_passes
from weightsync.v1 import weight_sync_service_pb2 as pb

UPDATE_WEIGHTS = "/weightsync.v1.WeightSyncService/UpdateWeights"

_LENGTH_DELIMITED = 2
_VARINT = 0


def _varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"only non-negative varints are encoded here, got {value}")
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def encode_bucket_chunk(sequence: int, offset_bytes: int, data: memoryview) -> bytes:
    """`UpdateWeightsRequest(bucket_chunk=BucketChunk(...)).SerializeToString()`, copying `data` once."""
    return encode_bucket_chunk_of(sequence, offset_bytes, [data])


def encode_bucket_chunk_of(sequence: int, offset_bytes: int, parts: list[memoryview | bytes]) -> bytes:
    """The same, the chunk's data being `parts` one after another (a bucket's tensors where they lie, and the
    padding between them): each copied once, into the message."""
    size = sum(memoryview(part).nbytes for part in parts)
    inner_head = (_key(1, _VARINT) + _varint(sequence) + _key(2, _VARINT) + _varint(offset_bytes)
                  + _key(3, _LENGTH_DELIMITED) + _varint(size))
    outer_head = _key(5, _LENGTH_DELIMITED) + _varint(len(inner_head) + size)
    byte_passes.copied("trainer.encode", size)
    return b"".join((outer_head, inner_head, *parts))


def _serialize(message: pb.UpdateWeightsRequest | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def update_weights_call(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    """The UpdateWeights method, taking messages or bytes already encoded by this module."""
    return channel.stream_stream(UPDATE_WEIGHTS, request_serializer=_serialize,
                                 response_deserializer=pb.UpdateWeightsResponse.FromString,
                                 _registered_method=True)
