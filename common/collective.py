"""Collective groups built without the default process group.

Both sides use this module: the trainer (rank 0) and every worker. A group is
a ProcessGroupGloo (CPU tensors) or ProcessGroupNCCL (CUDA tensors) on a
PrefixStore(group_id, TCPStore). Every operation has the group's timeout.

Switching a deployment from CPU to GPU changes only `backend` (and the device
the buffers live on); the NCCL branch is kept next to the Gloo one so the two
stay one small switch apart.

NCCL groups are built so that weightsync's own timeouts decide what a failure
costs (nccl_env.py: no torch watchdog or heartbeat monitor for our groups; the
waits themselves are in transfer_waits.py):
  - every transfer is waited for by polling its completion against its deadline
    (started + the group's timeout), and against close() from another thread; its
    result is read with work.exception(), never with torch's work.wait(), which
    aborts the communicator in the waiting thread when the work failed
    (TORCH_NCCL_BLOCKING_WAIT=1) or timed out: on a failure the caller closes the
    group (abort, bounded);
  - point-to-point transfers (a part's sends, its owners' receives) run as batches
    of one on the group's own communicator (nccl_p2p.py), never on torch's
    per-pair communicators; their start, which connects a pair at its first
    transfer, runs in a thread of its own waited for against the same deadline;
  - the communicator is non-blocking (an abandoned group is aborted, half-built or
    not) and is built inside open_group, by a first 1-byte broadcast waited for
    against the group's timeout: open_group returns a group whose ranks all
    connected, or fails within the timeout. Not eager_connect_single_device: with a
    non-blocking communicator its init cannot be waited for from Python, and the
    first collective then races it (NCCL error 7, "operation in progress");
  - a group is closed (aborted and released) in a thread of its own with a
    bounded join: ncclCommAbort can hang, and nothing in torch can abort a
    communicator whose init is still being waited for (the connect's broadcast
    holds its lock, up to TORCH_NCCL_NONBLOCKING_TIMEOUT). A process refuses a new
    NCCL group while too many earlier ones are still being released (nccl_groups.py).

A broadcast also carries its framing: the trainer announces the bucket's last
bytes (`bucket_tail`) so every receiver can tell a short broadcast from a full
one (see gpu_worker/bucket_checks.py).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from weightsync.common.logging import get_logger
from weightsync.common.nccl_groups import UNRELEASED, GroupsStillClosing, refuse_while_closing
from weightsync.common.nccl_p2p import batched, free_device_bytes, on_stream
from weightsync.common.threads import CallAbandoned, ThreadCall
from weightsync.common.transfer_waits import (
    FAILED_CLOSE_JOIN_SECONDS,
    NCCL_POLL_SECONDS,
    CollectiveError,
    Stopped,
    looks_like_timeout,
    run_bounded,
    wait_call,
    wait_gloo,
    wait_polled,
)
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.collective")

BACKEND_NAMES = {pb.BACKEND_GLOO: "gloo", pb.BACKEND_NCCL: "nccl"}
RENDEZVOUS_PREFIX = "weightsync/"
"""Every rank's rendezvous keys live under PrefixStore(RENDEZVOUS_PREFIX + group_id, store)."""

BUCKET_TAIL_BYTES = 8
"""BucketStart.tail holds a bucket's last min(8, size) bytes."""

CLOSE_JOIN_SECONDS = 10.0
"""How long closing a group may hold its caller; the abort goes on in its thread after that."""
CONNECT_BYTES = 1
"""open_group's first broadcast, which builds an NCCL communicator and proves every rank connected."""


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


def bucket_tag(sequence: int) -> int:
    """The Gloo tag of bucket `sequence`'s send to its owner (tags are 32-bit: they wrap)."""
    return sequence % (1 << 31)


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
    released: threading.Event = field(default_factory=threading.Event)
    """Set once close() finished releasing the communicator (its abort may outlive close()'s bound)."""
    trainer_ranks: int = 1
    """The trainer's ranks, 0..trainer_ranks-1 (CreateTransferGroupRequest.trainer_ranks): one per part."""
    peers: set[int] = field(default_factory=set)
    """NCCL: the ranks a point-to-point transfer of ours connected to (on the group's own communicator)."""
    nccl_device_bytes: int = 0
    """NCCL: device memory this process's driver had less of after the connect and after each peer's first
    transfer (NCCL's buffers, invisible to torch's allocator; measured, so other allocations at the same
    moment count too)."""
    unfinished_work: object | None = None
    """NCCL: the last transfer whose wait failed or timed out; its kernel may still be queued (settled())."""

    def __post_init__(self) -> None:
        if self._pg is None:
            self.released.set()

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
            raise CollectiveError(str(error), timed_out=looks_like_timeout(error)) from error

    def deadline(self) -> float:
        """When a transfer started now must have completed (time.monotonic())."""
        return time.monotonic() + self.timeout.total_seconds()

    @property
    def closed(self) -> bool:
        """close() was called (from any thread): nothing of the group is worth waiting for."""
        return self._pg is None

    def wait(self, work: dist.Work, deadline: float | None = None, *, stopped: Stopped | None = None) -> None:
        """Complete a transfer by `deadline` (time.monotonic(); default: the group's timeout from now,
        pass the transfer's own when it started earlier); raises CollectiveError on failure, timeout, or
        close() from another thread (the group is then unusable: the caller closes it), TransferStopped once
        `stopped` gives a reason (asked every transfer_waits.STOP_CHECK_SECONDS)."""
        deadline = self.deadline() if deadline is None else deadline
        try:
            if self.backend == pb.BACKEND_NCCL:
                self._wait_polling(work, deadline, stopped)
            else:
                wait_gloo(work, deadline, what=f"group {self.group_id}: transfer", timeout=self._seconds,
                          closed=lambda: self.closed, stopped=stopped)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except CollectiveError:
            self.unfinished_work = work if self.backend == pb.BACKEND_NCCL else None
            raise
        except RuntimeError as error:
            raise CollectiveError(str(error), timed_out=looks_like_timeout(error)) from error

    def settled(self) -> bool:
        """Released (close() finished its abort), and no failed transfer of it still queued on the device: a
        closed group's recorded streams no longer hold torch's cached blocks (gpu_worker/device_lane.py)."""
        if not self.released.is_set():
            return False
        work = self.unfinished_work
        try:
            return work is None or bool(work.is_completed())  # type: ignore[attr-defined]
        except RuntimeError:
            return True  # its communicator is gone: nothing of it runs

    def _wait_polling(self, work: dist.Work, deadline: float, stopped: Stopped | None = None) -> None:
        """NCCL: wait for completion against the deadline (transfer_waits.wait_polled), then order this thread's
        current stream after it: WorkNCCL::synchronize blocks the current stream on the work's end event;
        unlike wait() it never aborts."""
        what = f"group {self.group_id}: transfer"
        wait_polled(work, deadline, what=what, timeout=self._seconds, closed=lambda: self.closed, stopped=stopped)
        work.synchronize()
        if self.closed:  # closed between the poll and here: the bytes may be an aborted kernel's
            raise CollectiveError(f"{what}: the group was closed while it was waited for", timed_out=False)

    @property
    def _seconds(self) -> float:
        return self.timeout.total_seconds()

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.wait(self.broadcast_async(tensor))

    def send_async(self, tensor: torch.Tensor, destination: int, tag: int, *, deadline: float | None = None,
                   stopped: Stopped | None = None) -> dist.Work:
        """Start sending to one rank (a bucket goes to its owner only); wait() on the result. Gloo returns at
        once. NCCL runs it on the group's own communicator (nccl_p2p.py), whose start may wait for
        `destination` to reach its matching receive (their first transfer connects them): that start is
        bounded by `deadline` (default: the group's timeout from now), by close() from another thread and
        by `stopped`."""
        return self._point_to_point(tensor, destination, tag, send=True, deadline=deadline, stopped=stopped)

    def receive(self, tensor: torch.Tensor, source: int, tag: int, *, deadline: float | None = None) -> None:
        """Receive what `source` sends with `tag`, by `deadline` (default: the group's timeout from now: the
        start and the transfer itself both within it)."""
        deadline = self.deadline() if deadline is None else deadline
        self.wait(self._point_to_point(tensor, source, tag, send=False, deadline=deadline, stopped=None), deadline)

    def _point_to_point(self, tensor: torch.Tensor, peer: int, tag: int, *, send: bool, deadline: float | None,
                        stopped: Stopped | None) -> dist.Work:
        pg = self._pg
        if pg is None:
            raise CollectiveError(f"group {self.group_id} is closed", timed_out=False)
        if self.backend != pb.BACKEND_NCCL:
            try:
                op = pg.send if send else pg.recv  # type: ignore[attr-defined]
                return op([tensor], peer, tag)
            except RuntimeError as error:
                raise CollectiveError(str(error), timed_out=looks_like_timeout(error)) from error
        deadline = self.deadline() if deadline is None else deadline
        device, first = self.device, peer not in self.peers
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

        def start() -> tuple[dist.Work, int]:
            with on_stream(device, stream):
                before = free_device_bytes(device) if first else 0
                work = batched(pg, send=send, tensor=tensor, peer=peer, tag=tag)
                return work, (max(0, before - free_device_bytes(device)) if first else 0)

        what = f"group {self.group_id}: {'send to' if send else 'receive from'} rank {peer}"
        try:
            work, grown = wait_call(ThreadCall(start, name=f"p2p-{self.group_id}"), deadline, what=what,
                                    timeout=self._seconds, closed=lambda: self.closed, stopped=stopped)
        except CollectiveError:
            raise
        except RuntimeError as error:
            raise CollectiveError(f"{what}: {error}", timed_out=looks_like_timeout(error)) from error
        if first:
            # NCCL's buffers for this peer were allocated while it connected (driver memory, not torch's).
            self.peers.add(peer)
            self.nccl_device_bytes += grown
            log.info("nccl_peer_connected", group_id=self.group_id, peer=peer, device_bytes=grown,
                     group_device_bytes=self.nccl_device_bytes)
        return work

    def close(self, join_seconds: float = CLOSE_JOIN_SECONDS) -> bool:
        """Abort and release the communicator, waiting at most join_seconds; safe to call twice.

        Runs in a thread of its own: ncclCommAbort can hang, and dropping a
        ProcessGroupNCCL joins torch's watchdog thread, which sleeps up to a minute
        after a failure. The last reference is dropped in that thread, so the
        caller (a worker's command loop) never waits longer than join_seconds.
        Returns whether the release finished in time."""
        pg, self._pg = self._pg, None
        if pg is None:
            return self.released.wait(join_seconds)  # closed already: the release may still be on its way
        held = [pg]
        del pg
        released = self.released

        def release() -> None:
            try:
                group = held.pop()
                for method in ("abort", "shutdown"):
                    fn = getattr(group, method, None)
                    if fn is not None:
                        try:
                            fn()
                            break
                        except Exception:  # noqa: BLE001 - best effort on teardown
                            continue
                del group  # the destructor runs here, not in the caller
            finally:
                released.set()

        finished = run_bounded(release, join_seconds, f"close-{self.group_id}")
        if not finished and self.backend == pb.BACKEND_NCCL:
            UNRELEASED.add(self.group_id, self.released)
        return finished


def failure_report_bound(group_timeout: float, *, margin: float, close_join: float = FAILED_CLOSE_JOIN_SECONDS,
                         poll: float = NCCL_POLL_SECONDS[1]) -> bool:
    """Whether a worker whose transfer timed out reports it before the server gives up on it: its wait
    ends at the group timeout (+ one poll), then the group's abort may hold it `close_join`, and the
    server waits the group timeout + `margin`. Half the margin is kept for the command's way there and back."""
    return group_timeout + poll + close_join <= group_timeout + margin / 2


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
    trainer_ranks: int = 1,
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
            refuse_while_closing(UNRELEASED.ids())
            from torch._C._distributed_c10d import ProcessGroupNCCL  # only in CUDA builds

            # The environment our group is built with (nccl_env.py) was set by the caller, from the
            # thread that started this one: the trainer around its rendezvous, a worker at start.
            deadline = time.monotonic() + timeout.total_seconds()
            options = nccl_options(ProcessGroupNCCL.Options(), timeout)
            pg = ProcessGroupNCCL(prefixed, rank, world_size, options)
            group = CollectiveGroup(group_id, backend, rank, world_size, timeout, device, pg,
                                    trainer_ranks=trainer_ranks)
            try:
                connect(group, deadline)
            except BaseException:
                # A communicator still initializing is aborted, but torch holds its init until
                # TORCH_NCCL_NONBLOCKING_TIMEOUT: not waited for here (the group counts as unreleased).
                group.close(FAILED_CLOSE_JOIN_SECONDS)
                raise
            return group
        else:
            raise ValueError(f"unsupported backend {backend}")
    except RuntimeError as error:
        if looks_like_timeout(error) and not isinstance(error, (RendezvousTimeout, GroupsStillClosing)):
            raise RendezvousTimeout(str(error)) from error
        raise
    return CollectiveGroup(group_id, backend, rank, world_size, timeout, device, pg, trainer_ranks=trainer_ranks)


def connect(group: CollectiveGroup, deadline: float) -> None:
    """Build the group's NCCL communicator now and prove every rank joined it: a 1-byte broadcast from
    rank 0, waited for against the deadline. Every rank runs it in open_group.

    The unique id goes through the store and NCCL's init runs in the background; torch waits for that
    init inside the broadcast call itself, for TORCH_NCCL_NONBLOCKING_TIMEOUT. torch reads that value
    once per process, so a trainer whose own NCCL groups came first keeps its value (torch's default is
    30 min), whatever nccl_env sets for ours: seen on an H200 (torch 2.11, NCCL 2.28.9), a group whose
    second rank never came held open_group past 4x its timeout. The call therefore runs in a thread of
    its own, waited for until the deadline; past it open_group closes the group. That abort waits for the
    init too (torch holds the communicator's lock while it waits for the init): the group is released only
    then, and counts meanwhile against MAX_UNRELEASED_NCCL_GROUPS."""
    device = group.device
    before = free_device_bytes(device)

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
        if error.timed_out:
            raise RendezvousTimeout(f"group {group.group_id}: not every rank connected within "
                                    f"{group.timeout.total_seconds():g} s: {error}") from error
        raise RuntimeError(f"group {group.group_id}: connecting failed: {error}") from error


def nonblocking_timeout_seconds(group_timeout: float) -> int:
    """The TORCH_NCCL_NONBLOCKING_TIMEOUT that ends a non-blocking communicator's wait within the group's
    timeout: torch counts whole seconds and fails once more than that many passed (so up to one more)."""
    return max(1, math.floor(group_timeout) - 1)


def nccl_options(options, timeout: datetime.timedelta):
    """ProcessGroupNCCL.Options for a weightsync group: its timeout, non-blocking communicator init."""
    options._timeout = timeout
    options.config.blocking = 0
    return options


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
