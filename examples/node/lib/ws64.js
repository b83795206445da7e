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
//   Ws64 / ws64    the same sums regrouped: value = n + sum_r (r + 1) * R_r + K * sum_c (c + 1) * C_c,
//                  where R_r is row r's word sum and C_c column c's word sum (mod 2^64).
//                  The hot loop adds the 32-bit halves of every word into float64
//                  accumulators, which stay exact below 2^53; BigInt only combines the
//                  per-row and per-column sums, modulo 2^64. Ws64 takes the bytes in pieces
//                  of any length (a bucket read chunk by chunk, a tensor read from a file).

const os = require('os');

const ROW_WORDS = 512;
const COLUMN_FACTOR = 0x9e3779b97f4a7c15n;
const MASK = (1n << 64n) - 1n;
const LITTLE_ENDIAN = os.endianness() === 'LE';
/** Rows summed into the float64 column accumulators before they are folded into BigInt:
 * each row adds < 2^32 to a column's half, so 2^20 rows stay far below 2^53. */
const FOLD_ROWS = 1 << 20;
/** Unaligned input is copied through a scratch buffer this many words at a time. */
const SCRATCH_WORDS = 64 * ROW_WORDS;

function toBytes(data) {
  if (data instanceof Uint8Array) return data; // Buffer included
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  if (data instanceof ArrayBuffer || data instanceof SharedArrayBuffer) return new Uint8Array(data);
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

/** WS64 of bytes given in pieces: `update(bytes)` any number of times, then `digest()` once. */
class Ws64 {
  constructor() {
    this.n = 0;
    this.word = 0; // index of the next word
    this.colLo = new Float64Array(ROW_WORDS);
    this.colHi = new Float64Array(ROW_WORDS);
    this.colTotal = new Array(ROW_WORDS).fill(0n);
    this.rowsSinceFold = 0;
    this.rowTerm = 0n;
    this.rowLo = 0; // sums of the row being filled
    this.rowHi = 0;
    this.pending = new Uint8Array(8); // a word split between two updates
    this.pendingLength = 0;
    this.scratch = null;
    this.done = false;
  }

  update(data) {
    if (this.done) throw new Error('Ws64.update after digest');
    let bytes = toBytes(data);
    this.n += bytes.length;
    if (!LITTLE_ENDIAN) {
      this.bigEndianBytes = this.bigEndianBytes || [];
      this.bigEndianBytes.push(Buffer.from(bytes));
      return this;
    }
    if (this.pendingLength > 0) {
      const take = Math.min(8 - this.pendingLength, bytes.length);
      this.pending.set(bytes.subarray(0, take), this.pendingLength);
      this.pendingLength += take;
      bytes = bytes.subarray(take);
      if (this.pendingLength < 8) return this;
      this.addWords(new Uint32Array(this.pending.buffer), 1);
      this.pendingLength = 0;
    }
    const words = Math.floor(bytes.length / 8);
    if (words > 0) {
      if (bytes.byteOffset % 4 === 0) {
        this.addWords(new Uint32Array(bytes.buffer, bytes.byteOffset, words * 2), words);
      } else {
        // A Uint32Array view needs 4-byte alignment: copy through an aligned scratch buffer.
        this.scratch = this.scratch || new Uint8Array(SCRATCH_WORDS * 8);
        const scratchWords = new Uint32Array(this.scratch.buffer);
        for (let first = 0; first < words; first += SCRATCH_WORDS) {
          const count = Math.min(SCRATCH_WORDS, words - first);
          this.scratch.set(bytes.subarray(first * 8, (first + count) * 8));
          this.addWords(scratchWords, count);
        }
      }
    }
    const tail = bytes.length - words * 8;
    if (tail > 0) {
      this.pending.set(bytes.subarray(words * 8));
      this.pendingLength = tail;
    }
    return this;
  }

  /** The value, a BigInt in [0, 2^64). Ends this accumulator. */
  digest() {
    if (this.done) throw new Error('Ws64.digest twice');
    this.done = true;
    if (!LITTLE_ENDIAN) return ws64Reference(Buffer.concat(this.bigEndianBytes || []));
    if (this.pendingLength > 0) {
      this.pending.fill(0, this.pendingLength);
      this.addWords(new Uint32Array(this.pending.buffer), 1);
    }
    if (this.word % ROW_WORDS !== 0) this.endRow(Math.floor(this.word / ROW_WORDS));
    this.fold();
    let colTerm = 0n;
    for (let c = 0; c < ROW_WORDS; c++) colTerm += this.colTotal[c] * BigInt(c + 1);
    return (BigInt(this.n) + this.rowTerm + COLUMN_FACTOR * (colTerm & MASK)) & MASK;
  }

  endRow(row) {
    this.rowTerm = (this.rowTerm + halves(this.rowLo, this.rowHi) * BigInt(row + 1)) & MASK;
    this.rowLo = 0;
    this.rowHi = 0;
    if (++this.rowsSinceFold >= FOLD_ROWS) this.fold();
  }

  fold() {
    const { colLo, colHi, colTotal } = this;
    for (let c = 0; c < ROW_WORDS; c++) {
      if (colLo[c] !== 0 || colHi[c] !== 0) {
        colTotal[c] = (colTotal[c] + halves(colLo[c], colHi[c])) & MASK;
        colLo[c] = 0;
        colHi[c] = 0;
      }
    }
    this.rowsSinceFold = 0;
  }

  /** `count` words whose 32-bit halves are u32[2k], u32[2k + 1]. */
  addWords(u32, count) {
    const { colLo, colHi } = this;
    let k = 0;
    while (k < count) {
      const col = this.word % ROW_WORDS;
      if (col === 0 && count - k >= 4 * ROW_WORDS && this.rowsSinceFold + 4 <= FOLD_ROWS) {
        k += this.addFourRows(u32, 2 * k);
        continue;
      }
      const take = Math.min(ROW_WORDS - col, count - k);
      let lo = this.rowLo;
      let hi = this.rowHi;
      for (let j = 0, p = 2 * k, c = col; j < take; j++, p += 2, c++) {
        const l = u32[p];
        const h = u32[p + 1];
        lo += l;
        hi += h;
        colLo[c] += l;
        colHi[c] += h;
      }
      this.rowLo = lo;
      this.rowHi = hi;
      k += take;
      this.word += take;
      if (col + take === ROW_WORDS) this.endRow(Math.floor(this.word / ROW_WORDS) - 1);
    }
  }

  /** Four whole rows at u32[p...]: one pass over the columns, four rows at a time, which halves
   * the loads and stores of the column accumulators (the hot loop's cost). Returns the words taken. */
  addFourRows(u32, p0) {
    const { colLo, colHi } = this;
    const R = 2 * ROW_WORDS;
    let l0 = 0, l1 = 0, l2 = 0, l3 = 0, h0 = 0, h1 = 0, h2 = 0, h3 = 0;
    for (let c = 0, p = p0; c < ROW_WORDS; c++, p += 2) {
      const a0 = u32[p], a1 = u32[p + R], a2 = u32[p + 2 * R], a3 = u32[p + 3 * R];
      const b0 = u32[p + 1], b1 = u32[p + 1 + R], b2 = u32[p + 1 + 2 * R], b3 = u32[p + 1 + 3 * R];
      l0 += a0; l1 += a1; l2 += a2; l3 += a3;
      h0 += b0; h1 += b1; h2 += b2; h3 += b3;
      colLo[c] += a0 + a1 + a2 + a3;
      colHi[c] += b0 + b1 + b2 + b3;
    }
    const row = this.word / ROW_WORDS;
    for (const [lo, hi, r] of [[l0, h0, row], [l1, h1, row + 1], [l2, h2, row + 2], [l3, h3, row + 3]]) {
      this.rowTerm = (this.rowTerm + halves(lo, hi) * BigInt(r + 1)) & MASK;
    }
    this.word += 4 * ROW_WORDS;
    this.rowsSinceFold += 4;
    return 4 * ROW_WORDS;
  }
}

/** WS64 of one buffer. Returns a BigInt in [0, 2^64). */
function ws64(data) {
  return new Ws64().update(data).digest();
}

module.exports = { ws64, ws64Reference, Ws64, ROW_WORDS, COLUMN_FACTOR };

// `node lib/ws64.js FILE...`: {"FILE": {"fast": ..., "fast_unaligned": ..., "pieces": ..., "reference": ...}}
// as decimal strings (the test compares each with the Python implementation).
if (require.main === module) {
  const fs = require('fs');
  const out = {};
  for (const file of process.argv.slice(2)) {
    const raw = fs.readFileSync(file);
    // also at an odd byte offset, to take the unaligned path
    const shifted = Buffer.alloc(raw.length + 1);
    raw.copy(shifted, 1);
    // and in uneven pieces: words split between updates, rows split between updates
    const pieces = new Ws64();
    for (let at = 0, step = 1; at < raw.length; at += step, step = (step * 7 + 3) % 20011 + 1) {
      pieces.update(raw.subarray(at, at + step));
    }
    out[file] = {
      fast: ws64(raw).toString(),
      fast_unaligned: ws64(shifted.subarray(1)).toString(),
      pieces: pieces.digest().toString(),
      reference: ws64Reference(raw).toString(),
    };
  }
  process.stdout.write(JSON.stringify(out) + '\n');
}
