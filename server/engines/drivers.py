"""The engine drivers by kind, and the one place an --engine spec becomes a driver (server/engines/):
adding an engine is a module there and a line here."""

from __future__ import annotations

from weightsync.server.config import parse_engine_spec
from weightsync.server.credentials import Credentials
from weightsync.server.engines.driver import HttpEngineDriver
from weightsync.server.engines.sglang import SglangHttpDriver
from weightsync.server.engines.vllm import VllmHttpDriver
from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.published.publisher import Publisher
from weightsync.server.store.leases import LeaseTable


def build_driver(spec: str, index: int, *, publisher: Publisher, engines: EngineRegistry, local_socket: str,
                 credentials: Credentials, leases: LeaseTable | None = None) -> HttpEngineDriver:
    """The driver of one --engine spec (validated by ServerConfig); `index`: its place among them."""
    parsed = parse_engine_spec(spec)
    name = parsed.kind if index == 0 else f"{parsed.kind}-{index}"
    if parsed.kind == "sglang-http":
        return SglangHttpDriver(name, parsed.url, publisher, engines, pause_mode=parsed.pause,
                                timeout_s=parsed.timeout_s)
    return VllmHttpDriver(name, parsed.url, publisher, engines, local_socket, credentials, leases)
