"""An NCCL group's connects, all inside open_group: its communicator, then every (trainer rank, worker) pair.

`connect`: a 1-byte broadcast from rank 0 that every rank makes, waited for against the group's timeout. The
unique id goes through the store and NCCL's init runs in the background; torch waits for that init inside the
broadcast call itself, for TORCH_NCCL_NONBLOCKING_TIMEOUT. torch reads that value once per process, so a trainer
whose own NCCL groups came first keeps its value (torch's default is 30 min), whatever nccl_env sets for ours:
seen on an H200 (torch 2.11, NCCL 2.28.9), a group whose second rank never came held open_group past 4x its
timeout. The call therefore runs in a thread of its own, waited for until the deadline; past it open_group closes
the group. That abort waits for the init too (torch holds the communicator's lock while it waits for the init):
the group is released only then, and counts meanwhile against MAX_UNRELEASED_NCCL_GROUPS.

`connect_pairs`, a group of several trainer ranks (parts, point-to-point): NCCL connects two ranks at their
first transfer (runtime connect: every p2p channel of the pair, its buffers on both GPUs), which needs both at
their matching operation and which torch waits for in the batch's end, bounded only by
TORCH_NCCL_NONBLOCKING_TIMEOUT. Left to an update, a pair's first bucket would meet that wait (a worker's
first receive from part p waits until p reaches that send, an owner for every earlier transfer in the global
order), a spin of one core per waiting rank, cut at whatever value torch read in each process (a worker: its
first group's timeout; a trainer: its own). So every trainer rank sends each worker one byte, and every worker
receives one from each trainer rank, in ONE batch per rank right after the communicator is built: within one
batch NCCL runs them all at once, so there is no order to get wrong and no cycle; every rank is already there
(the broadcast proved it). Each byte names its sender (pair_byte): a worker checks it got each from the right
rank. What the pairs cost on the device (NCCL's per-peer buffers, invisible to torch's allocator) is measured
here, where it is the only thing that moves, logged per peer, and already spent when a worker reports its free
memory after the join; every part does send to every owner of its servers over a model's buckets, so connecting
them up front costs what the first push would have.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from weightsync.common import nccl_env
from weightsync.common.collective import CollectiveGroup, RendezvousTimeout
from weightsync.common.logging import get_logger
from weightsync.common.nccl_p2p import PointToPoint, free_device_bytes
from weightsync.common.threads import CallAbandoned, ThreadCall
from weightsync.common.transfer_waits import CollectiveError

log = get_logger("weightsync.collective")

CONNECT_BYTES = 1
"""open_group's first broadcast, which builds an NCCL communicator and proves every rank connected."""


def connect(group: CollectiveGroup, deadline: float) -> None:
    """Build the group's NCCL communicator now and prove every rank joined it: a 1-byte broadcast from rank 0,
    waited for against the deadline (see the module docstring). Every rank runs it in open_group."""
    device = group.device
    before = free_device_bytes(device)
    # torch reads it at this process's first NCCL collective: this one, unless the process ran its own before.
    nccl_env.note_nonblocking_read(os.environ.get(nccl_env.NONBLOCKING_TIMEOUT))

    def start() -> dist.Work:
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device:  # this thread's current device and stream: the probe's
            probe = torch.zeros(CONNECT_BYTES, dtype=torch.uint8, device=device)
            return group.broadcast_async(probe)

    try:
        work = ThreadCall(start, name=f"connect-{group.group_id}").result(max(0.0, deadline - time.monotonic()))
        group.wait(work, deadline)
        group.nccl_device_bytes = max(0, before - free_device_bytes(device))  # the communicator NCCL built
        log.info("nccl_communicator_built", group_id=group.group_id, device_bytes=group.nccl_device_bytes)
    except CallAbandoned as error:
        raise RendezvousTimeout(f"group {group.group_id}: the communicator was not built within "
                                f"{group.timeout.total_seconds():g} s (not every rank connected)") from error
    except CollectiveError as error:
        raise _connect_failure(group, "not every rank connected", error) from error


def pair_peers(rank: int, world_size: int, trainer_ranks: int) -> tuple[bool, list[int]]:
    """(whether `rank` sends, the ranks it connects to) in connect_pairs: a trainer rank sends to every worker, a
    worker receives from every trainer rank; nothing with one trainer rank (it broadcasts) or no worker."""
    trainers = range(trainer_ranks) if trainer_ranks > 1 and world_size > trainer_ranks else range(0)
    if not trainers:
        return False, []
    if rank in trainers:
        return True, list(range(trainer_ranks, world_size))
    return False, list(trainers)


def pair_byte(sender: int) -> int:
    """The byte trainer rank `sender` sends each worker in connect_pairs (never 0, the receive buffer's fill)."""
    return sender % 255 + 1


def connect_pairs(group: CollectiveGroup, deadline: float) -> None:
    """Connect every (trainer rank, worker) pair of an NCCL group of several trainer ranks, in one batch per rank,
    by `deadline` (see the module docstring); a worker checks each byte came from its trainer rank."""
    sends, peers = pair_peers(group.rank, group.world_size, group.trainer_ranks)
    if not peers:
        return
    device = group.device
    if sends:
        probe = torch.full((1,), pair_byte(group.rank), dtype=torch.uint8, device=device)
        operations = [PointToPoint(True, probe, peer) for peer in peers]
    else:
        probe = torch.zeros(len(peers), dtype=torch.uint8, device=device)
        operations = [PointToPoint(False, probe[i : i + 1], peer) for i, peer in enumerate(peers)]
    before = free_device_bytes(device)
    try:
        group.wait(group.start_batch(operations, deadline), deadline)
    except CollectiveError as error:
        raise _connect_failure(group, "not every pair connected", error) from error
    grown = max(0, before - free_device_bytes(device))
    group.peers.update(peers)
    group.nccl_device_bytes += grown
    log.info("nccl_pairs_connected", group_id=group.group_id, peers=len(peers), device_bytes=grown,
             device_bytes_per_peer=grown // len(peers), group_device_bytes=group.nccl_device_bytes)
    if not sends:
        got = probe.cpu().tolist()  # group.wait ordered this thread's stream after the batch
        wanted = [pair_byte(peer) for peer in peers]
        if got != wanted:
            raise RuntimeError(f"group {group.group_id}: the pairs' first bytes came from other ranks than their "
                               f"own (got {got}, wanted {wanted}): the ranks disagree on the group's layout")


def _connect_failure(group: CollectiveGroup, what: str, error: CollectiveError) -> RuntimeError:
    if error.timed_out:
        return RendezvousTimeout(f"group {group.group_id}: {what} within {group.timeout.total_seconds():g} s: {error}")
    return RuntimeError(f"group {group.group_id}: connecting failed: {error}")
