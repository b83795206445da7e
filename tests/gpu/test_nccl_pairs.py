"""Point-to-point over NCCL on one GPU (issue 44: C1, C4, P2, L5), what a CPU cannot show.

One GPU cannot hold two ranks of one communicator, so what runs here is a group whose other rank never comes: the
trainer's first send on it (torch builds the group's communicator inside that call and waits for its init, holding
its lock, until TORCH_NCCL_NONBLOCKING_TIMEOUT) is bounded by the transfer's deadline and ended for its caller by
close() from another thread; it runs batched on the group's one communicator (torch's lazy-mode warning about a
two-rank communicator per pair never appears); the abort is released only when torch lets go of the init
(measured); failed connects are reported at once, and a third NCCL group is refused while two are unreleased.
What the absent-rank cases measure is torch's wait for the communicator's INIT (the group is built bare, without
open_group's connect), not a pair's connect on a communicator that exists, which is what a real group meets:
close() ending that one is shown only by test_nccl_two_ranks.py (a first send to a rank that never receives).
These run in a subprocess whose first NCCL call is a one-rank all_reduce of its own (as a trainer's FSDP would),
with TORCH_NCCL_NONBLOCKING_TIMEOUT from the environment (the kit exports 20; 30 when unset), so that torch's
value is the one read then. The two-GPU tests (test_nccl_two_ranks.py) show the same with a peer that exists.

In process: a receive whose transfer failed leaves its staging's cached blocks held, so the abort is answered at
once rather than after the kernel (P2); torch's pool hands out 32 streams per priority (L5).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from weightsync.common.collective import host_store, open_group
from weightsync.gpu_worker.device_lane import DeviceLane
from weightsync.gpu_worker.group_table import GroupTable
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

from gpukit import SLEEP_CYCLES, context_after_abort, context_sound, record

pytestmark = pytest.mark.timeout(180)

DEVICE = torch.device("cuda", 0)
LAZY_PAIR_WARNING = "In lazy initialization mode, this will result in a new 2-rank"
"""torch's warning when a send or recv builds a two-rank communicator of its own (ProcessGroupNCCL::pointToPoint)."""

SCRIPT = textwrap.dedent('''
    import datetime, json, os, sys, threading, time
    import torch
    from torch.distributed import PrefixStore, TCPStore
    from torch._C._distributed_c10d import ProcessGroupNCCL
    from weightsync.common import nccl_groups
    from weightsync.common.collective import (CollectiveGroup, RendezvousTimeout, nccl_options,
                                              open_group)
    from weightsync.common.nccl_env import trainer_group_environment
    from weightsync.v1 import weight_sync_service_pb2 as pb
    sys.path.insert(0, sys.argv[1])
    from gpukit import close_while_sending, send_with_deadline

    NCCL, device, out = pb.BACKEND_NCCL, torch.device("cuda", 0), {}
    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    # The process's first NCCL call is its own, as a trainer's: torch reads TORCH_NCCL_NONBLOCKING_TIMEOUT now.
    own = ProcessGroupNCCL(PrefixStore("own", store), 0, 1, ProcessGroupNCCL.Options())
    own.allreduce([torch.ones(1, device=device)]).wait()
    torch.cuda.synchronize()
    began = time.monotonic()

    def open_absent(name, seconds):
        # world 2, rank 1 never comes; open_group would connect (and fail): built bare, as a group before its
        # first transfer
        timeout = datetime.timedelta(seconds=seconds)
        with trainer_group_environment(None, group_timeout=seconds):
            pg = ProcessGroupNCCL(PrefixStore("weightsync/" + name, store), 0, 2,
                                  nccl_options(ProcessGroupNCCL.Options(), timeout))
        return CollectiveGroup(name, NCCL, 0, 2, timeout, device, pg, trainer_ranks=2)

    def try_open(name):
        begun = time.monotonic()
        try:
            with trainer_group_environment(None, group_timeout=3.0):
                open_group(group_id=name, backend=NCCL, store=store, rank=0, world_size=2,
                           timeout=datetime.timedelta(seconds=3), device=device, local_address="127.0.0.1")
            return {"outcome": "opened"}
        except (RendezvousTimeout, nccl_groups.GroupsStillClosing) as error:
            return {"outcome": type(error).__name__, "seconds": time.monotonic() - begun}

    buffer = torch.ones(1 << 20, dtype=torch.uint8, device=device)
    # C4: a connect that fails (the other rank never comes), reported at its timeout + the short join.
    out["failed_connect"] = try_open("lonely")
    # C1: a first send blocked in torch, ended for its caller by close() from another thread.
    out["blocked"] = close_while_sending(open_absent("absent", 30.0), buffer, close_join=2.0)
    # C4: a third NCCL group refused while two are still being released.
    out["refused_connect"] = try_open("refused")
    # C1: a first send bounded by its deadline.
    bounded = open_absent("absent-2", 30.0)
    out["deadline"] = send_with_deadline(bounded, buffer, 3.0)
    bounded.close(0.5)
    out["unreleased"] = nccl_groups.UNRELEASED.ids()
    # Released once torch lets go of each init (TORCH_NCCL_NONBLOCKING_TIMEOUT after it began).
    def ours_left():
        return [t.name for t in threading.enumerate() if t.name.startswith(("connect-", "p2p-", "close-"))]
    limit = time.monotonic() + float(os.environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "30")) + 30
    while (nccl_groups.UNRELEASED.ids() or ours_left()) and time.monotonic() < limit:
        time.sleep(0.1)
    out["all_released_after_seconds"] = time.monotonic() - began
    out["unreleased_at_end"] = nccl_groups.UNRELEASED.ids()
    out["threads_left"] = ours_left()
    # The next group works: a one-rank group, connected, a broadcast waited for.
    with trainer_group_environment(None, group_timeout=30.0):
        alone = open_group(group_id="alone", backend=NCCL, store=store, rank=0, world_size=1,
                           timeout=datetime.timedelta(seconds=30), device=device, local_address="127.0.0.1")
    probe = torch.arange(64, dtype=torch.uint8, device=device)
    alone.broadcast(probe)
    out["next_group_ok"] = bool(torch.equal(probe.cpu(), torch.arange(64, dtype=torch.uint8)))
    out["next_group_closed"] = alone.close(10.0)
    out["nccl_device_bytes_one_rank"] = alone.nccl_device_bytes
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # nothing of ours is left running, but do not let an exit hook wait on torch
''')


def test_a_first_send_to_an_absent_rank_and_a_failed_connect_are_bounded_and_released(tmp_path: Path):
    """C1 and C4 on one GPU, in a subprocess whose first NCCL call is its own."""
    nonblocking = float(os.environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "30"))
    env = dict(os.environ, TORCH_NCCL_NONBLOCKING_TIMEOUT=str(int(nonblocking)), PYTHONUNBUFFERED="1")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).resolve().parent)], env=env, capture_output=True, text=True,
                          timeout=nonblocking + 120)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert done.returncode == 0 and line is not None, (done.stdout + done.stderr)[-4000:]
    out = json.loads(line.removeprefix("RESULT "))
    record("nccl_absent_peer", nonblocking_timeout=nonblocking, seconds=time.monotonic() - started, **out)
    # Batched on the group's own communicator: torch never made a two-rank communicator for the pair.
    assert LAZY_PAIR_WARNING not in done.stderr
    # The start is bounded by the transfer's deadline (3 s), not torch's spin.
    assert out["deadline"]["timed_out"] and 3.0 <= out["deadline"]["seconds"] < 5.0, out["deadline"]
    # close() from another thread ends a blocked first send for its caller at once, and returns within its bound
    # (its abort waits for torch: False, and the group counts as unreleased).
    blocked = out["blocked"]
    assert blocked["send"] == {"closed": True, "timed_out": False}, out
    assert blocked["send_ended_after_close"] < 1.0 and blocked["close_seconds"] < 3.0, out
    # A failed connect is reported at its 3 s (+ the short join, not the 10 s close); a third group is refused.
    assert out["failed_connect"]["outcome"] == "RendezvousTimeout", out
    assert out["failed_connect"]["seconds"] < 3.0 + 0.5 + 2.0, out
    assert out["refused_connect"]["outcome"] == "GroupsStillClosing" and out["refused_connect"]["seconds"] < 1.0, out
    # Released once torch lets go (its non-blocking timeout), nothing of ours left; the next group works.
    assert out["unreleased_at_end"] == [] and out["threads_left"] == [], out
    assert out["all_released_after_seconds"] < nonblocking + 30, out
    assert out["next_group_ok"] and out["next_group_closed"]


@pytest.mark.aborts_queued_kernel
def test_a_failed_receives_cached_blocks_wait_for_its_kernel_and_the_abort_is_answered_at_once():
    """P2: the staging slot was recorded on NCCL's stream behind the receive; torch's empty_cache waits for that
    stream's events, so releasing the staging at the abort would wait for the kernel (here: behind ~3 s of
    sleep). The lane holds its cached blocks while the group's work may be queued, and gives them back after.
    The abort lands with the broadcast still queued: whether the context survived it is recorded."""
    context_sound()
    timeout = datetime.timedelta(seconds=30)
    store = host_store("127.0.0.1", timeout)
    torch.cuda.set_device(DEVICE)
    group = open_group(group_id="p2", backend=pb.BACKEND_NCCL, store=store, rank=0, world_size=1, timeout=timeout,
                       device=DEVICE, local_address="127.0.0.1")
    table = GroupTable(DEVICE)
    table.groups["p2"] = group
    lane = DeviceLane(DEVICE)
    lane.hold_cache = table.device_busy
    lane.ensure(8 << 20)
    torch.cuda.synchronize()
    torch.cuda._sleep(3 * SLEEP_CYCLES)  # ~3 s queued before the broadcast into the slot
    _, slot = lane.take(8 << 20)
    with pytest.raises(Exception) as failed:
        table.transfer(group, slot, wpb.ReceiveBucketCommand(sequence=0), point_to_point=False,
                       deadline=time.monotonic() + 1.0)
    assert getattr(failed.value, "reason", "") == "COLLECTIVE_TIMEOUT"
    del slot
    started = time.monotonic()
    lane.release()
    released_in = time.monotonic() - started
    busy = table.device_busy()
    context_after_abort("p2_failed_receive")  # the sleep, then the aborted broadcast, end
    deadline = time.monotonic() + 30
    while table.device_busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    lane.release_cache()
    record("p2_abort_release", release_seconds=released_in, busy_at_release=busy,
           pending_after=lane.cache_release_pending)
    assert released_in < 1.0 and busy  # answered at once: the kernel was still queued
    assert not table.device_busy() and not lane.cache_release_pending  # given back once it ended


def test_torchs_stream_pool_hands_out_32_streams_per_priority_round_robin():
    """L5: a pool stream is shared once 32 were handed out (a group's communicator takes one: since issue 44 one
    per group, never one per pair of ranks)."""
    streams = [torch.cuda.Stream(DEVICE) for _ in range(33)]
    ids = [s.stream_id for s in streams]
    record("stream_pool", distinct=len(set(ids)), handed_out=len(ids))
    assert len(set(ids)) == 32 and ids[32] == ids[0]
