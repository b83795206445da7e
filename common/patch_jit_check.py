"""The receiver's numba kernels behind common.patch_kernels: a PATCH_XOR patch's structure checked
(common.patch_format's order of refusals), then walked once to check, apply or keep it.

Status codes are returned, not raised (patch_kernels words the error): see patch_jit.OK ...
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from weightsync.common.numba_cache import cached_njit
from weightsync.common.patch_jit import (
    COUNT_MISMATCH,
    MALFORMED,
    OK,
    OUT_OF_RANGE,
    U0,
    _ws64_change,
)


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for array[index]'s cache line now (llvm.prefetch): the receiver's reads of live at
    scattered positions then overlap instead of waiting one by one."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0" if str(byte_pointer) == "ptr" else "llvm.prefetch.p0i8"  # opaque pointers or not
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]), name)
        builder.call(function, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.none(array, index), codegen


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.int64)


@cached_njit(nogil=True)
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
        run = 0  # continuation bytes just before this one
        while found < count:
            if at >= size:
                return MALFORMED, 2, 0, kinds, plane_at, sparse_at
            byte = data[at]
            at += 1
            more = np.int64(byte >> 7)
            if run == 9 and (more or byte != 0):  # an 11th byte, or a 10th over int64
                return MALFORMED, 3 if more else 4, 0, kinds, plane_at, sparse_at
            run = (run + 1) & -more  # no branch on the varint's length (1 or 2 bytes: mispredicted)
            found += 1 - more
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


BATCH = 256
"""walk decodes this many (position, XOR) pairs, prefetching live at each, then touches live for
them in a loop of its own (misses one after another cost ~40 ns per change below 3% changed)."""


@cached_njit(nogil=True)
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
    batch_positions = np.empty(BATCH, np.int64)
    batch_xors = np.empty(BATCH, np.uint64)
    for k0 in range(0, count, BATCH):
        n = min(BATCH, count - k0)
        for i in range(n):
            if bitmask:
                while pending == 0:
                    pending = np.int64(data[1 + byte_index])
                    byte_index += 1
                bit = np.int64(trailing_zeros(np.uint64(pending)))
                pending &= pending - 1
                position = (byte_index - 1) * 8 + bit
            else:
                byte = data[at]  # branchy on purpose: predicted, it does not wait for the load
                at += 1
                gap = np.int64(byte & 127)
                shift = 7
                while byte >= 128:
                    byte = data[at]
                    at += 1
                    gap |= np.int64(byte & 127) << shift
                    shift += 7
                if gap >= numel - position - 1:
                    return OUT_OF_RANGE, position + 1 + gap if gap < numel else numel, delta
                position += gap + 1
            batch_positions[i] = position
            if mode != 3:
                prefetch(live, position)
        batch_xors[:n] = 0
        for j in range(itemsize):
            kind = kinds[j]
            shift = np.uint64(8 * j)
            if kind == 1:
                base = plane_at[j] + k0
                for i in range(n):
                    batch_xors[i] |= np.uint64(data[base + i]) << shift
            elif kind == 2:
                bitmap = plane_at[j]
                cursor = cursors[j]
                for i in range(n):
                    k = k0 + i
                    if (data[bitmap + (k >> 3)] >> (k & 7)) & 1:
                        batch_xors[i] |= np.uint64(data[cursor]) << shift
                        cursor += 1
                cursors[j] = cursor
        if mode == 3:
            positions[k0: k0 + n] = batch_positions[:n]
            values[k0: k0 + n] = batch_xors[:n]
            continue
        for i in range(n):
            p = batch_positions[i]
            old = live[p]
            new = old ^ batch_xors[i]
            delta += _ws64_change(p, itemsize, old, new)
            if mode == 1:
                live[p] = new
            elif mode == 2:
                positions[k0 + i] = p
                values[k0 + i] = new
    return OK, 0, delta


@cached_njit(nogil=True)
def scatter(target, positions, values):
    """target[positions[k]] = values[k] (positions checked already: a kept, decoded patch)."""
    for k in range(positions.size):
        target[positions[k]] = values[k]
