"""server/store/boxes.py: a contiguous range of a box's row-major elements as sub-boxes of the whole tensor,
by literal tables and against a brute-force index mask over generated boxes and ranges."""

from __future__ import annotations

import math
import random

import pytest
import torch

from weightsync.server.store.boxes import SubBox, inside, max_sub_boxes, sub_boxes


@pytest.mark.parametrize(("offsets", "sizes", "first", "count", "expected"), [
    # a whole box is one sub-box
    ((2, 0), (3, 8), 0, 24, [SubBox((2, 0), (3, 8), 0)]),
    # a row range of a matrix, whole rows
    ((4, 0), (6, 8), 8, 16, [SubBox((5, 0), (2, 8), 0)]),
    # a partial first row, whole rows, a partial last row
    ((0, 0), (4, 8), 5, 20, [SubBox((0, 5), (1, 3), 0), SubBox((1, 0), (2, 8), 3), SubBox((3, 0), (1, 1), 19)]),
    # a column box (dim 1): rows of the box are 2 wide
    ((1, 6), (3, 2), 1, 4, [SubBox((1, 7), (1, 1), 0), SubBox((2, 6), (1, 2), 1), SubBox((3, 6), (1, 1), 3)]),
    # inside one row
    ((0, 3), (2, 5), 6, 3, [SubBox((1, 4), (1, 3), 0)]),
    # rank 3: the worst case, 2 * 3 - 1 sub-boxes
    ((0, 0, 0), (3, 2, 2), 1, 10, [SubBox((0, 0, 1), (1, 1, 1), 0), SubBox((0, 1, 0), (1, 1, 2), 1),
                                   SubBox((1, 0, 0), (1, 2, 2), 3), SubBox((2, 0, 0), (1, 1, 2), 7),
                                   SubBox((2, 1, 0), (1, 1, 1), 9)]),
    # a vector's box, and a scalar's
    ((10,), (5,), 1, 3, [SubBox((11,), (3,), 0)]),
    ((), (), 0, 1, [SubBox((), (), 0)]),
])
def test_literal_ranges(offsets, sizes, first, count, expected):
    assert list(sub_boxes(offsets, sizes, first, count)) == expected


@pytest.mark.parametrize(("offsets", "sizes", "first", "count"), [
    ((0, 0), (2, 2), 0, 5), ((0, 0), (2, 2), -1, 2), ((0, 0), (2, 2), 0, 0), ((0, 0), (2, 0), 0, 1),
    ((0,), (2, 2), 0, 1), ((-1, 0), (2, 2), 0, 1),
])
def test_a_range_outside_the_box_or_a_bad_box_is_refused(offsets, sizes, first, count):
    with pytest.raises(ValueError):
        sub_boxes(offsets, sizes, first, count)


def test_inside():
    assert inside((0, 2), (4, 6), (4, 8))
    assert not inside((0, 3), (4, 6), (4, 8))  # past the end of dim 1
    assert not inside((0,), (4,), (4, 8))  # another rank
    assert not inside((0, 0), (0, 8), (4, 8))  # an empty size
    assert not inside((-1, 0), (1, 8), (4, 8))


def _random_case(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]:
    rank = rng.randint(0, 4)
    shape = tuple(rng.randint(1, 6) for _ in range(rank))
    sizes = tuple(rng.randint(1, d) for d in shape)
    offsets = tuple(rng.randint(0, d - s) for d, s in zip(shape, sizes, strict=True))
    numel = math.prod(sizes)
    first = rng.randrange(numel)
    count = rng.randint(1, numel - first)
    return shape, offsets, sizes, first, count


def test_against_a_brute_force_index_mask():
    """Every generated range: the sub-boxes' elements, in order, are exactly the range's elements of the box
    (each element's flat index in the whole tensor), each sub-box inside the tensor, at most 2r - 1 of them."""
    rng = random.Random(35)
    for _ in range(3000):
        shape, offsets, sizes, first, count = _random_case(rng)
        index = torch.arange(math.prod(shape)).reshape(shape)
        box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        expected = box.reshape(-1)[first : first + count].tolist()
        got: list[int] = []
        cuts = sub_boxes(offsets, sizes, first, count)
        for cut in cuts:
            assert inside(cut.offsets, cut.sizes, shape), (shape, cut)
            assert cut.start == len(got)
            got.extend(index[tuple(slice(o, o + s) for o, s in zip(cut.offsets, cut.sizes, strict=True))]
                       .reshape(-1).tolist())
        assert got == expected, (shape, offsets, sizes, first, count, cuts)
        assert len(cuts) <= max_sub_boxes(len(shape))
