"""The worker's command loop.

State machine (one worker, one store; groups are independent of it):

    IDLE --prepare_update--> PREPARED --receive_bucket(k)--> PREPARED (k+1 next)
    PREPARED --commit_update (all buckets in)--> IDLE   (new version live)
    PREPARED --abort_update / any failure------> IDLE   (STAGED: live untouched;
                                                         IN_PLACE: touched tensors dirty)
    any --shutdown--> exit 0

Commands are handled one at a time, in order. A command blocks the loop only
inside a collective, and every collective has its group's timeout. Each command
gets exactly one event with the same command_id: its result or CommandFailed.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import structlog
import torch

from weightsync.common.collective import (
    CollectiveError,
    CollectiveGroup,
    RendezvousTimeout,
    backend_for_device,
    connect_store,
    local_address_towards,
    open_group,
)
from weightsync.common.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    WeightSyncError,
    code_number,
)
from weightsync.common.shm_queue import ShmQueue
from weightsync.gpu_worker.store import WeightStore
from weightsync.gpu_worker.update import (
    FastPlan,
    PreparedUpdate,
    abort_update,
    commit_update,
    prepare_from_fast_plan,
    prepare_update,
    remember_fast_plan,
    verify_bucket,
)
from weightsync.worker.v1 import worker_pb2 as wpb

log = structlog.get_logger("weightsync.worker")


class _Shutdown(Exception):
    pass


class Worker:
    """Owns the store, the groups and the current update of one device."""

    def __init__(self, config: wpb.WorkerConfig, commands: ShmQueue, events: ShmQueue) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.commands = commands
        self.events = events
        self.store = WeightStore(self.device)
        self.groups: dict[str, CollectiveGroup] = {}
        self.update: PreparedUpdate | None = None
        self.staging: torch.Tensor | None = None
        self.fast_plan: FastPlan | None = None
        self._handlers: dict[str, Callable[[wpb.WorkerCommand, wpb.WorkerEvent], None]] = {
            "join_group": self._join_group,
            "leave_group": self._leave_group,
            "prepare_update": self._prepare_update,
            "receive_bucket": self._receive_bucket,
            "commit_update": self._commit_update,
            "abort_update": self._abort_update,
            "compute_checksums": self._compute_checksums,
            "shutdown": self._shutdown,
        }

    # -- loop ------------------------------------------------------------------
    def run(self, parent_alive: Callable[[], bool]) -> None:
        self._emit(
            wpb.WorkerEvent(
                started=wpb.WorkerStarted(
                    pid=os.getpid(), device=str(self.device), backend=backend_for_device(self.device)
                )
            )
        )
        log.info("worker_started", device=str(self.device))
        while True:
            payload = self.commands.get(timeout=1.0)
            if payload is None:
                if not parent_alive():
                    log.warning("parent_gone_exiting")
                    return
                continue
            try:
                self._dispatch(payload)
            except _Shutdown:
                log.info("worker_stopping")
                return

    def _dispatch(self, payload: bytes) -> None:
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
            event.store.CopyFrom(self._store_status())
            self._emit(event)
            raise
        except WeightSyncError as error:
            self._fail(event, error)
        except CollectiveError as error:
            self._fail(event, Aborted("COLLECTIVE_FAILED", str(error)))
        except torch.OutOfMemoryError as error:
            self._fail(event, ResourceExhausted("DEVICE_OUT_OF_MEMORY", str(error)))
        except Exception as error:  # noqa: BLE001 - reported, never fatal
            log.exception("command_crashed", command_id=event.command_id)
            self._fail(event, WeightSyncError("WORKER_INTERNAL", f"worker error: {type(error).__name__}"))
        else:
            event.store.CopyFrom(self._store_status())
            self._emit(event)

    def _fail(self, event: wpb.WorkerEvent, error: WeightSyncError, broken_group: str = "") -> None:
        failed = event.command_failed
        failed.code = code_number(error.code)
        failed.reason = error.reason
        failed.message = error.message
        failed.metadata.update(error.metadata)
        failed.broken_group_id = broken_group or getattr(error, "broken_group_id", "")
        event.store.CopyFrom(self._store_status())
        self._emit(event)

    def _emit(self, event: wpb.WorkerEvent) -> None:
        self.events.put(event.SerializeToString(), timeout=30.0)

    def _store_status(self) -> wpb.StoreStatus:
        return wpb.StoreStatus(
            state=self.store.state,
            tensor_count=len(self.store.tensors),
            store_bytes=self.store.live_bytes,
        )

    # -- groups ------------------------------------------------------------------
    def _join_group(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        join = command.join_group
        if join.group_id in self.groups:
            raise AlreadyExists("GROUP_ALREADY_EXISTS", f"already in group {join.group_id}", group_id=join.group_id)
        timeout = join.timeout.ToTimedelta()
        started = time.monotonic()
        bound = log.bind(group_id=join.group_id, rank=join.rank)
        bound.info("group_joining", store=f"{join.store_host}:{join.store_port}", world_size=join.world_size)
        try:
            store = connect_store(join.store_host, join.store_port, timeout)
            remaining = timeout - datetime.timedelta(seconds=time.monotonic() - started)
            store.set_timeout(max(remaining, datetime.timedelta(seconds=1)))
            group = open_group(
                group_id=join.group_id,
                backend=join.backend,
                store=store,
                rank=join.rank,
                world_size=join.world_size,
                timeout=timeout,
                device=self.device,
                local_address=local_address_towards(join.store_host, join.store_port),
            )
        except RendezvousTimeout as error:
            raise DeadlineExceeded(
                "RENDEZVOUS_TIMEOUT",
                f"group {join.group_id}: not every rank joined within {timeout.total_seconds():g} s",
                group_id=join.group_id,
                rank=join.rank,
            ) from error
        except RuntimeError as error:
            raise Aborted(
                "RENDEZVOUS_FAILED", f"group {join.group_id}: {error}", group_id=join.group_id
            ) from error
        self.groups[join.group_id] = group
        event.group_joined.group_id = join.group_id
        event.group_joined.join_seconds = time.monotonic() - started
        bound.info("group_joined", seconds=round(event.group_joined.join_seconds, 3))

    def _leave_group(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        group_id = command.leave_group.group_id
        if self.update is not None and self.update.group_id == group_id:
            self._abort_current("group deleted")
        group = self.groups.pop(group_id, None)
        if group is not None:
            group.close()
        event.group_left.group_id = group_id
        log.info("group_left", group_id=group_id)

    # -- updates -------------------------------------------------------------------
    def _prepare_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        prepare = command.prepare_update
        if self.update is not None:
            raise FailedPrecondition(
                "UPDATE_IN_PROGRESS",
                f"update {self.update.update_id} is still running",
                update_id=self.update.update_id,
            )
        if prepare.group_id not in self.groups:
            raise NotFound("GROUP_NOT_FOUND", f"not in group {prepare.group_id}", group_id=prepare.group_id)
        update = None if self.fast_plan is None else prepare_from_fast_plan(self.store, prepare, self.fast_plan)
        if update is None:
            update = prepare_update(self.store, prepare, self.staging, self.config.memory_limit_bytes)
            self.fast_plan = remember_fast_plan(self.store, prepare.plan_id, update)
        if update.staging_bytes > (0 if self.staging is None else self.staging.numel()):
            # zeros() touches every page now, not during the first receive.
            self.staging = torch.zeros(update.staging_bytes, dtype=torch.uint8, device=self.device)
        self.store.updating = True
        self.update = update
        event.update_prepared.update_id = update.update_id
        event.update_prepared.fast_path_bucket_count = update.fast_path_count
        log.info(
            "update_prepared",
            update_id=update.update_id,
            buckets=len(update.targets),
            fast_path=update.fast_path_count,
        )

    def _receive_bucket(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        receive = command.receive_bucket
        update = self._current(receive.update_id)
        group = self.groups.get(update.group_id)
        if group is None:
            raise NotFound("GROUP_NOT_FOUND", f"group {update.group_id} is gone", group_id=update.group_id)
        sequence = receive.sequence
        if receive.discard or update.failed:
            # The update is already failing: complete the broadcast the
            # trainer announced so no rank hangs, and drop the bytes.
            size = update.targets[sequence].size_bytes if 0 <= sequence < len(update.targets) else 0
            self._broadcast(group, self._scratch(size))
            event.bucket_received.sequence = sequence
            return
        if sequence != update.next_sequence:
            raise InvalidArgument(
                "BUCKET_OUT_OF_ORDER",
                f"bucket {sequence} announced, expected {update.next_sequence}",
                bucket=sequence,
                expected=update.next_sequence,
            )
        target = update.targets[sequence]
        received = target.direct if target.direct is not None else self._scratch(target.size_bytes)
        update.started_through = sequence
        self._broadcast(group, received)
        try:
            verify_bucket(sequence, target, received, receive.checksum)
        except WeightSyncError:
            update.failed = True
            raise
        for copy in target.copies:
            copy.dst.copy_(received[copy.src_offset : copy.src_offset + copy.size_bytes])
        update.next_sequence += 1
        update.received_bytes += target.size_bytes
        event.bucket_received.sequence = sequence
        event.bucket_received.size_bytes = target.size_bytes
        event.bucket_received.fast_path = target.direct is not None

    def _broadcast(self, group: CollectiveGroup, buffer: torch.Tensor) -> None:
        try:
            group.broadcast(buffer)
        except CollectiveError as error:
            group.close()
            self.groups.pop(group.group_id, None)
            reason = "COLLECTIVE_TIMEOUT" if error.timed_out else "COLLECTIVE_FAILED"
            failure = Aborted(reason, f"group {group.group_id}: broadcast failed: {error}", group_id=group.group_id)
            failure.broken_group_id = group.group_id  # type: ignore[attr-defined]
            log.warning("collective_failed", group_id=group.group_id, reason=reason, error=str(error))
            raise failure from error

    def _scratch(self, size: int) -> torch.Tensor:
        if self.staging is None or self.staging.numel() < size:
            self.staging = torch.zeros(size, dtype=torch.uint8, device=self.device)
        return self.staging[:size]

    def _commit_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        update = self._current(command.commit_update.update_id)
        commit_update(self.store, update)
        self.update = None
        event.update_committed.update_id = update.update_id
        log.info("update_committed", update_id=update.update_id, bytes=update.received_bytes)

    def _abort_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        update_id = command.abort_update.update_id
        if self.update is not None and self.update.update_id == update_id:
            self._abort_current("requested")
        event.update_aborted.update_id = update_id

    def _abort_current(self, why: str) -> None:
        assert self.update is not None
        abort_update(self.store, self.update)
        log.info("update_aborted", update_id=self.update.update_id, why=why, store_state=self.store.state)
        self.update = None

    def _current(self, update_id: str) -> PreparedUpdate:
        if self.update is None or self.update.update_id != update_id:
            raise FailedPrecondition("UPDATE_NOT_PREPARED", f"update {update_id} is not prepared", update_id=update_id)
        return self.update

    # -- queries -------------------------------------------------------------------
    def _compute_checksums(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        event.checksums_computed.tensors.extend(self.store.checksums(list(command.compute_checksums.names)))

    def _shutdown(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        if self.update is not None:
            self._abort_current("shutdown")
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        raise _Shutdown()
