"""An RPC is counted before its status leaves the server.

A caller that scrapes /metrics as soon as it saw a failure must find that failure counted; sending
the status yields to the event loop and the scrape is served from another thread, so counting after
the send lost that race now and then (CI saw the failed UpdateWeights missing from a scrape)."""

from __future__ import annotations

import asyncio

import grpc.aio
import pytest

from weightsync.common.errors import InvalidArgument
from weightsync.server.metrics import Metrics
from weightsync.server.rpc.interceptors import _mapped_errors

METHOD = "/weightsync.v1.WeightSyncService/UpdateWeights"


class StatusRecorder:
    """A servicer context that notes what the counters held when the status went out."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.counted_when_sent: dict[str, float] = {}

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort_with_status(self, status: object) -> None:
        self.counted_when_sent = {
            code: self.metrics.registry.get_sample_value(
                "weightsync_rpcs_total", {"method": "UpdateWeights", "code": code}) or 0.0
            for code in ("INVALID_ARGUMENT", "INTERNAL", "OK")}
        raise grpc.aio.AbortError()


async def fail_with(error: Exception, context: StatusRecorder) -> None:
    with pytest.raises(grpc.aio.AbortError):
        async with _mapped_errors(context, METHOD, context.metrics):
            raise error


@pytest.mark.parametrize(("error", "code"), [(InvalidArgument("TENSOR_SHAPE_MISMATCH", "bad shape"), "INVALID_ARGUMENT"),
                                             (RuntimeError("crash"), "INTERNAL")])
def test_a_failed_rpc_is_counted_once_and_before_its_status_is_sent(error, code):
    metrics = Metrics()
    context = StatusRecorder(metrics)
    asyncio.run(fail_with(error, context))
    assert context.counted_when_sent == {"INVALID_ARGUMENT": 0.0, "INTERNAL": 0.0, "OK": 0.0, code: 1.0}
    after = metrics.registry.get_sample_value("weightsync_rpcs_total", {"method": "UpdateWeights", "code": code})
    assert after == 1.0
    assert metrics.registry.get_sample_value("weightsync_rpcs_total", {"method": "UpdateWeights", "code": "OK"}) is None


def test_a_successful_rpc_is_counted_once_as_ok():
    metrics = Metrics()

    async def succeed() -> None:
        async with _mapped_errors(StatusRecorder(metrics), METHOD, metrics):
            pass

    asyncio.run(succeed())
    assert metrics.registry.get_sample_value("weightsync_rpcs_total", {"method": "UpdateWeights", "code": "OK"}) == 1.0
