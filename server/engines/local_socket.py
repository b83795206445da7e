"""The local hand-off: engines and same-host trainers map the node's memory.

A unix stream socket (weightsync/v1/local.proto for the messages, common/
local_wire.py for the framing). Only peers with the server's uid (or one
allowed with --local-allow-uid) are served, checked with SO_PEERCRED; the
socket file itself is 0600. An engine attaches, then acquires the current
version (a lease, see server/store/leases.py): it gets the node store's arenas as read-only
descriptors, and every tensor's place in them; it copies what changed into its
model (a CUDA engine: host to device) and releases, saying whether it now serves
that version. Every engine process of the node, every tensor-parallel rank,
reads the same one store. An SHM trainer opens the ingress instead, and the
arenas it writes its buckets into when it writes them straight into the store
(open_store, read-write: server/store/writes.py).

The token is read from the server's Credentials at every check, never
copied: after a SIGHUP rotation the new token attaches and the old one is
refused, here as on gRPC. A connection attached with the old token is
refused at its next request (but release_version, which only gives back).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import itertools
import os
import re
import socket
import stat
from dataclasses import dataclass, field

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
from weightsync.common.local_wire import MAX_FDS, LocalWireError, read_frame, write_frame
from weightsync.common.logging import get_logger
from weightsync.server.credentials import Credentials
from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.published.publisher import Publisher
from weightsync.server.store.ingress import Ingress
from weightsync.server.store.leases import LeaseTable
from weightsync.server.store.node_store import NodeStore
from weightsync.v1 import local_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.local")

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
DEFAULT_WAIT_SECONDS = 30.0
ACCEPT_RETRY_SECONDS = (0.05, 0.2, 1.0)
"""accept() failing (out of descriptors, ...): wait this long, then the next, and try again."""


@dataclass(slots=True)
class _Peer:
    """One connection's state."""

    conn_id: int
    uid: int
    attached: bool = False
    engine_name: str = ""
    presented: str = field(default="", repr=False)
    """The token this peer attached with, checked again at each request (the server's may rotate)."""


class LocalHandoff:
    def __init__(
        self,
        path: str,
        *,
        store: NodeStore,
        publisher: Publisher,
        leases: LeaseTable,
        engines: EngineRegistry,
        ingress: Ingress | None,
        credentials: Credentials,
        allowed_uids: tuple[int, ...],
    ) -> None:
        self.path = path
        self._store = store
        self._publisher = publisher
        self._leases = leases
        self._engines = engines
        self._ingress = ingress
        self._credentials = credentials
        self._uids = {os.getuid(), *allowed_uids}
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

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
        self._track(asyncio.ensure_future(self._accept()))
        log.info("local_socket_listening", path=self.path)

    async def stop(self) -> None:
        """Stop accepting, end every connection, remove the socket file. Never raises: the
        server's shutdown goes on to the workers whatever happened here."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("local_task_failed", error=repr(result))
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        log.info("local_socket_closed", path=self.path)

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug: say so, never silently
            log.error("local_task_died", error=repr(task.exception()))

    async def _accept(self) -> None:
        """Accept connections until stopped; a failing accept (EMFILE, ...) is logged and retried."""
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        failures = 0
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as error:
                delay = ACCEPT_RETRY_SECONDS[min(failures, len(ACCEPT_RETRY_SECONDS) - 1)]
                failures += 1
                log.error("local_accept_failed", error=str(error), retry_seconds=delay, failures=failures)
                await asyncio.sleep(delay)
                continue
            failures = 0
            conn.setblocking(False)
            self._track(asyncio.ensure_future(self._serve(conn)))

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
            held = self._leases.held_by(peer.conn_id)
            await self._leases.release_owner(peer.conn_id)
            if peer.engine_name:
                self._engines.detached(peer.engine_name, holding=bool(held))

    async def _dispatch(self, peer: _Peer, request: local_pb2.LocalRequest) -> tuple[local_pb2.LocalResponse, list[int]]:
        kind = request.WhichOneof("request")
        if kind == "attach_store":
            return await self._attach(peer, request.attach_store), []
        if not peer.attached:
            raise FailedPrecondition("NOT_ATTACHED", "send attach_store first")
        if kind != "release_version":  # giving a lease back needs no credentials
            self._check_token(peer.presented, "the server's token changed since this connection attached; "
                                              "attach again with the new token")
        if kind == "acquire_version":
            return await self._acquire(peer, request.acquire_version)
        if kind == "release_version":
            return await self._release(peer, request.release_version), []
        if kind == "open_ingress":
            return self._open_ingress()
        if kind == "open_store":
            return self._open_store(request.open_store)
        if kind == "get_status":
            return local_pb2.LocalResponse(get_status=local_pb2.GetStatusResponse(
                version=self._publisher.version.to_proto(), store_state=self._store.state)), []
        raise InvalidArgument("REQUEST_UNKNOWN", f"unknown local request {kind!r}")

    # -- requests -------------------------------------------------------------------
    def _check_token(self, presented: str, message: str = "missing or invalid token") -> None:
        token = self._credentials.token  # read now: SIGHUP may have replaced it
        if token and not hmac.compare_digest(presented.encode(), token.encode()):
            raise Unauthenticated("TOKEN_INVALID", message)

    async def _attach(self, peer: _Peer, attach: local_pb2.AttachStoreRequest) -> local_pb2.LocalResponse:
        self._check_token(attach.token)
        if attach.engine_name and not ENGINE_NAME.match(attach.engine_name):
            raise InvalidArgument("ENGINE_NAME_INVALID", "engine_name must be 1 to 128 characters of [A-Za-z0-9._:-]")
        if attach.engine_name != peer.engine_name:  # attached again under another name: one connection, one name
            if peer.engine_name:
                self._engines.detached(peer.engine_name, holding=bool(self._leases.held_by(peer.conn_id)))
            if attach.engine_name:
                self._engines.attached(attach.engine_name, "local", "node-store")
        peer.attached = True
        peer.engine_name = attach.engine_name
        peer.presented = attach.token
        return local_pb2.LocalResponse(attach_store=local_pb2.AttachStoreResponse(
            version=self._publisher.version.to_proto(), store_state=self._store.state))

    async def _acquire(self, peer: _Peer, acquire: local_pb2.AcquireVersionRequest):
        wait = acquire.wait.ToTimedelta().total_seconds() if acquire.HasField("wait") else DEFAULT_WAIT_SECONDS
        lease = await self._leases.grant(lambda: self._publisher.version, peer.conn_id, wait)
        try:
            # Read in the same step as the grant: the store's layout and the lease's version agree.
            version = lease.version
            if acquire.generation > version.generation:  # never committed here (yet): not gone
                raise FailedPrecondition("VERSION_NOT_COMMITTED", f"generation {acquire.generation} is not committed; "
                                         f"the store holds generation {version.generation} (a later one, or one of "
                                         "the store before this server started)", generation=acquire.generation,
                                         current=version.generation)
            if acquire.generation and acquire.generation != version.generation:
                raise FailedPrecondition("VERSION_GONE", f"generation {acquire.generation} is not held; the store "
                                         f"holds generation {version.generation}", generation=acquire.generation,
                                         current=version.generation)
            self._require_readable()
            store = self._store
            response = local_pb2.AcquireVersionResponse(lease_id=lease.lease_id, version=version.to_proto(),
                                                        tensors=store.locations())
            fds: list[int] = []
            for arena_id in store.live_arena_ids():
                arena = store.arena(arena_id)
                response.arenas.add(arena_id=arena_id, size_bytes=arena.size_bytes, fd_index=len(fds))
                fds.append(arena.fd)
        except BaseException:
            await self._leases.release(lease.lease_id, peer.conn_id)
            raise
        if peer.engine_name:
            self._engines.applying(peer.engine_name)
        return local_pb2.LocalResponse(acquire_version=response), fds

    def _require_readable(self) -> None:
        store = self._store
        if store.readable():
            return  # an UPDATING store here runs a STAGED update: the live bytes are the committed version
        state = store.state
        if not store.tensors:  # nothing committed yet, even while the first update (UPDATING) writes
            raise FailedPrecondition("STORE_EMPTY", "the store holds no weights yet",
                                     store_state=pb.StoreState.Name(state))
        raise FailedPrecondition("STORE_INCONSISTENT", "an aborted IN_PLACE update left tensors half-written; a "
                                 "full update repairs the store", store_state=pb.StoreState.Name(state))

    async def _release(self, peer: _Peer, release: local_pb2.ReleaseVersionRequest) -> local_pb2.LocalResponse:
        lease = await self._leases.release(release.lease_id, peer.conn_id)
        if lease is None:
            raise NotFound("LEASE_NOT_FOUND", f"no lease {release.lease_id} on this connection", lease=release.lease_id)
        if peer.engine_name:
            if release.error:
                self._engines.failed(peer.engine_name, release.error)
            elif release.applied:
                self._engines.applied(peer.engine_name, lease.version)  # the version it read, even if a newer one exists
            else:
                self._engines.not_applied(peer.engine_name)  # looked, kept what it serves: no longer APPLYING
        return local_pb2.LocalResponse(release_version=local_pb2.ReleaseVersionResponse())

    def _open_ingress(self) -> tuple[local_pb2.LocalResponse, list[int]]:
        if self._ingress is None:
            raise FailedPrecondition("INGRESS_DISABLED", "this server has no ingress (--ingress-slot-bytes 0)")
        response = local_pb2.OpenIngressResponse(slot_bytes=self._ingress.slot_bytes,
                                                 slot_count=self._ingress.slot_count)
        return local_pb2.LocalResponse(open_ingress=response), [self._ingress.fd]


    def _open_store(self, request: local_pb2.OpenStoreRequest) -> tuple[local_pb2.LocalResponse, list[int]]:
        """Arenas of the store, read-write, for an SHM trainer that writes its buckets straight into them
        (server/store/writes.py): the same uid, and the token, as the ingress needs."""
        wanted = list(dict.fromkeys(request.arena_ids))
        if len(wanted) > MAX_FDS:
            raise InvalidArgument("ARENA_IDS_TOO_MANY", f"{len(wanted)} arenas asked for at once; at most {MAX_FDS}",
                                  count=len(wanted), limit=MAX_FDS)
        held = self._store.arena_ids()
        response = local_pb2.OpenStoreResponse(store_arena_ids=held)
        fds: list[int] = []
        for arena_id in wanted:
            if arena_id not in held:
                raise NotFound("ARENA_NOT_FOUND", f"the store holds no arena {arena_id} (any more): ask again after "
                               "the next ready", arena=arena_id)
            arena = self._store.arena(arena_id)
            response.arenas.add(arena_id=arena_id, size_bytes=arena.size_bytes, fd_index=len(fds))
            fds.append(arena.fd)
        return local_pb2.LocalResponse(open_store=response), fds


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
