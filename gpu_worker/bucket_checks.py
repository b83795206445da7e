"""Checks on a received bucket: its length (the announced tail) and its checksums.

A Gloo broadcast shorter than the receive buffer completes without error and
leaves the buffer's end as it was, and correct data can end in any bytes at
all, so the receive buffer alone cannot tell a short broadcast from a full
one. The trainer therefore announces the bucket's last n = min(8, size) bytes
(BucketStart.tail). Before posting the receive, the worker writes their
bytewise complement into the buffer's last n bytes; afterwards it requires
those bytes to equal the announced ones exactly. A broadcast k >= 1 bytes
short leaves at least the last byte as its complement, which differs from the
announced byte in every bit: caught with certainty. A full broadcast of the
announced bytes always passes, whatever they are. Every worker writes the same
complement (a relaying rank forwards its whole buffer, end included).

A broadcast longer than the buffer cannot be caught this way: Gloo aborts the
receiving process, and the node keeps its weights because the store lives in
memory the server keeps (server/store/node_store.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync.common import byte_passes
from weightsync.common.checksum import ws64, ws64_terms
from weightsync.common.collective import tail_length
from weightsync.common.errors import DataLoss, InvalidArgument
from weightsync.v1 import tensor_pb2
from weightsync.worker.v1 import worker_pb2 as wpb


def check_tail_announced(sequence: int, size_bytes: int, tail: bytes) -> None:
    """INVALID_ARGUMENT unless `tail` has the bucket's min(8, size) bytes (the server checks first)."""
    if len(tail) != tail_length(size_bytes):
        raise InvalidArgument(
            "BUCKET_TAIL_INVALID",
            f"bucket {sequence}: the announced tail has {len(tail)} bytes; a {size_bytes}-byte bucket "
            f"needs its last {tail_length(size_bytes)}",
            bucket=sequence, tail_bytes=len(tail), size_bytes=size_bytes,
        )


def complement(tail: bytes) -> bytes:
    return bytes(b ^ 0xFF for b in tail)


def arm_tail(buffer: torch.Tensor, tail: bytes) -> torch.Tensor | None:
    """Write the complement of `tail` into the buffer's last len(tail) bytes; returns what it covered."""
    n = len(tail)
    if n == 0:
        return None
    end = buffer[buffer.numel() - n :]
    covered = end.clone()
    end.copy_(torch.frombuffer(bytearray(complement(tail)), dtype=torch.uint8))
    return covered


def restore_tail(buffer: torch.Tensor, covered: torch.Tensor | None) -> None:
    """Undo arm_tail (the broadcast failed before the bucket arrived)."""
    if covered is not None:
        buffer[buffer.numel() - covered.numel() :].copy_(covered)


def check_tail(sequence: int, buffer: torch.Tensor, tail: bytes) -> None:
    """DATA_LOSS unless the buffer ends with the announced tail (call after the broadcast completed)."""
    n = len(tail)
    if n == 0:
        return
    arrived = bytes(buffer[buffer.numel() - n :].cpu().tolist())
    if arrived != tail:
        raise DataLoss(
            "BUCKET_TRUNCATED",
            f"bucket {sequence}: its last {n} bytes are not the announced tail: the broadcast was shorter "
            f"than the bucket's {buffer.numel()} bytes (or BucketStart.tail is not the bucket's end); "
            "send exactly the announced length",
            bucket=sequence, size_bytes=buffer.numel(),
        )


def verify_bucket(
    sequence: int, checks: Sequence[wpb.TensorCheck], received: torch.Tensor, bucket_checksum: tensor_pb2.Checksum
) -> None:
    """DATA_LOSS naming the bucket or tensor whose bytes do not match their checksum."""
    if bucket_checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_WS64:
        actual = ws64(received)
        byte_passes.read("worker.check", received.numel())
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


def verify_in_store(sequence: int, checks: Sequence[wpb.TensorCheck], pieces: Sequence[tuple[int, torch.Tensor]],
                    size_bytes: int, bucket_checksum: tensor_pb2.Checksum) -> None:
    """verify_bucket for a bucket that lies in the store in pieces (the SHM trainer wrote it there:
    server/store/writes.py): `pieces` are (where it starts in the bucket, a multiple of 8; its bytes),
    the bytes between them zeros. The bucket's WS64 is its length plus each piece's terms
    (common/ws64_host.py); a tensor's check reads the piece that holds it."""
    if bucket_checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_WS64:
        raise InvalidArgument("BUCKET_CHECKSUM_REQUIRED", f"bucket {sequence}: an SHM bucket needs its WS64 "
                              "checksum", bucket=sequence)
    total = size_bytes
    for offset, data in pieces:
        total += _terms(data, offset // 8)
        byte_passes.read("worker.check", data.numel())
    actual = total & _MASK
    if actual != bucket_checksum.value:
        raise DataLoss(
            "BUCKET_CHECKSUM_MISMATCH",
            f"bucket {sequence} is in the store with WS64 {actual:#018x}, expected {bucket_checksum.value:#018x}",
            bucket=sequence, expected=f"{bucket_checksum.value:#018x}", actual=f"{actual:#018x}",
        )
    for check in checks:
        data = next((d[check.offset_bytes - o : check.offset_bytes - o + check.size_bytes] for o, d in pieces
                     if o <= check.offset_bytes and check.offset_bytes + check.size_bytes <= o + d.numel()), None)
        actual = ws64(data) if data is not None else None
        if actual != check.expected:
            raise DataLoss(
                "TENSOR_CHECKSUM_MISMATCH",
                f"tensor {check.name!r} in bucket {sequence} is in the store with WS64 "
                f"{'(no place)' if actual is None else f'{actual:#018x}'}, expected {check.expected:#018x}",
                bucket=sequence, tensor=check.name,
            )


_MASK = (1 << 64) - 1
CHECK_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))
"""Threads one check of a bucket in the store is split over (host memory): the trainer has written the bucket
and waits, so the last bucket's check, the one the commit waits for, can use the cores it left."""
_pool: ThreadPoolExecutor | None = None


def _terms(data: torch.Tensor, first_word: int) -> int:
    """ws64_terms of host bytes, over CHECK_THREADS threads when they are large enough to pay."""
    from weightsync.common.ws64_host import (  # numba loads on first use
        SPLIT_BYTES,
        ws64_terms_split,
    )

    global _pool
    if data.device.type != "cpu" or CHECK_THREADS < 2 or data.numel() < 2 * SPLIT_BYTES:
        return ws64_terms(data, first_word)
    if _pool is None:
        _pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="weightsync-check")
    return ws64_terms_split(data.numpy(), first_word, _pool.map,
                            chunk_bytes=max(SPLIT_BYTES, -(-data.numel() // CHECK_THREADS)))
