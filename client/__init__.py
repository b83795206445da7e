"""weightsync.client: the trainer SDK (see weightsync.client.sdk)."""

from weightsync.client.errors import (
    PartGroupFailed,
    PartInputsRefused,
    PartsUnavailable,
    PartUpdateFailed,
    PlanMismatch,
    UpdateFailed,
    WeightSyncClientError,
    WeightSyncRpcError,
)
from weightsync.client.parts.part import Part
from weightsync.client.sdk import WeightSyncClient
from weightsync.client.types import (
    PushProgress,
    PushResult,
    ServerOutcome,
    TensorMismatch,
    TlsConfig,
    VerifyResult,
)

__all__ = [
    "Part",
    "PartGroupFailed",
    "PartInputsRefused",
    "PartUpdateFailed",
    "PartsUnavailable",
    "PlanMismatch",
    "PushProgress",
    "PushResult",
    "ServerOutcome",
    "TensorMismatch",
    "TlsConfig",
    "UpdateFailed",
    "VerifyResult",
    "WeightSyncClient",
    "WeightSyncClientError",
    "WeightSyncRpcError",
]
