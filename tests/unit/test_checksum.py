"""WS64 against the straight transcription of the proto comment: the host kernel (CPU tensors) and
the torch reductions (any device) alike."""

from __future__ import annotations

import pytest
import torch

from weightsync.common.checksum import ROW_WORDS, ws64, ws64_reference, ws64_torch


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 4095, 4096, 4097, ROW_WORDS * 8 * 3 + 13, 100_003])
def test_ws64_matches_reference(n):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert ws64(data) == ws64_torch(data) == ws64_reference(bytes(data.tolist()))
    if n > 1:  # an odd start: the host kernel copies to an aligned buffer
        assert ws64(data[1:]) == ws64_torch(data[1:]) == ws64_reference(bytes(data[1:].tolist()))


def test_the_host_kernel_wraps_like_the_definition():
    """All-ones words over many rows: every product and sum overflows 2^64 many times."""
    data = torch.full((ROW_WORDS * 8 * 40 + 24,), 0xFF, dtype=torch.uint8)
    assert ws64(data) == ws64_torch(data) == ws64_reference(bytes(data.tolist()))


def test_known_values():
    assert ws64(torch.empty(0, dtype=torch.uint8)) == 0
    # One word 0x01: n=8, plus 1*(0+1) + C*1*(0+1).
    assert ws64(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)) == (8 + 1 + 0x9E3779B97F4A7C15) % 2**64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn])
def test_ws64_of_typed_and_misaligned_tensors(dtype):
    base = torch.randn(1001).to(dtype) if dtype != torch.bool else torch.rand(1001) > 0.5
    for view in (base, base[1:], base[3:900]):  # odd offsets need the aligned fallback
        raw = view.contiguous().view(torch.uint8) if dtype != torch.bool else view.contiguous().view(torch.uint8)
        assert ws64(view) == ws64_reference(bytes(raw.tolist()))


def test_ws64_sees_swapped_words_and_flipped_bits():
    data = torch.arange(4096, dtype=torch.int64)
    base = ws64(data)
    swapped = data.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert ws64(swapped) != base
    flipped = data.clone()
    flipped[777] ^= 1 << 40
    assert ws64(flipped) != base
    moved = data.clone()
    moved[[0, 512]] = moved[[512, 0]]  # same column, different row
    assert ws64(moved) != base


def test_ws64_noncontiguous_equals_contiguous():
    t = torch.randn(64, 48)
    assert ws64(t.t()) == ws64(t.t().contiguous())
