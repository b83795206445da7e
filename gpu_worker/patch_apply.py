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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.common import patch_kernels
from weightsync.common.checksum import ws64
from weightsync.common.errors import DataLoss
from weightsync.common.patches import XOR, DecodedPatch, apply_patch, decode_patch, ws64_after_patch
from weightsync.worker.v1 import worker_pb2 as wpb


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

    def apply(self, destination: torch.Tensor) -> None:
        """XOR into destination (the live tensor, or its shadow holding the same bits); InvalidArgument
        or DataLoss with destination as it was."""
        target = self.target
        base = target.live_checksum if target.HasField("live_checksum") else ws64(self.live)
        actual = patch_kernels.apply_checked(self.data, destination, target.count, live_ws64=base, tensor=target.name)
        if actual != target.expected:
            self.undo(destination)
            raise _mismatch(target, actual, self.bucket)

    def undo(self, destination: torch.Tensor) -> None:
        """Take an applied patch back (XOR undoes itself)."""
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
    one the plan names (DATA_LOSS); write nothing."""
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
