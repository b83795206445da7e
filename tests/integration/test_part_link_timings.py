"""A part's dense push times the link by what the nodes measured of the whole update (client/delta/link_timings.py
node_timed): every part's bytes (UpdateCommitted.size_bytes) over the node's seconds (its duration), the
slowest node's figure, and only into stores that held the part's last commit (a first push allocates).
A part's own bytes over those seconds would understate the link by the number of parts.

The rule by table, then two parts (two clients in threads of this process, no group: a shared part_key)
pushing dense into one real server twice."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightsync.client import Part, WeightSyncClient
from weightsync.client.delta import link_timings
from weightsync.client.delta.link_timings import LinkTimings
from weightsync.client.types import PushResult, ServerOutcome

from helpers import start_server

pytestmark = pytest.mark.timeout(180)

MB = 1 << 20


def outcome(server: str, size_bytes: int, seconds: float) -> ServerOutcome:
    return ServerOutcome(server=server, version="v", generation=2, size_bytes=size_bytes, seconds=seconds,
                         fast_path_buckets=0)


@pytest.mark.parametrize(("outcomes", "timed"), [
    ([outcome("a", 128 * MB, 1.0)], [128 * MB]),
    ([outcome("a", 128 * MB, 1.0), outcome("b", 128 * MB, 2.0)], [64 * MB]),  # the slowest node
    ([outcome("a", 64 * MB, 0.5), outcome("b", 256 * MB, 1.0)], [128 * MB]),  # a subset node: its own figure
    ([outcome("a", 32 * MB, 0.01)], []),  # too small: fixed costs, not the link (DENSE_TIMING_MIN_BYTES)
    ([outcome("a", 128 * MB, 0.0)], []),  # no duration reported
    ([], []),
])
def test_node_timed_keeps_the_slowest_node_s_figure_of_the_whole_update(outcomes, timed):
    links = LinkTimings()
    links.node_timed("inline", outcomes)
    assert links.dense_throughputs.get("inline", []) == timed


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_server(tmp_path_factory.mktemp("part-link-timings"), workers=2)
    yield started
    assert started.stop() == 0, started.log()[-3000:]


def test_a_part_s_dense_push_is_timed_by_the_node_s_bytes_of_the_whole_update(server, monkeypatch):
    monkeypatch.setattr(link_timings, "DENSE_TIMING_MIN_BYTES", 1)  # this model is small
    g = torch.Generator().manual_seed(5)
    owns = ({"a": torch.randn(64, 256, generator=g)}, {"b": torch.randn(128, 256, generator=g)})
    clients = [WeightSyncClient(server.address, part=Part(rank=rank, world=2)) for rank in (0, 1)]
    try:
        def step(key: str) -> list[PushResult]:
            with ThreadPoolExecutor(2) as pool:
                futures = [pool.submit(c.push, owns[rank], version=key, transport="inline", part_key=key,
                                       allow_new_tensors=True, delta=False) for rank, c in enumerate(clients)]
                return [f.result(timeout=120) for f in futures]

        step("k-first")  # allocates: not timed
        assert [c._links.dense_throughputs for c in clients] == [{}, {}]
        results = step("k-second")  # dense into stores that held the parts' last commit
        node_bytes = sum(t.numel() * t.element_size() for part in owns for t in part.values())
        for client, result in zip(clients, results, strict=True):
            (node,) = result.servers
            assert node.size_bytes >= node_bytes > result.bytes_sent  # every part's bytes, not this part's
            assert client._links.dense_throughputs == {"inline": [node.size_bytes / node.seconds]}
            assert client._links.bytes_per_second("inline") == node.size_bytes / node.seconds
    finally:
        for client in clients:
            client.close()
