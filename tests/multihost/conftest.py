"""Multi-host suite: three network namespaces on one machine, a weightsync server in each node.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; everything is skipped with the
reason otherwise. No __init__.py: modules are imported by path, like tests/system/faults.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from meshkit import GROUP_TIMEOUT, MEASURED, RPC_TIMEOUT, Cluster  # noqa: E402
from netns import NetnsUnavailable, check_available, list_netns  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "multihost: needs root: network namespaces, veth, a bridge, tc")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.resolve().parent == HERE and "multihost" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: every test in tests/multihost must be marked multihost")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if MEASURED:
        terminalreporter.write_sep("-", "multihost measurements")
        for key, value in MEASURED.items():
            terminalreporter.write_line(f"{key}: {json.dumps(value) if not isinstance(value, str) else value}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The mesh (trainer, node-a, node-b), an mTLS server on each node, the trainer process."""
    try:
        check_available()
    except NetnsUnavailable as error:
        pytest.skip(f"multi-host tests need network namespaces: {error}")
    directory = tmp_path_factory.mktemp("multihost")
    with Cluster(directory, rpc_timeout=RPC_TIMEOUT) as running:
        MEASURED["cluster start (mesh + 2 servers + trainer), s"] = round(running.startup_seconds, 2)
        tag = running.mesh.tag
        yield running
    # Closed: servers stopped with SIGTERM; namespaces (veths, bridge) gone.
    problems = [f"{role} exited {code}:\n{running.servers[role].log()[-3000:]}"
                for role, code in running.exit_codes.items() if code != 0]
    left = [name for name in list_netns() if name.startswith(f"{tag}-")]
    if left:
        problems.append(f"namespaces left behind: {left}")
    assert not problems, "\n".join(problems)


@pytest.fixture
def group(cluster):
    """A fresh transfer group for one test, deleted afterwards (whatever the test did to it)."""
    answer = cluster.trainer.call("create_group", timeout=GROUP_TIMEOUT)
    yield answer
    with contextlib.suppress(AssertionError):
        cluster.trainer.call("delete_group", expect=("deleted", "error"), wait=60)
