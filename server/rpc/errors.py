"""Domain exception -> google.rpc.Status with exactly one ErrorInfo."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from weightsync.common.errors import ERROR_DOMAIN, WeightSyncError, code_number


def rich_status(error: WeightSyncError) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code_number(error.code), message=error.message, details=[detail])
    return rpc_status.to_status(status)
