"""No store arena is larger than one cudaHostRegister call takes (server/store/arenas.py): an update's segments
are packed, in order and never split, into arenas of at most ARENA_MAX_BYTES (256 GiB; a few pages here),
for new segments and for STAGED shadows alike, and an aborted update gives every arena it made back."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_update_core import expected, held, model, node, push  # noqa: F401 - node is a fixture

from weightsync.common import host_pinning
from weightsync.common.errors import WeightSyncError
from weightsync.server.store import arenas, node_store
from weightsync.v1 import weight_sync_service_pb2 as pb

PACKS = [  # aligned segment sizes, limit -> arenas (indexes)
    ([], 10, []),
    ([4], 10, [[0]]),
    ([4, 6], 10, [[0, 1]]),
    ([4, 6, 1], 10, [[0, 1], [2]]),
    ([4, 7, 3], 10, [[0], [1, 2]]),
    ([12], 10, [[0]]),  # larger than the limit alone: an arena of its own
    ([3, 12, 3], 10, [[0], [1], [2]]),
    ([10, 10, 10], 10, [[0], [1], [2]]),
    ([5, 5, 5, 5, 5], 10, [[0, 1], [2, 3], [4]]),
    ([2, 9, 1, 1], 10, [[0], [1, 2], [3]]),
]


@pytest.mark.parametrize(("sizes", "limit", "packed"), PACKS)
def test_segments_are_packed_in_order_up_to_the_limit(sizes, limit, packed):
    assert arenas.pack_segments(sizes, limit) == packed


def test_the_limit_is_one_registration():
    assert arenas.ARENA_MAX_BYTES == host_pinning.CHUNK_BYTES == 256 << 30


def arena_sizes(store: node_store.NodeStore) -> list[int]:
    return [store.arena(a).size_bytes for a in store.arena_ids()]


def test_an_update_makes_arenas_of_at_most_the_limit_and_an_abort_gives_them_back(node, monkeypatch):  # noqa: F811
    monkeypatch.setattr(node_store, "ARENA_MAX_BYTES", 16384)
    services, _fleet = node(2)
    store = services.store
    v1 = model(1)  # six buckets of one tensor each: segments of 4096, 8192, 8192, 8192, 12288, 12288 bytes
    asyncio.run(push(services, v1, "v1"))
    assert arena_sizes(store) == [12288, 16384, 12288, 12288]
    assert held(store) == expected(v1)
    v2 = model(2)
    asyncio.run(push(services, v2, "v2", mode=pb.UPDATE_MODE_STAGED))  # the shadows, packed alike
    assert arena_sizes(store) == [12288, 16384, 12288, 12288] * 2
    assert held(store) == expected(v2)

    grown = {**model(3), **{f"extra.{i}": torch.full((2000,), float(i)) for i in range(5)}}
    with pytest.raises(WeightSyncError):
        asyncio.run(push(services, grown, "aborted", stop_after=2))
    assert arena_sizes(store) == [12288, 16384, 12288, 12288] * 2  # the new segments' arenas are gone
    assert store.state == pb.STORE_STATE_CONSISTENT and held(store) == expected(v2)

    asyncio.run(push(services, grown, "v3"))
    assert held(store) == expected(grown)
    new = arena_sizes(store)[8:]
    assert new and all(size <= 16384 for size in new) and sum(new) == 5 * 8192
