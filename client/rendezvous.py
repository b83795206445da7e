"""Rank 0's side of a transfer group's rendezvous, in a thread of its own.

torch builds a process group by blocking until every rank joined or the
timeout passed. Run inline, that would hold up a server's immediate refusal
(a bad group id, a name already taken) for the whole timeout, so it runs in a
thread (common/threads.py) while the CreateTransferGroup calls go out; at the
first refusal the rendezvous is abandoned: the thread fails at its own deadline
and closes what it built.

An NCCL group is built with weightsync's settings in the environment
(common/nccl_env.py), set here in the caller's thread before the rendezvous
thread exists, and put back here once the rendezvous ended (or was abandoned).
"""

from __future__ import annotations

import contextlib
import datetime

import torch

from weightsync.common.collective import CollectiveGroup, interface_of, open_group
from weightsync.common.nccl_env import trainer_group_environment
from weightsync.common.threads import CallAbandoned, ThreadCall
from weightsync.v1 import weight_sync_service_pb2 as pb


class Rendezvous:
    """One rank-0 join, started at construction."""

    def __init__(self, *, group_id: str, backend: int, store, world_size: int, timeout: datetime.timedelta,
                 device: torch.device, local_address: str) -> None:
        self._group_id = group_id
        self._environment = contextlib.ExitStack()
        if backend == pb.BACKEND_NCCL:
            self._environment.enter_context(trainer_group_environment(interface_of(local_address),
                                                                      group_timeout=timeout.total_seconds()))

        def join() -> CollectiveGroup:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # per thread: NCCL binds the current device
            return open_group(group_id=group_id, backend=backend, store=store, rank=0, world_size=world_size,
                              timeout=timeout, device=device, local_address=local_address)

        try:
            self._call = ThreadCall(join, name=f"rendezvous-{group_id}", discard=CollectiveGroup.close)
        except BaseException:
            self._environment.close()
            raise

    def result(self, timeout: float) -> CollectiveGroup:
        """The joined group; raises what the rendezvous raised, or TimeoutError past `timeout` seconds."""
        try:
            return self._call.result(timeout)
        except CallAbandoned:
            raise TimeoutError(f"the rendezvous of group {self._group_id} did not finish in {timeout:g} s") from None
        finally:
            self._environment.close()

    def abandon(self) -> None:
        """Nobody will use the group: close it now or as soon as it is built."""
        self._call.abandon()
        self._environment.close()
