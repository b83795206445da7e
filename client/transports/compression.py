"""Buckets of patches compressed on a slow link (BucketStart.compression ZSTD; docs/data-plane.md).

A PATCH_XOR patch of a small optimizer step is mostly one low byte per change and short gap
varints: zstd level 1 shrinks it 1.6-1.8x (bench/results/patch_kernels.md) at ~600 MB/s on one
core here, and the owners decompress at ~1.3 GB/s each. That pays only where the link is the
slower stage: the trainer compresses bucket k while bucket k-1 is on the wire (CollectiveSink
keeps two in flight), so a compressed bucket costs about max(compress, its frame on the link),
against its whole bytes on the link. Dense buckets are never compressed: bf16 weights shrink a few
percent, not worth a pass over every byte.
"""

from __future__ import annotations

import threading
import time

import torch

from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

COMPRESS_BELOW_BYTES_PER_SECOND = 400e6
"""Compress buckets of patches when this client's dense pushes over the group measured slower
than this (~3.2 Gbit/s): below half the compressor's one-core speed on the benchmark machine, so
compressing a bucket takes less than sending the one before it. On loopback (~3 GB/s here) and
over 10 Gbit/s the frames measured no faster than the raw bytes (bench/results/patch_kernels.md)."""

LEVEL = 1

_local = threading.local()


def _compressor():
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        import zstandard  # imported on the first compressed bucket only

        compressor = _local.compressor = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return compressor


def holds_patches(bucket: tensor_pb2.BucketSpec) -> bool:
    return any(t.encoding > tensor_pb2.TENSOR_ENCODING_DENSE for t in bucket.tensors)


def compressed_frame(data: torch.Tensor) -> torch.Tensor | None:
    """One zstd frame of `data` (uint8, host) with its content size stated; None when it does not
    shrink (the bucket then goes as it is)."""
    frame = _compressor().compress(data.numpy())
    if len(frame) >= data.numel():
        return None
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)


def worth_compressing(dense_bytes_per_second: float | None) -> bool:
    """Whether a push whose dense bytes last moved at this rate compresses its buckets of patches."""
    return dense_bytes_per_second is not None and dense_bytes_per_second < COMPRESS_BELOW_BYTES_PER_SECOND


class Frames:
    """Which buckets of one push go as zstd frames, and what that saved (one per sink and push)."""

    def __init__(self) -> None:
        self.enabled = False
        """This push sends its buckets of patches as frames (set by the SDK per push)."""
        self._patched: set[int] = set()
        self.compressed_bytes = 0
        """Bucket bytes sent as frames."""
        self.saved_bytes = 0
        """What compressing them took off the bytes sent."""
        self.seconds = 0.0
        """Time spent compressing (not waiting on the link)."""

    def new_run(self) -> None:
        """A run of another plan starts (a push sends patches, then dense to a server without the base):
        its bucket indices start again at 0."""
        self._patched.clear()

    def planned(self, index: int, bucket: tensor_pb2.BucketSpec) -> None:
        if holds_patches(bucket):
            self._patched.add(index)

    def encode(self, index: int, data: torch.Tensor) -> tuple[torch.Tensor, int]:
        """What to send for bucket `index` (its bytes, or a frame of them), and its BucketStart.compression."""
        if self.enabled and index in self._patched and data.device.type == "cpu":
            started = time.perf_counter()
            frame = compressed_frame(data)
            self.seconds += time.perf_counter() - started
            if frame is not None:
                self.compressed_bytes += data.numel()
                self.saved_bytes += data.numel() - frame.numel()
                return frame, pb.BUCKET_COMPRESSION_ZSTD
        return data, pb.BUCKET_COMPRESSION_UNSPECIFIED
