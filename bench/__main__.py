"""`python -m bench [--quick]`: the side-by-side benchmark of issue 5.

Starts a real weightsync server (2 CPU workers) and baseline receiver processes,
runs raw / weightsync / concat / per_tensor alternately on the dense, moe and
tiny workloads, measures the one-tensor update latency and the scaling curves,
and writes bench/results/latest.{json,md} plus PNG plots.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench import machine, report, workloads
from bench.baselines import BaselineCluster, packed_source, strided_subset
from bench.progress import log
from bench.servers import Server, WeightSyncTrainer

MODES = ("raw", "weightsync", "concat", "per_tensor")
MB = 1 << 20
GB = 1 << 30


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    reps: int
    """Timed repetitions of every mode in the main comparison (after one warm-up each)."""
    scaling_reps: int
    bucket_bytes: int
    dense_scale: float
    moe_scale: float
    tiny_count: int
    per_tensor_limit: int
    """per_tensor runs on at most this many tensors (a strided sample) and is scaled
    linearly to the whole workload; 0 runs every tensor."""
    latency_samples: int
    bytes_points: tuple[int, ...]
    bytes_tensor_size: int
    count_bytes: int
    count_points: tuple[int, ...]
    receivers_bytes: int
    receivers_tensors: int
    receivers_points: tuple[int, ...]
    store_budget_bytes: int
    """Most bytes a server's workers may hold before the harness starts a fresh server."""
    diagnostics: bool
    """Also time weightsync with checksums=True (the CUDA default), and raw with the SDK's own bucket plan
    (reported in latest.meta.json and latest.md, not in latest.json's runs)."""
    receiver_threads: int = 1
    """torch intra-op threads of each baseline receiver (see bench/receiver.py)."""
    trainer_threads: int = 1
    """torch intra-op threads of this process (the trainer of every mode). The SDK runs
    push() with one thread whatever this says; one thread here gives concat's torch.cat
    the same condition (with more, OpenMP barriers stall on the 2 busy cores)."""


FULL = Config(
    name="full", reps=5, scaling_reps=3, bucket_bytes=256 * MB,
    dense_scale=1.0, moe_scale=1.0, tiny_count=5000, per_tensor_limit=0, latency_samples=60,
    bytes_points=(128 * MB, 256 * MB, 512 * MB, 1024 * MB, 2048 * MB), bytes_tensor_size=8 * MB,
    count_bytes=256 * MB, count_points=(8, 64, 512, 4096, 16384),
    receivers_bytes=512 * MB, receivers_tensors=64, receivers_points=(1, 2, 4),
    store_budget_bytes=int(2.5 * GB), diagnostics=True,
)
QUICK = Config(
    name="quick", reps=3, scaling_reps=2, bucket_bytes=64 * MB,
    dense_scale=0.25, moe_scale=0.25, tiny_count=1500, per_tensor_limit=0, latency_samples=30,
    bytes_points=(32 * MB, 64 * MB, 128 * MB, 256 * MB), bytes_tensor_size=4 * MB,
    count_bytes=64 * MB, count_points=(4, 64, 512, 4096),
    receivers_bytes=128 * MB, receivers_tensors=32, receivers_points=(1, 2, 4),
    store_budget_bytes=int(1.5 * GB), diagnostics=False,
)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def median(values: list[float]) -> float:
    return statistics.median(values)


class Harness:
    """Owns every process the benchmark starts: at most one server and one receiver set at a time."""

    def __init__(self, cfg: Config, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.server: Server | None = None
        self.trainer: WeightSyncTrainer | None = None
        self.cluster: BaselineCluster | None = None
        self.server_starts = 0
        self.processes: list = []
        """Every Popen started (servers, receivers), to check they all ended."""
        self.shm: set[str] = set()
        """Every shared-memory segment a server of ours had mapped."""

    def weightsync(self, workers: int, adding_bytes: int) -> WeightSyncTrainer:
        """A trainer joined to a server with `workers` workers that can hold `adding_bytes` more."""
        s = self.server
        if s is not None and s.workers == workers and s.store_bytes + adding_bytes <= self.cfg.store_budget_bytes:
            assert self.trainer is not None
            return self.trainer
        self.stop_server()
        self.server = Server(workers, self.workdir)
        self.server_starts += 1
        self.processes.append(self.server.process)
        self.shm |= self.server.shm
        self.trainer = WeightSyncTrainer(self.server, self.cfg.bucket_bytes)
        return self.trainer

    def receivers(self, count: int) -> BaselineCluster:
        if self.cluster is not None and self.cluster.receivers == count:
            return self.cluster
        self.stop_cluster()
        self.cluster = BaselineCluster(count, self.workdir, threads=self.cfg.receiver_threads)
        self.processes += self.cluster.procs
        return self.cluster

    def stop_server(self) -> None:
        trainer, self.trainer = self.trainer, None
        server, self.server = self.server, None
        try:
            if trainer is not None:
                trainer.close()
        finally:
            if server is not None:
                code = server.stop()
                log(f"server stopped (exit {code})")

    def stop_cluster(self) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.close()
            log("baseline receivers stopped")

    def close(self) -> None:
        try:
            self.stop_cluster()
        finally:
            self.stop_server()

    def leftovers(self) -> dict:
        """Processes still running and shared-memory segments still present (both should be empty)."""
        running = [p.pid for p in self.processes if p.poll() is None]
        segments = sorted(n for n in self.shm if Path("/dev/shm", n).exists())
        return {"processes": running, "shm_segments": segments}

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def alternate(runners: dict[str, Callable[[], float]], reps: int, label: str) -> dict[str, list[float]]:
    """One warm-up of every mode, then A B C D A B C D ... `reps` times."""
    for mode, run in runners.items():
        seconds = run()
        log(f"{label}: warm-up {mode} {seconds:.3f} s")
    out: dict[str, list[float]] = {mode: [] for mode in runners}
    for rep in range(reps):
        for mode, run in runners.items():
            seconds = run()
            out[mode].append(seconds)
        log(f"{label}: rep {rep + 1}/{reps} " + " ".join(f"{m}={v[-1]:.3f}s" for m, v in out.items()))
    return out


def plan_layout(tensors: dict[str, torch.Tensor], bucket_bytes: int):
    """Greedy buckets of up to bucket_bytes in input order, tensors at 64-byte aligned
    offsets (weightsync.common.layout.plan_buckets): the layout raw and concat use."""
    from weightsync.common.layout import TensorMeta, plan_buckets

    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes)
    sizes = [b.size_bytes for b in buckets]
    layout = [[(p.meta.name, p.offset_bytes, p.meta.size_bytes) for p in b.tensors] for b in buckets]
    return sizes, layout


def sdk_layout(tensors: dict[str, torch.Tensor], bucket_bytes: int):
    """The bucket plan the SDK itself makes for these tensors (it may give large
    tensors buckets of their own): sizes and placement."""
    from weightsync.client.planning import build_plan

    planned = build_plan(list(tensors.items()), bucket_bytes)
    sizes = [p.spec.size_bytes for p in planned]
    layout = [[(t.name, t.offset_bytes, t.size_bytes) for t in p.spec.tensors] for p in planned]
    return sizes, layout


def run_entry(workload: str, mode: str, size: int, tensors: int, receivers: int, seconds: list[float], **extra) -> dict:
    entry = {"workload": workload, "mode": mode, "bytes": size, "tensors": tensors, "receivers": receivers,
             "seconds": [round(s, 6) for s in seconds], "median_seconds": round(median(seconds), 6)}
    entry.update(extra)
    return entry


# -- the main comparison ------------------------------------------------------------
def compare_workload(h: Harness, wl: workloads.Workload, diagnostics: dict) -> list[dict]:
    cfg = h.cfg
    receivers = 2
    log(f"workload {wl.name}: {wl.tensor_count} tensors, {wl.total_bytes / 1e9:.3f} GB; materialising")
    tensors = wl.materialize(prefix=f"{wl.name}.")
    size = nbytes(tensors)
    items = list(tensors.items())
    sizes, layout = plan_layout(tensors, cfg.bucket_bytes)
    groups = [[(name, tensors[name]) for name, _, _ in bucket] for bucket in layout]
    ws_sizes, ws_layout = sdk_layout(tensors, cfg.bucket_bytes)
    log(f"workload {wl.name}: raw/concat {len(sizes)} buckets of up to {max(sizes) / MB:.0f} MiB; "
        f"the SDK plans {len(ws_sizes)} buckets")

    trainer = h.weightsync(workers=receivers, adding_bytes=size)
    trainer.define(tensors)
    cluster = h.receivers(receivers)
    raw_bytes = max(sum(sizes), sum(ws_sizes)) if cfg.diagnostics else sum(sizes)
    cluster.setup(tensors, raw_bytes=raw_bytes)
    source = packed_source(tensors, layout, sizes)
    ws_source = packed_source(tensors, ws_layout, ws_sizes) if cfg.diagnostics else None

    subset = strided_subset(items, cfg.per_tensor_limit)
    factor = len(items) / len(subset)
    runners: dict[str, Callable[[], float]] = {
        "raw": lambda: cluster.run_raw(source, sizes),
        "weightsync": lambda: trainer.push(tensors),
        "concat": lambda: cluster.run_concat(groups),
        "per_tensor": lambda: cluster.run_per_tensor(subset) * factor,
    }
    if cfg.diagnostics:
        runners["weightsync_with_checksums"] = lambda: trainer.push(tensors, checksums=True)
        runners["raw_sdk_buckets"] = lambda: cluster.run_raw(ws_source, ws_sizes)
    times = alternate(runners, cfg.reps, wl.name)
    trainer.verify(tensors)
    if cfg.diagnostics:  # raw_sdk_buckets ran last and left its own layout in the raw buffers
        cluster.verify(None, ws_source, sum(ws_sizes))
        cluster.run_raw(source, sizes)  # untimed, so the greedy layout is checked too
    cluster.verify(tensors, source, sum(sizes))
    log(f"{wl.name}: verified: every receiver of every mode holds the trainer's bytes")
    runs = []
    for mode in MODES:
        extra: dict = {"buckets": len(sizes) if mode in ("raw", "concat") else len(items)}
        if mode == "weightsync":
            extra = {"buckets": trainer.last.bucket_count, "zero_copy_buckets": trainer.last.zero_copy_buckets}
        if mode == "per_tensor" and factor != 1.0:
            extra |= {"extrapolated_from_tensors": len(subset), "measured_seconds": [round(s / factor, 6) for s in times[mode]],
                      "extrapolation": "strided sample of tensors, time scaled by tensors/sampled"}
        runs.append(run_entry(wl.name, mode, size, len(items), receivers, times[mode], **extra))
    if cfg.diagnostics:
        for mode, buckets in (("weightsync_with_checksums", len(ws_sizes)), ("raw_sdk_buckets", len(ws_sizes))):
            diagnostics.setdefault(mode, []).append(
                run_entry(wl.name, mode, size, len(items), receivers, times[mode], buckets=buckets))
    cluster.free()
    return runs  # the tensors and buffers go with this frame


def one_tensor_latency(h: Harness) -> tuple[float, list[float]]:
    probe = {"probe.model.norm.weight": torch.ones(896, dtype=torch.bfloat16)}
    trainer = h.weightsync(workers=2, adding_bytes=nbytes(probe))
    trainer.define(probe)
    for _ in range(3):
        trainer.push(probe)
    samples = [trainer.push(probe) * 1000 for _ in range(h.cfg.latency_samples)]
    ms = median(samples)
    log(f"one-tensor update: median {ms:.2f} ms over {len(samples)} pushes (min {min(samples):.2f}, max {max(samples):.2f})")
    return ms, samples


# -- scaling curves ------------------------------------------------------------------
def flat_point(h: Harness, wl: workloads.Workload, receivers: int, label: str, reps: int) -> dict[str, list[float]]:
    """weightsync and raw, alternately, on one flat workload."""
    tensors = wl.materialize(prefix=f"{wl.name}.")
    sizes, layout = plan_layout(tensors, h.cfg.bucket_bytes)
    trainer = h.weightsync(workers=receivers, adding_bytes=nbytes(tensors))
    trainer.define(tensors)
    cluster = h.receivers(receivers)
    cluster.setup(None, raw_bytes=sum(sizes))
    source = packed_source(tensors, layout, sizes)
    times = alternate({"raw": lambda: cluster.run_raw(source, sizes),
                       "weightsync": lambda: trainer.push(tensors)}, reps, label)
    trainer.verify(tensors)
    cluster.verify(None, source, sum(sizes))
    cluster.free()
    return times


def points(times: dict[str, list[float]], **fields) -> list[dict]:
    out = []
    for mode, seconds in times.items():
        m = median(seconds)
        entry = dict(fields, mode=mode, seconds=[round(s, 6) for s in seconds], median_seconds=round(m, 6))
        if "bytes" in fields:
            entry["gbps"] = round(fields["bytes"] / m / 1e9, 3)
        out.append(entry)
    return out


def scaling_bytes(h: Harness) -> dict:
    cfg = h.cfg
    out = {"receivers": 2, "tensor_bytes": cfg.bytes_tensor_size, "bucket_bytes": cfg.bucket_bytes, "points": []}
    for total in cfg.bytes_points:
        count = max(1, total // cfg.bytes_tensor_size)
        wl = workloads.flat(total, count, name=f"bytes{total // MB}m")
        log(f"scaling/bytes: {wl.total_bytes / MB:.0f} MiB in {count} tensors")
        times = flat_point(h, wl, 2, f"bytes {total // MB} MiB", cfg.scaling_reps)
        gc.collect()
        out["points"] += points(times, bytes=wl.total_bytes, tensors=count)
    out["fit"] = {mode: report.linear_fit([(p["bytes"] / 1e9, p["median_seconds"]) for p in out["points"] if p["mode"] == mode])
                  for mode in ("raw", "weightsync")}
    return out


def scaling_count(h: Harness) -> dict:
    cfg = h.cfg
    out = {"receivers": 2, "bytes": cfg.count_bytes, "bucket_bytes": cfg.bucket_bytes, "points": []}
    for count in cfg.count_points:
        wl = workloads.flat(cfg.count_bytes, count, name=f"count{count}")
        log(f"scaling/tensor_count: {count} tensors, {wl.total_bytes / MB:.0f} MiB")
        times = flat_point(h, wl, 2, f"count {count}", cfg.scaling_reps)
        gc.collect()
        out["points"] += points(times, bytes=wl.total_bytes, tensors=count)
    out["fit"] = {mode: report.linear_fit([(p["tensors"], p["median_seconds"]) for p in out["points"] if p["mode"] == mode])
                  for mode in ("raw", "weightsync")}
    return out


def scaling_receivers(h: Harness) -> dict:
    cfg = h.cfg
    out = {"bytes": cfg.receivers_bytes, "tensors": cfg.receivers_tensors, "bucket_bytes": cfg.bucket_bytes, "points": []}
    # Start with the receiver count already running (2), then the others.
    order = sorted(cfg.receivers_points, key=lambda n: (n != 2, n))
    for n in order:
        wl = workloads.flat(cfg.receivers_bytes, cfg.receivers_tensors, name=f"recv{n}")
        log(f"scaling/receivers: {n} workers, {wl.total_bytes / MB:.0f} MiB")
        times = flat_point(h, wl, n, f"receivers {n}", cfg.scaling_reps)
        gc.collect()
        out["points"] += points(times, receivers=n, bytes=wl.total_bytes, tensors=cfg.receivers_tensors)
    out["points"].sort(key=lambda p: (p["receivers"], p["mode"]))
    return out


# -- entry point ------------------------------------------------------------------
def _sigterm(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions (< 3 minutes)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    parser.add_argument("--reps", type=int, help="override the repetitions of the main comparison")
    parser.add_argument("--receiver-threads", type=int, help="torch threads per baseline receiver (0: torch default)")
    parser.add_argument("--per-tensor-limit", type=int,
                        help="run per_tensor on a strided sample of at most N tensors and scale linearly "
                             "(labelled extrapolated_from_tensors in latest.json); default: every tensor")
    parser.add_argument("--trainer-threads", type=int, help="torch threads of the trainer process (0: torch default)")
    parser.add_argument("--diagnostics", action=argparse.BooleanOptionalAction,
                        help="also time weightsync with checksums=True and raw with the SDK's bucket plan "
                             "(default: on in full runs)")
    parser.add_argument("--only", choices=["main", "latency", "scaling", "load"], action="append",
                        help="run only these parts (repeatable); default: all")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.reps:
        cfg = replace(cfg, reps=args.reps)
    if args.receiver_threads is not None:
        cfg = replace(cfg, receiver_threads=args.receiver_threads)
    if args.diagnostics is not None:
        cfg = replace(cfg, diagnostics=args.diagnostics)
    parts = set(args.only or ["main", "latency", "scaling", "load"])
    if args.per_tensor_limit is not None:
        cfg = replace(cfg, per_tensor_limit=args.per_tensor_limit)
    if args.trainer_threads is not None:
        cfg = replace(cfg, trainer_threads=args.trainer_threads)
    if cfg.trainer_threads > 0:
        torch.set_num_threads(cfg.trainer_threads)
    signal.signal(signal.SIGTERM, _sigterm)
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    host = machine.describe()
    load_before = machine.load_average()
    log(f"{cfg.name} run on {machine.one_line(host)}", load=load_before)
    started = time.monotonic()
    runs: list[dict] = []
    diagnostics: dict = {}
    latency_ms: float | None = None
    latency_samples: list[float] = []
    scaling: dict = {}
    with (machine.LoadSampler() as load, tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp,
          Harness(cfg, Path(tmp)) as h):
        if "main" in parts:
            suite = [workloads.dense(cfg.dense_scale), workloads.moe(cfg.moe_scale), workloads.tiny(cfg.tiny_count)]
            for wl in suite:
                runs += compare_workload(h, wl, diagnostics)
                gc.collect()
        if "latency" in parts:
            latency_ms, latency_samples = one_tensor_latency(h)
        if "scaling" in parts:
            scaling["tensor_count"] = scaling_count(h)
            scaling["bytes"] = scaling_bytes(h)
            scaling["receivers"] = scaling_receivers(h)
        server_starts = h.server_starts
        control_load = None
        if "load" in parts:
            from bench import load as load_bench

            control_load = load_bench.run(reps=3 if args.quick else 5, calls=200, workdir=Path(tmp))
            log(f"load: {control_load['calls_succeeded']} calls ok, {control_load['calls_failed']} failed; update "
                f"{control_load['median_quiet_seconds']:.3f} s quiet, {control_load['median_loaded_seconds']:.3f} s "
                f"under load ({control_load['slowdown'] * 100:+.1f}%)")
    leftovers = h.leftovers()
    log(f"cleanup: {len(h.processes)} processes started, still running: {leftovers['processes'] or 'none'}; "
        f"{len(h.shm)} shared-memory segments used, still present: {leftovers['shm_segments'] or 'none'}")
    seconds = time.monotonic() - started
    results = {
        "runs": runs,
        "ratios": report.ratios(runs),
        "one_tensor_update_ms": None if latency_ms is None else round(latency_ms, 3),
        "scaling": scaling,
        "load": control_load,
    }
    meta = {
        "config": asdict(cfg),
        "machine": host,
        "load_average_before": load_before,
        "load_average_after": machine.load_average(),
        "load_average_during": load.summary(),
        "elapsed_seconds": round(seconds, 1),
        "server_starts": server_starts,
        "leftovers": leftovers,
        "one_tensor_update_samples_ms": [round(s, 3) for s in latency_samples],
        "diagnostics": diagnostics,
        "argv": sys.argv[1:],
    }
    (out_dir / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "latest.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    plots = report.plots(scaling, out_dir)
    markdown = report.markdown(results, meta, plots)
    if control_load is not None:
        markdown += (
            f"\n## Control-plane load during an update\n\n{control_load['concurrent_calls_per_update']} concurrent "
            f"GetServerInfo + Health/Check calls fired while a {control_load['update_bytes'] / 1e9:.2f} GB update runs: "
            f"{control_load['calls_succeeded']} succeeded, {control_load['calls_failed']} failed; the update took "
            f"{control_load['median_loaded_seconds']:.3f} s against {control_load['median_quiet_seconds']:.3f} s without "
            f"them ({control_load['slowdown'] * 100:+.1f}%, medians of alternated runs).\n"
        )
    (out_dir / "latest.md").write_text(markdown)
    log(f"done in {seconds:.0f} s; wrote {out_dir}/latest.json, latest.md, latest.meta.json and {len(plots)} plots")
    print(report.summary(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
