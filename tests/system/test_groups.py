"""Transfer groups: refusals are fast and harmless, a join that times out costs nothing,
and a trainer that dies between updates does not leave its group behind (defects 2, 3, 6, 10)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

from weightsync.client import WeightSyncClient, WeightSyncRpcError
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import error_info, local_checksums, server_checksums, wait_for
from models import mixed_model

pytestmark = pytest.mark.timeout(300)

GROUP_TIMEOUT = 120.0
"""The groups' timeout here: a healthy rendezvous finishes well within it on a loaded host; what must happen "at
once" (a refusal, a dead trainer seen) happens within half of it, AT_ONCE, which waiting it out does not."""
AT_ONCE = GROUP_TIMEOUT / 2
JOIN_TIMEOUT = 10.0
"""The timeout of a join that cannot succeed (its store never answers): the server answers at it, not at 2-3x it
(torch's TCPStore client retrying past its deadline), which JOIN_TIMEOUT * 2 tells apart on a loaded host."""


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def groups(server) -> dict[str, pb.TransferGroup]:
    return {g.group_id: g for g in server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups}


def open_fds_and_threads(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


@pytest.fixture
def committed(server):
    """A committed model on the server (what every failure below must leave intact)."""
    model = mixed_model(31)
    with WeightSyncClient(server.address) as client:
        client.create_group(timeout=30)
        client.push(model, version="base", bucket_size_bytes=1 << 20, allow_new_tensors=True)
    assert server_checksums(server) == [local_checksums(model)]
    return model


# -- defects 2 and 6: a refused create is fast, and deletes nobody else's group ---------------------
def test_a_refused_create_is_fast_and_leaves_the_owners_group_alone(server, committed):
    with WeightSyncClient(server.address) as owner:
        owner.create_group(group_id="shared-name", timeout=GROUP_TIMEOUT)
        owner.push(committed, version="owner-1", bucket_size_bytes=1 << 20)
        with WeightSyncClient(server.address) as intruder:
            started = time.monotonic()
            with pytest.raises(WeightSyncRpcError) as caught:
                intruder.create_group(group_id="shared-name", timeout=GROUP_TIMEOUT)
            elapsed = time.monotonic() - started
            assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.ALREADY_EXISTS, "GROUP_ALREADY_EXISTS")
            assert elapsed < AT_ONCE, f"the refusal took {elapsed:.1f} s (the group timeout is {GROUP_TIMEOUT:g} s)"
            started = time.monotonic()
            with pytest.raises(WeightSyncRpcError) as caught:
                intruder.create_group(group_id="bad id!", timeout=GROUP_TIMEOUT)
            assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "GROUP_ID_INVALID")
            assert time.monotonic() - started < AT_ONCE
        assert groups(server)["shared-name"].state == pb.GROUP_STATE_READY
        result = owner.push(mixed_model(32), version="owner-2", bucket_size_bytes=1 << 20)
        assert result.servers[0].version == "owner-2"
        assert owner.verify(mixed_model(32)).ok


# -- defect 3: a join that times out is abandoned, never paid for with the node's weights --------------
def test_a_silent_rendezvous_store_times_out_cleanly(server, committed):
    before = info(server)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts TCP connections, never answers them
    try:
        request = pb.CreateTransferGroupRequest(
            group_id="silent-store", store_host="127.0.0.1", store_port=silent.getsockname()[1], world_size=3,
            rank_offset=1, backend=pb.BACKEND_GLOO,
        )
        request.timeout.FromTimedelta(datetime.timedelta(seconds=JOIN_TIMEOUT))
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            server.stub().CreateTransferGroup(request, timeout=4 * JOIN_TIMEOUT)
        elapsed = time.monotonic() - started
    finally:
        silent.close()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
    assert error_info(caught.value).reason == "RENDEZVOUS_TIMEOUT"
    assert JOIN_TIMEOUT <= elapsed < 2 * JOIN_TIMEOUT, f"answered after {elapsed:.1f} s for a {JOIN_TIMEOUT:g} s timeout"
    after = info(server)
    assert [(w.pid, w.restart_count) for w in after.workers] == [(w.pid, w.restart_count) for w in before.workers]
    assert after.store_state == pb.STORE_STATE_CONSISTENT
    assert "silent-store" not in groups(server)
    assert server_checksums(server) == [local_checksums(committed)]
    with WeightSyncClient(server.address) as client:  # the next normal operation works
        client.create_group(timeout=30)
        client.push(mixed_model(33), version="after-silent", bucket_size_bytes=1 << 20)
        assert client.verify(mixed_model(33)).ok


# -- defect 10: a trainer that dies between updates --------------------------------------------------
TRAINER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {tests!r})
    from weightsync.client import WeightSyncClient
    from models import mixed_model
    client = WeightSyncClient({address!r})
    group = client.create_group(timeout={group_timeout})
    client.push(mixed_model(34), version="from-doomed", bucket_size_bytes=1 << 20)
    print("GROUP " + json.dumps({{"group": group}}), flush=True)
    time.sleep(600)
""")


def test_a_trainer_that_dies_between_updates_breaks_and_releases_its_group(server, committed):
    workers = [w.pid for w in info(server).workers]
    idle = [open_fds_and_threads(pid) for pid in workers]
    script = TRAINER.format(tests=str(Path(__file__).resolve().parents[1]), address=server.address, group_timeout=GROUP_TIMEOUT)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = next(line for line in trainer.stdout if line.startswith("GROUP "))  # after the SDK's own log lines
        group_id = json.loads(line.removeprefix("GROUP "))["group"]
        assert groups(server)[group_id].state == pb.GROUP_STATE_READY
        joined = [open_fds_and_threads(pid) for pid in workers]
        assert all(j[0] > i[0] for j, i in zip(joined, idle, strict=True))  # the group holds sockets
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        killed = time.monotonic()
        broken = wait_for(lambda: (g := groups(server)[group_id]).state == pb.GROUP_STATE_BROKEN and g, timeout=AT_ONCE)
        assert broken.broken_reason.startswith("TRAINER_GONE"), broken.broken_reason
        assert time.monotonic() - killed < AT_ONCE  # seen at once, not at the group's timeout
        # Released: each worker is back to what it held before the group (a thread or fd of slack).
        wait_for(lambda: all(
            now[0] <= was[0] + 1 and now[1] <= was[1] + 1
            for now, was in zip((open_fds_and_threads(pid) for pid in workers), idle, strict=True)
        ), timeout=10)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.stdout.close()
    assert info(server).store_state == pb.STORE_STATE_CONSISTENT
    server.stub().DeleteTransferGroup(pb.DeleteTransferGroupRequest(group_id=group_id), timeout=10)
    assert group_id not in groups(server)
    with WeightSyncClient(server.address) as client:
        client.create_group(timeout=30)
        client.push(mixed_model(35), version="after-dead-trainer", bucket_size_bytes=1 << 20)
        assert client.verify(mixed_model(35)).ok


def test_an_abandoned_join_leaves_no_connection_to_the_silent_store(server, committed):
    """After DEADLINE_EXCEEDED, every connection the workers opened to a store
    that never answers is closed (before: torch's TCPStore client kept two of four open)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    request = pb.CreateTransferGroupRequest(
        group_id="mute-store", store_host="127.0.0.1", store_port=silent.getsockname()[1], world_size=3,
        rank_offset=1, backend=pb.BACKEND_GLOO,
    )
    request.timeout.FromTimedelta(datetime.timedelta(seconds=JOIN_TIMEOUT))
    try:
        with pytest.raises(grpc.RpcError) as caught:
            server.stub().CreateTransferGroup(request, timeout=4 * JOIN_TIMEOUT)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def closed_by_peer(connection: socket.socket) -> bool:
            connection.settimeout(0.05)
            try:
                return connection.recv(1 << 16) == b""
            except TimeoutError:
                return False
            except OSError:
                return True

        wait_for(lambda: accepted and all(closed_by_peer(c) for c in accepted), timeout=AT_ONCE)
    finally:
        silent.close()
        for connection in accepted:
            connection.close()
    with WeightSyncClient(server.address) as client:
        client.create_group(timeout=30)
        client.push(mixed_model(35), version="after-mute", bucket_size_bytes=1 << 20)
        assert client.verify(mixed_model(35)).ok


# -- a transfer the server refused, or one that failed, ends when the server says so --------------------
LONG_GROUP_TIMEOUT = 120.0
"""Far past the test's own bound: a push that waits out the group timeout fails the test by that bound."""


def _push_in_thread(client: WeightSyncClient, model, version: str) -> tuple[threading.Event, dict]:
    done, outcome = threading.Event(), {}

    def push() -> None:
        try:
            outcome["result"] = client.push(model, version=version, bucket_size_bytes=1 << 20, delta=False)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=push, name=f"push-{version}", daemon=True).start()
    return done, outcome


def _next_push_and_verify(client: WeightSyncClient, server, seed: int, version: str) -> None:
    """The group broke: a new one, then a normal push that every worker verifies."""
    client.delete_group()
    client.create_group(timeout=30)
    model = mixed_model(seed)
    client.push(model, version=version, bucket_size_bytes=1 << 20, delta=False)
    assert client.verify(model).ok
    assert server_checksums(server) == [local_checksums(model)]
    assert info(server).store_state == pb.STORE_STATE_CONSISTENT


def test_a_gloo_send_the_server_refused_ends_as_soon_as_the_server_says_so(server, committed, monkeypatch):
    """Bucket 1 is announced with a sequence outside the plan: the server refuses it (INVALID_ARGUMENT
    BUCKET_OUT_OF_RANGE) and breaks the group, as no worker can receive it; our Gloo send to bucket 1's owner
    would wait out the group timeout. The SDK aborts the update at the server's word: the workers leave the
    broken group and the send fails at once."""
    from weightsync.client.transports import collective as sinks

    real_announce = sinks.announce

    def out_of_plan(loop, streams, index, *args, **kwargs):
        return real_announce(loop, streams, 1000 + index if index == 1 else index, *args, **kwargs)

    with WeightSyncClient(server.address) as client:
        client.create_group(timeout=LONG_GROUP_TIMEOUT)
        monkeypatch.setattr(sinks, "announce", out_of_plan)
        done, outcome = _push_in_thread(client, mixed_model(33), "refused")
        assert done.wait(LONG_GROUP_TIMEOUT / 4), "the push waited for its send past the server's refusal"
        error = outcome.get("error")
        assert getattr(error, "code", None) == grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert error.reason == "BUCKET_OUT_OF_RANGE"
        monkeypatch.setattr(sinks, "announce", real_announce)
        _next_push_and_verify(client, server, 34, "after-refused")
