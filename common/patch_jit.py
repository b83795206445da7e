"""The numba kernels behind common.patch_kernels (PATCH_XOR, see common.patch_format).

Every kernel works on raw bits through unsigned arrays of the element's width (uint8/16/32/64),
so one kernel per width covers every dtype. numba types uint64 mixed with int64 as float64:
every WS64 quantity here is uint64 on both sides. The kernels release the GIL (nogil) and write
only the output ranges they are given, so callers may run them on threads side by side.
Status codes (returned, not raised: the caller builds the error): 0 ok, then see patch_kernels.
"""

from __future__ import annotations

import numpy as np
from numba import njit

C = np.uint64(0x9E3779B97F4A7C15)  # checksum.COLUMN_FACTOR
U0, U1, U3, U7, U8, U9, U255, U511 = (np.uint64(v) for v in (0, 1, 3, 7, 8, 9, 255, 511))
OK, MALFORMED, OUT_OF_RANGE, COUNT_MISMATCH = 0, 1, 2, 3
BLOCK_BYTES = 64  # one cache line of each input per "anything changed?" test


@njit(nogil=True, cache=True, inline="always")
def _ws64_change(position, itemsize, old, new):
    """WS64(after) - WS64(before) for one element: its word's weight times the word's change."""
    offset = np.uint64(position) * np.uint64(itemsize)
    word = offset >> U3
    weight = ((word >> U9) + U1) + C * ((word & U511) + U1)
    return weight * ((np.uint64(new) - np.uint64(old)) << ((offset & U7) * U8))


@njit(nogil=True, cache=True)
def scan(a, b, start, stop, capacity):
    """Compare a[start:stop] with b[start:stop] (one pass, a cache line of each at a time).

    Returns (count, first position, last position, gap varints after the first (bytes, used),
    XOR values, nonzero bytes per plane, WS64 delta). The first gap depends on the previous
    range, so the caller writes it."""
    itemsize = a.itemsize
    step = BLOCK_BYTES // itemsize
    varints = np.empty(max(capacity * 2, 64), np.uint8)
    xors = np.empty(max(capacity, 16), a.dtype)
    nonzero = np.zeros(8, np.int64)
    used = 0
    count = 0
    first = -1
    previous = -1
    delta = U0
    i = start
    while i < stop:
        end = min(i + step, stop)
        any_changed = a[i] ^ b[i]
        for t in range(i + 1, end):
            any_changed |= a[t] ^ b[t]
        if any_changed != 0:
            for t in range(i, end):
                x = a[t] ^ b[t]
                if x == 0:
                    continue
                if count == xors.size:
                    grown = np.empty(xors.size * 2, a.dtype)
                    grown[:count] = xors
                    xors = grown
                if used + 10 > varints.size:
                    more = np.empty(varints.size * 2, np.uint8)
                    more[:used] = varints[:used]
                    varints = more
                xors[count] = x
                if count == 0:
                    first = t
                else:
                    gap = t - previous - 1
                    while gap >= 128:
                        varints[used] = (gap & 127) | 128
                        gap >>= 7
                        used += 1
                    varints[used] = gap
                    used += 1
                previous = t
                count += 1
                wide = np.uint64(x)
                for j in range(itemsize):
                    if (wide >> np.uint64(8 * j)) & U255:
                        nonzero[j] += 1
                delta += _ws64_change(t, itemsize, a[t], b[t])
        i = end
    return count, first, previous, varints, used, xors, nonzero, delta


@njit(nogil=True, cache=True)
def _put_varint(out, at, value):
    while value >= 128:
        out[at] = (value & 127) | 128
        value >>= 7
        at += 1
    out[at] = value
    return at + 1


@njit(nogil=True, cache=True)
def varint_size(value):
    size = 1
    while value >= 128:
        value >>= 7
        size += 1
    return size


@njit(nogil=True, cache=True)
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


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.int64)


@njit(nogil=True, cache=True)
def structure(data, numel, count, itemsize):
    """Check a patch's structure (patch_format's order, steps 1-2 and the bitmask's step 3).

    Returns (status, detail, index end, plane kinds, plane data offsets, sparse byte offsets);
    detail says which check failed (patch_kernels words it)."""
    kinds = np.zeros(8, np.int64)
    plane_at = np.zeros(8, np.int64)
    sparse_at = np.zeros(8, np.int64)
    size = data.size
    if count < 0 or count > numel:
        return COUNT_MISMATCH, 0, 0, kinds, plane_at, sparse_at
    if size < 1:
        return MALFORMED, 1, 0, kinds, plane_at, sparse_at
    index_kind = data[0]
    at = 1
    if index_kind == 0:
        found = 0
        length = 0
        while found < count:
            if at >= size:
                return MALFORMED, 2, 0, kinds, plane_at, sparse_at
            byte = data[at]
            at += 1
            length += 1
            if byte < 128:
                if length == 10 and byte != 0:
                    return MALFORMED, 4, 0, kinds, plane_at, sparse_at
                found += 1
                length = 0
            elif length == 10:
                return MALFORMED, 3, 0, kinds, plane_at, sparse_at
    elif index_kind == 1:
        at += (numel + 7) >> 3
        if at > size:
            return MALFORMED, 5, 0, kinds, plane_at, sparse_at
    else:
        return MALFORMED, 6, 0, kinds, plane_at, sparse_at
    index_end = at
    if at + itemsize > size:
        return MALFORMED, 7, 0, kinds, plane_at, sparse_at
    at += itemsize
    bitmap_bytes = (count + 7) >> 3
    for j in range(itemsize):
        kind = data[index_end + j]
        kinds[j] = kind
        plane_at[j] = at
        if kind == 1:
            at += count
            if at > size:
                return MALFORMED, 8, 0, kinds, plane_at, sparse_at
        elif kind == 2:
            at += bitmap_bytes
            if at > size:
                return MALFORMED, 9, 0, kinds, plane_at, sparse_at
            if count & 7 and data[at - 1] >> (count & 7):
                return MALFORMED, 10, 0, kinds, plane_at, sparse_at
            ones = 0
            for t in range(plane_at[j], at):
                ones += _POPCOUNT[data[t]]
            sparse_at[j] = at
            at += ones
            if at > size:
                return MALFORMED, 11, 0, kinds, plane_at, sparse_at
        elif kind != 0:
            return MALFORMED, 12, 0, kinds, plane_at, sparse_at
    if at != size:
        return MALFORMED, 13, 0, kinds, plane_at, sparse_at
    if index_kind == 1:
        last = index_end - 1
        if numel & 7 and data[last] >> (numel & 7):
            return OUT_OF_RANGE, 14, 0, kinds, plane_at, sparse_at
        ones = 0
        for t in range(1, index_end):
            ones += _POPCOUNT[data[t]]
        if ones != count:
            return COUNT_MISMATCH, 15, 0, kinds, plane_at, sparse_at
    return OK, 0, index_end, kinds, plane_at, sparse_at


@njit(nogil=True, cache=True)
def walk(data, numel, count, index_end, kinds, plane_at, sparse_at, live, mode, positions, values):
    """Decode every (position, XOR) of a structurally valid patch, in k order, and per mode:
    0 check (write nothing), 1 apply (live[p] ^= x), 2 keep (positions[k] = p, values[k] = the
    new bits), 3 xor (positions[k] = p, values[k] = x). Returns (status, bad position, WS64
    delta); modes 0 and 2 read live, mode 3 does not (its delta is 0)."""
    itemsize = live.itemsize
    bitmask = data[0] == 1
    at = 1
    byte_index = 0
    pending = 0
    position = -1
    delta = U0
    cursors = sparse_at.copy()
    for k in range(count):
        if bitmask:
            while pending == 0:
                pending = np.int64(data[1 + byte_index])
                byte_index += 1
            low = pending & -pending
            pending ^= low
            bit = 0
            while low > 1:
                low >>= 1
                bit += 1
            position = (byte_index - 1) * 8 + bit
        else:
            gap = 0
            shift = 0
            while True:
                byte = data[at]
                at += 1
                gap |= np.int64(byte & 127) << shift
                shift += 7
                if byte < 128:
                    break
            if gap >= numel - position - 1:
                return OUT_OF_RANGE, position + 1 + gap if gap < numel else numel, delta
            position += gap + 1
        x = U0
        for j in range(itemsize):
            kind = kinds[j]
            if kind == 1:
                x |= np.uint64(data[plane_at[j] + k]) << np.uint64(8 * j)
            elif kind == 2:
                if (data[plane_at[j] + (k >> 3)] >> (k & 7)) & 1:
                    x |= np.uint64(data[cursors[j]]) << np.uint64(8 * j)
                    cursors[j] += 1
        if mode == 3:
            positions[k] = position
            values[k] = x
            continue
        old = live[position]
        new = old ^ x
        delta += _ws64_change(position, itemsize, old, new)
        if mode == 1:
            live[position] = new
        elif mode == 2:
            positions[k] = position
            values[k] = new
    return OK, 0, delta


@njit(nogil=True, cache=True)
def scatter(target, positions, values):
    """target[positions[k]] = values[k] (positions checked already: a kept, decoded patch)."""
    for k in range(positions.size):
        target[positions[k]] = values[k]


@njit(nogil=True, cache=True)
def count_changed(a, b, stride):
    """How many of a[::stride] differ from b[::stride] by bits."""
    changed = 0
    for i in range(0, a.size, stride):
        changed += a[i] != b[i]
    return changed
