"""One copy per node: `python -m bench --only node_store`.

Each side (a weightsync tree: "after" is this one, "before" another tree's virtualenv, e.g.
`git worktree add /work/wt-before 44fabba && make -C /work/wt-before install`) runs in a process
of its own, `python -m bench.node_store --side LABEL --json PATH`, with that tree's interpreter
(its editable install decides which weightsync the SDK, server and workers are), so both sides run
this same bench code. The sides run in turn: before, after, before, after ... (`rounds`).

Per side, with the dense workload (bf16):
  - memory: a server with 1, 2, 3 CPU workers (all three kept up); a define push (IN_PLACE, new
    tensors), then two STAGED pushes; then every process of the server's tree is read from /proc:
    each memfd and /dev/shm file it holds open (/proc/PID/fd) or maps (/proc/PID/smaps) is counted
    once by inode, at its allocated size (st_blocks * 512 of the fd, which counts pages allocated
    whether or not any process touched them; a file only mapped counts its largest Rss), by name:
    store (weightsync-arena-*), ingress, queues (/dev/shm), other. Pss of those mappings summed
    over the tree is reported beside it as a cross-check (it counts only pages some process
    touched), and the tree's whole Pss (smaps_rollup). All as multiples of the model's bytes;
  - push time, IN_PLACE (the SDK's default), alternated per repetition after one warm-up each:
    COLLECTIVE (Gloo) and INLINE into the 1-, 2- and 3-worker servers, and the raw limits of
    delivering the bytes once into a node over the same transport from preallocated buffers:
    raw_gloo, a plain ProcessGroupGloo send per bucket (one in flight) from this process to one
    receiver process that recvs into its preallocated buffer, the SDK's own bucket sizes
    (bench.receiver's p2p op); raw_inline, one gRPC client stream of the same bytes in chunks of
    the server's max_chunk_bytes, from one preallocated buffer (one copy into each message, as
    the SDK makes) to a plain grpcio (sync, thread pool) server process that copies each chunk
    into its preallocated buffer; raw_inline_aio (a diagnostic), the same with a grpc.aio server,
    as weightsync's is. Every push and every raw path is verified afterwards;
  - engine apply (bench/engine_apply.py, unchanged): acquire + apply_to_module against
    load_state_dict of the same tensors already in the process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import engine_apply, workloads
from bench.baselines import BaselineCluster, packed_source
from bench.harness import FULL, QUICK, Harness, alternate, median, nbytes, sdk_layout
from bench.progress import log
from bench.raw_grpc import RawInline
from bench.servers import REPO, Server

WORKERS = (1, 2, 3)
TRANSPORTS = ("collective", "inline")
RAW = {"collective": "raw_gloo", "inline": "raw_inline"}
GOALS = {"three_vs_one_workers": 1.25, "vs_raw_limit": 0.9, "memory_after_x": 2.0}


# -- memory ------------------------------------------------------------------------------
def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return sorted(out)


def _kind(path: str) -> str | None:
    if "memfd:weightsync-arena" in path:
        return "store"
    if "memfd:weightsync-ingress" in path:
        return "ingress"
    if "/dev/shm/" in path:
        return "queues"
    if "memfd:" in path:
        return "other"
    return None


def shared_memory(root: int) -> dict:
    """Bytes of the memfd / shm files a server's process tree holds (see the module docstring)."""
    files: dict[tuple[int, int], dict] = {}  # (major:minor as int pair folded, inode) -> file
    pss = {"store": 0, "ingress": 0, "queues": 0, "other": 0}
    tree_pss = 0
    pids = process_tree(root)
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                kind = _kind(link)
                if kind is not None:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    key = (os.major(st.st_dev) << 20 | os.minor(st.st_dev), st.st_ino)
                    files[key] = {"kind": kind, "name": link, "bytes": st.st_blocks * 512, "size": st.st_size,
                                  "fd": True}
            kind, key = None, None
            for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                    path = " ".join(head[5:])
                    kind = _kind(path)
                    major, minor = (int(x, 16) for x in head[3].split(":"))
                    key = (major << 20 | minor, int(head[4]))
                elif kind is not None and head[0] in ("Rss:", "Pss:"):
                    value = int(head[1]) * 1024
                    if head[0] == "Pss:":
                        pss[kind] += value
                    elif key not in files or not files[key]["fd"]:
                        held = files.setdefault(key, {"kind": kind, "name": path, "bytes": 0, "fd": False})
                        held["bytes"] = max(held["bytes"], value)
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    tree_pss += int(line.split()[1]) * 1024
        except (OSError, ValueError):  # a process that ended while we read: skipped
            continue
    by_kind = {k: 0 for k in pss}
    for f in files.values():
        by_kind[f["kind"]] += f["bytes"]
    return {"processes": len(pids), "files": len(files), "allocated_bytes": by_kind,
            "allocated_total_bytes": sum(by_kind.values()), "mapped_pss_bytes": pss, "tree_pss_bytes": tree_pss}


def as_multiple(memory: dict, size: int) -> dict:
    return {"store_x": round(memory["allocated_bytes"]["store"] / size, 3),
            "total_x": round(memory["allocated_total_bytes"] / size, 3),
            "mapped_pss_x": round(sum(memory["mapped_pss_bytes"].values()) / size, 3),
            "tree_pss_x": round(memory["tree_pss_bytes"] / size, 3)}


# -- one side ------------------------------------------------------------------------------
def _timer(client, tensors: dict, transport: str, bucket: int):
    def push() -> float:
        started = time.perf_counter()
        client.push(tensors, delta=False, version=f"{transport}-{time.monotonic_ns()}", transport=transport,
                    bucket_size_bytes=bucket)
        return time.perf_counter() - started
    return push


def measure_side(label: str, quick: bool, workdir: Path) -> dict:
    """Memory, push times and engine apply of the weightsync this interpreter imports."""
    import weightsync
    from weightsync.client import WeightSyncClient
    from weightsync.common.checksum import ws64

    cfg = QUICK if quick else FULL
    bucket = cfg.bucket_bytes
    tree = Path(weightsync.__path__[0]).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    wl = workloads.dense(cfg.dense_scale)
    tensors = wl.materialize(prefix="dense.")
    size = nbytes(tensors)
    sizes, layout = sdk_layout(tensors, bucket)
    log(f"node_store {label} ({tree} @ {commit}): {size / 1e9:.3f} GB, {len(tensors)} tensors, "
        f"{len(sizes)} SDK buckets of <= {bucket >> 20} MiB")
    servers: dict[int, Server] = {}
    clients: dict[int, WeightSyncClient] = {}
    cluster = raw_inline = raw_aio = None
    memory: dict = {}
    try:
        for n in WORKERS:
            servers[n] = Server(n, workdir, extra=("--ingress-slot-bytes", str(bucket)))
            clients[n] = client = WeightSyncClient(servers[n].address, timeout=600)
            client.create_group(timeout=120)
            client.push(tensors, delta=False, version="define", allow_new_tensors=True, bucket_size_bytes=bucket)
            for k in range(2):
                client.push(tensors, delta=False, version=f"staged-{k}", mode="staged", bucket_size_bytes=bucket)
            held = shared_memory(servers[n].process.pid)
            memory[n] = {"after_two_staged": held | as_multiple(held, size)}
            log(f"node_store {label} memory, {n} workers: " + json.dumps(as_multiple(held, size)))
        chunk = min(clients[1].server_info()[0].limits.max_chunk_bytes, 32 << 20)
        source = packed_source(tensors, layout, sizes)
        cluster = BaselineCluster(1, workdir)
        cluster.setup(None, raw_bytes=sum(sizes))
        raw_inline, raw_aio = RawInline(workdir, sum(sizes)), RawInline(workdir, sum(sizes), aio=True)
        runners = {}
        for transport in TRANSPORTS:
            for n in WORKERS:
                runners[f"{transport}_{n}w"] = _timer(clients[n], tensors, transport, bucket)
            runners[RAW[transport]] = ((lambda: cluster.run_p2p(source, sizes)) if transport == "collective"
                                       else (lambda: raw_inline.push(source, sizes, chunk)))
        runners["raw_inline_aio"] = lambda: raw_aio.push(source, sizes, chunk)  # diagnostic: an aio sink
        times = alternate(runners, cfg.reps, f"node_store {label}")
        for n in WORKERS:
            if not clients[n].verify(tensors).ok:
                raise RuntimeError(f"node_store {label}: the {n}-worker server does not hold the pushed tensors")
            held = shared_memory(servers[n].process.pid)
            memory[n]["after_timing"] = held | as_multiple(held, size)
        cluster.verify(None, source, sum(sizes))
        if raw_inline.digest() != ws64(source) or raw_aio.digest() != ws64(source):
            raise RuntimeError("raw inline: a sink's buffer differs from the source")
    finally:
        for closing in (*clients.values(), cluster, raw_inline, raw_aio, *servers.values()):
            if closing is not None:
                closing.close() if not isinstance(closing, Server) else closing.stop()
    count = len(tensors)
    tensors = source = runners = None  # freed before the engine bench materializes its own
    try:
        with Harness(cfg, workdir) as h:
            engine = engine_apply.run(h, wl)
    except Exception as error:  # noqa: BLE001 - reported, not fatal: the other parts stand
        log(f"node_store {label}: engine apply failed: {error!r}")
        engine = {"error": repr(error)}
    return {"label": label, "tree": str(tree), "commit": commit, "python": sys.executable,
            "workload": wl.name, "bytes": size, "tensors": count, "buckets": len(sizes),
            "bucket_bytes": bucket, "chunk_bytes": chunk, "memory": {str(n): m for n, m in memory.items()},
            "times": {mode: [round(t, 6) for t in ts] for mode, ts in times.items()}, "engine_apply": engine}


# -- both sides, in turn ---------------------------------------------------------------------
def run_side(label: str, python: str, quick: bool, workdir: Path) -> dict:
    """One side in a process of its own, with `python` (whose weightsync it measures)."""
    out = workdir / f"node-store-{label}-{time.monotonic_ns()}.json"
    argv = [python, "-m", "bench.node_store", "--side", label, "--json", str(out), *(["--quick"] if quick else [])]
    env = dict(os.environ, PYTHONPATH=str(REPO))  # this bench, that tree's weightsync
    subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=1200)
    return json.loads(out.read_text())


def run(workdir: Path, *, quick: bool, before: str | None, rounds: int) -> dict:
    sides = ([("before", before)] if before else []) + [("after", sys.executable)]
    results: dict[str, list[dict]] = {label: [] for label, _ in sides}
    for r in range(rounds):
        for label, python in sides:
            log(f"node_store: round {r + 1}/{rounds}, {label} ({python})")
            results[label].append(run_side(label, python, quick, workdir))
    return summarize(results, quick)


def summarize(results: dict[str, list[dict]], quick: bool) -> dict:
    out: dict = {"quick": quick, "goals": GOALS, "sides": {}, "rounds": results}
    for label, rounds in results.items():
        first = rounds[0]
        times = {mode: [t for r in rounds for t in r["times"][mode]] for mode in first["times"]}
        med = {mode: median(ts) for mode, ts in times.items()}
        side = {"tree": first["tree"], "commit": first["commit"], "bytes": first["bytes"],
                "buckets": first["buckets"], "bucket_bytes": first["bucket_bytes"], "chunk_bytes": first["chunk_bytes"],
                "samples_per_mode": len(next(iter(times.values()))),
                "median_seconds": {m: round(v, 4) for m, v in med.items()}, "memory": {}, "push": {}}
        for n in map(str, WORKERS):
            side["memory"][n] = {phase: {k: median([r["memory"][n][phase][k] for r in rounds])
                                         for k in ("store_x", "total_x", "mapped_pss_x", "tree_pss_x")}
                                 for phase in ("after_two_staged", "after_timing")}
        for transport in TRANSPORTS:
            raw = med[RAW[transport]]
            one = med[f"{transport}_1w"]
            side["push"][transport] = {n: {"seconds": round(med[f"{transport}_{n}w"], 4),
                                           "vs_one_worker": round(med[f"{transport}_{n}w"] / one, 3),
                                           "vs_raw_limit": round(raw / med[f"{transport}_{n}w"], 3)}
                                       for n in WORKERS}
            side["push"][transport]["raw_seconds"] = round(raw, 4)
        side["push"]["inline"]["raw_aio_seconds"] = round(med["raw_inline_aio"], 4)
        engines = [r["engine_apply"] for r in rounds if "error" not in r["engine_apply"]]
        if engines:
            side["engine_apply"] = {
                mode["mode"]: round(median([e_run["median_seconds"] for e in engines for e_run in e["runs"]
                                            if e_run["mode"] == mode["mode"]]), 4) for mode in engines[0]["runs"]}
            side["engine_apply"]["apply_vs_copy"] = round(median([e["apply_vs_copy"] for e in engines]), 3)
        else:
            side["engine_apply"] = {"error": rounds[0]["engine_apply"].get("error")}
        out["sides"][label] = side
    return out


def markdown(result: dict, meta: dict | None = None) -> str:
    sides = result["sides"]
    after = sides["after"]
    labels = [s for s in ("before", "after") if s in sides]
    lines = ["# One copy per node", ""]
    if meta:
        lines += [f"Machine: {meta['machine']}. Command: `{meta['command']}`. Ran {meta['elapsed_seconds']:.0f} s; "
                  f"1-minute load average before/after: {meta['load_before']} / {meta['load_after']}.", ""]
    lines += [f"Dense workload, bf16, {after['bytes'] / 1e9:.3f} GB, {after['buckets']} SDK buckets of at most "
              f"{after['bucket_bytes'] >> 20} MiB; INLINE chunks of {after['chunk_bytes'] >> 20} MiB. "
              + ", ".join(f"{s}: `{sides[s]['commit']}` ({sides[s]['tree']})" for s in labels)
              + f". Rounds per side: {len(result['rounds']['after'])}, run in turn (before, after, ...); "
              "method: bench/node_store.py's docstring.", "",
              "## Memory per node after a define push and two STAGED pushes (x model bytes)", "",
              "`store`: weightsync-arena memfds; `all shm`: every memfd and /dev/shm file of the server's process "
              "tree (ingress and queues too), allocated bytes, each file once; `Pss`: the shared mappings' Pss "
              "summed over the tree (touched pages only); `tree Pss`: the whole tree (libraries, heaps too).", "",
              "| workers | " + " | ".join(f"{s} store | {s} all shm | {s} Pss | {s} tree Pss" for s in labels) + " |",
              "|---:|" + "---:|---:|---:|---:|" * len(labels)]
    for n in map(str, WORKERS):
        cells = []
        for s in labels:
            m = sides[s]["memory"][n]["after_two_staged"]
            cells += [f"{m['store_x']:.2f}x", f"{m['total_x']:.2f}x", f"{m['mapped_pss_x']:.2f}x", f"{m['tree_pss_x']:.2f}x"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "After the timed pushes (INLINE touched the ingress): " + "; ".join(
        f"{s} " + ", ".join(f"{n}w {sides[s]['memory'][n]['after_timing']['total_x']:.2f}x" for n in map(str, WORKERS))
        for s in labels) + " (all shm).", "",
        "## Dense push time by workers per node (IN_PLACE, median s)", "",
        f"Modes alternated after one warm-up each; {after['samples_per_mode']} samples per mode and side. "
        "`x 1 worker` = t(n) / t(1) (goal for 3 workers: <= "
        f"{GOALS['three_vs_one_workers']}); `x raw limit` = t(raw) / t(n) (goal >= {GOALS['vs_raw_limit']}).", "",
        "| transport | workers | " + " | ".join(f"{s} s | {s} x 1 worker | {s} x raw limit" for s in labels) + " |",
        "|---|---:|" + "---:|---:|---:|" * len(labels)]
    for transport in TRANSPORTS:
        for n in WORKERS:
            cells = []
            for s in labels:
                p = sides[s]["push"][transport][n]
                cells += [f"{p['seconds']:.3f}", f"{p['vs_one_worker']:.2f}", f"{p['vs_raw_limit']:.2f}"]
            lines.append(f"| {transport} | {n} | " + " | ".join(cells) + " |")
        raw = " / ".join(f"{s} {sides[s]['push'][transport]['raw_seconds']:.3f} s" for s in labels)
        lines.append(f"| {RAW[transport]} (limit) | 1 receiver | {raw} |" + " |" * (3 * len(labels) - 1))
    aio = " / ".join(f"{s} {sides[s]['push']['inline']['raw_aio_seconds']:.3f} s" for s in labels)
    lines.append(f"| raw_inline_aio (diagnostic) | 1 receiver | {aio} |" + " |" * (3 * len(labels) - 1))
    lines += ["", "## Engine apply from the store (1 worker, SHM pushes; median s)", "",
              "| side | load_state_dict (copy_baseline) | engine_apply | apply / copy | push | push -> served |",
              "|---|---:|---:|---:|---:|---:|"]
    for s in labels:
        e = sides[s]["engine_apply"]
        if "error" in e:
            lines.append(f"| {s} | failed: {e['error']} | | | | |")
        else:
            lines.append(f"| {s} | {e['copy_baseline']:.3f} | {e['engine_apply']:.3f} | {e['apply_vs_copy']:.2f} | "
                         f"{e['push']:.3f} | {e['push_served']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.node_store", description=__doc__.splitlines()[0])
    parser.add_argument("--side", help="measure this interpreter's weightsync under this label")
    parser.add_argument("--json", help="where --side writes its result")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as python -m bench: the trainer's own ops on one thread
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="weightsync-node-store-") as tmp:
        result = measure_side(args.side or "this", args.quick, Path(tmp))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n") if args.json else print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
