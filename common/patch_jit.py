"""The trainer's numba kernels behind common.patch_kernels (PATCH_XOR, see common.patch_format);
the receiver's are in common.patch_jit_check.

Every kernel works on raw bits through unsigned arrays of the element's width (uint8/16/32/64),
so one kernel per width covers every dtype. numba types uint64 mixed with int64 as float64:
every WS64 quantity here is uint64 on both sides. The kernels release the GIL (nogil) and write
only the output ranges they are given, so callers may run them on threads side by side.
Status codes (returned, not raised: the caller builds the error): 0 ok, then see patch_kernels.
"""

from __future__ import annotations

import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

from weightsync.common.numba_cache import cached_njit

C = np.uint64(0x9E3779B97F4A7C15)  # checksum.COLUMN_FACTOR
U0, U1, U3, U7, U8, U9, U255, U511 = (np.uint64(v) for v in (0, 1, 3, 7, 8, 9, 255, 511))
ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
OK, MALFORMED, OUT_OF_RANGE, COUNT_MISMATCH = 0, 1, 2, 3


@cached_njit(nogil=True, inline="always")
def _ws64_change(position, itemsize, old, new):
    """WS64(after) - WS64(before) for one element: its word's weight times the word's change."""
    offset = np.uint64(position) * np.uint64(itemsize)
    word = offset >> U3
    weight = ((word >> U9) + U1) + C * ((word & U511) + U1)
    return weight * ((np.uint64(new) - np.uint64(old)) << ((offset & U7) * U8))


CHUNK = 8192
"""scan's unit, in words (or elements off the fast path): 64 KiB of each input, still in cache
when its changes are emitted; the buffers get room for a chunk's worst case before it, so the
hot loops check nothing but the data."""
BRANCHLESS_ABOVE = 1 / 200
"""Find a chunk's changed words without a branch when more than this fraction of the last
chunk's changed: a branch per changed word mispredicts (~5 ns each), a branchless pass costs
~0.6 ns per word whatever changed. Measured on one 128 MB bf16 tensor, one-ulp changes, one
thread: equal at 0.1% of the elements changed (0.4% of the words: branchy), 18% faster at 1%
than with the branch (15.2 against 18.5 ms; the threshold was 1/16 of the words), the same from
2% up (branchless either way)."""


@cached_njit(nogil=True)
def _changed(a, b, lo, hi, found, branchless):
    """Indices t in lo..hi where a[t] != b[t] into found; how many. Plain loops: LLVM makes them
    ~40 GB/s on one core (blocked "any change in this line?" loops measured 3-5x slower)."""
    x, y = a[lo:hi], b[lo:hi]
    count = 0
    if branchless:
        for t in range(x.size):
            found[count] = lo + t
            count += x[t] != y[t]
    else:
        for t in range(x.size):
            if x[t] != y[t]:
                found[count] = lo + t
                count += 1
    return count


@cached_njit(nogil=True, inline="always")
def _put_gap(varints, used, gap):
    """One gap's varint at varints[used:]; returns the new used. Gaps below 2^14 (all but a few
    per tensor at >= 0.1% changed) without a data-dependent branch."""
    if gap < 16384:
        long = gap >= 128
        varints[used] = (gap & 127) | (long << 7)
        varints[used + 1] = gap >> 7
        return used + 1 + long
    while gap >= 128:
        varints[used] = (gap & 127) | 128
        gap >>= 7
        used += 1
    varints[used] = gap
    return used + 1


@cached_njit(nogil=True)
def _emit_words(a64, b64, found, m, xors, varints, state, itemsize, advance):
    """Record the changes in the m changed words listed in found: XOR values, gap varints, the
    WS64 delta; advance: and write each changed word of b into a (the base becomes b, its other
    words being b's already). (A copy per itemsize with constant shifts measured ~3% faster and
    4 s more of cold compile: not worth it.)
    state = [count, varint bytes used, first position, previous position], in and out."""
    lanes = 8 // itemsize
    lane_bits = 8 * itemsize
    lane_log = 3 + (itemsize > 1) + (itemsize > 2) + (itemsize > 4)
    element = ALL_ONES if itemsize == 8 else (U1 << np.uint64(lane_bits)) - U1
    count, used, first, previous = state[0], state[1], state[2], state[3]
    delta = U0
    for k in range(m):
        t = found[k]
        old, new = a64[t], b64[t]
        weight = ((np.uint64(t) >> U9) + U1) + C * ((np.uint64(t) & U511) + U1)
        delta += weight * (new - old)
        if advance:
            a64[t] = new  # its cache line was just read: a write here costs a write-back, no pass
        x = old ^ new
        while x:
            lane = np.int64(trailing_zeros(x)) >> lane_log
            shift = np.uint64(lane * lane_bits)
            value = (x >> shift) & element
            x ^= value << shift
            position = t * lanes + lane
            xors[count] = value
            if count == 0:
                first = position
            else:
                used = _put_gap(varints, used, position - previous - 1)
            previous = position
            count += 1
    state[0], state[1], state[2], state[3] = count, used, first, previous
    return delta


@cached_njit(nogil=True)
def _emit_elements(a, b, found, m, xors, varints, state, advance):
    """_emit_words for the changed elements listed in found (off the aligned fast path)."""
    itemsize = a.itemsize
    count, used, first, previous = state[0], state[1], state[2], state[3]
    delta = U0
    for k in range(m):
        t = found[k]
        delta += _ws64_change(t, itemsize, a[t], b[t])
        xors[count] = a[t] ^ b[t]
        if advance:
            a[t] = b[t]
        if count == 0:
            first = t
        else:
            used = _put_gap(varints, used, t - previous - 1)
        previous = t
        count += 1
    state[0], state[1], state[2], state[3] = count, used, first, previous
    return delta


@cached_njit(nogil=True)
def _plane_nonzero(xors, count, nonzero):
    """Nonzero bytes per plane of xors[:count], a pass of its own (counting inside the emit loop
    made a store-to-load chain through memory per change)."""
    for j in range(xors.itemsize):
        shift = 8 * j
        ones = 0
        for k in range(count):
            ones += ((xors[k] >> shift) & 255) != 0
        nonzero[j] = ones


@cached_njit(nogil=True)
def _grow(xors, varints, state, elements):
    """Room for `elements` more changes (doubling)."""
    while state[0] + elements > xors.size:
        grown = np.empty(xors.size * 2, xors.dtype)
        grown[: state[0]] = xors[: state[0]]
        xors = grown
    while state[1] + 10 * elements > varints.size:
        longer = np.empty(varints.size * 2, np.uint8)
        longer[: state[1]] = varints[: state[1]]
        varints = longer
    return xors, varints


@cached_njit(nogil=True)
def scan(a, b, a64, b64, start, stop, capacity, advance):
    """Compare a[start:stop] with b[start:stop] in one pass, chunk by chunk; advance: and make
    a[start:stop] equal to b[start:stop] in the same pass (only the changed words are written).

    a64, b64: a and b as 64-bit words when both are 8-byte aligned (then start is a multiple
    of 8 elements), else empty (element by element). Returns (count, first position, last
    position, gap varints after the first (bytes, used), XOR values, nonzero bytes per plane,
    WS64 delta). The first gap depends on the previous range: the caller writes it."""
    lanes = 8 // a.itemsize
    xors = np.empty(max(capacity, 16), a.dtype)
    varints = np.empty(max(2 * capacity, 160), np.uint8)
    nonzero = np.zeros(8, np.int64)
    state = np.array([0, 0, -1, -1], np.int64)
    found = np.empty(CHUNK, np.int64)
    delta = U0
    branchless = False
    elements_from = start
    if a64.size:
        elements_from = start + (stop - start) // lanes * lanes
        for lo in range(start // lanes, elements_from // lanes, CHUNK):
            hi = min(lo + CHUNK, elements_from // lanes)
            xors, varints = _grow(xors, varints, state, (hi - lo) * lanes)
            m = _changed(a64, b64, lo, hi, found, branchless)
            branchless = m > BRANCHLESS_ABOVE * (hi - lo)
            delta += _emit_words(a64, b64, found, m, xors, varints, state, a.itemsize, advance)
    for lo in range(elements_from, stop, CHUNK):
        hi = min(lo + CHUNK, stop)
        xors, varints = _grow(xors, varints, state, hi - lo)
        m = _changed(a, b, lo, hi, found, branchless)
        branchless = m > BRANCHLESS_ABOVE * (hi - lo)
        delta += _emit_elements(a, b, found, m, xors, varints, state, advance)
    _plane_nonzero(xors, state[0], nonzero)
    return state[0], state[2], state[3], varints, state[1], xors, nonzero, delta


@cached_njit(nogil=True)
def _put_varint(out, at, value):
    while value >= 128:
        out[at] = (value & 127) | 128
        value >>= 7
        at += 1
    out[at] = value
    return at + 1


@cached_njit(nogil=True)
def varint_size(value):
    size = 1
    while value >= 128:
        value >>= 7
        size += 1
    return size


@cached_njit(nogil=True)
def emit(out, start, stop, count, first, varints, used, xors, first_gap, bitmask_at, index_at,
         plane_kinds, plane_at, bit_start, sparse_at, heads):
    """Write one range's share of the patch: its index bytes (gap varints at index_at, or its
    bitmask bytes when bitmask_at >= 0) and its XOR bytes in each plane (DENSE: at plane_at[j] +
    bit_start; SPARSE: bitmap at plane_at[j], bits from bit_start, bytes at sparse_at[j]).
    A sparse bitmap byte this range shares with the previous one is left to the caller: its bits
    go to heads[j] (OR them in once every range is done)."""
    itemsize = xors.itemsize
    if bitmask_at >= 0:
        out[bitmask_at + (start >> 3): bitmask_at + ((stop + 7) >> 3)] = 0
        position = first
        at = 0
        for k in range(count):
            if k:
                gap = 0
                shift = 0
                while True:
                    byte = varints[at]
                    at += 1
                    gap |= (byte & 127) << shift
                    shift += 7
                    if byte < 128:
                        break
                position += gap + 1
            out[bitmask_at + (position >> 3)] |= np.uint8(1 << (position & 7))
    elif count:
        at = _put_varint(out, index_at, first_gap)
        out[at: at + used] = varints[:used]
    for j in range(itemsize):
        kind = plane_kinds[j]
        shift = np.uint64(8 * j)
        if kind == 1:
            base = plane_at[j] + bit_start
            for k in range(count):
                out[base + k] = (np.uint64(xors[k]) >> shift) & U255
        elif kind == 2:
            bitmap = plane_at[j]
            owned = (bit_start + 7) & ~7  # first bit of the first byte this range owns
            head = 0
            byte = 0
            cursor = sparse_at[j]
            for k in range(count):
                value = (np.uint64(xors[k]) >> shift) & U255
                bit = bit_start + k
                flag = 1 if value else 0
                if flag:
                    out[cursor] = value
                    cursor += 1
                if bit < owned:
                    head |= flag << (bit & 7)
                else:
                    byte |= flag << (bit & 7)
                    if bit & 7 == 7:
                        out[bitmap + (bit >> 3)] = byte
                        byte = 0
            last = bit_start + count - 1
            if count and last >= owned and last & 7 != 7:
                out[bitmap + (last >> 3)] = byte
            heads[j] = head


@cached_njit(nogil=True)
def count_changed(a, b, blocks, stride, run):
    """How many of the sampled elements (common.patches.SampleLayout: `run` at every `stride`-th,
    `blocks` times) differ between a and b by bits."""
    changed = 0
    for k in range(blocks):
        start = k * stride
        for j in range(start, start + run):
            changed += a[j] != b[j]
    return changed


@cached_njit(nogil=True)
def resample(a, blocks, stride, run, old, fresh):
    """fresh = the sampled elements of a, in order (as count_changed reads them); how many of them
    differ from old by bits."""
    changed = 0
    at = 0
    for k in range(blocks):
        start = k * stride
        for j in range(start, start + run):
            value = a[j]
            changed += value != old[at]
            fresh[at] = value
            at += 1
    return changed
