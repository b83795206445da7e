"""tests/unit/conftest.py refuses every way this tier's tests could start a process. Without the
guard, each of these would start one (a forked child leaves at once)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys

import pytest

REFUSED = "tests/unit starts no process"


def test_a_subprocess_is_refused():
    with pytest.raises(RuntimeError, match=REFUSED):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_an_asyncio_subprocess_is_refused():
    async def start() -> None:
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")

    with pytest.raises(RuntimeError, match=REFUSED):
        asyncio.run(start())


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_multiprocessing_process_is_refused(method):
    process = multiprocessing.get_context(method).Process(target=print)
    with pytest.raises(RuntimeError, match=REFUSED):
        process.start()


def test_fork_and_system_are_refused():
    with pytest.raises(RuntimeError, match=REFUSED):
        if (pid := os.fork()) == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    with pytest.raises(RuntimeError, match=REFUSED):
        os.system("true")
