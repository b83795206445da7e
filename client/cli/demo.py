"""`make demo`: the main job end to end, on this machine.

Starts a server with 2 CPU workers, writes a synthetic Qwen-style checkpoint
(~0.46 GB bf16, 290 tensors with norms and biases), pushes four versions with
the SDK's defaults, that is delta="auto" (the first whole; then two RL-like steps at a small learning rate,
where most bf16 weights round back to the same bits, as patches; then a step at
ten times that rate, which auto sends dense on host tensors), verifies
checksums after each, prints a table with the bytes each push sent against a
dense push, and stops the server cleanly. Exits non-zero if anything fails.
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

from weightsync.client.cli.checkpoint import load_checkpoints, save_checkpoint
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


FINE_LR = 3e-7
"""An RL step: about 0.4% of the bf16 weights change, the smallest first, so auto sends patches
(about 1% of the dense bytes; the norms and some small biases do not change and stay out)."""
COARSE_LR = 3e-6
"""The last step: about 3.5% change, above where patches pay on host tensors over loopback (about 2.3%,
client/delta/policy.py): it goes dense."""


def next_version(master: dict[str, torch.Tensor], model: dict[str, torch.Tensor], step: int, *, lr: float) -> None:
    """An optimizer step as the trainer sees it: the fp32 master weights move by lr-sized noise
    (an Adam step is about lr in size, whatever the weight's), and the bf16 weights pushed are the
    master rounded. A bf16 weight changes only once its master has moved half a bf16 step away
    (2^-9 to 2^-8 of |w|): weights near zero do, the norms at 1.0 never do at these rates."""
    g = torch.Generator().manual_seed(step)
    for name, weights in master.items():
        weights.add_(torch.randn(weights.shape, generator=g), alpha=lr)
        model[name].copy_(weights)


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
    parser.add_argument("--versions", type=int, default=4, help=f"the last one at lr {COARSE_LR:g} (dense)")
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
            master = {name: tensor.float() for name, tensor in model.items()}  # the trainer's fp32 copy
            total = sum(t.numel() * t.element_size() for t in model.values())
            print(f"server {address} with 2 CPU workers; model: {len(model)} tensors, {total / 1e9:.2f} GB bf16", flush=True)
            with WeightSyncClient([address]) as client:
                worker_pids = [w.pid for w in client.server_info()[0].workers]
                client.create_group(timeout=60)
                for step in range(1, args.versions + 1):
                    if step > 1:
                        next_version(master, model, step, lr=FINE_LR if step < args.versions else COARSE_LR)
                    path = workdir / f"model-v{step}.safetensors"
                    save_checkpoint(model, path)
                    tensors = load_checkpoints([path])
                    result = client.push(tensors, version=f"v{step}", bucket_size_bytes=128 << 20)
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
        print(f"{'version':<8} {'tensors':>8} {'bytes sent':>12} {'dense bytes':>12} {'of dense':>9} {'seconds':>8} "
              f"{'GB/s':>6}  verified")
        for version, tensors, sent, dense, seconds, ok in rows:
            print(f"{version:<8} {tensors:>8} {sent:>12} {dense:>12} {sent / dense:>9.2%} {seconds:>8.3f} "
                  f"{dense / seconds / 1e9:>6.2f}  {ok}")
        print("(tensors: those sent, unchanged ones stay out; GB/s: the model's dense bytes over the push's seconds)")
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
