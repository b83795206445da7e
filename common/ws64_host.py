"""WS64 of host memory at memory speed: numba kernels behind common.checksum.ws64 for CPU tensors.

Why: the torch reduction (a row sum, a column sum, a weighted sum) makes three passes and two
temporaries and ran at ~0.5 GB/s here, so a server checksumming its store, or a trainer the copy
it keeps for patches, spent seconds per GB. One pass of uint64 multiply-adds runs near memcpy.

WS64 is a sum over words of w_i * ((r_i + 1) + C (c_i + 1)), (r_i, c_i) = divmod(i, 512): each
word's term depends only on its value and its position. So a bucket's WS64 is its length plus the
terms of its pieces, each computed alone at the word where it starts (`ws64_terms`), as long as
the pieces start on word boundaries and the bytes no piece covers are zero. That lets a trainer
that writes a bucket tensor by tensor checksum each tensor as it copies it (`copy_ws64_terms`: one
pass that reads the source once and writes the destination once, instead of a copy and then a
read of the copy), and an owner check a bucket that lies in several places of the store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from weightsync.common.checksum import COLUMN_FACTOR, ROW_WORDS
from weightsync.common.numba_cache import cached_njit

_C = np.uint64(COLUMN_FACTOR)
_ROW = ROW_WORDS
_U1 = np.uint64(1)
_MASK = (1 << 64) - 1
SPLIT_BYTES = 16 << 20
"""Bytes per chunk when one checksum is split over threads (ws64_terms_split)."""


@cached_njit(nogil=True)
def _weighted_words(words):
    """sum of words[i] * ((r + 1) + C (c + 1)), (r, c) = divmod(i, 512), modulo 2^64: per row a sum
    (times r + 1) and per column a running sum (times C (c + 1) once, at the end): adds only in
    the loop over the words, which LLVM vectorizes."""
    n = words.size
    columns = np.zeros(_ROW, np.uint64)
    rows_term = np.uint64(0)
    row = np.uint64(0)
    for start in range(0, n - n % _ROW, _ROW):
        row_sum = np.uint64(0)
        for c in range(_ROW):
            w = words[start + c]
            row_sum += w
            columns[c] += w
        row += _U1
        rows_term += row_sum * row
    rest = n % _ROW
    if rest:
        row_sum = np.uint64(0)
        for c in range(rest):
            w = words[n - rest + c]
            row_sum += w
            columns[c] += w
        row += _U1
        rows_term += row_sum * row
    columns_term = np.uint64(0)
    weight = _U1
    for c in range(_ROW):
        columns_term += columns[c] * weight
        weight += _U1
    return rows_term + _C * columns_term


@cached_njit(nogil=True)
def _partial_row(words, start, count, c0, columns):
    """Sum of words[start:start + count], each also added to columns[c0 + k] (a row's head or tail)."""
    row_sum = np.uint64(0)
    for k in range(count):
        w = words[start + k]
        row_sum += w
        columns[c0 + k] += w
    return row_sum


@cached_njit(nogil=True)
def _copy_partial_row(dst, words, start, count, c0, columns):
    """_partial_row, writing each word into dst as it is read."""
    row_sum = np.uint64(0)
    for k in range(count):
        w = words[start + k]
        dst[start + k] = w
        row_sum += w
        columns[c0 + k] += w
    return row_sum


@cached_njit(nogil=True)
def _columns_term(columns):
    total = np.uint64(0)
    weight = _U1
    for c in range(_ROW):
        total += columns[c] * weight
        weight += _U1
    return total


@cached_njit(nogil=True)
def _terms_from(words, first):
    """sum of words[j] * ((r + 1) + C (c + 1)), (r, c) = divmod(first + j, 512), modulo 2^64: a head up to
    the next row boundary, whole rows (the loop of _weighted_words, which LLVM vectorizes), a tail."""
    n = words.size
    columns = np.zeros(_ROW, np.uint64)
    row = np.uint64(first // _ROW) + _U1
    c0 = first % _ROW
    head = min(n, (_ROW - c0) % _ROW)
    rows_term = np.uint64(0)
    if head:
        rows_term += _partial_row(words, 0, head, c0, columns) * row
        row += _U1
    # The whole rows through a slice, from index 0: with a loop that starts at `head`, numba cannot tell
    # the index is never negative, and the loop is not vectorized (5x slower).
    body = words[head:]
    full = body.size - body.size % _ROW
    for start in range(0, full, _ROW):
        row_sum = np.uint64(0)
        for c in range(_ROW):
            w = body[start + c]
            row_sum += w
            columns[c] += w
        rows_term += row_sum * row
        row += _U1
    start = head + full
    if start < n:
        rows_term += _partial_row(words, start, n - start, 0, columns) * row
    return rows_term + _C * _columns_term(columns)


@cached_njit(nogil=True)
def _copy_terms_from(dst, words, first):
    """_terms_from(words, first), writing every word into dst as it is read (one pass over the bytes)."""
    n = words.size
    columns = np.zeros(_ROW, np.uint64)
    row = np.uint64(first // _ROW) + _U1
    c0 = first % _ROW
    head = min(n, (_ROW - c0) % _ROW)
    rows_term = np.uint64(0)
    if head:
        rows_term += _copy_partial_row(dst, words, 0, head, c0, columns) * row
        row += _U1
    body, out = words[head:], dst[head:]  # from index 0: see _terms_from
    full = body.size - body.size % _ROW
    for start in range(0, full, _ROW):
        row_sum = np.uint64(0)
        for c in range(_ROW):
            w = body[start + c]
            out[start + c] = w
            row_sum += w
            columns[c] += w
        rows_term += row_sum * row
        row += _U1
    start = head + full
    if start < n:
        rows_term += _copy_partial_row(dst, words, start, n - start, 0, columns) * row
    return rows_term + _C * _columns_term(columns)


def _tail_terms(data: np.ndarray, first_word: int) -> int:
    """The terms of a last partial word (fewer than 8 bytes, zero-padded) at word `first_word`."""
    word = int.from_bytes(data.tobytes(), "little")
    return word * (first_word // _ROW + 1) + COLUMN_FACTOR * word * (first_word % _ROW + 1)


def ws64_terms(data: np.ndarray, first_word: int = 0) -> int:
    """The WS64 terms of a flat uint8 array whose first byte is word `first_word` of a bucket (its last
    partial word zero-padded), without the bucket's length: WS64 = (length + sum of terms) mod 2^64."""
    whole = data.size // 8
    total = 0
    if whole:
        head = data[: whole * 8]
        if head.ctypes.data % 8:
            head = head.copy()  # a uint64 view needs 8-byte alignment
        total += int(_terms_from(head.view(np.uint64), first_word))
    if data.size > whole * 8:
        total += _tail_terms(data[whole * 8 :], first_word + whole)
    return total & _MASK


def copy_ws64_terms(dst: np.ndarray, src: np.ndarray, first_word: int = 0) -> int:
    """Copy flat uint8 `src` into `dst` (same length) and return ws64_terms(src, first_word), reading
    `src` once where both are 8-byte aligned (else a copy, then the terms of the copy's source)."""
    if dst.size != src.size:
        raise ValueError(f"copy of {src.size} bytes into {dst.size}")
    whole = src.size // 8
    if src.ctypes.data % 8 or dst.ctypes.data % 8 or not whole:
        dst[:] = src
        return ws64_terms(src, first_word)
    total = int(_copy_terms_from(dst[: whole * 8].view(np.uint64), src[: whole * 8].view(np.uint64), first_word))
    if src.size > whole * 8:
        dst[whole * 8 :] = src[whole * 8 :]
        total += _tail_terms(src[whole * 8 :], first_word + whole)
    return total & _MASK


def ws64_terms_split(data: np.ndarray, first_word: int, run: Callable[..., Iterable[int]],
                     chunk_bytes: int = SPLIT_BYTES) -> int:
    """ws64_terms of `data` summed over chunks of about `chunk_bytes` (whole words), each computed by
    `run(ws64_terms, chunks, first words)` (a thread pool's map: the kernel releases the GIL)."""
    step = max(8, chunk_bytes - chunk_bytes % 8)
    starts = list(range(0, data.size, step)) or [0]
    chunks = [data[start : start + step] for start in starts]
    return sum(run(ws64_terms, chunks, [first_word + start // 8 for start in starts])) & _MASK


def ws64_host(data: np.ndarray) -> int:
    """WS64 of a flat uint8 array (the definition on weightsync.v1.ChecksumAlgorithm)."""
    n = data.size
    whole = n // 8
    total = n
    if whole:
        head = data[: whole * 8]
        if head.ctypes.data % 8:
            head = head.copy()  # a uint64 view needs 8-byte alignment
        total += int(_weighted_words(head.view(np.uint64)))
    tail = n - whole * 8
    if tail:
        word = int.from_bytes(data[whole * 8 :].tobytes(), "little")
        total += word * (whole // _ROW + 1) + COLUMN_FACTOR * word * (whole % _ROW + 1)
    return total & _MASK


def warm_up() -> None:
    """Call every kernel of this module once (each compiles into the cache: common/numba_cache.py)."""
    data = np.arange(8 * 1030, dtype=np.uint8)
    ws64_host(data)
    ws64_terms(data, 3)
    copy_ws64_terms(np.empty_like(data), data, 3)
