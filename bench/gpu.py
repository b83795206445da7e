"""`python -m bench.gpu --out DIR`: weightsync against plain CUDA copies of the same bytes.

A bf16 model shaped like Qwen2.5-0.5B's layers, scaled to about --gb (1.5: 41 layers, 494
tensors), lives on cuda:0. One weightsync server runs with CPU workers (its store in host memory),
started as a user starts it (bench.servers.Server).

(a) trainer -> server. The CUDA trainer pushes the model IN_PLACE over INLINE (bytes in the gRPC
    stream) and SHM (each bucket copied straight into its place in the node store, which the trainer
    maps and pins: client/transports/store_writes.py), against `d2h_pinned`: a plain `copy_(non_blocking=True)`
    of every tensor into preallocated pinned host tensors, then `torch.cuda.synchronize()`.
    `d2h_pageable` (the same into ordinary host memory) shows what host memory that is not pinned
    costs. Issue 45's goal: push_shm within 2x of d2h_pinned for a 0.5 GB model, 1.1x for 8 GB.
(c) the colocated round trip, trainer GPU -> store -> engine GPU (verl's hybrid engine): a push over
    SHM, then an engine on the same host (pinned, as in (b)) applies the committed version into a
    module on cuda:0, against `d2h_h2d_pinned`: the two plain pinned copies of the same bytes (device
    to pinned host, then back into other device tensors).
(b) store -> engine. An engine on the same host (`weightsync.engine.EngineClient`) acquires the
    committed version (the store mapped read-only), copies every tensor into a module on cuda:0
    (`apply_to_module`: queued, asynchronous) and releases (which waits for the copies), measured
    both ways an engine can open its client: `engine_apply_pinned` (device="cuda:0": the mapping
    is pinned, so the copies are DMA from pinned memory; compare with `h2d_pinned`, a plain copy of
    the same tensors from pinned host memory, the section's baseline) and `engine_apply_pageable`
    (device="cpu": the mapping stays pageable; compare with `h2d_pageable`, a plain copy from
    ordinary host memory). `x like` in the table is each engine mode against its like.

`--only SECTION` measures only some of (a), (b), (c) and the map and pause sections; `--no-inline` leaves
push_inline out and defines the store over SHM (issue 45's goal at 8 GB: `--gb 8 --only push --only roundtrip
--no-inline`). Every mode runs once to warm up, then --reps times, alternated; medians. The pushed and applied
bytes are checked (verify() on the server, torch.equal on the engine's modules). Every report
names the GPU, torch, CUDA and NCCL versions it ran with. Writes DIR/gpu_bench.json and
DIR/gpu_bench.md and prints the table. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GB = 10**9
MIB = 1 << 20
DTYPE_BYTES = 2  # bfloat16

# Qwen2.5-0.5B's shapes (tied embeddings): one layer is 12 tensors, about 29.8 MB in bf16.
HIDDEN, KV, FFN, VOCAB = 896, 128, 4864, 151936
LAYER = (
    ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)), ("self_attn.q_proj.bias", (HIDDEN,)),
    ("self_attn.k_proj.weight", (KV, HIDDEN)), ("self_attn.k_proj.bias", (KV,)),
    ("self_attn.v_proj.weight", (KV, HIDDEN)), ("self_attn.v_proj.bias", (KV,)),
    ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
    ("mlp.gate_proj.weight", (FFN, HIDDEN)), ("mlp.up_proj.weight", (FFN, HIDDEN)),
    ("mlp.down_proj.weight", (HIDDEN, FFN)),
    ("input_layernorm.weight", (HIDDEN,)), ("post_attention_layernorm.weight", (HIDDEN,)),
)

SECTIONS = {
    "push": ("Trainer -> server: CUDA tensors into a CPU worker's store", "d2h_pinned"),
    "roundtrip": ("Colocated round trip: trainer GPU -> store -> engine GPU", "d2h_h2d_pinned"),
    "engine": ("Store -> engine: the committed version into a module on the GPU", "h2d_pinned"),
    "map": ("A worker maps a store-sized arena: fault its pages in, or pin it for DMA", "populate"),
    "pause": ("vLLM's pause, staged: the swap into the live tensors against a pinned host-to-device copy",
              "h2d_pinned"),
}
WHAT = {
    "d2h_pinned": "plain copy_ to pinned host tensors + synchronize (the baseline)",
    "d2h_pageable": "plain copy_ to ordinary host tensors + synchronize",
    "push_inline": "client.push(transport='inline'), to Committed",
    "push_shm": "client.push(transport='shm'), to Committed",
    "d2h_h2d_pinned": "plain copy_ to pinned host tensors, then from them into other device tensors + synchronize "
                      "(the baseline)",
    "push_shm_apply": "client.push(transport='shm') to Committed, then EngineClient(device='cuda:0'): acquire + "
                      "apply_to_module (CUDA module) + release",
    "h2d_pinned": "plain copy_ from pinned host tensors + synchronize (the baseline)",
    "h2d_pageable": "plain copy_ from ordinary host tensors + synchronize",
    "engine_apply_pinned": "EngineClient(device='cuda:0'), store mapping pinned: acquire + apply_to_module "
                           "(CUDA module) + release (waits for the copies)",
    "engine_apply_pageable": "EngineClient(device='cpu'), store mapping pageable: acquire + apply_to_module "
                             "(CUDA module) + release (waits for the copies)",
}
WHAT |= {
    "populate": "a fresh memfd arena (fallocated, as the server makes it) mapped and pre-faulted "
                "(MADV_POPULATE_WRITE, or a read per page): a CPU worker's map (the baseline)",
    "register": "the same, pinned with cudaHostRegister instead (it faults the pages in itself)",
    "populate_register": "the same, pre-faulted, then pinned with cudaHostRegister: a CUDA worker's map "
                         "(gpu_worker/memory.map_arena); GB/s here bounds a large store's map "
                         "(server/store/arenas.py map_timeout)",
}
WHAT |= {
    "vllm_swap": "engine/vllm_staging.py's StagedModel.swap: the version staged on the device (vLLM's ranks load and "
                 "process it there while serving) copied into the live tensors: what vLLM's pause holds (goal <= "
                 "1.2x h2d_pinned)",
}
CHECKED = {
    "push": "server holds the pushed bytes (verify)",
    "roundtrip": "the round trip's module equals the model",
    "engine": "engines' modules equal the model",
    "map": "cudaHostRegister pinned every fresh arena",
    "pause": "the swap left the staged bytes in the live tensors",
}
"""What each section checks, as the report says it."""
LIKE = {"engine_apply_pinned": "h2d_pinned", "engine_apply_pageable": "h2d_pageable"}
"""The plain copy from the same kind of host memory each engine mode reads: its `x like`."""


# -- pure parts (tested without a GPU) ---------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_bench.json and gpu_bench.md")
    parser.add_argument("--gb", type=float, default=1.5, help="model size in GB (10^9 bytes), bf16 (default 1.5)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs of every mode after one warm-up (default 5)")
    parser.add_argument("--bucket-mib", type=int, default=128,
                        help="push bucket size, and the server's ingress slot size (default 128)")
    parser.add_argument("--workers", type=int, default=1, help="CPU workers of the server (default 1)")
    parser.add_argument("--only", choices=list(SECTIONS), action="append",
                        help="measure only these sections (repeatable; default: all). Issue 45's goals: --only push "
                             "--only roundtrip at --gb 0.5, and at --gb 8 with --no-inline")
    parser.add_argument("--no-inline", action="store_true",
                        help="push section without push_inline, the store defined over SHM (an 8 GB INLINE push "
                             "takes ~11 s on an H200 host, and the kit's bench step has 40)")
    args = parser.parse_args(argv)
    if not 0.05 <= args.gb <= 16:
        parser.error(f"--gb {args.gb}: between 0.05 and 16")
    if args.reps < 1 or args.bucket_mib < 1 or args.workers < 1:
        parser.error("--reps, --bucket-mib and --workers must be at least 1")
    return args


def model_shapes(target_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Qwen2-like model of about target_bytes in bf16 (at least one layer)."""
    layer_bytes = sum(_numel(shape) for _, shape in LAYER) * DTYPE_BYTES
    fixed_bytes = (VOCAB * HIDDEN + HIDDEN) * DTYPE_BYTES
    layers = max(1, round((target_bytes - fixed_bytes) / layer_bytes))
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    shapes += [(f"model.layers.{i}.{name}", shape) for i in range(layers) for name, shape in LAYER]
    shapes.append(("model.norm.weight", (HIDDEN,)))
    return shapes


def ingress_slot_bytes(bucket_bytes: int, largest_tensor_bytes: int) -> int:
    """The server's ingress slot: an SHM bucket must fit one, and the SDK gives a tensor larger
    than the bucket size a bucket of its own (the embedding: 272 MB)."""
    return max(bucket_bytes, -(-largest_tensor_bytes // MIB) * MIB)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def summarize(mode: str, seconds: list[float], size: int, baseline_median: float | None = None,
              like_median: float | None = None) -> dict:
    m = statistics.median(seconds)
    run = {"mode": mode, "what": WHAT.get(mode, ""), "seconds": [round(s, 6) for s in seconds],
           "median_seconds": round(m, 6), "gbps": round(size / m / GB, 3)}
    if baseline_median:
        run["x_baseline"] = round(m / baseline_median, 3)
    if like_median:
        run["like"] = LIKE[mode]
        run["x_like"] = round(m / like_median, 3)
    return run


def section(key: str, times: dict[str, list[float]], size: int) -> dict:
    """One table: every mode's medians, its time as a multiple of the section's baseline, and for an
    engine mode as a multiple of the plain copy from its kind of host memory (LIKE)."""
    title, baseline = SECTIONS[key]
    base = statistics.median(times[baseline])
    runs = []
    for mode, seconds in times.items():
        like = statistics.median(times[LIKE[mode]]) if LIKE.get(mode) in times else None
        runs.append(summarize(mode, seconds, size, base, like))
    return {"key": key, "title": title, "baseline": baseline, "runs": runs}


def versions_line(machine: dict) -> str:
    """GPU, torch, CUDA and NCCL, as every GPU figure is reported with."""
    return (f"{machine.get('gpu', '?')}, torch {machine.get('torch', '?')}, CUDA {machine.get('cuda', '?')}, "
            f"NCCL {machine.get('nccl', '?')}")


def markdown(results: dict) -> str:
    model, cfg, machine = results["model"], results["config"], results["machine"]
    lines = [
        "# weightsync on a GPU (bench.gpu)", "",
        f"Machine: {versions_line(machine)}; {machine.get('cores', '?')} cores, Python {machine.get('python', '?')}.",
        "",
        f"Model: {model['tensors']} bf16 tensors, {model['bytes'] / GB:.2f} GB (Qwen2.5-0.5B's shapes, "
        f"{model['layers']} layers) on cuda:0. Server: {cfg['workers']} CPU worker(s), store in host memory, "
        f"ingress slots of {cfg.get('ingress_slot_bytes', 0) // MIB} MiB; buckets of {cfg['bucket_bytes'] // MIB} MiB "
        f"(a larger tensor gets its own). Medians of {cfg['reps']} after one warm-up, modes "
        "alternated. `x baseline` = median / the section's plain-copy median (1.00: as fast as the copy).",
    ]
    for sec in results["sections"]:
        lines += ["", f"## {sec['title']}", "", "| mode | median s | GB/s | x baseline | x like | what |",
                  "|---|---:|---:|---:|---:|---|"]
        for run in sec["runs"]:
            like = f"{run['x_like']:.2f} ({run['like']})" if "x_like" in run else ""
            lines.append(f"| {run['mode']} | {run['median_seconds']:.4f} | {run['gbps']:.2f} | "
                         f"{run.get('x_baseline', 0):.2f} | {like} | {run['what']} |")
    checks = results.get("verified", {})
    if checks:
        lines += ["", "Checked: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()) + "."]
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "gpu_bench.json", out / "gpu_bench.md"
    js.write_text(json.dumps(results, indent=1) + "\n")
    md.write_text(markdown(results))
    return js, md


# -- the measurements (CUDA) ---------------------------------------------------------------
@dataclass(slots=True)
class Copies:
    """Host tensors shaped like the model: pinned and ordinary."""
    pinned: dict
    pageable: dict


def _timed(action):
    import torch

    def run() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        action()
        torch.cuda.synchronize()
        return time.perf_counter() - started
    return run


def _copy_all(targets: dict, sources: dict) -> None:
    for name, target in targets.items():
        target.copy_(sources[name], non_blocking=True)


def make_model(shapes: list[tuple[str, tuple[int, ...]]]) -> dict:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    return {name: torch.randn(shape, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
            for name, shape in shapes}


def measure_push(server, model: dict, copies: Copies, args: argparse.Namespace, size: int) -> tuple[dict, bool]:
    from bench.harness import alternate
    from weightsync.client import WeightSyncClient

    bucket = args.bucket_mib * MIB
    with WeightSyncClient(server.address, timeout=300) as client:
        client.push(model, delta=False, version="define", transport="shm" if args.no_inline else "inline",
                    allow_new_tensors=True, bucket_size_bytes=bucket)

        def push(transport: str):
            return lambda: client.push(model, delta=False, version=f"{transport}-{time.monotonic_ns()}", transport=transport,
                                       bucket_size_bytes=bucket)

        modes = {
            "d2h_pinned": _timed(lambda: _copy_all(copies.pinned, model)),
            "d2h_pageable": _timed(lambda: _copy_all(copies.pageable, model)),
            "push_inline": _timed(push("inline")),
            "push_shm": _timed(push("shm")),
        }
        if args.no_inline:
            del modes["push_inline"]
        times = alternate(modes, args.reps, "gpu push")
        verified = client.verify(model).ok
    return section("push", times, size), verified


def measure_roundtrip(server, model: dict, copies: Copies, args: argparse.Namespace, size: int) -> tuple[dict, bool]:
    """Trainer GPU -> store -> engine GPU, against the two plain pinned copies of the same bytes."""
    import torch

    from bench.engine_apply import module_with
    from bench.harness import alternate
    from weightsync.client import WeightSyncClient
    from weightsync.engine import EngineClient, apply_to_module

    bucket = args.bucket_mib * MIB
    module = module_with(model)
    targets = {name: torch.empty_like(t) for name, t in model.items()}

    def two_copies() -> None:
        _copy_all(copies.pinned, model)
        _copy_all(targets, copies.pinned)

    with (WeightSyncClient(server.address, timeout=300) as client,
          EngineClient(server=server.address, name="bench-gpu-roundtrip", device="cuda:0") as engine):

        def round_trip() -> None:
            client.push(model, delta=False, version=f"roundtrip-{time.monotonic_ns()}", transport="shm",
                        bucket_size_bytes=bucket)
            with engine.acquire() as snapshot:
                apply_to_module(module, snapshot)  # queued; the release waits for the copies

        times = alternate({"d2h_h2d_pinned": _timed(two_copies), "push_shm_apply": _timed(round_trip)},
                          args.reps, "gpu roundtrip")
    state = module.state_dict()
    verified = all(torch.equal(state[name], tensor) for name, tensor in model.items())
    return section("roundtrip", times, size), verified


def measure_engine(server, model: dict, copies: Copies, args: argparse.Namespace, size: int) -> tuple[dict, bool]:
    import torch

    from bench.engine_apply import module_with
    from bench.harness import alternate
    from weightsync.engine import EngineClient, apply_to_module

    modules = {"cuda:0": module_with(model), "cpu": module_with(model)}  # zeros like the model: on cuda:0
    targets = {name: torch.empty_like(t) for name, t in model.items()}
    # The store's mapping: pinned by an engine opened on the GPU (at its first acquire, in the warm-up),
    # pageable for one opened on the CPU. Either way the copies go into a module on cuda:0.
    with (EngineClient(server=server.address, name="bench-gpu-pinned", device="cuda:0") as pinned,
          EngineClient(server=server.address, name="bench-gpu-pageable", device="cpu") as pageable):

        def engine_apply(engine: EngineClient, module) -> Callable[[], None]:
            def apply() -> None:
                with engine.acquire() as snapshot:
                    apply_to_module(module, snapshot)  # queued; the release waits for the copies
            return apply

        times = alternate({
            "h2d_pinned": _timed(lambda: _copy_all(targets, copies.pinned)),
            "h2d_pageable": _timed(lambda: _copy_all(targets, copies.pageable)),
            "engine_apply_pinned": _timed(engine_apply(pinned, modules["cuda:0"])),
            "engine_apply_pageable": _timed(engine_apply(pageable, modules["cpu"])),
        }, args.reps, "gpu engine")
    states = [module.state_dict() for module in modules.values()]
    verified = all(torch.equal(state[name], tensor) for state in states for name, tensor in model.items())
    return section("engine", times, size), verified


def measure_map(args: argparse.Namespace, size: int) -> tuple[dict, bool]:
    """What mapping the node store costs a worker per byte, pre-faulted (CPU) or pinned (CUDA): each
    repetition maps a fresh arena, as a restarted worker does."""
    import mmap
    import os

    import torch

    from bench.harness import alternate
    from weightsync.common.host_pinning import pin_host, unpin_host
    from weightsync.gpu_worker.memory import populate

    pinned_every_time: list[bool] = []

    def fresh_map(pin: bool, fault_first: bool = False) -> Callable[[], float]:
        def run() -> float:
            fd = os.memfd_create("bench-map")
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            data = torch.frombuffer(mapping, dtype=torch.uint8)
            started = time.perf_counter()
            if fault_first or not pin:
                populate(data)
            bases = pin_host(data) if pin else []
            if pin:
                pinned_every_time.append(bool(bases))
            seconds = time.perf_counter() - started
            unpin_host(bases)
            del data
            mapping.close()
            return seconds
        return run

    modes = {"populate": fresh_map(False), "register": fresh_map(True),
             "populate_register": fresh_map(True, fault_first=True)}
    times = alternate(modes, args.reps, "gpu map")
    return section("map", times, size), all(pinned_every_time)


def measure_pause(model: dict, copies: Copies, args: argparse.Namespace, size: int) -> tuple[dict, bool]:
    """vLLM's pause with the version staged on the GPU (docs/engines/vllm.md): the swap is a device copy of
    the staged tensors into the live ones, against a pinned host-to-device copy of the same bytes (what an
    unstaged apply is bounded by). vLLM itself is not needed: the swap is weightsync's own code."""
    import torch
    import torch.nn

    from bench.harness import alternate
    from weightsync.engine.vllm_staging import StagedLayer, StagedModel

    live = {name: torch.empty_like(tensor) for name, tensor in model.items()}

    def swap() -> None:
        StagedModel([StagedLayer(name, torch.nn.Module(), [(live[name], staged)], {}, [])
                     for name, staged in model.items()]).swap()

    modes = {"h2d_pinned": _timed(lambda: _copy_all(live, copies.pinned)), "vllm_swap": _timed(swap)}
    times = alternate(modes, args.reps, "gpu pause")
    return section("pause", times, size), all(torch.equal(live[n], t) for n, t in model.items())


def nccl_version() -> str:
    """NCCL's version as torch reports it ("-" in a build without NCCL)."""
    import torch

    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return "-"


def machine() -> dict:
    import platform

    import torch

    from bench.machine import describe

    m = describe()
    m |= {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
          "nccl": nccl_version(), "python": platform.python_version()}
    return m


def run(args: argparse.Namespace) -> dict:
    import torch

    from bench.progress import log
    from bench.servers import Server
    from weightsync.client import WeightSyncClient

    shapes = model_shapes(int(args.gb * GB))
    model = make_model(shapes)
    size = sum(t.numel() * t.element_size() for t in model.values())
    log(f"model: {len(model)} bf16 tensors, {size / GB:.2f} GB on cuda:0")
    copies = Copies(pinned={n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for n, t in model.items()},
                    pageable={n: torch.empty(t.shape, dtype=t.dtype) for n, t in model.items()})
    slot = ingress_slot_bytes(args.bucket_mib * MIB, max(t.numel() * t.element_size() for t in model.values()))
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as workdir:
        server = Server(args.workers, Path(workdir), extra=("--ingress-slot-bytes", str(slot)))
        wanted = set(args.only or SECTIONS)
        measured: dict[str, tuple[dict, bool]] = {}
        try:
            if "roundtrip" in wanted and "push" not in wanted:  # the round trip's pushes need a defined store
                with WeightSyncClient(server.address, timeout=300) as client:
                    client.push(model, delta=False, version="define", transport="shm", allow_new_tensors=True,
                                bucket_size_bytes=args.bucket_mib * MIB)
            if "push" in wanted:
                measured["push"] = measure_push(server, model, copies, args, size)
            if "roundtrip" in wanted:
                measured["roundtrip"] = measure_roundtrip(server, model, copies, args, size)
            _copy_all(copies.pinned, model)  # the h2d baselines copy the model's own bytes
            _copy_all(copies.pageable, model)
            torch.cuda.synchronize()
            if "engine" in wanted:
                measured["engine"] = measure_engine(server, model, copies, args, size)
            if "map" in wanted:
                measured["map"] = measure_map(args, size)
            if "pause" in wanted:
                measured["pause"] = measure_pause(model, copies, args, size)
        except BaseException:
            print(server.log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    return {"machine": machine(),
            "model": {"tensors": len(model), "bytes": size, "dtype": "bfloat16",
                      "layers": (len(model) - 2) // len(LAYER)},
            "config": {"reps": args.reps, "bucket_bytes": args.bucket_mib * MIB, "workers": args.workers,
                       "ingress_slot_bytes": slot, "sections": sorted(wanted), "push_inline": not args.no_inline},
            "sections": [table for table, _ in measured.values()],
            "verified": {CHECKED[key]: ok for key, (_, ok) in measured.items()}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"bench.gpu: skipped: no CUDA device here (torch {torch.__version__}); it runs on a GPU machine "
              "(bash tools/gpu_kit/run.sh there)")
        return 0
    from weightsync.common.logging import configure_logging

    configure_logging("warning")  # not a line per push
    print(f"bench.gpu: {versions_line(machine())}", flush=True)  # in the log even if a step fails later
    results = run(args)
    js, md = write(results, args.out)
    print(markdown(results))
    print(f"wrote {js} and {md}")
    return 0 if all(results["verified"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
