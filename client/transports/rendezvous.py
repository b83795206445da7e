"""A trainer rank's side of a transfer group's rendezvous, in a thread of its own (rank 0's, or each part's).

torch builds a process group by blocking until every rank joined or the
timeout passed. Run inline, that would hold up a server's immediate refusal
(a bad group id, a name already taken) for the whole timeout, so it runs in a
thread (common/threads.py) while the CreateTransferGroup calls go out; at the
first refusal the rendezvous is abandoned. The rank that hosts the store (rank 0,
part 0) then closes it (HostedStore): every join waiting on it, this rank's and
every other's, fails at once, and abandon() waits for this rank's join to end, so
nothing a refused create_group started outlives it (a process that exited while
a join was still waiting died with SIGABRT when the join's timeout came during the
interpreter's exit). A join that built its group anyway closes what it built.

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
from torch.distributed import TCPStore

from weightsync.common.collective import CollectiveGroup, interface_of, open_group
from weightsync.common.logging import get_logger
from weightsync.common.nccl_env import TrainerSettings, hold_trainer_settings
from weightsync.common.threads import CallAbandoned, ThreadCall
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")


class HostedStore:
    """The rendezvous TCPStore this rank hosts, referenced here alone: torch's store server stops with the last
    reference to it, which fails every wait on it at once (measured: ~0.1 s), so close() ends the joins of a group
    nobody will use, on every rank, instead of at the group's timeout. A join waits on a connection of its own
    (client()), so that the join's thread holds no reference to the server."""

    def __init__(self, store: TCPStore) -> None:
        self._store: TCPStore | None = store

    @property
    def store(self) -> TCPStore:
        if self._store is None:
            raise RuntimeError("the rendezvous store was closed")
        return self._store

    @property
    def port(self) -> int:
        return self.store.port

    def client(self) -> TCPStore:
        """A connection of its own to the store (a join's)."""
        return self.store.clone()

    def close(self) -> None:
        self._store = None


class Rendezvous:
    """One trainer rank's join (rank 0, or a part's rank among trainer_ranks), started at construction.
    hosted: the store this rank hosts (`store` is then a client() of it), closed when the join is abandoned."""

    def __init__(self, *, group_id: str, backend: int, store, world_size: int, timeout: datetime.timedelta,
                 device: torch.device, local_address: str, rank: int = 0, trainer_ranks: int = 1,
                 hosted: HostedStore | None = None) -> None:
        self._group_id = group_id
        self._hosted = hosted
        self._timeout = timeout
        self._finished = threading.Event()  # the join's thread is done with the store
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
                self._finished.set()

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
        """Nobody will use the group: close it now or as soon as it is built. A store this rank hosts is closed,
        which ends the join (every rank's) at once; the join is then waited for, at most the group's timeout,
        which bounds it anyway: no thread of this join outlives the call."""
        self._call.abandon()
        if self._hosted is not None:
            self._hosted.close()
            if not self._finished.wait(self._timeout.total_seconds()):
                log.warning("rendezvous_still_running", group_id=self._group_id)
        self._end(let_go=True)
