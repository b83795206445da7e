"""A refused create_group() leaves nothing running (issue 43, item 13): its rendezvous thread ends with the call,
so a program that exits right after it exits 0. Before, the thread waited out the group's timeout in torch's
rendezvous; a program exiting while it timed out died with SIGABRT (rc 134: torch's C++ raising into an
interpreter that was finalizing)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums, start_server

pytestmark = pytest.mark.timeout(600)

GROUP_TIMEOUT = 600.0
"""The refused call's group timeout, past PROGRAM_TIMEOUT: a call (or thread) that waits it out fails the test."""
PROGRAM_TIMEOUT = 300.0
"""Bounds the whole program: its interpreter's start, one group, one refusal, its exit."""

PROGRAM = textwrap.dedent("""
    import json, sys, threading
    from weightsync.client import WeightSyncClient, WeightSyncRpcError
    with WeightSyncClient(sys.argv[1]) as client:
        try:
            client.create_group(group_id="held-by-the-test", timeout=float(sys.argv[2]))
            outcome = "created"
        except WeightSyncRpcError as error:
            outcome = error.reason
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("rendezvous-"))
    print(json.dumps({"outcome": outcome, "threads": threads}), flush=True)
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_server(tmp_path_factory.mktemp("refused-exit"), workers=1)
    yield started
    assert started.stop() == 0, started.log()[-3000:]


def test_a_program_whose_create_group_was_refused_exits_0_with_no_rendezvous_thread_left(server):
    with WeightSyncClient(server.address) as holder:
        holder.create_group(group_id="held-by-the-test", timeout=60)
        done = subprocess.run([sys.executable, "-c", PROGRAM, server.address, str(GROUP_TIMEOUT)],
                              capture_output=True, text=True, timeout=PROGRAM_TIMEOUT)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"outcome": "GROUP_ALREADY_EXISTS", "threads": []}
        groups = server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=30).groups
        assert [(g.group_id, g.state) for g in groups] == [("held-by-the-test", pb.GROUP_STATE_READY)]
        tensors = {"w": torch.arange(64, dtype=torch.float32)}
        holder.push(tensors, version="after-refusal", allow_new_tensors=True)  # the next normal operation
        assert holder.verify(tensors).ok
        assert server_checksums(server) == [local_checksums(tensors)]
