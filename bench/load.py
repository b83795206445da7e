"""Control-plane load during an update.

While a ~0.5 GB update runs, fire 200 concurrent GetServerInfo and health
calls at the server; record that every call succeeded and how much longer the
update took than the same update without the load (alternated, medians).

    python -m bench.load [--reps 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import grpc.aio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import workloads
from bench.progress import log
from bench.servers import Server, WeightSyncTrainer
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc


async def _burst(address: str, calls: int) -> tuple[int, int, float]:
    """`calls` concurrent RPCs, half GetServerInfo and half Health/Check."""
    async with grpc.aio.insecure_channel(address) as channel:
        service = pb_grpc.WeightSyncServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        async def one(i: int) -> bool:
            try:
                if i % 2:
                    await service.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
                else:
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
                    return reply.status == health_pb2.HealthCheckResponse.SERVING
                return True
            except grpc.aio.AioRpcError:
                return False

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(calls)))
        return sum(results), calls - sum(results), time.perf_counter() - started


def run(reps: int = 5, calls: int = 200, workdir: Path | None = None) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="weightsync-load-") as tmp:
        root = workdir or Path(tmp)
        tensors = workloads.dense(0.7).materialize(prefix="load.")  # ~0.5 GB
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with Server(2, root) as server:
            trainer = WeightSyncTrainer(server, 256 << 20)
            try:
                trainer.define(tensors)
                quiet, loaded, ok, failed, burst_seconds = [], [], 0, 0, []
                for rep in range(reps):
                    quiet.append(trainer.push(tensors))
                    outcome: list[tuple[int, int, float]] = []

                    def fire(sink: list = outcome) -> None:
                        sink.append(asyncio.run(_burst(server.address, calls)))

                    thread = threading.Thread(target=fire)
                    thread.start()
                    loaded.append(trainer.push(tensors))
                    thread.join()
                    ok += outcome[0][0]
                    failed += outcome[0][1]
                    burst_seconds.append(outcome[0][2])
                    log(f"load rep {rep + 1}/{reps}: quiet {quiet[-1]:.3f} s, with {calls} calls {loaded[-1]:.3f} s")
                trainer.verify(tensors)
            finally:
                trainer.close()
    result = {
        "update_bytes": size,
        "concurrent_calls_per_update": calls,
        "calls_succeeded": ok,
        "calls_failed": failed,
        "quiet_seconds": [round(s, 4) for s in quiet],
        "loaded_seconds": [round(s, 4) for s in loaded],
        "median_quiet_seconds": round(statistics.median(quiet), 4),
        "median_loaded_seconds": round(statistics.median(loaded), 4),
        "median_burst_seconds": round(statistics.median(burst_seconds), 4),
    }
    result["slowdown"] = round(result["median_loaded_seconds"] / result["median_quiet_seconds"] - 1, 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "load.json"))
    args = parser.parse_args()
    result = run(args.reps, args.calls)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    log(f"load: {result['calls_succeeded']}/{result['calls_succeeded'] + result['calls_failed']} calls ok; "
        f"update {result['median_quiet_seconds']:.3f} s quiet vs {result['median_loaded_seconds']:.3f} s loaded "
        f"({result['slowdown'] * 100:+.1f}%)")


if __name__ == "__main__":
    main()
