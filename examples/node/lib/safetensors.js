'use strict';
// A safetensors file, read without any library: an 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
// Only the header is read up front; tensor bytes are read from the file when they are sent, so a
// checkpoint larger than memory (or than a Node Buffer) can be pushed.

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

/** The safetensors format caps its header at 100 MB; anything larger is not such a file. */
const MAX_HEADER_BYTES = 100_000_000;

class SafetensorsFile {
  /**
   * Open `path` and parse its header. `tensors` are [{name, dtype, elementSize, shape, begin, end}]
   * sorted by place in the data section (begin, end: byte offsets into it).
   */
  constructor(path) {
    this.path = path;
    this.fd = fs.openSync(path, 'r');
    try {
      const size = fs.fstatSync(this.fd).size;
      const prefix = this.readExactly(Buffer.alloc(8), 0, 8, 0, 'header length');
      const headerLength = prefix.readBigUInt64LE(0);
      if (headerLength > BigInt(Math.min(MAX_HEADER_BYTES, size - 8))) {
        throw this.error(`header length ${headerLength} does not fit the file's ${size} bytes`);
      }
      const raw = this.readExactly(Buffer.alloc(Number(headerLength)), 0, Number(headerLength), 8, 'header');
      this.dataStart = 8 + Number(headerLength);
      this.dataLength = size - this.dataStart;
      this.tensors = this.parseHeader(raw);
    } catch (error) {
      fs.closeSync(this.fd);
      throw error;
    }
  }

  error(message) {
    return new Error(`${this.path}: ${message}`);
  }

  parseHeader(raw) {
    let header;
    try {
      header = JSON.parse(raw.toString('utf8'));
    } catch (error) {
      throw this.error(`the header is not JSON (${error.message})`);
    }
    if (header === null || typeof header !== 'object' || Array.isArray(header)) throw this.error('the header is not a JSON object');
    const tensors = [];
    for (const [name, entry] of Object.entries(header)) {
      if (name === '__metadata__') continue;
      tensors.push(this.parseEntry(name, entry));
    }
    // An empty tensor sorts before a tensor starting at the same offset: offsets must increase.
    tensors.sort((a, b) => a.begin - b.begin || a.end - b.end);
    for (let i = 1; i < tensors.length; i++) {
      if (tensors[i].begin < tensors[i - 1].end) {
        throw this.error(`tensors ${JSON.stringify(tensors[i - 1].name)} and ${JSON.stringify(tensors[i].name)} overlap`);
      }
    }
    return tensors;
  }

  parseEntry(name, entry) {
    const where = `tensor ${JSON.stringify(name)}`;
    if (!entry || typeof entry !== 'object') throw this.error(`${where}: not an object`);
    const known = DTYPES[entry.dtype];
    if (!known) throw this.error(`${where} has dtype ${entry.dtype}, which weightsync does not carry`);
    const [dtype, elementSize] = known;
    const { shape, data_offsets: offsets } = entry;
    const isCount = (v) => Number.isSafeInteger(v) && v >= 0;
    if (!Array.isArray(shape) || !shape.every(isCount)) throw this.error(`${where}: shape ${JSON.stringify(shape)} is not a list of sizes`);
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(isCount)) {
      throw this.error(`${where}: data_offsets ${JSON.stringify(offsets)} is not [begin, end]`);
    }
    const [begin, end] = offsets;
    const elements = shape.reduce((a, b) => a * b, 1);
    if (end - begin !== elements * elementSize || end > this.dataLength) {
      throw this.error(`${where}: offsets [${begin}, ${end}) do not match its shape and dtype, or pass the end of the file`);
    }
    return { name, dtype, elementSize, shape, begin, end };
  }

  /** Read `length` bytes at `fileOffset` into `target` at `targetOffset`; a short file is an error. */
  readExactly(target, targetOffset, length, fileOffset, what = 'data') {
    let done = 0;
    while (done < length) {
      const got = fs.readSync(this.fd, target, targetOffset + done, length - done, fileOffset + done);
      if (got === 0) throw this.error(`the file ends inside its ${what} (byte ${fileOffset + done})`);
      done += got;
    }
    return target;
  }

  /** Read data-section bytes [begin, begin + length) into `target` at `targetOffset`. */
  readData(target, targetOffset, begin, length) {
    return this.readExactly(target, targetOffset, length, this.dataStart + begin);
  }

  close() {
    fs.closeSync(this.fd);
  }
}

module.exports = { SafetensorsFile, DTYPES };
