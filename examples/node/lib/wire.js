'use strict';
// BucketChunk messages encoded by hand, with the file's bytes read straight into them.
//
// An UpdateWeightsRequest{bucket_chunk: BucketChunk{sequence, offset_bytes, data}} is a few bytes of
// protobuf framing and then `data` verbatim. Built with protobufjs, `data` is copied into the
// message; built here, the message buffer is allocated first and the file is read into its tail, so
// the bytes are copied once fewer. The encoding is plain protobuf (field 5 of UpdateWeightsRequest,
// fields 1-3 of BucketChunk): the server parses it with its ordinary generated code.

const LENGTH_DELIMITED = 2;
const VARINT = 0;
/** Room before the payload for the framing (at most 34 bytes); a multiple of 8 so the payload
 * stays 8-byte aligned for WS64's word view. */
const HEAD_ROOM = 40;

/** Protobuf varint of a non-negative safe integer (plain arithmetic: it may pass 2^32). */
function varint(value) {
  if (!Number.isSafeInteger(value) || value < 0) throw new RangeError(`varint of ${value}`);
  const out = [];
  while (value >= 0x80) {
    out.push((value % 0x80) | 0x80);
    value = Math.floor(value / 0x80);
  }
  out.push(value);
  return out;
}

function key(field, wireType) {
  return varint(field * 8 + wireType);
}

/** The framing before `length` data bytes of bucket `sequence` at `offset`. */
function chunkHead(sequence, offset, length) {
  const inner = [...key(1, VARINT), ...varint(sequence), ...key(2, VARINT), ...varint(offset),
    ...key(3, LENGTH_DELIMITED), ...varint(length)];
  return Buffer.from([...key(5, LENGTH_DELIMITED), ...varint(inner.length + length), ...inner]);
}

/**
 * Encoded BucketChunk messages in reused buffers. A fresh multi-megabyte buffer per chunk costs
 * page faults and garbage collection comparable to the copy itself. The buffer is free again once
 * the message's write callback ran: grpc-js copies a message into its length-prefixed framing
 * (the compression filter of its ResolvingCall) before the message reaches the retry layer, which
 * may run the callback before the bytes are on the wire, but only ever holds that copy.
 */
class ChunkBuffers {
  constructor(chunkBytes) {
    this.chunkBytes = chunkBytes;
    this.free = [];
  }

  /**
   * An encoded UpdateWeightsRequest carrying `length` (<= chunkBytes) bytes of bucket `sequence` at
   * `offset`: {message, payload, buffer}, where `payload` is the (uninitialized) data part of
   * `message` to fill. Hand `buffer` back with release() once the message was written.
   */
  take(sequence, offset, length) {
    if (length > this.chunkBytes) throw new RangeError(`a chunk of ${length} bytes in buffers of ${this.chunkBytes}`);
    const head = chunkHead(sequence, offset, length);
    // Unpooled by Node: its own ArrayBuffer, so the payload's alignment is HEAD_ROOM's.
    const buffer = this.free.pop() || Buffer.allocUnsafeSlow(HEAD_ROOM + this.chunkBytes);
    head.copy(buffer, HEAD_ROOM - head.length);
    return { message: buffer.subarray(HEAD_ROOM - head.length, HEAD_ROOM + length),
      payload: buffer.subarray(HEAD_ROOM, HEAD_ROOM + length), buffer };
  }

  release(buffer) {
    this.free.push(buffer);
  }
}

module.exports = { ChunkBuffers, chunkHead, varint };
