"""Which buckets an SHM trainer writes straight into the node store, and where: a pure rule.

A trainer on the server's host that asks for it (BeginUpdate.store_writes) maps the store's arenas
(local socket, open_store) and writes a bucket at its places in the store instead of into an ingress
slot: no slot, no copy by the bucket's owner, who checks the bytes where they lie (its WS64 over the
regions, gpu_worker/bucket_checks.py). A bucket qualifies when every byte of it has one place in the
store that a plain copy fills:
  - laid out as its segment, or as a split tensor's place (the fast path): one region, the whole
    bucket, its padding included;
  - otherwise every tensor of the bucket copied whole to its place (the general path), each starting
    at a multiple of 8 in the bucket, so that the bucket's WS64 is the sum of each region's terms
    (common/ws64_host.py) with the padding between them counted as zeros.
Never: a deferred bucket (its layout comes with its announcement), one with patches or boxes (its
owner decodes or scatters them), one this node stores only part of, or none of (its other tensors have
no place here), an empty one.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.server.store.update_plan import BucketRoute
from weightsync.v1 import tensor_pb2

WORD_BYTES = 8
"""WS64 sums 8-byte words: a region starts on a word of the bucket, so its terms are its own."""


@dataclass(frozen=True, slots=True)
class ClientRegion:
    """Bucket bytes [bucket_offset, +size_bytes) go to segment `segment` at `segment_offset`."""

    bucket_offset: int
    size_bytes: int
    segment: int
    segment_offset: int


def client_regions(route: BucketRoute, bucket: tensor_pb2.BucketSpec) -> tuple[ClientRegion, ...] | None:
    """Where a trainer writes `bucket` (routed as `route`) in the store, in bucket order; None when it goes
    through an ingress slot (see the module docstring)."""
    if bucket.deferred or not route.stored or route.patches or route.box_copies or route.size_bytes == 0:
        return None
    if route.receive_into is not None:
        target = route.receive_into
        return (ClientRegion(0, route.size_bytes, target.segment, target.offset_bytes),)
    sent = sorted((t.offset_bytes, t.size_bytes) for t in bucket.tensors if t.size_bytes)
    copies = sorted(route.copies, key=lambda c: c.src_offset)
    if not copies or [(c.src_offset, c.size_bytes) for c in copies] != sent:
        return None  # a tensor of the bucket has no place here (not stored on this node)
    if any(c.src_offset % WORD_BYTES for c in copies):
        return None
    return tuple(ClientRegion(c.src_offset, c.size_bytes, c.segment, c.dst_offset) for c in copies)
