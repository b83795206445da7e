"""One worker per GPU. A GPU listed twice is refused at start-up with a
reason, through the command line as through the config; CPU workers may repeat."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightsync.server.config import ServerConfig


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:0", "cuda:1")])
def test_a_gpu_listed_twice_is_refused(devices):
    with pytest.raises(ValueError, match=r"device cuda:\d is listed 2 times: one worker per GPU"):
        ServerConfig(devices=devices)


def test_cpu_workers_may_repeat_and_distinct_gpus_are_fine():
    assert ServerConfig(devices=("cpu", "cpu")).devices == ("cpu", "cpu")
    assert ServerConfig(devices=("cuda:0", "cuda:1")).devices == ("cuda:0", "cuda:1")


def test_the_command_line_says_why_and_exits_non_zero():
    result = subprocess.run([sys.executable, "-m", "weightsync.server.cli", "--devices", "cuda:0,cuda:0",
                             "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "device cuda:0 is listed 2 times" in result.stderr + result.stdout
