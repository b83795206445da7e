"""What an UpdateWeights stream may say after Begin: the announcement rules, as pure functions.

Each function takes plain values (the plan, the message's fields, what the stream said
before) and returns the decision: an accepted announcement, or the refusal the client
gets (a WeightSyncError: its status code, its ErrorInfo reason and a message that says
what to do). Nothing here reads or changes an update's state, so the rules are tested
by tables (tests/unit/test_announcements.py) and every intake (intake.py) shares them.

The rules, in the order they are checked for a BucketStart:
  - its sequence is the next one, within the plan (BUCKET_OUT_OF_ORDER, BUCKET_OUT_OF_RANGE);
  - a deferred bucket comes with its layout, a planned one without (BUCKET_LAYOUT_*,
    and the layout's own checks in common/plan_validation.py);
  - a compressed bucket: a known compression, on a link that carries it (a Gloo group
    or INLINE), a frame shorter than the bucket, and over a group the frame's tail;
  - otherwise: the planned size (or 0 for "as planned"), a known checksum algorithm,
    over a group the bucket's tail, and over SHM a WS64 checksum and a free slot (unless
    the client writes the bucket straight into the store: no slot).
A BucketChunk continues the bucket being filled (INLINE), in order and within it; any other
message first needs that bucket complete; a commit needs every bucket applied.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.common.collective import tail_length
from weightsync.common.errors import FailedPrecondition, InvalidArgument, WeightSyncError
from weightsync.common.plan_validation import validate_layout
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

KNOWN_CHECKSUMS = (tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED, tensor_pb2.CHECKSUM_ALGORITHM_WS64)

Refusal = WeightSyncError
"""A refused message: its code, ErrorInfo reason, message and metadata are what the client gets."""


@dataclass(frozen=True, slots=True)
class Link:
    """What the rules need to know of the stream's transport, fixed when the update begins."""

    transport: int
    """pb.Transport: COLLECTIVE, INLINE or SHM."""
    broadcast_to_all: bool = False
    """An NCCL group: every worker joins every broadcast (no compressed frames there)."""
    slot_count: int = 0
    """SHM: the ingress slots the client writes in turn (bucket k uses slot k % slot_count)."""
    in_store: frozenset[int] = frozenset()
    """SHM: the buckets the client writes straight into the store (UpdateReady.store_places): no slot."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """A BucketStart that may be received: the sizes its intake forwards."""

    sequence: int
    size_bytes: int
    """The bucket's bytes in the store: its layout's for a deferred bucket, the plan's otherwise."""
    wire_bytes: int
    """The bytes that follow on the wire: the zstd frame's for a compressed bucket, size_bytes otherwise."""
    compression: int = pb.BUCKET_COMPRESSION_UNSPECIFIED

    @property
    def compressed(self) -> bool:
        return self.compression != pb.BUCKET_COMPRESSION_UNSPECIFIED


@dataclass(frozen=True, slots=True)
class Filling:
    """The INLINE bucket whose chunks are expected: the next chunk continues it."""

    sequence: int
    received: int
    size_bytes: int


def bucket_size(plan: tensor_pb2.WeightPlan, start: pb.BucketStart) -> int:
    """The length of an announced bucket (in range): its layout's for a deferred one, the plan's otherwise."""
    if start.HasField("layout"):
        return start.layout.size_bytes
    return plan.buckets[start.sequence].size_bytes


def check_start(start: pb.BucketStart, plan: tensor_pb2.WeightPlan, *, expected: int, link: Link,
                applied_sent: int = 0) -> Accepted | Refusal:
    """A BucketStart, when bucket `expected` is the next one and the client can have seen
    `applied_sent` BucketApplied messages: accepted with its sizes, or why not."""
    refusal = _check_sequence(start.sequence, len(plan.buckets), expected) or _check_layout(start, plan)
    if refusal is not None:
        return refusal
    planned = bucket_size(plan, start)
    if start.compression != pb.BUCKET_COMPRESSION_UNSPECIFIED:
        return _check_compressed(start, planned, link) or Accepted(start.sequence, planned, start.size_bytes,
                                                                   start.compression)
    return _check_plain(start, planned, link, applied_sent) or Accepted(start.sequence, planned, planned)


def _check_sequence(sequence: int, buckets: int, expected: int) -> Refusal | None:
    if sequence < expected:
        return InvalidArgument("BUCKET_OUT_OF_ORDER", f"bucket {sequence} was already announced; expected "
                               f"{expected}", bucket=sequence, expected=expected)
    if sequence >= buckets:
        return InvalidArgument("BUCKET_OUT_OF_RANGE", f"bucket {sequence} announced; the plan has {buckets}",
                               bucket=sequence, buckets=buckets)
    if sequence != expected:
        return InvalidArgument("BUCKET_OUT_OF_ORDER", f"bucket {sequence} announced, expected {expected}",
                               bucket=sequence, expected=expected)
    return None


def _check_layout(start: pb.BucketStart, plan: tensor_pb2.WeightPlan) -> Refusal | None:
    """A deferred bucket is announced with its layout (checked against the plan's candidates), a planned one without."""
    sequence = start.sequence
    bucket = plan.buckets[sequence]
    if bucket.deferred and not start.HasField("layout"):
        return InvalidArgument("BUCKET_LAYOUT_MISSING", f"bucket {sequence} is deferred: announce it with its "
                               "layout", bucket=sequence)
    if start.HasField("layout") and not bucket.deferred:
        return InvalidArgument("BUCKET_LAYOUT_UNEXPECTED", f"bucket {sequence} is laid out by the plan: announce "
                               "it without a layout", bucket=sequence)
    if bucket.deferred:
        try:
            validate_layout(sequence, bucket, start.layout)
        except InvalidArgument as error:
            return error
    return None


def _check_plain(start: pb.BucketStart, planned: int, link: Link, applied_sent: int) -> Refusal | None:
    """An uncompressed bucket: the planned size, a known checksum, and what its transport needs."""
    sequence = start.sequence
    if start.size_bytes and start.size_bytes != planned:
        return InvalidArgument(
            "BUCKET_SIZE_MISMATCH",
            f"bucket {sequence} is {planned} bytes in the plan but is announced as {start.size_bytes} bytes",
            bucket=sequence, planned_bytes=planned, announced_bytes=start.size_bytes,
        )
    if start.checksum.algorithm not in KNOWN_CHECKSUMS:
        return InvalidArgument("CHECKSUM_ALGORITHM_UNKNOWN", f"bucket {sequence} has unknown checksum algorithm "
                               f"{start.checksum.algorithm}", bucket=sequence)
    if link.transport == pb.TRANSPORT_COLLECTIVE and len(start.tail) != tail_length(planned):
        return InvalidArgument("BUCKET_TAIL_INVALID", f"bucket {sequence}: tail has {len(start.tail)} bytes; "
                               f"send the bucket's last {tail_length(planned)} bytes", bucket=sequence,
                               tail_bytes=len(start.tail), expected=tail_length(planned))
    if link.transport == pb.TRANSPORT_SHM:
        if start.checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_WS64:
            return InvalidArgument("BUCKET_CHECKSUM_REQUIRED", f"bucket {sequence}: an SHM bucket needs its WS64 "
                                   "checksum", bucket=sequence)
        if sequence in link.in_store:
            return None  # written into the store: no slot to wait for
        return check_slot(sequence, link.slot_count, applied_sent)
    return None


def _check_compressed(start: pb.BucketStart, planned: int, link: Link) -> Refusal | None:
    """A compressed bucket: one zstd frame (a Gloo group, or INLINE), shorter than the bucket (its owner
    checks the frame itself as it decompresses it)."""
    sequence = start.sequence
    if start.compression not in pb.BucketCompression.values():
        return InvalidArgument("BUCKET_COMPRESSION_UNKNOWN", f"bucket {sequence}: unknown compression "
                               f"{start.compression}", bucket=sequence, compression=start.compression)
    if link.transport == pb.TRANSPORT_SHM or link.broadcast_to_all:
        return InvalidArgument("BUCKET_COMPRESSION_UNSUPPORTED", f"bucket {sequence}: compressed buckets travel "
                               "only over a Gloo group (COLLECTIVE) or INLINE", bucket=sequence)
    if not 0 < start.size_bytes < planned:
        return InvalidArgument(
            "BUCKET_SIZE_MISMATCH", f"bucket {sequence} is {planned} bytes in the plan; its compressed frame is "
            f"announced as {start.size_bytes} bytes (1 to {planned - 1}: send a bucket that does not shrink as "
            "it is)", bucket=sequence, planned_bytes=planned, announced_bytes=start.size_bytes)
    if start.checksum.algorithm not in KNOWN_CHECKSUMS:
        return InvalidArgument("CHECKSUM_ALGORITHM_UNKNOWN", f"bucket {sequence} has unknown checksum algorithm "
                               f"{start.checksum.algorithm}", bucket=sequence)
    if link.transport == pb.TRANSPORT_COLLECTIVE and len(start.tail) != tail_length(start.size_bytes):
        return InvalidArgument("BUCKET_TAIL_INVALID", f"bucket {sequence}: tail has {len(start.tail)} bytes; "
                               f"send the frame's last {tail_length(start.size_bytes)} bytes", bucket=sequence,
                               tail_bytes=len(start.tail), expected=tail_length(start.size_bytes))
    return None


def check_slot(sequence: int, slot_count: int, applied_sent: int) -> Refusal | None:
    """SHM: the client may write bucket k's slot only after BucketApplied(k - slots) came back."""
    if sequence - slot_count >= applied_sent:
        return InvalidArgument(
            "SHM_SLOT_BUSY",
            f"bucket {sequence} was announced before bucket {sequence - slot_count} (same ingress slot) was applied: "
            "wait for its BucketApplied before writing the slot",
            bucket=sequence, slot=sequence % slot_count,
        )
    return None


def drain_length(start: pb.BucketStart, plan: tensor_pb2.WeightPlan) -> int | None:
    """A refused announcement over a group: the length of the broadcast that follows it, if it is known and
    drainable (draining costs a scratch buffer of that length on every worker: no more than the plan's largest
    bucket)."""
    if start.size_bytes < 0:
        return None
    length = start.size_bytes
    if not length:
        if not 0 <= start.sequence < len(plan.buckets):
            return None
        length = bucket_size(plan, start)
    return length if length <= max(b.size_bytes for b in plan.buckets) else None


def check_chunk(filling: Filling | None, *, sequence: int, offset_bytes: int, size_bytes: int,
                max_chunk_bytes: int) -> Refusal | None:
    """A BucketChunk of `size_bytes` bytes, when `filling` is the bucket being filled (None: none is)."""
    if filling is None or sequence != filling.sequence:
        return InvalidArgument("CHUNK_UNEXPECTED", f"a chunk for bucket {sequence}, which is not being sent",
                               bucket=sequence)
    if offset_bytes != filling.received:
        return InvalidArgument("CHUNK_OUT_OF_ORDER", f"bucket {sequence}: chunk at offset {offset_bytes}, expected "
                               f"{filling.received}", bucket=sequence, offset_bytes=offset_bytes,
                               expected=filling.received)
    if not 0 < size_bytes <= max_chunk_bytes:
        return InvalidArgument("CHUNK_SIZE_INVALID", f"bucket {sequence}: a chunk of {size_bytes} bytes "
                               f"(1 to {max_chunk_bytes})", bucket=sequence, size_bytes=size_bytes)
    if offset_bytes + size_bytes > filling.size_bytes:
        return InvalidArgument("CHUNK_OVERFLOW", f"bucket {sequence}: a chunk ends at byte "
                               f"{offset_bytes + size_bytes}, past the bucket's {filling.size_bytes}",
                               bucket=sequence, size_bytes=filling.size_bytes)
    return None


def incomplete(filling: Filling) -> Refusal:
    """Another message came while bucket `filling` still lacked bytes."""
    return InvalidArgument(
        "BUCKET_INCOMPLETE", f"bucket {filling.sequence} got {filling.received} of its "
        f"{filling.size_bytes} bytes before the next message", bucket=filling.sequence,
        received=filling.received, size_bytes=filling.size_bytes,
    )


def unexpected(kind: str) -> Refusal:
    """A message no update takes after Begin (a second Begin, or none at all)."""
    return InvalidArgument("UNEXPECTED_MESSAGE", f"unexpected {kind or 'empty'} message after begin")


def check_commit(applied: int, buckets: int) -> Refusal | None:
    """A CommitUpdate after `applied` of the plan's `buckets` buckets were applied."""
    if applied != buckets:
        return FailedPrecondition("BUCKETS_MISSING", f"commit after {applied} of {buckets} buckets",
                                  received=applied, expected=buckets)
    return None
