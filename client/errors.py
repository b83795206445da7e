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


class PartsUnavailable(WeightSyncClientError):
    """A push with a part (WeightSyncClient(part=...)) that cannot run: a transport servers run parts over
    (INLINE, SHM from the server's host, COLLECTIVE over a group of every part), or a server whose
    GetServerInfo.parts is false. Raised before any byte moves."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = "PARTS_UNAVAILABLE"


class PartInputsRefused(WeightSyncClientError):
    """The parts of a push checked their inputs together (Part.group) and at least one refused its own:
    raised on every rank, before Begin, nothing sent. `ranks`: the failing ranks, ascending; `messages`:
    rank -> what it said (shortened); `__cause__` on a failing rank: its own TypeError/ValueError/...."""

    def __init__(self, message: str, ranks: tuple[int, ...], messages: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.messages = messages


class PartGroupFailed(WeightSyncClientError):
    """The parts' own group (Part.group) failed one of the SDK's collectives before anything was sent (a push's
    agreement, create_group's): a part is gone (its connection closed) or did not reach it within the group's
    timeout. Raised on every rank that saw it; `__cause__` is the backend's error.

    rank, world: this part. during: which collective ("push", "create_group"). peer: the rank or address the
    backend named (Gloo names an address, "[10.0.0.2]:41234"), else None. timed_out: the backend said it timed
    out (else a connection closed or broke)."""

    def __init__(self, message: str, *, rank: int, world: int, during: str, peer: str | None,
                 timed_out: bool) -> None:
        super().__init__(message)
        self.rank = rank
        self.world = world
        self.during = during
        self.peer = peer
        self.timed_out = timed_out


class PartUpdateFailed(UpdateFailed):
    """A push with a part failed: UpdateFailed (code, reason, server, cause) and which part.

    rank, world, update_key: this part. failed_part: the other part a server named (metadata `part`: the one
    that failed, PART_FAILED, or was refused before it joined, with its own reason), else None. missing: the
    ranks that never joined (PARTS_MISSING, at most the first 20), else ()."""

    def __init__(self, message: str, cause: UpdateFailed, *, rank: int, world: int, update_key: str,
                 failed_part: int | None, missing: tuple[int, ...]) -> None:
        super().__init__(message, cause.cause, cause.server, code=cause.code, reason=cause.reason)
        self.rank = rank
        self.world = world
        self.update_key = update_key
        self.failed_part = failed_part
        self.missing = missing
