"""The Node.js trainer (examples/node) against the Python SDK, INLINE, the same safetensors file.

    python -m bench.node_inline [--quick]

One server (2 CPU workers). The dense workload is written once as a safetensors file;
then, alternately: the Python SDK pushes the file's tensors over INLINE (checksums off, its
CPU default; and with bucket checksums, as the Node trainer always sends them) and the Node
trainer pushes the file. Node's time is the push it reports (begin to committed: planning,
packing, WS64 of every bucket, the stream), not its start-up or its check afterwards.
node_vs_python = median(python) / median(node): above 1, Node is faster.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import workloads
from bench.harness import FULL, QUICK, Harness, alternate, median, nbytes
from bench.progress import log
from bench.servers import Server

NODE_TRAINER = Path(__file__).resolve().parents[1] / "examples" / "node" / "trainer.js"
MODES = ("python_inline", "python_inline_checksums", "node_inline")


def node_problem() -> str | None:
    if shutil.which("node") is None:
        return "node is not on PATH"
    if not (NODE_TRAINER.parent / "node_modules").is_dir():
        return "examples/node/node_modules is missing (npm ci there)"
    return None


def run(h: Harness, wl: workloads.Workload) -> dict | None:
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

    def node_push() -> float:
        result = subprocess.run(["node", str(NODE_TRAINER), "--server", server.address, "--file", str(path),
                                 "--version", f"node-{time.monotonic_ns()}", "--mode", "in_place",
                                 "--bucket-bytes", str(cfg.bucket_bytes), "--json"],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"node trainer: {result.stderr.strip()}")
        return float(json.loads(result.stdout)["seconds"])

    try:
        with WeightSyncClient(server.address, timeout=300) as client:
            def python_push(checksums: bool):
                def push() -> float:
                    started = time.perf_counter()
                    client.push(tensors, version=f"py-{time.monotonic_ns()}", transport="inline",
                                bucket_size_bytes=cfg.bucket_bytes, checksums=checksums)
                    return time.perf_counter() - started
                return push

            client.push(tensors, version="define", transport="inline", allow_new_tensors=True,
                        bucket_size_bytes=cfg.bucket_bytes)
            times = alternate({"python_inline": python_push(False), "python_inline_checksums": python_push(True),
                               "node_inline": node_push}, cfg.reps, f"node inline {wl.name}")
            if not client.verify(tensors).ok:
                raise RuntimeError("node inline: a worker does not hold the file's tensors")
    finally:
        server.stop()
    medians = {mode: median(times[mode]) for mode in MODES}
    result = {
        "workload": wl.name, "bytes": size, "tensors": len(tensors),
        "runs": [{"mode": mode, "seconds": [round(t, 6) for t in times[mode]], "median_seconds": round(medians[mode], 6),
                  "gbps": round(size / medians[mode] / 1e9, 3)} for mode in MODES],
        "node_vs_python": round(medians["python_inline"] / medians["node_inline"], 3),
        "node_vs_python_checksums": round(medians["python_inline_checksums"] / medians["node_inline"], 3),
    }
    log(f"node inline {wl.name}: python {medians['python_inline']:.3f} s, python+checksums "
        f"{medians['python_inline_checksums']:.3f} s, node {medians['node_inline']:.3f} s "
        f"(node/python {result['node_vs_python']:.2f}x, like for like {result['node_vs_python_checksums']:.2f}x)")
    return result


def markdown(result: dict) -> str:
    if "skipped" in result:
        return f"\n## Node.js trainer, INLINE (issue 11)\n\nSkipped: {result['skipped']}.\n"
    lines = ["", "## Node.js trainer, INLINE (issue 11)", "",
             f"{result['workload']}: {result['bytes'] / 1e9:.2f} GB, {result['tensors']} tensors from one safetensors "
             "file, IN_PLACE, alternated. Node's time is its push (begin to committed), WS64 of every bucket included.",
             "", "| trainer | median s | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['mode']} | {r['median_seconds']:.3f} | {r['gbps']:.2f} |" for r in result["runs"]]
    lines += ["", f"Node / Python SDK (checksums off) = {result['node_vs_python']:.2f}; with bucket checksums on both "
              f"sides = {result['node_vs_python_checksums']:.2f} (above 1: Node faster).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.node_inline", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="weightsync-node-bench-") as tmp, Harness(cfg, Path(tmp)) as h:
        result = run(h, workloads.dense(cfg.dense_scale))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
