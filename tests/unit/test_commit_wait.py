"""UpdateStream.committed_within: a part that asked to commit waits for the others while its server keeps
saying they still send (PartsWaiting every 10 s), not a fixed bound from its own commit; a server that goes
quiet is given up on after the bound."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from weightsync.client.channels.streams import UpdateStream
from weightsync.v1 import weight_sync_service_pb2 as pb

QUIET_S = 1.0


def stream() -> SimpleNamespace:
    loop = asyncio.get_running_loop()
    return SimpleNamespace(committed=loop.create_future(), heard_at=loop.time())


async def keepalives(s: SimpleNamespace, count: int, then_commit: bool) -> None:
    """The server's side: `count` keepalives, QUIET_S / 4 apart (each moves heard_at, as _read does), then
    Committed or nothing."""
    loop = asyncio.get_running_loop()
    for _ in range(count):
        await asyncio.sleep(QUIET_S / 4)  # the server's cadence, not a synchronisation
        s.heard_at = loop.time()
    if then_commit:
        s.committed.set_result(pb.UpdateCommitted(size_bytes=7))


def test_keepalives_hold_the_wait_open_past_the_bound() -> None:
    async def run() -> tuple[pb.UpdateCommitted, float]:
        s = stream()
        loop = asyncio.get_running_loop()
        started = loop.time()
        server = asyncio.ensure_future(keepalives(s, 12, then_commit=True))  # ~3 x QUIET_S of keepalives
        committed = await UpdateStream.committed_within(s, QUIET_S)  # type: ignore[arg-type]
        await server
        return committed, loop.time() - started

    committed, waited = asyncio.run(run())
    assert committed.size_bytes == 7
    assert waited > QUIET_S  # it outlived the bound: a fixed bound would have raised TimeoutError


def test_a_quiet_server_is_given_up_on() -> None:
    async def run() -> None:
        s = stream()
        server = asyncio.ensure_future(keepalives(s, 2, then_commit=False))
        try:
            await UpdateStream.committed_within(s, QUIET_S)  # type: ignore[arg-type]
        finally:
            await server

    with pytest.raises(TimeoutError):
        asyncio.run(run())


def test_a_failed_stream_raises_its_failure() -> None:
    async def run() -> None:
        s = stream()
        s.committed.set_exception(RuntimeError("PART_FAILED"))
        await UpdateStream.committed_within(s, QUIET_S)  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match="PART_FAILED"):
        asyncio.run(run())
