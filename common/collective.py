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
  - point-to-point transfers (a part's sends of a bucket to its owners, one
    owner's receive) run as batches on the group's own communicator (nccl_p2p.py),
    never on torch's per-pair communicators; their start runs in a thread of its
    own waited for against the same deadline;
  - the communicator is non-blocking (an abandoned group is aborted, half-built or
    not) and is built inside open_group, by a first 1-byte broadcast waited for
    against the group's timeout, then (several trainer ranks) every trainer rank's
    pair with every worker connected by a 1-byte batch (nccl_connect.py): open_group
    returns a group whose ranks and pairs all connected, or fails within the
    timeout. Not eager_connect_single_device: with a non-blocking communicator its
    init cannot be waited for from Python, and the first collective then races it
    (NCCL error 7, "operation in progress");
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

import datetime
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from weightsync.common import nccl_env
from weightsync.common.logging import get_logger
from weightsync.common.nccl_groups import (
    MAX_UNRELEASED_NCCL_GROUPS,
    UNRELEASED,
    GroupsStillClosing,
    refuse_while_closing,
)
from weightsync.common.nccl_p2p import PointToPoint, batched, free_device_bytes, on_stream
from weightsync.common.rendezvous_store import (  # noqa: F401 - their home before; imported from here
    RendezvousTimeout,
    connect_store,
    host_store,
    interface_of,
    local_address_towards,
)
from weightsync.common.threads import ThreadCall
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


def backend_for_device(device: torch.device) -> int:
    """NCCL for CUDA tensors, Gloo for everything else."""
    return pb.BACKEND_NCCL if device.type == "cuda" else pb.BACKEND_GLOO


def available_backends() -> list[int]:
    backends = [pb.BACKEND_GLOO] if dist.is_gloo_available() else []
    if dist.is_nccl_available() and torch.cuda.is_available():
        backends.append(pb.BACKEND_NCCL)
    return backends


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
    """NCCL: the ranks this one's point-to-point transfers are connected to (on the group's own communicator;
    a parts' group connects them all in open_group: nccl_connect.connect_pairs)."""
    nccl_device_bytes: int = 0
    """NCCL: device memory this process's driver had less of after the connect and after its pairs' connect
    (NCCL's communicator and per-peer buffers, invisible to torch's allocator; measured, so other allocations
    at the same moment count too)."""
    unfinished_work: object | None = None
    """NCCL: the last transfer whose wait failed or timed out; its kernel may still be queued (settled())."""
    _starting: threading.Lock = field(default_factory=threading.Lock)
    """NCCL: held while a batch is started (start_batch): one at a time per group."""

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
        """Start sending to one rank; wait() on the result (send_many_async: to several at once)."""
        [work] = self.send_many_async(tensor, [destination], tag, deadline=deadline, stopped=stopped)
        return work

    def send_many_async(self, tensor: torch.Tensor, destinations: Sequence[int], tag: int, *,
                        deadline: float | None = None, stopped: Stopped | None = None) -> list[dist.Work]:
        """Start sending `tensor` to each of `destinations` (a bucket to its owners); wait() on each work returned.
        Gloo: a send per destination, each returned at once. NCCL: ONE batch on the group's own communicator
        (nccl_p2p.py), all its sends in one kernel, one work; its start is bounded by `deadline` (default: the
        group's timeout from now), by close() from another thread and by `stopped`."""
        if self.backend == pb.BACKEND_NCCL:
            batch = [PointToPoint(True, tensor, destination, tag) for destination in destinations]
            return [self.start_batch(batch, deadline, stopped=stopped)] if batch else []
        pg = self._open_pg()
        try:
            return [pg.send([tensor], destination, tag) for destination in destinations]  # type: ignore[attr-defined]
        except RuntimeError as error:
            raise CollectiveError(str(error), timed_out=looks_like_timeout(error)) from error

    def receive(self, tensor: torch.Tensor, source: int, tag: int, *, deadline: float | None = None) -> None:
        """Receive what `source` sends with `tag`, by `deadline` (default: the group's timeout from now: the
        start and the transfer itself both within it)."""
        deadline = self.deadline() if deadline is None else deadline
        if self.backend == pb.BACKEND_NCCL:
            work = self.start_batch([PointToPoint(False, tensor, source, tag)], deadline)
        else:
            try:
                work = self._open_pg().recv([tensor], source, tag)  # type: ignore[attr-defined]
            except RuntimeError as error:
                raise CollectiveError(str(error), timed_out=looks_like_timeout(error)) from error
        self.wait(work, deadline)

    def _open_pg(self) -> object:
        pg = self._pg
        if pg is None:
            raise CollectiveError(f"group {self.group_id} is closed", timed_out=False)
        return pg

    def start_batch(self, operations: Sequence[PointToPoint], deadline: float | None = None, *,
                    stopped: Stopped | None = None) -> dist.Work:
        """NCCL: start `operations` as one batch on the group's own communicator (nccl_p2p.batched), in a thread
        of its own that takes this thread's device and current stream (the batch is ordered after what this
        stream queued), waited for until `deadline`, close() from another thread, or `stopped`. One batch is
        started at a time on a group (torch keeps a batch's state on the process group): a start given up on is
        followed by close(), which every caller does (a failed transfer breaks the group)."""
        pg = self._open_pg()
        deadline = self.deadline() if deadline is None else deadline
        device = self.device
        unconnected = sorted({op.peer for op in operations} - self.peers)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

        def start() -> tuple[dist.Work, int]:
            if not self._starting.acquire(blocking=False):
                raise CollectiveError(f"group {self.group_id}: a batch was started while another one still was "
                                      "(torch keeps one batch per process group)", timed_out=False)
            try:
                with on_stream(device, stream):
                    before = free_device_bytes(device) if unconnected else 0
                    work = batched(pg, operations)
                    return work, (max(0, before - free_device_bytes(device)) if unconnected else 0)
            finally:
                self._starting.release()

        kinds = {"send to" if op.send else "receive from" for op in operations}
        what = f"group {self.group_id}: {' and '.join(sorted(kinds))} rank {', '.join(str(op.peer) for op in operations)}"
        try:
            work, grown = wait_call(ThreadCall(start, name=f"p2p-{self.group_id}"), deadline, what=what,
                                    timeout=self._seconds, closed=lambda: self.closed, stopped=stopped)
        except CollectiveError:
            raise
        except RuntimeError as error:
            raise CollectiveError(f"{what}: {error}", timed_out=looks_like_timeout(error)) from error
        if unconnected and self.peers:
            # A parts' group connects every pair in open_group (nccl_connect.connect_pairs): these were not.
            log.warning("nccl_peers_connected_late", group_id=self.group_id, peers=unconnected, device_bytes=grown)
        self.peers.update(unconnected)
        self.nccl_device_bytes += grown
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
            log.warning("nccl_group_unreleased", group_id=self.group_id, unreleased=UNRELEASED.ids(),
                        refused_from=MAX_UNRELEASED_NCCL_GROUPS,
                        nonblocking_timeout=nccl_env.kept_nonblocking_timeout(),
                        why="its abort waits for torch's own wait on the communicator (up to "
                            "TORCH_NCCL_NONBLOCKING_TIMEOUT after its connect began, read once in this process); "
                            "while this many are unreleased a new NCCL group is refused (GroupsStillClosing): export "
                            "TORCH_NCCL_NONBLOCKING_TIMEOUT (about the group timeout) before the first NCCL call")
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
            kept = nccl_env.kept_nonblocking_timeout()
            if nccl_env.connects_cut_short(kept, timeout.total_seconds()):
                log.warning("nccl_connect_cut_short", group_id=group_id, nonblocking_timeout=kept,
                            group_timeout=timeout.total_seconds(),
                            why="torch reads TORCH_NCCL_NONBLOCKING_TIMEOUT once per process: it ends this group's "
                                "connects (its communicator's init, its pairs') before the group's timeout does, so "
                                "a rank that joins later than that fails the group")
            options = nccl_options(ProcessGroupNCCL.Options(), timeout)
            pg = ProcessGroupNCCL(prefixed, rank, world_size, options)
            group = CollectiveGroup(group_id, backend, rank, world_size, timeout, device, pg,
                                    trainer_ranks=trainer_ranks)
            from weightsync.common.nccl_connect import connect, connect_pairs

            try:
                connect(group, deadline)
                connect_pairs(group, deadline)
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


def nonblocking_timeout_seconds(group_timeout: float) -> int:
    """The TORCH_NCCL_NONBLOCKING_TIMEOUT that ends a non-blocking communicator's wait within the group's
    timeout: torch counts whole seconds and fails once more than that many passed (so up to one more)."""
    return max(1, math.floor(group_timeout) - 1)


def nccl_options(options, timeout: datetime.timedelta):
    """ProcessGroupNCCL.Options for a weightsync group: its timeout, non-blocking communicator init."""
    options._timeout = timeout
    options.config.blocking = 0
    return options
