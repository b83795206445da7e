"""Patches: a tensor sent as the elements that changed (positions and new values), not whole.

The byte layout (also in tensor.proto, TensorEncoding, and docs/data-plane.md):

    [index section][zero padding to a multiple of the element size][values: count elements]

  POSITIONS  count element positions (row-major, strictly increasing), little-endian int32
             when the tensor has at most 2^31 elements, int64 otherwise.
  GAPS       count little-endian uint16 gaps: g[0] = p[0], g[k] = p[k] - p[k-1] - 1; only for
             patches whose every gap (and first position) is below 65536.
  BITMASK    ceil(numel / 8) bytes, bit j of byte b (least significant first) set for element
             8b + j; bits past numel are 0; count is the number of bits set.

Values are overwritten, not added, in the tensor's dtype, in increasing position order.

WS64 is linear in a tensor's 64-bit words, so the WS64 of the patched tensor follows from the
WS64 before and the words the patch touches: `ws64_after_patch` costs O(count), not O(size).
Everything runs with torch ops on the tensor's own device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.common.checksum import COLUMN_FACTOR, ROW_WORDS, as_bytes
from weightsync.common.errors import InvalidArgument
from weightsync.v1 import tensor_pb2

POSITIONS = tensor_pb2.TENSOR_ENCODING_PATCH_POSITIONS
GAPS = tensor_pb2.TENSOR_ENCODING_PATCH_GAPS
BITMASK = tensor_pb2.TENSOR_ENCODING_PATCH_BITMASK
XOR = tensor_pb2.TENSOR_ENCODING_PATCH_XOR
"""Gap varints and XOR byte planes, variable length: common.patch_format (layout),
common.patch_kernels (the host kernels). The three above overwrite and are sized by their count."""
PATCH_ENCODINGS = (POSITIONS, GAPS, BITMASK, XOR)
DENSE_ENCODINGS = (tensor_pb2.TENSOR_ENCODING_UNSPECIFIED, tensor_pb2.TENSOR_ENCODING_DENSE)
MAX_GAP = (1 << 16) - 1
_MASK64 = (1 << 64) - 1
_ROW_SHIFT = ROW_WORDS.bit_length() - 1
assert 1 << _ROW_SHIFT == ROW_WORDS  # a word's row and column by shift and mask


def is_patch(encoding: int) -> bool:
    return encoding in PATCH_ENCODINGS


def position_bytes(numel: int) -> int:
    """Width of one POSITIONS entry."""
    return 4 if numel <= 1 << 31 else 8


def index_bytes(encoding: int, numel: int, count: int) -> int:
    if encoding == POSITIONS:
        return count * position_bytes(numel)
    if encoding == GAPS:
        return count * 2
    if encoding == BITMASK:
        return -(-numel // 8)
    raise ValueError(f"not a patch encoding: {encoding}")


def values_offset(encoding: int, numel: int, count: int, itemsize: int) -> int:
    index = index_bytes(encoding, numel, count)
    return -(-index // itemsize) * itemsize


def patch_size_bytes(encoding: int, numel: int, count: int, itemsize: int) -> int:
    """Bytes of a patch of `count` elements in a bucket (an overwriting encoding: fixed by the count)."""
    return values_offset(encoding, numel, count, itemsize) + count * itemsize


def xor_size_bounds(numel: int, count: int, itemsize: int) -> tuple[int, int]:
    """The fewest and most bytes a PATCH_XOR patch of `count` elements can take (its decoder checks the
    exact length): the kind byte, the index (a byte per varint up to 10, or the bitmask), the plane
    kinds, and per plane nothing up to a sparse bitmap plus a byte per element."""
    bitmask = -(-numel // 8)
    smallest = 1 + min(count, bitmask) + itemsize
    largest = 1 + max(10 * count, bitmask) + itemsize + itemsize * (count + -(-count // 8))
    return smallest, largest


@dataclass(frozen=True, slots=True)
class PatchChoice:
    encoding: int
    size_bytes: int


def smallest_encoding(positions: torch.Tensor, numel: int, itemsize: int,
                      gaps: torch.Tensor | None = None) -> PatchChoice:
    """The smallest eligible encoding for these (sorted, unique) positions (`gaps`: gaps_of(positions),
    when the caller has them)."""
    count = positions.numel()
    choices = [PatchChoice(POSITIONS, patch_size_bytes(POSITIONS, numel, count, itemsize)),
               PatchChoice(BITMASK, patch_size_bytes(BITMASK, numel, count, itemsize))]
    if count and int((gaps if gaps is not None else gaps_of(positions)).max().item()) <= MAX_GAP:
        choices.append(PatchChoice(GAPS, patch_size_bytes(GAPS, numel, count, itemsize)))
    return min(choices, key=lambda c: (c.size_bytes, c.encoding))


def gaps_of(positions: torch.Tensor) -> torch.Tensor:
    """g[0] = p[0], g[k] = p[k] - p[k-1] - 1 (int64)."""
    return torch.diff(positions, prepend=positions.new_full((1,), -1)).sub_(1)


# -- the trainer's side ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SampleLayout:
    """Which elements a sample of a tensor reads: `run` consecutive ones at the start of each of
    `blocks` strides of `stride` elements (a small tensor: every element, blocks = numel)."""

    blocks: int
    stride: int
    run: int

    @property
    def size(self) -> int:
        return self.blocks * self.run

    def of(self, bits: torch.Tensor) -> torch.Tensor:
        """The sampled elements of a flat raw-bits tensor (bits_of), on its device: a view where it can be."""
        return bits[: self.blocks * self.stride].view(self.blocks, self.stride)[:, : self.run].reshape(-1)


SAMPLE_RUN = 16
"""Elements read together by a sample: 32 bytes of bf16, one cache line. 4096 elements one by one
cost a cache (and, past 4 MB, a TLB) miss each: 10.5 ms a push for the bench model's 291 tensors,
against 2.1 ms for 256 runs of 16 (one-ulp changes at 1%, the same counts within noise)."""


def sample_layout(numel: int, elements: int) -> SampleLayout:
    """`elements` (a multiple of SAMPLE_RUN) elements of a tensor of `numel`, spread in runs over all of it."""
    if numel <= elements:
        return SampleLayout(numel, 1, 1)
    blocks = elements // SAMPLE_RUN
    return SampleLayout(blocks, numel // blocks, SAMPLE_RUN)


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a tensor's raw bits, so -0.0 differs from 0.0 and NaN payloads count.

    A view of the tensor's own memory when it is contiguous; a copy otherwise (a strided slice
    such as big[::3] or big[:, ::2] cannot be viewed at another element width)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() > 1 and flat.stride(0) != 1:
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width)


@dataclass(frozen=True, slots=True)
class Changes:
    """The elements whose bits differ between two tensors of one layout."""

    positions: torch.Tensor
    """int64, strictly increasing."""
    values: torch.Tensor
    """uint8, count * itemsize bytes: the new elements' bytes in position order."""
    ws64_delta: int | None
    """WS64(new) - WS64(base) modulo 2^64, when the comparison went word by word (None otherwise:
    ws64_after_patch gives it)."""


def changes_between(base: torch.Tensor, new: torch.Tensor) -> Changes:
    """What changed from base to new, by raw bits (both on one device, same dtype and numel).

    Compares 64-bit words: one pass over both tensors and a mask an eighth of their size. The
    changed words (old and new) give everything else in O(changed): the WS64 change (WS64 is
    linear in the words) and, lane by lane inside them, the changed elements and their values,
    without reading the big tensors again."""
    a, b = bits_of(base), bits_of(new)
    itemsize = a.element_size()
    total = a.numel() * itemsize
    if total % 8 or a.data_ptr() % 8 or b.data_ptr() % 8 or not a.numel():
        positions = torch.nonzero(a != b, as_tuple=False).reshape(-1)
        return Changes(positions, as_bytes(b.index_select(0, positions)), None)
    a64, b64 = a.view(torch.int64), b.view(torch.int64)
    words = torch.nonzero(a64 != b64, as_tuple=False).reshape(-1)
    old, now = a64.index_select(0, words), b64.index_select(0, words)
    delta = _weighted_sum(now - old, words)  # now - old wraps modulo 2^64, as WS64 does
    per_word_shift = (8 // itemsize).bit_length() - 1
    lanes = torch.nonzero(old.view(a.dtype) != now.view(a.dtype), as_tuple=False).reshape(-1)
    positions = (words.index_select(0, lanes >> per_word_shift) << per_word_shift).add_(lanes & ((1 << per_word_shift) - 1))
    return Changes(positions, as_bytes(now.view(a.dtype).index_select(0, lanes)), delta & _MASK64)


def changed_positions(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted int64 positions of the elements whose bits differ."""
    return changes_between(base, new).positions


def encode_patch(new: torch.Tensor, positions: torch.Tensor, encoding: int, out: torch.Tensor, *,
                 values: torch.Tensor | None = None, gaps: torch.Tensor | None = None) -> None:
    """Write the patch of `new` at `positions` into `out` (uint8, exactly patch_size_bytes long).
    `values` (the new elements' bytes, Changes.values) and `gaps` (gaps_of) spare a pass when known."""
    flat = new.detach().reshape(-1)
    numel, count, itemsize = flat.numel(), positions.numel(), flat.element_size()
    start = values_offset(encoding, numel, count, itemsize)
    index_end = index_bytes(encoding, numel, count)
    if encoding == POSITIONS:
        width = torch.int32 if position_bytes(numel) == 4 else torch.int64
        out[:index_end].copy_(positions.to(width).view(torch.uint8))
    elif encoding == GAPS:
        gaps = gaps if gaps is not None else gaps_of(positions)
        out[:index_end].copy_(gaps.to(torch.int32).to(torch.int16).view(torch.uint8))
    elif encoding == BITMASK:
        byte_of, bit_of = positions // 8, (positions % 8).to(torch.uint8)
        packed = torch.zeros(index_end, dtype=torch.uint8, device=positions.device)
        # Positions are distinct, so OR-ing each bit into its byte is a sum of distinct powers of two.
        packed.index_add_(0, byte_of, torch.ones_like(bit_of) << bit_of)
        out[:index_end].copy_(packed)
    else:
        raise ValueError(f"not a patch encoding: {encoding}")
    out[index_end:start].zero_()
    if values is None:
        values = as_bytes(bits_of(flat).index_select(0, positions.to(flat.device)))
    out[start:].copy_(values)


# -- the receiver's side -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DecodedPatch:
    positions: torch.Tensor
    """int64, strictly increasing, each in [0, numel)."""
    values: torch.Tensor
    """uint8, count * itemsize bytes: the new elements' bytes in position order."""


def decode_patch(data: torch.Tensor, *, encoding: int, numel: int, count: int, itemsize: int,
                 tensor: str) -> DecodedPatch:
    """Read a patch from its bytes in a bucket; INVALID_ARGUMENT for indices out of range, out of
    order or repeated, or a bitmask whose bits disagree with the count."""
    index_end = index_bytes(encoding, numel, count)
    raw = data[:index_end]
    if encoding == POSITIONS:
        width = torch.int32 if position_bytes(numel) == 4 else torch.int64
        positions = _aligned(raw).view(width).to(torch.int64)
    elif encoding == GAPS:  # increasing by construction: only the last position can be wrong
        steps = (_aligned(raw).view(torch.int16).to(torch.int64) & 0xFFFF).add_(1)
        positions = torch.cumsum(steps, dim=0).sub_(1)
    elif encoding == BITMASK:
        bits = (raw.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=raw.device)) & 1
        flags = bits.reshape(-1)
        if bool(flags[numel:].any().item()):
            raise InvalidArgument("PATCH_INDEX_OUT_OF_RANGE", f"tensor {tensor!r}: its bitmask sets bits past its "
                                  f"{numel} elements", tensor=tensor, numel=numel)
        positions = torch.nonzero(flags[:numel], as_tuple=False).reshape(-1)  # increasing by construction
        if positions.numel() != count:
            raise InvalidArgument("PATCH_COUNT_MISMATCH", f"tensor {tensor!r}: its bitmask sets {positions.numel()} "
                                  f"bits, the plan says {count} changed elements", tensor=tensor,
                                  bits=positions.numel(), patch_count=count)
    else:
        raise InvalidArgument("TENSOR_ENCODING_UNKNOWN", f"tensor {tensor!r} has encoding {encoding}", tensor=tensor)
    if count and (int(positions[0].item()) < 0 or int(positions[-1].item()) >= numel):
        raise InvalidArgument("PATCH_INDEX_OUT_OF_RANGE", f"tensor {tensor!r}: a patch position is outside "
                              f"[0, {numel})", tensor=tensor, numel=numel)
    if encoding == POSITIONS and count > 1 and not bool((positions[1:] > positions[:-1]).all().item()):
        raise InvalidArgument("PATCH_INDEX_UNSORTED", f"tensor {tensor!r}: patch positions must be strictly "
                              "increasing (sorted, no repeats)", tensor=tensor)
    start = values_offset(encoding, numel, count, itemsize)
    return DecodedPatch(positions, data[start: start + count * itemsize])


def _aligned(raw: torch.Tensor) -> torch.Tensor:
    return raw if raw.data_ptr() % 8 == 0 else raw.clone()


def apply_patch(target: torch.Tensor, patch: DecodedPatch) -> None:
    """Overwrite target's elements at the patch's positions (target: a contiguous tensor, any shape)."""
    if not target.is_contiguous():
        raise ValueError("a patch is applied to contiguous memory only")
    flat = bits_of(target)
    # scatter_ rather than index_copy_: the same writes, about twice as fast on CPU (bench --only delta)
    flat.scatter_(0, patch.positions.to(flat.device), patch.values.to(flat.device).view(flat.dtype))


# -- WS64 in O(changed) ------------------------------------------------------------------------
def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _unsigned_bits(values: torch.Tensor, itemsize: int) -> torch.Tensor:
    """int64 holding each element's bits as an unsigned number (itemsize 8: its two's complement,
    which is the same modulo 2^64)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    wide = values.view(width).to(torch.int64)
    return wide if itemsize in (1, 8) else wide & ((1 << (8 * itemsize)) - 1)


def ws64_after_patch(old_ws64: int, current: torch.Tensor, patch: DecodedPatch) -> int:
    """WS64 of `current` once the patch is applied, from its WS64 now, in O(changed).

    A 64-bit word is the sum of its elements' bits shifted to their byte offset (elements never
    straddle words), so a changed element moves the word by (new - old) << shift, and WS64 by
    that times the word's weight (r + 1) + C * (c + 1): all modulo 2^64, as in the definition."""
    count = patch.positions.numel()
    if not count:
        return old_ws64
    device = current.device
    itemsize = patch.values.numel() // count
    positions = patch.positions.to(device)
    old = _unsigned_bits(bits_of(current).index_select(0, positions).view(torch.uint8), itemsize)
    new = _unsigned_bits(patch.values.to(device), itemsize)
    per_word_shift = (8 // itemsize).bit_length() - 1
    words = positions >> per_word_shift
    lane_bits = (positions & ((1 << per_word_shift) - 1)) << (3 + itemsize.bit_length() - 1)
    change = (new - old) << lane_bits  # the word's change, modulo 2^64
    return (old_ws64 + _weighted_sum(change, words)) & _MASK64


def _weighted_sum(change: torch.Tensor, words: torch.Tensor) -> int:
    """Sum of change[k] times the WS64 weight of word words[k]: (r + 1) + C * (c + 1), with
    r, c = divmod(word, ROW_WORDS), written as (r + C * c) + (1 + C); modulo 2^64 (int64 wraps)."""
    weights = torch.add(words >> _ROW_SHIFT, words & (ROW_WORDS - 1), alpha=_signed(COLUMN_FACTOR))
    return int((change * weights).sum().item()) + (1 + COLUMN_FACTOR) * int(change.sum().item())
