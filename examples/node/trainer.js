#!/usr/bin/env node
'use strict';
// A Node.js trainer for weightsync: pushes a safetensors file over INLINE and checks every tensor.
//
//   node trainer.js --server HOST:PORT --file model.safetensors --version v1 [--mode staged|in_place]
//        [--token T] [--ca ca.pem] [--bucket-bytes N] [--allow-new-tensors] [--tensor-checksums] [--json]
//        [--abort-after-buckets K]       send K buckets, then abort; check that nothing changed
//        [--corrupt-checksum-bucket K]   announce a wrong WS64 for bucket K (the server must refuse)
//
// What it does is docs/data-plane.md, "INLINE": GetServerInfo for the limits, a plan with every
// tensor's WS64, then UpdateWeights: begin -> ready, per bucket bucket_start + chunks, commit ->
// committed. Then GetTensorChecksums: every worker's WS64 of every tensor must equal its own.
// Exit 0 on success (for --abort-after-buckets: aborted and unchanged); otherwise one line on
// stderr, "error: CODE REASON: message", and exit 1.

const { once } = require('events');
const { readSafetensors } = require('./lib/safetensors');
const { planBuckets, bucketBytes, weightPlan, checksum } = require('./lib/plan');
const { ws64 } = require('./lib/ws64');
const { connect, unary, describeError } = require('./lib/service');

function parseArgs(argv) {
  const args = { mode: 'staged', bucketBytes: 16 << 20, token: '', ca: '', version: '', json: false,
    allowNewTensors: false, tensorChecksums: false, abortAfterBuckets: -1, corruptChecksumBucket: -1 };
  const flags = { '--server': 'server', '--file': 'file', '--token': 'token', '--ca': 'ca', '--version': 'version',
    '--mode': 'mode', '--bucket-bytes': 'bucketBytes', '--abort-after-buckets': 'abortAfterBuckets',
    '--corrupt-checksum-bucket': 'corruptChecksumBucket' };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    if (flag === '--json') args.json = true;
    else if (flag === '--allow-new-tensors') args.allowNewTensors = true;
    else if (flag === '--tensor-checksums') args.tensorChecksums = true;
    else if (flags[flag] && i + 1 < argv.length) args[flags[flag]] = argv[++i];
    else throw new UsageError(`unknown or incomplete argument ${flag}`);
  }
  for (const key of ['bucketBytes', 'abortAfterBuckets', 'corruptChecksumBucket']) args[key] = Number(args[key]);
  if (!args.server || !args.file || !args.version) throw new UsageError('--server, --file and --version are required');
  if (!['staged', 'in_place'].includes(args.mode)) throw new UsageError('--mode is staged or in_place');
  if (!(args.bucketBytes >= 8)) throw new UsageError('--bucket-bytes must be at least 8');
  return args;
}

class UsageError extends Error {}

/** The UpdateWeights stream as a few awaitable steps. */
class UpdateStream {
  constructor(client, metadata) {
    this.call = client.UpdateWeights(metadata);
    this.responses = [];
    this.waiters = [];
    this.ended = new Promise((resolve) => {
      this.call.on('status', (status) => resolve(status));
    });
    this.call.on('data', (response) => {
      this.responses.push(response);
      this.wake();
    });
    this.call.on('error', (error) => {
      this.error = error;
      this.wake();
    });
    this.call.on('end', () => {
      this.finished = true;
      this.wake();
    });
  }

  wake() {
    for (const waiter of this.waiters.splice(0)) waiter();
  }

  /** Write, honouring gRPC flow control: wait for 'drain' when the buffer is full. */
  async write(message) {
    if (this.error) throw this.error;
    if (!this.call.write(message)) await Promise.race([once(this.call, 'drain'), this.ended]);
  }

  /** The next response of one of `kinds` (others, e.g. bucket_applied, are counted and skipped). */
  async next(...kinds) {
    for (;;) {
      const index = this.responses.findIndex((r) => kinds.includes(r.message));
      if (index >= 0) return this.responses.splice(index, 1)[0];
      const aborting = this.responses.find((r) => r.message === 'aborting');
      if (aborting && !kinds.includes('aborting')) {
        await this.ended;
        throw this.error || new Error(`aborted: ${aborting.aborting.reason}`);
      }
      if (this.error) throw this.error;
      if (this.finished) throw new Error(`the stream ended before ${kinds.join('/')}`);
      await new Promise((resolve) => this.waiters.push(resolve));
    }
  }
}

async function push(client, metadata, args, file, buckets, limits) {
  const maxChunk = Number(limits.maxChunkBytes) || 4 << 20;
  const stream = new UpdateStream(client, metadata);
  const started = process.hrtime.bigint();
  await stream.write({ begin: { version: args.version, plan: weightPlan(buckets, file.data, { tensorChecksums: args.tensorChecksums }), mode: args.mode === 'staged'
    ? 'UPDATE_MODE_STAGED' : 'UPDATE_MODE_IN_PLACE', transport: 'TRANSPORT_INLINE', allowNewTensors: args.allowNewTensors } });
  const ready = (await stream.next('ready')).ready;
  let sentBytes = 0;
  for (let k = 0; k < buckets.length; k++) {
    if (k === args.abortAfterBuckets) {
      await stream.write({ abort: { reason: `node trainer: --abort-after-buckets ${k}` } });
      stream.call.end();
      return { aborted: true, status: await stream.ended, updateId: ready.updateId, bucketsSent: k };
    }
    const bytes = bucketBytes(buckets[k], file.data);
    let sum = ws64(bytes);
    if (k === args.corruptChecksumBucket) sum ^= 1n;
    await stream.write({ bucketStart: { sequence: String(k), sizeBytes: String(bytes.length), checksum: checksum(sum) } });
    for (let offset = 0; offset < bytes.length; offset += maxChunk) {
      const data = bytes.subarray(offset, Math.min(offset + maxChunk, bytes.length));
      await stream.write({ bucketChunk: { sequence: String(k), offsetBytes: String(offset), data } });
    }
    sentBytes += bytes.length;
  }
  await stream.write({ commit: {} });
  const committed = (await stream.next('committed')).committed;
  stream.call.end();
  const status = await stream.ended;
  if (status.code !== 0) throw stream.error || new Error(status.details);
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  return { aborted: false, updateId: ready.updateId, version: committed.version, bytes: sentBytes, seconds };
}

/** Every worker's WS64 of every tensor against our own; returns the names that differ. */
async function verify(client, metadata, tensors) {
  const response = await unary(client, metadata, 'GetTensorChecksums', { names: [] });
  const own = new Map(tensors.map((t) => [t.name, ws64(t.data).toString()]));
  const wrong = [];
  for (const worker of response.workers) {
    const seen = new Map(worker.tensors.map((t) => [t.name, t.checksum && t.checksum.value]));
    for (const [name, value] of own) {
      if (seen.get(name) !== value) wrong.push(`worker ${worker.workerIndex}: ${name}`);
    }
  }
  return { wrong, workers: response.workers.length, version: response.version };
}

async function snapshot(client, metadata) {
  const info = await unary(client, metadata, 'GetServerInfo', {});
  const sums = await unary(client, metadata, 'GetTensorChecksums', { names: [] });
  return { version: info.currentVersion, storeState: info.storeState, checksums: JSON.stringify(sums.workers) };
}

async function main(argv) {
  const args = parseArgs(argv);
  const file = readSafetensors(args.file);
  const { tensors } = file;
  const { client, metadata } = connect(args.server, { token: args.token, caFile: args.ca });
  try {
    const info = await unary(client, metadata, 'GetServerInfo', {});
    if (!info.transports.includes('TRANSPORT_INLINE')) throw new Error(`${args.server} does not offer INLINE`);
    const buckets = planBuckets(tensors, Math.min(args.bucketBytes, Number(info.limits.maxBucketBytes) || args.bucketBytes));
    const before = args.abortAfterBuckets >= 0 ? await snapshot(client, metadata) : null;
    const result = await push(client, metadata, args, file, buckets, info.limits);
    let summary;
    if (result.aborted) {
      const after = await snapshot(client, metadata);
      const unchanged = after.version.generation === before.version.generation && after.checksums === before.checksums;
      summary = { aborted: true, bucketsSent: result.bucketsSent, status: result.status.code, unchanged,
        version: after.version.version, generation: Number(after.version.generation), storeState: after.storeState };
      if (!unchanged) throw new Error(`the aborted update changed the store: ${JSON.stringify(summary)}`);
    } else {
      const check = await verify(client, metadata, tensors);
      if (check.wrong.length) throw new Error(`${check.wrong.length} tensor checksums differ, e.g. ${check.wrong[0]}`);
      summary = { aborted: false, version: result.version.version, generation: Number(result.version.generation),
        bytes: result.bytes, tensors: tensors.length, buckets: buckets.length, seconds: result.seconds,
        gbps: result.bytes / result.seconds / 1e9, verifiedWorkers: check.workers };
    }
    if (args.json) console.log(JSON.stringify(summary));
    else if (summary.aborted) console.log(`aborted after ${summary.bucketsSent} buckets; the server still holds ${summary.version} (generation ${summary.generation}), unchanged`);
    else console.log(`committed ${summary.version} (generation ${summary.generation}): ${summary.tensors} tensors, ${(summary.bytes / 1e6).toFixed(1)} MB in ${summary.seconds.toFixed(3)} s; every tensor verified on ${summary.verifiedWorkers} workers`);
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).then(() => process.exit(0), (error) => {
  if (error instanceof UsageError) {
    process.stderr.write(`usage error: ${error.message}\n`);
    process.exit(2);
  }
  if (error && typeof error.code === 'number' && error.metadata) {
    const e = describeError(error);
    process.stderr.write(`error: ${e.codeName} ${e.reason}: ${e.message}\n`);
  } else {
    process.stderr.write(`error: ${error && error.message ? error.message : error}\n`);
  }
  process.exit(1);
});
