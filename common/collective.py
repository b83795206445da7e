"""Collective groups built without the default process group.

Both sides use this module: the trainer (rank 0) and every worker. A group is
a ProcessGroupGloo (CPU tensors) or ProcessGroupNCCL (CUDA tensors) on a
PrefixStore(group_id, TCPStore). Every operation has the group's timeout.

Switching a deployment from CPU to GPU changes only `backend` (and the device
the buffers live on); the NCCL branch is kept next to the Gloo one so the two
stay one small switch apart.

A broadcast also carries its framing: the trainer announces the bucket's last
bytes (`bucket_tail`) so every receiver can tell a short broadcast from a full
one (see gpu_worker/bucket_checks.py).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from weightsync.v1 import weight_sync_service_pb2 as pb

BACKEND_NAMES = {pb.BACKEND_GLOO: "gloo", pb.BACKEND_NCCL: "nccl"}
RENDEZVOUS_PREFIX = "weightsync/"
"""Every rank's rendezvous keys live under PrefixStore(RENDEZVOUS_PREFIX + group_id, store)."""

BUCKET_TAIL_BYTES = 8
"""BucketStart.tail holds a bucket's last min(8, size) bytes."""


# -- framing of a bucket broadcast ---------------------------------------------------
def tail_length(size_bytes: int) -> int:
    """How many bytes BucketStart.tail holds for a bucket of this size."""
    return min(BUCKET_TAIL_BYTES, max(size_bytes, 0))


def bucket_tail(buffer: torch.Tensor) -> bytes:
    """BucketStart.tail of a packed bucket (a 1-D uint8 tensor): its last min(8, size) bytes.

    Call it after the copies that packed the buffer were enqueued: for a CUDA
    buffer, `.cpu()` is a blocking copy on the current stream, so it reads the
    bytes after every copy enqueued on that stream before it (the pack copies,
    which the SDK also synchronizes on)."""
    n = tail_length(buffer.numel())
    return bytes(buffer[buffer.numel() - n :].cpu().tolist()) if n else b""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the group is no longer usable."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class RendezvousTimeout(RuntimeError):
    """Not every rank joined before the deadline."""


def backend_for_device(device: torch.device) -> int:
    """NCCL for CUDA tensors, Gloo for everything else."""
    return pb.BACKEND_NCCL if device.type == "cuda" else pb.BACKEND_GLOO


def available_backends() -> list[int]:
    backends = [pb.BACKEND_GLOO] if dist.is_gloo_available() else []
    if dist.is_nccl_available() and torch.cuda.is_available():
        backends.append(pb.BACKEND_NCCL)
    return backends


def local_address_towards(host: str, port: int) -> str:
    """The local IP address that routes to host: the one peers can reach us at."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP connect sends nothing
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds an IPv4 address (None if none does)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _looks_like_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timeout" in text or "timed out" in text or isinstance(error, TimeoutError)


@dataclass(slots=True)
class CollectiveGroup:
    """A joined group: broadcast from rank 0 with the group's timeout."""

    group_id: str
    backend: int
    rank: int
    world_size: int
    timeout: datetime.timedelta
    device: torch.device
    _pg: object | None

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start a broadcast from rank 0; wait() on the result with wait()."""
        if self._pg is None:
            raise CollectiveError(f"group {self.group_id} is closed", timed_out=False)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = self.timeout
        try:
            return self._pg.broadcast([tensor], options)  # type: ignore[attr-defined]
        except RuntimeError as error:
            raise CollectiveError(str(error), timed_out=_looks_like_timeout(error)) from error

    def wait(self, work: dist.Work) -> None:
        """Complete a broadcast; raises CollectiveError on failure or timeout."""
        try:
            work.wait(self.timeout)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError as error:
            raise CollectiveError(str(error), timed_out=_looks_like_timeout(error)) from error

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.wait(self.broadcast_async(tensor))

    def close(self) -> None:
        """Release the communicator; safe to call twice."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        for method in ("abort", "shutdown"):
            fn = getattr(pg, method, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:  # noqa: BLE001 - best effort on teardown
                    continue


def open_group(
    *,
    group_id: str,
    backend: int,
    store: TCPStore,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    device: torch.device,
    local_address: str,
) -> CollectiveGroup:
    """Join the group on `store` (blocks until every rank joined or timeout)."""
    prefixed = PrefixStore(f"{RENDEZVOUS_PREFIX}{group_id}", store)
    try:
        if backend == pb.BACKEND_GLOO:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        elif backend == pb.BACKEND_NCCL:
            from torch._C._distributed_c10d import ProcessGroupNCCL  # only in CUDA builds

            # NCCL's bootstrap picks an interface by itself: pin the one that routes to the
            # trainer (what Gloo gets through local_address), unless the operator chose one.
            if "NCCL_SOCKET_IFNAME" not in os.environ and (name := interface_of(local_address)):
                os.environ["NCCL_SOCKET_IFNAME"] = name
            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = ProcessGroupNCCL(prefixed, rank, world_size, options)
            # NCCL creates its communicator lazily; connect now so the
            # rendezvous (and its timeout) happens here, on every rank.
            pg.eager_connect_single_device(device)
        else:
            raise ValueError(f"unsupported backend {backend}")
    except RuntimeError as error:
        if _looks_like_timeout(error):
            raise RendezvousTimeout(str(error)) from error
        raise
    return CollectiveGroup(group_id, backend, rank, world_size, timeout, device, pg)


def connect_store(host: str, port: int, timeout: datetime.timedelta) -> TCPStore:
    """Connect to the trainer's TCPStore as a client, within timeout.

    torch's TCPStore client retries a refused connection for its whole timeout,
    then backs off and tries again: an unreachable store took 2-3x the timeout.
    Waiting for the port with plain sockets first keeps the whole connect
    inside the deadline.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    last: OSError | None = None
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, remaining)):
                break
        except OSError as error:
            last = error
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    else:
        raise RendezvousTimeout(f"could not reach the TCPStore at {host}:{port}: {last}")
    remaining = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        return TCPStore(host, port, None, False, remaining, wait_for_workers=False)
    except (RuntimeError, ValueError) as error:  # DistNetworkError is a RuntimeError
        raise RendezvousTimeout(f"could not connect to the TCPStore at {host}:{port}: {error}") from error


def host_store(host: str, timeout: datetime.timedelta, port: int = 0) -> TCPStore:
    """Open a TCPStore server (the trainer's side) on `port`, or a free one."""
    return TCPStore(host, port, None, True, timeout, wait_for_workers=False)
