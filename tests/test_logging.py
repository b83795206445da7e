"""Issue 9, defect 17: processes that share one stderr never merge their log lines."""

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
