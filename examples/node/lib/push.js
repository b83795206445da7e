'use strict';
// One INLINE update, as docs/data-plane.md ("INLINE: bytes inside the stream") spells it out:
//   begin{version, plan, mode, transport: INLINE} -> ready
//   per bucket k: bucket_start{sequence: k, size_bytes, checksum}, then bucket_chunk{sequence: k,
//     offset_bytes, data} from offset 0, each next one where the previous ended, 1 to
//     max_chunk_bytes bytes each, until the bucket is complete
//   commit -> committed
// If the server sends `aborting`, nothing more is announced (the bucket under way is finished),
// `abort` is sent, and the call's status (with its ErrorInfo) is the error.

const { UpdateStream } = require('./stream');
const { Ws64 } = require('./ws64');
const { ChunkBuffers } = require('./wire');
const { checksum, weightPlan } = require('./plan');

/**
 * A bucket's bytes, read from the file straight into encoded BucketChunk messages, and (with
 * `hash`) its WS64.
 * Yields to the event loop between chunks, so the chunks of the previous bucket keep flowing.
 */
async function readBucket(file, bucket, sequence, buffers, hash) {
  const sum = hash ? new Ws64() : null;
  const chunks = [];
  for (let offset = 0; offset < bucket.sizeBytes; offset += buffers.chunkBytes) {
    const length = Math.min(buffers.chunkBytes, bucket.sizeBytes - offset);
    const chunk = buffers.take(sequence, offset, length);
    const fromFile = Math.max(0, Math.min(length, bucket.dataBytes - offset));
    file.readData(chunk.payload, 0, bucket.start + offset, fromFile);
    chunk.payload.fill(0, fromFile); // the padding of a bucket under 8 bytes
    if (sum) sum.update(chunk.payload);
    chunks.push(chunk);
    await new Promise(setImmediate);
  }
  return { chunks, sum: sum ? sum.digest() : null };
}

/**
 * Push `buckets` of `file`. `options`: version, mode ('staged' | 'in_place'), allowNewTensors,
 * chunkBytes, checksums (bucket WS64s), tensorSums (Map name -> WS64, put in the plan, or null),
 * abortAfterBuckets (-1: never), abortBy ('abort' | 'cancel'), corruptChecksumBucket (-1: never).
 * Returns {aborted: false, ...the commit} or {aborted: true, ...how the call ended}.
 */
async function push(client, metadata, file, buckets, options) {
  const stream = new UpdateStream(client, metadata);
  try {
    return await run(stream, file, buckets, options);
  } catch (error) {
    stream.call.cancel(); // a local failure (the file, a bug) drops the call: the server aborts the update
    throw error;
  }
}

async function run(stream, file, buckets, options) {
  const started = process.hrtime.bigint();
  await stream.write({ begin: {
    version: options.version,
    plan: weightPlan(buckets, options.tensorSums),
    mode: options.mode === 'staged' ? 'UPDATE_MODE_STAGED' : 'UPDATE_MODE_IN_PLACE',
    transport: 'TRANSPORT_INLINE',
    allowNewTensors: options.allowNewTensors,
  } });
  const ready = await stream.next('ready');
  // A server started with --tensors stores a subset: a bucket with none of its tensors is announced
  // and gets no chunks (UpdateReady.not_stored_buckets).
  const notStored = new Set((ready.notStoredBuckets || []).map(String));
  const buffers = new ChunkBuffers(options.chunkBytes);
  let bytes = 0;
  let chunks = 0;
  for (let k = 0; k <= buckets.length; k++) {
    if (k === options.abortAfterBuckets) return abandon(stream, ready, k, options.abortBy);
    if (k === buckets.length) break;
    if (notStored.has(String(k))) {
      await stream.write({ bucketStart: { sequence: String(k), sizeBytes: String(buckets[k].sizeBytes) } });
      continue;
    }
    const { chunks: bucketChunks, sum } = await readBucket(file, buckets[k], k, buffers, options.checksums);
    if (stream.aborting) throw await stream.failure(); // announce nothing more
    // --corrupt-checksum-bucket: a wrong WS64, which every worker must refuse (DATA_LOSS).
    const announced = k === options.corruptChecksumBucket ? sum ^ 1n : sum;
    await stream.write({ bucketStart: { sequence: String(k), sizeBytes: String(buckets[k].sizeBytes),
      checksum: sum === null ? null : checksum(announced) } });
    for (const { message, buffer } of bucketChunks) await stream.write(message, () => buffers.release(buffer));
    bytes += buckets[k].sizeBytes;
    chunks += bucketChunks.length;
  }
  if (stream.aborting) throw await stream.failure();
  await stream.write({ commit: {} });
  const committed = await stream.next('committed');
  await stream.close();
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  return { aborted: false, updateId: ready.updateId, planId: ready.planId,
    fastPathBuckets: Number(ready.fastPathBucketCount), version: committed.version, bytes, chunks, seconds };
}

/** --abort-after-buckets: once the buckets sent so far were applied (so a STAGED update really
 * wrote its shadow copy), abandon the update. */
async function abandon(stream, ready, sent, abortBy) {
  const applied = await stream.appliedAtLeast(sent);
  if (!applied && stream.aborting) throw await stream.failure();
  if (!applied && stream.error) throw stream.error;
  const status = await stream.abandon(`node trainer: --abort-after-buckets ${sent}`, { cancel: abortBy === 'cancel' });
  return { aborted: true, updateId: ready.updateId, bucketsSent: sent, bucketsApplied: stream.applied, status,
    error: stream.error };
}

module.exports = { push, readBucket };
