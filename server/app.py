"""Assemble and run the server: servicer, health, reflection, interceptor, signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import grpc
import grpc.aio
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from weightsync.server.config import ServerConfig
from weightsync.server.interceptors import EdgeInterceptor
from weightsync.server.service import SERVICE_NAME, WeightSyncServicer
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

log = structlog.get_logger("weightsync.server")


def _configure_servicers(server: grpc.aio.Server, config: ServerConfig) -> WeightSyncServicer:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    servicer = WeightSyncServicer(config, health)
    pb_grpc.add_WeightSyncServiceServicer_to_server(servicer, server)
    return servicer


def _configure_reflection(server: grpc.aio.Server) -> None:
    names = (
        pb.DESCRIPTOR.services_by_name["WeightSyncService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _configure_port(server: grpc.aio.Server, config: ServerConfig) -> int:
    try:
        if not config.tls_cert:
            return server.add_insecure_port(config.listen)
        credentials = grpc.ssl_server_credentials(
            [(_read(config.tls_key), _read(config.tls_cert))],
            root_certificates=_read(config.tls_client_ca) if config.tls_client_ca else None,
            require_client_auth=bool(config.tls_client_ca),
        )
        return server.add_secure_port(config.listen, credentials)
    except RuntimeError as error:  # grpc: "Failed to bind to address ..." (in use, not local, ...)
        raise OSError(f"could not bind {config.listen} (address in use or not available)") from error


def build_server(config: ServerConfig) -> tuple[grpc.aio.Server, WeightSyncServicer, int]:
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(interceptors=[EdgeInterceptor(config.token)], options=options)
    # Bind first: the servicer creates the workers' shared-memory queues, which
    # a failed bind would otherwise leak.
    port = _configure_port(server, config)
    if port == 0:
        raise OSError(f"could not bind {config.listen}")
    servicer = _configure_servicers(server, config)
    _configure_reflection(server)
    return server, servicer, port


async def _started(servicer: WeightSyncServicer, stop: asyncio.Event) -> bool:
    """Start the workers unless a signal comes first (SIGTERM always wins, even mid-start)."""
    starting = asyncio.ensure_future(servicer.start())
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
    """Run until SIGTERM/SIGINT; returns the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server, servicer, port = build_server(config)
    try:
        if not await _started(servicer, stop):
            return 0
        await server.start()
        host = config.listen.rpartition(":")[0]
        log.info("server_listening", address=f"{host}:{port}", workers=len(config.devices), tls=bool(config.tls_cert))
        if ready_file:
            tmp = f"{ready_file}.tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump({"port": port, "pid": os.getpid()}, handle)
            os.replace(tmp, ready_file)
        await stop.wait()
        log.info("server_draining", grace_seconds=config.shutdown_grace_seconds)
        await servicer.drain(config.shutdown_grace_seconds)
        await server.stop(grace=1.0)
    finally:
        await servicer.stop()
    log.info("server_stopped")
    return 0


__all__ = ["build_server", "serve", "SERVICE_NAME"]
