"""latest.json helpers, the markdown table and the PNG plots."""

from __future__ import annotations

from pathlib import Path

TARGETS = {
    "weightsync_vs_raw": (("dense", "moe"), 0.90),
    "weightsync_vs_concat": (("dense",), 1.5),
    "weightsync_vs_per_tensor": (("moe", "tiny"), 5.0),
}
ONE_TENSOR_TARGET_MS = 10.0


def ratios(runs: list[dict]) -> dict:
    """median_seconds(X) / median_seconds(weightsync), per workload (> 1: weightsync faster)."""
    by = {(r["workload"], r["mode"]): r["median_seconds"] for r in runs}
    out: dict[str, dict] = {}
    for workload in dict.fromkeys(r["workload"] for r in runs):
        ws = by.get((workload, "weightsync"))
        if not ws:
            continue
        out[workload] = {
            f"weightsync_vs_{mode}": round(by[(workload, mode)] / ws, 3)
            for mode in ("raw", "concat", "per_tensor")
            if (workload, mode) in by
        }
    return out


def linear_fit(xy: list[tuple[float, float]]) -> dict:
    """Least squares y = intercept + slope * x, with R²."""
    n = len(xy)
    if n < 2:
        return {}
    mx = sum(x for x, _ in xy) / n
    my = sum(y for _, y in xy) / n
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    sxy = sum((x - mx) * (y - my) for x, y in xy)
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for _, y in xy)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in xy)
    r2 = 1 - ss_res / ss_tot if ss_tot else 1.0
    return {"slope": round(slope, 9), "intercept": round(intercept, 6), "r2": round(r2, 4)}


def target_checks(results: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) rows."""
    rows = []
    for key, (workloads, threshold) in TARGETS.items():
        for workload in workloads:
            value = results["ratios"].get(workload, {}).get(key)
            met = None if value is None else value >= threshold
            rows.append((f"{key} >= {threshold:g} on {workload}", "n/a" if value is None else f"{value:.2f}", met))
    ms = results.get("one_tensor_update_ms")
    rows.append((f"one-tensor update <= {ONE_TENSOR_TARGET_MS:g} ms", "n/a" if ms is None else f"{ms:.2f} ms",
                 None if ms is None else ms <= ONE_TENSOR_TARGET_MS))
    return rows


def _load(meta: dict) -> str:
    during = meta.get("load_average_during") or {}
    if not during:
        return f"{meta['load_average_before'][:1]} before, {meta['load_average_after'][:1]} after"
    return f"min {during['min']}, median {during['median']}, max {during['max']}"


def _fmt_s(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def markdown(results: dict, meta: dict, plots: list[str]) -> str:
    from bench.machine import one_line

    cfg = meta["config"]
    lines = [
        f"# weightsync benchmark ({cfg['name']} run)",
        "",
        f"Machine: {one_line(meta['machine'])}.",
        "",
        "These are CPU/Gloo figures: CPU tensors broadcast with ProcessGroupGloo over loopback TCP "
        "between processes on one host; they say nothing about NCCL on GPUs.",
        "",
        f"Run: {meta['elapsed_seconds']:.0f} s, bucket size {cfg['bucket_bytes'] >> 20} MiB, "
        f"{cfg['reps']} timed repetitions per mode after one warm-up each, modes alternated "
        f"(raw, weightsync, concat, per_tensor, ...), medians shown. 1-minute load average during the run "
        f"(the machine is shared; 2 cores): {_load(meta)}.",
        "",
        "## Full updates (median seconds; 2 receivers)",
        "",
        "raw and concat use greedy buckets of the bucket size (weightsync.common.layout.plan_buckets); "
        "weightsync uses the SDK's own plan (buckets column: the SDK's count; it may give large tensors "
        "buckets of their own); per_tensor sends one broadcast per tensor.",
        "",
        "| workload | tensors | GB | buckets raw / ws | raw | weightsync | concat | per_tensor | weightsync GB/s "
        "| vs raw | vs concat | vs per_tensor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["workload"], r["mode"]): r for r in results["runs"]}
    notes = []
    for workload, ratio in results["ratios"].items():
        ws = by[(workload, "weightsync")]
        cells = []
        for mode in ("raw", "weightsync", "concat", "per_tensor"):
            run = by.get((workload, mode))
            cell = _fmt_s(run["median_seconds"] if run else None)
            if run and "extrapolated_from_tensors" in run:
                cell += "*"
                notes.append(f"\\* per_tensor on {workload}: measured on {run['extrapolated_from_tensors']} of "
                             f"{run['tensors']} tensors (strided sample), scaled linearly.")
            cells.append(cell)
        gbps = ws["bytes"] / ws["median_seconds"] / 1e9
        lines.append(
            f"| {workload} | {ws['tensors']} | {ws['bytes'] / 1e9:.3f} | {by[(workload, 'raw')].get('buckets', '')} / {ws.get('buckets', '')} | {' | '.join(cells)} "
            f"| {gbps:.2f} | {ratio.get('weightsync_vs_raw', 0):.2f} | {ratio.get('weightsync_vs_concat', 0):.2f} "
            f"| {ratio.get('weightsync_vs_per_tensor', 0):.2f} |"
        )
    lines += ["", "Ratios are median_seconds(mode) / median_seconds(weightsync): above 1 means weightsync is faster.", ""]
    lines += notes + ([""] if notes else [])
    diag = meta.get("diagnostics", {})
    if diag.get("weightsync_with_checksums"):
        lines += ["Diagnostic (not in latest.json runs): weightsync with per-bucket WS64 checksums "
                  "(`checksums=True`, the default on CUDA), same alternation: "
                  + ", ".join(f"{d['workload']} {d['median_seconds']:.3f} s" for d in diag["weightsync_with_checksums"]) + ".", ""]
    if diag.get("raw_sdk_buckets"):
        lines += ["Diagnostic: raw with the SDK's own bucket plan instead of greedy buckets: "
                  + ", ".join(f"{d['workload']} {d['median_seconds']:.3f} s ({d['buckets']} buckets)" for d in diag["raw_sdk_buckets"]) + ".", ""]
    ms = results.get("one_tensor_update_ms")
    if ms is not None:
        lines += [f"One-tensor update (push() to Committed, a 1.75 KiB norm, plan reused): median **{ms:.2f} ms** "
                  f"over {len(meta.get('one_tensor_update_samples_ms', []))} pushes.", ""]
    lines += ["## Targets", "", "| target | measured | met |", "|---|---:|:---:|"]
    for target, measured, met in target_checks(results):
        lines.append(f"| {target} | {measured} | {'n/a' if met is None else ('yes' if met else 'no')} |")
    scaling = results.get("scaling", {})
    if scaling:
        lines += ["", "## Scaling (median seconds)", ""]
    if "bytes" in scaling:
        s = scaling["bytes"]
        lines += [f"Time against total bytes ({s['tensor_bytes'] >> 20} MiB tensors, {s['receivers']} receivers):", "",
                  "| MiB | tensors | raw | weightsync | raw GB/s | weightsync GB/s |", "|---:|---:|---:|---:|---:|---:|"]
        lines += _pair_rows(s["points"], lambda p: (p["bytes"], p["tensors"]), lambda k: f"{k[0] >> 20} | {k[1]}", gbps=True)
        for mode, fit in s.get("fit", {}).items():
            if fit:
                lines.append(f"\n{mode}: {fit['slope']:.3f} s/GB + {fit['intercept']:.3f} s (R² {fit['r2']:.3f})")
        lines.append("")
    if "tensor_count" in scaling:
        s = scaling["tensor_count"]
        lines += [f"Time against tensor count at {s['bytes'] >> 20} MiB ({s['receivers']} receivers):", "",
                  "| tensors | raw | weightsync |", "|---:|---:|---:|"]
        lines += _pair_rows(s["points"], lambda p: p["tensors"], str)
        fit = s.get("fit", {}).get("weightsync")
        if fit:
            lines.append(f"\nweightsync: {fit['slope'] * 1e6:.1f} µs per tensor + {fit['intercept']:.3f} s (R² {fit['r2']:.3f})")
        lines.append("")
    if "receivers" in scaling:
        s = scaling["receivers"]
        lines += [f"Time against receivers ({s['bytes'] >> 20} MiB, {s['tensors']} tensors; weightsync: N servers "
                  "with 1 worker each, N nodes; raw: N receiver processes):", "",
                  "| receivers | raw | weightsync |", "|---:|---:|---:|"]
        lines += _pair_rows(s["points"], lambda p: p["receivers"], str)
        lines.append("")
    if plots:
        lines += ["Plots: " + ", ".join(f"[{p}]({p})" for p in plots), ""]
    lines += METHOD.format(receiver_threads=cfg.get("receiver_threads", 1),
                           trainer_threads=cfg.get("trainer_threads", 1)).splitlines()
    left = meta.get("leftovers")
    if left is not None:
        lines += ["", f"Cleanup: still running after the run: {left['processes'] or 'no process'}; shared-memory "
                  f"segments of the servers still present: {left['shm_segments'] or 'none'}."]
    lines += ["", "Raw data: latest.json (the issue's shape) and latest.meta.json (configuration, machine, "
              "load samples, one-tensor samples, diagnostics).", ""]
    return "\n".join(lines)


METHOD = """## Method

- Every mode moves the same bf16 tensors (each its own storage, like an ordinary model's
  parameters) from this process (rank 0, the trainer) to 2 receiver processes, and is timed
  from the first byte of work to the moment every receiver holds the last byte.
- `weightsync`: `WeightSyncClient.push()` against 2 real `weightsync-server --workers 1
  --device cpu` subprocesses (2 nodes: a server holds the model once whatever its workers, and
  Gloo sends each bucket to one worker per server, so 2 servers hold 2 copies as raw's 2
  receivers do; plan reused, IN_PLACE, default options: bucket checksums are off on CPU), timed from the
  push() call to Committed. The first push of a tensor set (which defines the server's
  store) is not timed.
- `raw`: plain `ProcessGroupGloo.broadcast` of the same bytes, one bucket after another,
  from one preallocated, touched send buffer into preallocated, touched buffers on
  `python -m bench.receiver` processes; receivers are told the bucket list before the clock
  starts and report over a control socket after the last bucket. No gRPC, no packing.
- `concat`: per bucket, `torch.cat` of the flattened tensors, one control round trip
  carrying names/dtypes/shapes, a fresh `torch.empty` receive buffer on every receiver,
  unpack by slicing and `copy_` into the receivers' parameters, answer after unpacking.
- `per_tensor`: per tensor, one control round trip (name/dtype/shape) and one broadcast of
  the tensor into a fresh buffer, `copy_` into the parameter, answer after the copy.
- The baselines' control channel is length-prefixed JSON over a plain TCP socket
  (TCP_NODELAY), cheaper than a gRPC call, so it favours the baselines.
- Threads: the baseline receivers run torch with {receiver_threads} intra-op thread(s) and the
  trainer process with {trainer_threads} (the weightsync workers and the SDK's push() use one
  thread by their own choice). With torch's default (one thread per core) every copy of more
  than 32K elements wakes an OpenMP team, which on this busy 2-core host costs several ms
  per copy: measured per_tensor steps of 128 KiB tensors took 8.1 ms instead of 0.9 ms.
- Modes alternate (raw, weightsync, concat, per_tensor, raw, ...) after one untimed warm-up
  of each; medians of the timed repetitions are reported. The machine is shared with
  other work, hence the load figures above; alternation spreads that noise over all modes.
"""


def _pair_rows(points: list[dict], key, label, gbps: bool = False) -> list[str]:
    grouped: dict = {}
    for p in points:
        grouped.setdefault(key(p), {})[p["mode"]] = p
    rows = []
    for k in sorted(grouped):
        raw, ws = grouped[k].get("raw"), grouped[k].get("weightsync")
        row = f"| {label(k)} | {_fmt_s(raw and raw['median_seconds'])} | {_fmt_s(ws and ws['median_seconds'])} |"
        if gbps:
            row += f" {raw['gbps'] if raw else '—'} | {ws['gbps'] if ws else '—'} |"
        rows.append(row)
    return rows


def plots(scaling: dict, out_dir: Path) -> list[str]:
    """PNG plots of the scaling curves; returns the file names written."""
    if not scaling:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    specs = [
        ("bytes", "scaling_bytes.png", lambda p: p["bytes"] / 1e9, "total bytes (GB)", "time against total bytes", False),
        ("tensor_count", "scaling_tensors.png", lambda p: p["tensors"], "tensors (fixed total bytes)",
         "time against tensor count", True),
        ("receivers", "scaling_receivers.png", lambda p: p["receivers"], "receivers (nodes)", "time against receivers", False),
    ]
    for key, filename, x_of, xlabel, title, logx in specs:
        curve = scaling.get(key)
        if not curve:
            continue
        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        for mode, style in (("raw", "o--"), ("weightsync", "s-")):
            pts = sorted((x_of(p), p["median_seconds"]) for p in curve["points"] if p["mode"] == mode)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=mode)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("median seconds")
        ax.set_title(f"{title} (CPU/Gloo)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / filename)
        plt.close(fig)
        written.append(filename)
    return written


def summary(results: dict, meta: dict) -> str:
    lines = [f"{'workload':<8} {'mode':<11} {'median s':>9} {'GB/s':>6}"]
    for r in results["runs"]:
        lines.append(f"{r['workload']:<8} {r['mode']:<11} {r['median_seconds']:>9.3f} {r['bytes'] / r['median_seconds'] / 1e9:>6.2f}")
    for workload, ratio in results["ratios"].items():
        lines.append(f"{workload}: " + ", ".join(f"{k}={v:.2f}" for k, v in ratio.items()))
    if results.get("one_tensor_update_ms") is not None:
        lines.append(f"one-tensor update: {results['one_tensor_update_ms']:.2f} ms")
    for target, measured, met in target_checks(results):
        lines.append(f"target {target}: {measured} -> {'n/a' if met is None else ('met' if met else 'MISSED')}")
    lines.append(f"elapsed {meta['elapsed_seconds']:.0f} s")
    return "\n".join(lines)
