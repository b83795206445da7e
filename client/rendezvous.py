"""A trainer rank's side of a transfer group's rendezvous, in a thread of its own (rank 0's, or each part's).

torch builds a process group by blocking until every rank joined or the
timeout passed. Run inline, that would hold up a server's immediate refusal
(a bad group id, a name already taken) for the whole timeout, so it runs in a
thread (common/threads.py) while the CreateTransferGroup calls go out; at the
first refusal the rendezvous is abandoned: the thread fails at its own deadline
and closes what it built.

An NCCL group is built with weightsync's settings in the environment
(common/nccl_env.py), set here in the caller's thread before the rendezvous
thread exists. They stay until both the join has ended (it reads them until
then: NCCL_SOCKET_IFNAME at its first communicator, the TORCH_NCCL_* ones in
the group's constructor) and the caller let go (result() returned or raised, or
abandon()); whichever comes second lets go of them, so a join the caller gave up
on (abandoned, or past result()'s timeout) keeps them until it ends, and puts
them back from its own thread then. Overlapping rendezvous share them: the
environment as it was before the first is what comes back after the last
(nccl_env.hold_trainer_settings).
"""

from __future__ import annotations

import datetime
import threading

import torch

from weightsync.common.collective import CollectiveGroup, interface_of, open_group
from weightsync.common.nccl_env import TrainerSettings, hold_trainer_settings
from weightsync.common.threads import CallAbandoned, ThreadCall
from weightsync.v1 import weight_sync_service_pb2 as pb


class Rendezvous:
    """One trainer rank's join (rank 0, or a part's rank among trainer_ranks), started at construction."""

    def __init__(self, *, group_id: str, backend: int, store, world_size: int, timeout: datetime.timedelta,
                 device: torch.device, local_address: str, rank: int = 0, trainer_ranks: int = 1) -> None:
        self._group_id = group_id
        self._settings: TrainerSettings | None = None
        if backend == pb.BACKEND_NCCL:
            self._settings = hold_trainer_settings(interface_of(local_address),
                                                   group_timeout=timeout.total_seconds())
        self._lock = threading.Lock()
        self._joined = False  # the join no longer reads the environment
        self._let_go = False  # the caller no longer waits for the join

        def join() -> CollectiveGroup:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # per thread: NCCL binds the current device
                return open_group(group_id=group_id, backend=backend, store=store, rank=rank, world_size=world_size,
                                  timeout=timeout, device=device, local_address=local_address,
                                  trainer_ranks=trainer_ranks)
            finally:
                self._end(joined=True)

        try:
            self._call = ThreadCall(join, name=f"rendezvous-{group_id}", discard=CollectiveGroup.close)
        except BaseException:
            self._end(joined=True, let_go=True)  # no thread: nothing reads them
            raise

    def _end(self, *, joined: bool = False, let_go: bool = False) -> None:
        """Mark the join ended and/or the caller gone; the second of the two releases our settings."""
        with self._lock:
            before = self._joined and self._let_go
            self._joined |= joined
            self._let_go |= let_go
            release = not before and self._joined and self._let_go
        if release and self._settings is not None:
            self._settings.release()

    def result(self, timeout: float) -> CollectiveGroup:
        """The joined group; raises what the rendezvous raised, or TimeoutError past `timeout` seconds."""
        try:
            return self._call.result(timeout)
        except CallAbandoned:
            raise TimeoutError(f"the rendezvous of group {self._group_id} did not finish in {timeout:g} s") from None
        finally:
            self._end(let_go=True)

    def abandon(self) -> None:
        """Nobody will use the group: close it now or as soon as it is built."""
        self._call.abandon()
        self._end(let_go=True)
