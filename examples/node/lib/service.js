'use strict';
// The WeightSyncService client from the repo's .proto files (loaded at run time, no codegen step),
// and google.rpc.Status / ErrorInfo decoding for failures.

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const REPO_PROTOS = path.resolve(__dirname, '..', '..', '..', 'protos');
const GOOGLE_PROTOS = path.resolve(__dirname, '..', 'protos');

const LOADER_OPTIONS = {
  keepCase: false, // camelCase field names
  longs: String, // int64 / fixed64 as decimal strings: exact beyond 2^53
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [REPO_PROTOS],
};

function loadService() {
  const definition = protoLoader.loadSync(['weightsync/v1/weight_sync_service.proto'], LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition).weightsync.v1.WeightSyncService;
}

/** A WeightSyncService client; TLS when `caFile` is given; the bearer token on every call. */
function connect(address, { token = '', caFile = '', maxMessageBytes = 64 << 20 } = {}) {
  const Service = loadService();
  let credentials = caFile
    ? grpc.credentials.createSsl(require('fs').readFileSync(caFile))
    : grpc.credentials.createInsecure();
  if (token) {
    if (!caFile) {
      // grpc-js sends call credentials only over TLS; on plaintext the token goes as metadata.
      return { client: new Service(address, credentials, channelOptions(maxMessageBytes)), metadata: tokenMetadata(token) };
    }
    const bearer = grpc.credentials.createFromMetadataGenerator((_, callback) => callback(null, tokenMetadata(token)));
    credentials = grpc.credentials.combineChannelCredentials(credentials, bearer);
  }
  return { client: new Service(address, credentials, channelOptions(maxMessageBytes)), metadata: new grpc.Metadata() };
}

function channelOptions(maxMessageBytes) {
  return { 'grpc.max_receive_message_length': maxMessageBytes, 'grpc.max_send_message_length': maxMessageBytes };
}

function tokenMetadata(token) {
  const metadata = new grpc.Metadata();
  metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

/** A unary call as a promise. */
function unary(client, metadata, method, request, deadlineSeconds = 60) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: Date.now() + deadlineSeconds * 1000 }, (error, response) =>
      error ? reject(error) : resolve(response));
  });
}

let statusTypes = null;

/** {code, codeName, message, reason, domain, metadata} of a failed call (ErrorInfo from the trailer). */
function describeError(error) {
  const codeName = Object.keys(grpc.status).find((k) => grpc.status[k] === error.code) || String(error.code);
  const out = { code: error.code, codeName, message: error.details || error.message, reason: '', domain: '', metadata: {} };
  const raw = error.metadata && error.metadata.get('grpc-status-details-bin')[0];
  if (!raw) return out;
  if (!statusTypes) {
    const root = protobuf.loadSync([path.join(GOOGLE_PROTOS, 'google/rpc/status.proto'),
      path.join(GOOGLE_PROTOS, 'google/rpc/error_details.proto')]);
    statusTypes = { status: root.lookupType('google.rpc.Status'), errorInfo: root.lookupType('google.rpc.ErrorInfo') };
  }
  const status = statusTypes.status.decode(raw);
  for (const detail of status.details || []) {
    if (detail.type_url === 'type.googleapis.com/google.rpc.ErrorInfo' || detail.typeUrl === 'type.googleapis.com/google.rpc.ErrorInfo') {
      const info = statusTypes.errorInfo.decode(detail.value);
      Object.assign(out, { reason: info.reason, domain: info.domain, metadata: { ...info.metadata } });
    }
  }
  return out;
}

module.exports = { connect, unary, describeError, grpc };
