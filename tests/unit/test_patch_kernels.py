"""PATCH_XOR: the numba kernels (common.patch_kernels) against the reference (common.patch_format)
bit for bit, both against the truth (a raw-bits comparison and common.checksum.ws64), the byte
layout pinned by hand-worked examples (docs/data-plane.md, PATCH_XOR), and every refusal."""

from __future__ import annotations

import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from weightsync.common import patch_format as pf
from weightsync.common import patch_kernels as pk
from weightsync.common import patches as pp
from weightsync.common.checksum import ws64
from weightsync.common.dtypes import SUPPORTED_PROTO_DTYPES, to_torch
from weightsync.common.errors import InvalidArgument

DTYPES = [to_torch(d) for d in SUPPORTED_PROTO_DTYPES]
FLOATS = [d for d in DTYPES if d.is_floating_point]
DENSITIES = [0.0, "one", 0.01, 0.05, 0.5, 1.0]
KINDS = ["ulp", "random", "special"]
MASK = (1 << 64) - 1
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "data-plane.md"


def itemsize_of(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def special_bits(dtype: torch.dtype) -> np.ndarray:
    """Bit patterns of 0.0, -0.0, +-inf, NaNs with different payloads and signs, and normals."""
    if dtype == torch.bool:
        return np.array([0, 1], np.uint8)
    values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.5, 1e-3])
    patterns = pf.bits(values.to(dtype)).copy() if dtype.is_floating_point else pf.bits(values.nan_to_num().to(dtype)).copy()
    nan = patterns[4]
    return np.concatenate([patterns, [nan ^ 1, nan | (1 << (8 * patterns.itemsize - 1))]]).astype(patterns.dtype)


def make_base(dtype: torch.dtype, numel: int, offset: int, seed: int, kind: str) -> torch.Tensor:
    """numel elements at `offset` elements into their storage (offset 1: not 8-byte aligned)."""
    g = np.random.default_rng(seed)
    storage = torch.empty(numel + offset, dtype=dtype)
    flat = pf.bits(storage)
    if kind == "special":
        flat[:] = g.choice(special_bits(dtype), numel + offset)
    elif dtype == torch.bool:
        flat[:] = g.integers(0, 2, numel + offset, dtype=np.uint8)
    else:
        flat[:] = g.integers(0, np.iinfo(flat.dtype).max, numel + offset, dtype=flat.dtype, endpoint=True)
    return storage[offset:]


def make_new(base: torch.Tensor, density, kind: str, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed + 1)
    storage = torch.empty(base.numel() + base.storage_offset(), dtype=base.dtype)
    new = storage[base.storage_offset():]
    new.copy_(base)
    flat, numel = pf.bits(new), base.numel()
    if not numel or density == 0.0:
        return new
    how_many = 1 if density == "one" else max(1, round(density * numel))
    where = np.sort(g.choice(numel, how_many, replace=False))
    if base.dtype == torch.bool:
        flat[where] ^= 1
    elif kind == "ulp":  # one ulp away from zero, wrapping like the bits do
        flat[where] += flat.dtype.type(1)
    elif kind == "random":
        flat[where] = g.integers(0, np.iinfo(flat.dtype).max, how_many, dtype=flat.dtype, endpoint=True)
    else:  # special: 0.0 <-> -0.0, NaN payloads, infinities
        flat[where] = g.choice(special_bits(base.dtype), how_many)
    return new


def assert_everything_agrees(base: torch.Tensor, new: torch.Tensor, threads: int = 1) -> bytes:
    numel, itemsize = base.numel(), base.element_size()
    a, b = pf.bits(base), pf.bits(new)
    truth = np.flatnonzero(a != b)
    data, count, delta = pf.encode(base, new)
    # the reference against the truth
    assert count == truth.size
    assert (ws64(base) + delta) & MASK == ws64(new)
    positions, xor = pf.decode(data, numel, itemsize, count)
    np.testing.assert_array_equal(positions, truth)
    np.testing.assert_array_equal(xor, (a ^ b)[truth])
    # the kernels against the reference, bit for bit
    patch = pk.compare_and_encode(base, new, threads)
    assert bytes(patch.data.numpy()) == data
    assert (patch.count, patch.ws64_delta) == (count, delta)
    k_positions, k_xor = pk.decode_xor(patch.data, numel, itemsize, count)
    np.testing.assert_array_equal(k_positions, truth)
    np.testing.assert_array_equal(k_xor, xor)
    before = a.copy()
    assert pk.check_patch(patch.data, base, numel, itemsize, count, live_ws64=ws64(base)) == ws64(new)
    checksum, kept_positions, kept_values = pk.decode_new_values(data, base, count, live_ws64=ws64(base))
    np.testing.assert_array_equal(a, before)  # neither wrote a byte
    assert checksum == ws64(new)
    np.testing.assert_array_equal(kept_positions.numpy(), truth)
    np.testing.assert_array_equal(pf.bits(kept_values), b[truth])
    for apply in (lambda t: pk.apply_patch(patch.data, t, count), lambda t: pf.apply(data, t, count),
                  lambda t: pk.scatter_values(t, kept_positions, kept_values)):
        target = base.clone()
        apply(target)
        np.testing.assert_array_equal(pf.bits(target), b)
    target = base.clone()
    assert pk.apply_patch(data, target, count) == delta
    target = base.clone()  # checked while it applies: the same bytes, the same WS64
    assert pk.apply_checked(patch.data, target, count, live_ws64=ws64(base)) == ws64(new)
    np.testing.assert_array_equal(pf.bits(target), b)
    # advance_base: the same patch, and the base made the new tensor in the same pass
    advanced = same_offset_copy(base)
    moved = pk.compare_and_encode(advanced, new, threads, advance_base=True)
    assert bytes(moved.data.numpy()) == data and (moved.count, moved.ws64_delta) == (count, delta)
    np.testing.assert_array_equal(pf.bits(advanced), b)
    np.testing.assert_array_equal(pf.bits(new), b)  # new is only read
    return data


def same_offset_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy at the same element offset into its storage (so unaligned stays unaligned)."""
    storage = torch.empty(tensor.numel() + tensor.storage_offset(), dtype=tensor.dtype)
    copy = storage[tensor.storage_offset():]
    copy.copy_(tensor)
    return copy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel,offset", [(0, 0), (1, 0), (7, 0), (8, 0), (1000, 0), (7, 1), (1000, 1), (1003, 3)])
def test_kernels_equal_the_reference_small(dtype, numel, offset):
    for kind in KINDS if dtype in FLOATS else KINDS[:2]:
        for density in DENSITIES:
            base = make_base(dtype, numel, offset, numel, kind)
            assert_everything_agrees(base, make_new(base, density, kind, numel))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_kernels_equal_the_reference_large(dtype, offset):
    numel = (1 << 16) + 3
    densities = DENSITIES if dtype == torch.bfloat16 else ["one", 0.05, 1.0]
    for density in densities:
        base = make_base(dtype, numel, offset, 7, "random")
        assert_everything_agrees(base, make_new(base, density, "ulp", 7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64], ids=str)
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_ranges_stitch_into_one_patch(monkeypatch, dtype, threads):
    """Ranges encoded apart, stitched (first gaps, bitmask bytes, sparse bitmaps that share a
    byte): the same bytes as one range."""
    monkeypatch.setattr(pk, "MIN_BYTES_PER_THREAD", 8)
    for numel, offset in [(1000, 0), (5003, 1), (20_000, 0)]:
        for density in ["one", 0.003, 0.05, 0.5, 1.0]:
            for kind in ("ulp", "random"):
                base = make_base(dtype, numel, offset, numel, "random")
                new = make_new(base, density, kind, numel + threads)
                assert_everything_agrees(base, new, threads)


def test_the_worked_example_is_the_documented_one():
    base = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, 1.0, -0.0, 0.25, 2.0, 1.5], dtype=torch.bfloat16)
    new = base.clone()
    pf.bits(new)[[1, 4, 8]] = [0xC001, 0x403F, 0x3FFF]  # one ulp each (4 and 8 downwards)
    expected = bytes.fromhex("01 12 01 01 02 01 7f ff 04 7f")
    patch = pk.compare_and_encode(base, new)
    assert bytes(patch.data.numpy()) == expected
    assert (patch.count, patch.ws64_delta) == (3, 0x62A41EAAFFA19395)
    assert (ws64(base), ws64(new)) == (0x80AB5EC1D4A03FD4, 0xE34F7D6CD441D369)
    assert assert_everything_agrees(base, new) == expected
    gaps_form = bytes.fromhex("00 01 02 03 01 02 01 7f ff 04 7f")  # valid too, one byte longer
    for data in (expected, gaps_form):
        positions, xor = pk.decode_xor(data, 10, 2, 3)
        assert positions.tolist() == [1, 4, 8] and xor.tolist() == [0x0001, 0x007F, 0x7FFF]
        assert pk.check_patch(data, base, 10, 2, 3, live_ws64=ws64(base)) == ws64(new)
    doc = EXAMPLE.read_text()
    assert "`01 12 01 01 02 01 7f ff 04 7f`" in doc and "`00 01 02 03 01 02 01 7f ff 04 7f`" in doc
    assert all(h in doc for h in ("0x62a41eaaffa19395", "0x80ab5ec1d4a03fd4", "0xe34f7d6cd441d369"))


def test_a_hand_worked_gaps_example_with_zero_planes_and_ties():
    """float32, 300 elements, XOR 0x00000001 at 5 and 0x00010000 at 200: gaps 5 and 194 (c2 01)
    beat a 38-byte bitmask; planes 0 and 2 tie DENSE/SPARSE at 2 bytes (DENSE, the lower kind);
    planes 1 and 3 are ZERO."""
    base = torch.zeros(300, dtype=torch.float32)
    new = base.clone()
    pf.bits(new)[[5, 200]] = [0x00000001, 0x00010000]
    expected = bytes.fromhex("00 05 c2 01 01 00 01 00 01 00 00 01")
    assert bytes(pk.compare_and_encode(base, new).data.numpy()) == expected
    assert assert_everything_agrees(base, new) == expected


def test_the_index_is_a_bitmask_only_when_strictly_smaller():
    base = torch.zeros(16, dtype=torch.uint8)
    new = base.clone()
    new[[0, 1]] = 1  # gaps 00 00 (2 bytes) == bitmask (2 bytes): gaps
    assert pk.compare_and_encode(base, new).data[0] == pf.INDEX_GAPS
    new[2] = 1  # 3 bytes of gaps > 2 of bitmask
    assert pk.compare_and_encode(base, new).data[0] == pf.INDEX_BITMASK


def test_limit_bytes_skips_writing_a_patch_that_does_not_pay():
    base = make_base(torch.bfloat16, 10_000, 0, 1, "random")
    new = make_new(base, 0.05, "ulp", 1)
    full = pk.compare_and_encode(base, new)
    assert pk.compare_and_encode(base, new, limit_bytes=full.data.numel() - 1) is None
    assert torch.equal(pk.compare_and_encode(base, new, limit_bytes=full.data.numel()).data, full.data)



@pytest.mark.parametrize("threads", [1, 2, 3])
def test_compare_many_is_compare_and_encode_per_tensor(monkeypatch, threads):
    """The batch the SDK runs (tensors shared out whole, the largest split): per tensor, in order,
    the bytes, count and WS64 change of compare_and_encode, None where the limit declines."""
    monkeypatch.setattr(pk, "SPLIT_ABOVE_BYTES", 40_000)  # the 20_000-element float32 pair is split
    monkeypatch.setattr(pk, "MIN_BYTES_PER_THREAD", 8)
    pairs, expected = [], []
    for i, (dtype, numel, density, offset) in enumerate([
            (torch.bfloat16, 5003, 0.01, 0), (torch.float32, 20_000, 0.05, 1), (torch.uint8, 7, "one", 0),
            (torch.bfloat16, 0, 0.0, 0), (torch.float64, 1000, 0.0, 0), (torch.bfloat16, 3000, 0.5, 0),
            (torch.int32, 1031, 0.003, 3)]):
        base = make_base(dtype, numel, offset, i, "random")
        new = make_new(base, density, "ulp", i)
        full = pk.compare_and_encode(base, new)
        limit = full.data.numel() - 1 if i == 5 else (full.data.numel() if i == 0 else None)
        pairs.append((base, new, limit))
        expected.append(None if i == 5 else full)
    got = pk.compare_many(pairs, threads)
    assert [g is None for g in got] == [e is None for e in expected] == [False] * 5 + [True, False]
    for g, e in zip(got, expected, strict=True):
        if e is not None:
            assert bytes(g.data.numpy()) == bytes(e.data.numpy())
            assert (g.count, g.ws64_delta) == (e.count, e.ws64_delta)
    assert got[3].count == got[4].count == 0
    advanced = [(same_offset_copy(base), new, limit) for base, new, limit in pairs]
    moved = pk.compare_many(advanced, threads, advance_base=True)
    for m, g in zip(moved, got, strict=True):
        assert (m is None) == (g is None)
        if g is not None:
            assert bytes(m.data.numpy()) == bytes(g.data.numpy()) and (m.count, m.ws64_delta) == (g.count, g.ws64_delta)
    for base, new, _ in advanced:  # every base is the new tensor, the declined one (limit) too
        np.testing.assert_array_equal(pf.bits(base), pf.bits(new))
    with pytest.raises(ValueError, match="base and new differ"):  # a worker's error reaches the caller
        pk.compare_many(pairs[:2] + [(pairs[0][0], pairs[1][1], None)], threads)
    assert pk.compare_many([], threads) == []

def test_count_changed_and_samples():
    base = make_base(torch.bfloat16, 100_003, 1, 3, "random")
    new = make_new(base, 0.05, "random", 3)
    truth = int((pf.bits(base) != pf.bits(new)).sum())
    assert pk.count_changed(base, new) == truth
    layout = pp.sample_layout(100_003, 4096)
    assert (layout.blocks, layout.stride, layout.run) == (256, 390, 16)
    sampled = int((layout.of(pp.bits_of(base)) != layout.of(pp.bits_of(new))).sum())
    assert pk.count_changed(base, new, layout) == sampled and 0 < sampled < truth
    assert layout.of(pp.bits_of(new))[16].item() == pp.bits_of(new)[390].item()  # the second run starts there


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.bool])
@pytest.mark.parametrize(("numel", "elements"), [(1, 4096), (9, 4096), (4096, 4096), (4097, 4096), (100_003, 4096),
                                                  (100_003, 32), (4096 * 3 + 1, 1024)])
def test_resample_is_the_torch_sample_bit_for_bit(dtype, numel, elements):
    layout = pp.sample_layout(numel, elements)
    assert layout.size == min(numel, elements)
    old = make_base(dtype, numel, 0, numel + elements, "random")  # raw random bits: NaN payloads included
    new = make_new(old, 0.3, "random", numel)
    if dtype.is_floating_point and numel > 1:  # bits, not values: -0.0 against 0.0
        old[0], new[0] = 0.0, -0.0
    sample = layout.of(pp.bits_of(old)).clone()
    changed, fresh = pk.resample(new, layout, sample)
    reference = layout.of(pp.bits_of(new))
    assert fresh.dtype == reference.dtype and torch.equal(fresh, reference)
    assert changed == int((reference != sample).sum()) == pk.count_changed(old, new, layout)
    if dtype.is_floating_point and numel > 1:
        assert changed >= 1


def test_resample_refuses_a_sample_of_another_tensor():
    new = torch.zeros(10_000, dtype=torch.bfloat16)
    layout = pp.sample_layout(10_000, 1024)
    with pytest.raises(ValueError, match="not one of 10000 elements"):
        pk.resample(new, layout, pp.sample_layout(9_000, 512).of(pp.bits_of(new)).clone())
    with pytest.raises(ValueError, match="not one of 10000 elements"):
        pk.resample(new, layout, layout.of(pp.bits_of(new.float())).clone())
    with pytest.raises(ValueError, match="does not sample a tensor of 10000 elements"):
        pk.count_changed(new, new, pp.sample_layout(20_000, 1024))


def test_calls_from_many_threads_at_once(monkeypatch):
    monkeypatch.setattr(pk, "MIN_BYTES_PER_THREAD", 1024)
    pairs = []
    for seed in range(8):
        base = make_base(torch.bfloat16, 200_000, seed % 2, seed, "random")
        pairs.append((base, make_new(base, 0.02, "ulp", seed)))
    expected = [bytes(pk.compare_and_encode(b, n).data.numpy()) for b, n in pairs]
    got: dict[int, bytes] = {}

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = bytes(pk.compare_and_encode(*pairs[i], 2).data.numpy())
            data = np.frombuffer(got[i], np.uint8)
            target = pairs[i][0].clone()
            pk.apply_patch(data, target, pk.compare_and_encode(*pairs[i]).count)
            assert torch.equal(target.view(torch.int16), pairs[i][1].view(torch.int16))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(pairs))] == expected


def test_warm_up_is_idempotent():
    pk.warm_up()
    pk.warm_up()


def test_host_tensors_only():
    with pytest.raises(ValueError, match="contiguous"):
        pk.compare_and_encode(torch.zeros(4, 4).t(), torch.zeros(4, 4).t())


# -- refusals --------------------------------------------------------------------------------
WORKED = "01 12 01 01 02 01 7f ff 04 7f"  # bf16, numel 10, count 3
MALFORMED_CASES = [
    # (name, hex bytes, numel, itemsize, count, reason)
    ("count above numel", WORKED, 10, 2, 11, pf.COUNT_MISMATCH),
    ("negative count", WORKED, 10, 2, -1, pf.COUNT_MISMATCH),
    ("no bytes at all", "", 10, 2, 0, pf.MALFORMED),
    ("unknown index kind", "02" + WORKED[2:], 10, 2, 3, pf.MALFORMED),
    ("varint past the end", "00 80", 10, 1, 1, pf.MALFORMED),
    ("varint over 10 bytes", "00" + " 80" * 10 + " 00 00", 1 << 62, 1, 1, pf.MALFORMED),
    ("varint over int64", "00" + " ff" * 9 + " 01 00", 1 << 62, 1, 1, pf.MALFORMED),
    ("bitmask cut short", "01 12", 10, 2, 3, pf.MALFORMED),
    ("plane kinds cut short", "01 12 01 01", 10, 2, 3, pf.MALFORMED),
    ("unknown plane kind", "01 12 01 01 03 01 7f ff 04 7f", 10, 2, 3, pf.MALFORMED),
    ("dense plane cut short", "01 12 01 01 02 01 7f", 10, 2, 3, pf.MALFORMED),
    ("sparse bitmap bit past count", "01 12 01 01 02 01 7f ff 0c 7f 7f", 10, 2, 3, pf.MALFORMED),
    ("sparse bytes cut short", "01 12 01 01 02 01 7f ff 04", 10, 2, 3, pf.MALFORMED),
    ("a byte left over", WORKED + " 00", 10, 2, 3, pf.MALFORMED),
    ("count below the varints", "00 01 02 03 01 02 01 7f ff 04 7f", 10, 2, 2, pf.MALFORMED),
    ("bitmask bit past numel", "01 00 04 00", 10, 1, 1, pf.OUT_OF_RANGE),
    ("bitmask bits below count", "01 12 01 00 00", 10, 2, 2, pf.COUNT_MISMATCH),
    ("bitmask bits above count", "01 12 01 00 00", 10, 2, 4, pf.COUNT_MISMATCH),
    ("position at numel", "00 0a 01 05", 10, 1, 1, pf.OUT_OF_RANGE),
    ("a later position past numel", "00 01 02 09 01 01 01 01", 10, 1, 3, pf.OUT_OF_RANGE),
    ("a gap near 2^63 (no overflow)", "00 00" + " ff" * 8 + " 7f 01 01 01", 10, 1, 2, pf.OUT_OF_RANGE),
]


def outcome(call):
    try:
        return "ok", call()
    except InvalidArgument as error:
        return "refused", error.reason


@pytest.mark.parametrize("name,hexdata,numel,itemsize,count,reason", MALFORMED_CASES, ids=[c[0] for c in MALFORMED_CASES])
def test_malformed_patches_are_refused_without_a_write(name, hexdata, numel, itemsize, count, reason):
    data = bytes.fromhex(hexdata)
    with pytest.raises(InvalidArgument) as refused:
        pf.decode(data, numel, itemsize, count, tensor="w")
    assert refused.value.reason == reason and "'w'" in refused.value.message
    assert outcome(lambda: pk.decode_xor(data, numel, itemsize, count, tensor="w")) == ("refused", reason)
    if numel > 1 << 20:
        return  # no live tensor that big; decode_xor and the reference cover it
    dtype = {1: torch.uint8, 2: torch.bfloat16}[itemsize]
    live = make_base(dtype, numel, 1, 0, "random")
    before = pf.bits(live).copy()
    assert outcome(lambda: pk.check_patch(data, live, numel, itemsize, count, live_ws64=0, tensor="w")) == ("refused", reason)
    assert outcome(lambda: pk.decode_new_values(data, live, count, live_ws64=0, tensor="w")) == ("refused", reason)
    np.testing.assert_array_equal(pf.bits(live), before)
    guarded = make_base(dtype, numel + 16, 0, 1, "random")
    target, guard = guarded[8: 8 + numel], pf.bits(guarded).copy()
    assert outcome(lambda: pk.apply_patch(data, target, count, tensor="w")) == ("refused", reason)
    np.testing.assert_array_equal(pf.bits(guarded)[:8], guard[:8])  # never a byte outside target
    np.testing.assert_array_equal(pf.bits(guarded)[8 + numel:], guard[8 + numel:])
    guarded = make_base(dtype, numel + 16, 0, 1, "random")
    target = guarded[8: 8 + numel]
    assert outcome(lambda: pk.apply_checked(data, target, count, live_ws64=0, tensor="w")) == ("refused", reason)
    np.testing.assert_array_equal(pf.bits(guarded), guard)  # checked as it applied: refused, nothing changed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_a_patch_refused_half_way_through_applying_is_taken_back(dtype):
    """A patch made for a longer tensor applied to a shorter one: well formed (a gaps index: a
    bitmask's length would give it away before any write), its positions valid for thousands of
    changes (many of the kernel's batches written), then one past the end. The fused
    check-and-apply stops there and takes back what it wrote: the target bit for bit as it was."""
    numel = 40_000
    longer = make_base(dtype, numel + 5_000, 0, 3, "random")
    data, count, _ = pf.encode(longer, make_new(longer, 0.05, "random", 4))
    assert data[0] == pf.INDEX_GAPS and count > 2_000
    target = longer[:numel].clone()
    before = pf.bits(target).copy()
    assert outcome(lambda: pk.apply_checked(data, target, count, live_ws64=0, tensor="w")) == ("refused", pf.OUT_OF_RANGE)
    np.testing.assert_array_equal(pf.bits(target), before)
    # and a patch whose WS64 the caller refuses is taken back whole by apply_patch
    good, good_count, _ = pf.encode(target, make_new(target, 0.01, "ulp", 5))
    pk.apply_checked(good, target, good_count, live_ws64=ws64(target))
    pk.apply_patch(good, target, good_count)
    np.testing.assert_array_equal(pf.bits(target), before)


def test_accepted_oddities():
    """Not refused: a non-minimal 10-byte varint, a zero XOR, a DENSE plane of zeros, a SPARSE
    bit whose byte is 0 (harmless, and cheaper not to look)."""
    for data, numel, count in [("00" + " 80" * 9 + " 00 00", 10, 1), ("00 03 01 00", 10, 1),
                               ("00 03 02 01 00", 10, 1)]:
        raw = bytes.fromhex(data)
        assert outcome(lambda raw=raw, numel=numel, count=count: pf.decode(raw, numel, 1, count)[0].tolist()) == \
            outcome(lambda raw=raw, numel=numel, count=count: pk.decode_xor(raw, numel, 1, count)[0].tolist())
        pf.decode(raw, numel, 1, count)


def mutations(data: bytes, rng: random.Random):
    for _ in range(150):
        raw = bytearray(data)
        what = rng.randrange(5)
        if what == 0 and raw:
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif what == 1 and raw:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif what == 2:
            raw.insert(rng.randrange(len(raw) + 1), rng.randrange(256))
        elif what == 3 and raw:
            del raw[rng.randrange(len(raw))]
        yield bytes(raw), rng.choice([0, 0, 0, 1, -1])


@pytest.mark.parametrize("dtype,numel,density,kind", [(torch.bfloat16, 10, 0.3, "ulp"), (torch.bfloat16, 300, 0.02, "ulp"),
                                                      (torch.float32, 200, 0.5, "random"), (torch.uint8, 40, 0.9, "random"),
                                                      (torch.float64, 100, 0.05, "special")])
def test_fuzzed_patches_get_the_reference_answer(dtype, numel, density, kind):
    """Random corruptions: the kernels refuse with the reference's reason, or accept and agree."""
    base = make_base(dtype, numel, 0, numel, kind)
    data, count, _ = pf.encode(base, make_new(base, density, kind, numel))
    rng = random.Random(numel)
    itemsize = itemsize_of(dtype)
    for raw, count_change in mutations(data, rng):
        n = count + count_change
        want = outcome(lambda raw=raw, n=n: pf.decode(raw, numel, itemsize, n))
        got = outcome(lambda raw=raw, n=n: pk.decode_xor(raw, numel, itemsize, n))
        if want[0] == "refused":
            assert got == want, (raw.hex(" "), n)
            continue
        assert got[0] == "ok", (raw.hex(" "), n, got)
        np.testing.assert_array_equal(got[1][0], want[1][0])
        np.testing.assert_array_equal(got[1][1], want[1][1])
        assert pk.check_patch(raw, base, numel, itemsize, n, live_ws64=ws64(base)) == pf.patched_ws64(raw, base, n)


def test_example_doc_hex_matches_its_table():
    """The doc's table and its bytes say the same thing (a drifted edit fails here)."""
    doc = EXAMPLE.read_text()
    rows = re.findall(r"\| (\d) \| [^|]+ \| `([0-9a-f]{4})` \| [^|]+ \| `([0-9a-f]{4})` \| `([0-9a-f]{4})` \|", doc)
    assert [(int(p), int(o, 16) ^ int(n, 16)) for p, o, n, _ in rows] == [(int(p), int(x, 16)) for p, _, _, x in rows]
    assert [int(p) for p, *_ in rows] == [1, 4, 8]


def test_the_kernels_use_the_checksum_constants():
    from weightsync.common import patch_jit
    from weightsync.common.checksum import COLUMN_FACTOR, ROW_WORDS

    assert int(patch_jit.C) == COLUMN_FACTOR and ROW_WORDS == 512 == int(patch_jit.U511) + 1
