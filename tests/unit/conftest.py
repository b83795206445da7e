"""tests/unit: the fast tier (make test-fast). Its tests start no process.

While a test of this folder sets up, runs and tears down, starting a process raises
ProcessStartRefused: subprocess.Popen (so asyncio's subprocesses too), a multiprocessing process
(so a process pool too), os.fork, os.system and os.posix_spawn. A test that needs a server process,
a trainer rank or an external tool belongs in tests/integration or tests/system (tests/README.md).
The guard is on only for this folder's tests: make test runs every tier in the same workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator

import pytest


class ProcessStartRefused(RuntimeError):
    """A test of tests/unit tried to start a process."""


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise ProcessStartRefused(f"tests/unit starts no process ({what}): move the test to tests/integration or tests/system")

    return refused


_GUARDED: list[tuple[object, str]] = [
    (subprocess.Popen, "__init__"),
    (multiprocessing.process.BaseProcess, "start"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "system"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
]


@contextlib.contextmanager
def processes_refused() -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name in _GUARDED if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, _refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with processes_refused():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with processes_refused():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with processes_refused():
        return (yield)
