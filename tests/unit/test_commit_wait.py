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


def test_update_aborting_ends_the_commit_wait_of_a_part_while_its_stream_stays_open() -> None:
    """Over real gRPC: a part asked to commit, heard PartsWaiting, then UpdateAborting{PART_FAILED, part 1}; the
    server keeps its stream open (another part still holds its own). The wait ends with that failure, naming
    the part, long before its bound (a wait that looked only at Committed and the stream's end raised
    TimeoutError after QUIET_LONG_S, or waited as long as the other part held)."""
    import grpc

    from weightsync.client.errors import WeightSyncRpcError
    from weightsync.v1 import weight_sync_service_pb2_grpc as rpc

    quiet_long_s = 120.0

    class Scripted(rpc.WeightSyncServiceServicer):
        def __init__(self) -> None:
            self.release = asyncio.Event()

        async def UpdateWeights(self, requests, context):  # noqa: N802 (the generated name)
            await anext(requests)  # Begin
            yield pb.UpdateWeightsResponse(ready=pb.UpdateReady(update_id="u1", bucket_count=0))
            await anext(requests)  # Commit
            yield pb.UpdateWeightsResponse(waiting=pb.PartsWaiting(sending=[1]))
            yield pb.UpdateWeightsResponse(aborting=pb.UpdateAborting(
                code=grpc.StatusCode.ABORTED.value[0], reason="PART_FAILED", message="part 1 failed",
                metadata={"part": "1", "part_reason": "BUCKET_CHECKSUM_MISMATCH"}))
            await self.release.wait()  # the stream stays open until the test is done

    async def run() -> tuple[BaseException, bool]:
        servicer = Scripted()
        server = grpc.aio.server()
        rpc.add_WeightSyncServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpc.WeightSyncServiceStub(channel)
                s = UpdateStream(f"127.0.0.1:{port}", stub.UpdateWeights, (), quiet_long_s)
                s.send(pb.UpdateWeightsRequest(begin=pb.BeginUpdate(version="v1")))
                await asyncio.wait_for(s.ready, quiet_long_s)
                s.send(pb.UpdateWeightsRequest(commit=pb.CommitUpdate()))
                try:
                    await s.committed_within(quiet_long_s)
                    raise AssertionError("committed")
                except (WeightSyncRpcError, TimeoutError) as error:
                    failure = error
                still_open = s.failure is None  # the stream did not end: the failure came from UpdateAborting
                s.cancel()
                return failure, still_open
        finally:
            servicer.release.set()
            await server.stop(None)

    failure, still_open = asyncio.run(run())
    assert isinstance(failure, WeightSyncRpcError), repr(failure)
    assert (failure.code, failure.reason, failure.metadata) == (
        grpc.StatusCode.ABORTED, "PART_FAILED", {"part": "1", "part_reason": "BUCKET_CHECKSUM_MISMATCH"})
    assert still_open
