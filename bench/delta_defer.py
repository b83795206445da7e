"""Comparing while sending against comparing first: `python -m bench.delta_defer [--rates 1gbit none]`.

Deferred buckets (client/delta/deferred.py) let a patched push compare the next tensors while the
current bucket travels. This A/B runs, per rate, in a network namespace of its own whose loopback a
tc token-bucket filter holds to the rate (as bench/delta_link.py; "none": plain loopback): two servers
with 2 CPU workers each, one client each, the bench's dense model at full size, bf16, patches
everywhere (delta=True: the same bytes either way, no zstd), one-ulp changes. Per density, the
same new tensors are pushed by one client deferring and by the other comparing first, alternated,
REPS times; both servers are verified at the end. Writes bench/results/delta_defer.md.
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
from bench.delta import _scatter_change
from bench.delta_link import limit_loopback
from bench.harness import median
from bench.progress import log

RESULTS = Path(__file__).resolve().parent / "results" / "delta_defer.md"
DENSITIES = (0.01, 0.03)


def measure(scale: float, reps: int) -> list[dict]:
    from bench.servers import Server
    from weightsync.client import WeightSyncClient
    from weightsync.client.delta import policy as delta_policy

    tensors = {n: t.to(torch.bfloat16) for n, t in workloads.dense(scale).materialize(prefix="dense.").items()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        servers = [Server(2, Path(tmp)), Server(2, Path(tmp))]
        try:
            with WeightSyncClient(servers[0].address, timeout=600) as deferring, \
                    WeightSyncClient(servers[1].address, timeout=600) as first:
                for client in (deferring, first):
                    client.create_group(timeout=120)
                    client.push(tensors, version="start", allow_new_tensors=True, delta=True)
                current = tensors
                for fraction in DENSITIES:
                    times: dict[str, list[float]] = {"deferred": [], "first": []}
                    for rep in range(reps):
                        new = _scatter_change(current, fraction, seed=int(fraction * 1e6) + rep)
                        for name, client, below in (("deferred", deferring, float("inf")), ("first", first, 0.0)):
                            delta_policy.DEFER_BELOW_BYTES_PER_SECOND = below
                            started = time.perf_counter()
                            result = client.push(new, version=f"{name}{fraction}-{rep}", delta=True, compress=False)
                            times[name].append(time.perf_counter() - started)
                        current = new
                    if not (deferring.verify(current).ok and first.verify(current).ok):
                        raise RuntimeError(f"{fraction}: a worker does not hold the trainer's tensors")
                    row = {"changed_fraction": fraction, "sent_fraction": round(result.bytes_sent / result.dense_bytes, 4),
                           "deferred_seconds": round(median(times["deferred"]), 4),
                           "first_seconds": round(median(times["first"]), 4),
                           "speedup": round(median([f / d for f, d in zip(times["first"], times["deferred"],
                                                                          strict=True)]), 2)}
                    rows.append(row)
                    log(f"deferral {fraction * 100:g}%: deferred {row['deferred_seconds']:.3f} s, compared first "
                        f"{row['first_seconds']:.3f} s ({row['speedup']:.2f}x)")
        finally:
            for server in servers:
                server.stop()
    return rows


def render(rates: list[str], scale: float, reps: int, results: list[list[dict]], seconds: float) -> str:
    lines = ["# Comparing while sending (deferred buckets) against comparing first", "",
             f"Command: `python -m bench.delta_defer --rates {' '.join(rates)} --reps {reps}` ({seconds:.0f} s). Per "
             "rate, loopback held to it by tc tbf in a network namespace of its own (none: as it is); dense workload "
             f"at scale {scale} (bf16); two servers "
             "with 2 CPU workers, one client each, COLLECTIVE over Gloo, delta=True, compress=False; the same tensors "
             "pushed by both clients, alternated; medians; `x` = the median of the per-repetition ratios "
             "(compared first / deferred; above 1, deferring is faster). 2 cores, shared by the trainer, the "
             "servers and their workers.", "",
             "| link | changed | bytes sent | deferred s | compared first s | x |", "|---|---:|---:|---:|---:|---:|"]
    for rate, rows in zip(rates, results, strict=True):
        for r in rows:
            lines.append(f"| {rate} | {r['changed_fraction'] * 100:g}% | {r['sent_fraction'] * 100:.2f}% | "
                         f"{r['deferred_seconds']:.3f} | {r['first_seconds']:.3f} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "none"], help="tc rates, e.g. 1gbit; none: plain loopback")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.inside:
        started, results = time.monotonic(), []
        for rate in args.rates:
            argv = [sys.executable, "-m", "bench.delta_defer", "--rates", rate, "--scale", str(args.scale),
                    "--reps", str(args.reps), "--inside"]
            done = subprocess.run(["unshare", "-n", *argv], stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).resolve().parent.parent, check=True)
            results.append(json.loads(done.stdout))
        report = render(args.rates, args.scale, args.reps, results, time.monotonic() - started)
        RESULTS.write_text(report)
        sys.stdout.write(report)
        return 0
    if args.rates[0] == "none":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    else:
        limit_loopback(args.rates[0], "1mb")
    print(json.dumps(measure(args.scale, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
