"""WS64: the checksum documented on weightsync.v1.ChecksumAlgorithm.

Computed with integer torch reductions on the tensor's own device, so CPU and
CUDA give the same value without copying weights to the host. Sums of int64
wrap modulo 2^64 and are order-independent, so the result is exact whatever
reduction order the device uses.
"""

from __future__ import annotations

import torch

from weightsync.v1 import tensor_pb2

ROW_WORDS = 512
COLUMN_FACTOR = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_column_weights: dict[torch.device, torch.Tensor] = {}


def _column_weight(device: torch.device) -> torch.Tensor:
    weights = _column_weights.get(device)
    if weights is None:
        weights = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=device)
        _column_weights[device] = weights
    return weights


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (row-major); copies only if not contiguous."""
    flat = tensor.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def ws64(tensor: torch.Tensor) -> int:
    """WS64 of a tensor's raw bytes, as an unsigned 64-bit int: a compiled pass on the host
    (common.ws64_host), torch reductions on the tensor's device otherwise."""
    if tensor.device.type == "cpu":
        from weightsync.common.ws64_host import ws64_host  # numba loads on first use, not on import

        data = as_bytes(tensor.detach())
        return ws64_host(data.numpy()) if data.numel() else ws64_host(data.new_empty(0).numpy())
    return ws64_torch(tensor)


def ws64_torch(tensor: torch.Tensor) -> int:
    """WS64 with torch reductions, on any device (the reference the host kernel is tested against)."""
    data = as_bytes(tensor)
    n = data.numel()
    full_words = n // 8
    total = n
    if full_words:
        head = data[: full_words * 8]
        if head.data_ptr() % 8:
            head = head.clone()  # an int64 view needs 8-byte alignment
        words = head.view(torch.int64)
        rows = full_words // ROW_WORDS
        if rows:
            grid = words[: rows * ROW_WORDS].view(rows, ROW_WORDS)
            row_weights = torch.arange(1, rows + 1, dtype=torch.int64, device=grid.device)
            row_term = int((grid.sum(dim=1) * row_weights).sum().item())
            col_term = int((grid.sum(dim=0) * _column_weight(grid.device)).sum().item())
            total += row_term + COLUMN_FACTOR * col_term
        rest = words[rows * ROW_WORDS :]
        if rest.numel():
            cols = _column_weight(rest.device)[: rest.numel()]
            total += (rows + 1) * int(rest.sum().item())
            total += COLUMN_FACTOR * int((rest * cols).sum().item())
    tail = n - full_words * 8
    if tail:
        word = int.from_bytes(bytes(data[full_words * 8 :].cpu().tolist()), "little")
        if word >= 1 << 63:
            word -= 1 << 64
        total += word * (full_words // ROW_WORDS + 1)
        total += COLUMN_FACTOR * word * (full_words % ROW_WORDS + 1)
    return total & _MASK


def ws64_terms(data: torch.Tensor, first_word: int = 0) -> int:
    """The WS64 terms of flat uint8 bytes whose first byte is word `first_word` of a bucket (the last
    partial word zero-padded), without the bucket's length: WS64 = (length + the terms of its pieces)
    mod 2^64 when the pieces start on words and the bytes between them are zero (common/ws64_host.py).
    The host kernel for CPU bytes, torch reductions on the bytes' device otherwise."""
    if data.device.type == "cpu":
        from weightsync.common.ws64_host import ws64_terms as host_terms

        return host_terms(data.detach().numpy(), first_word) if data.numel() else 0
    return int(ws64_terms_torch(data, first_word).item()) & _MASK


_C_SIGNED = COLUMN_FACTOR - (1 << 64)
"""COLUMN_FACTOR as a signed int64 (torch multiplies int64 modulo 2^64 with it alike)."""


def ws64_terms_torch(data: torch.Tensor, first_word: int = 0) -> torch.Tensor:
    """ws64_terms with torch reductions on the bytes' own device, as a 0-d int64 tensor there (the sum
    modulo 2^64, as a signed value): nothing waits for it, so a CUDA caller can queue it on a stream and
    read it once an event says it is done. No temporary larger than a row sum per 512 words."""
    n = data.numel()
    whole = n // 8
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if whole:
        head_bytes = data[: whole * 8]
        if head_bytes.data_ptr() % 8:
            head_bytes = head_bytes.clone()  # an int64 view needs 8-byte alignment
        words = head_bytes.view(torch.int64)
        total = total + _words_terms(words, first_word)
    if n > whole * 8:
        last = torch.zeros(8, dtype=torch.uint8, device=data.device)
        last[: n - whole * 8] = data[whole * 8 :]
        total = total + _words_terms(last.view(torch.int64), first_word + whole)
    return total


def _words_terms(words: torch.Tensor, first: int) -> torch.Tensor:
    """sum of words[j] * ((r + 1) + C (c + 1)), (r, c) = divmod(first + j, 512): a head to the next row
    boundary, whole rows as a grid (a row sum and a column sum), a tail."""
    n = words.numel()
    device = words.device
    total = torch.zeros((), dtype=torch.int64, device=device)
    start = 0
    head = min(n, (ROW_WORDS - first % ROW_WORDS) % ROW_WORDS)
    if head:
        total = total + _partial_row_terms(words[:head], first)
        start = head
    rows = (n - start) // ROW_WORDS
    if rows:
        grid = words[start : start + rows * ROW_WORDS].view(rows, ROW_WORDS)
        first_row = (first + start) // ROW_WORDS
        row_weights = torch.arange(first_row + 1, first_row + rows + 1, dtype=torch.int64, device=device)
        total = total + (grid.sum(dim=1) * row_weights).sum()
        total = total + _C_SIGNED * (grid.sum(dim=0) * _column_weight(device)).sum()
        start += rows * ROW_WORDS
    if start < n:
        total = total + _partial_row_terms(words[start:], first + start)
    return total


def _partial_row_terms(words: torch.Tensor, first: int) -> torch.Tensor:
    """The terms of words that all lie in one row (first // 512), from column first % 512."""
    row, column = divmod(first, ROW_WORDS)
    columns = _column_weight(words.device)[column : column + words.numel()]
    return words.sum() * (row + 1) + _C_SIGNED * (words * columns).sum()


def ws64_reference(raw: bytes) -> int:
    """Straight transcription of the proto comment, for tests and other languages."""
    n = len(raw)
    padded = raw + b"\0" * (-n % 8)
    total = n
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        r, c = divmod(i, ROW_WORDS)
        total += w * (r + 1) + COLUMN_FACTOR * w * (c + 1)
    return total & _MASK


def to_proto(value: int) -> tensor_pb2.Checksum:
    return tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=value)


def tensor_checksum(tensor: torch.Tensor) -> tensor_pb2.Checksum:
    """The proto Checksum of a tensor."""
    return to_proto(ws64(tensor))
