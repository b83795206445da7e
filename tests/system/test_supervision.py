"""Defect 6 (server half): no background task of the server dies silently.

A real Supervisor with a real worker process, in this test's event loop: a failing callback
does not stop the heartbeat watch, and a respawn whose Popen fails is retried. Plus the two
asyncio tools the server's clean-ups rely on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from weightsync.server.tasks import finish_despite_cancel, supervised
from weightsync.server.workers.supervisor import Supervisor
from weightsync.v1 import weight_sync_service_pb2 as pb

pytestmark = pytest.mark.timeout(120)


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def make_supervisor(**callbacks) -> Supervisor:
    return Supervisor(("cpu",), queue_capacity_bytes=1 << 20, log_level="warning", memory_limit_bytes=0,
                      on_worker_died=callbacks.get("died", lambda w: None),
                      on_worker_started=callbacks.get("started", lambda w: None),
                      on_worker_unresponsive=callbacks.get("unresponsive", lambda w: None))


def test_a_failing_callback_does_not_stop_the_heartbeat_watch():
    calls = []

    def unresponsive(worker) -> None:
        calls.append(worker.index)
        if len(calls) == 1:
            raise RuntimeError("a bug in a callback")

    async def scenario() -> None:
        supervisor = make_supervisor(unresponsive=unresponsive)
        await supervisor.start()
        worker = supervisor.workers[0]
        try:
            for _stall in range(2):  # the second stall is seen only if the watch survived the first
                os.kill(worker.process.pid, signal.SIGSTOP)
                await until(lambda: worker.state == pb.WORKER_STATE_UNRESPONSIVE)
                os.kill(worker.process.pid, signal.SIGCONT)
                await until(lambda: worker.state == pb.WORKER_STATE_RUNNING)
            assert calls == [0, 0]
            # And it still takes commands.
            event = await supervisor.call(worker, 10, unmap_arenas={"arena_ids": []})
            assert event.WhichOneof("event") == "arenas_mapped"
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)
            await supervisor.stop()

    asyncio.run(scenario())


def test_a_respawn_whose_popen_fails_is_retried(monkeypatch):
    async def scenario() -> None:
        supervisor = make_supervisor()
        await supervisor.start()
        worker = supervisor.workers[0]
        first_pid = worker.process.pid
        real_popen = subprocess.Popen
        failures = []

        def failing_once(*args, **kwargs):
            if not failures:
                failures.append(1)
                raise OSError(11, "Resource temporarily unavailable")
            return real_popen(*args, **kwargs)

        monkeypatch.setattr(subprocess, "Popen", failing_once)
        try:
            os.kill(first_pid, signal.SIGKILL)
            await until(lambda: failures and worker.state == pb.WORKER_STATE_RUNNING
                        and worker.process.pid != first_pid)
            event = await supervisor.call(worker, 10, unmap_arenas={"arena_ids": []})
            assert event.WhichOneof("event") == "arenas_mapped"
        finally:
            await supervisor.stop()

    asyncio.run(scenario())


def test_supervised_restarts_a_body_that_raised():
    runs = []

    async def body() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise ValueError("malformed answer")

    asyncio.run(asyncio.wait_for(supervised("test", body), 10))
    assert len(runs) == 3


def test_finish_despite_cancel_survives_two_cancels():
    async def scenario() -> list[str]:
        done: list[str] = []

        async def cleanup() -> None:
            await asyncio.sleep(0.3)
            done.append("abort")
            await asyncio.sleep(0.1)
            done.append("write_done")

        async def handler() -> None:
            try:
                await asyncio.sleep(10)
            finally:
                await finish_despite_cancel(cleanup())

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0.05)
        task.cancel()  # the client cancels...
        await asyncio.sleep(0.1)
        task.cancel()  # ... and again, during the clean-up
        with pytest.raises(asyncio.CancelledError):
            await task
        return done

    assert asyncio.run(scenario()) == ["abort", "write_done"]


@pytest.mark.parametrize(("exit_code", "quick_failures", "seconds"), [
    (-9, 1, 0.0),     # killed once: at once
    (1, 3, 1.0),      # dying in quick succession: doubling
    (1, 20, 30.0),    # ... up to the cap
    (86, 1, 0.0),     # a sticky CUDA error: a fresh process fixes it, at once
    (87, 1, 30.0),    # the device is gone: a restart cannot help soon, never a loop
])
def test_restart_delay(exit_code, quick_failures, seconds):
    from weightsync.server.workers.supervisor import restart_delay

    assert restart_delay(exit_code, quick_failures) == seconds
