"""Where weightsync's time goes against raw: `python -m bench.breakdown [--workload dense]`.

Times, alternately on one workload with 2 receivers, weightsync with its
features switched off one by one (checksums; large tensors sent as their own
buckets vs packed into bucket-size buckets) next to raw with the greedy
buckets and raw with the SDK's own bucket plan. Prints a table; writes
bench/results/breakdown-<workload>.json. Not part of `python -m bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench import machine, workloads
from bench.baselines import packed_source
from bench.harness import FULL, Harness, alternate, plan_layout, sdk_layout
from bench.progress import log

NO_ZERO_COPY = 1 << 62


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.breakdown")
    parser.add_argument("--workload", choices=["dense", "moe", "tiny"], default="dense")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="JSON output (default bench/results/breakdown-<workload>.json)")
    args = parser.parse_args(argv)
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"breakdown-{args.workload}.json")
    torch.set_num_threads(1)
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    cfg = FULL
    wl = {"dense": workloads.dense, "moe": workloads.moe, "tiny": workloads.tiny}[args.workload]()
    with machine.LoadSampler() as load, tempfile.TemporaryDirectory(prefix="weightsync-breakdown-") as tmp, \
            Harness(cfg, Path(tmp)) as h:
        tensors = wl.materialize(prefix=f"{wl.name}.")
        sizes, layout = plan_layout(tensors, cfg.bucket_bytes)
        ws_sizes, ws_layout = sdk_layout(tensors, cfg.bucket_bytes)
        trainer = h.weightsync(2, sum(t.numel() * t.element_size() for t in tensors.values()))
        trainer.define(tensors)
        cluster = h.receivers(2)
        cluster.setup(None, raw_bytes=max(sum(sizes), sum(ws_sizes)))
        source = packed_source(tensors, layout, sizes)
        ws_source = packed_source(tensors, ws_layout, ws_sizes)

        def push(checksums: bool, zero_copy: bool):
            def run() -> float:
                return trainer.push(tensors, delta=False, checksums=checksums,
                                    **({} if zero_copy else {"zero_copy_min_bytes": NO_ZERO_COPY}))
            return run

        runners = {
            f"raw ({len(sizes)} greedy buckets)": lambda: cluster.run_raw(source, sizes),
            f"raw (SDK plan, {len(ws_sizes)} buckets)": lambda: cluster.run_raw(ws_source, ws_sizes),
            "weightsync (default: no bucket checksums on CPU)": push(False, True),
            "weightsync checksums=True": push(True, True),
            "weightsync packed buckets (no zero-copy)": push(False, False),
            "weightsync packed, checksums=True": push(True, False),
        }
        times = alternate(runners, args.reps, f"breakdown {wl.name}")
    rows = {mode: {"seconds": [round(s, 4) for s in v], "median_seconds": round(statistics.median(v), 4)}
            for mode, v in times.items()}
    print(f"{wl.name}: {wl.tensor_count} tensors, {wl.total_bytes / 1e9:.3f} GB, 2 receivers, load {load.summary()}")
    for mode, row in rows.items():
        print(f"  {mode:<45} median {row['median_seconds']:.3f} s  {row['seconds']}")
    out.write_text(json.dumps({"workload": wl.name, "bytes": wl.total_bytes, "tensors": wl.tensor_count,
                                          "load": load.summary(), "modes": rows}, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
