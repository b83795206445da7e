"""Sending only what changed over a link slower than loopback: part of `python -m bench --only delta`.

The bench re-runs this module as `unshare -n python -m bench.delta_link RATE ...`: in a network
namespace of its own, whose loopback carries every byte between the trainer and its servers (gRPC,
the Gloo broadcast, the rendezvous), a token-bucket filter (`tc qdisc ... tbf rate RATE`) holds the
loopback to RATE. Two servers with 2 CPU workers each: per density, a dense push of the changed
tensors to one and push(delta="auto") (the SDK's default) to the other, alternated, on COLLECTIVE
and INLINE; every push verified at the end. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import workloads
from bench.harness import median
from bench.progress import log

DENSITIES = (0.01, 0.03)
TRANSPORTS = ("collective", "inline")


def limit_loopback(rate: str, burst: str) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", burst,
                    "latency", "200ms"], check=True)


def measure(scale: float, reps: int, bucket_bytes: int) -> list[dict]:
    from bench.delta import _scatter_change
    from bench.servers import Server
    from weightsync.client import WeightSyncClient

    rows = []
    tensors = {n: t.to(torch.bfloat16) for n, t in workloads.dense(scale).materialize(prefix="dense.").items()}
    with tempfile.TemporaryDirectory() as tmp:
        servers = [Server(2, Path(tmp)), Server(2, Path(tmp))]
        try:
            for transport in TRANSPORTS:
                with WeightSyncClient(servers[0].address, timeout=600) as auto, \
                        WeightSyncClient(servers[1].address, timeout=600) as dense:
                    if transport == "collective":
                        auto.create_group(timeout=120)
                        dense.create_group(timeout=120)
                    current = tensors
                    for client in (auto, dense):
                        client.push(current, version="start", transport=transport, bucket_size_bytes=bucket_bytes,
                                    allow_new_tensors=True)
                    for fraction in DENSITIES:
                        t_dense, t_auto, sent, compressed, planned = [], [], 0, 0, 0
                        for rep in range(reps):
                            new = _scatter_change(current, fraction, seed=int(fraction * 1e6) + rep)
                            started = time.perf_counter()
                            dense.push(new, version=f"d{rep}", transport=transport, bucket_size_bytes=bucket_bytes,
                                       delta=False)
                            t_dense.append(time.perf_counter() - started)
                            started = time.perf_counter()
                            result = auto.push(new, version=f"a{rep}", transport=transport,
                                               bucket_size_bytes=bucket_bytes)
                            t_auto.append(time.perf_counter() - started)
                            sent, compressed, planned = result.bytes_sent, result.compressed_bytes, result.size_bytes
                            current = new
                        if not (auto.verify(current).ok and dense.verify(current).ok):
                            raise RuntimeError(f"{transport} {fraction}: a worker does not hold the trainer's tensors")
                        size = result.dense_bytes
                        rows.append({"transport": transport, "changed_fraction": fraction, "dense_bytes": size,
                                     "sent_fraction": round(sent / size, 4),
                                     "compressed_fraction": round(compressed / size, 4),
                                     "planned_fraction": round(planned / size, 4),
                                     "dense_seconds": round(median(t_dense), 4), "auto_seconds": round(median(t_auto), 4),
                                     "speedup": round(median(t_dense) / median(t_auto), 2),
                                     "dense_gbit_per_s": round(size * 8 / median(t_dense) / 1e9, 2)})
                        log(f"delta link {transport} {fraction * 100:g}% changed: dense {median(t_dense):.3f} s, "
                            f"auto {median(t_auto):.3f} s ({rows[-1]['speedup']:.2f}x), sent {sent / size * 100:.2f}% "
                            f"({compressed / size * 100:.2f}% of the model's bytes compressed)")
        finally:
            for server in servers:
                server.stop()
    return rows


def run_limited(rate: str, burst: str, *, scale: float, reps: int, bucket_bytes: int) -> dict:
    """This module in a network namespace of its own, its loopback held to `rate`; the reason it
    could not run otherwise (no unshare, no tc, no privilege for either)."""
    argv = ["unshare", "-n", sys.executable, "-m", "bench.delta_link", rate, burst, "--scale", str(scale),
            "--reps", str(reps), "--bucket-bytes", str(bucket_bytes)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                              cwd=Path(__file__).resolve().parent.parent)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"rate": rate, "skipped": f"{type(error).__name__}: {error}"}
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode != 0:
        return {"rate": rate, "skipped": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    return {"rate": rate, "rows": json.loads(done.stdout)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rate", help="tc rate, e.g. 1gbit")
    parser.add_argument("burst", help="tc burst, e.g. 1mb")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20)
    args = parser.parse_args()
    limit_loopback(args.rate, args.burst)
    print(json.dumps(measure(args.scale, args.reps, args.bucket_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
