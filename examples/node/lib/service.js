'use strict';
// The WeightSyncService client from the repo's .proto files (loaded at run time, no codegen step),
// and google.rpc.Status / ErrorInfo decoding for failures.

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

// The weightsync protos are the repo's own (this example runs from a checkout); only the
// google.rpc ones are copied here.
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
  // UpdateWeights also takes messages already encoded (a Buffer: BucketChunks from wire.js).
  const updateWeights = definition['weightsync.v1.WeightSyncService'].UpdateWeights;
  const serialize = updateWeights.requestSerialize;
  updateWeights.requestSerialize = (message) => (Buffer.isBuffer(message) ? message : serialize(message));
  return grpc.loadPackageDefinition(definition).weightsync.v1.WeightSyncService;
}

/**
 * A WeightSyncService client; TLS when `caFile` is given (`serverName` overrides the name checked);
 * the bearer token on every call. Returns {client, metadata}: pass `metadata` to every call.
 */
function connect(address, { token = '', caFile = '', serverName = '', maxReceiveBytes = 64 << 20 } = {}) {
  const Service = loadService();
  const options = {
    'grpc.max_receive_message_length': maxReceiveBytes,
    'grpc.max_send_message_length': -1, // the server's limit is what counts (ServerLimits)
  };
  if (serverName) {
    options['grpc.ssl_target_name_override'] = serverName;
    options['grpc.default_authority'] = serverName;
  }
  if (!caFile) {
    // grpc-js sends call credentials only over TLS; on plaintext the token goes as plain metadata.
    const metadata = token ? tokenMetadata(token) : new grpc.Metadata();
    return { client: new Service(address, grpc.credentials.createInsecure(), options), metadata };
  }
  let credentials = grpc.credentials.createSsl(fs.readFileSync(caFile));
  if (token) {
    const bearer = grpc.credentials.createFromMetadataGenerator((_, callback) => callback(null, tokenMetadata(token)));
    credentials = grpc.credentials.combineChannelCredentials(credentials, bearer);
  }
  return { client: new Service(address, credentials, options), metadata: new grpc.Metadata() };
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

function codeName(code) {
  return Object.keys(grpc.status).find((k) => grpc.status[k] === code) || String(code);
}

let statusTypes = null;

function loadStatusTypes() {
  if (!statusTypes) {
    const root = protobuf.loadSync([path.join(GOOGLE_PROTOS, 'google/rpc/status.proto'),
      path.join(GOOGLE_PROTOS, 'google/rpc/error_details.proto')]);
    statusTypes = { status: root.lookupType('google.rpc.Status'), errorInfo: root.lookupType('google.rpc.ErrorInfo') };
  }
  return statusTypes;
}

/**
 * {code, codeName, message, reason, domain, metadata} of a failed call: the reason and metadata
 * from the google.rpc.ErrorInfo in the google.rpc.Status of the `grpc-status-details-bin` trailer.
 */
function describeError(error) {
  const out = { code: error.code, codeName: codeName(error.code), message: error.details || error.message,
    reason: '', domain: '', metadata: {} };
  const raw = error.metadata && error.metadata.get('grpc-status-details-bin')[0];
  if (!raw) return out;
  const types = loadStatusTypes();
  const status = types.status.decode(raw);
  for (const detail of status.details || []) {
    const typeUrl = detail.type_url || detail.typeUrl;
    if (typeUrl === 'type.googleapis.com/google.rpc.ErrorInfo') {
      const info = types.errorInfo.decode(detail.value);
      Object.assign(out, { reason: info.reason, domain: info.domain, metadata: { ...info.metadata } });
    }
  }
  return out;
}

/** Whether `error` is a gRPC status (as opposed to a local failure). */
function isGrpcError(error) {
  return Boolean(error) && typeof error.code === 'number' && Boolean(error.metadata);
}

module.exports = { connect, unary, describeError, isGrpcError, codeName, grpc };
