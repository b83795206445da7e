"""WatchWeights: the current state at once, then one event per change."""

from __future__ import annotations

import threading

import pytest

from weightsync.client import WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from models import mixed_model

pytestmark = pytest.mark.timeout(120)


def test_watch_sees_updating_then_the_published_version(server):
    stream = server.stub().WatchWeights(pb.WatchWeightsRequest(), timeout=60)
    first = next(stream)
    events: list[pb.WatchWeightsResponse] = []
    done = threading.Event()

    def collect():
        for event in stream:
            events.append(event)
            if event.version.version == "watched" and event.store_state == pb.STORE_STATE_CONSISTENT:
                done.set()
                return

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    with WeightSyncClient(server.address) as client:
        client.create_group(timeout=30)
        client.push(mixed_model(5), version="watched", bucket_size_bytes=1 << 20)
    assert done.wait(30)
    stream.cancel()
    states = [e.store_state for e in events]
    assert pb.STORE_STATE_UPDATING in states
    final = events[-1]
    assert final.version.generation == first.version.generation + 1
    # Each event is stamped when it happened: in order, and the commit's within the push's time.
    stamps = [e.event_time.ToNanoseconds() for e in events]
    assert stamps == sorted(stamps) and len(set(stamps)) > 1
    assert final.event_time.ToNanoseconds() >= final.version.commit_time.ToNanoseconds()
    assert final.event_time.ToNanoseconds() - final.version.commit_time.ToNanoseconds() < 5_000_000_000
