"""The worker's command loop: one device, one store, its groups.

    prepare_update   the store takes the update in, SIZED (needed_bytes > 0: it waits
                     for the server's admission), or allocated at once
    allocate_update  SIZED -> receiving
    receive_bucket   one bucket, from a broadcast or the ingress
    commit_update    the new version goes live
    abort_update, leave_group of the update's group, shutdown: the update is dropped
    shutdown         exit 0

The update's lifecycle (and every check on a bucket) lives in store.py; this
module only dispatches, and reports what the store became. Commands are
handled one at a time, in order; each gets exactly one event with the same
command_id: its result or CommandFailed. A command blocks the loop only inside
a collective (every collective has its group's timeout) or a join (bounded by
its deadline, see groups.py).

A sticky CUDA error ends the process after its CommandFailed went out (see
device_faults.py): the supervisor restarts the worker on the store it kept.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

import torch

from weightsync.common.collective import CollectiveError, backend_for_device
from weightsync.common.device_identity import cuda_uuid
from weightsync.common.errors import (
    Aborted,
    InvalidArgument,
    ResourceExhausted,
    WeightSyncError,
    code_number,
)
from weightsync.common.fd_passing import send_fds
from weightsync.common.logging import get_logger
from weightsync.common.shm_queue import ShmQueue
from weightsync.gpu_worker.device_faults import DeviceFault, classify
from weightsync.gpu_worker.groups import GroupTable
from weightsync.gpu_worker.memory import available_bytes, map_ingress
from weightsync.gpu_worker.store import Applied, StoreUpdate, WeightStore
from weightsync.gpu_worker.update_plan import PlanCache, derive_update_plan
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.worker")

HEARTBEAT_SECONDS = 0.25


class _Shutdown(Exception):
    pass


class _DeviceFailed(Exception):
    """The device is unusable: the loop ends and the process exits with `fault.exit_code`."""

    def __init__(self, fault: DeviceFault) -> None:
        super().__init__(fault.name)
        self.fault = fault


class Worker:
    """Owns the store, the groups and the current update of one device."""

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
        self.store = WeightStore(self.device)
        self.ingress = map_ingress(config.ingress_fd, config.ingress_bytes)
        self.groups = GroupTable(self.device)
        self.plans = PlanCache()
        self._handlers: dict[str, Callable[[wpb.WorkerCommand, wpb.WorkerEvent], None]] = {
            "join_group": self._join_group,
            "leave_group": self._leave_group,
            "prepare_update": self._prepare_update,
            "allocate_update": self._allocate_update,
            "receive_bucket": self._receive_bucket,
            "commit_update": self._commit_update,
            "abort_update": self._abort_update,
            "compute_checksums": self._compute_checksums,
            "restore_store": self._restore_store,
            "export_store": self._export_store,
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
            event.store.CopyFrom(self.store.status())
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
            event.store.CopyFrom(self.store.status())
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
        event.store.CopyFrom(self.store.status())
        self._emit(event)

    def _emit(self, event: wpb.WorkerEvent) -> None:
        self.events.put(event.SerializeToString(), timeout=30.0)

    def _snapshot(self) -> tuple[wpb.StoreManifest, list[int]]:
        """The store's manifest, after handing the server the arenas it does not hold yet."""
        unsent = self.store.unsent_arenas()
        if unsent and self.fd_channel is not None:
            send_fds(self.fd_channel, [a.fd for a in unsent])
            self.store.mark_persisted([a.arena_id for a in unsent])
        return self.store.manifest(), [a.arena_id for a in unsent] if self.fd_channel is not None else []

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
        if self.store.update is not None and self.store.update.group_id == group_id:
            self._abort("group deleted")
        self.groups.leave(group_id)
        event.group_left.group_id = group_id
        log.info("group_left", group_id=group_id)

    # -- updates -------------------------------------------------------------------
    def _prepare_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        prepare = command.prepare_update
        store = self.store
        store.require_idle()
        if prepare.group_id:  # COLLECTIVE; INLINE and SHM buckets come through the ingress
            self.groups.get(prepare.group_id)
        plan = self.plans.get(prepare.plan_id, store.layout_version, prepare.mode == pb.UPDATE_MODE_STAGED) or derive_update_plan(
            plan=prepare.plan, plan_id=prepare.plan_id, mode=prepare.mode,
            allow_new_tensors=prepare.allow_new_tensors, tensors=store.tensors,
            segment_signatures=[s.signature for s in store.segments],
            segment_sizes=[s.size_bytes for s in store.segments], layout_version=store.layout_version,
        )
        needed = store.needed_bytes(plan)
        limit = self.config.memory_limit_bytes
        if limit and store.held_bytes + needed > limit:
            raise ResourceExhausted(
                "WORKER_MEMORY_LIMIT",
                f"the update needs {needed} more bytes; this worker holds {store.held_bytes} of its "
                f"{limit}-byte limit (--worker-memory-limit-bytes)",
                needed_bytes=needed, held_bytes=store.held_bytes, limit=limit,
            )
        update = store.prepare_update(plan, prepare.update_id, prepare.group_id)
        prepared = event.update_prepared
        prepared.update_id = prepare.update_id
        prepared.fast_path_bucket_count = plan.fast_path_count
        prepared.held_bytes = store.held_bytes
        if update.needed_bytes == 0:
            self._allocate(prepare.update_id)
            return
        prepared.needed_bytes = update.needed_bytes
        if self.device.type == "cuda":
            prepared.device_available_bytes = available_bytes(self.device)

    def _allocate_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        update = self._allocate(command.allocate_update.update_id)
        event.update_prepared.update_id = update.update_id
        event.update_prepared.fast_path_bucket_count = update.plan.fast_path_count
        event.update_prepared.held_bytes = self.store.held_bytes

    def _allocate(self, update_id: str) -> StoreUpdate:
        update = self.store.allocate_update(update_id)
        log.info("update_prepared", update_id=update_id, buckets=len(update.plan.routes),
                 fast_path=update.plan.fast_path_count)
        return update

    def _receive_bucket(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        receive = command.receive_bucket
        event.bucket_received.sequence = receive.sequence
        applied: Applied | None
        if receive.from_ingress:
            applied = self.store.receive_from_ingress(receive, self.ingress)
        else:
            group = self.groups.get(self.store.current(receive.update_id).group_id)
            applied = self.store.receive_broadcast(receive, lambda buffer: self.groups.broadcast(group, buffer))
        if applied is not None:
            event.bucket_received.size_bytes = applied.size_bytes
            event.bucket_received.fast_path = applied.fast_path

    def _commit_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        update_id = command.commit_update.update_id
        received = self.store.current(update_id).received_bytes
        plan = self.store.commit_update()
        self.plans.remember(plan, self.store.layout_version)
        manifest, sent = self._snapshot()
        event.update_committed.update_id = update_id
        event.update_committed.manifest.CopyFrom(manifest)
        event.update_committed.sent_arena_ids.extend(sent)
        log.info("update_committed", update_id=update_id, bytes=received)

    def _abort_update(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        update_id = command.abort_update.update_id
        if self.store.update is not None and self.store.update.update_id == update_id:
            self._abort("requested")
        manifest, sent = self._snapshot()
        event.update_aborted.update_id = update_id
        event.update_aborted.manifest.CopyFrom(manifest)
        event.update_aborted.sent_arena_ids.extend(sent)

    def _abort(self, why: str) -> None:
        update = self.store.update
        assert update is not None
        self.store.abort_update()
        log.info("update_aborted", update_id=update.update_id, why=why, store_state=self.store.state)

    # -- store -------------------------------------------------------------------------
    def _restore_store(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        restore = command.restore_store
        self.store.restore(restore.manifest, {a.arena_id: a.fd for a in restore.arenas}, list(restore.dirty))
        event.store_restored.tensor_count = len(self.store.tensors)
        log.info("store_restored", tensors=len(self.store.tensors), state=self.store.state)

    def _export_store(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        """This worker's GPU UUID and the CUDA IPC handles of its committed arenas, for an engine on
        the same GPU (host arenas go as fds); each arena is shared once per process (cuda_export.py)."""
        from weightsync.gpu_worker.cuda_export import ArenaExporter, committed_arena_ids

        exporter = getattr(self, "_arena_exporter", None)
        if exporter is None:
            exporter = self._arena_exporter = ArenaExporter.for_device(self.device)
        exported = event.store_exported
        exported.device_uuid = exporter.device_uuid
        exported.arenas.extend(exporter.export(self.store.arenas, committed_arena_ids(self.store)))

    def _compute_checksums(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        event.checksums_computed.tensors.extend(self.store.checksums(list(command.compute_checksums.names)))

    def _shutdown(self, command: wpb.WorkerCommand, event: wpb.WorkerEvent) -> None:
        if self.store.update is not None:
            self._abort("shutdown")
        self.groups.close_all()
        raise _Shutdown()
