"""What one push sends per tensor (the whole tensor, a patch, or nothing), and the views whose
storage is smaller than their logical size: the vocabulary of client/delta/base.py, apart from the copy
it keeps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weightsync.common.patches import bits_of


def read_span(tensor: torch.Tensor) -> int:
    """The elements of its storage a tensor reads, from its first to its last (torch strides are never
    negative): fewer than its numel only when it reads some more than once (expand(), a stride of 0)."""
    if not tensor.numel():
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))


def repeats_elements(tensor: torch.Tensor) -> bool:
    """Whether the tensor is a view whose storage is smaller than its logical size (its copy keeps
    only that storage: policy.kept_copy)."""
    return read_span(tensor) < tensor.numel()


def read_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The storage a tensor reads, first element to last, as flat raw bits (a view: no copy)."""
    return bits_of(tensor.detach().as_strided((read_span(tensor),), (1,), tensor.storage_offset()))


@dataclass(frozen=True, slots=True)
class TensorPatch:
    """One tensor's patch, encoded as it goes into a bucket."""

    data: torch.Tensor
    """uint8, the patch's bytes (tensor.proto, TensorEncoding)."""
    encoding: int
    count: int
    checksum: int
    """WS64 of the whole tensor after the patch."""
    positions: torch.Tensor | None
    """The changed positions of an overwriting patch (None for PATCH_XOR: its bytes are enough)."""


@dataclass(slots=True)
class DeltaChoice:
    """What one push sends: patches by name, unchanged tensors left out, everything else dense."""

    patches: dict[str, TensorPatch] = field(default_factory=dict)
    unchanged: set[str] = field(default_factory=set)
    """Bit for bit what the base holds: not sent at all (their generation on the node stays)."""
    deferred: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """Kept host tensors whose samples predict a patch, compared only while the push's first
    buckets travel (client/delta/deferred.py): (name, the new tensor, contiguous), in push order."""
    patch_below: dict[str, float] = field(default_factory=dict)
    """Per deferred tensor, its Worth.patch_below (what its deferred bucket makes room for)."""

    def keep_patches_within(self, bucket_size_bytes: int) -> None:
        """A patch larger than a bucket goes dense (split into pieces): a patch is never split."""
        for name in [n for n, p in self.patches.items() if p.data.numel() > bucket_size_bytes]:
            del self.patches[name]

    def sent_bytes(self, items: list[tuple[str, torch.Tensor]]) -> int:
        """What this choice moves: the patches, and the changed tensors whole (the deferred ones, whose
        samples predict small patches, are not counted)."""
        return sum(self.patches[n].data.numel() if n in self.patches else t.numel() * t.element_size()
                   for n, t in items if n not in self.unchanged and n not in self.patch_below)
