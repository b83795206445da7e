"""A push from the trainer's host against one memcpy of the same bytes: `python -m bench --only host_path`.

The model is bench.gpu's (Qwen2.5-0.5B's shapes in bf16, 98 tensors, 0.51 GB), here as CPU tensors, each
with its own storage. One server with 1 CPU worker, started as a user starts it, ingress slots sized as
bench.gpu sizes them (an SHM bucket must fit one). The SDK's buckets of 128 MiB (a larger tensor gets
buckets of its own), IN_PLACE, dense (delta=False). A define push (INLINE) makes the store first.

Modes, one warm-up each, then --reps repetitions, the order reversed every other repetition:
  memcpy     every tensor `copy_`ed once into preallocated, touched host tensors, on one thread (the baseline)
  shm        client.push(transport='shm'): Begin to Committed
  inline     client.push(transport='inline')
  shm_slots  a diagnostic: SHM with the store writes off (another client whose sink does not ask for them):
             every bucket through an ingress slot, written there with its checksum in one pass, then copied
             into the store by its owner (issue 45's step 2 without step 3)
Each repetition records wall seconds and CPU seconds of the whole process tree (this process, the server
and its workers: utime + stime from /proc), so a figure can be read against the memcpy of the same
repetition (`per-rep x memcpy`, the median of those ratios) and against the machine's load (CPU seconds
move less with contention than wall seconds). Every push is verified at the end (client.verify).

Copies and read passes per byte are counted, not estimated (common/byte_passes.py): a second server runs
with WEIGHTSYNC_BYTE_PASSES set, every process of the push (this trainer, the server, its worker) counts
the bytes each of its stages copies or reads, and the counts of COUNTED_PUSHES pushes of each transport,
divided by the bytes pushed, are the table. What no code of ours does (gRPC's C core, the kernel's socket
copies) is not counted there; the INLINE floor in the results file says what it is.

`--side LABEL --json PATH` measures the weightsync this interpreter imports and writes JSON (how
`--before PYTHON` runs another tree, e.g. `git worktree add /tmp/base a1beaa4`, in alternated rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import machine
from bench.gpu import GB, MIB, ingress_slot_bytes, model_shapes
from bench.node_store import process_tree
from bench.progress import log
from bench.servers import REPO, Server

MODEL_BYTES = int(0.5 * GB)
BUCKET_BYTES = 128 * MIB
MODES = ("memcpy", "shm", "inline", "shm_slots")
COUNTED_PUSHES = 2
GOAL_SHM_X_MEMCPY = 1.6
"""Issue 45: SHM dense push / one memcpy of the same bytes, on this CPU."""
_TICK = os.sysconf("SC_CLK_TCK")


# -- pure parts ---------------------------------------------------------------------------
def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """bench.gpu's model as CPU bf16 tensors, each with storage of its own, filled with noise."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
            for name, shape in model_shapes(MODEL_BYTES)}


def orders(modes: tuple[str, ...], reps: int) -> list[tuple[str, ...]]:
    """The order of the modes in each repetition: as given, then reversed, and so on."""
    return [modes if rep % 2 == 0 else tuple(reversed(modes)) for rep in range(reps)]


def summarize(wall: dict[str, list[float]], cpu: dict[str, list[dict[str, float]]], size: int) -> list[dict]:
    """Per mode: median wall and CPU seconds (in all, and per role), x memcpy as the ratio of medians and as
    the median of the per-repetition ratios, CPU x memcpy, GB/s."""
    base = statistics.median(wall["memcpy"])
    total = {mode: [sum(used.values()) for used in uses] for mode, uses in cpu.items()}
    base_cpu = statistics.median(total["memcpy"])
    rows = []
    for mode, seconds in wall.items():
        m = statistics.median(seconds)
        per_rep = [s / b for s, b in zip(seconds, wall["memcpy"], strict=True)]
        c = statistics.median(total[mode])
        rows.append({"mode": mode, "seconds": [round(s, 6) for s in seconds], "median_seconds": round(m, 6),
                     "gbps": round(size / m / 1e9, 3), "x_memcpy": round(m / base, 3),
                     "per_rep_x_memcpy": round(statistics.median(per_rep), 3),
                     "cpu_seconds": [round(s, 4) for s in total[mode]], "median_cpu_seconds": round(c, 4),
                     "cpu_x_memcpy": round(c / base_cpu, 3) if base_cpu else None,
                     "median_cpu_by_role": {role: round(statistics.median(u[role] for u in cpu[mode]), 4)
                                            for role in ROLES}})
    return rows


# -- CPU seconds of a process tree -------------------------------------------------------
ROLES = ("trainer", "server", "worker")


def cpu_seconds(server: int, pids: list[int]) -> dict[str, float]:
    """utime + stime so far of this whole process (the trainer, every thread), the server, and its workers."""
    used = {"trainer": time.process_time(), "server": 0.0, "worker": 0.0}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used["server" if pid == server else "worker"] += (int(fields[11]) + int(fields[12])) / _TICK
    return used


def alternated(runners: dict[str, Callable[[], None]], reps: int, server: int, pids: list[int],
               label: str) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """One warm-up of every mode, then `reps` repetitions in alternating order: wall and CPU seconds (by role)."""
    for run in runners.values():
        run()
    wall: dict[str, list[float]] = {mode: [] for mode in runners}
    cpu: dict[str, list[dict[str, float]]] = {mode: [] for mode in runners}
    for rep, order in enumerate(orders(tuple(runners), reps)):
        for mode in order:
            used, started = cpu_seconds(server, pids), time.perf_counter()
            runners[mode]()
            wall[mode].append(time.perf_counter() - started)
            after = cpu_seconds(server, pids)
            cpu[mode].append({role: after[role] - used[role] for role in ROLES})
        log(f"{label}: rep {rep + 1}/{reps} " + " ".join(f"{m}={wall[m][-1]:.3f}s" for m in runners))
    return wall, cpu


# -- one side ---------------------------------------------------------------------------
def memcpy_runner(tensors: dict[str, torch.Tensor]) -> Callable[[], None]:
    targets = {name: torch.zeros_like(t) for name, t in tensors.items()}  # zeros: every page touched

    def run() -> None:
        for name, target in targets.items():
            target.copy_(tensors[name])
    return run


def slots_only(client) -> None:
    """A diagnostic: this client's SHM sink stops asking the server to place buckets in its store (every bucket
    then goes through an ingress slot). Its sink exists once it pushed over SHM."""
    client._fleet.states[0].ingress.sink.writes_store = False  # noqa: SLF001 - the bench's switch, not an API


def push_runner(client, tensors: dict[str, torch.Tensor], transport: str) -> Callable[[], None]:
    def run() -> None:
        client.push(tensors, delta=False, version=f"{transport}-{time.monotonic_ns()}", transport=transport,
                    bucket_size_bytes=BUCKET_BYTES)
    return run


def measure(reps: int, workdir: Path, *, diagnostics: bool = True) -> dict:
    """Every mode, alternated, on one 1-worker server (the weightsync this interpreter imports). Without
    `diagnostics` (another tree, which may predate them): no shm_slots, no counted passes."""
    from weightsync.client import WeightSyncClient

    torch.set_num_threads(1)
    tensors = model()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    slot = ingress_slot_bytes(BUCKET_BYTES, max(t.numel() * t.element_size() for t in tensors.values()))
    load_before = os.getloadavg()[0]
    with Server(1, workdir, extra=("--ingress-slot-bytes", str(slot))) as server, \
            WeightSyncClient(server.address, timeout=300) as client, \
            WeightSyncClient(server.address, timeout=300) as slots_client:
        client.push(tensors, delta=False, version="define", transport="inline", allow_new_tensors=True,
                    bucket_size_bytes=BUCKET_BYTES)
        pids = process_tree(server.process.pid)
        runners = {"memcpy": memcpy_runner(tensors), "shm": push_runner(client, tensors, "shm"),
                   "inline": push_runner(client, tensors, "inline")}
        if diagnostics:
            push_runner(slots_client, tensors, "shm")()
            slots_only(slots_client)
            runners["shm_slots"] = push_runner(slots_client, tensors, "shm")
        wall, cpu = alternated(runners, reps, server.process.pid, pids, "host_path")
        verified = client.verify(tensors).ok and slots_client.verify(tensors).ok
        buckets = client.push(tensors, delta=False, version="count", transport="shm",
                              bucket_size_bytes=BUCKET_BYTES).bucket_count
        fixed = fixed_costs(client)
    passes = count_passes(tensors, slot, workdir) if diagnostics else {}
    return {"bytes": size, "tensors": len(tensors), "buckets": buckets, "reps": reps,
            "runs": summarize(wall, cpu, size), "passes": passes, "verified": verified, "one_tensor_ms": fixed,
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}


ONE_TENSOR_PUSHES = 30


def fixed_costs(client) -> dict[str, float]:
    """The fixed cost of a push, Begin to Committed: a partial update of one 4 KiB tensor (a probe the store gets
    beside the model), median milliseconds of ONE_TENSOR_PUSHES per transport, alternated."""
    probe = {"host_path.probe": torch.ones(2048, dtype=torch.bfloat16)}
    client.push(probe, delta=False, version="probe", transport="inline", allow_new_tensors=True)
    times: dict[str, list[float]] = {"shm": [], "inline": []}
    for _ in range(ONE_TENSOR_PUSHES):
        for transport, samples in times.items():
            started = time.perf_counter()
            client.push(probe, delta=False, version=f"probe-{time.monotonic_ns()}", transport=transport)
            samples.append(time.perf_counter() - started)
    return {transport: round(statistics.median(samples) * 1000, 2) for transport, samples in times.items()}


def count_passes(tensors: dict[str, torch.Tensor], slot: int, workdir: Path) -> dict[str, dict[str, float]]:
    """Per transport: the bytes each stage of every process copied ("copy STAGE") or read ("read STAGE"), per
    byte pushed, over COUNTED_PUSHES pushes into a server that counts (common/byte_passes.py)."""
    from weightsync.client import WeightSyncClient
    from weightsync.common import byte_passes

    folder = workdir / f"passes-{time.monotonic_ns()}"
    folder.mkdir()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    env = dict(os.environ, **{byte_passes.ENV: str(folder)})
    counted: dict[str, dict[str, float]] = {}
    byte_passes._folder = str(folder)  # noqa: SLF001 - this process is the trainer: it counts too
    try:
        with Server(1, workdir, env=env, extra=("--ingress-slot-bytes", str(slot))) as server, \
                WeightSyncClient(server.address, timeout=300) as client, \
                WeightSyncClient(server.address, timeout=300) as slots_client:
            client.push(tensors, delta=False, version="define", transport="inline", allow_new_tensors=True,
                        bucket_size_bytes=BUCKET_BYTES)
            push_runner(slots_client, tensors, "shm")()
            slots_only(slots_client)
            for mode, target, transport in (("shm", client, "shm"), ("inline", client, "inline"),
                                            ("shm_slots", slots_client, "shm")):
                push_runner(target, tensors, transport)()  # every kernel compiled, every mapping made
                before = byte_passes.collect(folder)
                for _ in range(COUNTED_PUSHES):
                    push_runner(target, tensors, transport)()
                after = byte_passes.collect(folder)
                counted[mode] = {key: round((after[key] - before.get(key, 0)) / (COUNTED_PUSHES * size), 4)
                                 for key in sorted(after) if after[key] != before.get(key, 0)}
    finally:
        byte_passes._folder = None  # noqa: SLF001
    return counted


# -- the results file ------------------------------------------------------------------------
WHAT = {
    "memcpy": "every tensor copy_'d once into preallocated host tensors, one thread (the baseline)",
    "shm": "client.push(transport='shm'), Begin to Committed",
    "inline": "client.push(transport='inline'), Begin to Committed",
    "shm_slots": "diagnostic: SHM with the store writes off (every bucket through a slot)",
}


def passes_rows(passes: dict[str, dict[str, float]]) -> list[str]:
    """One row per transport: copies and read passes per byte pushed, in all and by stage."""
    rows = []
    for mode, stages in passes.items():
        copies = sum(v for k, v in stages.items() if k.startswith("copy "))
        reads = sum(v for k, v in stages.items() if k.startswith("read "))
        detail = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        rows.append(f"| {mode} | {copies:.2f} | {reads:.2f} | {detail} |")
    return rows


def side_table(result: dict) -> list[str]:
    lines = ["| mode | median s | GB/s | x memcpy | per-rep x memcpy | CPU-s | CPU x memcpy | CPU-s trainer / server / "
             "worker | what |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in result["runs"]:
        roles = r.get("median_cpu_by_role", {})
        by_role = " / ".join(f"{roles[role]:.3f}" for role in ROLES) if roles else ""
        lines.append(f"| {r['mode']} | {r['median_seconds']:.4f} | {r['gbps']:.2f} | {r['x_memcpy']:.2f} | "
                     f"{r['per_rep_x_memcpy']:.2f} | {r['median_cpu_seconds']:.3f} | {r['cpu_x_memcpy']:.2f} | "
                     f"{by_role} | {WHAT.get(r['mode'], '')} |")
    return lines


def markdown(sides: dict[str, list[dict]], meta: dict) -> str:
    after = sides["after"][-1]
    shm = next(r for r in after["runs"] if r["mode"] == "shm")
    lines = [
        "# The host path: a push from the trainer's host against one memcpy (issue 45)", "",
        f"Machine: {meta['machine']}. Command: `{meta['command']}`. Date: {meta['date']}. Ran "
        f"{meta['elapsed_seconds']:.0f} s; 1-minute load average before/after: {meta['load_before']} / "
        f"{meta['load_after']} (a shared 2-core machine: read the ratios and the CPU seconds, not the seconds).", "",
        f"Model: bench.gpu's Qwen2.5-0.5B shapes, {after['tensors']} bf16 CPU tensors, {after['bytes'] / 1e9:.3f} GB, "
        f"{after['buckets']} SDK buckets of at most {BUCKET_BYTES >> 20} MiB; one server with 1 CPU worker; IN_PLACE, "
        f"dense. Modes alternated (order reversed every other repetition), one warm-up each, medians of "
        f"{after['reps']}; `per-rep x memcpy` is the median of each repetition's ratio to its own memcpy; CPU-s "
        "counts this process, the server and its worker (/proc). Every push verified: "
        f"{'yes' if all(s['verified'] for v in sides.values() for s in v) else 'NO'}.", "",
        f"**SHM dense push: {shm['x_memcpy']:.2f}x one memcpy** (per repetition {shm['per_rep_x_memcpy']:.2f}x; "
        f"CPU {shm['cpu_x_memcpy']:.2f}x; goal <= {GOAL_SHM_X_MEMCPY}x).", "",
    ]
    if after.get("one_tensor_ms"):
        fixed = after["one_tensor_ms"]
        lines += ["A push's fixed cost, Begin to Committed, one 4 KiB tensor (median of "
                  f"{ONE_TENSOR_PUSHES}, alternated): SHM {fixed['shm']:.1f} ms, INLINE {fixed['inline']:.1f} ms.", ""]
    for label, runs in sides.items():
        for n, result in enumerate(runs):
            title = "this tree" if label == "after" else f"before ({meta.get('before', 'another tree')})"
            lines += [f"## {title}, round {n + 1}", "", *side_table(result), ""]
    lines += ["## Copies and read passes per byte, counted", "",
              f"Each stage of each process counts what it copies or reads (common/byte_passes.py), over "
              f"{COUNTED_PUSHES} pushes of the model into a server that counts, divided by the bytes pushed "
              "(a segment's padding makes a stage's bytes slightly more than the tensors'). gRPC's own copies "
              "and the kernel's are no code of ours and are not counted (see the INLINE floor).", "",
              "| transport | copies/byte | reads/byte | by stage |", "|---|---:|---:|---|",
              *passes_rows(after["passes"]), "", *INLINE_FLOOR, *ELSEWHERE]
    return "\n".join(lines)


INLINE_FLOOR = [
    "## INLINE: the copies left, and the floor", "",
    "Ours, counted above, one per process that must hold the bytes: the trainer encodes each chunk into its "
    "message (`trainer.encode`: grpc's Python API takes one bytes object per message; a bucket of CPU tensors is "
    "no longer packed first, so this is the trainer's only copy), the server copies each received message into "
    "the ingress (`server.ingress`: the one way bytes leave the server's process for the worker's), the owner "
    "copies the ingress into the store (`worker.from_ingress`). Not ours, not counted: grpc copies each message "
    "into its own buffers when it sends it, the kernel copies it into and out of the socket, grpc.aio builds a "
    "Python bytes of each received message: about 4 more per byte. The floor with grpc as it is: the trainer's "
    "and the server's copies plus grpc's 4. The owner's could go if the server wrote a fast-path bucket straight "
    "into the store; measured (559ee31, bench/results/node_store-inline-in-store.md) it gained 0-8% (that copy "
    "runs on the owner's core, beside the server's receive) and left a store INCONSISTENT after an IN_PLACE "
    "update aborted in its first bucket, where the ingress path leaves it CONSISTENT: not taken. INLINE's time is "
    "the server's one event loop receiving through grpc.aio, not the copies (its CPU by process is in the table).",
    "",
]


ELSEWHERE = [
    "## Elsewhere", "",
    "The steps as each was measured, what else moved (the other benches, alternated against the tree before "
    "issue 45) and the GPU figures' status: host-path-notes.md.", "",
]


# -- entry points ---------------------------------------------------------------------------
def run_side(label: str, python: str, reps: int, workdir: Path) -> dict:
    """One side in a process of its own, with that tree's interpreter (its editable install decides which
    weightsync the SDK, the server and its worker are)."""
    out = workdir / f"host-path-{label}-{time.monotonic_ns()}.json"
    extra = [] if label == "after" else ["--no-diagnostics"]
    subprocess.run([python, "-m", "bench.host_path", "--side", label, "--json", str(out), "--reps", str(reps),
                    *extra], cwd=REPO, check=True)
    return json.loads(out.read_text())


def run(workdir: Path, *, reps: int, before: str | None = None, rounds: int = 1) -> dict:
    """This tree's figures (and another tree's, `before`, in alternated rounds: before, after, ...)."""
    sides: dict[str, list[dict]] = {"after": []}
    if before:
        sides["before"] = []
    for _ in range(rounds):
        if before:
            sides["before"].append(run_side("before", before, reps, workdir))
        sides["after"].append(run_side("after", sys.executable, reps, workdir))
    return sides


def write(sides: dict[str, list[dict]], meta: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "host-path.json", out / "host-path.md"
    js.write_text(json.dumps(sides | {"meta": meta}, indent=1) + "\n")
    md.write_text(markdown(sides, meta))
    return js, md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_path", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                        help="folder for host-path.{json,md} (default bench/results)")
    parser.add_argument("--reps", type=int, default=9, help="repetitions after the warm-up (default 9, at least 7)")
    parser.add_argument("--before", metavar="PYTHON", help="also measure another tree's interpreter, in turn")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per side, run in turn (default 1)")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-diagnostics", dest="diagnostics", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps < 7:
        parser.error("--reps: at least 7 (medians of alternated runs)")
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="bench-host-path-") as tmp:
        if args.side:  # one side, for run_side
            result = measure(args.reps, Path(tmp), diagnostics=args.diagnostics)
            args.json.write_text(json.dumps(result | {"side": args.side}, indent=1) + "\n")
            return 0
        started, load_before = time.monotonic(), machine.load_average()
        sides = run(Path(tmp), reps=args.reps, before=args.before, rounds=args.rounds)
    meta = run_meta(started, load_before, args.before, argv if argv is not None else sys.argv[1:])
    js, md = write(sides, meta, args.out)
    print(markdown(sides, meta))
    log(f"host_path: wrote {js} and {md}")
    return 0


def run_meta(started: float, load_before: list[float], before: str | None, argv: list[str]) -> dict:
    return {"machine": machine.one_line(machine.describe()).split(";")[0],
            "command": "python -m bench.host_path " + " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime()),
            "elapsed_seconds": round(time.monotonic() - started, 1), "load_before": load_before,
            "load_after": machine.load_average(), "before": before or ""}


if __name__ == "__main__":
    sys.exit(main())
