"""Every SDK wait is bounded: a server that stops answering mid-push fails the push, typed and named.

A real server is SIGSTOPped in the middle of an INLINE push (it stops reading: gRPC's
flow control then holds the trainer forever), or sits behind a TCP proxy that stops
forwarding (a dropped port). The push must raise UpdateFailed naming that server,
within a bound derived from the client timeout; once the server answers again, the
committed weights are intact and the next push commits and verifies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from weightsync.client import UpdateFailed, WeightSyncClient, WeightSyncRpcError
from weightsync.client.push.run import ABORT_GRACE_SECONDS
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import ServerProcess, local_checksums, server_checksums, start_server

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 5.0
"""The client timeout of these tests."""
BOUND = 3 * TIMEOUT + ABORT_GRACE_SECONDS + 30
"""Generous: the push must give up within a few client timeouts, not hang (the defect: forever)."""


MAX_MESSAGE = 2 << 20
"""Small chunks and ingress slots: a resumed server has many chunks of an abandoned update to get through."""


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("timeouts"), "--ingress-slot-bytes", str(1 << 20),
                          "--max-message-bytes", str(MAX_MESSAGE), "--transfer-timeout-seconds", "8")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def model(seed: int) -> dict[str, torch.Tensor]:
    """64 MiB in 16 buckets: far more than the socket buffers and gRPC's window hold, so a server that
    stops reading stops the trainer."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(1 << 20, generator=g) for i in range(16)}


def bounded(fn: Callable[[], object], seconds: float) -> BaseException | object:
    """fn()'s value or exception; fails the test (instead of hanging it) if fn is still blocked after `seconds`."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed back
            box["value"] = error

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {time.monotonic() - started:.0f} s (bound {seconds:g} s)")
    return box["value"]


def stop_at_bucket(k: int, stop: Callable[[], None]) -> Callable:
    done = []

    def progress(p) -> None:
        if p.bucket == k and not done:
            done.append(True)
            stop()

    return progress


def assert_unresponsive(outcome: object, address: str) -> None:
    assert isinstance(outcome, UpdateFailed), repr(outcome)
    assert outcome.server == address
    assert (outcome.code, outcome.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "SERVER_UNRESPONSIVE")
    assert f"update aborted on {address}: SERVER_UNRESPONSIVE" in str(outcome)
    assert isinstance(outcome.cause, WeightSyncRpcError) and outcome.cause.server == address


def test_inline_push_to_a_sigstopped_server_fails_typed_and_the_next_push_commits(node):
    pid = node.process.pid
    with WeightSyncClient(node.address, timeout=TIMEOUT, max_message_bytes=MAX_MESSAGE) as client:
        before, after = model(1), model(4)
        client.push(before, version="before", transport="inline", allow_new_tensors=True)
        try:
            # IN_PLACE: the server has half-written tensors to account for when it learns of the abort.
            outcome = bounded(lambda: client.push(model(2), version="stalled", transport="inline",
                                                  progress=stop_at_bucket(1, lambda: os.kill(pid, signal.SIGSTOP))),
                              BOUND)
            assert_unresponsive(outcome, node.address)
            # Still stopped: a query and a new push are bounded too, and name the server.
            query = bounded(client.server_info, BOUND)
            assert isinstance(query, WeightSyncRpcError), repr(query)
            # Its deadline, or the keepalive that closed the dead connection first: bounded and named either way.
            assert query.server == node.address
            assert query.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), query
            refused = bounded(lambda: client.push(model(3), version="while-stopped", transport="inline"), BOUND)
            assert isinstance(refused, UpdateFailed) and refused.server == node.address, repr(refused)
            assert refused.reason == "READY_TIMEOUT"
        finally:
            os.kill(pid, signal.SIGCONT)
        # At once, while the resumed server is usually still winding the abandoned updates down (the
        # SDK waits that out, within its timeout); a full update, which a torn IN_PLACE store needs.
        result = client.push(after, version="after", transport="inline")
        assert result.servers[0].version == "after"
        assert client.verify(after).ok
        assert client.server_info()[0].store_state == pb.STORE_STATE_CONSISTENT
    assert server_checksums(node, sorted(after)) == [local_checksums(after)]


class StallingProxy:
    """Forwards TCP to a port until stalled; then holds every byte, both ways, with the connections open
    (a dropped port: nothing answers, nothing is refused)."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._flowing.set()
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            self._flowing.wait()
            try:
                data = src.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            self._flowing.wait()  # a chunk read just before the stall is held until resume
            try:
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def test_inline_push_through_a_port_that_stops_answering_fails_typed_and_the_next_push_commits(node):
    proxy = StallingProxy(node.port)
    try:
        with WeightSyncClient(proxy.address, timeout=TIMEOUT, max_message_bytes=MAX_MESSAGE) as client:
            before = model(11)
            client.push(before, version="proxy-before", transport="inline", allow_new_tensors=True)
            try:
                outcome = bounded(lambda: client.push(model(12), version="proxy-stalled", transport="inline",
                                                      mode="staged", progress=stop_at_bucket(1, proxy.stall)), BOUND)
            finally:
                proxy.resume()
            assert_unresponsive(outcome, proxy.address)
            assert client.verify(before).ok  # STAGED: the committed weights are untouched
            after = model(13)
            client.push(after, version="proxy-after", transport="inline")
            assert client.verify(after).ok
    finally:
        proxy.close()
    assert server_checksums(node, sorted(after)) == [local_checksums(after)]


@pytest.fixture(scope="module")
def impatient(tmp_path_factory) -> Iterator[ServerProcess]:
    """A healthy server that gives up on a silent client well before the client's own timeout."""
    server = start_server(tmp_path_factory.mktemp("impatient"), "--ingress-slot-bytes", str(1 << 20),
                          "--max-message-bytes", str(MAX_MESSAGE), "--transfer-timeout-seconds", "2")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def test_a_healthy_server_idling_out_while_the_sdk_waits_on_a_stopped_one_is_not_blamed(impatient, node):
    """INLINE sends each chunk to every server in turn: while the SDK waits on the stopped server,
    the healthy one (listed first) gets nothing and aborts CLIENT_IDLE after 2 s, before the SDK's
    5 s. That is a symptom; the push names the stopped server. Then both take the next push."""
    pid = node.process.pid
    servers = [impatient.address, node.address]
    with WeightSyncClient(servers, timeout=TIMEOUT, max_message_bytes=MAX_MESSAGE) as client:
        client.push(model(5), version="both", transport="inline", mode="staged", allow_new_tensors=True)
        try:
            outcome = bounded(lambda: client.push(model(6), version="stalled", transport="inline", mode="staged",
                                                  progress=stop_at_bucket(1, lambda: os.kill(pid, signal.SIGSTOP))),
                              BOUND)
            assert_unresponsive(outcome, node.address)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [s.current_version.version for s in client.server_info()] == ["both", "both"]  # STAGED: the old version stays
        after = model(7)
        result = client.push(after, version="after-both", transport="inline", mode="staged")
        assert [s.version for s in result.servers] == ["after-both", "after-both"]
        assert client.verify(after).ok
    assert server_checksums(impatient, sorted(after)) == [local_checksums(after)]
    assert server_checksums(node, sorted(after)) == [local_checksums(after)]
