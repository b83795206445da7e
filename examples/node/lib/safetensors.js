'use strict';
// A safetensors file, read without any library: an 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.

const fs = require('fs');

/** safetensors dtype -> [weightsync.v1.Dtype name, element size in bytes]. */
const DTYPES = {
  F32: ['DTYPE_FLOAT32', 4],
  F16: ['DTYPE_FLOAT16', 2],
  BF16: ['DTYPE_BFLOAT16', 2],
  F64: ['DTYPE_FLOAT64', 8],
  F8_E4M3: ['DTYPE_FLOAT8_E4M3FN', 1],
  F8_E5M2: ['DTYPE_FLOAT8_E5M2', 1],
  I8: ['DTYPE_INT8', 1],
  U8: ['DTYPE_UINT8', 1],
  I16: ['DTYPE_INT16', 2],
  I32: ['DTYPE_INT32', 4],
  I64: ['DTYPE_INT64', 8],
  BOOL: ['DTYPE_BOOL', 1],
};

/**
 * Read `path`. Returns {data, tensors: [{name, dtype, elementSize, shape, dataOffset, data}]} sorted by
 * place in the file: `data` (top level) is the file's data section, each tensor's `data` a view of
 * its bytes (no copy) starting `dataOffset` bytes into it.
 */
function readSafetensors(path) {
  const file = fs.readFileSync(path);
  if (file.length < 8) throw new Error(`${path}: not a safetensors file (${file.length} bytes)`);
  const headerLength = Number(file.readBigUInt64LE(0));
  if (headerLength > file.length - 8) throw new Error(`${path}: header length ${headerLength} past the end of the file`);
  const header = JSON.parse(file.subarray(8, 8 + headerLength).toString('utf8'));
  const dataStart = 8 + headerLength;
  const tensors = [];
  for (const [name, entry] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const known = DTYPES[entry.dtype];
    if (!known) throw new Error(`${path}: tensor ${JSON.stringify(name)} has dtype ${entry.dtype}, which weightsync does not carry`);
    const [dtype, elementSize] = known;
    const [begin, end] = entry.data_offsets;
    const elements = entry.shape.reduce((a, b) => a * b, 1);
    if (end - begin !== elements * elementSize || dataStart + end > file.length) {
      throw new Error(`${path}: tensor ${JSON.stringify(name)}: offsets [${begin}, ${end}) do not match its shape and dtype`);
    }
    tensors.push({ name, dtype, elementSize, shape: entry.shape, dataOffset: begin,
      data: file.subarray(dataStart + begin, dataStart + end) });
  }
  tensors.sort((a, b) => a.dataOffset - b.dataOffset);
  return { data: file.subarray(dataStart), tensors };
}

module.exports = { readSafetensors, DTYPES };
