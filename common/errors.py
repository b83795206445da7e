"""Domain exceptions, one per gRPC status code.

Raised anywhere in the server or worker; converted to a google.rpc.Status with
one ErrorInfo in exactly one place (weightsync.server.rpc.errors). The code says
what a caller should do: FAILED_PRECONDITION "fix state first", UNAVAILABLE
"retry this call", ABORTED "retry the whole sequence".
"""

from __future__ import annotations

import grpc

ERROR_DOMAIN = "weightsync"


class WeightSyncError(Exception):
    """Base class: a status code, a machine-readable reason and metadata."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    broken_group_id: str = ""
    """Set when the failure left a transfer group unusable (its collective failed)."""
    worker_index: int | None = None
    """Set when one worker reported the failure."""
    store_touched: bool = True
    """A bucket's receive that failed: whether its bytes may have reached the store (the worker says;
    a failure nobody reported, a worker's death, is assumed to have)."""

    def __init__(self, reason: str, message: str, **metadata: object) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items() if v != ""}

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"


class InvalidArgument(WeightSyncError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(WeightSyncError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(WeightSyncError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(WeightSyncError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(WeightSyncError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(WeightSyncError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(WeightSyncError):
    code = grpc.StatusCode.ABORTED


class DataLoss(WeightSyncError):
    code = grpc.StatusCode.DATA_LOSS


class Unavailable(WeightSyncError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(WeightSyncError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(WeightSyncError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(WeightSyncError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(WeightSyncError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[WeightSyncError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        DeadlineExceeded,
        Aborted,
        DataLoss,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        Unimplemented,
        Internal,
    )
}
_CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def code_number(code: grpc.StatusCode) -> int:
    """The google.rpc.Code number of a status code."""
    return int(code.value[0])


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc.Code number (UNKNOWN if there is none)."""
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_from_code(code: int, reason: str, message: str, metadata: dict[str, str]) -> WeightSyncError:
    """Rebuild a domain exception from its wire form (worker events, ErrorInfo)."""
    status = _CODE_BY_NUMBER.get(code, grpc.StatusCode.INTERNAL)
    cls = _BY_CODE.get(status, Internal)
    return cls(reason, message, **metadata)


def error_info(error: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """The ErrorInfo reason and metadata a refused call's status carries; ("", {}) where it carries
    none (a status from gRPC itself, or one that does not parse)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a malformed status is still an error
        return "", {}
    reason, metadata = "", {}
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
    return reason, metadata
