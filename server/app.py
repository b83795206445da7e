"""Assemble and run the server: servicer, health (and its plaintext port), reflection, interceptor,
metrics, signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from weightsync.common.address import parse_address
from weightsync.common.logging import get_logger, log_loop_exception
from weightsync.server.config import ServerConfig
from weightsync.server.credentials import Credentials
from weightsync.server.metrics import Metrics
from weightsync.server.node import SERVICE_NAME, FleetFactory, Node
from weightsync.server.rpc.interceptors import EdgeInterceptor
from weightsync.server.rpc.reflection import enable_reflection
from weightsync.server.rpc.service import WeightSyncServicer
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

log = get_logger("weightsync.server")


def _configure_reflection(server: grpc.aio.Server) -> None:
    enable_reflection(server, (
        pb.DESCRIPTOR.services_by_name["WeightSyncService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    ))


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as error:  # grpc: "Failed to bind to address ..." (in use, not local, ...)
        raise OSError(f"could not bind {address} (address in use or not available)") from error
    if port == 0:
        raise OSError(f"could not bind {address}")
    return port


@dataclass(slots=True)
class Assembled:
    """Everything serve() runs: the gRPC server, its parts, and the side ports."""

    server: grpc.aio.Server
    node: Node
    port: int
    credentials: Credentials
    metrics: Metrics
    health_server: grpc.aio.Server | None = None
    health_port: int = 0
    metrics_port: int = 0


def build_server(config: ServerConfig, fleet: FleetFactory | None = None) -> Assembled:
    """The gRPC server and its node; `fleet` replaces the worker processes (Node)."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    credentials = Credentials(config)
    metrics = Metrics()
    server = grpc.aio.server(interceptors=[EdgeInterceptor(lambda: credentials.token, metrics)], options=options)
    # Bind first: the node creates the workers' shared-memory queues, which
    # a failed bind would otherwise leak.
    port = _bind(server, config.listen, credentials.server_credentials())
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    assembled = Assembled(server, Node(config, health, credentials, metrics, fleet), port, credentials, metrics)
    pb_grpc.add_WeightSyncServiceServicer_to_server(WeightSyncServicer(assembled.node), server)
    _configure_reflection(server)
    if config.health_listen:
        # Probes cannot speak TLS (kubelet's gRPC probe): a plaintext port with only the health service.
        assembled.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health, assembled.health_server)
        assembled.health_port = _bind(assembled.health_server, config.health_listen, None)
    return assembled


async def _started(node: Node, stop: asyncio.Event) -> bool:
    """Start the workers unless a signal comes first (SIGTERM always wins, even mid-start)."""
    starting = asyncio.ensure_future(node.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        log.info("server_stopped_while_starting")
        return False
    stopping.cancel()
    starting.result()  # raises if the workers could not start
    return True


async def serve(config: ServerConfig, ready_file: str = "") -> int:
    """Run until SIGTERM/SIGINT; SIGHUP reloads the token and certificates. Returns the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(log_loop_exception)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    built = build_server(config)
    loop.add_signal_handler(signal.SIGHUP, built.credentials.reload)
    node = built.node
    try:
        await node.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if built.health_server is not None:
            await built.health_server.start()  # probes get NOT_SERVING while the workers start
        if config.metrics_listen:
            address = parse_address(config.metrics_listen, allow_port_zero=True)
            built.metrics_port = built.metrics.serve(address.host, address.port)
        if not await _started(node, stop):
            return 0
        await built.server.start()
        host = config.listen.rpartition(":")[0]
        log.info("server_listening", address=f"{host}:{built.port}", workers=len(config.devices),
                 tls=bool(config.tls_cert), health_port=built.health_port, metrics_port=built.metrics_port)
        if ready_file:
            tmp = f"{ready_file}.tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump({"port": built.port, "pid": os.getpid(), "health_port": built.health_port,
                           "metrics_port": built.metrics_port}, handle)
            os.replace(tmp, ready_file)
        await stop.wait()
        log.info("server_draining", grace_seconds=config.shutdown_grace_seconds)
        await node.drain(config.shutdown_grace_seconds)
        await built.server.stop(grace=1.0)
        if built.health_server is not None:
            await built.health_server.stop(grace=0.5)
    finally:
        await node.stop()
        built.metrics.stop()
    log.info("server_stopped")
    return 0


__all__ = ["build_server", "serve", "SERVICE_NAME"]
