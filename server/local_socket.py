"""The local hand-off: engines and same-host trainers map the node's memory.

A unix stream socket (weightsync/v1/local.proto for the messages, common/
local_wire.py for the framing). Only peers with the server's uid (or one
allowed with --local-allow-uid) are served, checked with SO_PEERCRED; the
socket file itself is 0600. An engine attaches to one worker's store, then
acquires the current version (a lease, see leases.py): it gets the arenas as
read-only descriptors (CPU) or CUDA IPC handles, and every tensor's place in
them; it copies what changed into its model and releases, saying whether it
now serves that version. An SHM trainer opens the ingress instead.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import itertools
import os
import re
import socket
import stat
from dataclasses import dataclass, field

import structlog

from weightsync.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    WeightSyncError,
    code_number,
)
from weightsync.common.fd_passing import peer_uid
from weightsync.common.local_wire import LocalWireError, read_frame, write_frame
from weightsync.server.engines import EngineRegistry
from weightsync.server.ingress import Ingress
from weightsync.server.leases import LeaseTable
from weightsync.server.publisher import Publisher
from weightsync.server.supervisor import Supervisor, WorkerHandle
from weightsync.v1 import local_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

log = structlog.get_logger("weightsync.local")

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
DEFAULT_WAIT_SECONDS = 30.0


@dataclass(slots=True)
class _Peer:
    """One connection's state."""

    conn_id: int
    uid: int
    worker: WorkerHandle | None = None
    engine_name: str = ""
    leases: dict[int, int] = field(default_factory=dict)
    """lease id -> generation it pins."""


class LocalHandoff:
    def __init__(
        self,
        path: str,
        *,
        supervisor: Supervisor,
        publisher: Publisher,
        leases: LeaseTable,
        engines: EngineRegistry,
        ingress: Ingress | None,
        token: str,
        allowed_uids: tuple[int, ...],
        command_timeout: float,
    ) -> None:
        self.path = path
        self._supervisor = supervisor
        self._publisher = publisher
        self._leases = leases
        self._engines = engines
        self._ingress = ingress
        self._token = token
        self._uids = {os.getuid(), *allowed_uids}
        self._command_timeout = command_timeout
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._exports: dict[tuple[int, int], local_pb2.ArenaHandle] = {}

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        _remove_stale(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is born 0600: no window where others can connect
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._tasks.add(asyncio.ensure_future(self._accept()))
        log.info("local_socket_listening", path=self.path)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            task = asyncio.ensure_future(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer = _Peer(next(self._ids), peer_uid(conn))
        try:
            if peer.uid not in self._uids:
                log.warning("local_peer_refused", uid=peer.uid)
                error = PermissionDenied("PEER_UID_REFUSED", f"uid {peer.uid} may not use this socket "
                                         "(run as the server's uid, or allow it with --local-allow-uid)", uid=peer.uid)
                await write_frame(loop, conn, _error(error))
                return
            while (payload := await read_frame(loop, conn)) is not None:
                request = local_pb2.LocalRequest()
                try:
                    request.ParseFromString(payload)
                    response, fds = await self._dispatch(peer, request)
                except WeightSyncError as error:
                    response, fds = _error(error), []
                except Exception as error:  # noqa: BLE001 - undecodable or a bug: a status, never a crash
                    log.warning("local_request_failed", error=repr(error))
                    response, fds = _error(InvalidArgument("MESSAGE_MALFORMED", f"request not understood: {error}")), []
                await write_frame(loop, conn, response, fds)
        except (LocalWireError, ConnectionError, OSError) as error:
            log.info("local_peer_gone", error=str(error))
        finally:
            conn.close()
            await self._leases.release_owner(peer.conn_id)
            if peer.engine_name and peer.leases:
                self._engines.unreachable(peer.engine_name, "disconnected while holding a version")

    async def _dispatch(self, peer: _Peer, request: local_pb2.LocalRequest) -> tuple[local_pb2.LocalResponse, list[int]]:
        kind = request.WhichOneof("request")
        if kind == "attach_store":
            return self._attach(peer, request.attach_store), []
        if peer.worker is None:
            raise FailedPrecondition("NOT_ATTACHED", "send attach_store first")
        if kind == "acquire_version":
            return await self._acquire(peer, request.acquire_version)
        if kind == "release_version":
            return await self._release(peer, request.release_version), []
        if kind == "open_ingress":
            return self._open_ingress()
        if kind == "get_status":
            worker = peer.worker
            return local_pb2.LocalResponse(get_status=local_pb2.GetStatusResponse(
                version=self._publisher.version.to_proto(),
                store_state=pb.STORE_STATE_LOST if worker.lost else worker.store.state)), []
        raise InvalidArgument("REQUEST_UNKNOWN", f"unknown local request {kind!r}")

    # -- requests -------------------------------------------------------------------
    def _attach(self, peer: _Peer, attach: local_pb2.AttachStoreRequest) -> local_pb2.LocalResponse:
        if self._token and not hmac.compare_digest(attach.token.encode(), self._token.encode()):
            raise Unauthenticated("TOKEN_INVALID", "missing or invalid token")
        if attach.engine_name and not ENGINE_NAME.match(attach.engine_name):
            raise InvalidArgument("ENGINE_NAME_INVALID", "engine_name must be 1 to 128 characters of [A-Za-z0-9._:-]")
        workers = self._supervisor.workers
        if attach.worker_index >= 0:
            if attach.worker_index >= len(workers):
                raise NotFound("WORKER_NOT_FOUND", f"no worker {attach.worker_index}; this server has {len(workers)}",
                               worker=attach.worker_index, workers=len(workers))
            worker = workers[attach.worker_index]
        else:
            worker = next((w for w in workers if w.device == (attach.device or "cpu")), None)
            if worker is None:
                raise NotFound("WORKER_NOT_FOUND", f"no worker on device {attach.device!r}",
                               device=attach.device, devices=",".join(w.device for w in workers))
        peer.worker = worker
        peer.engine_name = attach.engine_name
        if attach.engine_name:
            self._engines.register(attach.engine_name, "local", f"worker:{worker.index}")
        return local_pb2.LocalResponse(attach_store=local_pb2.AttachStoreResponse(
            worker_index=worker.index, device=worker.device, version=self._publisher.version.to_proto(),
            store_state=pb.STORE_STATE_LOST if worker.lost else worker.store.state))

    async def _acquire(self, peer: _Peer, acquire: local_pb2.AcquireVersionRequest):
        worker = peer.worker
        assert worker is not None
        wait = acquire.wait.ToTimedelta().total_seconds() if acquire.HasField("wait") else DEFAULT_WAIT_SECONDS
        lease = await self._leases.grant(worker.index, lambda: self._publisher.version.generation, peer.conn_id, wait)
        try:
            version = self._publisher.version
            if acquire.generation and acquire.generation != version.generation:
                raise FailedPrecondition("VERSION_GONE", f"generation {acquire.generation} is not held; the store "
                                         f"holds generation {version.generation}", generation=acquire.generation,
                                         current=version.generation)
            self._require_readable(worker)
            kept = worker.kept
            response = local_pb2.AcquireVersionResponse(lease_id=lease.lease_id, version=version.to_proto(),
                                                        tensors=kept.locations())
            fds: list[int] = []
            exported = await self._device_handles(worker) if not worker.host_memory else {}
            assert kept.layout is not None
            for arena in kept.layout.arenas:
                handle = response.arenas.add(arena_id=arena.arena_id, size_bytes=arena.size_bytes, fd_index=-1)
                if worker.host_memory:
                    handle.fd_index = len(fds)
                    fds.append(kept.fds[arena.arena_id])
                else:
                    handle.cuda.CopyFrom(exported[arena.arena_id].cuda)
        except BaseException:
            await self._leases.release(lease.lease_id, peer.conn_id)
            raise
        peer.leases[lease.lease_id] = version.generation
        if peer.engine_name:
            self._engines.applying(peer.engine_name)
        return local_pb2.LocalResponse(acquire_version=response), fds

    def _require_readable(self, worker: WorkerHandle) -> None:
        state = pb.STORE_STATE_LOST if worker.lost else worker.store.state
        if state in (pb.STORE_STATE_CONSISTENT, pb.STORE_STATE_UPDATING) and worker.kept.layout is not None \
                and worker.kept.tensors and not worker.kept.layout.dirty:
            return  # UPDATING here means a STAGED update: the live bytes are the committed version
        why = {
            pb.STORE_STATE_EMPTY: ("STORE_EMPTY", "the store holds no weights yet"),
            pb.STORE_STATE_LOST: ("STORE_LOST", "the worker died and its store was lost; a full update refills it"),
        }.get(state, ("STORE_INCONSISTENT", "an aborted IN_PLACE update left tensors half-written; a full update "
                                            "repairs the store"))
        raise FailedPrecondition(why[0], why[1], worker=worker.index, store_state=pb.StoreState.Name(state))

    async def _device_handles(self, worker: WorkerHandle) -> dict[int, local_pb2.ArenaHandle]:
        """CUDA IPC handles of a device store's arenas, asked of the worker once per arena."""
        assert worker.kept.layout is not None
        wanted = {a.arena_id for a in worker.kept.layout.arenas}
        if not all((worker.index, a) in self._exports for a in wanted):
            event = await self._supervisor.call(worker, self._command_timeout, export_store=wpb.ExportStoreCommand())
            for handle in event.store_exported.arenas:
                self._exports[(worker.index, handle.arena_id)] = handle
        return {a: self._exports[(worker.index, a)] for a in wanted}

    async def _release(self, peer: _Peer, release: local_pb2.ReleaseVersionRequest) -> local_pb2.LocalResponse:
        generation = peer.leases.pop(release.lease_id, None)
        lease = await self._leases.release(release.lease_id, peer.conn_id)
        if lease is None or generation is None:
            raise NotFound("LEASE_NOT_FOUND", f"no lease {release.lease_id} on this connection", lease=release.lease_id)
        if peer.engine_name:
            if release.error:
                self._engines.failed(peer.engine_name, release.error)
            elif release.applied and generation == self._publisher.version.generation:
                self._engines.applied(peer.engine_name, self._publisher.version)
        return local_pb2.LocalResponse(release_version=local_pb2.ReleaseVersionResponse())

    def _open_ingress(self) -> tuple[local_pb2.LocalResponse, list[int]]:
        if self._ingress is None:
            raise FailedPrecondition("INGRESS_DISABLED", "this server has no ingress (--ingress-slot-bytes 0)")
        response = local_pb2.OpenIngressResponse(slot_bytes=self._ingress.slot_bytes,
                                                 slot_count=self._ingress.slot_count)
        return local_pb2.LocalResponse(open_ingress=response), [self._ingress.fd]


def _error(error: WeightSyncError) -> local_pb2.LocalResponse:
    return local_pb2.LocalResponse(error=local_pb2.LocalError(
        code=code_number(error.code), reason=error.reason, message=error.message, metadata=error.metadata))


def _remove_stale(path: str) -> None:
    """Remove a socket file nobody listens on (a previous server that was killed); never anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another server listens on {path}")
