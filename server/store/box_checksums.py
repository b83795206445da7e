"""GetTensorChecksums for boxes of tensors (GetTensorChecksumsRequest.boxes): what one part of a sharded
trainer holds of a tensor, checked against the store without the trainer gathering the whole tensor.

A box's checksum is the WS64 of its elements in row-major order over the box, i.e. of the contiguous copy
of the tensor narrowed to the box in every dimension: the bytes a part sends of that box
(TensorSpec.box), and for a box that is the whole tensor the whole tensor's checksum. The copy is one
box at a time (the store is host memory; a part's box is at most its shard).

`checked_boxes` is pure (shapes and names in, a refusal or the boxes to read out);
tests/system/test_part_verify.py holds its table and the checksum rule against tensors built by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync.common.checksum import ws64
from weightsync.common.errors import InvalidArgument
from weightsync.server.store.boxes import inside
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AskedBox:
    """One box asked for, of a stored tensor."""

    name: str
    offsets: Shape
    sizes: Shape

    def __str__(self) -> str:
        """`[0:4, 2:6]`: the box as Python slices (the form BOX_OUT_OF_SHAPE's metadata uses)."""
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=False)) + "]"

    def proto(self) -> tensor_pb2.TensorBox:
        return tensor_pb2.TensorBox(offsets=list(self.offsets), sizes=list(self.sizes))


def checked_boxes(refs: Sequence[pb.TensorBoxRef], shapes: Mapping[str, Shape],
                  stores: Callable[[str], bool]) -> list[AskedBox]:
    """The asked boxes to read, in the order asked, leaving out those of names this node does not store by
    design (`stores` false: its --tensors subset; the caller lists them in not_stored). `shapes`: the
    stored tensors' shapes; a name missing there is the caller's TENSOR_NOT_FOUND, checked before. Raises
    INVALID_ARGUMENT BOX_OUT_OF_SHAPE for the first box without its tensor's rank, a size >= 1 per
    dimension, or inside its shape (TensorBox's rules)."""
    out: list[AskedBox] = []
    for ref in refs:
        if not stores(ref.name):
            continue
        asked = AskedBox(ref.name, tuple(ref.box.offsets), tuple(ref.box.sizes))
        shape = shapes[ref.name]
        if not inside(asked.offsets, asked.sizes, shape):
            raise InvalidArgument(
                "BOX_OUT_OF_SHAPE", f"box {asked} of tensor {ref.name!r} does not lie inside its shape {list(shape)} "
                f"(one offset and one size >= 1 per dimension, {len(shape)} dimension(s))",
                tensor=ref.name[:64], box=str(asked)[:128], shape=str(list(shape)))
        out.append(asked)
    return out


def box_checksum(tensor: torch.Tensor, offsets: Shape, sizes: Shape) -> int:
    """WS64 of the box's elements in row-major order: the contiguous copy of the narrowed view."""
    view = tensor
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        view = view.narrow(dim, offset, size)
    return ws64(view.contiguous())


def compute_box_checksums(boxes: Sequence[AskedBox], view: Callable[[str], torch.Tensor]) -> list[pb.BoxChecksum]:
    """Each box's checksum over the committed tensor `view(name)`, one box copied at a time. Runs in a thread;
    the caller pins the bytes (a lease)."""
    return [pb.BoxChecksum(name=b.name, box=b.proto(), checksum=tensor_pb2.Checksum(
                algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=box_checksum(view(b.name), b.offsets, b.sizes)))
            for b in boxes]


__all__ = ["AskedBox", "checked_boxes", "box_checksum", "compute_box_checksums"]
