"""The Node.js trainer (examples/node) against the Python SDK, INLINE, the same safetensors file.

    python -m bench.node_inline [--quick]

One server (2 CPU workers). The dense workload is written once as a safetensors file; the
Python SDK defines the store with it. Then, alternately, IN_PLACE, with and without WS64
bucket checksums on both sides: the SDK pushes the file's tensors (loaded with safetensors),
and the Node trainer pushes the file. Node's time is the push it reports (begin to committed:
reading the file, WS64 of every bucket, the stream), not its start-up nor its check afterwards
(both reported apart). node_vs_python = median(python) / median(node), the ratio of Node's
throughput to Python's: above 1, Node is faster.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import workloads
from bench.harness import FULL, QUICK, Harness, alternate, median, nbytes
from bench.progress import log
from bench.servers import Server

NODE_DIR = Path(__file__).resolve().parents[1] / "examples" / "node"
NODE_TRAINER = NODE_DIR / "trainer.js"
MODES = ("python_inline", "node_inline", "python_inline_checksums", "node_inline_checksums")
TITLE = "## Node.js trainer, INLINE"


def node_problem() -> str | None:
    """Why the Node trainer cannot run here, if it cannot."""
    if shutil.which("node") is None:
        return "node is not on PATH"
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return "examples/node/node_modules is missing (run npm ci there)"
    return None


class NodePushes:
    """Node trainer runs against one server; keeps what each run reported besides its time."""

    def __init__(self, address: str, path: Path, bucket_bytes: int) -> None:
        self.address, self.path, self.bucket_bytes = address, path, bucket_bytes
        self.process_seconds: list[float] = []
        self.fast_path_buckets: set[int] = set()

    def timer(self, checksums: bool) -> Callable[[], float]:
        def push() -> float:
            return self.push(checksums)
        return push

    def push(self, checksums: bool) -> float:
        argv = ["node", str(NODE_TRAINER), "--server", self.address, "--file", str(self.path),
                "--version", f"node-{time.monotonic_ns()}", "--mode", "in_place",
                "--bucket-bytes", str(self.bucket_bytes), "--json"]
        started = time.perf_counter()
        result = subprocess.run([*argv, *(() if checksums else ("--no-checksums",))],
                                capture_output=True, text=True, timeout=600)
        self.process_seconds.append(time.perf_counter() - started)
        if result.returncode != 0:
            raise RuntimeError(f"node trainer: {result.stderr.strip()}")
        summary = json.loads(result.stdout)
        self.fast_path_buckets.add(summary["fastPathBuckets"])
        return float(summary["seconds"])


def python_timer(client, tensors: dict[str, torch.Tensor], bucket_bytes: int, checksums: bool) -> Callable[[], float]:
    def push() -> float:
        started = time.perf_counter()
        client.push(tensors, delta=False, version=f"py-{time.monotonic_ns()}", transport="inline",
                    bucket_size_bytes=bucket_bytes, checksums=checksums)
        return time.perf_counter() - started
    return push


def run(h: Harness, wl: workloads.Workload) -> dict:
    """Alternate the four modes cfg.reps times (after a warm-up each); see the module docstring.

    Returns {"skipped": why} when Node cannot run, else {"workload", "bytes", "tensors",
    "runs": [{"mode", "seconds", "median_seconds", "gbps"}] in MODES order, "node_vs_python",
    "node_vs_python_checksums", "node_process_median_seconds", "node_fast_path_buckets"}.
    """
    from safetensors.torch import load_file, save_file

    from weightsync.client import WeightSyncClient

    if problem := node_problem():
        log(f"node inline: skipped: {problem}")
        return {"skipped": problem}
    cfg = h.cfg
    h.stop_server()
    server = Server(2, h.workdir)
    h.processes.append(server.process)
    h.shm |= server.shm
    path = h.workdir / "node-bench.safetensors"
    save_file(wl.materialize(prefix=f"{wl.name}."), str(path))
    tensors = load_file(str(path))  # exactly what Node reads
    size = nbytes(tensors)
    node = NodePushes(server.address, path, cfg.bucket_bytes)
    try:
        with WeightSyncClient(server.address, timeout=300) as client:
            client.push(tensors, delta=False, version="define", transport="inline", allow_new_tensors=True,
                        bucket_size_bytes=cfg.bucket_bytes)
            timers = {"python_inline": python_timer(client, tensors, cfg.bucket_bytes, False),
                      "node_inline": node.timer(False),
                      "python_inline_checksums": python_timer(client, tensors, cfg.bucket_bytes, True),
                      "node_inline_checksums": node.timer(True)}
            times = alternate(timers, cfg.reps, f"node inline {wl.name}")
            if not client.verify(tensors).ok:
                raise RuntimeError("node inline: a worker does not hold the file's tensors")
    finally:
        server.stop()
    path.unlink()
    return summarize(wl.name, size, len(tensors), times, node)


def summarize(workload: str, size: int, count: int, times: dict[str, list[float]], node: NodePushes) -> dict:
    medians = {mode: median(times[mode]) for mode in MODES}
    result = {
        "workload": workload, "bytes": size, "tensors": count,
        "runs": [{"mode": mode, "seconds": [round(t, 6) for t in times[mode]], "median_seconds": round(medians[mode], 6),
                  "gbps": round(size / medians[mode] / 1e9, 3)} for mode in MODES],
        "node_vs_python": round(medians["python_inline"] / medians["node_inline"], 3),
        "node_vs_python_checksums": round(medians["python_inline_checksums"] / medians["node_inline_checksums"], 3),
        "node_process_median_seconds": round(median(node.process_seconds), 3),
        "node_fast_path_buckets": sorted(node.fast_path_buckets),
    }
    log(f"node inline {workload}: " + ", ".join(f"{m} {medians[m]:.3f} s" for m in MODES)
        + f" (node/python {result['node_vs_python']:.2f}x, with checksums {result['node_vs_python_checksums']:.2f}x)")
    return result


def markdown(result: dict) -> str:
    if "skipped" in result:
        return f"\n{TITLE}\n\nSkipped: {result['skipped']}.\n"
    lines = ["", TITLE, "",
             f"{result['workload']}: {result['bytes'] / 1e9:.2f} GB, {result['tensors']} tensors from one safetensors "
             "file, IN_PLACE into a store the SDK's plan defined, alternated. Node's time is its push (begin to "
             "committed), reading the file included; its whole process (start-up and the check after commit too) "
             f"took {result['node_process_median_seconds']:.2f} s (median).",
             "", "| trainer | median s | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['mode']} | {r['median_seconds']:.3f} | {r['gbps']:.2f} |" for r in result["runs"]]
    lines += ["", f"Node / Python SDK throughput: {result['node_vs_python']:.2f} without checksums, "
              f"{result['node_vs_python_checksums']:.2f} with WS64 bucket checksums on both sides (above 1: Node faster).",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.node_inline", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick configuration (smaller workload, fewer reps)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON after the markdown")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="weightsync-node-bench-") as tmp, Harness(cfg, Path(tmp)) as h:
        result = run(h, workloads.dense(cfg.dense_scale))
    print(markdown(result))
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
