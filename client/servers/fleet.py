"""The client's servers as a push sees them: each one's channel and its record, in the order given.

The rules that span the servers live here, over their records (records.py): a server whose
SHM local socket hung up went stale; when any went stale, every server is asked again (one
GetServerInfo to each, at once) and every SHM ingress is unmapped, to be mapped again from the
server as it is now.
"""

from __future__ import annotations

from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.revision import spoken
from weightsync.client.channels.server_set import ServerSet
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.servers.records import ServerState, ShmIngress
from weightsync.client.transports.shm import ShmSink
from weightsync.client.transports.shm_lease import open_ingress
from weightsync.v1 import weight_sync_service_pb2 as pb


class Fleet:
    """One ServerState per server of a ServerSet, in its order."""

    def __init__(self, servers: ServerSet) -> None:
        self.servers = servers
        self.states = [ServerState(server) for server in servers.servers]

    def infos(self) -> list[pb.GetServerInfoResponse]:
        """Each server's last GetServerInfo; every server is asked when one never was (its errors raised)."""
        if any(state.info is None for state in self.states):
            self._ask()
        return [state.info for state in self.states]  # type: ignore[misc]

    def answered(self) -> list[ServerState]:
        """Every record, each with its GetServerInfo (every server is asked when one never was)."""
        self.infos()
        return self.states

    def ask_again_if_stale(self) -> None:
        """Once a push, before anything else: see the module docstring. A server that does not answer
        keeps its last answer, and the push fails on its own terms (typed, naming the server) rather
        than on this query."""
        for state in self.states:
            if state.hung_up():
                state.went_stale()  # the SHM server exited since the last push: restarted, or gone
        if not any(state.stale for state in self.states):
            return
        try:
            self._ask()
        except WeightSyncRpcError:
            pass
        self.unmap()  # mapped from the server as it was: one restarted since has another

    def shm_sink(self, loop: LoopThread) -> ShmSink:
        """The SHM sink of the one server (same host), its ingress mapped on first use."""
        if len(self.states) != 1:
            raise WeightSyncClientError("SHM pushes to one server, on this host; use transport='inline' for several")
        state = self.states[0]
        if state.ingress is None:
            info = self.infos()[0]
            lease = open_ingress(state.address, info.local_socket, self.servers.token)
            try:
                sink = ShmSink(loop, lease.fd, lease.slot_bytes, lease.slot_count, self.servers.timeout,
                               open_arenas=lambda ids: lease.open_arenas(state.address, ids))
            except BaseException:
                lease.close()
                raise
            state.mapped(ShmIngress(lease, sink))
        assert state.ingress is not None
        return state.ingress.sink

    def unmap(self) -> None:
        """Unmap every SHM ingress and leave the local sockets; the next SHM push maps them again."""
        for state in self.states:
            state.unmapped()

    def by_address(self, address: str) -> ServerState:
        return next(state for state in self.states if state.address == address)

    def _ask(self) -> None:
        answers = self.servers.each("GetServerInfo", pb.GetServerInfoRequest())
        for state, (_, info) in zip(self.states, spoken(self.servers.addresses, answers), strict=True):
            state.answered(info)
