"""A blocking call in a thread of its own, waited for until a deadline and abandoned past it.

Some calls block far past the timeout they are given (torch's TCPStore client on an
address that accepts TCP but never answers; a process group's rendezvous), and some
must not hold up their caller while they block (rank 0's rendezvous while the servers
are asked to join). Run through ThreadCall, the caller waits only as long as it
chooses. An abandoned call is left to finish or fail by itself; whatever it built is
handed to `discard` (to be closed) instead of being returned, so nothing leaks and
nobody uses a half-abandoned result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CallAbandoned(TimeoutError):
    """The call did not finish before the caller's deadline and was abandoned."""


class ThreadCall(Generic[T]):
    """`fn()` in a daemon thread, started at construction."""

    def __init__(self, fn: Callable[[], T], *, name: str, discard: Callable[[T], None] | None = None) -> None:
        self._fn = fn
        self._discard = discard
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        value: T | None = None
        try:
            value = self._fn()
        except BaseException as error:  # noqa: BLE001 - handed to result()
            self._error = error
        with self._lock:
            discard = self._abandoned and value is not None
            if not discard:
                self._value = value
            self._done.set()
        if discard and self._discard is not None:
            self._discard(value)  # type: ignore[arg-type]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def wait(self, timeout: float) -> bool:
        """Whether the call finished within `timeout` seconds; unlike result(), never abandons it."""
        return self._done.wait(timeout)

    def result(self, timeout: float) -> T:
        """The call's value, or what it raised. Past `timeout` seconds the call is abandoned
        (its value goes to `discard` when it comes) and CallAbandoned is raised."""
        finished = self._done.wait(timeout)
        if not finished:
            with self._lock:
                # Decided under the lock: the thread either stored its value before this
                # (and we take it) or will see `_abandoned` and discard it; never both.
                finished = self._done.is_set()
                if not finished:
                    self._abandoned = True
            if not finished:
                raise CallAbandoned(f"did not finish within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def abandon(self) -> None:
        """Nobody will take the value: discard it now, or as soon as it comes."""
        with self._lock:
            self._abandoned = True
            value, self._value = self._value, None
        if value is not None and self._discard is not None:
            self._discard(value)
