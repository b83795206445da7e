"""The inference node's parts, built and wired in one place.

A Node owns the store (server/store/node_store.py: every tensor once, in host memory the server keeps),
the supervisor (worker processes: the node's receivers), the publisher (version and
watchers), the groups, the plan cache, memory admission, the leases, the ingress, the local
socket, the engine drivers, the metrics, the credentials and the update gate. It reacts to
the workers' lives (died, started, unresponsive). The servicer (server/rpc/service.py) only serves
RPCs over it, and an update session sees only SessionServices.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Callable
from importlib.metadata import version
from typing import TypeVar

from grpc_health.v1 import health_pb2

from weightsync.common.data_plane import DATA_PLANE_REVISION
from weightsync.common.errors import Unavailable
from weightsync.common.logging import get_logger
from weightsync.server.config import ServerConfig, max_chunk_bytes
from weightsync.server.credentials import Credentials
from weightsync.server.engines.drivers import build_driver
from weightsync.server.engines.local_socket import LocalHandoff
from weightsync.server.groups import GroupRecord, GroupRegistry
from weightsync.server.metrics import Metrics, StateCollector
from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.published.publisher import Publisher
from weightsync.server.store.ingress import Ingress
from weightsync.server.store.leases import LeaseTable
from weightsync.server.store.node_store import NodeStore
from weightsync.server.tasks import TaskSet
from weightsync.server.update.admission import MemoryAdmission
from weightsync.server.update.gate import UpdateGate
from weightsync.server.update.plans import ValidatedPlans
from weightsync.server.update.view import SessionServices
from weightsync.server.workers.backends import available_backends_for
from weightsync.server.workers.supervisor import Supervisor, WorkerHandle
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = get_logger("weightsync.node")

SERVICE_NAME = "weightsync.v1.WeightSyncService"
SERVER_VERSION = version("weightsync")
T = TypeVar("T")
FleetFactory = Callable[[Ingress | None], Supervisor]
"""Builds the node's workers from its ingress instead of the Supervisor's processes: a stand-in with the
Supervisor's surface, such as tests/fake_fleet.py's receivers in the server's own process."""


class Node:
    """One inference node: its workers, its store's published version, its engines."""

    def __init__(self, config: ServerConfig, health, credentials: Credentials, metrics: Metrics | None = None,
                 fleet: FleetFactory | None = None) -> None:
        self.config = config
        self.health = health  # the grpc_health aio servicer, shared with the plaintext health port
        self.credentials = credentials
        self.metrics = metrics or Metrics()
        self.ingress = Ingress(config.ingress_slot_bytes, config.ingress_slot_count) if config.ingress_slot_bytes else None
        self.supervisor = fleet(self.ingress) if fleet is not None else Supervisor(
            config.devices,
            queue_capacity_bytes=config.queue_capacity_bytes,
            log_level=config.log_level,
            memory_limit_bytes=config.worker_memory_limit_bytes,
            on_worker_died=self._on_worker_died,
            on_worker_started=self._on_worker_started,
            on_worker_unresponsive=self._on_worker_unresponsive,
            ingress=self.ingress,
        )
        self.store = NodeStore(tensor_filter=config.tensors)
        self.engines = EngineRegistry(on_change=lambda: self.publisher.publish_state())
        self.publisher = Publisher(self.store, self.engines)
        self.leases = LeaseTable()
        self.groups = GroupRegistry(on_trainer_gone=self._release_group)
        self.plans = ValidatedPlans()
        self.gate = UpdateGate()
        self.session_services = SessionServices(
            fleet=self.supervisor,
            store=self.store,
            publisher=self.publisher,
            groups=self.groups,
            admission=MemoryAdmission(host_limit_bytes=config.host_memory_limit_bytes,
                                      reserve_bytes=config.host_memory_reserve_bytes,
                                      store_held_bytes=lambda: self.store.held_bytes),
            leases=self.leases,
            ingress=self.ingress,
            command_timeout=config.worker_call_timeout_seconds,
            transfer_timeout=config.transfer_timeout_seconds,
            lease_timeout=config.engine_lease_timeout_seconds,
            max_chunk_bytes=max_chunk_bytes(config),
            metrics=self.metrics,
        )
        self.local: LocalHandoff | None = None
        if config.local_socket:
            path = config.local_socket
            if path == "auto":
                path = os.path.join(tempfile.gettempdir(), f"weightsync-{os.getpid()}.sock")
            self.local = LocalHandoff(
                path, store=self.store, publisher=self.publisher, leases=self.leases, engines=self.engines,
                ingress=self.ingress, credentials=credentials, allowed_uids=config.local_allow_uids,
            )
        self.drivers = [
            build_driver(spec, i, publisher=self.publisher, engines=self.engines,
                         local_socket=self.local.path if self.local else "", credentials=credentials,
                         leases=self.leases)
            for i, spec in enumerate(config.engines)
        ]
        self.draining = False
        self.background = TaskSet()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------
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
        """After the gRPC server stopped: the engine drivers, the local socket, the workers, the ingress.
        Each step runs even if one before it failed: a stale socket file or a live worker outlasting
        the server would be worse than the first error."""
        steps: list[tuple[str, Callable[[], object]]] = [(f"driver_{d.name}", d.stop) for d in self.drivers]
        if self.local is not None:
            steps.append(("local_socket", self.local.stop))
        steps.append(("workers", self.supervisor.stop))
        steps.append(("background", self.background.cancel_all))
        for name, step in steps:
            try:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 - logged; the other parts must still stop
                log.exception("stop_step_failed", step=name)
        if self.ingress is not None:
            self.ingress.close()
        self.store.close()

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new work, let a running update finish within the grace period, then abort it."""
        self.draining = True
        self.groups.stop()
        await self.health.enter_graceful_shutdown()
        session = self.gate.running_update()
        if session is not None:
            log.info("draining_update", update_id=session.update_id, grace_seconds=grace_seconds)
            try:
                await asyncio.wait_for(self.gate.wait_idle(), grace_seconds)
            except TimeoutError:
                session.request_shutdown()  # type: ignore[attr-defined]
                try:
                    await asyncio.wait_for(self.gate.wait_idle(), 5.0)
                except TimeoutError:
                    log.warning("update_still_running_at_shutdown")

    # -- the update gate -----------------------------------------------------------------
    def require_serving(self) -> None:
        if self.draining:
            raise Unavailable("SERVER_DRAINING", "the server is shutting down")
        if not self.supervisor.all_running:
            raise Unavailable("WORKER_UNAVAILABLE", "a worker is restarting or unresponsive; retry shortly")

    # -- what the workers' lives change ------------------------------------------------------
    def _on_worker_died(self, worker: WorkerHandle) -> None:
        self.metrics.worker_restarts.labels(worker=str(worker.index)).inc()
        # The dead worker left every group; the others must leave too (a group missing a rank is unusable).
        self.groups.mark_all_broken(f"WORKER_DIED: worker {worker.index} died")
        for record in list(self.groups.records.values()):
            self.background.spawn(self.leave_everywhere(record.group_id), "leave_group")
        self.background.spawn(self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING), "set_health")
        self.publisher.publish_state()

    def _on_worker_started(self, worker: WorkerHandle) -> None:
        if self.supervisor.all_running and not self.draining:
            self.background.spawn(self.set_health(health_pb2.HealthCheckResponse.SERVING), "set_health")
        self.publisher.publish_state()

    def _on_worker_unresponsive(self, worker: WorkerHandle) -> None:
        self.background.spawn(self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING), "set_health")

    async def _release_group(self, record: GroupRecord) -> None:
        await self.leave_everywhere(record.group_id)

    async def set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def leave_everywhere(self, group_id: str) -> None:
        supervisor = self.supervisor
        left = await supervisor.fan_out(self.config.worker_call_timeout_seconds, supervisor.alive_workers(),
                                        leave_group=wpb.LeaveGroupCommand(group_id=group_id))
        left.log_errors("leave_group_failed", group_id=group_id)

    # -- what the node looks like --------------------------------------------------------
    def info(self) -> pb.GetServerInfoResponse:
        config, store = self.config, self.store
        workers = [
            pb.WorkerInfo(
                index=w.index, device=w.device, backend=w.backend, state=w.state, store_state=store.state,
                tensor_count=len(store.tensors), store_bytes=store.live_bytes, pid=w.pid,
                restart_count=w.restart_count, device_uuid=w.device_uuid, staging_bytes=w.status.staging_bytes,
                staging_on_device=not w.host_memory and w.status.staging_bytes > 0,
                received_bytes=w.status.received_bytes,
            )
            for w in self.supervisor.workers
        ]
        return pb.GetServerInfoResponse(
            server_version=SERVER_VERSION,
            workers=workers,
            backends=available_backends_for(self.supervisor.workers),
            transports=self.transports(),
            bucket_compressions=[pb.BUCKET_COMPRESSION_ZSTD],  # every worker decompresses (gpu_worker/frames.py)
            deferred_buckets=True,
            parts=self.ingress is not None,  # parts run over INLINE, whole tensors and boxes (server/rpc/service.py)
            data_plane_revision=DATA_PLANE_REVISION,
            store_state=store.state,
            current_version=self.publisher.version.to_proto(),
            limits=pb.ServerLimits(
                max_tensors=config.max_tensors, max_plan_bytes=config.max_plan_bytes,
                max_bucket_bytes=config.max_bucket_bytes, max_message_bytes=config.max_message_bytes,
                max_chunk_bytes=self.session_services.max_chunk_bytes if self.ingress else 0,
                ingress_slot_bytes=self.ingress.slot_bytes if self.ingress else 0,
                ingress_slot_count=self.ingress.slot_count if self.ingress else 0,
            ),
            draining=self.draining,
            engines=self.engines.protos(),
            local_socket=self.local.path if self.local else "",
            store=pb.StoreInfo(state=store.state, tensor_count=len(store.tensors), live_bytes=store.live_bytes,
                               held_bytes=store.held_bytes, tensor_filter=store.tensor_filter),
        )

    def transports(self) -> list[int]:
        offered = [pb.TRANSPORT_COLLECTIVE]
        if self.ingress is not None:
            offered.append(pb.TRANSPORT_INLINE)
            if self.local is not None:  # SHM trainers map the ingress through the local socket
                offered.append(pb.TRANSPORT_SHM)
        return offered

    def _info_from_any_thread(self) -> pb.GetServerInfoResponse:
        """For the metrics thread: a consistent snapshot, taken on the event loop."""
        return self._on_loop(self.info)

    def _groups_from_any_thread(self) -> list[pb.TransferGroup]:
        return self._on_loop(lambda: [g.to_proto() for g in self.groups.sorted()])

    def _on_loop(self, read: Callable[[], T]) -> T:
        loop = self._loop
        if loop is None or loop.is_closed() or threading.get_ident() == getattr(loop, "_thread_id", None):
            return read()

        async def call() -> T:
            return read()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=10)


__all__ = ["Node", "SERVICE_NAME"]
