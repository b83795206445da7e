"""A whole weightsync server in the test's own process: the real gRPC service, node, store, ingress
and update sessions, with the workers' receivers run in-process (fake_fleet.py's InProcessFleet)
instead of worker processes. It binds 127.0.0.1:0 and serves on an event loop of its own thread,
so a test talks to it as to a server process, through a channel; it starts in well under a second.

For tests of the RPC surface (refusals, limits, info): what a worker process, its queues or
shared memory would add is not here, and those tests stay with a real server (helpers.start_server).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from fake_fleet import InProcessFleet

from weightsync.server.app import Assembled, build_server
from weightsync.server.config import config_from_args
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

START_SECONDS = 60.0
"""A bound on building and starting it (no process, no import: a fraction of a second unloaded)."""


@dataclass
class InProcessServer:
    built: Assembled
    loop: asyncio.AbstractEventLoop
    fleet: InProcessFleet

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.built.port}"

    def stub(self) -> pb_grpc.WeightSyncServiceStub:
        return pb_grpc.WeightSyncServiceStub(grpc.insecure_channel(self.address))

    def call(self, coroutine, timeout: float = START_SECONDS):
        """Run a coroutine on the server's loop (its node's state is that loop's)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


@contextlib.contextmanager
def inprocess_server(*args: str, workers: int = 2) -> Iterator[InProcessServer]:
    """A server configured as `weightsync-server --listen 127.0.0.1:0 --workers N --device cpu ARGS`."""
    config = config_from_args(["--listen", "127.0.0.1:0", "--workers", str(workers), "--device", "cpu", *args])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="inprocess-server", daemon=True)
    thread.start()
    fleets: list[InProcessFleet] = []

    def fleet(ingress) -> InProcessFleet:
        fleets.append(InProcessFleet(workers, ingress))
        return fleets[-1]

    async def start() -> Assembled:
        built = build_server(config, fleet)
        await built.node.start()
        await built.server.start()
        return built

    built = asyncio.run_coroutine_threadsafe(start(), loop).result(START_SECONDS)
    server = InProcessServer(built, loop, fleets[0])
    try:
        yield server
    finally:
        async def stop() -> None:
            await built.server.stop(grace=1.0)
            await built.node.stop()
            built.metrics.stop()
            # What the node left running on this loop (its groups' sweeper, its publisher's watchers).
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

        try:
            server.call(stop())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(START_SECONDS)
            loop.close()
