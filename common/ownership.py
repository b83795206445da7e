"""Which worker of a node receives which bucket: one owner per bucket, balanced by bytes.

The node's store holds every tensor once (server/node_store.py); its workers are the
node's receivers, not replicas, so each bucket of a plan is received by exactly one of
them, its owner, which writes it into the store. The owners are a pure function of the
plan's bucket sizes and the node's worker count (docs/data-plane.md spells it out for
trainers in other languages), so a plan reused by id keeps its owners, and a server
restarted with another worker count re-plans them:

    every worker starts with 0 bytes; for bucket 0, 1, 2, ... in order, the owner is the
    worker holding the fewest bytes so far (the lowest index among equals), which then
    holds that bucket's size_bytes more.

Equal buckets therefore go round-robin, so consecutive buckets land on different
workers, and a node's receive work is spread by bytes whatever the bucket sizes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def bucket_owners(sizes: Sequence[int], workers: int) -> list[int]:
    """The owner (worker index) of each bucket, in plan order (see the module docstring)."""
    if workers < 1:
        raise ValueError(f"a node has at least one worker, got {workers}")
    load = [(0, index) for index in range(workers)]  # (bytes so far, worker): the heap's smallest is the owner
    owners = []
    for size in sizes:
        held, owner = heapq.heappop(load)
        owners.append(owner)
        heapq.heappush(load, (held + size, owner))
    return owners
