'use strict';
// Buckets as docs/data-plane.md lays them out, cut straight out of the file: a safetensors data
// section already is tensors back to back, so a run of them is a valid bucket whenever each one's
// offset in the run is a multiple of its element size (writers align them). Such a bucket is a view
// of the file: no packing copy. A bucket closes before it would pass `bucketBytes` (a larger tensor
// gets one of its own), or where a tensor would sit misaligned (it starts the next bucket, at 0).
// A non-empty bucket shorter than 8 bytes is padded, which takes a copy.

const { ws64 } = require('./ws64');

/**
 * tensors (sorted by dataOffset) -> [{start, sizeBytes, tensors: [{tensor, offsetBytes}]}], where
 * `start` is the bucket's first byte in the data section.
 */
function planBuckets(tensors, bucketBytes) {
  const buckets = [];
  let current = null;
  for (const tensor of tensors) {
    const end = tensor.dataOffset + tensor.data.length;
    const fits = current !== null && end - current.start <= bucketBytes
      && (tensor.dataOffset - current.start) % tensor.elementSize === 0;
    if (!fits) {
      current = { start: tensor.dataOffset, sizeBytes: 0, tensors: [] };
      buckets.push(current);
    }
    current.tensors.push({ tensor, offsetBytes: tensor.dataOffset - current.start });
    current.sizeBytes = end - current.start;
  }
  return buckets;
}

/** The bucket's bytes: a view of the data section, or a padded copy for a bucket under 8 bytes. */
function bucketBytes(bucket, data) {
  const view = data.subarray(bucket.start, bucket.start + bucket.sizeBytes);
  if (bucket.sizeBytes === 0 || bucket.sizeBytes >= 8) return view;
  const padded = Buffer.alloc(8);
  view.copy(padded);
  return padded;
}

function checksum(value) {
  return { algorithm: 'CHECKSUM_ALGORITHM_WS64', value: value.toString() };
}

/** weightsync.v1.WeightPlan for these buckets; with tensorChecksums, every tensor's WS64 too (the
 * workers then check each tensor; without, the bucket WS64s and the check after commit remain). */
function weightPlan(buckets, data, { tensorChecksums = false } = {}) {
  return {
    buckets: buckets.map((bucket) => ({
      sizeBytes: String(bucketBytes(bucket, data).length),
      tensors: bucket.tensors.map(({ tensor, offsetBytes }) => ({
        name: tensor.name,
        dtype: tensor.dtype,
        shape: tensor.shape.map(String),
        offsetBytes: String(offsetBytes),
        sizeBytes: String(tensor.data.length),
        checksum: tensorChecksums ? checksum(ws64(tensor.data)) : null,
      })),
    })),
  };
}

module.exports = { planBuckets, bucketBytes, weightPlan, checksum };
