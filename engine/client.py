"""The engine's connection to the node's weightsync server (its local socket).

`EngineClient` attaches to the worker store on the engine's device. `acquire()`
returns a `StoreSnapshot`: the committed version, pinned by a lease until
released, with every tensor as a read-only view into the mapped store (host
memory: the arenas' descriptors, mapped MAP_SHARED, PROT_READ; CUDA: IPC
handles, same GPU). Nothing is copied until the engine copies it into its own
model; releasing says whether the engine now serves that version, which the
server reports in GetServerInfo.engines and WatchWeights.
"""

from __future__ import annotations

import datetime
import mmap
import os
import warnings
from dataclasses import dataclass, field

import grpc
import torch

from weightsync.common import dtypes
from weightsync.common.errors import status_code
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
    inode: int
    data: torch.Tensor
    mapping: mmap.mmap | None


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

    @property
    def generation(self) -> int:
        return self.version.generation

    def changed_since(self, generation: int) -> list[str]:
        """Names written after `generation` (-1: every tensor), sorted."""
        return sorted(n for n, g in self.written.items() if g > generation or generation < 0)

    def release(self, *, applied: bool, error: str = "") -> None:
        if not self.released:
            self.released = True
            self.client._release(self.lease_id, applied=applied, error=error)

    def __enter__(self) -> StoreSnapshot:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.release(applied=self.applied and kind is None, error="" if kind is None else f"{kind.__name__}: {value}")


class EngineClient:
    """Attach to the worker store on a device, read versions, report what is served."""

    def __init__(
        self,
        *,
        server: str | None = None,
        socket_path: str | None = None,
        name: str = "engine",
        device: str = "cpu",
        worker: int = -1,
        token: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        """server: the node's gRPC address (its local socket is looked up with GetServerInfo), or
        socket_path: the local socket itself. worker: an index, or -1 for the first on `device`."""
        if socket_path is None:
            if server is None:
                raise ValueError("give server (host:port) or socket_path")
            socket_path = _local_socket_of(server, token, timeout)
        self.socket_path = socket_path
        self.name = name
        self._connection = LocalConnection(socket_path, timeout)
        self._mapped: dict[int, _Mapped] = {}
        attached = self._request(attach_store=local_pb2.AttachStoreRequest(
            engine_name=name, worker_index=worker, device=device, token=token or ""))[0].attach_store
        self.worker_index = attached.worker_index
        self.device = attached.device

    # -- requests --------------------------------------------------------------------
    def _request(self, **kwargs) -> tuple[local_pb2.LocalResponse, list[int]]:
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
        request = local_pb2.AcquireVersionRequest(generation=generation)
        request.wait.FromTimedelta(datetime.timedelta(seconds=wait))
        response, fds = self._request(acquire_version=request)
        acquired = response.acquire_version
        try:
            arenas = {a.arena_id: self._map(a, fds) for a in acquired.arenas}
        except BaseException:
            close_fds(fds)
            self._release(acquired.lease_id, applied=False, error="could not map the store")
            raise
        close_fds(fds)  # mapped: the descriptors are not needed any more
        tensors = {t.name: _view(arenas[t.arena_id], t) for t in acquired.tensors}
        written = {t.name: t.written_generation for t in acquired.tensors}
        return StoreSnapshot(self, acquired.lease_id, acquired.version, tensors, written)

    def _release(self, lease_id: int, *, applied: bool, error: str) -> None:
        self._request(release_version=local_pb2.ReleaseVersionRequest(lease_id=lease_id, applied=applied,
                                                                      error=error[:2000]))

    # -- mapping ------------------------------------------------------------------------
    def _map(self, arena: local_pb2.ArenaHandle, fds: list[int]) -> torch.Tensor:
        if arena.fd_index < 0:
            return _open_cuda(arena)
        fd = fds[arena.fd_index]
        inode = os.fstat(fd).st_ino  # a restarted store may reuse arena ids, never memfd inodes
        known = self._mapped.get(arena.arena_id)
        if known is not None and known.inode == inode:
            return known.data
        mapping = mmap.mmap(fd, arena.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # read-only on purpose: torch warns that it cannot write
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mapping, dtype=torch.uint8)
        self._mapped[arena.arena_id] = _Mapped(inode, data, mapping)
        return data

    def close(self) -> None:
        self._connection.close()
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


def _open_cuda(arena: local_pb2.ArenaHandle) -> torch.Tensor:
    """Map a CUDA worker's arena through its IPC handle (same GPU, another process)."""
    cuda = arena.cuda
    storage = torch.UntypedStorage._new_shared_cuda(  # noqa: SLF001 - torch's own IPC entry point
        cuda.device, cuda.handle, cuda.allocation_size_bytes, cuda.offset_bytes, cuda.ref_counter_handle,
        cuda.ref_counter_offset, cuda.event_handle or None, cuda.event_sync_required,
    )
    data = torch.empty(0, dtype=torch.uint8, device=f"cuda:{cuda.device}").set_(storage)
    return data[: arena.size_bytes]


def _local_socket_of(server: str, token: str | None, timeout: float) -> str:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(server) as channel:
        info = pb_grpc.WeightSyncServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata,
                                                                    timeout=timeout)
    if not info.local_socket:
        raise EngineError("LOCAL_SOCKET_DISABLED", f"{server} has no local socket (--local-socket)")
    return info.local_socket
