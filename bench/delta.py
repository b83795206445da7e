"""Sending only what changed (issue 18): `python -m bench --only delta`.

Two parts, against servers (2 CPU workers each) started here: the delta pushes go to one, the
dense pushes of the same tensors to another, alternated, so each server holds exactly what its
client committed last:
  - a real fine-tune: the Qwen-shaped dense workload as bf16 parameters with fp32 master weights,
    AdamW steps at lr 1e-6 and 1e-5 (gradients drawn at random: the optimizer, not the loss,
    decides how many bf16 values move), 10 steps each; per step the fraction of elements whose
    bits changed, what push(delta="auto") sent, and its time against a dense push of the same
    tensors, on COLLECTIVE, INLINE and SHM, alternated;
  - a density sweep (0.1% .. 50% of the elements changed, spread at random): what auto sends,
    and what patches everywhere (delta=True, to a third server) send, their times against dense
    (where auto switches, and why), and the trainer's diff on its own against a memcpy of the model in
    the same process (the diff reads two copies: memcpy bandwidth bounds it).
Every push is verified against the trainer's tensors.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench import workloads
from bench.harness import median
from bench.progress import log
from bench.servers import Server

SWEEP = (0.001, 0.005, 0.01, 0.02, 0.05, 0.2, 0.5)
TRANSPORTS = ("collective", "inline", "shm")


class FineTune:
    """bf16 parameters, fp32 master weights, AdamW (torch.optim.AdamW on the masters)."""

    def __init__(self, tensors: dict[str, torch.Tensor], lr: float, seed: int = 0) -> None:
        self.names = list(tensors)
        self.master = [tensors[n].float().clone().requires_grad_(False) for n in self.names]
        self.params = {n: tensors[n].to(torch.bfloat16) for n in self.names}
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> dict[str, torch.Tensor]:
        for master in self.master:
            master.grad = torch.randn(master.shape, generator=self.generator) * 1e-3
        self.optimizer.step()
        with torch.no_grad():
            for name, master in zip(self.names, self.master, strict=True):
                self.params[name].copy_(master)
        return self.params


def changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    changed = sum(int((before[n].view(torch.int16) != after[n].view(torch.int16)).sum()) for n in after)
    return changed / sum(t.numel() for t in after.values())


def _timed(call, *args, **kwargs) -> tuple[float, object]:
    started = time.perf_counter()
    result = call(*args, **kwargs)
    return time.perf_counter() - started, result


def _diff_all(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    from weightsync.common.patches import changes_between

    for name, tensor in new.items():
        changes_between(base[name], tensor)


def _copy_all(targets: dict[str, torch.Tensor], sources: dict[str, torch.Tensor]) -> None:
    for name, tensor in sources.items():
        targets[name].copy_(tensor)


def fine_tune(servers: tuple[Server, Server], scale: float, steps: int, bucket_bytes: int) -> list[dict]:
    """Per lr and transport, the same trajectory: dense pushes to one server, delta to the other
    (each server then holds exactly the previous step for its client), alternated step by step."""
    from weightsync.client import WeightSyncClient

    delta_server, dense_server = servers
    rows: dict[tuple[float, int], dict] = {}
    base = workloads.dense(scale).materialize(prefix="dense.")
    for lr in (1e-6, 1e-5):
        for transport in TRANSPORTS:
            run = FineTune(base, lr)
            with WeightSyncClient(delta_server.address, timeout=600) as delta, \
                    WeightSyncClient(dense_server.address, timeout=600) as dense:
                if transport == "collective":
                    delta.create_group(timeout=120)
                    dense.create_group(timeout=120)
                params = run.params
                for client in (delta, dense):
                    client.push(params, version="start", transport=transport, bucket_size_bytes=bucket_bytes,
                                allow_new_tensors=True, delta="auto")
                previous = {n: t.clone() for n, t in params.items()}
                for step in range(steps):
                    params = run.step()
                    row = rows.setdefault((lr, step), {"lr": lr, "step": step,
                                                       "changed_fraction": round(changed_fraction(previous, params), 6)})
                    t_dense, _ = _timed(dense.push, params, version=f"d{step}", transport=transport,
                                        bucket_size_bytes=bucket_bytes, delta=False)
                    t_delta, result = _timed(delta.push, params, version=f"p{step}", transport=transport,
                                             bucket_size_bytes=bucket_bytes, delta="auto")
                    row[transport] = {"dense_seconds": round(t_dense, 4), "delta_seconds": round(t_delta, 4),
                                      "bytes_sent": result.bytes_sent, "dense_bytes": result.dense_bytes,
                                      "speedup": round(t_dense / t_delta, 2)}
                    previous = {n: t.clone() for n, t in params.items()}
                    log(f"delta fine-tune lr={lr:g} {transport} step {step}: {row['changed_fraction'] * 100:.3f}% "
                        f"changed, {result.bytes_sent / result.dense_bytes * 100:.2f}% of the bytes sent, "
                        f"{t_dense / t_delta:.2f}x dense")
                if not delta.verify(params).ok:
                    raise RuntimeError(f"delta lr={lr} {transport}: a worker does not hold the trainer's tensors")
    return [rows[k] for k in sorted(rows)]


def _scatter_change(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in tensors.items():
        new = tensor.clone()
        flat = new.view(-1).view(torch.int16)
        count = int(flat.numel() * fraction)
        if count:
            flat[torch.randperm(flat.numel(), generator=g)[:count]] ^= 1
        out[name] = new
    return out


def sweep(servers: tuple[Server, Server, Server], scale: float, reps: int, bucket_bytes: int) -> list[dict]:
    from weightsync.client import WeightSyncClient

    tensors = {n: t.to(torch.bfloat16) for n, t in workloads.dense(scale).materialize(prefix="dense.").items()}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    rows = []
    delta_server, dense_server, forced_server = servers
    with WeightSyncClient(delta_server.address, timeout=600) as delta, \
            WeightSyncClient(dense_server.address, timeout=600) as dense, \
            WeightSyncClient(forced_server.address, timeout=600) as forced:
        for client in (delta, dense, forced):
            client.create_group(timeout=120)
        current = tensors
        for client in (delta, dense, forced):
            client.push(current, version="sweep-start", bucket_size_bytes=bucket_bytes, allow_new_tensors=True,
                        delta="auto")
        for fraction in SWEEP:
            t_dense, t_delta, t_forced, t_diff, t_copy, sent, forced_sent = [], [], [], [], [], 0, 0
            scratch = {n: torch.empty_like(t) for n, t in current.items()}
            _copy_all(scratch, current)
            for rep in range(reps):
                new = _scatter_change(current, fraction, seed=int(fraction * 1e6) + rep)
                # The diff alone (every tensor compared: positions, values, WS64 change) and a memcpy of
                # the model into touched memory (fresh pages would time page faults), in this process.
                t_diff.append(_timed(_diff_all, current, new)[0])
                t_copy.append(_timed(_copy_all, scratch, new)[0])
                t_dense.append(_timed(dense.push, new, version=f"d{fraction}-{rep}", bucket_size_bytes=bucket_bytes,
                                      delta=False)[0])
                elapsed, result = _timed(delta.push, new, version=f"p{fraction}-{rep}", bucket_size_bytes=bucket_bytes,
                                         delta="auto")
                t_delta.append(elapsed)
                sent = result.bytes_sent
                elapsed, result = _timed(forced.push, new, version=f"f{fraction}-{rep}", bucket_size_bytes=bucket_bytes,
                                         delta=True)
                t_forced.append(elapsed)
                forced_sent = result.bytes_sent
                current = new
            if not (delta.verify(current).ok and forced.verify(current).ok):
                raise RuntimeError(f"delta sweep {fraction}: a worker does not hold the trainer's tensors")
            diff_gbps = 2 * size / median(t_diff) / 1e9  # it reads both copies
            copy_gbps = 2 * size / median(t_copy) / 1e9  # read + write
            row = {"changed_fraction": fraction, "bytes_sent": sent, "dense_bytes": size,
                   "sent_fraction": round(sent / size, 4), "dense_seconds": round(median(t_dense), 4),
                   "delta_seconds": round(median(t_delta), 4), "speedup": round(median(t_dense) / median(t_delta), 2),
                   "forced_sent_fraction": round(forced_sent / size, 4), "forced_seconds": round(median(t_forced), 4),
                   "forced_speedup": round(median(t_dense) / median(t_forced), 2),
                   "diff_seconds": round(median(t_diff), 4), "diff_gbps": round(diff_gbps, 2),
                   "memcpy_gbps": round(copy_gbps, 2), "diff_vs_memcpy": round(diff_gbps / copy_gbps, 2)}
            log(f"delta sweep {fraction * 100:g}% changed: sent {row['sent_fraction'] * 100:.2f}% of the bytes, "
                f"{row['speedup']:.2f}x dense (patches everywhere: {row['forced_speedup']:.2f}x); diff {diff_gbps:.1f} GB/s ({row['diff_vs_memcpy']:.2f}x memcpy)")
            rows.append(row)
    return rows


def run(workdir: Path, *, quick: bool) -> dict:
    scale = 0.25 if quick else 1.0
    bucket = (64 if quick else 256) << 20
    extra = ("--local-socket", "auto", "--ingress-slot-bytes", str(bucket))
    servers = (Server(2, workdir, extra=extra), Server(2, workdir, extra=extra), Server(2, workdir, extra=extra))
    try:
        swept = sweep(servers, scale, reps=2 if quick else 3, bucket_bytes=bucket)
        tune = fine_tune(servers[:2], scale, steps=3 if quick else 10, bucket_bytes=bucket)
    finally:
        for server in servers:
            server.stop()
    return {"scale": scale, "fine_tune": tune, "sweep": swept,
            "goals": {"sent_at_1pct": 0.05, "speedup_at_1pct": 3.0, "diff_vs_memcpy": 0.5, "auto_at_50pct": 1 / 1.1}}


def markdown(result: dict) -> str:
    lines = ["", "## Sending only what changed (issue 18)", "",
             f"Dense workload at scale {result['scale']}, bf16, one server with 2 CPU workers. `x dense` = "
             "median dense push time / median delta push time (the trainer's diff included); above 1 is faster.", "",
             "Fine-tune (AdamW, fp32 masters, bf16 pushed):", "",
             "| lr | step | elements changed | " + " | ".join(f"{t} bytes sent / x dense" for t in TRANSPORTS) + " |",
             "|---|---:|---:|" + "---:|" * len(TRANSPORTS)]
    for row in result["fine_tune"]:
        cells = [f"{row[t]['bytes_sent'] / row[t]['dense_bytes'] * 100:.2f}% / {row[t]['speedup']:.2f}x"
                 for t in TRANSPORTS]
        lines.append(f"| {row['lr']:g} | {row['step']} | {row['changed_fraction'] * 100:.3f}% | " + " | ".join(cells) + " |")
    lines += ["", "Density sweep (COLLECTIVE; `auto`: delta='auto', `patches`: delta=True, a patch wherever it is "
              "smaller; the diff: every tensor compared in full):", "",
              "| changed | auto bytes sent | auto s | patches bytes sent | patches s | dense s | auto x dense | "
              "patches x dense | diff GB/s | memcpy GB/s | diff / memcpy |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["sweep"]:
        lines.append(f"| {row['changed_fraction'] * 100:g}% | {row['sent_fraction'] * 100:.2f}% | "
                     f"{row['delta_seconds']:.3f} | {row['forced_sent_fraction'] * 100:.2f}% | {row['forced_seconds']:.3f} | "
                     f"{row['dense_seconds']:.3f} | {row['speedup']:.2f}x | {row['forced_speedup']:.2f}x | "
                     f"{row['diff_gbps']:.1f} | {row['memcpy_gbps']:.1f} | {row['diff_vs_memcpy']:.2f} |")
    return "\n".join(lines) + "\n"
