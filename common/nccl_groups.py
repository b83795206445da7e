"""What a process knows of its NCCL groups beyond any one of them: those closed but not yet released, and the
device a torch process group's collectives take their tensors on.

A group whose communicator never finished its init cannot be released before TORCH_NCCL_NONBLOCKING_TIMEOUT:
torch waits for that init holding the communicator's lock (NCCLComm::getNcclComm -> waitReady), and the abort
takes the same lock (common/nccl_connect.py's connect). Each such group holds a thread, NCCL's own threads and
sockets and the device memory its init took meanwhile; a trainer whose first NCCL use was its own keeps torch's
30 min. A process therefore refuses a new NCCL group while MAX_UNRELEASED_NCCL_GROUPS are still unreleased
(verl makes a new group after every failed sync: without a bound each failure would add one).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

MAX_UNRELEASED_NCCL_GROUPS = 2
"""Closed NCCL groups of this process not yet released beyond which open_group refuses a new one."""


class GroupsStillClosing(RuntimeError):
    """A new NCCL group was refused: MAX_UNRELEASED_NCCL_GROUPS earlier ones are still being released."""


class Unreleased:
    """Closed NCCL groups whose release has not finished: (group id, its `released` event)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list[tuple[str, threading.Event]] = []

    def add(self, group_id: str, released: threading.Event) -> None:
        with self._lock:
            self._groups.append((group_id, released))

    def ids(self) -> list[str]:
        """The groups still unreleased (those released since are forgotten)."""
        with self._lock:
            self._groups = [(g, released) for g, released in self._groups if not released.is_set()]
            return [g for g, _ in self._groups]


UNRELEASED = Unreleased()
"""This process's (CollectiveGroup.close adds a group whose release outlived its bound)."""


def refuse_while_closing(still: list[str], limit: int = MAX_UNRELEASED_NCCL_GROUPS) -> None:
    """Raise GroupsStillClosing when `still` (Unreleased.ids) holds `limit` groups or more."""
    if len(still) >= limit:
        raise GroupsStillClosing(
            f"{len(still)} earlier NCCL groups of this process are still being released ({', '.join(still)}): torch "
            "holds a communicator whose init never completed until TORCH_NCCL_NONBLOCKING_TIMEOUT (30 min unless "
            "exported lower before the process's first NCCL call); try again once they are released")


def process_group_device(group: Any) -> torch.device:
    """Where a torch.distributed group's collectives take their tensors: for NCCL the device the group was
    bound to (init_process_group(device_id=...)), else this thread's current CUDA device (a thread other
    than the one that set it is on device 0: bind the group, or set the device in that thread); host
    memory for any other backend."""
    import torch.distributed as dist

    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    return torch.device("cuda", torch.cuda.current_device())
