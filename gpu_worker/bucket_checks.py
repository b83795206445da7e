"""Checks on a received bucket: its length (tail nonce) and its checksums.

A Gloo broadcast shorter than the receive buffer completes without error and
leaves the buffer's tail as it was, so before posting the receive the worker
writes a nonce into the bucket's last 8 bytes and afterwards checks that the
sender overwrote it. The nonce depends only on (update id, bucket), so every
worker writes the same one (a relaying rank forwards its whole buffer, tail
included). A broadcast longer than the buffer cannot be caught this way:
Gloo aborts the receiving process, and the node keeps its weights because the
store lives in memory the server keeps (see memory.py).
"""

from __future__ import annotations

import hashlib

import torch

from weightsync.common.checksum import ws64
from weightsync.common.errors import DataLoss, InvalidArgument
from weightsync.gpu_worker.update_plan import TensorCheck
from weightsync.v1 import tensor_pb2

TAIL_NONCE_BYTES = 8


def tail_nonce(update_id: str, sequence: int, device: torch.device) -> torch.Tensor:
    digest = hashlib.blake2b(f"{update_id}/{sequence}".encode(), digest_size=TAIL_NONCE_BYTES).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)


def arm_tail(buffer: torch.Tensor, nonce: torch.Tensor) -> torch.Tensor | None:
    """Write the nonce into the last 8 bytes (buckets are 0 or >= 8 bytes); returns what it covered."""
    if buffer.numel() < TAIL_NONCE_BYTES:
        return None
    covered = buffer[-TAIL_NONCE_BYTES:].clone()
    buffer[-TAIL_NONCE_BYTES:].copy_(nonce)
    return covered


def restore_tail(buffer: torch.Tensor, covered: torch.Tensor | None) -> None:
    """Undo arm_tail (the broadcast failed before the bucket arrived)."""
    if covered is not None:
        buffer[-TAIL_NONCE_BYTES:].copy_(covered)


def check_tail(sequence: int, buffer: torch.Tensor, nonce: torch.Tensor) -> None:
    """DATA_LOSS if the broadcast did not reach the bucket's end."""
    if buffer.numel() >= TAIL_NONCE_BYTES and torch.equal(buffer[-TAIL_NONCE_BYTES:], nonce):
        raise DataLoss(
            "BUCKET_TRUNCATED",
            f"bucket {sequence}: the broadcast was shorter than the bucket's {buffer.numel()} bytes "
            "(its last 8 bytes never arrived); send exactly the announced length",
            bucket=sequence, size_bytes=buffer.numel(),
        )


def verify_bucket(
    sequence: int, checks: tuple[TensorCheck, ...], received: torch.Tensor, bucket_checksum: tensor_pb2.Checksum
) -> None:
    """DATA_LOSS naming the bucket or tensor whose bytes do not match their checksum."""
    if bucket_checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_WS64:
        actual = ws64(received)
        if actual != bucket_checksum.value:
            raise DataLoss(
                "BUCKET_CHECKSUM_MISMATCH",
                f"bucket {sequence} arrived with WS64 {actual:#018x}, expected {bucket_checksum.value:#018x}",
                bucket=sequence, expected=f"{bucket_checksum.value:#018x}", actual=f"{actual:#018x}",
            )
    elif bucket_checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED:
        raise InvalidArgument(
            "CHECKSUM_ALGORITHM_UNKNOWN",
            f"bucket {sequence} has unknown checksum algorithm {bucket_checksum.algorithm}",
            bucket=sequence,
        )
    for check in checks:
        actual = ws64(received[check.offset_bytes : check.offset_bytes + check.size_bytes])
        if actual != check.expected:
            raise DataLoss(
                "TENSOR_CHECKSUM_MISMATCH",
                f"tensor {check.name!r} in bucket {sequence} arrived with WS64 {actual:#018x}, "
                f"expected {check.expected:#018x}",
                bucket=sequence, tensor=check.name,
            )
