"""Faults on the inference side: a worker killed, one of two servers killed, SIGTERM mid-push."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from weightsync.client import (
    PushProgress,
    UpdateFailed,
    WeightSyncClient,
    WeightSyncClientError,
    WeightSyncRpcError,
)
from weightsync.v1 import weight_sync_service_pb2 as pb

from faultkit import (
    GROUP_TIMEOUT,
    MARGIN,
    groups,
    health,
    info,
    start_tracked_server,
    stop_and_check,
)
from helpers import local_checksums, server_checksums, server_stop_seconds, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.timeout(150)]

SERVING = health_pb2.HealthCheckResponse.SERVING
BUCKET_BYTES = 1 << 20


def model(seed: int, tensors: int = 12, numel: int = 200_000) -> dict[str, torch.Tensor]:
    """~10 MB in ~0.8 MB tensors: a dozen buckets, so a fault lands mid-push."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}


class KillAt:
    """A progress callback that runs `action` once, when bucket `bucket` is on its way."""

    def __init__(self, bucket: int, action) -> None:
        self.bucket = bucket
        self.action = action
        self.at: float | None = None

    def __call__(self, report: PushProgress) -> None:
        if report.bucket == self.bucket and self.at is None:
            self.at = time.monotonic()
            self.action()


# -- 2. a worker is SIGKILLed mid-update ---------------------------------------------------------
def test_worker_sigkilled_mid_update(node):
    v1, v2, v3 = model(61), model(62), model(63)
    before = info(node)
    victim = before.workers[1]
    with WeightSyncClient([node.address], timeout=30) as client:
        client.create_group(timeout=GROUP_TIMEOUT)
        client.push(v1, version="w1", mode="staged", bucket_size_bytes=BUCKET_BYTES)
        kill = KillAt(1, lambda: os.kill(victim.pid, signal.SIGKILL))
        with pytest.raises(UpdateFailed) as caught:
            client.push(v2, version="w2", mode="staged", bucket_size_bytes=BUCKET_BYTES, progress=kill)
        assert kill.at is not None
        elapsed = time.monotonic() - kill.at
        # A clear status, no hang: the server's reason for the dead worker, within the group timeout.
        assert elapsed < GROUP_TIMEOUT + MARGIN, elapsed
        error = caught.value
        assert error.server == node.address, error
        # WORKER_DIED, or WORKER_UNAVAILABLE when bucket 1 was announced after the worker was gone.
        assert error.reason in ("WORKER_DIED", "WORKER_UNAVAILABLE"), error
        assert isinstance(error.cause, WeightSyncRpcError), repr(error.cause)
        assert error.code == grpc.StatusCode.UNAVAILABLE, error
        assert "worker 1" in str(error), error
        # Our side of the broken group is closed at once (its communicator aborted), and refused after.
        assert client._group.broken and client._group.collective._pg is None
        with pytest.raises(WeightSyncClientError, match="broken"):
            client.push(v2, version="w2-again", mode="staged", bucket_size_bytes=BUCKET_BYTES)
        client.delete_group()

    # The worker is restarted and maps the store the server kept: nothing is lost. STAGED: both
    # workers hold w1 exactly, the restarted one included.
    restarted = wait_for(
        lambda: (w := info(node).workers[1]).state == pb.WORKER_STATE_RUNNING and w.pid != victim.pid and w, timeout=60
    )
    assert restarted.restart_count == victim.restart_count + 1
    wait_for(lambda: health(node) == SERVING, timeout=10)
    state = info(node)
    assert state.store_state == pb.STORE_STATE_CONSISTENT
    assert [w.store_state for w in state.workers] == [pb.STORE_STATE_CONSISTENT] * 2
    assert state.current_version.version == "w1"
    assert state.workers[0].pid == before.workers[0].pid  # the survivor was not touched
    assert server_checksums(node) == [local_checksums(v1)]
    assert groups(node) == []

    # A new group and a full update succeed on every worker.
    with WeightSyncClient([node.address], timeout=30) as client:
        client.create_group(timeout=GROUP_TIMEOUT)
        result = client.push(v3, version="w3", mode="staged", bucket_size_bytes=BUCKET_BYTES)
        assert result.servers[0].version == "w3"
        assert client.verify(v3).ok
    assert server_checksums(node) == [local_checksums(v3)]
    after = info(node)
    assert after.store_state == pb.STORE_STATE_CONSISTENT
    assert [w.store_state for w in after.workers] == [pb.STORE_STATE_CONSISTENT] * 2


# -- 5. one of two servers dies during a multi-server push -----------------------------------------
def test_one_of_two_servers_killed_mid_push(node, tmp_path):
    victim = start_tracked_server(tmp_path, workers=1)
    v1, v2, v3 = model(71), model(72), model(73)
    with WeightSyncClient([node.address, victim.address], timeout=30) as client:
        client.create_group(timeout=GROUP_TIMEOUT)
        first = client.push(v1, version="m1", mode="staged", bucket_size_bytes=BUCKET_BYTES)
        assert [o.server for o in first.servers] == [node.address, victim.address]
        kill = KillAt(1, victim.process.kill)  # SIGKILL: its worker dies with it
        with pytest.raises(UpdateFailed) as caught:
            client.push(v2, version="m2", mode="staged", bucket_size_bytes=BUCKET_BYTES, progress=kill)
        assert kill.at is not None
        elapsed = time.monotonic() - kill.at
        assert elapsed < GROUP_TIMEOUT + MARGIN, elapsed
        # A typed error that names the dead server, not the survivor that merely saw the broadcast break.
        error = caught.value
        assert error.server == victim.address, error
        assert victim.address in str(error), error
        assert isinstance(error.cause, WeightSyncRpcError), repr(error.cause)
        assert error.cause.server == victim.address
        # The survivor aborted the update: its store is the last commit, bit for bit.
        state = wait_for(lambda: (s := info(node)).store_state != pb.STORE_STATE_UPDATING and s, timeout=MARGIN)
        assert state.store_state == pb.STORE_STATE_CONSISTENT
        assert state.current_version.version == "m1"
        assert server_checksums(node) == [local_checksums(v1)]
        client.delete_group()  # best effort on the dead server; removes the group from the survivor
    assert victim.process.wait(10) == -signal.SIGKILL
    assert groups(node) == []

    # The survivor keeps serving: a new group with it alone pushes and verifies.
    with WeightSyncClient([node.address], timeout=30) as client:
        client.create_group(timeout=GROUP_TIMEOUT)
        client.push(v3, version="m3", mode="staged", bucket_size_bytes=BUCKET_BYTES)
        assert client.verify(v3).ok
    assert info(node).store_state == pb.STORE_STATE_CONSISTENT


# -- 6. SIGTERM while the SDK pushes -------------------------------------------------------------------
def test_sigterm_during_sdk_push(tmp_path):
    grace = 1.0
    server = start_tracked_server(tmp_path, "--shutdown-grace-seconds", str(grace))
    v1, v2 = model(81), model(82)
    paused, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold(report: PushProgress) -> None:
        # Keep the update open past the grace period (a trainer busy computing the next layer).
        if report.bucket == 1 and not paused.is_set():
            paused.set()
            release.wait(60)

    client = WeightSyncClient([server.address], timeout=30)
    try:
        client.create_group(timeout=GROUP_TIMEOUT)
        client.push(v1, version="t1", mode="staged", bucket_size_bytes=BUCKET_BYTES)

        def push() -> None:
            try:
                outcome["result"] = client.push(v2, version="t2", mode="staged", bucket_size_bytes=BUCKET_BYTES,
                                                progress=hold)
            except BaseException as error:  # noqa: BLE001 - handed to the test thread
                outcome["error"] = error
            outcome["at"] = time.monotonic()

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        assert paused.wait(60)
        assert info(server).store_state == pb.STORE_STATE_UPDATING
        server.process.send_signal(signal.SIGTERM)
        # Clean exit within the grace period (plus the abort, the workers' exit and the interpreter's): nothing hung.
        code = server.process.wait(timeout=server_stop_seconds(grace))
        assert code == 0, server.log()
        release.set()
        pusher.join(GROUP_TIMEOUT + MARGIN)
        assert not pusher.is_alive(), "push hangs after the server exited"
        # The SDK raises a typed error naming the server, rather than hanging or committing.
        error = outcome.get("error")
        assert isinstance(error, UpdateFailed), outcome
        assert error.server == server.address
        assert error.reason in ("SERVER_SHUTTING_DOWN", "SERVER_STOPPING"), error
    finally:
        release.set()
        client.close()
    assert "update_still_running_at_shutdown" not in server.log()
    assert "worker_killed_on_stop" not in server.log()
    problems = stop_and_check(server)  # already exited: only the leak checks
    assert not problems, problems


@pytest.mark.faults
def test_sigkilled_server_leaves_no_segment_and_no_worker(tmp_path):
    from helpers import shm_segments, start_server

    server = start_server(tmp_path)
    segments = server.segments()
    workers = server.worker_pids()
    assert len(segments) == 4 and not segments & shm_segments()
    server.stop(signal.SIGKILL)
    # Workers die with their parent (PR_SET_PDEATHSIG); the memory goes with the last mapping.
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    wait_for(lambda: not any(running(pid) for pid in workers), timeout=10)
    assert not segments & shm_segments()
