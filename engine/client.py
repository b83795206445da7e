"""The engine's connection to the node's weightsync server (its local socket).

`EngineClient` attaches to the node's store: one store per node, in host memory the
server keeps, which every engine process of the node (every tensor-parallel rank of
vLLM included) maps read-only and loads what it needs from with its own loader.
`acquire()` returns a `StoreSnapshot`: the committed version, pinned by a lease until
released, with every tensor as a read-only view into the mapped store (the arenas'
descriptors, mapped MAP_SHARED, PROT_READ). Nothing is copied until the engine copies it
into its own model; releasing says whether the engine now serves that version, which the
server reports in GetServerInfo.engines and WatchWeights.

Arenas are mapped once and kept (an arena id is never reused in a server's life); a CUDA
engine (device="cuda:N") also pins each mapping for the device's DMA engines, so copies
to the GPU are asynchronous and at full speed. Releasing first waits for every copy this
process queued on its device: an IN_PLACE update may overwrite the store's bytes as soon
as the lease is gone.
"""

from __future__ import annotations

import datetime
import mmap
import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
import torch

from weightsync.common import dtypes
from weightsync.common.errors import error_info, status_code
from weightsync.common.host_pinning import READ_ONLY, pin_host, unpin_host
from weightsync.common.local_wire import LocalConnection, close_fds
from weightsync.v1 import local_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc


class EngineError(Exception):
    """The server refused, or the engine cannot apply what it got. `reason` is machine-readable."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION,
                 metadata: dict[str, str] | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.code = code
        self.metadata = metadata or {}


@dataclass(slots=True)
class _Mapped:
    identity: tuple
    """What makes it the same memory: the arena's inode (memfd inodes are not reused while mapped)."""
    data: torch.Tensor
    mapping: mmap.mmap
    pinned: list[int] = field(default_factory=list)

    def close(self) -> None:
        unpin_host(self.pinned)
        self.pinned = []


def devices_to_synchronize(devices: Iterable[torch.device]) -> list[torch.device]:
    """The CUDA devices whose queued work must finish before a lease goes, sorted: the engine's own
    (its copies from the pinned store run there, asynchronously). Host copies are synchronous."""
    return sorted({d for d in devices if d.type == "cuda"}, key=lambda d: d.index or 0)


def synchronize_devices(devices: Iterable[torch.device]) -> None:
    for device in devices_to_synchronize(devices):
        torch.cuda.synchronize(device)  # every stream of this process on that device


@dataclass(slots=True)
class StoreSnapshot:
    """One committed version, pinned until released. Use as a context manager."""

    client: EngineClient
    lease_id: int
    version: pb.WeightVersion
    tensors: dict[str, torch.Tensor]
    """Read-only views of every tensor of the store, by name."""
    written: dict[str, int]
    """Name -> generation of the commit that last wrote the tensor."""
    released: bool = False
    applied: bool = field(default=False, repr=False)
    devices: frozenset[torch.device] = frozenset()
    """The engine's CUDA device, if any: release() waits for this process's work there first."""

    @property
    def generation(self) -> int:
        return self.version.generation

    def changed_since(self, generation: int) -> list[str]:
        """Names written after `generation` (-1: every tensor), sorted."""
        return sorted(n for n, g in self.written.items() if g > generation or generation < 0)

    def release(self, *, applied: bool, error: str = "") -> None:
        """Give the version back. First waits until every copy queued from the store's bytes (on a
        GPU: asynchronous) has finished: once released, an IN_PLACE update may overwrite them."""
        if self.released:
            return
        self.released = True
        try:
            synchronize_devices(self.devices)
        except Exception as failure:  # noqa: BLE001 - a broken device: release anyway, saying so
            applied = False
            error = error or f"DEVICE_SYNC_FAILED: {type(failure).__name__}: {failure}"
        self.client._release(self.lease_id, applied=applied, error=error)

    def __enter__(self) -> StoreSnapshot:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.release(applied=self.applied and kind is None, error="" if kind is None else f"{kind.__name__}: {value}")


WORKER_DEPRECATED = ("EngineClient(worker=...) is deprecated and ignored: the node has one store, which every "
                     "engine reads; drop the argument (a later release removes it)")


class EngineClient:
    """Attach to the node's store, read versions, report what is served."""

    def __init__(
        self,
        *,
        server: str | None = None,
        socket_path: str | None = None,
        name: str = "engine",
        device: str = "cpu",
        worker: int | None = None,
        token: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        """server: the node's gRPC address (its local socket is looked up with GetServerInfo), or
        socket_path: the local socket itself. device: where this engine copies the weights ("cpu",
        "cuda:N" in this process's numbering): a CUDA engine pins the mapped store and waits for its
        copies before a release. worker: deprecated and ignored (servers before 0.3 kept one replica
        per worker; the node now has one store, which every engine reads): passing it warns with a
        DeprecationWarning, and a later release drops it."""
        if worker is not None:
            warnings.warn(WORKER_DEPRECATED, DeprecationWarning, stacklevel=2)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError("DEVICE_UNAVAILABLE", f"this process has no CUDA device {device!r}",
                              metadata={"device": device})
        if socket_path is None:
            if server is None:
                raise ValueError("give server (host:port) or socket_path")
            socket_path = _local_socket_of(server, token, timeout)
        self.socket_path = socket_path
        self.name = name
        self._connection = LocalConnection(socket_path, timeout)
        self._requests = threading.RLock()
        """One request (and one acquire's mapping) at a time: a vLLM rank stages in a thread of its own."""
        self._mapped: dict[int, _Mapped] = {}
        try:
            self._request(attach_store=local_pb2.AttachStoreRequest(engine_name=name, token=token or ""))
        except BaseException:
            self._connection.close()
            raise

    # -- requests --------------------------------------------------------------------
    def _request(self, **kwargs) -> tuple[local_pb2.LocalResponse, list[int]]:
        with self._requests:
            response, fds = self._connection.request(local_pb2.LocalRequest(**kwargs))
        if response.WhichOneof("response") == "error":
            close_fds(fds)
            e = response.error
            raise EngineError(e.reason, e.message, status_code(e.code), dict(e.metadata))
        return response, fds

    def status(self) -> local_pb2.GetStatusResponse:
        """The current version and store state (cheap: no lease, no layout)."""
        return self._request(get_status=local_pb2.GetStatusRequest())[0].get_status

    def acquire(self, *, generation: int = 0, wait: float = 30.0) -> StoreSnapshot:
        """Pin the committed version (0: the current one) and map it."""
        with self._requests:
            return self._acquire(generation, wait)

    def _acquire(self, generation: int, wait: float) -> StoreSnapshot:
        request = local_pb2.AcquireVersionRequest(generation=generation)
        request.wait.FromTimedelta(datetime.timedelta(seconds=wait))
        response, fds = self._request(acquire_version=request)
        acquired = response.acquire_version
        try:
            arenas = {a.arena_id: self._map(a, fds) for a in acquired.arenas}
            self._forget_unlisted(arenas)
            tensors = {t.name: _view(arenas[t.arena_id], t) for t in acquired.tensors}
        except BaseException as error:
            close_fds(fds)
            self._release(acquired.lease_id, applied=False, error=f"could not map the store: {error}")
            raise
        close_fds(fds)  # mapped: the descriptors are not needed any more
        written = {t.name: t.written_generation for t in acquired.tensors}
        devices = frozenset({self.device}) if self.device.type == "cuda" else frozenset()
        return StoreSnapshot(self, acquired.lease_id, acquired.version, tensors, written, devices=devices)

    def _release(self, lease_id: int, *, applied: bool, error: str) -> None:
        self._request(release_version=local_pb2.ReleaseVersionRequest(lease_id=lease_id, applied=applied,
                                                                      error=error[:2000]))

    # -- mapping ------------------------------------------------------------------------
    def _map(self, arena: local_pb2.ArenaHandle, fds: list[int]) -> torch.Tensor:
        """The arena's bytes, mapped once per memory: a later acquire of the same arena reuses the mapping."""
        if not 0 <= arena.fd_index < len(fds):
            raise EngineError("ANSWER_MALFORMED", f"arena {arena.arena_id} names descriptor {arena.fd_index} of "
                              f"{len(fds)}")
        identity = ("host", os.fstat(fds[arena.fd_index]).st_ino)
        known = self._mapped.get(arena.arena_id)
        if known is not None and known.identity == identity:
            return known.data
        old = self._mapped.pop(arena.arena_id, None)
        if old is not None:
            old.close()
        mapping = mmap.mmap(fds[arena.fd_index], arena.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # read-only on purpose: torch warns that it cannot write
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mapping, dtype=torch.uint8)
        # Faulted in first (MADV_POPULATE_READ): cudaHostRegister faulting them itself ran ~10x slower.
        pinned = pin_host(data, READ_ONLY, prefault=True) if self.device.type == "cuda" else []
        self._mapped[arena.arena_id] = _Mapped(identity, data, mapping, pinned)
        return data

    def _forget_unlisted(self, listed: dict[int, torch.Tensor]) -> None:
        """Drop mappings of arenas the store no longer lists."""
        for arena_id in [a for a in self._mapped if a not in listed]:
            self._mapped.pop(arena_id).close()

    def close(self) -> None:
        self._connection.close()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()  # mappings go with the last view

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _view(arena: torch.Tensor, t: local_pb2.StoredTensorLocation) -> torch.Tensor:
    dtype = dtypes.to_torch(t.dtype, tensor=t.name)
    if t.size_bytes == 0:
        return torch.empty(tuple(t.shape), dtype=dtype, device=arena.device)
    return arena[t.offset_bytes : t.offset_bytes + t.size_bytes].view(dtype).view(tuple(t.shape))


def _local_socket_of(server: str, token: str | None, timeout: float) -> str:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        with grpc.insecure_channel(server) as channel:
            info = pb_grpc.WeightSyncServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(),
                                                                        metadata=metadata, timeout=timeout)
    except grpc.RpcError as error:
        raise _engine_error(server, error) from None
    if not info.local_socket:
        raise EngineError("LOCAL_SOCKET_DISABLED", f"{server} has no local socket (--local-socket)")
    return info.local_socket


def _engine_error(server: str, error: grpc.RpcError) -> EngineError:
    """A refused gRPC call as an EngineError: its code, and the ErrorInfo reason and metadata."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    reason, metadata = error_info(error)
    if not reason:
        reason = "SERVER_UNREACHABLE" if code == grpc.StatusCode.UNAVAILABLE else code.name
    return EngineError(reason, f"{server}: {code.name}: {details}", code, metadata)
