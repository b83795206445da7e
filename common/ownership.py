"""Which worker of a node receives which bucket: one owner per bucket, balanced by bytes.

The node's store holds every tensor once (server/store/node_store.py); its workers are the
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
A node that stores a subset of the tensors (`--tensors`) skips the buckets with none
of its tensors: they have no owner there (NO_OWNER) and add to nobody's load.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence

NO_OWNER = -1
"""A bucket this node does not receive (none of its tensors is stored here)."""


def bucket_owners(sizes: Sequence[int], workers: int, not_stored: Collection[int] = ()) -> list[int]:
    """The owner (worker index) of each bucket, in plan order (see the module docstring); NO_OWNER
    for the buckets in `not_stored`."""
    if workers < 1:
        raise ValueError(f"a node has at least one worker, got {workers}")
    load = [(0, index) for index in range(workers)]  # (bytes so far, worker): the heap's smallest is the owner
    owners = []
    for k, size in enumerate(sizes):
        if k in not_stored:
            owners.append(NO_OWNER)
            continue
        held, owner = heapq.heappop(load)
        owners.append(owner)
        heapq.heappush(load, (held + size, owner))
    return owners
