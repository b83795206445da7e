"""The worker's command loop: one device, its groups, its assignments in the node's updates.

    map_arenas       map arenas of the node store (descriptors on the fd channel)
    unmap_arenas     drop the mappings of arenas the store no longer uses
    prepare_update   take this worker's assignment in an update: its buckets and their places
    receive_bucket   one bucket, from a Gloo receive, an NCCL broadcast or the ingress
    commit_update    STAGED patches scattered, every copy done
    abort_update, leave_group of the update's group, shutdown: the update is dropped
    shutdown         exit 0

The update's lifecycle (and every check on a bucket) lives in receiver.py; this module only
dispatches. Commands are handled one at a time, in order; each gets exactly one event with
the same command_id: its result or CommandFailed. A command blocks the loop only inside a
collective (every collective has its group's timeout) or a join (bounded by its deadline,
see group_table.py).

A sticky CUDA error ends the process after its CommandFailed went out (see
device_faults.py): the supervisor restarts the worker; the store is the server's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import torch

from weightsync.common.collective import (
    FAILED_CLOSE_JOIN_SECONDS,
    CollectiveError,
    backend_for_device,
)
from weightsync.common.device_identity import cuda_uuid
from weightsync.common.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    WeightSyncError,
    code_number,
)
from weightsync.common.fd_passing import recv_fds
from weightsync.common.logging import get_logger
from weightsync.common.shm_queue import ShmQueue
from weightsync.gpu_worker.device_faults import DeviceFault, classify
from weightsync.gpu_worker.group_table import GroupTable
from weightsync.gpu_worker.memory import available_bytes, map_arena, map_ingress
from weightsync.gpu_worker.receive_update import Applied
from weightsync.gpu_worker.receiver import Receiver
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.worker")

HEARTBEAT_SECONDS = 0.25


class _Shutdown(Exception):
    pass


def command_arrival(sent_ns: int, read_at: float) -> float:
    """When a command arrived (time.monotonic()): when the server put it in the queue (WorkerCommand.sent_monotonic_ns,
    the host's CLOCK_MONOTONIC, which time.monotonic() reads too), never later than when this worker read it; the
    reading time where the server did not stamp it (0)."""
    return min(read_at, sent_ns / 1e9) if sent_ns > 0 else read_at


class _DeviceFailed(Exception):
    """The device is unusable: the loop ends and the process exits with `fault.exit_code`."""

    def __init__(self, fault: DeviceFault) -> None:
        super().__init__(fault.name)
        self.fault = fault


class Worker:
    """Owns the groups, the mapped node store and the current update of one device."""

    def __init__(
        self,
        config: wpb.WorkerConfig,
        commands: ShmQueue,
        events: ShmQueue,
        fd_channel: socket.socket | None,
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.commands = commands
        self.events = events
        self.fd_channel = fd_channel
        self.receiver = Receiver(self.device, config.memory_limit_bytes)
        self.ingress = map_ingress(config.ingress_fd, config.ingress_bytes)
        self.groups = GroupTable(self.device)
        if self.receiver.lane is not None:  # its cached blocks wait while a failed NCCL kernel may be queued
            self.receiver.lane.hold_cache = self.groups.device_busy
        self._arrived = 0.0
        """When the command being executed was put in the queue (command_arrival; time.monotonic())."""
        self._held: dict[tuple[str, int], tuple[bytes, float]] = {}
        """(update id, sequence) -> a receive command waiting its turn (_held_back), and when it was put in the queue."""
        self._handlers: dict[str, Callable[[wpb.WorkerCommand, wpb.WorkerEvent], None]] = {
            "join_group": self._join_group,
            "leave_group": self._leave_group,
            "map_arenas": self._map_arenas,
            "unmap_arenas": self._unmap_arenas,
            "prepare_update": self._prepare_update,
            "receive_bucket": self._receive_bucket,
            "commit_update": self._commit_update,
            "abort_update": self._abort_update,
            "shutdown": self._shutdown,
        }

    # -- loop ------------------------------------------------------------------
    def run(self, parent_alive: Callable[[], bool]) -> int:
        """Serve commands until shutdown (0), the parent's death (0) or a device fault (its exit code)."""
        beating = threading.Event()
        threading.Thread(target=self._heartbeat, args=(beating,), name="heartbeat", daemon=True).start()
        self._emit(wpb.WorkerEvent(started=wpb.WorkerStarted(
            pid=os.getpid(), device=str(self.device), backend=backend_for_device(self.device),
            device_uuid=self._device_uuid())))
        log.info("worker_started", device=str(self.device))
        try:
            while True:
                payload = self.commands.get(timeout=1.0)
                self._expire_held()
                if payload is None:
                    if not parent_alive():
                        log.warning("parent_gone_exiting")
                        return 0
                    continue
                try:
                    self._dispatch(payload)
                except _Shutdown:
                    log.info("worker_stopping")
                    return 0
                except _DeviceFailed as failed:
                    log.error("device_failed_exiting", fault=failed.fault.name, exit_code=failed.fault.exit_code)
                    return failed.fault.exit_code
        finally:
            beating.set()

    def _device_uuid(self) -> str:
        """The GPU's UUID for GetServerInfo; "" for a CPU worker, or if CUDA cannot say (the
        first command on the device then fails with the real reason)."""
        if self.device.type != "cuda":
            return ""
        try:
            return cuda_uuid(self.device.index or 0)
        except (RuntimeError, AssertionError) as error:
            log.warning("device_uuid_unknown", error=str(error))
            return ""

    def _heartbeat(self, stop: threading.Event) -> None:
        """Beat from a thread of its own: the loop may sit in a collective for its whole timeout."""
        while not stop.is_set():
            self.commands.beat()
            stop.wait(HEARTBEAT_SECONDS)

    def _dispatch(self, payload: bytes) -> None:
        """Run one command, unless it is a receive that must wait its turn (held: run, and answered, once every
        receive before it in the update's one order ran, or failed at the update's abort)."""
        command = wpb.WorkerCommand()
        try:
            command.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - _execute reports it
            command = None
        self._arrived = command_arrival(command.sent_monotonic_ns if command is not None else 0, time.monotonic())
        if self._held_back(command, payload):
            return
        self._execute(payload)
        while (update := self.receiver.update) is not None and update.turns:
            due = (update.update_id, update.turns[0])
            if due not in self._held:
                return
            payload, self._arrived = self._held.pop(due)
            self._execute(payload)  # its receive takes the turn, whatever its outcome

    def _held_back(self, command: wpb.WorkerCommand | None, payload: bytes) -> bool:
        """A receive of a COLLECTIVE update of several parts that is not yet this worker's turn is held
        (common/receive_order.py: every part sends in bucket order, every worker receives in one global order,
        so no wait forms a cycle). A payload that does not parse (None) is not held: running it reports why."""
        update = self.receiver.update
        if update is None or not update.turns or command is None:
            return False
        if command.WhichOneof("command") != "receive_bucket":
            return False
        receive = command.receive_bucket
        if receive.update_id != update.update_id or update.in_turn(receive.sequence):
            return False
        self._held[(update.update_id, receive.sequence)] = (payload, self._arrived)
        return True

    def _expire_held(self) -> None:
        """A receive held longer than the group's timeout fails as a transfer would have (COLLECTIVE_TIMEOUT), and
        before the server gives up on this worker (the group's timeout + its margin): the part whose turn it
        waits for sent nothing in that time."""
        update = self.receiver.update
        if not self._held or update is None or update.group_id not in self.groups.groups:
            return
        timeout = self.groups.groups[update.group_id].timeout.total_seconds()
        if time.monotonic() - min(since for _, since in self._held.values()) >= timeout:
            self._fail_held(f"no transfer came in turn within the group's timeout, {timeout:g} s", timed_out=True)

    def _fail_held(self, why: str, *, timed_out: bool = False) -> None:
        """The update ends with receives still held (or they waited too long: COLLECTIVE_TIMEOUT): each is answered
        COLLECTIVE_FAILED, and the group is left,
        since a part may already be sending those buckets to this rank (a send nobody will receive leaves the
        group unusable: the server marks it BROKEN from these answers)."""
        held, self._held = self._held, {}
        if not held:
            return
        update = self.receiver.update
        group_id = update.group_id if update is not None else ""
        closed = self.groups.leave(group_id, FAILED_CLOSE_JOIN_SECONDS) if group_id else True
        log.warning("held_receives_failed", why=why, buckets=sorted(sequence for _, sequence in held), closed=closed)
        kind, reason = (DeadlineExceeded, "COLLECTIVE_TIMEOUT") if timed_out else (Aborted, "COLLECTIVE_FAILED")
        self.receiver.touched = False  # a held receive wrote nothing
        for payload, _ in held.values():
            command = wpb.WorkerCommand()
            command.ParseFromString(payload)
            event = wpb.WorkerEvent(command_id=command.command_id)
            event.bucket_received.sequence = command.receive_bucket.sequence
            failure = kind(reason, f"group {group_id}: bucket {command.receive_bucket.sequence} was not received "
                           f"({why}) before its turn", group_id=group_id)
            failure.broken_group_id = group_id
            self._fail(event, failure)

    def _execute(self, payload: bytes) -> None:
        command = wpb.WorkerCommand()
        event = wpb.WorkerEvent()
        try:
            command.ParseFromString(payload)
            event.command_id = command.command_id
            kind = command.WhichOneof("command")
            handler = self._handlers.get(kind or "")
            if handler is None:
                raise InvalidArgument("COMMAND_UNKNOWN", f"unknown worker command {kind!r}")
            handler(command, event)
        except _Shutdown:
            event.status.CopyFrom(self._status())
            self._emit(event)
            raise
        except WeightSyncError as error:
            self._fail(event, error)
            self._exit_if_device_failed(error)  # e.g. NCCL's "unhandled cuda error" behind COLLECTIVE_FAILED
        except CollectiveError as error:
            self._fail(event, Aborted("COLLECTIVE_FAILED", str(error)))
            self._exit_if_device_failed(error)
        except torch.OutOfMemoryError as error:
            self._fail(event, ResourceExhausted("DEVICE_OUT_OF_MEMORY", str(error)))
        except Exception as error:  # noqa: BLE001 - reported; fatal only for a device fault
            log.exception("command_crashed", command_id=event.command_id)
            if self.device.type == "cuda" and classify(error) is not None:
                failure = WeightSyncError("DEVICE_FAILED", f"the device failed, the worker restarts: {str(error)[:300]}")
            else:
                failure = WeightSyncError("WORKER_INTERNAL", f"worker error: {type(error).__name__}")
            self._fail(event, failure)
            self._exit_if_device_failed(error)
        else:
            event.status.CopyFrom(self._status())
            self._emit(event)

    def _exit_if_device_failed(self, error: BaseException) -> None:
        """A sticky CUDA error (or a lost device) ends the loop once its failure was reported."""
        if self.device.type != "cuda":
            return
        cause: BaseException | None = error
        while cause is not None:
            fault = classify(cause)
            if fault is not None:
                raise _DeviceFailed(fault) from error
            cause = cause.__cause__

    def _fail(self, event: wpb.WorkerEvent, error: WeightSyncError) -> None:
        event.ClearField("event")
        failed = event.command_failed
        failed.code = code_number(error.code)
        failed.reason = error.reason
        failed.message = error.message
        failed.metadata.update(error.metadata)
        failed.broken_group_id = error.broken_group_id
        failed.store_touched = self.receiver.touched
        event.status.CopyFrom(self._status())
        self._emit(event)

    def _emit(self, event: wpb.WorkerEvent) -> None:
        self.events.put(event.SerializeToString(), timeout=30.0)

    def _status(self) -> wpb.WorkerStatus:
        status = self.receiver.status()
        if self.device.type == "cuda":
            try:
                status.device_available_bytes = available_bytes(self.device)
            except Exception:  # noqa: BLE001 - a failing device reports 0 free (the command's failure says why)
                status.device_available_bytes = 0
        return status

    # -- groups ------------------------------------------------------------------
    def _join_group(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        join = command.join_group
        bound = log.bind(group_id=join.group_id, rank=join.rank)
        bound.info("group_joining", store=f"{join.store_host}:{join.store_port}", world_size=join.world_size)
        seconds = self.groups.join(join)
        event.group_joined.group_id = join.group_id
        event.group_joined.join_seconds = seconds
        bound.info("group_joined", seconds=round(seconds, 3))

    def _leave_group(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        group_id = command.leave_group.group_id
        update = self.receiver.update
        if update is not None and update.group_id == group_id:
            self._abort("group deleted")
        self.groups.leave(group_id)
        self.receiver.release_staging()  # the device staging (NCCL's) goes back while no update runs
        event.group_left.group_id = group_id
        log.info("group_left", group_id=group_id)

    # -- the node store -------------------------------------------------------------------
    def _map_arenas(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        arenas = list(command.map_arenas.arenas)
        if self.fd_channel is None:
            raise FailedPrecondition("FD_CHANNEL_MISSING", "this worker has no fd channel to receive arenas on")
        fds = recv_fds(self.fd_channel, len(arenas))
        for i, spec in enumerate(arenas):
            try:
                self.receiver.maps.add(map_arena(spec.arena_id, fds[i], spec.size_bytes, self.device))
            except BaseException:
                for fd in fds[i + 1 :]:
                    os.close(fd)
                raise
        event.arenas_mapped.arena_ids.extend(sorted(self.receiver.maps.arenas))
        log.info("arenas_mapped", arenas=[a.arena_id for a in arenas], bytes=sum(a.size_bytes for a in arenas))

    def _unmap_arenas(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        self.receiver.maps.drop(command.unmap_arenas.arena_ids)
        event.arenas_mapped.arena_ids.extend(sorted(self.receiver.maps.arenas))

    # -- updates -------------------------------------------------------------------------
    def _device_lane(self, group_id: str) -> bool:
        """NCCL broadcasts land in device staging; everything else in host memory."""
        return bool(group_id) and self.groups.get(group_id).backend == pb.BACKEND_NCCL

    def _prepare_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        prepare = command.prepare_update
        if prepare.group_id:  # COLLECTIVE; INLINE and SHM buckets come through the ingress
            self.groups.get(prepare.group_id)
        self.receiver.prepare(prepare, device_lane=self._device_lane(prepare.group_id))
        prepared = event.update_prepared
        prepared.update_id = prepare.update_id
        prepared.staging_bytes = self.receiver.staging_bytes
        prepared.staging_on_device = self.receiver.lane is not None and self.receiver.lane.held_bytes > 0
        log.info("update_prepared", update_id=prepare.update_id, buckets=len(prepare.buckets),
                 shadow_copies=len(prepare.shadow_copies))

    def _receive_bucket(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        receive = command.receive_bucket
        event.bucket_received.sequence = receive.sequence
        applied: Applied | None
        if receive.in_store:
            applied = self.receiver.receive_in_store(receive)
        elif receive.from_ingress:
            applied = self.receiver.receive_from_ingress(receive, self.ingress)
        else:
            update = self.receiver.current(receive.update_id)
            try:
                group = self.groups.get(update.group_id)
                parts = len(update.lane_starts) > 1  # every part sends its own buckets, point-to-point
                # Within the group's timeout from when the server queued the command (its bound runs from then),
                # whatever part of it the queue or a turn took.
                deadline = self._arrived + group.timeout.total_seconds()
                applied = self.receiver.receive_collective(
                    receive, lambda buffer: self.groups.transfer(group, buffer, receive, point_to_point=parts,
                                                                 deadline=deadline),
                    device_lane=group.backend == pb.BACKEND_NCCL)
            finally:
                update.took_turn(receive.sequence)
        if applied is not None:
            event.bucket_received.size_bytes = applied.size_bytes
            event.bucket_received.fast_path = applied.fast_path

    def _commit_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        update_id = command.commit_update.update_id
        self.receiver.commit(update_id)
        event.update_committed.update_id = update_id
        log.info("update_committed", update_id=update_id)

    def _abort_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        update_id = command.abort_update.update_id
        update = self.receiver.update
        if update is not None and update.update_id == update_id:
            self._abort("requested")
        event.update_aborted.update_id = update_id

    def _abort(self, why: str) -> None:
        update = self.receiver.update
        assert update is not None
        self._fail_held(why)
        self.receiver.abort()
        log.info("update_aborted", update_id=update.update_id, why=why)

    def _shutdown(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        if self.receiver.update is not None:
            self._abort("shutdown")
        self.groups.close_all()
        raise _Shutdown()
