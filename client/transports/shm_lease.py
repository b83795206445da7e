"""The SHM transport's side door: map the server's ingress, and the store's arenas an SHM trainer writes
buckets into (client/transports/store_writes.py), over its local socket."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.common.errors import status_code
from weightsync.common.local_wire import LocalConnection, close_fds
from weightsync.v1 import local_pb2


@dataclass(slots=True)
class IngressLease:
    """The ingress descriptor and its slots; keeps the local connection open while used."""

    fd: int
    slot_bytes: int
    slot_count: int
    connection: LocalConnection

    def open_arenas(self, server: str, arena_ids: Sequence[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
        """The store's arenas `arena_ids` to map read-write: (arena id, size, descriptor) each, the descriptors
        now the caller's; and every arena the store holds now."""
        request = local_pb2.LocalRequest(open_store=local_pb2.OpenStoreRequest(arena_ids=list(arena_ids)))
        response, fds = self.connection.request(request)
        opened = _expect(server, response, fds, "open_store")
        return ([(a.arena_id, a.size_bytes, fds[a.fd_index]) for a in opened.arenas],
                list(opened.store_arena_ids))

    def close(self) -> None:
        self.connection.close()


def open_ingress(server: str, socket_path: str, token: str | None) -> IngressLease:
    """Attach to the server's local socket (same host only) and get its ingress memory."""
    if not socket_path:
        raise WeightSyncClientError(f"{server} offers no local socket: SHM needs one (--local-socket)")
    try:
        connection = LocalConnection(socket_path)
    except OSError as error:
        raise WeightSyncClientError(
            f"SHM needs this process on {server}'s host: its local socket {socket_path} is not reachable ({error}); "
            "use transport='inline' or 'collective'"
        ) from error
    try:
        attach = local_pb2.LocalRequest(attach_store=local_pb2.AttachStoreRequest(token=token or ""))
        _expect(server, *connection.request(attach), "attach_store")
        response, fds = connection.request(local_pb2.LocalRequest(open_ingress=local_pb2.OpenIngressRequest()))
        opened = _expect(server, response, fds, "open_ingress")
        return IngressLease(fds[0], opened.slot_bytes, opened.slot_count, connection)
    except BaseException:
        connection.close()
        raise


def _expect(server: str, response: local_pb2.LocalResponse, fds: list[int], kind: str):
    if response.WhichOneof("response") == "error":
        close_fds(fds)
        e = response.error
        raise WeightSyncRpcError(server, status_code(e.code), e.reason, e.message, dict(e.metadata))
    return getattr(response, kind)
