"""A bucket to several owners over NCCL: one batch against a batch per owner (review H3, F6), on three GPUs.

Rank 0 on cuda:0 sends 256 MiB to ranks 1 and 2 (cuda:1, cuda:2), each a process of its own (this file run as a
script), in one weightsync group. Alternated, 5 times each: the bucket to both owners as ONE batch (what a part
does: CollectiveGroup.send_many_async), and as a batch per owner, each waited for before the next (what a part did
before). Recorded: each way's median seconds and their ratio (a measurement, not a timed assertion; the CPU
proof that the order stays deadlock-free is tests/unit/test_receive_order.py). Checked: every receive's bytes.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
BYTES = 256 * MIB
REPS = 5
GROUP_TIMEOUT = 60.0


def rank_main() -> None:
    """python test_nccl_batches.py RANK PORT"""
    import torch
    from torch.distributed import TCPStore

    from weightsync.common.collective import open_group
    from weightsync.common.nccl_env import trainer_group_environment
    from weightsync.v1 import weight_sync_service_pb2 as pb

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    with trainer_group_environment(None, group_timeout=GROUP_TIMEOUT):
        group = open_group(group_id="batches", backend=pb.BACKEND_NCCL, store=store, rank=rank, world_size=3,
                           timeout=datetime.timedelta(seconds=GROUP_TIMEOUT), device=device,
                           local_address="127.0.0.1")
    pattern = (torch.arange(BYTES, dtype=torch.int64, device=device) % 251).to(torch.uint8)
    out: dict = {"rank": rank, "seconds": {"one_batch": [], "per_owner": []}, "bytes_ok": True}
    modes = ["one_batch", "per_owner"] * REPS
    if rank == 0:
        group.wait(group.send_many_async(pattern, [1, 2], 0)[0])  # warm-up: both pairs connected
        for mode in modes:
            torch.cuda.synchronize()
            started = time.monotonic()
            if mode == "one_batch":
                [work] = group.send_many_async(pattern, [1, 2], 0)
                group.wait(work)
            else:
                for owner in (1, 2):
                    group.wait(group.send_async(pattern, owner, 0))
            out["seconds"][mode].append(time.monotonic() - started)
    else:
        into = torch.zeros(BYTES, dtype=torch.uint8, device=device)
        for _ in range(1 + len(modes)):
            into.zero_()
            group.receive(into, 0, 0)
            out["bytes_ok"] &= bool(torch.equal(into, pattern))
    out["closed"] = group.close(10.0)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    rank_main()


# -- the test ---------------------------------------------------------------------------------------------
import pytest  # noqa: E402
import torch  # noqa: E402

from gpukit import record  # noqa: E402
from helpers import free_port  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs (a sender and two owners)")]


def test_a_bucket_to_two_owners_in_one_batch_against_a_batch_per_owner():
    port = free_port()
    children = [subprocess.Popen([sys.executable, __file__, str(rank), str(port)], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(3)]
    results = []
    try:
        for rank, child in enumerate(children):
            stdout, stderr = child.communicate(timeout=240)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            assert child.returncode == 0 and line is not None, f"rank {rank}: {(stdout + stderr)[-4000:]}"
            results.append(json.loads(line.removeprefix("RESULT ")))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(30)
    sender = results[0]["seconds"]
    medians = {mode: statistics.median(seconds) for mode, seconds in sender.items()}
    record("nccl_bucket_to_two_owners", bytes=BYTES, median_seconds=medians,
           per_owner_over_one_batch=medians["per_owner"] / medians["one_batch"], seconds=sender)
    assert all(r["bytes_ok"] for r in results[1:]) and all(r["closed"] for r in results)
