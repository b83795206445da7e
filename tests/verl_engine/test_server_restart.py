"""A weightsync server restarted between two of verl's steps (issue 36): verl's lifecycle (as
test_verl_checkpoint_engine drives it: two actor ranks, rank 0 pushing with delta, one rollout
worker) over a real server; the server is stopped (SIGTERM, exit 0) and started again on the same
address, with an empty store and a new local socket. The next steps must still work with the same
actor and rollout processes: the actor's SDK client, whose last commit the new server does not
hold, sends the step dense (the server refuses the delta base, BASE_MISMATCH, and the client falls
back), the rollout finds its node's new local socket, and gets the step bit for bit; the step after
goes as a delta again. Steps asked while the server is down fail on every worker with a typed
error, at once (not at the bound, timeout_s), and the node then takes the next step as if nothing
happened.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed here: run make test-verl")

from test_fsdp_actors import free_port  # noqa: E402
from test_verl_checkpoint_engine import Worker, assert_bit_exact, sync  # noqa: E402
from verl_workers import weights_for  # noqa: E402

from weightsync.client import WeightSyncClient  # noqa: E402
from weightsync.engine import EngineClient  # noqa: E402

from helpers import ServerProcess, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TIMEOUT_S = 150.0
"""The engine's timeout_s: the bound on each wait of a sync (an RPC, the rollout's wait for a commit).
Generous: the first delta push (step 2) compiles the SDK's numba kernels, over a minute on a loaded
2-core machine, while the rollout waits."""
DOWN_S = 30.0
"""A step asked while the server is down fails within this: at once, not at TIMEOUT_S."""


class RestartableServer:
    """A server process that can be stopped and started again on the same address."""

    def __init__(self, tmp_path: Path, port: int) -> None:
        self.tmp_path = tmp_path
        self.port = port
        self.process: ServerProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        assert self.process is not None
        code = self.process.stop()
        assert code == 0, self.process.log()[-3000:]
        self.process = None

    def start(self) -> None:
        assert self.process is None
        self.process = start_server(self.tmp_path, "--listen", self.address, workers=1)
        assert self.process.port == self.port

    def restart(self) -> None:
        self.stop()
        self.start()

    def local_socket(self) -> str:
        assert self.process is not None
        with EngineClient(server=self.address, name="test") as engine:
            return engine.socket_path


@pytest.fixture()
def server(tmp_path) -> Iterator[RestartableServer]:
    """Not started yet: the test starts it while its workers import verl."""
    server = RestartableServer(tmp_path, free_port())
    try:
        yield server
    finally:
        if server.process is not None:
            server.stop()


def committed(server: RestartableServer) -> tuple[str, int]:
    with EngineClient(server=server.address, name="test") as engine:
        version = engine.status().version
        return version.version, version.generation


def test_steps_go_on_after_the_server_restarts_between_them(server: RestartableServer) -> None:
    kwargs = {"servers": [server.address], "transport": "inline", "timeout_s": TIMEOUT_S, "senders": "one"}
    actors = [Worker("actor", True, kwargs), Worker("actor", False, kwargs)]
    rollouts = [Worker("rollout", False, kwargs)]
    try:
        server.start()  # while the workers import verl
        assert [w.ready() for w in actors + rollouts] == ["WeightSyncCheckpointEngine"] * 3
        # Steps 1 and 2: the first dense, the second a delta against it.
        for step in (1, 2):
            actor_results, (received,) = sync(actors, rollouts, step)
            assert_bit_exact(received, weights_for(step))
        assert_delta(actor_results)

        # Restarted between steps 2 and 3, on the same address: an empty store (a new store epoch)
        # and a new local socket (its name carries the pid). Step 3 commits, bit for bit; the
        # actor's client planned patches against step 2, which the new server does not hold: it
        # refuses that base (BASE_MISMATCH, at Begin) and the client sends the step dense. Step 4
        # is a delta again.
        old_socket = server.local_socket()
        server.restart()
        assert server.local_socket() != old_socket
        assert committed(server) == ("", 0)
        actor_results, (received,) = sync(actors, rollouts, 3)
        assert_bit_exact(received, weights_for(3))
        assert_dense(actor_results)
        assert committed(server)[0] == "3"
        actor_results, (received,) = sync(actors, rollouts, 4)
        assert_bit_exact(received, weights_for(4))
        assert_delta(actor_results)

        # Steps 5 and 6 are asked while the server is down: every actor rank raises PUSH_FAILED
        # naming rank 0 (SERVER_UNREACHABLE), the rollout worker too (rank 0's outcome), well within
        # the bound of their waits (not at it). At step 6 the rollout worker's init_process_group
        # finds no server either (it connects when the server is back). Started again, the node
        # takes step 7, bit for bit, and verifies.
        server.stop()
        for step in (5, 6):
            started = time.monotonic()
            actor_results, (rollout_result,) = sync(actors, rollouts, step)
            assert time.monotonic() - started < DOWN_S
            for kind, error in [*actor_results, rollout_result]:
                assert kind == "error", error
                assert (error["type"], error["reason"], error["rank"], error["version"], error["cause_reason"]) == (
                    "WeightSyncVerlError", "PUSH_FAILED", 0, str(step), "SERVER_UNREACHABLE"), error["message"]
        server.start()
        _, (received,) = sync(actors, rollouts, 7)
        assert_bit_exact(received, weights_for(7))
        with WeightSyncClient(server.address) as client:
            assert client.verify(weights_for(7)).ok
    finally:
        for w in actors + rollouts:
            w.stop()


def assert_delta(actor_results: list[dict]) -> None:
    metrics = actor_results[0]  # rank 0 pushed; rank 1's answer is the same metrics
    assert metrics["weightsync/bytes_sent"] < metrics["weightsync/dense_bytes"] / 10, metrics


def assert_dense(actor_results: list[dict]) -> None:
    metrics = actor_results[0]
    assert metrics["weightsync/bytes_sent"] >= metrics["weightsync/dense_bytes"], metrics
