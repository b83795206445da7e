"""Client-side planning: packed buckets, zero-copy buckets, emission order."""

from __future__ import annotations

import pytest
import torch

from weightsync.client.buckets.planning import build_plan

MiB = 1 << 20


def f32(numel: int) -> torch.Tensor:
    return torch.zeros(numel)


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        # tensor sizes in float32 elements -> [(names, zero-copy?)] per bucket, in emission order
        ([16, 16], [(("t0", "t1"), False)]),
        ([MiB, 16], [(("t0",), True), (("t0",), True), (("t1",), False)]),  # 4 MiB: pieces, from its own memory
        ([16, MiB, 16], [(("t1",), True), (("t1",), True), (("t0", "t2"), False)]),  # the packed bucket stays open
        ([MiB * 3 // 4, 16], [(("t0",), False), (("t1",), False)]),  # 3 MiB: a bucket, under the zero-copy size
        ([MiB // 2, MiB // 2], [(("t0",), False), (("t1",), False)]),  # 2 MiB each: packed, 3 MiB buckets
    ],
)
def test_bucket_kinds_and_order(sizes, expected):
    named = [(f"t{i}", f32(n)) for i, n in enumerate(sizes)]
    planned = build_plan(named, bucket_size_bytes=3 * MiB, zero_copy_min_bytes=4 * MiB)
    got = [(tuple(t.name for t in p.spec.tensors), p.flat_source is not None) for p in planned]
    assert got == expected


def test_zero_copy_bucket_aliases_the_tensor():
    big = torch.randn(MiB)
    (planned,) = build_plan([("big", big)], bucket_size_bytes=4 * MiB, zero_copy_min_bytes=MiB)
    assert planned.flat_source.data_ptr() == big.data_ptr()
    assert planned.spec.size_bytes == 4 * MiB


def test_non_contiguous_large_tensor_is_packed():
    big = torch.randn(2048, 1024).t()
    (planned,) = build_plan([("big", big)], bucket_size_bytes=8 * MiB, zero_copy_min_bytes=MiB)
    assert planned.flat_source is None


def test_a_tensor_larger_than_a_bucket_is_cut_into_pieces_of_its_own_memory():
    big = torch.randn(MiB + 1)  # 4 MiB + 4 bytes: the last piece takes 64 bytes from the one before
    planned = build_plan([("big", big)], bucket_size_bytes=MiB, zero_copy_min_bytes=MiB)
    spans = [(p.spec.tensors[0].piece.offset_bytes, p.spec.size_bytes) for p in planned]
    assert spans == [(0, MiB), (MiB, MiB), (2 * MiB, MiB), (3 * MiB, MiB - 64), (4 * MiB - 64, 68)]
    assert [p.flat_source.data_ptr() for p in planned] == [big.data_ptr() + start for start, _ in spans]
    transposed = torch.randn(1024, 2048).t()
    assert all(p.flat_source is None for p in build_plan([("t", transposed)], MiB, MiB))  # packed pieces


def test_flat_parameter_views_keep_their_offsets():
    flat = torch.zeros(1000, dtype=torch.bfloat16)
    named = [("a", flat[0:10]), ("b", flat[10:13]), ("c", flat[20:1000])]
    (planned,) = build_plan(named, bucket_size_bytes=MiB)
    assert [(t.name, t.offset_bytes, t.size_bytes) for t in planned.spec.tensors] == [
        ("a", 0, 20), ("b", 20, 6), ("c", 40, 1960)
    ]
    assert planned.spec.size_bytes == 2000
    assert planned.flat_source.data_ptr() == flat.data_ptr()


def test_duplicate_names_and_unsupported_dtypes_are_refused():
    with pytest.raises(ValueError, match="twice"):
        build_plan([("a", f32(1)), ("a", f32(1))], MiB)
    with pytest.raises(ValueError, match="complex64"):
        build_plan([("a", torch.zeros(2, dtype=torch.complex64))], MiB)


@pytest.mark.parametrize(("sizes", "buckets", "expected"), [
    ([300 << 10, 200 << 10, 100 << 10, 100 << 10], 2, [["p0", "p3"], ["p1", "p2"]]),  # largest first, to the lightest
    ([300 << 10, 200 << 10, 100 << 10, 100 << 10], 1, [["p0", "p1", "p2", "p3"]]),
    ([100 << 10, 100 << 10], 4, [["p0", "p1"]]),  # 200 KiB: under MIN_PATCH_BUCKET_BYTES a share
    ([600 << 10] + [10 << 10] * 6, 3, [["p0"], ["p1", "p2", "p3", "p4", "p5", "p6"]]),  # 660 KiB: two shares
    ([300 << 10] * 3 + [10 << 10] * 3, 3, [["p0", "p3"], ["p1", "p4"], ["p2", "p5"]]),
    ([], 2, []),
])
def test_patches_are_shared_out_one_bucket_per_worker(sizes, buckets, expected):
    """client/push/plans.py split_patches: exactly `buckets` shares where the bytes allow, balanced by bytes
    (largest first, each to the share holding least), each share in the patches' order."""
    from weightsync.client.push.plans import split_patches

    patches = [(f"p{i}", torch.empty(size, dtype=torch.uint8)) for i, size in enumerate(sizes)]
    assert [[name for name, _ in share] for share in split_patches(patches, buckets)] == expected
