"""The transfer groups one worker belongs to.

A join runs in a thread of its own and the command loop waits for it until
the group's deadline, not longer: torch's TCPStore client can block far past
its timeout when the address accepts TCP but never answers (seen: > 110 s
with a 3 s timeout). At the deadline the join is abandoned (DEADLINE_EXCEEDED):
the thread is left to finish or fail on its own and closes whatever it built,
and the worker, with its store, carries on.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import stat
import time

import torch

from weightsync.common.collective import (
    CLOSE_JOIN_SECONDS,
    FAILED_CLOSE_JOIN_SECONDS,
    CollectiveError,
    CollectiveGroup,
    RendezvousTimeout,
    bucket_tag,
    connect_store,
    interface_of,
    local_address_towards,
    open_group,
)
from weightsync.common.errors import Aborted, AlreadyExists, DeadlineExceeded, NotFound
from weightsync.common.logging import get_logger
from weightsync.common.nccl_env import lower_nonblocking_timeout, pin_worker_interface
from weightsync.common.threads import CallAbandoned, ThreadCall
from weightsync.gpu_worker.device_faults import DeviceLeftBusy
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.worker.groups")


def _open(join: wpb.JoinGroupCommand, device: torch.device) -> CollectiveGroup:
    """Connect to the trainer's store and build this rank's group (in a join thread)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # per thread: NCCL binds the current device
    timeout = join.timeout.ToTimedelta()
    started = time.monotonic()
    store = connect_store(join.store_host, join.store_port, timeout)
    remaining = timeout - datetime.timedelta(seconds=time.monotonic() - started)
    store.set_timeout(max(remaining, datetime.timedelta(seconds=1)))
    return open_group(
        group_id=join.group_id, backend=join.backend, store=store, rank=join.rank,
        world_size=join.world_size, timeout=timeout, device=device,
        local_address=local_address_towards(join.store_host, join.store_port),
        trainer_ranks=max(1, join.trainer_ranks),  # NCCL, several: every pair connected in the join
    )


def abort_overdue(backend: int, device: torch.device, *, finished: bool, waited: float,
                  bound: float = CLOSE_JOIN_SECONDS) -> bool:
    """Whether a closed group's unfinished abort means a kernel may be left on this worker's GPU for good: an
    NCCL broadcast's kernel runs until its communicator's abort ends it (Gloo runs nothing on a device)."""
    return not finished and waited >= bound and backend == pb.BACKEND_NCCL and device.type == "cuda"


def _close_abandoned(group: CollectiveGroup) -> None:
    group.close()
    log.info("abandoned_join_closed", group_id=group.group_id)


class GroupTable:
    """Joined groups by id; joins bounded by their deadline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: dict[str, CollectiveGroup] = {}
        self.stores: dict[str, tuple[str, int]] = {}
        """Each joined group's rendezvous store address."""
        self.abandoned_joins = 0
        self.closing: list[tuple[CollectiveGroup, float]] = []
        """Groups left whose abort had not finished by then, with when it began (check_closing)."""
        self.settling: list[CollectiveGroup] = []
        """NCCL groups left on this GPU that are not settled yet (device_busy)."""

    def join(self, join: wpb.JoinGroupCommand) -> float:
        """Join a group; returns the seconds it took."""
        self.check_closing()
        if join.group_id in self.groups:
            raise AlreadyExists("GROUP_ALREADY_EXISTS", f"already in group {join.group_id}", group_id=join.group_id)
        timeout = join.timeout.ToTimedelta().total_seconds()
        started = time.monotonic()
        if join.backend == pb.BACKEND_NCCL:
            # From this (the loop's) thread, before any join thread exists: NCCL reads it once.
            pin_worker_interface(interface_of(local_address_towards(join.store_host, join.store_port)))
            lower_nonblocking_timeout(timeout)  # its communicator's init ends within the join's bound
        call = ThreadCall(functools.partial(_open, join, self.device), name=f"join-{join.group_id}",
                          discard=_close_abandoned)
        try:
            # A little slack over the timeout: torch reports its own rendezvous timeout first.
            group = call.result(timeout + 1.0)
        except CallAbandoned:
            self.abandoned_joins += 1
            address = (join.store_host, join.store_port)
            severed = 0 if address in self.stores.values() else sever_connections_to(*address)
            log.warning("join_abandoned", group_id=join.group_id, timeout=timeout, abandoned=self.abandoned_joins,
                        connections_severed=severed)
            raise DeadlineExceeded(
                "RENDEZVOUS_TIMEOUT",
                f"group {join.group_id}: the rendezvous at {join.store_host}:{join.store_port} did not complete "
                f"within {timeout:g} s",
                group_id=join.group_id, rank=join.rank,
            ) from None
        except RendezvousTimeout as error:
            raise DeadlineExceeded(
                "RENDEZVOUS_TIMEOUT",
                f"group {join.group_id}: not every rank joined within {timeout:g} s",
                group_id=join.group_id, rank=join.rank,
            ) from error
        except Exception as error:  # noqa: BLE001 - any other failure of the rendezvous, typed
            raise Aborted("RENDEZVOUS_FAILED", f"group {join.group_id}: {error}", group_id=join.group_id) from error
        self.groups[join.group_id] = group
        self.stores[join.group_id] = (join.store_host, join.store_port)
        return time.monotonic() - started

    def get(self, group_id: str) -> CollectiveGroup:
        group = self.groups.get(group_id)
        if group is None:
            raise NotFound("GROUP_NOT_FOUND", f"not in group {group_id}", group_id=group_id)
        return group

    def leave(self, group_id: str, join_seconds: float = CLOSE_JOIN_SECONDS) -> bool:
        """Leave and close a group, waiting for its abort at most `join_seconds`; False if it goes on."""
        self.stores.pop(group_id, None)
        group = self.groups.pop(group_id, None)
        if group is None:
            return True
        closed = group.close(join_seconds)
        if group.backend == pb.BACKEND_NCCL and group.device.type == "cuda" and not group.settled():
            self.settling.append(group)
        if not closed:
            self.closing.append((group, time.monotonic()))
        return closed

    def device_busy(self) -> bool:
        """Whether a group left on this GPU may still have work queued there: its abort not finished, or a
        failed transfer's kernel not ended (CollectiveGroup.settled). torch's empty_cache would wait for it
        (the device lane holds its cached blocks meanwhile: gpu_worker/device_lane.py)."""
        self.settling = [group for group in self.settling if not group.settled()]
        return bool(self.settling)

    def check_closing(self) -> None:
        """Before a group command: a closed NCCL group whose abort is still not done CLOSE_JOIN_SECONDS after
        it began may have left its broadcast's kernel running on this GPU, and nothing in this process can end
        it: raise DeviceLeftBusy (the worker reports it, then exits with the device-lost code)."""
        now = time.monotonic()
        self.closing = [(g, started) for g, started in self.closing if not g.released.is_set()]
        for group, started in self.closing:
            if abort_overdue(group.backend, group.device, finished=False, waited=now - started):
                raise DeviceLeftBusy(f"group {group.group_id}: its NCCL abort is not done after {now - started:.0f} s; "
                                     "its kernel may still run on this device")

    def transfer(self, group: CollectiveGroup, buffer: torch.Tensor, receive: wpb.ReceiveBucketCommand, *,
                 point_to_point: bool, deadline: float | None = None) -> None:
        """Receive one bucket: point-to-point from its sender (ReceiveBucketCommand.source_rank, tag: its index in
        the sender's plan, source_sequence), which Gloo always is and NCCL is for an update of several parts;
        else (NCCL, one trainer) the broadcast from rank 0 that every rank joins. Done by `deadline`
        (time.monotonic(); default: the group's timeout from now): the worker passes when the command arrived
        plus the group's timeout, which a receive held for its turn has partly spent (the server's bound runs
        from when it forwarded the command). A failure leaves the group (it is unusable) and says so."""
        self.check_closing()
        sequence = receive.sequence
        deadline = group.deadline() if deadline is None else deadline
        try:
            if group.backend == pb.BACKEND_NCCL and not point_to_point:
                group.wait(group.broadcast_async(buffer), deadline)
            else:
                group.receive(buffer, receive.source_rank, bucket_tag(receive.source_sequence), deadline=deadline)
        except CollectiveError as error:
            # Reported within the server's bound (the group timeout + its margin: collective.failure_report_bound):
            # the abort goes on in its own thread past FAILED_CLOSE_JOIN_SECONDS; one still running at a later
            # group command CLOSE_JOIN_SECONDS after it began ends the worker (check_closing).
            closed = self.leave(group.group_id, FAILED_CLOSE_JOIN_SECONDS)
            kind, reason = (DeadlineExceeded, "COLLECTIVE_TIMEOUT") if error.timed_out else (Aborted, "COLLECTIVE_FAILED")
            failure = kind(reason, f"group {group.group_id}: bucket {sequence} failed: {error}", group_id=group.group_id)
            failure.broken_group_id = group.group_id
            log.warning("collective_failed", group_id=group.group_id, reason=reason, error=str(error), closed=closed)
            raise failure from error

    def close_all(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        self.stores.clear()


def sever_connections_to(host: str, port: int) -> int:
    """Shut down this process's TCP connections to host:port; returns how many.

    An abandoned join's thread may sit in torch's TCPStore client on a store that accepted the
    connection but never answers, for minutes past any timeout. Shutting its socket down (the
    descriptor stays the client's to close) ends that wait at once, so the connection does not
    outlive the DEADLINE_EXCEEDED the worker already reported. Only called when no joined group
    uses the same store."""
    try:
        peers = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return 0
    severed = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves the client's own
        except (OSError, ValueError):
            continue
        with probe:
            if probe.family not in (socket.AF_INET, socket.AF_INET6) or probe.type != socket.SOCK_STREAM:
                continue
            try:
                peer = probe.getpeername()
            except OSError:
                continue
            if peer[0].removeprefix("::ffff:") in peers and peer[1] == port:  # torch dials v4 over a v6 socket
                try:
                    probe.shutdown(socket.SHUT_RDWR)
                    severed += 1
                except OSError:
                    pass
    return severed
