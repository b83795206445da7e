"""Processes that share one stderr never merge their log lines."""

from __future__ import annotations

import json
import subprocess
import sys

WRITER = """
import sys, structlog
from weightsync.common.logging import configure_logging
configure_logging("info", json=True)
log = structlog.get_logger()
for i in range(300):
    log.info("event", writer=int(sys.argv[1]), i=i, pad="x" * int(sys.argv[2]))
"""


def lines_from_concurrent_writers(pad: int, writers: int = 4) -> list[str]:
    """Like the server and its workers: several processes, one inherited stderr pipe."""
    script = f"import subprocess, sys\nprocs = [subprocess.Popen([sys.executable, '-c', {WRITER!r}, str(w), '{pad}']) for w in range({writers})]\n" \
             "[p.wait() for p in procs]\n"
    result = subprocess.run([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, timeout=120)
    return result.stderr.splitlines()


def test_one_json_object_per_line_from_concurrent_processes():
    lines = lines_from_concurrent_writers(pad=100)
    assert len(lines) == 1200
    events = [json.loads(line) for line in lines]  # every line parses alone (no "}{")
    assert sorted((e["writer"], e["i"]) for e in events) == sorted((w, i) for w in range(4) for i in range(300))


def test_lines_longer_than_an_atomic_pipe_write_are_shortened_not_split():
    lines = lines_from_concurrent_writers(pad=9000)
    assert len(lines) == 1200
    events = [json.loads(line) for line in lines]
    assert all(e["truncated"] is True and len(line.encode()) < 4096 for e, line in zip(events, lines, strict=True))
    assert all(e["pad"].startswith("xxxx") and "chars cut" in e["pad"] for e in events)


TRAINER = """
import logging, sys, torch
from weightsync.client import WeightSyncClient
if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s", stream=sys.stderr)
with WeightSyncClient(sys.argv[1]) as client:
    client.create_group(backend="gloo")
    client.push({"w": torch.arange(64.0)}, version="v1", allow_new_tensors=True)
    client.push({"w": torch.arange(64.0) + 1}, version="v2", transport="inline")
print("done")
"""


def run_trainer(address: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRAINER, address, mode], capture_output=True, text=True, timeout=120)


def test_the_sdk_leaves_the_trainers_stdout_alone_and_logs_through_the_standard_library(tmp_path):
    from helpers import running_server

    with running_server(tmp_path, workers=1) as server:
        plain = run_trainer(server.address, "plain")
        configured = run_trainer(server.address, "configured")
    assert plain.returncode == 0, plain.stderr[-2000:]
    # Nothing configured: the SDK's info lines go nowhere, and never to stdout.
    assert plain.stdout == "done\n"
    assert "push_committed" not in plain.stderr and "group_" not in plain.stderr
    # The application configured logging: its handler gets weightsync's records, named and levelled.
    assert configured.returncode == 0, configured.stderr[-2000:]
    assert configured.stdout == "done\n"
    committed = [line for line in configured.stderr.splitlines() if "push_committed" in line]
    assert len(committed) == 2, configured.stderr[-2000:]
    assert committed[0].startswith("weightsync.client|INFO|push_committed ") and "version='v1'" in committed[0]
    assert any(line.startswith("weightsync.client|INFO|group_ready ") for line in configured.stderr.splitlines())


def test_a_configured_process_renders_weightsync_and_foreign_records_as_json_lines():
    script = (
        "import logging\nfrom weightsync.common.logging import configure_logging, get_logger\n"
        "configure_logging('info', json=True)\n"
        "get_logger('weightsync.test').info('thing_done', size=3, name='x')\n"
        "logging.getLogger('asyncio').warning('foreign %s', 'text')\n"
        "get_logger('weightsync.test').debug('hidden')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    get_logger('weightsync.test').exception('failed')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout == ""
    events = [json.loads(line) for line in result.stderr.splitlines()]
    assert [(e["event"], e["level"], e["logger"]) for e in events] == [
        ("thing_done", "info", "weightsync.test"), ("foreign text", "warning", "asyncio"),
        ("failed", "error", "weightsync.test")]
    assert (events[0]["size"], events[0]["name"]) == (3, "x")
    assert "ZeroDivisionError" in events[2]["exception"]
