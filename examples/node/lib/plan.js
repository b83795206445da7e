'use strict';
// Buckets as docs/data-plane.md lays them out, cut straight out of the file: a safetensors data
// section already is tensors back to back, so a run of them is a valid bucket whenever each one's
// offset in the run is a multiple of its element size (writers align them). Such a bucket is read
// from the file as it is: no packing copy. A bucket closes before it would pass `bucketBytes` (a
// larger tensor gets one of its own), or where a tensor would sit misaligned (it starts the next
// bucket, at 0). A non-empty run shorter than 8 bytes is padded with zeros to 8.

const { Ws64 } = require('./ws64');

/** Bytes read from the file at a time when hashing whole tensors (a multiple of 8). */
const READ_BYTES = 8 << 20;

/**
 * tensors (sorted by begin) -> [{start, dataBytes, sizeBytes, tensors: [{tensor, offsetBytes}]}]:
 * the bucket is data-section bytes [start, start + dataBytes), zero-padded to sizeBytes.
 */
function planBuckets(tensors, bucketBytes) {
  const buckets = [];
  let current = null;
  for (const tensor of tensors) {
    const fits = current !== null && tensor.end - current.start <= bucketBytes
      && (tensor.begin - current.start) % tensor.elementSize === 0;
    if (!fits) {
      current = { start: tensor.begin, dataBytes: 0, sizeBytes: 0, tensors: [] };
      buckets.push(current);
    }
    current.tensors.push({ tensor, offsetBytes: tensor.begin - current.start });
    current.dataBytes = tensor.end - current.start;
  }
  for (const bucket of buckets) bucket.sizeBytes = bucket.dataBytes > 0 ? Math.max(8, bucket.dataBytes) : 0;
  return buckets;
}

/** WS64 of every tensor, read from the file: Map name -> BigInt. */
function tensorChecksums(file, tensors) {
  const buffer = Buffer.alloc(READ_BYTES);
  const sums = new Map();
  for (const tensor of tensors) {
    const sum = new Ws64();
    for (let at = tensor.begin; at < tensor.end; at += READ_BYTES) {
      const length = Math.min(READ_BYTES, tensor.end - at);
      file.readData(buffer, 0, at, length);
      sum.update(buffer.subarray(0, length));
    }
    sums.set(tensor.name, sum.digest());
  }
  return sums;
}

function checksum(value) {
  return { algorithm: 'CHECKSUM_ALGORITHM_WS64', value: value.toString() };
}

/** weightsync.v1.WeightPlan for these buckets; with `sums` (name -> WS64), every tensor's checksum
 * too (the workers then check each tensor; without, the bucket WS64s and the check after commit remain). */
function weightPlan(buckets, sums = null) {
  return {
    buckets: buckets.map((bucket) => ({
      sizeBytes: String(bucket.sizeBytes),
      tensors: bucket.tensors.map(({ tensor, offsetBytes }) => ({
        name: tensor.name,
        dtype: tensor.dtype,
        shape: tensor.shape.map(String),
        offsetBytes: String(offsetBytes),
        sizeBytes: String(tensor.end - tensor.begin),
        checksum: sums ? checksum(sums.get(tensor.name)) : null,
      })),
    })),
  };
}

module.exports = { planBuckets, tensorChecksums, weightPlan, checksum };
