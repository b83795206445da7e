"""The content-derived plan id written on weightsync.v1.WeightPlan.

A plan is named by a hash of its layout, so an id can only ever stand for the
layout it was computed from: a client that sends `plan_id` means exactly one
plan, and a server that holds a plan under that id holds that plan. No cache
on either side can confuse two layouts (the defect this replaced: a client
reused the id of a plan whose update had failed).
"""

from __future__ import annotations

import hashlib
import struct

from weightsync.v1 import tensor_pb2

PLAN_ID_MAGIC = b"WSPLAN1\n"
PLAN_ID_HEX_DIGITS = 32

_BUCKET = struct.Struct("<qI")
_U32 = struct.Struct("<I")
_TENSOR_HEAD = struct.Struct("<II")
_TENSOR_TAIL = struct.Struct("<qqIQ")
_PATCH = struct.Struct("<Iq")
_PIECE = struct.Struct("<q")
_PATCH_ENCODINGS = (tensor_pb2.TENSOR_ENCODING_PATCH_POSITIONS, tensor_pb2.TENSOR_ENCODING_PATCH_GAPS,
                    tensor_pb2.TENSOR_ENCODING_PATCH_BITMASK, tensor_pb2.TENSOR_ENCODING_PATCH_XOR)


def plan_id_of(plan: tensor_pb2.WeightPlan) -> str:
    """The plan id: 32 lowercase hex digits of SHA-256 over the canonical bytes."""
    digest = hashlib.sha256(PLAN_ID_MAGIC)
    for bucket in plan.buckets:
        digest.update(_BUCKET.pack(bucket.size_bytes, len(bucket.tensors)))
        for tensor in bucket.tensors:
            name = tensor.name.encode("utf-8")
            digest.update(_U32.pack(len(name)))
            digest.update(name)
            digest.update(_TENSOR_HEAD.pack(tensor.dtype, len(tensor.shape)))
            digest.update(struct.pack(f"<{len(tensor.shape)}q", *tensor.shape))
            digest.update(
                _TENSOR_TAIL.pack(
                    tensor.offset_bytes, tensor.size_bytes, tensor.checksum.algorithm, tensor.checksum.value
                )
            )
            if tensor.encoding in _PATCH_ENCODINGS:  # dense plans keep the ids they always had
                digest.update(_PATCH.pack(tensor.encoding, tensor.patch_count))
            if tensor.HasField("piece"):
                digest.update(b"piece" + _PIECE.pack(tensor.piece.offset_bytes))
            if tensor.HasField("box"):  # plans without one keep the ids they always had
                box = tensor.box
                digest.update(b"box" + _U32.pack(len(box.offsets)) + struct.pack(f"<{len(box.offsets)}q", *box.offsets)
                              + _U32.pack(len(box.sizes)) + struct.pack(f"<{len(box.sizes)}q", *box.sizes))
        if bucket.deferred:  # plans without one keep the ids they always had
            digest.update(b"deferred")
    return digest.hexdigest()[:PLAN_ID_HEX_DIGITS]
