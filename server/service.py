"""The WeightSyncService servicer: one method per RPC, over the server's parts.

The parts: the Supervisor (worker processes), the Publisher (version and
watchers), the GroupRegistry (groups and the dead-trainer watch), the
PlanCache (validated plans by content id) and the MemoryAdmission. An update
stream gets exactly these through SessionServices, never the servicer.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator
from importlib.metadata import version

import structlog
from grpc_health.v1 import health_pb2

from weightsync.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from weightsync.server.admission import MemoryAdmission
from weightsync.server.config import ServerConfig
from weightsync.server.credentials import Credentials
from weightsync.server.engine_driver import VllmHttpDriver
from weightsync.server.engines import EngineRegistry
from weightsync.server.groups import GroupRegistry
from weightsync.server.ingress import Ingress
from weightsync.server.leases import LeaseTable
from weightsync.server.local_socket import LocalHandoff
from weightsync.server.metrics import Metrics, StateCollector
from weightsync.server.publisher import Publisher
from weightsync.server.requests import (
    PlanCache,
    available_backends_for,
    check_begin,
    group_for,
    group_record,
    max_chunk_bytes,
    plan_for,
    require_full_update_of_empty_stores,
)
from weightsync.server.state import GroupRecord
from weightsync.server.supervisor import Supervisor, WorkerHandle
from weightsync.server.update_session import SessionServices, UpdateSession
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc
from weightsync.worker.v1 import worker_pb2 as wpb

log = structlog.get_logger("weightsync.service")

SERVICE_NAME = "weightsync.v1.WeightSyncService"
SERVER_VERSION = version("weightsync")
GROUP_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_GROUP_TIMEOUT = datetime.timedelta(seconds=60)
MAX_GROUP_TIMEOUT = datetime.timedelta(hours=1)
MAX_VERSION_BYTES = 256
JOIN_MARGIN_SECONDS = 2.0
"""Workers answer a join by its deadline (+1 s); this much more before the server gives up on them."""


class WeightSyncServicer(pb_grpc.WeightSyncServiceServicer):
    def __init__(self, config: ServerConfig, health, metrics: Metrics | None = None, *,
                 credentials: Credentials) -> None:
        self.config = config
        self.credentials = credentials  # the one source of truth for the token: SIGHUP reloads it
        self.health = health  # the grpc_health aio servicer, shared with the plaintext health port
        self.metrics = metrics or Metrics()
        self.ingress = Ingress(config.ingress_slot_bytes, config.ingress_slot_count) if config.ingress_slot_bytes else None
        self.supervisor = Supervisor(
            config.devices,
            queue_capacity_bytes=config.queue_capacity_bytes,
            log_level=config.log_level,
            memory_limit_bytes=config.worker_memory_limit_bytes,
            on_worker_died=self._on_worker_died,
            on_worker_started=self._on_worker_started,
            on_worker_unresponsive=self._on_worker_unresponsive,
            ingress=self.ingress,
        )
        self.engines = EngineRegistry(on_change=lambda: self.publisher.publish_state())
        self.publisher = Publisher(self.supervisor, self.engines)
        self.leases = LeaseTable()
        self.groups = GroupRegistry(on_trainer_gone=self._release_group)
        self.plans = PlanCache()
        self.sessions = SessionServices(
            supervisor=self.supervisor,
            publisher=self.publisher,
            groups=self.groups,
            admission=MemoryAdmission(host_limit_bytes=config.host_memory_limit_bytes,
                                      reserve_bytes=config.host_memory_reserve_bytes),
            leases=self.leases,
            ingress=self.ingress,
            command_timeout=config.worker_call_timeout_seconds,
            transfer_timeout=config.transfer_timeout_seconds,
            lease_timeout=config.engine_lease_timeout_seconds,
            max_chunk_bytes=max_chunk_bytes(config),
            metrics=self.metrics,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self.local: LocalHandoff | None = None
        if config.local_socket:
            path = config.local_socket
            if path == "auto":
                path = os.path.join(tempfile.gettempdir(), f"weightsync-{os.getpid()}.sock")
            self.local = LocalHandoff(
                path, supervisor=self.supervisor, publisher=self.publisher, leases=self.leases, engines=self.engines,
                ingress=self.ingress, credentials=self.credentials, allowed_uids=config.local_allow_uids,
                command_timeout=config.worker_call_timeout_seconds,
            )
        self.drivers = [
            VllmHttpDriver.from_spec(spec, i, publisher=self.publisher, engines=self.engines,
                                     local_socket=self.local.path if self.local else "", credentials=self.credentials)
            for i, spec in enumerate(config.engines)
        ]
        self.draining = False
        self.update_lock = asyncio.Lock()
        self.active_update: UpdateSession | None = None
        self._background: set[asyncio.Task] = set()

    # -- lifecycle hooks -------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics.watch(StateCollector(self._info_from_any_thread, self._groups_from_any_thread))
        await self.supervisor.start()
        self.groups.start()
        if self.local is not None:
            await self.local.start()
        for driver in self.drivers:
            driver.start()
        await self.set_health(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        """After the gRPC server stopped: the engine drivers, the local socket, the workers, the ingress."""
        for driver in self.drivers:
            await driver.stop()
        if self.local is not None:
            await self.local.stop()
        await self.supervisor.stop()
        if self.ingress is not None:
            self.ingress.close()

    def _info_from_any_thread(self) -> pb.GetServerInfoResponse:
        """For the metrics thread: a consistent snapshot, taken on the event loop."""
        return self._on_loop(self.info)

    def _groups_from_any_thread(self) -> list[pb.TransferGroup]:
        return self._on_loop(lambda: [g.to_proto() for g in self.groups.sorted()])

    def _on_loop(self, read):
        loop = self._loop
        if loop is None or loop.is_closed() or threading.get_ident() == getattr(loop, "_thread_id", None):
            return read()

        async def call():
            return read()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=10)

    def _on_worker_died(self, worker: WorkerHandle) -> None:
        self.metrics.worker_restarts.labels(worker=str(worker.index)).inc()
        # The dead worker left every group; the others must leave too (a group missing a rank is unusable).
        self.groups.mark_all_broken(f"WORKER_DIED: worker {worker.index} died")
        for record in list(self.groups.records.values()):
            self._spawn(self._leave_everywhere(record.group_id))
        self._spawn(self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self.publisher.publish_state()

    def _on_worker_started(self, worker: WorkerHandle) -> None:
        if self.supervisor.all_running and not self.draining:
            self._spawn(self.set_health(health_pb2.HealthCheckResponse.SERVING))
        self.publisher.publish_state()

    def _on_worker_unresponsive(self, worker: WorkerHandle) -> None:
        self._spawn(self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def _release_group(self, record: GroupRecord) -> None:
        await self._leave_everywhere(record.group_id)

    async def set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _require_serving(self) -> None:
        if self.draining:
            raise Unavailable("SERVER_DRAINING", "the server is shutting down")
        if not self.supervisor.all_running:
            raise Unavailable("WORKER_UNAVAILABLE", "a worker is restarting or unresponsive; retry shortly")

    async def _leave_everywhere(self, group_id: str) -> None:
        leave = wpb.LeaveGroupCommand(group_id=group_id)
        results = await asyncio.gather(
            *(self.supervisor.call(w, self.config.worker_call_timeout_seconds, leave_group=leave)
              for w in self.supervisor.workers if w.state == pb.WORKER_STATE_RUNNING),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                log.warning("leave_group_failed", group_id=group_id, error=str(result))

    # -- RPCs ----------------------------------------------------------------------
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.GetServerInfoResponse:
        return self.info()

    def info(self) -> pb.GetServerInfoResponse:
        workers = [
            pb.WorkerInfo(
                index=w.index, device=w.device, backend=w.backend, state=w.state,
                store_state=pb.STORE_STATE_LOST if w.lost else w.store.state,
                tensor_count=w.store.tensor_count, store_bytes=w.store.store_bytes, pid=w.pid,
                restart_count=w.restart_count,
            )
            for w in self.supervisor.workers
        ]
        return pb.GetServerInfoResponse(
            server_version=SERVER_VERSION,
            workers=workers,
            backends=available_backends_for(self.supervisor.workers),
            transports=self.transports(),
            store_state=self.publisher.store_state(),
            current_version=self.publisher.version.to_proto(),
            limits=pb.ServerLimits(
                max_tensors=self.config.max_tensors, max_plan_bytes=self.config.max_plan_bytes,
                max_bucket_bytes=self.config.max_bucket_bytes, max_message_bytes=self.config.max_message_bytes,
                max_chunk_bytes=self.sessions.max_chunk_bytes if self.ingress else 0,
                ingress_slot_bytes=self.ingress.slot_bytes if self.ingress else 0,
                ingress_slot_count=self.ingress.slot_count if self.ingress else 0,
            ),
            draining=self.draining,
            engines=self.engines.protos(),
            local_socket=self.local.path if self.local else "",
        )

    def transports(self) -> list[int]:
        offered = [pb.TRANSPORT_COLLECTIVE]
        if self.ingress is not None:
            offered.append(pb.TRANSPORT_INLINE)
            if self.local is not None:  # SHM trainers map the ingress through the local socket
                offered.append(pb.TRANSPORT_SHM)
        return offered

    async def CreateTransferGroup(self, request: pb.CreateTransferGroupRequest, context) -> pb.CreateTransferGroupResponse:
        record = group_record(request, self.supervisor.workers)
        if record.group_id in self.groups:
            raise AlreadyExists("GROUP_ALREADY_EXISTS", f"group {record.group_id!r} already exists", group_id=record.group_id)
        self._require_serving()
        self.groups.add(record)
        structlog.contextvars.bind_contextvars(group_id=record.group_id)
        log.info("group_creating", world_size=record.world_size, rank_offset=record.rank_offset)
        join = wpb.JoinGroupCommand(
            group_id=record.group_id, store_host=request.store_host, store_port=request.store_port,
            world_size=record.world_size, backend=record.backend,
        )
        join.timeout.FromTimedelta(record.timeout)
        timeout = record.timeout.total_seconds() + JOIN_MARGIN_SECONDS
        joined = False
        try:
            calls = []
            for worker in self.supervisor.workers:
                command = wpb.JoinGroupCommand()
                command.CopyFrom(join)
                command.rank = record.rank_offset + worker.index
                calls.append(self.supervisor.call(worker, timeout, join_group=command))
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
            joined = True
        finally:
            if not joined:
                # Leave nothing half-joined, even if this RPC was cancelled.
                self.groups.remove(record.group_id)
                self._spawn(self._leave_everywhere(record.group_id))
                log.warning("group_create_failed")
        if record.state == pb.GROUP_STATE_JOINING:
            record.state = pb.GROUP_STATE_READY
        log.info("group_ready")
        return pb.CreateTransferGroupResponse(group=record.to_proto())

    async def DeleteTransferGroup(self, request: pb.DeleteTransferGroupRequest, context) -> pb.DeleteTransferGroupResponse:
        record = self.groups.get(request.group_id)
        if record is None:
            raise NotFound("GROUP_NOT_FOUND", f"no group {request.group_id!r}", group_id=request.group_id[:128])
        active = self.active_update
        if active is not None and active.group is record and not active.finished:
            raise FailedPrecondition(
                "UPDATE_IN_PROGRESS", f"update {active.update_id} is running on group {record.group_id!r}",
                group_id=record.group_id, update_id=active.update_id,
            )
        if record.state == pb.GROUP_STATE_JOINING:
            raise FailedPrecondition("GROUP_JOINING", f"group {record.group_id!r} is still joining", group_id=record.group_id)
        self.groups.remove(record.group_id)
        await self._leave_everywhere(record.group_id)
        log.info("group_deleted", group_id=record.group_id)
        return pb.DeleteTransferGroupResponse()

    async def ListTransferGroups(self, request: pb.ListTransferGroupsRequest, context) -> pb.ListTransferGroupsResponse:
        return pb.ListTransferGroupsResponse(groups=[g.to_proto() for g in self.groups.sorted()])

    async def GetTensorChecksums(self, request: pb.GetTensorChecksumsRequest, context) -> pb.GetTensorChecksumsResponse:
        names = list(request.names)
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise InvalidArgument("TENSOR_NAME_DUPLICATE", f"tensor {duplicate!r} is asked for twice",
                                  tensor=duplicate[:256])
        if self.active_update is not None and not self.active_update.finished:
            raise FailedPrecondition("STORE_UPDATING", "an update is running; ask again after it commits or aborts")
        self._require_serving()
        events = await self.supervisor.call_all(
            self.config.worker_call_timeout_seconds, compute_checksums=wpb.ComputeChecksumsCommand(names=names),
        )
        return pb.GetTensorChecksumsResponse(
            version=self.publisher.version.to_proto(),
            store_state=self.publisher.store_state(),
            workers=[
                pb.WorkerChecksums(worker_index=w.index, tensors=e.checksums_computed.tensors)
                for w, e in zip(self.supervisor.workers, events, strict=True)
            ],
        )

    async def WatchWeights(self, request: pb.WatchWeightsRequest, context) -> AsyncIterator[pb.WatchWeightsResponse]:
        queue = self.publisher.watchers.subscribe()
        try:
            yield self.publisher.event()
            while True:
                yield await queue.get()
        finally:
            self.publisher.watchers.unsubscribe(queue)

    async def UpdateWeights(self, requests: AsyncIterator[pb.UpdateWeightsRequest], context) -> AsyncIterator[pb.UpdateWeightsResponse]:
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            raise InvalidArgument("BEGIN_MISSING", "the stream closed before a begin message") from None
        if first.WhichOneof("message") != "begin":
            raise InvalidArgument("BEGIN_MISSING", "the first message must be begin")
        begin = first.begin
        check_begin(begin, self.transports())
        group = group_for(begin, self.groups)
        plan, plan_id, summary = plan_for(begin, self.plans, self.config.limits,
                                          self.ingress.slot_bytes if self.ingress else 0)
        self._require_serving()
        require_full_update_of_empty_stores(self.supervisor.workers, summary)
        if self.update_lock.locked():
            active = self.active_update
            raise FailedPrecondition(
                "UPDATE_IN_PROGRESS",
                "another update is running on this server's store; retry after it commits or aborts",
                update_id=active.update_id if active else "",
            )
        async with self.update_lock:
            update_id = uuid.uuid4().hex[:16]
            structlog.contextvars.bind_contextvars(update_id=update_id, group_id=group.group_id if group else "",
                                                   transport=pb.Transport.Name(begin.transport))
            session = UpdateSession(self.sessions, update_id, group, begin, plan, plan_id)
            self.active_update = session
            try:
                async for response in session.run(requests):
                    if response.WhichOneof("message") == "committed":
                        self.plans.remember(plan_id, plan, summary)
                    yield response
            finally:
                self.active_update = None

    # -- shutdown ------------------------------------------------------------------
    async def drain(self, grace_seconds: float) -> None:
        """Refuse new work, let a running update finish within the grace period, then abort it."""
        self.draining = True
        self.groups.stop()
        await self.health.enter_graceful_shutdown()
        session = self.active_update
        if session is not None and not session.finished:
            log.info("draining_update", update_id=session.update_id, grace_seconds=grace_seconds)
            try:
                await asyncio.wait_for(self._wait_idle(), grace_seconds)
            except TimeoutError:
                session.request_shutdown()
                try:
                    await asyncio.wait_for(self._wait_idle(), 5.0)
                except TimeoutError:
                    log.warning("update_still_running_at_shutdown")

    async def _wait_idle(self) -> None:
        while self.active_update is not None:
            await asyncio.sleep(0.05)


__all__ = ["WeightSyncServicer", "SERVICE_NAME"]
