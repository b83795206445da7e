"""Structural validation of a WeightPlan, before any byte moves.

Checks only what the plan says about itself and the server's limits; checks
against the weight store (existing names, dtypes, shapes) happen where the
store's layout is known. Every failure is an InvalidArgument naming the
offending bucket and tensor in its metadata. A deferred bucket (BucketSpec.deferred)
lists candidates at Begin; its layout, given at its BucketStart, is checked there
(validate_layout) by the same rules as a plan's bucket. A spec with a box (TensorSpec.box) is
checked as the box: inside the tensor's shape, its elements' size, its pieces covering it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync.common import dtypes, patches
from weightsync.common.errors import InvalidArgument
from weightsync.v1 import tensor_pb2

MAX_NAME_BYTES = 1024
# Sizes are int64 on the wire; anything near 2^63 is nonsense for a tensor.
MAX_TENSOR_BYTES = 1 << 50
MIN_BUCKET_BYTES = 8
"""A bucket is 0 or >= 8 bytes: a COLLECTIVE broadcast announces its last 8 bytes (BucketStart.tail)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanLimits:
    """Bounds applied to every plan."""

    max_tensors: int
    """Most tensors one plan may list."""
    max_plan_bytes: int
    """Most bytes (sum of bucket sizes) one plan may move."""
    max_bucket_bytes: int
    """Most bytes in one bucket."""


@dataclass(frozen=True, slots=True)
class PlanSummary:
    """Totals of a valid plan."""

    tensor_count: int
    total_bytes: int
    max_bucket_bytes: int
    patch_count: int = 0
    """Tensors sent as patches (they need BeginUpdate.base_generation)."""


@dataclass(slots=True)
class _OpenPieces:
    """A split tensor whose pieces are still coming."""

    spec: tensor_pb2.TensorSpec
    next_offset: int
    size_bytes: int


def validate_plan(plan: tensor_pb2.WeightPlan, limits: PlanLimits) -> PlanSummary:
    """Raise InvalidArgument for the first problem found; return totals otherwise."""
    if not plan.buckets:
        raise InvalidArgument("PLAN_EMPTY", "the plan has no buckets")
    names: set[str] = set()
    tensor_count = 0
    patched = 0
    total_bytes = 0
    largest = 0
    pieces: _OpenPieces | None = None
    for index, bucket in enumerate(plan.buckets):
        pieces = _validate_pieces(index, bucket, pieces)
        _validate_bucket(index, bucket, limits, names)
        tensor_count += sum(1 for t in bucket.tensors if not t.HasField("piece") or not t.piece.offset_bytes)
        patched += sum(1 for t in bucket.tensors if patches.is_patch(t.encoding))  # a deferred one's candidates too
        total_bytes += bucket.size_bytes
        largest = max(largest, bucket.size_bytes)
        if tensor_count > limits.max_tensors:
            raise InvalidArgument(
                "PLAN_TOO_MANY_TENSORS",
                f"the plan lists more than {limits.max_tensors} tensors (server limit max_tensors)",
                limit=limits.max_tensors,
                bucket=index,
            )
        if total_bytes > limits.max_plan_bytes:
            raise InvalidArgument(
                "PLAN_TOO_MANY_BYTES",
                f"the plan moves more than {limits.max_plan_bytes} bytes "
                "(server limit max_plan_bytes)",
                limit=limits.max_plan_bytes,
                bucket=index,
            )
    if pieces is not None:
        raise _incomplete(len(plan.buckets), pieces)
    return PlanSummary(tensor_count, total_bytes, largest, patched)


def _incomplete(index: int, pieces: _OpenPieces) -> InvalidArgument:
    name = pieces.spec.name
    return InvalidArgument("PIECES_INCOMPLETE", f"tensor {name!r} is split, and its pieces stop at byte "
                           f"{pieces.next_offset} of {pieces.size_bytes} (bucket {index} must be its next piece)",
                           bucket=index, tensor=name, received_bytes=pieces.next_offset,
                           size_bytes=pieces.size_bytes)


def _validate_pieces(index: int, bucket: tensor_pb2.BucketSpec, pieces: _OpenPieces | None) -> _OpenPieces | None:
    """The piece rules (WeightPlan): a piece alone in its bucket, the pieces of one tensor consecutive, in
    order, covering it exactly. Returns the split tensor still open after this bucket."""
    piece = next((t for t in bucket.tensors if t.HasField("piece")), None)
    if piece is None:
        if pieces is not None:
            raise _incomplete(index, pieces)
        return None
    name = piece.name
    if len(bucket.tensors) != 1 or piece.offset_bytes != 0 or bucket.size_bytes != piece.size_bytes:
        raise InvalidArgument("PIECE_NOT_ALONE", f"bucket {index} holds a piece of tensor {name!r}: a piece is alone "
                              "in its bucket, at offset 0, and the bucket is exactly its size", bucket=index,
                              tensor=name)
    if patches.is_patch(piece.encoding):
        raise InvalidArgument("PIECE_INVALID", f"tensor {name!r}: a patch is never split into pieces",
                              bucket=index, tensor=name)
    start = piece.piece.offset_bytes
    if pieces is None:
        if start != 0:
            raise InvalidArgument("PIECE_OUT_OF_ORDER", f"tensor {name!r}: its first piece starts at byte {start}, "
                                  "not 0", bucket=index, tensor=name, piece_offset_bytes=start)
        itemsize = dtypes.itemsize(piece.dtype, tensor=name)
        pieces = _OpenPieces(piece, 0, _numel(piece) * itemsize)  # a box's pieces cover the box
    elif (name, piece.dtype, list(piece.shape), _box_key(piece)) != (
            pieces.spec.name, pieces.spec.dtype, list(pieces.spec.shape), _box_key(pieces.spec)):
        raise _incomplete(index, pieces)
    elif start != pieces.next_offset:
        raise InvalidArgument("PIECE_OUT_OF_ORDER", f"tensor {name!r}: a piece at byte {start}, expected "
                              f"{pieces.next_offset}", bucket=index, tensor=name, piece_offset_bytes=start,
                              expected=pieces.next_offset)
    itemsize = dtypes.itemsize(piece.dtype, tensor=name)
    end = start + piece.size_bytes
    if piece.size_bytes <= 0 or piece.size_bytes % itemsize or end > pieces.size_bytes:
        raise InvalidArgument("PIECE_INVALID", f"tensor {name!r}: a piece of {piece.size_bytes} bytes at byte "
                              f"{start} (pieces are whole elements inside the tensor's {pieces.size_bytes} bytes)",
                              bucket=index, tensor=name, size_bytes=piece.size_bytes, piece_offset_bytes=start)
    pieces.next_offset = end
    return None if end == pieces.size_bytes else pieces


def _box_key(spec: tensor_pb2.TensorSpec) -> str:
    """'' for a whole tensor; the box (TensorSpec.box) it carries otherwise: two boxes of one tensor are two
    entries of a plan, a box twice is a duplicate."""
    return f"{list(spec.box.offsets)}{list(spec.box.sizes)}" if spec.HasField("box") else ""


def _numel(spec: tensor_pb2.TensorSpec) -> int:
    """Elements the spec carries: its box's, or the whole tensor's."""
    return math.prod(spec.box.sizes) if spec.HasField("box") else math.prod(spec.shape)


def _validate_bucket(
    index: int, bucket: tensor_pb2.BucketSpec, limits: PlanLimits, names: set[str]
) -> None:
    _validate_bucket_size(index, bucket.size_bytes, limits)
    if not bucket.tensors:
        raise InvalidArgument("BUCKET_EMPTY", f"bucket {index} lists no tensors", bucket=index)
    if bucket.deferred:
        for spec in bucket.tensors:
            _validate_candidate(index, spec, names)
        return
    _validate_tensors(index, bucket, names)


def validate_layout(index: int, planned: tensor_pb2.BucketSpec, layout: tensor_pb2.BucketSpec) -> None:
    """A deferred bucket's layout (BucketStart.layout) against the plan's bucket (validated at Begin,
    so within the server's limits): raises InvalidArgument for the first problem."""
    if layout.deferred:
        raise InvalidArgument("BUCKET_LAYOUT_INVALID", f"bucket {index}: a layout is not itself deferred",
                              bucket=index)
    if layout.size_bytes < 0 or 0 < layout.size_bytes < MIN_BUCKET_BYTES:
        raise InvalidArgument("BUCKET_TOO_SMALL", f"bucket {index}'s layout is {layout.size_bytes} bytes: 0 or at "
                              f"least {MIN_BUCKET_BYTES} (receivers check its last 8 bytes); pad it", bucket=index,
                              size_bytes=layout.size_bytes)
    if layout.size_bytes > planned.size_bytes:
        raise InvalidArgument("BUCKET_TOO_LARGE", f"bucket {index}'s layout is {layout.size_bytes} bytes; the plan "
                              f"gives it at most {planned.size_bytes}", bucket=index, size_bytes=layout.size_bytes,
                              limit=planned.size_bytes)
    candidates = iter(planned.tensors)
    for spec in layout.tensors:
        candidate = next((c for c in candidates if c.name == spec.name), None)
        if candidate is None or (candidate.dtype, list(candidate.shape)) != (spec.dtype, list(spec.shape)):
            raise InvalidArgument("BUCKET_LAYOUT_INVALID", f"bucket {index}: tensor {spec.name!r} is not one of the "
                                  "plan's candidates for it, in their order, with their dtype and shape",
                                  bucket=index, tensor=spec.name[:64])
        if not patches.is_patch(spec.encoding) or spec.HasField("piece"):
            raise InvalidArgument("BUCKET_LAYOUT_INVALID", f"bucket {index}: tensor {spec.name!r} is not a patch "
                                  "(a deferred bucket holds patches only)", bucket=index, tensor=spec.name[:64])
    _validate_tensors(index, layout, set())


def _validate_candidate(index: int, spec: tensor_pb2.TensorSpec, names: set[str]) -> None:
    """A deferred bucket's candidate: a tensor's name, dtype and shape, PATCH_XOR, nothing else."""
    _validate_name_and_shape(index, spec, names, continued=False)
    laid_out = (spec.offset_bytes, spec.size_bytes, spec.patch_count, spec.checksum.algorithm, spec.checksum.value)
    if spec.encoding != patches.XOR or any(laid_out) or spec.HasField("piece"):
        raise InvalidArgument("DEFERRED_CANDIDATE_INVALID", f"bucket {index} is deferred: its tensor {spec.name!r} "
                              "must be a candidate (encoding PATCH_XOR; offset_bytes, size_bytes, patch_count, "
                              "checksum and piece unset: its BucketStart.layout gives them)", bucket=index,
                              tensor=spec.name)


def _validate_bucket_size(index: int, size_bytes: int, limits: PlanLimits) -> None:
    if size_bytes < 0:
        raise InvalidArgument(
            "BUCKET_SIZE_NEGATIVE", f"bucket {index} has size_bytes {size_bytes}", bucket=index
        )
    if size_bytes > limits.max_bucket_bytes:
        raise InvalidArgument(
            "BUCKET_TOO_LARGE",
            f"bucket {index} is {size_bytes} bytes; the server accepts at most "
            f"{limits.max_bucket_bytes} (max_bucket_bytes): split it",
            bucket=index,
            size_bytes=size_bytes,
            limit=limits.max_bucket_bytes,
        )
    if 0 < size_bytes < MIN_BUCKET_BYTES:
        raise InvalidArgument(
            "BUCKET_TOO_SMALL",
            f"bucket {index} is {size_bytes} bytes: a bucket is 0 or at least {MIN_BUCKET_BYTES} bytes "
            "(receivers check its last 8 bytes); pad it",
            bucket=index, size_bytes=size_bytes,
        )


def _validate_tensors(index: int, bucket: tensor_pb2.BucketSpec, names: set[str]) -> None:
    """Each tensor's own fields, and the bucket's layout: increasing offsets, nothing past its end."""
    previous_end = 0
    previous_name = ""
    for spec in bucket.tensors:
        _validate_tensor(index, spec, names)
        if spec.offset_bytes < previous_end:
            raise InvalidArgument(
                "TENSOR_OVERLAP",
                f"tensor {spec.name!r} at offset {spec.offset_bytes} in bucket {index} overlaps "
                f"{previous_name!r}, which ends at {previous_end} (tensors must be in increasing, "
                "non-overlapping offset order)",
                bucket=index,
                tensor=spec.name,
                offset_bytes=spec.offset_bytes,
            )
        end = spec.offset_bytes + spec.size_bytes
        if end > bucket.size_bytes:
            raise InvalidArgument(
                "TENSOR_OUT_OF_BOUNDS",
                f"tensor {spec.name!r} ends at byte {end}, past the end of bucket {index} "
                f"({bucket.size_bytes} bytes)",
                bucket=index,
                tensor=spec.name,
                offset_bytes=spec.offset_bytes,
                size_bytes=spec.size_bytes,
            )
        previous_end, previous_name = end, spec.name


def _encoded_size(index: int, spec: tensor_pb2.TensorSpec, numel: int, itemsize: int) -> int:
    """Bytes the tensor takes in its bucket: whole, or as a patch (see TensorEncoding)."""
    if spec.encoding in patches.DENSE_ENCODINGS:
        if spec.patch_count:
            raise InvalidArgument("PATCH_COUNT_INVALID", f"tensor {spec.name!r} is dense but has patch_count "
                                  f"{spec.patch_count}", bucket=index, tensor=spec.name)
        return numel * itemsize
    if not patches.is_patch(spec.encoding):
        raise InvalidArgument("TENSOR_ENCODING_UNKNOWN", f"tensor {spec.name!r} has unknown encoding "
                              f"{spec.encoding}", bucket=index, tensor=spec.name, encoding=spec.encoding)
    if not 1 <= spec.patch_count <= numel:
        raise InvalidArgument("PATCH_COUNT_INVALID", f"tensor {spec.name!r}: patch_count {spec.patch_count} is not "
                              f"1 to its {numel} elements", bucket=index, tensor=spec.name,
                              patch_count=spec.patch_count, numel=numel)
    if spec.encoding == patches.XOR:
        smallest, largest = patches.xor_size_bounds(numel, spec.patch_count, itemsize)
        if not smallest <= spec.size_bytes <= largest:
            raise InvalidArgument("TENSOR_SIZE_MISMATCH", f"tensor {spec.name!r}: size_bytes is {spec.size_bytes}, but "
                                  f"a PATCH_XOR patch of {spec.patch_count} elements takes {smallest} to {largest}",
                                  bucket=index, tensor=spec.name, size_bytes=spec.size_bytes,
                                  min_bytes=smallest, max_bytes=largest)
        return spec.size_bytes  # its exact length is checked as it is parsed (PATCH_MALFORMED)
    return patches.patch_size_bytes(spec.encoding, numel, spec.patch_count, itemsize)


def _validate_tensor(index: int, spec: tensor_pb2.TensorSpec, names: set[str]) -> None:
    """One spec's own fields; a piece after the first repeats its tensor's name (_validate_pieces)."""
    continued = spec.HasField("piece") and spec.piece.offset_bytes > 0
    itemsize, numel = _validate_name_and_shape(index, spec, names, continued=continued)
    expected = spec.size_bytes if spec.HasField("piece") else _encoded_size(index, spec, numel, itemsize)
    _finish_tensor(index, spec, itemsize, expected)


def _validate_name_and_shape(index: int, spec: tensor_pb2.TensorSpec, names: set[str], *,
                             continued: bool) -> tuple[int, int]:
    """Name, dtype and shape; returns (itemsize, numel)."""
    name = spec.name
    if not name:
        raise InvalidArgument("TENSOR_NAME_EMPTY", f"bucket {index} has a tensor with no name", bucket=index)
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidArgument(
            "TENSOR_NAME_TOO_LONG",
            f"a tensor name in bucket {index} is {len(name.encode())} bytes; at most {MAX_NAME_BYTES}",
            bucket=index,
            tensor=name[:64],
        )
    key = name + ("\0box" + _box_key(spec) if spec.HasField("box") else "")
    if key in names and not continued:
        raise InvalidArgument(
            "TENSOR_NAME_DUPLICATE", f"tensor {name!r} appears twice in the plan", bucket=index, tensor=name
        )
    names.add(key)
    try:
        itemsize = dtypes.itemsize(spec.dtype, tensor=name)
    except InvalidArgument as error:  # DTYPE_UNSPECIFIED / DTYPE_UNKNOWN: name the bucket too
        error.metadata["bucket"] = str(index)
        raise
    for dim in spec.shape:
        if dim < 0:
            raise InvalidArgument(
                "TENSOR_SHAPE_NEGATIVE",
                f"tensor {name!r} has a negative dimension in shape {list(spec.shape)}",
                bucket=index,
                tensor=name,
            )
    numel = math.prod(spec.shape)
    dense_bytes = numel * itemsize
    if dense_bytes > MAX_TENSOR_BYTES:
        raise InvalidArgument(
            "TENSOR_SHAPE_TOO_LARGE",
            f"tensor {name!r} with shape {list(spec.shape)} would be {dense_bytes} bytes",
            bucket=index,
            tensor=name,
        )
    if spec.HasField("box"):  # what it carries is the box: its elements, its size
        box = spec.box
        if (len(box.offsets) != len(spec.shape) or len(box.sizes) != len(spec.shape) or any(
                o < 0 or z < 1 or o + z > d for o, z, d in zip(box.offsets, box.sizes, spec.shape, strict=True))):
            raise InvalidArgument("BOX_OUT_OF_SHAPE", f"tensor {name!r}: box offsets {list(box.offsets)} sizes "
                                  f"{list(box.sizes)} does not lie inside its shape {list(spec.shape)} (one offset and "
                                  "one size >= 1 per dimension)", bucket=index, tensor=name[:64],
                                  box=("[" + ", ".join(f"{o}:{o + z}" for o, z in zip(box.offsets, box.sizes,
                                                                                     strict=False)) + "]")[:128],
                                  shape=str(list(spec.shape)))
        numel = math.prod(box.sizes)
    return itemsize, numel


def _finish_tensor(index: int, spec: tensor_pb2.TensorSpec, itemsize: int, expected: int) -> None:
    name = spec.name
    if spec.size_bytes != expected:
        what = (f"shape {list(spec.shape)} of {itemsize}-byte elements" if not patches.is_patch(spec.encoding) else
                f"a {tensor_pb2.TensorEncoding.Name(spec.encoding)} patch of {spec.patch_count} elements")
        raise InvalidArgument(
            "TENSOR_SIZE_MISMATCH",
            f"tensor {name!r}: size_bytes is {spec.size_bytes}, but {what} needs {expected}",
            bucket=index,
            tensor=name,
            size_bytes=spec.size_bytes,
            expected_bytes=expected,
        )
    if spec.offset_bytes < 0 or spec.offset_bytes % itemsize:
        raise InvalidArgument(
            "TENSOR_OFFSET_UNALIGNED",
            f"tensor {name!r} has offset_bytes {spec.offset_bytes}: it must be >= 0 and a multiple "
            f"of its element size {itemsize}",
            bucket=index,
            tensor=name,
            offset_bytes=spec.offset_bytes,
        )
    algorithm = spec.checksum.algorithm
    if patches.is_patch(spec.encoding) and algorithm != tensor_pb2.CHECKSUM_ALGORITHM_WS64:
        raise InvalidArgument(
            "PATCH_CHECKSUM_MISSING",
            f"tensor {name!r} is a patch: its checksum (WS64 of the whole tensor after the patch) is required",
            bucket=index, tensor=name,
        )
    if algorithm not in (
        tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED,
        tensor_pb2.CHECKSUM_ALGORITHM_WS64,
    ):
        raise InvalidArgument(
            "CHECKSUM_ALGORITHM_UNKNOWN",
            f"tensor {name!r} has unknown checksum algorithm {algorithm}",
            bucket=index,
            tensor=name,
        )
