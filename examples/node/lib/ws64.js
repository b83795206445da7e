'use strict';
// WS64, the checksum of weightsync.v1.ChecksumAlgorithm (protos/weightsync/v1/tensor.proto),
// over the raw bytes B[0..n) of a tensor or a bucket:
//   1. zero-pad B to a multiple of 8 bytes, read it as m little-endian u64 words w[0..m);
//   2. word i sits in row r = floor(i / 512), column c = i % 512;
//   3. value = n + sum_i w[i] * (r + 1) + 0x9E3779B97F4A7C15 * sum_i w[i] * (c + 1)   (mod 2^64).
//
// Two implementations, both exact:
//   ws64Reference  a straight BigInt transcription of the definition (slow: one BigInt
//                  multiply-add per word); the yardstick the fast one is tested against.
//   ws64           the same sums regrouped: value = n + sum_r (r + 1) * R_r + K * sum_c (c + 1) * C_c,
//                  where R_r is row r's word sum and C_c column c's word sum (mod 2^64).
//                  The hot loop adds the 32-bit halves of every word into float64
//                  accumulators, which stay exact below 2^53; BigInt only combines the
//                  per-row and per-column sums, modulo 2^64.

const os = require('os');

const ROW_WORDS = 512;
const COLUMN_FACTOR = 0x9e3779b97f4a7c15n;
const MASK = (1n << 64n) - 1n;
const TWO32 = 4294967296;
const LITTLE_ENDIAN = os.endianness() === 'LE';
/** Rows summed into the float64 column accumulators before they are folded into BigInt:
 * each row adds < 2^32 to a column's half, so 2^20 rows stay far below 2^53. */
const FOLD_ROWS = 1 << 20;
/** Unaligned input is copied through a scratch buffer this many rows at a time. */
const SCRATCH_ROWS = 256;

function toBytes(data) {
  if (Buffer.isBuffer(data) || data instanceof Uint8Array) return data;
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  throw new TypeError('ws64 needs a Buffer, a typed array or an ArrayBuffer');
}

/** WS64 as the definition reads, one BigInt step per word. Returns a BigInt in [0, 2^64). */
function ws64Reference(data) {
  const bytes = toBytes(data);
  const n = bytes.length;
  const words = Math.ceil(n / 8);
  let total = BigInt(n);
  for (let i = 0; i < words; i++) {
    let w = 0n;
    for (let b = 7; b >= 0; b--) {
      const at = 8 * i + b;
      w = (w << 8n) | BigInt(at < n ? bytes[at] : 0);
    }
    const r = BigInt(Math.floor(i / ROW_WORDS));
    const c = BigInt(i % ROW_WORDS);
    total = (total + w * (r + 1n) + COLUMN_FACTOR * w * (c + 1n)) & MASK;
  }
  return total;
}

/** A u64 given as two exact non-negative float64 sums of 32-bit halves, as a BigInt mod 2^64. */
function halves(lo, hi) {
  return (BigInt(lo) + (BigInt(hi) << 32n)) & MASK;
}

/** WS64 computed fast (see the top of this file). Returns a BigInt in [0, 2^64). */
function ws64(data) {
  const bytes = toBytes(data);
  if (!LITTLE_ENDIAN) return ws64Reference(bytes);
  const n = bytes.length;
  const fullWords = Math.floor(n / 8);
  const colLo = new Float64Array(ROW_WORDS);
  const colHi = new Float64Array(ROW_WORDS);
  const colTotal = new Array(ROW_WORDS).fill(0n);
  let rowTerm = 0n;
  let rowsSinceFold = 0;

  const fold = () => {
    for (let c = 0; c < ROW_WORDS; c++) {
      if (colLo[c] !== 0 || colHi[c] !== 0) {
        colTotal[c] = (colTotal[c] + halves(colLo[c], colHi[c])) & MASK;
        colLo[c] = 0;
        colHi[c] = 0;
      }
    }
    rowsSinceFold = 0;
  };

  // words [first, first + count) of the input, whose 32-bit halves are u32[2k], u32[2k + 1]
  const addWords = (u32, first, count) => {
    let k = 0;
    let word = first;
    while (k < count) {
      const row = Math.floor(word / ROW_WORDS);
      const col = word % ROW_WORDS;
      const take = Math.min(ROW_WORDS - col, count - k);
      let lo = 0;
      let hi = 0;
      for (let j = 0, p = 2 * k, c = col; j < take; j++, p += 2, c++) {
        const l = u32[p];
        const h = u32[p + 1];
        lo += l;
        hi += h;
        colLo[c] += l;
        colHi[c] += h;
      }
      rowTerm = (rowTerm + halves(lo, hi) * BigInt(row + 1)) & MASK;
      k += take;
      word += take;
      if (col + take === ROW_WORDS && ++rowsSinceFold >= FOLD_ROWS) fold();
    }
  };

  if (fullWords > 0) {
    if (bytes.byteOffset % 4 === 0) {
      addWords(new Uint32Array(bytes.buffer, bytes.byteOffset, fullWords * 2), 0, fullWords);
    } else {
      // A Uint32Array view needs 4-byte alignment: copy through an aligned scratch buffer.
      const scratch = new Uint8Array(SCRATCH_ROWS * ROW_WORDS * 8);
      const scratchWords = new Uint32Array(scratch.buffer);
      for (let first = 0; first < fullWords; first += SCRATCH_ROWS * ROW_WORDS) {
        const count = Math.min(SCRATCH_ROWS * ROW_WORDS, fullWords - first);
        scratch.set(bytes.subarray(first * 8, (first + count) * 8));
        addWords(scratchWords, first, count);
      }
    }
  }
  const tail = n - fullWords * 8;
  if (tail > 0) {
    const last = new Uint8Array(8);
    last.set(bytes.subarray(fullWords * 8));
    const u32 = new Uint32Array(last.buffer);
    addWords(u32, fullWords, 1);
  }
  fold();
  let colTerm = 0n;
  for (let c = 0; c < ROW_WORDS; c++) colTerm += colTotal[c] * BigInt(c + 1);
  return (BigInt(n) + rowTerm + COLUMN_FACTOR * (colTerm & MASK)) & MASK;
}

module.exports = { ws64, ws64Reference, ROW_WORDS, COLUMN_FACTOR, TWO32 };

// `node lib/ws64.js FILE...`: {"FILE": {"fast": "...", "reference": "..."}} as decimal strings
// (the test compares both with the Python implementation).
if (require.main === module) {
  const fs = require('fs');
  const out = {};
  for (const file of process.argv.slice(2)) {
    const raw = fs.readFileSync(file);
    // also at an odd byte offset, to take the unaligned path
    const shifted = Buffer.alloc(raw.length + 1);
    raw.copy(shifted, 1);
    out[file] = {
      fast: ws64(raw).toString(),
      fast_unaligned: ws64(shifted.subarray(1)).toString(),
      reference: ws64Reference(raw).toString(),
    };
  }
  process.stdout.write(JSON.stringify(out) + '\n');
}
