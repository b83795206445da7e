"""Typed errors raised by the SDK."""

from __future__ import annotations

import grpc

from weightsync.common.errors import error_info


class WeightSyncClientError(Exception):
    """Base class of every SDK error."""


class WeightSyncRpcError(WeightSyncClientError):
    """A server answered with an error status.

    Attributes: code (grpc.StatusCode), reason (ErrorInfo reason, e.g.
    "TENSOR_SHAPE_MISMATCH"), metadata (ErrorInfo metadata), server (address).
    """

    def __init__(self, server: str, code: grpc.StatusCode, reason: str, message: str, metadata: dict[str, str]):
        super().__init__(f"{server}: {code.name} {reason}: {message}")
        self.server = server
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = metadata

    @staticmethod
    def from_rpc(server: str, error: grpc.RpcError) -> WeightSyncRpcError:
        reason, metadata = error_info(error)
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        if not reason and code == grpc.StatusCode.UNAVAILABLE:
            reason = "SERVER_UNREACHABLE"  # gRPC's own: no connection, or it broke (keepalive, a cut link)
        return WeightSyncRpcError(server, code, reason or code.name, details or "", metadata)


class UpdateFailed(WeightSyncClientError):
    """A push failed and was aborted on every server.

    `cause` is the first failure (a WeightSyncRpcError naming its server, or a
    CollectiveError from the broadcast); `server` names the server at fault
    when one is known.
    """

    def __init__(
        self,
        message: str,
        cause: BaseException | None = None,
        server: str = "",
        *,
        code: grpc.StatusCode | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.server = server
        self.reason: str = reason or getattr(cause, "reason", "") or "UNKNOWN"
        self.code: grpc.StatusCode = code or getattr(cause, "code", None) or grpc.StatusCode.UNKNOWN


class PlanMismatch(WeightSyncClientError):
    """Streamed tensors do not match the plan being reused (the STAGED update is aborted)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "PLAN_MISMATCH"


class DuplicateTensor(PlanMismatch):
    """A streamed push yielded the same tensor name twice (the STAGED update is aborted)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "TENSOR_NAME_DUPLICATE"
