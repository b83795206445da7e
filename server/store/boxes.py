"""Where a box's bytes land in its whole tensor (TensorSpec.box), as pure functions of shapes and ranges.

A box of a tensor travels as its elements in row-major order over the box; a box larger than a
bucket travels as pieces, each a contiguous range of those elements. In the whole tensor such a
range is not contiguous: `sub_boxes` cuts it into rectangular sub-boxes of the tensor, each of which
is one strided slice there (what a worker copies with one `copy_`), and contiguous, in order, in the
range. A range of a box of rank r takes at most 2r - 1 of them (a scalar's one box: 1):
the end of a partial first row of dimension 0 (at most r - 1 sub-boxes, recursively), the whole rows
between (1), the start of a partial last row (at most r - 1).

Nothing here allocates or reads a tensor; tests/unit/test_box_geometry.py checks it against a brute-force
index mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Index = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SubBox:
    """A rectangle of the whole tensor (indices offsets[d] <= i < offsets[d] + sizes[d]): its row-major
    elements are elements [start, start + numel) of the range."""

    offsets: Index
    """Where the sub-box starts, per dimension of the whole tensor."""
    sizes: Index
    """Its extent per dimension, each >= 1."""
    start: int
    """Its first element's position in the range (0 for the first sub-box)."""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _local(shape: Index, start: int, stop: int) -> list[tuple[Index, Index]]:
    """Elements [start, stop) (row-major, 0 <= start < stop <= numel) of a block of `shape` as rectangles
    of it, in order: (offsets, sizes) relative to the block."""
    if not shape:
        return [((), ())]
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    if first == last:  # inside one row of dimension 0
        return [((first, *o), (1, *s)) for o, s in _local(inner_shape, head, tail)]
    out: list[tuple[Index, Index]] = []
    if head:
        out.extend(((first, *o), (1, *s)) for o, s in _local(inner_shape, head, inner))
        first += 1
    if last > first:
        out.append(((first, *(0,) * len(inner_shape)), (last - first, *inner_shape)))
    if tail:
        out.extend(((last, *o), (1, *s)) for o, s in _local(inner_shape, 0, tail))
    return out


def sub_boxes(offsets: Index, sizes: Index, first: int, count: int) -> tuple[SubBox, ...]:
    """The elements [first, first + count) of the box (offsets, sizes) of a tensor, in the box's row-major
    order, as sub-boxes of the tensor (tensor coordinates), in order. Raises ValueError for a range outside
    the box or a box with a size < 1 (plan validation refuses both before this runs)."""
    if len(offsets) != len(sizes) or any(s < 1 for s in sizes) or any(o < 0 for o in offsets):
        raise ValueError(f"not a box: offsets {list(offsets)}, sizes {list(sizes)}")
    numel = math.prod(sizes)
    if first < 0 or count < 1 or first + count > numel:
        raise ValueError(f"elements [{first}, +{count}) are not inside a box of {numel}")
    out = []
    start = 0
    for local_offsets, local_sizes in _local(tuple(sizes), first, first + count):
        box = SubBox(tuple(o + b for o, b in zip(local_offsets, offsets, strict=True)), local_sizes, start)
        out.append(box)
        start += box.numel
    return tuple(out)


def max_sub_boxes(rank: int) -> int:
    """The most sub-boxes `sub_boxes` returns for a box of this rank."""
    return max(1, 2 * rank - 1)


def inside(offsets: Index, sizes: Index, shape: Index) -> bool:
    """The box has the shape's rank, every size >= 1, and lies inside the shape."""
    return (len(offsets) == len(shape) == len(sizes)
            and all(o >= 0 and s >= 1 and o + s <= d for o, s, d in zip(offsets, sizes, shape, strict=True)))


__all__ = ["SubBox", "sub_boxes", "max_sub_boxes", "inside"]
