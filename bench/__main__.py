"""`python -m bench [--quick]`: the side-by-side benchmark.

Starts real weightsync servers (one per receiver, 1 CPU worker each: a server holds the model
once per node) and baseline receiver processes,
runs raw / weightsync / concat / per_tensor alternately on the dense, moe and
tiny workloads, measures the one-tensor update latency and the scaling curves,
and writes bench/results/latest.{json,md} plus PNG plots.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench import delta as delta_bench
from bench import engine_apply, machine, multi_sender, node_inline, node_store, report, workloads
from bench import transports as transport_bench
from bench.baselines import packed_source, strided_subset
from bench.harness import (
    FULL,
    MB,
    QUICK,
    Harness,
    alternate,
    median,
    nbytes,
    plan_layout,
    sdk_layout,
)
from bench.progress import log

MODES = ("raw", "weightsync", "concat", "per_tensor")
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

    trainer = h.weightsync(receivers=receivers, adding_bytes=size)
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
    trainer = h.weightsync(receivers=2, adding_bytes=nbytes(probe))
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
    trainer = h.weightsync(receivers=receivers, adding_bytes=nbytes(tensors))
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
    parser.add_argument("--before", metavar="PYTHON",
                        help="node_store: also measure the weightsync of this interpreter's tree (another worktree's "
                             ".venv/bin/python, e.g. of 44fabba) as 'before'; default: this tree only")
    parser.add_argument("--rounds", type=int,
                        help="node_store: rounds per side, run in turn (default: 2 with --before, 1 otherwise or --quick)")
    parser.add_argument("--only", choices=["main", "latency", "scaling", "load", "transports", "engine", "node", "delta",
                                           "node_store", "multi_sender", "pause", "host_path"],
                        action="append",
                        help="run only these parts (repeatable); default: all but node_store and multi_sender ("
                             "--only host_path writes bench/results/host-path.{md,json}, with --before PYTHON that "
                             "tree's figures beside; "
                             "--only node_store --before PYTHON writes bench/results/node_store.{md,json}; "
                             "--only multi_sender writes bench/results/multi-sender-cpu.md; --only pause, in "
                             ".venv-engine, writes bench/results/pause.md: bench/pause.py)")
    parser.add_argument("--link-rate", default="300mbit", help="multi_sender: each sender's link (tc rate, e.g. 300mbit)")
    parser.add_argument("--model-mib", type=int, help="multi_sender: the model's MiB (default 128, 64 with --quick)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.reps:
        cfg = replace(cfg, reps=args.reps)
    if args.receiver_threads is not None:
        cfg = replace(cfg, receiver_threads=args.receiver_threads)
    if args.diagnostics is not None:
        cfg = replace(cfg, diagnostics=args.diagnostics)
    # node_store is asked for by name (--only node_store): it compares against another tree (--before), runs
    # three servers per side, and writes node_store.{md,json} of its own.
    parts = set(args.only or ["main", "latency", "scaling", "load", "transports", "engine", "node", "delta",
                              "host_path"])
    if "host_path" in parts:  # its own servers; writes bench/results/host-path.{md,json} (bench/host_path.py)
        from bench import host_path

        host_path.main(["--out", args.out, "--reps", str(max(7, args.reps or 9)),
                        *(["--before", args.before, "--rounds", str(args.rounds or 1)] if args.before else [])])
        parts.discard("host_path")
        if not parts:
            return 0
    if "pause" in parts:  # vLLM's pause per update: its own vLLM servers, in the engine virtualenv
        from bench import pause
        from weightsync.common.logging import configure_logging

        configure_logging("warning")
        pause.run(pause.QUICK_SIZES if args.quick else pause.DEFAULT_SIZES, args.quick, Path(args.out),
                  "python -m bench " + " ".join(sys.argv[1:]))
        parts.discard("pause")
        if not parts:
            return 0
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
        transports = None
        if "transports" in parts:
            transports = transport_bench.run(h, [workloads.dense(cfg.dense_scale), workloads.moe(cfg.moe_scale)])
        engine = engine_apply.run(h, workloads.dense(cfg.dense_scale)) if "engine" in parts else None
        node = node_inline.run(h, workloads.dense(cfg.dense_scale)) if "node" in parts else None
        if "delta" in parts:
            h.stop_server()  # room for the two servers of the delta bench
        delta = delta_bench.run(Path(tmp), quick=args.quick) if "delta" in parts else None
        if "node_store" in parts:
            h.stop_server()  # room for the three servers of each side
            started_node_store, load_node_store = time.monotonic(), machine.load_average()
            stores = node_store.run(Path(tmp), quick=args.quick, before=args.before,
                                    rounds=args.rounds or (2 if args.before and not args.quick else 1))
        if "multi_sender" in parts:  # its own servers, in a network namespace of their own
            h.stop_server()
            senders = multi_sender.run(quick=args.quick, rate=args.link_rate, model_mib=args.model_mib)
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
    if "node_store" in parts:
        stores_meta = {"machine": machine.one_line(host), "command": "python -m bench " + " ".join(sys.argv[1:]),
                       "elapsed_seconds": round(time.monotonic() - started_node_store, 1),
                       "load_before": load_node_store, "load_after": machine.load_average()}
        (out_dir / "node_store.json").write_text(json.dumps(stores | {"meta": stores_meta}, indent=2) + "\n")
        (out_dir / "node_store.md").write_text(node_store.markdown(stores, stores_meta))
        log(f"node_store: wrote {out_dir}/node_store.json and node_store.md")
        if parts == {"node_store"}:  # latest.* stay what the last run of the other parts wrote
            print(node_store.markdown(stores, stores_meta))
            return 0
    if "multi_sender" in parts:
        header = (f"# Several senders, one version (CPU)\n\nMachine: {machine.one_line(host).split(';')[0]}. Command: "
                  f"`python -m bench {' '.join(sys.argv[1:])}`. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
                  f"Ran {seconds:.0f} s; 1-minute load average before/after: {load_before} / "
                  f"{machine.load_average()}.\n")
        (out_dir / "multi-sender-cpu.md").write_text(header + multi_sender.markdown(senders))
        log(f"multi_sender: wrote {out_dir}/multi-sender-cpu.md")
        if parts == {"multi_sender"}:  # latest.* stay what the last run of the other parts wrote
            print(header + multi_sender.markdown(senders))
            return 0
    if delta is not None:
        delta_meta = {"machine": machine.one_line(host), "command": "python -m bench " + " ".join(sys.argv[1:]),
                      "elapsed_seconds": round(seconds, 1), "load_before": load_before,
                      "load_after": machine.load_average()}
        header = (f"# Sending only what changed\n\nMachine: {delta_meta['machine']}. Command: `{delta_meta['command']}`. "
                  f"Ran {delta_meta['elapsed_seconds']:.0f} s; 1-minute load average before/after: "
                  f"{delta_meta['load_before']} / {delta_meta['load_after']}.\n")
        (out_dir / "delta.json").write_text(json.dumps(delta | {"meta": delta_meta}, indent=2) + "\n")
        (out_dir / "delta.md").write_text(header + delta_bench.markdown(delta))
        log(f"delta: wrote {out_dir}/delta.json and delta.md")
        if parts == {"delta"}:  # latest.* stay what the last run of the other parts wrote
            print(header + delta_bench.markdown(delta))
            return 0
    results = {
        "runs": runs,
        "ratios": report.ratios(runs),
        "one_tensor_update_ms": None if latency_ms is None else round(latency_ms, 3),
        "scaling": scaling,
        "load": control_load,
        "transports": transports,
        "engine_apply": engine,
        "node_inline": node,
        "delta": delta,
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
    if transports is not None:
        markdown += transport_bench.markdown(transports)
    if engine is not None:
        markdown += engine_apply.markdown(engine)
    if node is not None:
        markdown += node_inline.markdown(node)
    if delta is not None:
        markdown += delta_bench.markdown(delta)
    (out_dir / "latest.md").write_text(markdown)
    log(f"done in {seconds:.0f} s; wrote {out_dir}/latest.json, latest.md, latest.meta.json and {len(plots)} plots")
    print(report.summary(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
