"""Whole tensors shared out between the ranks that all hold them, so that every rank sends a part.

An RL framework whose weight generator already gathers (verl's FSDP actors: every rank's generator
yields the full tensors) can still send from every rank: each rank pushes only its share of the
names, as the whole tensors of its part (weightsync.client.Part). The rule must give every rank the
same answer from the same input without talking, so it depends on nothing but the names, their
sizes and the world: largest tensor first (ties by name), each to the rank with the fewest bytes so
far (ties to the rank with the fewest tensors, then the lowest rank, so that empty tensors spread too). The shares then differ by at most the largest tensor's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable


def share_out(sizes: Iterable[tuple[str, int]], world: int) -> list[list[str]]:
    """The names each rank sends, by rank, each list in name order.

    Args:
        sizes: (name, bytes) of every tensor, the same on every rank, in any order; names unique.
        world: how many ranks send, >= 1.

    Returns:
        world lists of names: disjoint, together every name once; a rank may get none.

    Raises:
        ValueError: world < 1, a name twice, or a negative size.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    listed = list(sizes)
    names = [name for name, _ in listed]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"tensor names must be unique: {twice[:5]} appear more than once")
    if any(size < 0 for _, size in listed):
        raise ValueError("tensor sizes must be >= 0 bytes")
    loads = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for name, size in sorted(listed, key=lambda item: (-item[1], item[0])):
        rank = min(range(world), key=lambda r: (loads[r], len(shares[r]), r))
        loads[rank] += size
        shares[rank].append(name)
    return [sorted(share) for share in shares]


__all__ = ["share_out"]
