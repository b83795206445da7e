"""Two nodes (docs/gpus.md, "Two nodes"): the trainer here, a server with CUDA workers on another node, NCCL between
them over the network transport (sockets or InfiniBand), where a peer's death is an error NCCL reports rather than a
kernel left spinning.

Skipped unless WEIGHTSYNC_GPU_REMOTE_SERVER names that server (host:port, started there with --devices cuda:...
and reachable from here; the group's store is hosted here, on the interface that routes to it):
  - one trainer over NCCL: two pushes bit for bit, the group's first push against its second (the connect across
    nodes: L6), and the interface NCCL was pinned to named in the trainer's log (common/nccl_env.py);
  - the trainer SIGKILLed mid-push: the remote workers fail their transfer and the server lists the group BROKEN
    or gone within the group timeout + the server's margin (C3, from the workers' side: an NCCL error read
    within its bound, never torch's wait() aborting in the worker's command loop);
  - two parts here (cuda:0, cuda:1) pushing over one NCCL group to the remote workers (test_nccl_parts.py's
    trainer script): every pair on the group's one communicator, across nodes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from gpukit import gpu_model, record
from helpers import free_port, run_ranks

REMOTE = os.environ.get("WEIGHTSYNC_GPU_REMOTE_SERVER", "")
GROUP_TIMEOUT = 30.0
SERVER_MARGIN_SECONDS = 2.0

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not REMOTE, reason="needs a second node: set WEIGHTSYNC_GPU_REMOTE_SERVER=host:port "
                                                    "of a weightsync server with CUDA workers there")]


def test_one_trainer_pushes_across_nodes_over_nccl(caplog):
    caplog.set_level("WARNING", logger="weightsync.nccl_env")
    torch.cuda.set_device(0)
    with WeightSyncClient(REMOTE, timeout=120) as client:
        client.create_group(backend="nccl", timeout=GROUP_TIMEOUT)
        seconds = []
        for step in range(2):
            model = gpu_model(step, scale=64)
            started = time.monotonic()
            client.push(model, version=f"v{step}", allow_new_tensors=True, bucket_size_bytes=16 << 20)
            seconds.append(time.monotonic() - started)
            assert client.verify(model).ok
    pinned = [r.getMessage() for r in caplog.records if "nccl_interface_pinned" in r.getMessage()]
    record("two_nodes_push", seconds=seconds, interface=pinned[:1])
    assert seconds[0] - seconds[1] < 10.0


TRAINER = textwrap.dedent('''
    import sys, torch
    from weightsync.client import WeightSyncClient
    sys.path.insert(0, sys.argv[2])
    from gpukit import gpu_model
    torch.cuda.set_device(0)
    client = WeightSyncClient(sys.argv[1], timeout=120)
    client.create_group(backend="nccl", timeout=float(sys.argv[3]))
    print("group", client._group.group_id, flush=True)
    step = 0
    while True:
        client.push(gpu_model(step, scale=256), version=f"v{step}", allow_new_tensors=True, bucket_size_bytes=1 << 20)
        print("pushed", flush=True)
        step += 1
''')


def test_a_trainer_killed_mid_push_fails_the_remote_workers_in_bound():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, REMOTE, str(Path(__file__).parent), str(GROUP_TIMEOUT)],
                               stdout=subprocess.PIPE, text=True)
    try:
        group_id = trainer.stdout.readline().split()[1]
        assert trainer.stdout.readline().strip() == "pushed"
        trainer.send_signal(signal.SIGKILL)
        killed = time.monotonic()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait(30)
    with WeightSyncClient(REMOTE, timeout=60) as observer:
        deadline = killed + GROUP_TIMEOUT + SERVER_MARGIN_SECONDS + 5.0
        while time.monotonic() < deadline:
            groups = {g.group_id: g for g in next(iter(observer.list_groups().values()))}
            if group_id not in groups or groups[group_id].state == pb.GROUP_STATE_BROKEN:
                break
            time.sleep(0.2)
        seen = time.monotonic() - killed
    record("two_nodes_trainer_killed", seconds_to_broken=seen)
    assert seen < GROUP_TIMEOUT + SERVER_MARGIN_SECONDS + 1.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs on this node for the two parts")
def test_two_parts_here_push_to_remote_workers_over_nccl(tmp_path):
    script = Path(__file__).parent / "test_nccl_parts.py"
    zero, one = run_ranks([str(script), "{rank}", "2", str(free_port()), REMOTE, str(tmp_path), "nccl", "0"], 2,
                          tmp_path, 400)
    record("two_nodes_parts", seconds=[zero["seconds"], one["seconds"]], free=[zero["free"], one["free"]])
    assert zero["v2_mismatches"] == one["v2_mismatches"] == []
