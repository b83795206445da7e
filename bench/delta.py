"""Sending only what changed: `python -m bench --only delta`.

Against servers (2 CPU workers each) started here: the pushes with the SDK's default
(delta="auto") go to one, dense pushes of the same tensors to another, alternated, so each server
holds exactly what its client committed last:
  - a density sweep (0.1% .. 50% of the elements changed, spread at random; one-ulp changes on
    every transport, random new values on COLLECTIVE): what auto sends, and what patches
    everywhere (delta=True, to a third server) send, their times against dense, and the trainer's
    diff on its own against a memcpy of the model in the same process (the diff reads two copies:
    memcpy bandwidth bounds it);
  - a real fine-tune: the Qwen-shaped dense workload as bf16 parameters with fp32 master weights,
    AdamW steps at lr 1e-6, 3e-6 and 1e-5 (gradients drawn at random: the optimizer, not the loss,
    decides how many bf16 values move), 10 steps each, on COLLECTIVE, INLINE and SHM;
  - a link slower than loopback (bench/delta_link.py: tc tbf at 1 and 10 Gbit/s in a network
    namespace of its own), dense against auto at 1% and 3% changed.
Every push is verified against the trainer's tensors.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from bench import workloads
from bench.harness import median
from bench.progress import log
from bench.servers import Server

SWEEP = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.5)
TRANSPORTS = ("collective", "inline", "shm")
LEARNING_RATES = (1e-6, 3e-6, 1e-5)
VALUES = ("ulp", "random")
"""How the changed elements change: one ulp (a bit flip in the lowest mantissa bit: what a small
AdamW step does to bf16 weights), or new random values (every byte of the element moves)."""


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
    """What the SDK runs on host tensors: the compiled compare-and-encode, on torch's threads."""
    from weightsync.common import patch_kernels

    patch_kernels.compare_many([(base[name], tensor, None) for name, tensor in new.items()], torch.get_num_threads())


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
    for lr in LEARNING_RATES:
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
                                allow_new_tensors=True)
                previous = {n: t.clone() for n, t in params.items()}
                for step in range(steps):
                    params = run.step()
                    row = rows.setdefault((lr, step), {"lr": lr, "step": step,
                                                       "changed_fraction": round(changed_fraction(previous, params), 6)})
                    t_dense, _ = _timed(dense.push, params, version=f"d{step}", transport=transport,
                                        bucket_size_bytes=bucket_bytes, delta=False)
                    t_delta, result = _timed(delta.push, params, version=f"p{step}", transport=transport,
                                             bucket_size_bytes=bucket_bytes)  # the default: delta="auto"
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


def _scatter_change(tensors: dict[str, torch.Tensor], fraction: float, seed: int,
                    values: str = "ulp") -> dict[str, torch.Tensor]:
    """A copy with about `fraction` of each tensor's elements changed, at random places. Places are
    drawn with repetition (fast on 10^8 elements, where randperm takes seconds): -n ln(1 - f) draws
    hit f n distinct places on average."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in tensors.items():
        new = tensor.clone()
        flat = new.view(-1)
        n = flat.numel()
        draws = n if fraction >= 1 else round(-n * math.log1p(-fraction))
        if draws:
            picks = torch.randint(n, (draws,), generator=g)
            if values == "ulp":
                flat.view(torch.int16)[picks] ^= 1  # a repeated place is flipped once: gather, xor, scatter
            else:
                flat[picks] = torch.randn(draws, generator=g).to(flat.dtype)
        out[name] = new
    return out


def sweep(servers: tuple[Server, Server, Server], scale: float, reps: int, bucket_bytes: int) -> list[dict]:
    """One-ulp changes on every transport, random values on COLLECTIVE."""
    tensors = {n: t.to(torch.bfloat16) for n, t in workloads.dense(scale).materialize(prefix="dense.").items()}
    rows = []
    for transport in TRANSPORTS:
        for values in VALUES if transport == "collective" else ("ulp",):
            rows += _sweep_block(servers, tensors, transport, values, reps, bucket_bytes)
    return rows


def _sweep_block(servers: tuple[Server, Server, Server], tensors: dict[str, torch.Tensor], transport: str,
                 values: str, reps: int, bucket_bytes: int) -> list[dict]:
    from weightsync.client import WeightSyncClient

    size = sum(t.numel() * t.element_size() for t in tensors.values())
    rows = []
    delta_server, dense_server, forced_server = servers
    with WeightSyncClient(delta_server.address, timeout=600) as delta, \
            WeightSyncClient(dense_server.address, timeout=600) as dense, \
            WeightSyncClient(forced_server.address, timeout=600) as forced:
        if transport == "collective":
            for client in (delta, dense, forced):
                client.create_group(timeout=120)
        current = tensors
        push = dict(transport=transport, bucket_size_bytes=bucket_bytes)
        for client in (delta, dense, forced):
            client.push(current, version="sweep-start", allow_new_tensors=True, **push)
        for fraction in SWEEP:
            t_dense, t_delta, t_forced, t_diff, t_copy, sent, forced_sent = [], [], [], [], [], 0, 0
            scratch = {n: torch.empty_like(t) for n, t in current.items()}
            _copy_all(scratch, current)
            for rep in range(reps):
                new = _scatter_change(current, fraction, seed=int(fraction * 1e6) + rep, values=values)
                # The diff alone (the SDK's compare-and-encode of every tensor) and a memcpy of the model
                # into touched memory (fresh pages would time page faults), in this process.
                t_diff.append(_timed(_diff_all, current, new)[0])
                t_copy.append(_timed(_copy_all, scratch, new)[0])
                t_dense.append(_timed(dense.push, new, version=f"d{fraction}-{rep}", delta=False, **push)[0])
                elapsed, result = _timed(delta.push, new, version=f"p{fraction}-{rep}", **push)  # the default: auto
                t_delta.append(elapsed)
                sent = result.bytes_sent
                elapsed, result = _timed(forced.push, new, version=f"f{fraction}-{rep}", delta=True, **push)
                t_forced.append(elapsed)
                forced_sent = result.bytes_sent
                current = new
            if not (delta.verify(current).ok and forced.verify(current).ok):
                raise RuntimeError(f"delta sweep {transport} {values} {fraction}: a worker does not hold the "
                                   "trainer's tensors")
            diff_gbps = 2 * size / median(t_diff) / 1e9  # it reads both copies
            copy_gbps = 2 * size / median(t_copy) / 1e9  # read + write
            row = {"transport": transport, "values": values, "changed_fraction": fraction, "bytes_sent": sent,
                   "dense_bytes": size, "sent_fraction": round(sent / size, 4),
                   "dense_seconds": round(median(t_dense), 4), "delta_seconds": round(median(t_delta), 4),
                   "speedup": round(median(t_dense) / median(t_delta), 2),
                   "speedup_of_means": round(sum(t_dense) / sum(t_delta), 2),
                   "forced_sent_fraction": round(forced_sent / size, 4), "forced_seconds": round(median(t_forced), 4),
                   "forced_speedup": round(median(t_dense) / median(t_forced), 2),
                   "diff_seconds": round(median(t_diff), 4), "diff_gbps": round(diff_gbps, 2),
                   "memcpy_gbps": round(copy_gbps, 2), "diff_vs_memcpy": round(diff_gbps / copy_gbps, 2)}
            log(f"delta sweep {transport} {values} {fraction * 100:g}% changed: auto sent "
                f"{row['sent_fraction'] * 100:.2f}% of the bytes, {row['speedup']:.2f}x dense (patches everywhere: "
                f"{row['forced_speedup']:.2f}x); diff {diff_gbps:.1f} GB/s ({row['diff_vs_memcpy']:.2f}x memcpy)")
            rows.append(row)
    return rows


def _frames(row: dict) -> str:
    """How much of the model's bytes went as zstd frames, before compression and on the wire (the last push)."""
    before = row.get("compressed_fraction", 0.0)
    if not before:
        return "none"
    after = before - (row["planned_fraction"] - row["sent_fraction"])
    return f"{before * 100:.2f}% / {after * 100:.2f}%"


LINKS = (("1gbit", "1mb"), ("10gbit", "8mb"))
"""tc tbf rate and burst of the slow links (the burst at least the rate over the kernel's timer tick)."""


def run(workdir: Path, *, quick: bool) -> dict:
    from bench import delta_link

    scale = 0.25 if quick else 1.0
    bucket = (64 if quick else 256) << 20
    extra = ("--local-socket", "auto", "--ingress-slot-bytes", str(bucket))
    servers = (Server(2, workdir, extra=extra), Server(2, workdir, extra=extra), Server(2, workdir, extra=extra))
    try:
        swept = sweep(servers, scale, reps=2 if quick else 5, bucket_bytes=bucket)
        tune = fine_tune(servers[:2], scale, steps=3 if quick else 10, bucket_bytes=bucket)
    finally:
        for server in servers:
            server.stop()
    links = [delta_link.run_limited(rate, burst, scale=0.25 if not quick else 0.0625, reps=5 if not quick else 2,
                                    bucket_bytes=64 << 20) for rate, burst in LINKS]
    return {"scale": scale, "fine_tune": tune, "sweep": swept, "links": links,
            "goals": {"sent_at_1pct": 0.015, "speedup_at_1pct": 3.0, "sent_at_3pct": 0.04, "speedup_at_3pct": 2.0,
                      "diff_vs_memcpy": 0.6, "auto_floor": 0.95, "speedup_at_3pct_1gbit": 15.0}}


def markdown(result: dict) -> str:
    lines = ["", "## Sending only what changed", "",
             f"Dense workload at scale {result['scale']}, bf16, servers with 2 CPU workers. `x dense` = "
             "median dense push time / median time of the same tensors pushed with the SDK's default, "
             "delta='auto' (the trainer's diff and kept-copy refresh included); above 1 is faster.", "",
             "Density sweep (`auto`: the default; `patches`: delta=True, a patch wherever it is smaller; "
             "`of means`: total dense time / total auto time over the repetitions, the kept copy's "
             "occasional refresh included; the diff: the SDK's compare-and-encode of every tensor, reading "
             "both copies, against a memcpy of the model in the same process):", "",
             "| transport | values | changed | auto bytes sent | auto x dense | of means | patches bytes sent | "
             "patches x dense | dense s | diff GB/s | memcpy GB/s | diff / memcpy |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["sweep"]:
        lines.append(f"| {row['transport']} | {row['values']} | {row['changed_fraction'] * 100:g}% | "
                     f"{row['sent_fraction'] * 100:.2f}% | {row['speedup']:.2f}x | {row['speedup_of_means']:.2f}x | "
                     f"{row['forced_sent_fraction'] * 100:.2f}% | {row['forced_speedup']:.2f}x | "
                     f"{row['dense_seconds']:.3f} | {row['diff_gbps']:.1f} | {row['memcpy_gbps']:.1f} | "
                     f"{row['diff_vs_memcpy']:.2f} |")
    lines += ["", "Fine-tune (AdamW on fp32 masters, random gradients, bf16 pushed; per lr and transport the "
              "same trajectory, auto to one server and dense to another, alternated):", "",
              "| lr | step | elements changed | " + " | ".join(f"{t} bytes sent / x dense" for t in TRANSPORTS) + " |",
              "|---|---:|---:|" + "---:|" * len(TRANSPORTS)]
    for row in result["fine_tune"]:
        cells = [f"{row[t]['bytes_sent'] / row[t]['dense_bytes'] * 100:.2f}% / {row[t]['speedup']:.2f}x"
                 for t in TRANSPORTS]
        lines.append(f"| {row['lr']:g} | {row['step']} | {row['changed_fraction'] * 100:.3f}% | " + " | ".join(cells) + " |")
    lines += ["", "A slower link (bench/delta_link.py: a network namespace whose loopback a tc token-bucket "
              "filter holds to the rate; dense workload at scale 0.25, one-ulp changes):", "",
              "| link | transport | changed | dense s | dense Gbit/s | auto s | auto bytes sent | of which zstd frames "
              "(before / after) | auto x dense |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for link in result.get("links", []):
        if "skipped" in link:
            lines.append(f"| {link['rate']} | not measured: {link['skipped']} | | | | | | | |")
            continue
        for row in link["rows"]:
            lines.append(f"| {link['rate']} | {row['transport']} | {row['changed_fraction'] * 100:g}% | "
                         f"{row['dense_seconds']:.3f} | {row['dense_gbit_per_s']:.2f} | {row['auto_seconds']:.3f} | "
                         f"{row['sent_fraction'] * 100:.2f}% | {_frames(row)} | {row['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"
