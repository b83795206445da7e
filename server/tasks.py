"""Background tasks that never die silently, and clean-ups that a second cancel cannot cut short.

Every long-lived task of the server (the group watch, the heartbeat watch, the engine drivers)
runs under `supervised`: an exception is logged as one structured line with its traceback and
the task starts again after a backoff, so a bad answer from a peer costs one round, not the
task. Fire-and-forget work (`TaskSet.spawn`) has its failure logged the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from weightsync.common.logging import get_logger

log = get_logger("weightsync.tasks")

T = TypeVar("T")

RESTART_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 5.0)
"""Waits before restarting a failed background task, the last one repeated."""


async def supervised(name: str, body: Callable[[], Awaitable[None]]) -> None:
    """Run `body` until it returns or is cancelled; restart it, with backoff, whenever it raises."""
    failures = 0
    while True:
        try:
            await body()
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged and restarted: the task is the server's, not the error's
            delay = RESTART_BACKOFF_SECONDS[min(failures, len(RESTART_BACKOFF_SECONDS) - 1)]
            failures += 1
            log.exception("background_task_failed", task=name, restart_in_seconds=delay, failures=failures)
            await asyncio.sleep(delay)


class TaskSet:
    """Tasks started and forgotten by their starter, kept referenced until they end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._ended(done, name))
        return task

    def _ended(self, task: asyncio.Task[Any], name: str) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.error("background_task_failed", task=name, error=f"{type(error).__name__}: {error}",
                      exc_info=error)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def finish_despite_cancel(work: Awaitable[T]) -> T:
    """Await `work` to its end even if the caller is cancelled meanwhile, once or many times
    (a client that aborts and then cancels); the cancellation is re-raised afterwards.
    `work` must be bounded in time: this is for clean-ups whose every step has a timeout."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            if task.done():  # it ended while we were being cancelled: take its result below
                result = task.result()
                cancelled = True
                break
            cancelled = True
            log.info("cleanup_continues_despite_cancel")  # a cancel came mid-clean-up: seen in the log
    if cancelled:
        raise asyncio.CancelledError()
    return result


def retrieve_quietly(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as seen (it is handled elsewhere), so asyncio does not log
    'exception was never retrieved' with a multi-line traceback."""
    def seen(done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()

    future.add_done_callback(seen)
