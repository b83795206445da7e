"""A worker's patches: each proved against the live tensor, and a refused one leaves no trace.

Every encoding is proved the same way: the WS64 of the whole tensor once patched, computed from
the live tensor's WS64 in O(changed), must be the one the plan names (DATA_LOSS
TENSOR_CHECKSUM_MISMATCH otherwise: the trainer's base was not this store's).

PATCH_XOR applied now (IN_PLACE, or a STAGED one into its shadow) runs the compiled kernels
(common.patch_kernels) in one pass that checks as it writes (FusedPatch): a refused patch is
XORed in again, which takes back exactly what it wrote, so the store ends bit for bit as it was.
One kept for commit is checked first and applied then (CheckedPatch). The overwriting encodings
(a trainer of another language, or the SDK's CUDA tensors) are checked first, then applied, by
the torch implementation in common.patches. Patches are decoded on the host: the node store is
host memory.

A patch of a box (PatchTarget.box, sent by a part) is proved the same way on the box: its positions
are row-major in the box and `expected` is the WS64 of the box's elements once patched, so it is
decoded and checked against a contiguous copy of the live box (its WS64 computed there: O(box)),
writing nothing; its positions are then mapped into the whole tensor (box_positions) and it is
scattered there like an overwriting patch, in place, into the shadow, or kept for commit. Applied
now, it keeps the elements it overwrote, so a later refusal in its bucket can take it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weightsync.common import patch_kernels
from weightsync.common.checksum import ws64
from weightsync.common.errors import DataLoss
from weightsync.common.patches import (
    XOR,
    DecodedPatch,
    apply_patch,
    bits_of,
    decode_patch,
    ws64_after_patch,
)
from weightsync.worker.v1 import worker_pb2 as wpb

Index = tuple[int, ...]


def box_positions(positions: torch.Tensor, shape: Index, offsets: Index, sizes: Index) -> torch.Tensor:
    """Row-major positions in the box (offsets, sizes) of a tensor of `shape` (each in [0, numel(box)))
    -> the same elements' row-major positions in the whole tensor (int64, in the same order: increasing
    positions stay increasing)."""
    rest = positions.to(torch.int64)
    whole = torch.zeros_like(rest)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = torch.remainder(rest, sizes[dim])
        rest = torch.div(rest, sizes[dim], rounding_mode="floor")
        whole.add_(index.add_(offsets[dim]), alpha=stride)
        stride *= shape[dim]
    return whole


def _box(target: wpb.PatchTarget) -> tuple[Index, Index] | None:
    return (tuple(target.box.offsets), tuple(target.box.sizes)) if target.HasField("box") else None


def _box_view(tensor: torch.Tensor, box: tuple[Index, Index]) -> torch.Tensor:
    """The box of the tensor, as a (strided) view of it."""
    view = tensor
    for dim, (offset, size) in enumerate(zip(*box, strict=True)):
        view = view.narrow(dim, offset, size)
    return view


@dataclass(frozen=True, slots=True)
class CheckedPatch:
    """A patch proved against the live tensor; `data` (XOR) or `decoded` (overwrite) is what applies it."""

    name: str
    encoding: int
    count: int
    data: torch.Tensor | None
    """PATCH_XOR: the patch's bytes (a view of the bucket until kept)."""
    decoded: DecodedPatch | None

    def apply(self, destination: torch.Tensor) -> None:
        """XOR into (or overwrite) destination: the live tensor, or its shadow copy holding the same bits
        (a STAGED update copies a patched segment's live bytes to its shadow before any bucket arrives)."""
        if self.data is not None:
            patch_kernels.apply_patch(self.data, destination, self.count, tensor=self.name)
        else:
            assert self.decoded is not None
            apply_patch(destination, self.decoded)

    def kept(self) -> CheckedPatch:
        """A copy that outlives the bucket's buffer (applied at commit)."""
        if self.data is not None:
            return CheckedPatch(self.name, self.encoding, self.count, self.data.clone(), None)
        assert self.decoded is not None
        return CheckedPatch(self.name, self.encoding, self.count, None,
                            DecodedPatch(self.decoded.positions.clone(), self.decoded.values.clone()))


@dataclass(frozen=True, slots=True)
class FusedPatch:
    """A PATCH_XOR patch checked while it is applied (one pass over the patch and the tensor, not
    two); refused, it is taken back before the error is raised."""

    target: wpb.PatchTarget
    data: torch.Tensor
    """The patch's bytes (a view of the bucket: applied before the bucket's buffer is reused)."""
    live: torch.Tensor
    bucket: int

    overwritten: list[DecodedPatch] = field(default_factory=list)
    """A patch of a box, once applied: the elements it overwrote (undo writes them back)."""

    def apply(self, destination: torch.Tensor) -> None:
        """XOR into destination (the live tensor, or its shadow holding the same bits); InvalidArgument
        or DataLoss with destination as it was."""
        target = self.target
        if target.HasField("box"):  # checked on the box first, then scattered into the whole tensor
            checked = check_patch(target, self.data, self.live, bucket=self.bucket)
            assert checked.decoded is not None
            positions = checked.decoded.positions
            self.overwritten.append(DecodedPatch(positions, bits_of(destination).index_select(0, positions)
                                                 .view(torch.uint8)))
            checked.apply(destination)
            return
        base = target.live_checksum if target.HasField("live_checksum") else ws64(self.live)
        actual = patch_kernels.apply_checked(self.data, destination, target.count, live_ws64=base, tensor=target.name)
        if actual != target.expected:
            self.undo(destination)
            raise _mismatch(target, actual, self.bucket)

    def undo(self, destination: torch.Tensor) -> None:
        """Take an applied patch back (XOR undoes itself; a box's overwritten elements are written back)."""
        if self.target.HasField("box"):
            for old in reversed(self.overwritten):
                apply_patch(destination, old)
            self.overwritten.clear()
            return
        patch_kernels.apply_patch(self.data, destination, self.target.count, tensor=self.target.name)


def _mismatch(target: wpb.PatchTarget, actual: int, bucket: int) -> DataLoss:
    return DataLoss(
        "TENSOR_CHECKSUM_MISMATCH",
        f"tensor {target.name!r} in bucket {bucket}: once patched its WS64 would be {actual:#018x}, "
        f"the plan says {target.expected:#018x} (was the base what the trainer thinks?)",
        bucket=bucket, tensor=target.name,
    )


def check_patch(target: wpb.PatchTarget, data: torch.Tensor, live: torch.Tensor, *, bucket: int) -> CheckedPatch:
    """Parse the patch, refuse it if malformed (INVALID_ARGUMENT) or if the tensor it makes is not the
    one the plan names (DATA_LOSS); write nothing. A patch of a box is checked on the box and comes back
    as an overwriting patch of the whole tensor (its positions mapped: box_positions)."""
    box = _box(target)
    if box is not None:
        return _check_box_patch(target, data, live, box, bucket=bucket)
    base = target.live_checksum if target.HasField("live_checksum") else ws64(live)
    if target.encoding == XOR:
        actual = patch_kernels.check_patch(data, live, live.numel(), live.element_size(), target.count,
                                           live_ws64=base, tensor=target.name)
        checked = CheckedPatch(target.name, XOR, target.count, data, None)
    else:
        decoded = decode_patch(data, encoding=target.encoding, numel=live.numel(), count=target.count,
                               itemsize=live.element_size(), tensor=target.name)
        actual = ws64_after_patch(base, live, decoded)
        checked = CheckedPatch(target.name, target.encoding, target.count, None, decoded)
    if actual != target.expected:
        raise _mismatch(target, actual, bucket)
    return checked


def _check_box_patch(target: wpb.PatchTarget, data: torch.Tensor, live: torch.Tensor, box: tuple[Index, Index], *,
                     bucket: int) -> CheckedPatch:
    """check_patch for a patch of a box: proved against a contiguous copy of the live box (the plan's
    checksum is the box's), then its positions mapped into the whole tensor."""
    live_box = _box_view(live, box).contiguous()
    base = ws64(live_box)
    if target.encoding == XOR:
        actual, positions, values = patch_kernels.decode_new_values(data, live_box, target.count, live_ws64=base,
                                                                    tensor=target.name)
        decoded = DecodedPatch(positions, values.reshape(-1).view(torch.uint8))
    else:
        decoded = decode_patch(data, encoding=target.encoding, numel=live_box.numel(), count=target.count,
                               itemsize=live_box.element_size(), tensor=target.name)
        actual = ws64_after_patch(base, live_box, decoded)
    if actual != target.expected:
        raise _mismatch(target, actual, bucket)
    mapped = box_positions(decoded.positions, tuple(live.shape), *box)
    return CheckedPatch(target.name, target.encoding, target.count, None, DecodedPatch(mapped, decoded.values))
