"""Patches: the byte layout of tensor.proto's TensorEncoding, round trips, refusals,
and WS64 after a patch computed in O(changed) equal to WS64 of the whole patched tensor."""

from __future__ import annotations

import pytest
import torch

from weightsync.common.checksum import ws64
from weightsync.common.errors import InvalidArgument
from weightsync.common.patches import (
    BITMASK,
    GAPS,
    POSITIONS,
    DecodedPatch,
    apply_patch,
    changed_positions,
    changes_between,
    decode_patch,
    encode_patch,
    patch_size_bytes,
    smallest_encoding,
    ws64_after_patch,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn]


def random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:  # only 0 and 1 are bools (torch canonicalizes other bytes on copy)
        return torch.randint(0, 2, (numel,), dtype=torch.uint8, generator=g).view(torch.bool)
    size = torch.tensor([], dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).view(dtype)


def changed_copy(base: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    bits = new.view(torch.uint8).view(-1, base.element_size())
    rows = torch.nonzero(torch.rand(base.numel(), generator=g) < density).reshape(-1)
    bits[rows, 0] ^= 1 if base.dtype == torch.bool else 0x5A  # flip bits of the low byte: always a change
    return new


def encoded(base: torch.Tensor, new: torch.Tensor, encoding: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = changed_positions(base, new)
    out = torch.empty(patch_size_bytes(encoding, new.numel(), positions.numel(), new.element_size()),
                      dtype=torch.uint8)
    encode_patch(new, positions, encoding, out)
    return positions, out


@pytest.mark.parametrize("encoding", [POSITIONS, GAPS, BITMASK], ids=["positions", "gaps", "bitmask"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])
def test_round_trip_and_ws64_after_patch(encoding, dtype, numel):
    base = random_tensor(dtype, numel, seed=numel)
    new = changed_copy(base, 0.05, seed=numel + 1)
    new.view(torch.uint8).view(-1, new.element_size())[-1, 0] ^= 1  # the last element (tail word) changes
    positions, data = encoded(base, new, encoding)
    patch = decode_patch(data, encoding=encoding, numel=numel, count=positions.numel(), itemsize=new.element_size(),
                         tensor="t")
    assert torch.equal(patch.positions, positions)
    assert ws64_after_patch(ws64(base), base, patch) == ws64(new)
    target = base.clone()
    apply_patch(target, patch)
    assert torch.equal(target.view(torch.uint8), new.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_changes_between_matches_an_element_by_element_comparison(dtype, numel, offset):
    """Word by word (aligned, whole words) or element by element: the same positions, values and
    WS64 change as comparing every element and summing the whole tensors."""
    base = random_tensor(dtype, numel + offset, seed=numel)[offset:]
    new = changed_copy(base, 0.05, seed=numel + 2)
    new.view(torch.uint8).view(-1, new.element_size())[-1, 0] ^= 1
    changes = changes_between(base, new)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    old_bits, new_bits = base.reshape(-1).view(width), new.reshape(-1).view(width)
    expected = torch.nonzero(old_bits != new_bits).reshape(-1)
    assert torch.equal(changes.positions, expected)
    assert bytes(changes.values.tolist()) == bytes(new_bits[expected].view(torch.uint8).tolist())
    whole_words = numel * new.element_size() % 8 == 0 and base.data_ptr() % 8 == 0
    if whole_words:
        assert changes.ws64_delta == (ws64(new) - ws64(base)) % (1 << 64)
    else:
        assert changes.ws64_delta is None


def test_changes_between_identical_tensors_is_empty():
    base = random_tensor(torch.bfloat16, 4096, seed=1)
    changes = changes_between(base, base.clone())
    assert changes.positions.numel() == 0 and changes.values.numel() == 0 and changes.ws64_delta == 0


def test_the_byte_layout_is_the_documented_one():
    base = torch.zeros(20, dtype=torch.float16)
    new = base.clone()
    new[3], new[4], new[17] = 1.0, 2.0, -0.0  # -0.0 against 0.0 is a change: raw bits differ
    positions, data = encoded(base, new, POSITIONS)
    values = bytes(torch.tensor([1.0, 2.0, -0.0], dtype=torch.float16).view(torch.uint8).tolist())
    assert bytes(data.tolist()) == (3).to_bytes(4, "little") + (4).to_bytes(4, "little") + (17).to_bytes(4, "little") \
        + values
    _, data = encoded(base, new, GAPS)
    assert bytes(data.tolist()) == (3).to_bytes(2, "little") + (0).to_bytes(2, "little") + (12).to_bytes(2, "little") \
        + values
    _, data = encoded(base, new, BITMASK)
    assert bytes(data.tolist()) == bytes([0b00011000, 0, 0b00000010]) + b"\0" + values  # 3 bytes, padded to 4


def test_nan_payloads_count_as_changes():
    base = torch.tensor([float("nan")] * 4)
    new = base.clone()
    new.view(torch.int32)[2] ^= 1  # another NaN
    assert changed_positions(base, new).tolist() == [2]


@pytest.mark.parametrize(("density", "expected"), [(0.0005, GAPS), (0.3, BITMASK)])
def test_the_smallest_encoding_is_chosen(density, expected):
    base = torch.zeros(1 << 16, dtype=torch.bfloat16)
    new = changed_copy(base, density, seed=3)
    assert smallest_encoding(changed_positions(base, new), new.numel(), 2).encoding == expected


def test_gaps_are_not_chosen_when_a_gap_does_not_fit():
    positions = torch.tensor([0, 70_000])
    assert smallest_encoding(positions, 100_000, 4).encoding == POSITIONS


def patch_bytes(positions: list[int], values: torch.Tensor, width=torch.int32) -> torch.Tensor:
    return torch.cat([torch.tensor(positions, dtype=width).view(torch.uint8), values.view(torch.uint8)])


@pytest.mark.parametrize(("positions", "reason"), [
    ([1, 10], "PATCH_INDEX_OUT_OF_RANGE"),
    ([-1, 3], "PATCH_INDEX_OUT_OF_RANGE"),
    ([5, 3], "PATCH_INDEX_UNSORTED"),
    ([3, 3], "PATCH_INDEX_UNSORTED"),
])
def test_bad_positions_are_refused(positions, reason):
    data = patch_bytes(positions, torch.ones(2))
    with pytest.raises(InvalidArgument) as caught:
        decode_patch(data, encoding=POSITIONS, numel=10, count=2, itemsize=4, tensor="w")
    assert caught.value.reason == reason


def test_a_bitmask_must_agree_with_its_count_and_size():
    mask_with_three = torch.tensor([0b00000111, 0], dtype=torch.uint8)
    data = torch.cat([mask_with_three, torch.zeros(2, dtype=torch.uint8), torch.ones(2).view(torch.uint8)])
    with pytest.raises(InvalidArgument) as caught:
        decode_patch(data, encoding=BITMASK, numel=10, count=2, itemsize=4, tensor="w")
    assert caught.value.reason == "PATCH_COUNT_MISMATCH"
    past_the_end = torch.tensor([0b00000001, 0b00000100], dtype=torch.uint8)  # bit 10 of a 10-element tensor
    data = torch.cat([past_the_end, torch.zeros(2, dtype=torch.uint8), torch.ones(2).view(torch.uint8)])
    with pytest.raises(InvalidArgument) as caught:
        decode_patch(data, encoding=BITMASK, numel=10, count=2, itemsize=4, tensor="w")
    assert caught.value.reason == "PATCH_INDEX_OUT_OF_RANGE"


def test_an_empty_patch_leaves_the_checksum():
    base = torch.arange(10, dtype=torch.float32)
    empty = DecodedPatch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.uint8))
    assert ws64_after_patch(ws64(base), base, empty) == ws64(base)
