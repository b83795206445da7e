"""WS64 of host memory at memory speed: a numba kernel behind common.checksum.ws64 for CPU tensors.

Why: the torch reduction (a row sum, a column sum, a weighted sum) makes three passes and two
temporaries and ran at ~0.5 GB/s here, so a server checksumming its store, or a trainer the copy
it keeps for patches, spent seconds per GB. One pass of uint64 multiply-adds runs near memcpy.
"""

from __future__ import annotations

import numpy as np

from weightsync.common.checksum import COLUMN_FACTOR, ROW_WORDS
from weightsync.common.numba_cache import cached_njit

_C = np.uint64(COLUMN_FACTOR)
_ROW = ROW_WORDS
_U1 = np.uint64(1)
_MASK = (1 << 64) - 1


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
