#!/usr/bin/env node
'use strict';
// A Node.js trainer for weightsync: pushes a safetensors file over INLINE and checks every tensor.
//
//   node trainer.js --server HOST:PORT --file model.safetensors --version v1 [options]
//
//   --token T                    bearer token (the server's --token-file)
//   --ca ca.pem [--server-name N]  TLS, trusting ca.pem (and checking the name N)
//   --mode staged|in_place       default staged
//   --allow-new-tensors          add tensors the store does not hold (the first push into an empty
//                                store defines it either way)
//   --bucket-bytes N             largest bucket (default 64 MiB; a larger tensor gets its own)
//   --chunk-bytes N              largest BucketChunk payload (default 4 MiB, at most the server's
//                                max_chunk_bytes)
//   --tensor-checksums           put every tensor's WS64 in the plan too (bucket WS64s always)
//   --no-checksums               send no WS64 at all (the check after commit still runs)
//   --json                       one JSON line on stdout: the summary, or {"error": ...}
//   --timeout S                  deadline of each unary call (default 60)
// Fault injection, to show what the server does:
//   --abort-after-buckets K      send K buckets, wait until they were applied, then abandon the
//                                update (STAGED only); check that the store did not change
//   --abort-by abort|cancel      abandon with an `abort` message (default) or by cancelling the call
//   --corrupt-checksum-bucket K  announce a wrong WS64 for bucket K (the server must refuse it)
//
// What it does is docs/data-plane.md, "INLINE": GetServerInfo for the limits, a plan cut from the
// file, then UpdateWeights (lib/push.js). Then GetTensorChecksums: every worker's WS64 of every
// tensor must equal its own, at the committed generation.
// Exit 0 on success (for --abort-after-buckets: abandoned, and the store unchanged); otherwise one
// line on stderr, "error: CODE REASON: message" (the reason from the status's ErrorInfo), exit 1;
// exit 2 for a wrong command line.

const { SafetensorsFile } = require('./lib/safetensors');
const { planBuckets, tensorChecksums } = require('./lib/plan');
const { push } = require('./lib/push');
const { connect, unary, describeError, isGrpcError, codeName, grpc } = require('./lib/service');

class UsageError extends Error {}

const VALUE_FLAGS = {
  '--server': 'server', '--file': 'file', '--version': 'version', '--version-label': 'version', '--token': 'token',
  '--ca': 'ca', '--server-name': 'serverName', '--mode': 'mode', '--bucket-bytes': 'bucketBytes',
  '--chunk-bytes': 'chunkBytes', '--timeout': 'timeout', '--abort-after-buckets': 'abortAfterBuckets',
  '--abort-by': 'abortBy', '--corrupt-checksum-bucket': 'corruptChecksumBucket',
};
const SWITCHES = { '--json': 'json', '--allow-new-tensors': 'allowNewTensors', '--tensor-checksums': 'tensorChecksums',
  '--no-checksums': 'noChecksums' };
const NUMBERS = ['bucketBytes', 'chunkBytes', 'timeout', 'abortAfterBuckets', 'corruptChecksumBucket'];

function parseArgs(argv) {
  const args = { mode: 'staged', bucketBytes: 64 << 20, chunkBytes: 4 << 20, timeout: 60, token: '', ca: '',
    serverName: '', version: '', abortAfterBuckets: -1, abortBy: 'abort', corruptChecksumBucket: -1 };
  for (const name of Object.values(SWITCHES)) args[name] = false;
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    if (SWITCHES[flag]) args[SWITCHES[flag]] = true;
    else if (VALUE_FLAGS[flag] && i + 1 < argv.length) args[VALUE_FLAGS[flag]] = argv[++i];
    else throw new UsageError(`unknown or incomplete argument ${flag}`);
  }
  for (const key of NUMBERS) {
    args[key] = Number(args[key]);
    const flag = Object.keys(VALUE_FLAGS).find((f) => VALUE_FLAGS[f] === key);
    if (!Number.isSafeInteger(args[key]) && key !== 'timeout') throw new UsageError(`${flag} needs an integer`);
  }
  if (!(args.timeout > 0)) throw new UsageError('--timeout needs a positive number of seconds');
  if (!args.server || !args.file || !args.version) throw new UsageError('--server, --file and --version are required');
  if (!['staged', 'in_place'].includes(args.mode)) throw new UsageError('--mode is staged or in_place');
  if (!['abort', 'cancel'].includes(args.abortBy)) throw new UsageError('--abort-by is abort or cancel');
  if (args.bucketBytes < 8) throw new UsageError('--bucket-bytes must be at least 8');
  if (args.chunkBytes < 1) throw new UsageError('--chunk-bytes must be at least 1');
  if (args.abortAfterBuckets >= 0 && args.mode !== 'staged') {
    // IN_PLACE promises no such thing: an abandoned IN_PLACE update leaves the store INCONSISTENT.
    throw new UsageError('--abort-after-buckets checks that nothing changed, which only --mode staged promises');
  }
  if (args.noChecksums && (args.tensorChecksums || args.corruptChecksumBucket >= 0)) {
    throw new UsageError('--no-checksums excludes --tensor-checksums and --corrupt-checksum-bucket');
  }
  return args;
}

/** The store's WS64 of every tensor (dtype and shape too) against our own, at `generation`; a server
 * with a --tensors subset names the tensors it does not store (not_stored), which are not checked. */
async function verify(client, metadata, args, file, sums, generation) {
  const names = file.tensors.map((t) => t.name);
  const response = await unary(client, metadata, 'GetTensorChecksums', { names }, args.timeout);
  if (Number(response.version.generation) !== generation) {
    throw new Error(`another update committed meanwhile: the store is at generation ${response.version.generation}, not ${generation}`);
  }
  const held = new Map(response.tensors.map((t) => [t.name, t]));
  const notStored = new Set(response.notStored || []);
  const checked = file.tensors.filter((t) => !notStored.has(t.name));
  const wrong = [];
  for (const tensor of checked) {
    const got = held.get(tensor.name);
    const same = got && got.dtype === tensor.dtype && got.shape.join(',') === tensor.shape.join(',')
      && got.checksum && got.checksum.value === sums.get(tensor.name).toString();
    if (!same) wrong.push(tensor.name);
  }
  if (wrong.length) throw new Error(`${wrong.length} tensors differ from the file, e.g. ${wrong[0]}`);
  return { tensorsVerified: checked.length };
}

/** What an abandoned update must not change: the published version, the store state, every checksum. */
async function snapshot(client, metadata, args) {
  const info = await unary(client, metadata, 'GetServerInfo', {}, args.timeout);
  const sums = await unary(client, metadata, 'GetTensorChecksums', { names: [] }, args.timeout);
  return { version: info.currentVersion, storeState: info.storeState, checksums: JSON.stringify(sums.tensors) };
}

async function run(args, file, client, metadata) {
  const info = await unary(client, metadata, 'GetServerInfo', {}, args.timeout);
  if (!info.transports.includes('TRANSPORT_INLINE')) throw new Error(`${args.server} does not offer INLINE`);
  const maxBucket = Number(info.limits.maxBucketBytes) || args.bucketBytes;
  const buckets = planBuckets(file.tensors, Math.min(args.bucketBytes, maxBucket));
  if (args.abortAfterBuckets > buckets.length) {
    throw new UsageError(`--abort-after-buckets ${args.abortAfterBuckets}: the plan has ${buckets.length} buckets`);
  }
  const before = args.abortAfterBuckets >= 0 ? await snapshot(client, metadata, args) : null;
  const started = process.hrtime.bigint();
  // Tensor checksums in the plan are part of the push; otherwise they are computed after it, to check.
  const planSums = args.tensorChecksums ? tensorChecksums(file, file.tensors) : null;
  const maxChunk = Number(info.limits.maxChunkBytes);
  const result = await push(client, metadata, file, buckets, {
    version: args.version, mode: args.mode, allowNewTensors: args.allowNewTensors,
    chunkBytes: maxChunk > 0 ? Math.min(args.chunkBytes, maxChunk) : args.chunkBytes,
    checksums: !args.noChecksums, tensorSums: planSums, abortAfterBuckets: args.abortAfterBuckets,
    abortBy: args.abortBy, corruptChecksumBucket: args.corruptChecksumBucket,
  });
  if (result.aborted) return abandoned(client, metadata, args, before, result);
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  const generation = Number(result.version.generation);
  const sums = planSums || tensorChecksums(file, file.tensors);
  const check = await verify(client, metadata, args, file, sums, generation);
  return { aborted: false, version: result.version.version, generation, updateId: result.updateId,
    planId: result.planId, bytes: result.bytes, tensors: file.tensors.length, buckets: buckets.length,
    chunks: result.chunks, fastPathBuckets: result.fastPathBuckets, seconds, gbps: result.bytes / seconds / 1e9,
    tensorsVerified: check.tensorsVerified };
}

/** Until the store is no longer UPDATING (WatchWeights sends the state at once, then every change).
 * A cancelled call ends on our side at once; the server finishes the abort a moment later. */
function settled(client, metadata, args) {
  return new Promise((resolve, reject) => {
    const call = client.WatchWeights({}, metadata, { deadline: Date.now() + args.timeout * 1000 });
    call.on('data', (event) => {
      if (event.storeState !== 'STORE_STATE_UPDATING') {
        resolve(event);
        call.cancel();
      }
    });
    call.on('error', (error) => {
      if (error.code !== grpc.status.CANCELLED) reject(error);
    });
  });
}

async function abandoned(client, metadata, args, before, result) {
  await settled(client, metadata, args);
  const after = await snapshot(client, metadata, args);
  const unchanged = after.version.version === before.version.version
    && after.version.generation === before.version.generation
    && after.storeState === before.storeState && after.checksums === before.checksums;
  const ended = result.error ? describeError(result.error) : { codeName: codeName(result.status.code), reason: '' };
  const summary = { aborted: true, abortBy: args.abortBy, bucketsSent: result.bucketsSent,
    bucketsApplied: result.bucketsApplied, status: ended.codeName, reason: ended.reason, unchanged,
    version: after.version.version, generation: Number(after.version.generation), storeState: after.storeState };
  if (!unchanged) throw new Error(`the abandoned STAGED update changed the store: ${JSON.stringify(summary)}`);
  return summary;
}

function report(args, summary) {
  if (args.json) console.log(JSON.stringify(summary));
  else if (summary.aborted) {
    console.log(`abandoned after ${summary.bucketsSent} buckets (${summary.status} ${summary.reason}); the server `
      + `still holds ${summary.version} (generation ${summary.generation}), unchanged`);
  } else {
    console.log(`committed ${summary.version} (generation ${summary.generation}): ${summary.tensors} tensors, `
      + `${(summary.bytes / 1e6).toFixed(1)} MB in ${summary.seconds.toFixed(3)} s (${summary.gbps.toFixed(2)} GB/s); `
      + `every tensor verified in the server's store`);
  }
}

async function main(argv) {
  const args = parseArgs(argv);
  const file = new SafetensorsFile(args.file);
  const { client, metadata } = connect(args.server, { token: args.token, caFile: args.ca, serverName: args.serverName });
  try {
    report(args, await run(args, file, client, metadata));
  } finally {
    client.close();
    file.close();
  }
}

function fail(error, json) {
  if (error instanceof UsageError) {
    process.stderr.write(`usage error: ${error.message}\n`);
    return 2;
  }
  const e = isGrpcError(error) ? describeError(error) : null;
  const line = e ? `${e.codeName} ${e.reason || '(no ErrorInfo)'}: ${e.message}` : (error && error.message) || String(error);
  if (json) {
    const detail = e ? { code: e.codeName, reason: e.reason, message: e.message, metadata: e.metadata } : { message: line };
    console.log(JSON.stringify({ error: detail }));
  }
  process.stderr.write(`error: ${line}\n`);
  return 1;
}

const argv = process.argv.slice(2);
main(argv).then(() => process.exit(0), (error) => process.exit(fail(error, argv.includes('--json'))));
