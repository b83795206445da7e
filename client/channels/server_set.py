"""The SDK's channels to its servers, and the calls every other part makes through them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.wire import update_weights_call
from weightsync.client.errors import WeightSyncRpcError
from weightsync.client.types import TlsConfig
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

KEEPALIVE_SECONDS = 20.0
"""A ping on a connection with calls in flight after this much silence; a connection whose ping is not
answered within min(client timeout, this) is closed and its calls fail UNAVAILABLE, naming the server.
Not shorter: a server with gRPC's default ping policy answers pings more often than every few seconds
with GOAWAY too_many_pings. gRPC sends at most two pings while the client itself sends no data, so an
idle channel stays quiet."""


def channel_options(max_message_bytes: int, timeout: float) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(KEEPALIVE_SECONDS * 1000)),
        ("grpc.keepalive_timeout_ms", int(min(timeout, KEEPALIVE_SECONDS) * 1000)),
    ]


@dataclass(slots=True)
class Server:
    """One server's channel and stubs (what the SDK knows of it: servers.records.ServerState)."""

    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WeightSyncServiceStub
    update_weights: grpc.aio.StreamStreamMultiCallable
    """UpdateWeights taking pre-encoded chunks too (wire.py)."""


class ServerSet:
    """One channel per server, on the SDK's loop; calls carry the token and extra metadata."""

    def __init__(self, loop: LoopThread, addresses: list[str], *, tls: TlsConfig | None, metadata: tuple,
                 timeout: float, max_message_bytes: int) -> None:
        self.loop = loop
        self.metadata = metadata
        self.timeout = timeout
        self.servers: list[Server] = loop.run(self._open(addresses, tls, max_message_bytes))

    async def _open(self, addresses: list[str], tls: TlsConfig | None, max_message_bytes: int) -> list[Server]:
        options = channel_options(max_message_bytes, self.timeout)
        out = []
        for address in addresses:
            if tls is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=_read(tls.ca_cert),
                    private_key=_read(tls.client_key),
                    certificate_chain=_read(tls.client_cert),
                )
                opts = options + ([("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else [])
                channel = grpc.aio.secure_channel(address, creds, options=opts)
            out.append(Server(address, channel, pb_grpc.WeightSyncServiceStub(channel), update_weights_call(channel)))
        return out

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    @property
    def token(self) -> str | None:
        return next((v.removeprefix("Bearer ") for k, v in self.metadata if k == "authorization"), None)

    async def unary(self, server: Server, method: str, request, timeout: float | None = None):
        try:
            return await getattr(server.stub, method)(request, metadata=self.metadata, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as error:
            raise WeightSyncRpcError.from_rpc(server.address, error) from None

    def each(self, method: str, request, timeout: float | None = None, servers: Sequence[Server] | None = None) -> list:
        """The same call on every server (or the given ones), at once; the first error is raised."""
        async def run():
            return await asyncio.gather(*(self.unary(s, method, request, timeout) for s in servers or self.servers))

        return list(self.loop.run(run()))

    def close(self) -> None:
        async def close_all():
            await asyncio.gather(*(s.channel.close() for s in self.servers))

        self.loop.run(close_all(), timeout=10)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as handle:
        return handle.read()
