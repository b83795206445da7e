"""One interceptor at the edge of every RPC.

- Authentication: with a token configured, every method but the health
  service needs `authorization: Bearer <token>` (constant-time compare);
  reflection included.
- Parsing: requests arrive as raw bytes and are parsed here, so a malformed
  message is INVALID_ARGUMENT (MESSAGE_MALFORMED), not an INTERNAL error from
  the framework.
- Errors: a WeightSyncError becomes its status code with one ErrorInfo; any
  other exception becomes INTERNAL with a generic message, the traceback going
  to the log only.
- Logging context: the RPC method, and a W3C `traceparent` when the caller sends
  one (its trace and parent span ids), are bound for everything logged below,
  the update id included: a trainer's trace finds the server's log lines.
- Metrics: every finished RPC is counted by method and status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import structlog
from google.protobuf.message import DecodeError

from weightsync.common.errors import Internal, InvalidArgument, Unauthenticated, WeightSyncError
from weightsync.common.logging import get_logger
from weightsync.server.intake.wire import UPDATE_WEIGHTS, parse_update_request
from weightsync.server.metrics import Metrics
from weightsync.server.rpc.errors import rich_status

log = get_logger("weightsync.rpc")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
SERVICE_PREFIX = "/weightsync.v1."
TRACEPARENT = re.compile(r"^(?!ff)[0-9a-f]{2}-(?!0{32})([0-9a-f]{32})-(?!0{16})([0-9a-f]{16})-[0-9a-f]{2}(-.*)?$")


async def _abort(context: grpc.aio.ServicerContext, error: WeightSyncError) -> None:
    await context.abort_with_status(rich_status(error))


def _internal(method: str, error: BaseException) -> WeightSyncError:
    log.error("rpc_crashed", method=method, exc_info=error)
    return Internal("INTERNAL", "internal error; see the server log")


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Authentication, parsing, error mapping, trace context and metrics for every RPC."""

    def __init__(self, token: Callable[[], str] = lambda: "", metrics: Metrics | None = None) -> None:
        self._token = token  # read per call: SIGHUP may have replaced it
        self._metrics = metrics

    @property
    def _expected(self) -> bytes:
        token = self._token()
        return f"Bearer {token}".encode() if token else b""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if self._expected and not method.startswith(HEALTH_PREFIX) and not self._authorized(details):
            # Unknown methods too: an unauthenticated caller learns nothing.
            refused = handler or grpc.unary_unary_rpc_method_handler(None)
            return _refusing_handler(refused, Unauthenticated("TOKEN_INVALID", "missing or invalid bearer token"))
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler
        return _wrap(handler, method, self._metrics)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False


def _refusing_handler(handler: grpc.RpcMethodHandler, error: WeightSyncError) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _abort(context, error)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _abort(context, error)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


def _parse(deserializer: Callable[[bytes], Any], raw: bytes) -> Any:
    try:
        return deserializer(raw)
    except (DecodeError, ValueError, UnicodeDecodeError) as error:
        raise InvalidArgument("MESSAGE_MALFORMED", f"request could not be parsed: {error}") from error


def _trace_context(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The caller's W3C trace context, if it sent a valid `traceparent`."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            match = TRACEPARENT.match(value if isinstance(value, str) else value.decode(errors="replace"))
            if match:
                return {"trace_id": match.group(1), "parent_span_id": match.group(2)}
    return {}


@contextlib.asynccontextmanager
async def _mapped_errors(context: grpc.aio.ServicerContext, method: str, metrics: Metrics | None) -> AsyncIterator[None]:
    """The one place where exceptions become statuses.

    An RPC is counted before its status is sent: a caller that reads the metrics right after it
    saw the status must find its RPC there (sending the status yields to the event loop, and the
    scrape is served from another thread)."""
    counted = False

    def count(code: str) -> None:
        nonlocal counted
        if metrics is not None and not counted:
            metrics.rpcs.labels(method=method.rsplit("/", 1)[-1], code=code).inc()
        counted = True

    with structlog.contextvars.bound_contextvars(rpc=method, **_trace_context(context)):
        try:
            yield
        except WeightSyncError as error:
            count(error.code.name)
            await _abort(context, error)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            count("CANCELLED")
            raise
        except Exception as error:  # noqa: BLE001
            count("INTERNAL")
            await _abort(context, _internal(method, error))
        finally:
            count("OK")


# Methods whose requests are parsed by our own code first (see server/intake/wire.py).
FAST_PARSERS = {UPDATE_WEIGHTS: parse_update_request}


def _wrap(handler: grpc.RpcMethodHandler, method: str, metrics: Metrics | None) -> grpc.RpcMethodHandler:
    parse = FAST_PARSERS.get(method, handler.request_deserializer)
    serialize = handler.response_serializer

    if not handler.request_streaming and not handler.response_streaming:
        inner = handler.unary_unary

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            async with _mapped_errors(context, method, metrics):
                return await inner(_parse(parse, raw), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, None, serialize)

    if not handler.request_streaming:
        inner_stream = handler.unary_stream

        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with _mapped_errors(context, method, metrics):
                async for response in inner_stream(_parse(parse, raw), context):
                    yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, None, serialize)

    inner_bidi = handler.stream_stream

    async def parsed(requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for raw in requests:
            yield _parse(parse, raw)

    async def stream_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with _mapped_errors(context, method, metrics):
            async for response in inner_bidi(parsed(requests), context):
                yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, None, serialize)
