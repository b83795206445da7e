"""Fault-injection suite: a shared server, and a leak check after every test.

No __init__.py here: test modules are imported by file path (pytest's default
"prepend" mode puts this folder on sys.path); tests/ goes on sys.path too so
`helpers` and `models` import the same way as in tests/*.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from faultkit import (  # noqa: E402
    HELPERS,
    TRACKED,
    delete_group,
    groups,
    info,
    start_tracked_server,
    stop_and_check,
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.resolve().parent == HERE and "faults" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: every test in tests/system/faults must be marked faults")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A 2-worker CPU server shared by one module's tests; each test leaves it clean (see no_leaks)."""
    server = start_tracked_server(tmp_path_factory.mktemp("node"))
    yield server
    problems = stop_and_check(server)
    assert not problems, problems


@pytest.fixture(autouse=True)
def no_leaks():
    """After every fault test: no helper process, no process or segment of a stopped server left,
    no group (and no update) left on a running one.

    Leftover groups are deleted before failing, so one failure does not cascade into the tests
    that share the server."""
    helpers_before = len(HELPERS)
    for entry in TRACKED:
        entry.refresh()
    yield
    problems: list[str] = []
    for process in HELPERS[helpers_before:]:
        if process.poll() is None:
            process.kill()
            process.wait()
            problems.append(f"helper process {process.pid} ({process.args[1:3]}) was still running")
    del HELPERS[helpers_before:]
    for entry in TRACKED:
        if entry.checked:
            continue
        if entry.server.process.poll() is not None:  # the test stopped or killed it
            entry.server.process.wait()
            problems.extend(entry.leaks_after_exit())
            continue
        entry.refresh()
        replaced = entry.orphaned_workers()
        if replaced:
            problems.append(f"{entry.server.address}: replaced workers still running: {sorted(replaced)}")
        try:
            left = groups(entry.server)
            for group in left:
                try:
                    delete_group(entry.server, group.group_id)
                except grpc.RpcError as error:
                    problems.append(f"{entry.server.address}: could not delete {group.group_id}: {error.details()}")
            if left:
                problems.append(
                    f"{entry.server.address}: groups left open: "
                    f"{[(g.group_id, pb.GroupState.Name(g.state)) for g in left]}"
                )
            state = info(entry.server).store_state
            if state == pb.STORE_STATE_UPDATING:
                problems.append(f"{entry.server.address}: an update is still running")
        except grpc.RpcError as error:
            problems.append(f"{entry.server.address}: unreachable after the test: {error.code()} {error.details()}")
    assert not problems, "\n".join(problems)
