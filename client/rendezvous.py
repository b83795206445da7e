"""Rank 0's side of a transfer group's rendezvous, in a thread of its own.

torch builds a process group by blocking until every rank joined or the
timeout passed. Run inline, that would hold up a server's immediate refusal
(a bad group id, a name already taken) for the whole timeout, so it runs in a
thread while the CreateTransferGroup calls go out; at the first refusal the
rendezvous is abandoned: the thread fails at its own deadline and closes what
it built.
"""

from __future__ import annotations

import datetime
import threading

import torch

from weightsync.common.collective import CollectiveGroup, open_group, pin_nccl_interface
from weightsync.v1 import weight_sync_service_pb2 as pb


class Rendezvous:
    """One rank-0 join, started at construction."""

    def __init__(self, *, group_id: str, backend: int, store, world_size: int, timeout: datetime.timedelta,
                 device: torch.device, local_address: str) -> None:
        self._kwargs = dict(group_id=group_id, backend=backend, store=store, rank=0, world_size=world_size,
                            timeout=timeout, device=device, local_address=local_address)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._group: CollectiveGroup | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        if backend == pb.BACKEND_NCCL:  # from the caller's thread, before the join thread: NCCL reads it once
            pin_nccl_interface(local_address)
        threading.Thread(target=self._run, name=f"rendezvous-{group_id}", daemon=True).start()

    def _run(self) -> None:
        device = self._kwargs["device"]
        if device.type == "cuda":
            torch.cuda.set_device(device)  # per thread: NCCL binds the current device
        try:
            group: CollectiveGroup | None = open_group(**self._kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to result()
            group, self._error = None, error
        with self._lock:
            if self._abandoned and group is not None:
                group.close()
            else:
                self._group = group
            self._done.set()

    def result(self, timeout: float) -> CollectiveGroup:
        """The joined group; raises what the rendezvous raised."""
        if not self._done.wait(timeout):
            self.abandon()
            raise TimeoutError(f"the rendezvous of group {self._kwargs['group_id']} did not finish in {timeout:g} s")
        if self._error is not None:
            raise self._error
        assert self._group is not None
        return self._group

    def abandon(self) -> None:
        """Nobody will use the group: close it now or as soon as it is built."""
        with self._lock:
            self._abandoned = True
            group, self._group = self._group, None
        if group is not None:
            group.close()
