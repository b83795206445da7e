"""Commit -> engine serving: applying a committed version to a model, against a plain copy.

One server (1 CPU worker, its local socket) holds the dense workload. This process is the
engine: a torch module whose parameters carry the workload's names. Alternately:

  copy_baseline   `module.load_state_dict(tensors)` from tensors already in this process:
                  what any engine pays to take new weights, with no transfer at all;
  engine_apply    acquire the committed version (a lease; the store mapped read-only, no
                  copy) and `apply_to_module` every tensor, then release;
  push            the trainer's push alone (SHM: trainer and server share the host);
  push_served     the same push, then the engine's follower applying what changed: push
                  start -> the engine serving it.

apply_vs_copy = median(engine_apply) / median(copy_baseline) (goal <= 1.5);
served_vs_push = median(push_served) / median(push).
"""

from __future__ import annotations

import time

import torch

from bench import workloads
from bench.harness import Harness, alternate, median, nbytes
from bench.progress import log
from bench.servers import Server

MODES = ("copy_baseline", "engine_apply", "push", "push_served")
GOAL_APPLY_VS_COPY = 1.5


def module_with(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state_dict has exactly these names, shapes and dtypes (fresh zeros)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = owner._modules.get(part)  # noqa: SLF001 - building the tree by name
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    return root


def _timer(action) -> callable:
    def run() -> float:
        started = time.perf_counter()
        action()
        return time.perf_counter() - started
    return run


def run(h: Harness, wl: workloads.Workload) -> dict:
    from weightsync.client import WeightSyncClient
    from weightsync.engine import EngineClient, ModuleFollower, apply_to_module

    cfg = h.cfg
    h.stop_server()  # room for this server's store
    server = Server(1, h.workdir)
    h.processes.append(server.process)
    h.shm |= server.shm
    tensors = wl.materialize(prefix=f"{wl.name}.")
    size = nbytes(tensors)
    model = module_with(tensors)
    try:
        with WeightSyncClient(server.address, timeout=300) as trainer, \
                EngineClient(server=server.address, name="bench") as engine:
            trainer.push(tensors, version="define", transport="shm", allow_new_tensors=True,
                         bucket_size_bytes=cfg.bucket_bytes)
            follower = ModuleFollower(engine, model)
            follower.update()  # the warm start: every tensor

            def engine_apply() -> None:
                with engine.acquire() as snapshot:
                    apply_to_module(model, snapshot)

            def push() -> None:
                trainer.push(tensors, version=f"v{time.monotonic_ns()}", transport="shm",
                             bucket_size_bytes=cfg.bucket_bytes)

            def push_served() -> None:
                push()
                if not follower.update():
                    raise RuntimeError("the follower saw no new version after a commit")

            times = alternate({"copy_baseline": _timer(lambda: model.load_state_dict(tensors)),
                               "engine_apply": _timer(engine_apply), "push": _timer(push),
                               "push_served": _timer(push_served)}, cfg.reps, f"engine apply {wl.name}")
            follower.update()
            mismatched = [n for n, p in model.state_dict().items() if not torch.equal(p, tensors[n])]
            if mismatched:
                raise RuntimeError(f"engine apply: {len(mismatched)} tensors differ, e.g. {mismatched[0]}")
    finally:
        server.stop()
    medians = {mode: median(times[mode]) for mode in MODES}
    result = {
        "workload": wl.name, "bytes": size, "tensors": len(tensors),
        "runs": [{"mode": mode, "seconds": [round(t, 6) for t in times[mode]],
                  "median_seconds": round(medians[mode], 6), "gbps": round(size / medians[mode] / 1e9, 3)}
                 for mode in MODES],
        "apply_vs_copy": round(medians["engine_apply"] / medians["copy_baseline"], 3),
        "served_vs_push": round(medians["push_served"] / medians["push"], 3),
        "goal_apply_vs_copy": GOAL_APPLY_VS_COPY,
    }
    log(f"engine apply {wl.name}: copy {medians['copy_baseline']:.3f} s, apply {medians['engine_apply']:.3f} s "
        f"({result['apply_vs_copy']:.2f}x), push {medians['push']:.3f} s, push->served {medians['push_served']:.3f} s "
        f"({result['served_vs_push']:.2f}x)")
    return result


def markdown(result: dict) -> str:
    lines = ["", "## Commit -> engine serving", "",
             f"{result['workload']}: {result['bytes'] / 1e9:.2f} GB, {result['tensors']} tensors, a torch module in the "
             "bench process, alternated. `engine_apply` maps the committed store read-only and copies every tensor "
             "into the module; `copy_baseline` is `load_state_dict` from tensors already in the process.", "",
             "| mode | median s | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['mode']} | {r['median_seconds']:.3f} | {r['gbps']:.2f} |" for r in result["runs"]]
    lines += ["", f"apply / copy = {result['apply_vs_copy']:.2f} (goal <= {result['goal_apply_vs_copy']}); "
              f"push -> served / push alone = {result['served_vs_push']:.2f}.", ""]
    return "\n".join(lines)
