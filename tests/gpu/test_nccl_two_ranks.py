"""Point-to-point over NCCL between two GPUs (issue 44; docs/gpus.md, "Two GPUs"): what one GPU cannot hold.

Rank 0 on cuda:0 and rank 1 on cuda:1, each a process of its own (this file run as a script) whose first NCCL call
is a one-rank all_reduce of its own, as a trainer's; one weightsync group of the two, connected by open_group.
  - pair: the first send returns only once rank 1 reached its receive (their first transfer connects them on the
    group's communicator), a later one at once; a 1 MiB send completes before its receive is posted (NCCL's p2p
    buffer: why an aborted update of parts breaks its group, P1); NCCL matches by order, not by tag (F9); what the
    connect and the pair's first transfer cost in device memory (C2).
  - absent: rank 1 in the group but never receiving: a first send's start ends at its deadline, and close() from
    another thread ends it for its caller and returns within its bound (the abort takes the lock between polls:
    C1, torch with pytorch#170424; the run records torch's git version); then a connected send nobody receives
    ends at its deadline and the abort ends its kernel.
  - killed: over the socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), rank 1 SIGKILLed mid-transfer: rank
    0's wait fails within the group timeout + 1 s, its outcome read within the bound (C3, torch 2.11's fallback).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GROUP_TIMEOUT = 10.0
MIB = 1 << 20


def rank_main() -> None:
    """python test_nccl_two_ranks.py RANK PORT SCENARIO"""
    import torch
    from torch._C._distributed_c10d import ProcessGroupNCCL
    from torch.distributed import PrefixStore, TCPStore

    from weightsync.common import transfer_waits
    from weightsync.common.collective import CollectiveError, open_group
    from weightsync.common.nccl_env import trainer_group_environment
    from weightsync.v1 import weight_sync_service_pb2 as pb

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpukit import close_while_sending, send_with_deadline

    rank, port, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    own = ProcessGroupNCCL(PrefixStore(f"own{rank}", store), 0, 1, ProcessGroupNCCL.Options())
    own.allreduce([torch.ones(1, device=device)]).wait()
    torch.cuda.synchronize()
    out: dict = {"rank": rank, "torch": torch.__version__, "torch_git_version": torch.version.git_version}
    free_before = torch.cuda.mem_get_info(device)[0]
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    with trainer_group_environment(None, group_timeout=GROUP_TIMEOUT):
        group = open_group(group_id=scenario, backend=pb.BACKEND_NCCL, store=store, rank=rank, world_size=2,
                           timeout=timeout, device=device, local_address="127.0.0.1", trainer_ranks=1)
    out["connect_device_bytes"] = free_before - torch.cuda.mem_get_info(device)[0]
    pattern = torch.arange(MIB, dtype=torch.int64, device=device).to(torch.uint8)
    later = datetime.timedelta(seconds=60)  # a second group, joined while rank 0 is still busy with the first

    def timed(fn):
        started = time.monotonic()
        value = fn()
        return value, time.monotonic() - started

    if scenario == "pair" and rank == 0:
        free = torch.cuda.mem_get_info(device)[0]
        work, out["first_start_seconds"] = timed(lambda: group.send_async(pattern, 1, 0))
        group.wait(work)
        out["first_transfer_device_bytes"] = free - torch.cuda.mem_get_info(device)[0]
        out["group_device_bytes"] = group.nccl_device_bytes
        work, out["second_start_seconds"] = timed(lambda: group.send_async(pattern, 1, 1))
        deadline = time.monotonic() + 2.0  # rank 1 posts this receive 3 s after the first
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        out["completed_before_its_receive"] = work.is_completed()
        group.wait(work)
        group.wait(group.send_async(torch.full((MIB,), 1, dtype=torch.uint8, device=device), 1, 1))
        group.wait(group.send_async(torch.full((MIB,), 2, dtype=torch.uint8, device=device), 1, 2))
    elif scenario == "pair":
        time.sleep(3.0)
        received = torch.zeros(MIB, dtype=torch.uint8, device=device)
        group.receive(received, 0, 0)
        out["first_bytes_ok"] = bool(torch.equal(received, pattern))
        time.sleep(3.0)
        group.receive(received, 0, 1)
        tagged_two, tagged_one = (torch.zeros(MIB, dtype=torch.uint8, device=device) for _ in range(2))
        group.receive(tagged_two, 0, 2)  # NCCL ignores tags: this takes the first send (tag 1's bytes)
        group.receive(tagged_one, 0, 1)
        out["tag_two_got"] = int(tagged_two[0])
        out["tag_one_got"] = int(tagged_one[0])
    elif scenario == "absent" and rank == 0:
        out["deadline"] = send_with_deadline(group, pattern, 3.0)
        out["close_after_deadline"] = group.close(10.0)
        with trainer_group_environment(None, group_timeout=GROUP_TIMEOUT):
            second = open_group(group_id="absent-2", backend=pb.BACKEND_NCCL, store=store, rank=0, world_size=2,
                                timeout=later, device=device, local_address="127.0.0.1", trainer_ranks=1)
        out["blocked"] = close_while_sending(second, pattern, close_join=10.0)
        store.set("absent-done", "1")
    elif scenario == "absent":
        with trainer_group_environment(None, group_timeout=GROUP_TIMEOUT):
            second = open_group(group_id="absent-2", backend=pb.BACKEND_NCCL, store=store, rank=1, world_size=2,
                                timeout=later, device=device, local_address="127.0.0.1", trainer_ranks=1)
        store.wait(["absent-done"], datetime.timedelta(seconds=90))
        out["closed"] = group.close(10.0) and second.close(10.0)
    elif scenario == "killed" and rank == 0:
        reads: list[float] = []
        original = transfer_waits.completed_failure

        def spy(work, bound=transfer_waits.FAILED_CLOSE_JOIN_SECONDS):
            started = time.monotonic()
            try:
                return original(work, bound)
            finally:
                reads.append(time.monotonic() - started)

        transfer_waits.completed_failure = spy
        big = torch.ones(256 * MIB, dtype=torch.uint8, device=device)
        started = time.monotonic()
        try:
            for tag in range(10_000):
                started = time.monotonic()
                group.wait(group.send_async(big, 1, tag))
            out["outcome"] = "every send completed"
        except CollectiveError as error:
            out["outcome"] = {"seconds": time.monotonic() - started, "timed_out": error.timed_out,
                              "error": str(error)[:300]}
        out["outcome_reads_seconds"] = max(reads) if reads else 0.0
        out["closed"] = group.close(10.0)
    else:  # killed, rank 1: receives until the test kills it
        into = torch.empty(256 * MIB, dtype=torch.uint8, device=device)
        group.receive(into, 0, 0)
        print("receiving", flush=True)
        for tag in range(1, 10_000):
            group.receive(into, 0, tag)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    rank_main()


# -- the tests --------------------------------------------------------------------------------------------
import pytest  # noqa: E402

from gpukit import record  # noqa: E402
from helpers import free_port  # noqa: E402

pytestmark = [pytest.mark.two_gpus, pytest.mark.timeout(300)]


def run_pair(scenario: str, env: dict[str, str] | None = None, kill_after: str | None = None) -> list[dict]:
    port = free_port()
    children = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), scenario], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
                for rank in (0, 1)]
    results: list[dict] = [{}, {}]
    try:
        if kill_after is not None:
            for line in children[1].stdout:
                if line.strip() == kill_after:
                    time.sleep(0.5)  # mid-transfer
                    children[1].send_signal(signal.SIGKILL)
                    break
        for rank, child in enumerate(children):
            stdout, stderr = child.communicate(timeout=180)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            if kill_after is not None and rank == 1:
                continue
            assert child.returncode == 0 and line is not None, f"rank {rank}: {(stdout + stderr)[-4000:]}"
            results[rank] = json.loads(line.removeprefix("RESULT "))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(30)
    return results


def test_the_first_transfer_of_a_pair_connects_it_small_sends_run_ahead_and_tags_are_not_matched():
    zero, one = run_pair("pair")
    record("nccl_pair", zero=zero, one=one)
    assert zero["first_start_seconds"] >= 2.0  # its start waited for rank 1's receive (posted after 3 s)
    assert zero["second_start_seconds"] < 1.0 and one["first_bytes_ok"]
    assert zero["completed_before_its_receive"]  # 1 MiB fits the pair's buffer (F9): P1's cause
    assert (one["tag_two_got"], one["tag_one_got"]) == (1, 2)  # matched by order (F9): the global order matters
    assert zero["group_device_bytes"] >= 0


def test_a_first_send_to_a_rank_that_never_receives_is_bounded_and_close_ends_it():
    zero, one = run_pair("absent")
    record("nccl_absent_receiver", zero=zero, one=one)
    assert zero["deadline"]["timed_out"] and 3.0 <= zero["deadline"]["seconds"] < 5.0
    assert zero["close_after_deadline"]  # the abort ended the connecting batch within CLOSE_JOIN_SECONDS
    blocked = zero["blocked"]  # its start waited for rank 1 to connect; close() ends it, the abort goes through
    assert blocked["send"] == {"closed": True, "timed_out": False} and blocked["send_ended_after_close"] < 1.0
    # The only run that shows close() releasing a pair's connect (one GPU shows the init's wait instead). A close
    # that does not finish is the sign of a torch without pytorch#170424 (its poll of the connect holds the
    # communicator's lock, so the abort waits for TORCH_NCCL_NONBLOCKING_TIMEOUT): torch_git_version is recorded.
    assert blocked["close_finished"] and blocked["close_seconds"] < 10.0, (zero["torch"], zero["torch_git_version"])
    assert one["closed"]


def test_a_receiver_killed_mid_transfer_over_sockets_fails_the_sender_in_bound():
    zero, _ = run_pair("killed", env={"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, kill_after="receiving")
    record("nccl_receiver_killed", zero=zero)
    assert isinstance(zero["outcome"], dict), zero
    assert zero["outcome"]["seconds"] < GROUP_TIMEOUT + 1.0
    assert zero["outcome_reads_seconds"] < 2.0  # never torch's wait() aborting in the caller's thread, unbounded
    assert zero["closed"]
