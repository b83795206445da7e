"""The SDK's hand-encoded BucketChunk must be byte-for-byte what protobuf would send."""

import os
import random

import pytest

from weightsync.client.channels.wire import encode_bucket_chunk
from weightsync.server.intake.wire import ChunkRequest, parse_update_request
from weightsync.v1 import weight_sync_service_pb2 as pb


@pytest.mark.parametrize("sequence, offset, size", [
    (0, 0, 1), (1, 0, 127), (7, 128, 128), (300, 2**31 + 5, 4096), (2**40, 2**62, 16_385),
])
def test_encoded_chunk_equals_protobuf_serialization(sequence: int, offset: int, size: int) -> None:
    data = os.urandom(size)
    expected = pb.UpdateWeightsRequest(bucket_chunk=pb.BucketChunk(
        sequence=sequence, offset_bytes=offset, data=data)).SerializeToString()
    # Generated code omits zero-valued fields; the hand encoding always writes them, which parses the same.
    encoded = encode_bucket_chunk(sequence, offset, memoryview(data))
    parsed = pb.UpdateWeightsRequest.FromString(encoded)
    assert parsed.WhichOneof("message") == "bucket_chunk"
    assert (parsed.bucket_chunk.sequence, parsed.bucket_chunk.offset_bytes) == (sequence, offset)
    assert parsed.bucket_chunk.data == data
    if sequence and offset:
        assert encoded == expected


def test_encoded_chunk_takes_a_slice_of_a_larger_buffer() -> None:
    whole = bytes(range(256)) * 4
    encoded = encode_bucket_chunk(3, 512, memoryview(whole)[512:700])
    assert pb.UpdateWeightsRequest.FromString(encoded).bucket_chunk.data == whole[512:700]


def test_negative_values_are_refused() -> None:
    with pytest.raises(ValueError):
        encode_bucket_chunk(-1, 0, memoryview(b"x"))


# -- the server's parser -------------------------------------------------------------------
def _fields(message) -> tuple:
    """What update_intake reads from a parsed request, whichever parser made it."""
    kind = message.WhichOneof("message")
    if kind != "bucket_chunk":
        return (kind, message.SerializeToString())
    chunk = message.bucket_chunk
    return (kind, chunk.sequence, chunk.offset_bytes, bytes(chunk.data))


def _both(raw: bytes):
    """(fast result or exception type, generated result or exception type)."""
    def attempt(parse):
        try:
            return _fields(parse(raw))
        except Exception as error:  # noqa: BLE001 - compared, not handled
            return type(error)
    return attempt(parse_update_request), attempt(pb.UpdateWeightsRequest.FromString)


def test_common_chunks_are_read_without_the_generated_parser() -> None:
    raw = encode_bucket_chunk(4, 1 << 20, memoryview(b"abc" * 1000))
    parsed = parse_update_request(raw)
    assert isinstance(parsed, ChunkRequest)
    assert isinstance(parsed.bucket_chunk.data, memoryview)
    assert _fields(parsed) == ("bucket_chunk", 4, 1 << 20, b"abc" * 1000)
    # Generated code's own encoding (zero fields omitted) takes the fast path too.
    generated = pb.UpdateWeightsRequest(bucket_chunk=pb.BucketChunk(data=b"xy")).SerializeToString()
    assert isinstance(parse_update_request(generated), ChunkRequest)
    assert _fields(parse_update_request(generated)) == ("bucket_chunk", 0, 0, b"xy")


@pytest.mark.parametrize("message", [
    pb.UpdateWeightsRequest(begin=pb.BeginUpdate(group_id="g", version="v")),
    pb.UpdateWeightsRequest(bucket_start=pb.BucketStart(sequence=2, size_bytes=10)),
    pb.UpdateWeightsRequest(commit=pb.CommitUpdate()),
    pb.UpdateWeightsRequest(bucket_chunk=pb.BucketChunk(sequence=-1, offset_bytes=-5, data=b"z")),
    pb.UpdateWeightsRequest(),
])
def test_other_messages_parse_as_protobuf_does(message) -> None:
    fast, generated = _both(message.SerializeToString())
    assert fast == generated == _fields(message)


def test_unusual_encodings_match_the_generated_parser() -> None:
    chunk = encode_bucket_chunk(9, 64, memoryview(b"payload"))
    inner = chunk[2:]
    cases = [
        chunk + b"\x08\x01",                                   # a second field after the chunk
        b"\x2a" + bytes([len(inner) + 2]) + inner + b"\x1a\x00",  # data repeated: the last one wins
        b"\x2a" + bytes([len(inner) + 2]) + inner + b"\x20\x07",  # an unknown field inside the chunk
        b"\x2a" + bytes([len(inner) | 0x80, 0x00]) + inner,       # a non-minimal length
        chunk[:-1],                                            # truncated
        chunk[:3],
        b"\x2a",
        b"\x2a\x05\x08\x01\x1a\x09ab",                         # data longer than the message
        b"\x2a\x0b" + b"\x08" + b"\xff" * 9 + b"\x01",           # a 10-byte (negative) varint
    ]
    for raw in cases:
        fast, generated = _both(raw)
        assert fast == generated, raw


def test_random_damage_never_parses_differently() -> None:
    rng = random.Random(7)
    base = encode_bucket_chunk(5, 300, memoryview(bytes(range(40))))
    for _ in range(3000):
        raw = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            op = rng.random()
            if op < 0.6 and raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            elif op < 0.8 and raw:
                del raw[rng.randrange(len(raw)) :]
            else:
                raw.insert(rng.randrange(len(raw) + 1), rng.randrange(256))
        fast, generated = _both(bytes(raw))
        assert fast == generated, bytes(raw)
