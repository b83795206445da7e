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
