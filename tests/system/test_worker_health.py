"""A stalled worker is seen, and a push that meets it fails at the
group timeout with a status code and a reason."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightsync.client import PushProgress, UpdateFailed, WeightSyncClient
from weightsync.server.workers.supervisor import UNRESPONSIVE_AFTER_SECONDS, WATCH_INTERVAL_SECONDS
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server, wait_for
from models import mixed_model

pytestmark = pytest.mark.timeout(300)
GROUP_TIMEOUT = 20.0
"""The group's timeout: a healthy rendezvous and push finish within it on a loaded host (4 s did not)."""
MARGIN = GROUP_TIMEOUT
"""Slack on the server's own bounds for "at the timeout" assertions: tells them from the next bound (the client's
30 s and more), not a fast host from a loaded one."""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def node(tmp_path):
    server = start_server(tmp_path)
    yield server
    for worker in server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).workers:
        if worker.pid:
            os.kill(worker.pid, signal.SIGCONT)
    assert server.stop() == 0, server.log()[-3000:]


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def health(server) -> int:
    return health_pb2_grpc.HealthStub(server.channel()).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_a_stopped_worker_is_unresponsive_and_health_says_so(node):
    pid = info(node).workers[1].pid
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    seen_within = UNRESPONSIVE_AFTER_SECONDS + WATCH_INTERVAL_SECONDS + MARGIN  # the server's watch, then slack
    wait_for(lambda: info(node).workers[1].state == pb.WORKER_STATE_UNRESPONSIVE, timeout=seen_within)
    wait_for(lambda: health(node) == NOT_SERVING, timeout=MARGIN)
    assert time.monotonic() - stopped < seen_within + MARGIN
    os.kill(pid, signal.SIGCONT)
    wait_for(lambda: info(node).workers[1].state == pb.WORKER_STATE_RUNNING, timeout=seen_within)
    wait_for(lambda: health(node) == SERVING, timeout=MARGIN)
    assert info(node).workers[1].pid == pid  # it came back by itself: never restarted


def test_a_push_that_meets_a_stopped_worker_fails_at_the_group_timeout(node):
    committed = mixed_model(81)
    with WeightSyncClient(node.address, timeout=GROUP_TIMEOUT + 2 * MARGIN) as client:  # the server's word first
        client.create_group(timeout=GROUP_TIMEOUT)
        client.push(committed, version="before", mode="staged", bucket_size_bytes=1 << 18)
        victim = info(node).workers[1].pid
        stop = {"at": None}

        def stop_worker(report: PushProgress) -> None:
            if report.bucket == 0 and stop["at"] is None:
                os.kill(victim, signal.SIGSTOP)
                stop["at"] = time.monotonic()

        with pytest.raises(UpdateFailed) as caught:
            client.push(mixed_model(82), version="stalled", mode="staged", bucket_size_bytes=1 << 18,
                        progress=stop_worker)
        elapsed = time.monotonic() - stop["at"]
        error = caught.value
        # Defect 11: a status code and a reason, whatever broke first.
        assert error.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
        assert error.reason in ("COLLECTIVE_TIMEOUT", "WORKER_UNRESPONSIVE", "WORKER_TIMEOUT", "WORKER_DIED"), error
        # The server kills a stalled worker at the group timeout + 2 s; the rest is the abort and the status.
        assert elapsed < GROUP_TIMEOUT + MARGIN, f"push returned {elapsed:.1f} s after the stall ({GROUP_TIMEOUT} s)"
        client.delete_group()
    # The stalled worker was killed and restarted; its store survived: STAGED leaves the last commit.
    restarted = wait_for(lambda: (w := info(node).workers[1]).state == pb.WORKER_STATE_RUNNING and w.pid != victim and w,
                         timeout=60)
    assert restarted.store_state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(node) == [local_checksums(committed)]
    with WeightSyncClient(node.address) as client:
        client.create_group(timeout=30)
        client.push(mixed_model(83), version="after", bucket_size_bytes=1 << 18)
        assert client.verify(mixed_model(83)).ok
