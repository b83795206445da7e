"""A worker's patches: check one against the live tensor (writing nothing), then apply it.

Every encoding is checked the same way before any byte moves: the WS64 of the whole tensor once
patched, computed from the live tensor's WS64 in O(changed), must be the one the plan names
(DATA_LOSS TENSOR_CHECKSUM_MISMATCH otherwise: the trainer's base was not this store's).

PATCH_XOR runs the compiled kernels (common.patch_kernels): one pass over the patch to check,
one to apply. The overwriting encodings (a trainer of another language, or the SDK's CUDA
tensors) run the torch implementation in common.patches. Patches are decoded on the host: the
node store is host memory.
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
        raise DataLoss(
            "TENSOR_CHECKSUM_MISMATCH",
            f"tensor {target.name!r} in bucket {bucket}: once patched its WS64 would be {actual:#018x}, "
            f"the plan says {target.expected:#018x} (was the base what the trainer thinks?)",
            bucket=bucket, tensor=target.name,
        )
    return checked
