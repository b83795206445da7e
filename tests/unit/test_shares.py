"""share_out: which whole tensors each rank sends when every rank holds them all (integrations/shares.py)."""

from __future__ import annotations

import pytest

from weightsync.integrations.shares import share_out


@pytest.mark.parametrize(("sizes", "world", "expected"), [
    # one rank sends everything, in name order
    ([("b", 4), ("a", 8)], 1, [["a", "b"]]),
    # largest first, each to the least-loaded rank: a(8)->0, c(6)->1, b(4)->1 (6 < 8), d(1)->0 (8 < 10)
    ([("a", 8), ("b", 4), ("c", 6), ("d", 1)], 2, [["a", "d"], ["b", "c"]]),
    # equal sizes: ties by name, then to the lowest rank
    ([("w2", 5), ("w1", 5), ("w3", 5), ("w0", 5)], 2, [["w0", "w2"], ["w1", "w3"]]),
    # more ranks than tensors: the last ranks send nothing
    ([("x", 3)], 3, [["x"], [], []]),
    # zero-byte tensors still go somewhere (the server must hear every name declared)
    ([("e", 0), ("f", 0)], 2, [["e"], ["f"]]),
    # one huge tensor: it alone on rank 0, the rest on rank 1
    ([("big", 100), ("s1", 1), ("s2", 2), ("s3", 3)], 2, [["big"], ["s1", "s2", "s3"]]),
    ([], 2, [[], []]),
])
def test_share_out_table(sizes: list[tuple[str, int]], world: int, expected: list[list[str]]) -> None:
    assert share_out(sizes, world) == expected


def test_every_rank_gets_the_same_answer_from_any_input_order() -> None:
    sizes = [(f"layer{i}.weight", (i * 7919) % 1000) for i in range(50)]
    assert share_out(sizes, 4) == share_out(list(reversed(sizes)), 4)


@pytest.mark.parametrize(("sizes", "world", "message"), [
    ([("a", 1)], 0, "world must be >= 1"),
    ([("a", 1), ("a", 2)], 2, "appear more than once"),
    ([("a", -1)], 2, "sizes must be >= 0"),
])
def test_share_out_refuses(sizes: list[tuple[str, int]], world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        share_out(sizes, world)
