"""A compressed bucket (BucketStart.compression ZSTD): one Zstandard frame that must decompress to
exactly the bucket the plan describes.

The frame is checked before a byte is written: its header must state the content size and that
size must be the bucket's, so a frame can never write past the bucket or leave part of it stale;
a frame that ends early, carries trailing bytes or is corrupt fails in zstd and writes nothing
either (the output goes to a buffer of zstd's own; the receiver copies it into place once whole).
"""

from __future__ import annotations

import numpy
import torch

from weightsync.common.errors import InvalidArgument

_decompressor = None


def _zstd():
    global _decompressor
    if _decompressor is None:
        import zstandard  # imported on the first compressed bucket: most workers never see one

        _decompressor = zstandard.ZstdDecompressor()
    return _decompressor


def malformed(sequence: int, why: str) -> InvalidArgument:
    return InvalidArgument("BUCKET_FRAME_MALFORMED", f"bucket {sequence}: {why}", bucket=sequence)


def decompress_bucket(sequence: int, frame: torch.Tensor, size: int) -> numpy.ndarray:
    """The bucket of `size` bytes that `frame` (uint8, host) holds, in a buffer of zstd's own: nothing
    is written anywhere unless every check passed."""
    import zstandard

    data = frame.numpy()
    decompressor = _zstd()
    try:
        stated = zstandard.frame_content_size(data)
    except zstandard.ZstdError as error:
        raise malformed(sequence, f"not a Zstandard frame ({error})") from None
    if stated != size:
        said = "no content size" if stated < 0 else f"a content size of {stated} bytes"
        raise malformed(sequence, f"the frame states {said}; the bucket is {size} bytes")
    try:
        out = decompressor.decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as error:
        raise malformed(sequence, f"the frame does not decompress ({error})") from None
    if len(out) != size:  # zstd checks this against the header; never trust a frame's word alone
        raise malformed(sequence, f"the frame decompressed to {len(out)} bytes, not {size}")
    return numpy.frombuffer(out, dtype=numpy.uint8)
