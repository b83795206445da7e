"""`make demo`: the main job end to end, on this machine.

Starts a server with 2 CPU workers, writes a synthetic Qwen-style checkpoint
(~0.46 GB bf16, 290 tensors with norms and biases), pushes four versions with
changed weights (delta="auto": the first whole, then two sparse RL-like steps
as patches, then a step that moves every weight, dense again), verifies
checksums after each, prints a table with the bytes each push sent, and stops
the server cleanly. Exits non-zero if anything fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from weightsync.client.checkpoint import load_checkpoints, save_checkpoint
from weightsync.client.sdk import WeightSyncClient


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """A small Qwen2-style decoder (tied embeddings)."""

    vocab: int = 32_000
    hidden: int = 896
    layers: int = 24
    intermediate: int = 2_432
    kv_dim: int = 128


def synthetic_model(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def weight(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * 0.02).to(torch.bfloat16)

    h, kv, ff = shape.hidden, shape.kv_dim, shape.intermediate
    tensors = {"model.embed_tokens.weight": weight(shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": weight(h, h),
            p + "self_attn.q_proj.bias": weight(h),
            p + "self_attn.k_proj.weight": weight(kv, h),
            p + "self_attn.k_proj.bias": weight(kv),
            p + "self_attn.v_proj.weight": weight(kv, h),
            p + "self_attn.v_proj.bias": weight(kv),
            p + "self_attn.o_proj.weight": weight(h, h),
            p + "mlp.gate_proj.weight": weight(ff, h),
            p + "mlp.up_proj.weight": weight(ff, h),
            p + "mlp.down_proj.weight": weight(h, ff),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return tensors


SPARSE_FRACTION = 0.003
"""An RL step at a small learning rate: most bf16 weights round back to the same bits."""


def next_version(tensors: dict[str, torch.Tensor], step: int, *, sparse: bool) -> None:
    """What an optimizer step looks like from outside. Sparse: SPARSE_FRACTION of each tensor's
    elements move by one bf16 step (the rest stay bit-identical); otherwise every tensor moves."""
    if not sparse:
        for t in tensors.values():
            t.mul_(1.0 - 1e-3 * step).add_(1e-3 * step)
        return
    g = torch.Generator().manual_seed(step)
    for t in tensors.values():
        bits = t.view(-1).view(torch.int16)
        bits[torch.randint(0, bits.numel(), (max(1, int(bits.numel() * SPARSE_FRACTION)),), generator=g)] ^= 1


def start_server(workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / "server.ready"
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        [sys.executable, "-m", "weightsync.server.cli", "--listen", "127.0.0.1:0", "--workers", "2",
         "--device", "cpu", "--ready-file", str(ready), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("server did not start:\n" + (workdir / "server.log").read_text())
        time.sleep(0.05)
    return process, f"127.0.0.1:{json.loads(ready.read_text())['port']}"


def server_segments(pid: int) -> set[str]:
    """The shared-memory segments a process has mapped (its worker queues)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync-demo")
    parser.add_argument("--versions", type=int, default=4, help="the last one moves every weight (dense)")
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args(argv)
    shape = ModelShape(layers=args.layers)
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as tmp:
        workdir = Path(tmp)
        server, address = start_server(workdir)
        segments = server_segments(server.pid)
        if len(segments) != 4:  # a command and an event queue per worker
            raise RuntimeError(f"expected 4 queue segments, the server maps {sorted(segments)}")
        rows = []
        worker_pids: list[int] = []
        try:
            model = synthetic_model(shape, seed=0)
            total = sum(t.numel() * t.element_size() for t in model.values())
            print(f"server {address} with 2 CPU workers; model: {len(model)} tensors, {total / 1e9:.2f} GB bf16", flush=True)
            with WeightSyncClient([address]) as client:
                worker_pids = [w.pid for w in client.server_info()[0].workers]
                client.create_group(timeout=60)
                for step in range(1, args.versions + 1):
                    if step > 1:
                        next_version(model, step, sparse=step < args.versions)
                    path = workdir / f"model-v{step}.safetensors"
                    save_checkpoint(model, path)
                    tensors = load_checkpoints([path])
                    result = client.push(tensors, version=f"v{step}", bucket_size_bytes=128 << 20, delta="auto")
                    verified = client.verify(tensors)
                    rows.append((result.version, result.tensor_count, result.bytes_sent, result.dense_bytes,
                                 result.seconds, "yes" if verified.ok else f"NO ({len(verified.mismatches)})"))
                    path.unlink()
                    if not verified.ok:
                        raise RuntimeError(f"version v{step}: {len(verified.mismatches)} tensors differ")
        finally:
            server.send_signal(signal.SIGTERM)
            code = server.wait(60)
        print()
        print(f"{'version':<8} {'tensors':>8} {'bytes sent':>12} {'of dense':>9} {'seconds':>8}  verified")
        for version, tensors, sent, dense, seconds, ok in rows:
            print(f"{version:<8} {tensors:>8} {sent:>12} {sent / dense:>9.2%} {seconds:>8.3f}  {ok}")
        leaked = {name for name in segments if (Path("/dev/shm") / name).exists()}
        orphans = [pid for pid in worker_pids if Path(f"/proc/{pid}").exists()]
        if orphans:
            print(f"worker processes left behind: {orphans}", file=sys.stderr)
            return 1
        if code != 0:
            print(f"server exited with {code}", file=sys.stderr)
            return 1
        if leaked:
            print(f"shared-memory segments left behind: {sorted(leaked)}", file=sys.stderr)
            return 1
    print("\nserver stopped cleanly; no process or shared-memory segment left behind")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
