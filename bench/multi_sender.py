"""Several senders of one version, each behind its own slow link: `python -m bench --only multi_sender`.

The question (issue 35): when each trainer process's link is the bottleneck, do N processes pushing
their parts of one version (WeightSyncClient(part=Part(rank, world)), over INLINE) beat the one
process that gathers the whole model first and pushes it over its one link? Each row pushes the same
model (whole tensors, split among the senders by bytes: split_tensors) into the same two servers:

  gather   one sender holding every tensor, a plain push (no part): the baseline;
  parts 1  the same sender as one part of one (world 1): what the part path itself costs;
  parts N  N sender processes, each holding 1/N of the tensors, pushing one version together.

The links: the bench re-runs this module as `unshare -n python -m bench.multi_sender hub ...`: a
network namespace (the hub) with the two servers, listening on every address. Each sender is a
process in a network namespace of its own (`unshare -n`), joined to the hub by a veth pair whose
sender end a token-bucket filter holds to RATE (`tc qdisc ... tbf`, the sender's egress: the data
direction). Without namespaces (no unshare, ip or tc, or no privilege for them) every process runs in
the current namespace and each sender paces itself in user space: after each bucket it sleeps until
its bytes at RATE would have taken that long (mode "paced" in the table, said in the results).
The rows run alternately, rep by rep; each row's median and its ratio to gather's median are reported.
Every wait is bounded and every process is stopped on the way out, whatever failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import median
from bench.progress import log

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
COUNTS = (1, 2, 4)
SERVERS = 2
REPLY_SECONDS = 600.0
"""Bounds every answer of a sender (its start, its model, one push, its verify)."""
SUBNET = "10.77"
"""Sender k's veth pair is 10.77.k.1 (hub end) / 10.77.k.2 (sender end)."""


# -- pure pieces (tests/unit/test_bench_multi_sender.py) ----------------------------------------
def split_tensors(sizes: Sequence[tuple[str, int]], senders: int) -> list[list[str]]:
    """Whole tensors shared out among `senders` by bytes: largest first, each to the sender holding
    the fewest bytes so far (the lowest index on a tie); each sender's names in the model's order."""
    if senders < 1:
        raise ValueError(f"senders must be >= 1, got {senders}")
    order = {name: i for i, (name, _) in enumerate(sizes)}
    loads = [0] * senders
    shares: list[list[str]] = [[] for _ in range(senders)]
    for name, size in sorted(sizes, key=lambda item: (-item[1], order[item[0]])):
        k = min(range(senders), key=lambda i: (loads[i], i))
        loads[k] += size
        shares[k].append(name)
    return [sorted(share, key=order.__getitem__) for share in shares]


def model_sizes(total_bytes: int, tensors: int) -> list[tuple[str, int]]:
    """The bench's model: `tensors` float32 tensors of (nearly) equal size, `total_bytes` in all."""
    per = max(1, total_bytes // tensors // 4)
    return [(f"layers.{i}.weight", per * 4) for i in range(tensors)]


def make_tensor(name: str, size: int, seed: int) -> torch.Tensor:
    """Tensor `name` of the model, the same bytes in every process (its own generator)."""
    index = int(name.split(".")[1])
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    return torch.randn(size // 4, generator=g)


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    senders: int
    seconds: tuple[float, ...]
    model_bytes: int
    servers: int


def rows_table(rows: Sequence[Row], rate_bits: float, baseline: str = "gather") -> list[dict]:
    """Per row: median seconds; the model's bytes into every server per second (MB/s, 1e6); the seconds its
    senders' links need at line rate (each sender sends its share to every server over its one link), and
    how much of that line rate the row reached; the ratio of the baseline's median to this row's (above 1:
    faster than the baseline)."""
    base = median(list(next(r for r in rows if r.label == baseline).seconds))
    out = []
    for r in rows:
        m = median(list(r.seconds))
        line = r.model_bytes * r.servers * 8 / (rate_bits * r.senders)
        out.append({"row": r.label, "senders": r.senders, "median_seconds": round(m, 3),
                    "seconds": [round(s, 3) for s in r.seconds],
                    "aggregate_mb_per_s": round(r.model_bytes * r.servers / m / 1e6, 1),
                    "line_rate_seconds": round(line, 3), "of_line_rate": round(line / m, 2),
                    "speedup_vs_gather": round(base / m, 2)})
    return out


def markdown_table(table: Sequence[dict]) -> str:
    lines = ["| row | senders | median s | runs (s) | aggregate MB/s (all servers) | s at line rate | of line rate "
             "| vs gather |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for t in table:
        runs = ", ".join(f"{s:.2f}" for s in t["seconds"])
        lines.append(f"| {t['row']} | {t['senders']} | {t['median_seconds']:.2f} | {runs} | "
                     f"{t['aggregate_mb_per_s']:.1f} | {t['line_rate_seconds']:.2f} | {t['of_line_rate'] * 100:.0f}% | "
                     f"{t['speedup_vs_gather']:.2f}x |")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    if "skipped" in result:
        return f"\n## Several senders, one version\n\nNot run: {result['skipped']}\n"
    cfg = result["config"]
    how = ("each sender in a network namespace of its own, its veth link to the servers' namespace held to "
           f"{cfg['rate']} by tc tbf" if result["links"] == "namespaces" else
           f"no namespaces ({result.get('why_paced', '')}): every sender paced in user space to {cfg['rate']} "
           "(sleeps after each bucket)")
    return (f"\n## Several senders, one version\n\n{cfg['model_bytes'] / MIB:.0f} MiB model ({cfg['tensors']} "
            f"float32 tensors, whole tensors split among the senders by bytes) pushed over INLINE into "
            f"{cfg['servers']} servers (CPU workers each: {cfg['workers']}); links: {how}. Median of {cfg['reps']} "
            "alternated runs per row (after one untimed push each), seconds from the push commands to every "
            "sender's push returning; every row verified at the end. gather = one process holding the whole "
            "model, plain push (no part); parts N = N processes, each pushing its share as one part of one "
            "version. `s at line rate`: the seconds the row's links need at "
            f"{cfg['rate']} (each sender sends its share to every server over its one link); `of line rate` near 100% "
            "says the links, not the 2 CPUs, bound the row. Every sender pushes the SDK's default buckets; "
            "with one worker per server, every part's buckets share that worker (a lane each).\n\n" + markdown_table(result["table"]))


# -- a sender process ---------------------------------------------------------------------
def sender_main() -> int:
    """JSON lines in on stdin, out on stdout: init, push, verify, exit."""
    from weightsync.client import WeightSyncClient
    from weightsync.client.parts.part import Part
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    torch.set_num_threads(1)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the answer channel
    out.write(json.dumps({"pid": os.getpid()}) + "\n")
    out.flush()
    client = None
    tensors: dict[str, torch.Tensor] = {}
    cfg: dict = {}
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "init":
                cfg = msg
                tensors = {name: make_tensor(name, size, msg["seed"]) for name, size in msg["tensors"]}
                part = Part(rank=msg["rank"], world=msg["world"]) if msg["part"] else None
                client = WeightSyncClient(msg["servers"], timeout=REPLY_SECONDS, part=part)
                reply: dict = {"ok": True}
            elif msg["cmd"] == "push":
                assert client is not None
                started = time.perf_counter()
                progress = None
                if cfg["pace_bits_per_s"]:
                    rate = cfg["pace_bits_per_s"] / SERVERS  # the bytes counted are per server's stream

                    def progress(p, rate=rate, started=started) -> None:
                        behind = p.bytes_sent * 8 / rate - (time.perf_counter() - started)
                        if behind > 0:
                            time.sleep(behind)
                # Dense on both sides: the bench measures links, not delta (parts keep no copy either).
                options = {"part_key": msg["key"], "delta": False} if cfg["part"] else {"delta": False}
                result = client.push(tensors, version=msg["version"], transport="inline", allow_new_tensors=True,
                                     progress=progress, **options)
                reply = {"ok": True, "seconds": time.perf_counter() - started, "bytes": result.size_bytes}
            elif msg["cmd"] == "verify":
                assert client is not None
                check = client.verify(tensors)
                reply = {"ok": check.ok, "mismatches": [f"{m.server}:{m.name}" for m in check.mismatches[:5]]}
            else:
                break
        except Exception as error:  # the hub reports it and stops every process
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    if client is not None:
        client.close()
    return 0


# -- the hub: servers, links, senders -----------------------------------------------------
def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, timeout=30, capture_output=True)


class Sender:
    """One sender process (in its own network namespace when `namespaces`), answering JSON lines."""

    def __init__(self, index: int, namespaces: bool, rate: str) -> None:
        self.index = index
        argv = [sys.executable, "-m", "bench.multi_sender", "sender"]
        if namespaces:
            argv = ["unshare", "-n", *argv]
        self.process = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        bufsize=1, start_new_session=True)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)
        try:
            self._connect(namespaces, rate)
        except BaseException:  # a sender half set up is stopped here: the hub's finally never saw it
            self.stop()
            raise

    def _connect(self, namespaces: bool, rate: str) -> None:
        """Its pid, then (namespaces) its veth link to the hub, held to `rate` on its egress."""
        index = self.index
        self.pid = self.read(60.0)["pid"]  # printed in the new namespace: the link can move in now
        self.address = "127.0.0.1"
        if namespaces:
            hub, end = f"hub{index}", f"snd{index}"
            self.address = f"{SUBNET}.{index}.1"
            sh("ip", "link", "add", hub, "type", "veth", "peer", "name", end)
            sh("ip", "link", "set", end, "netns", str(self.pid))
            sh("ip", "addr", "add", f"{self.address}/24", "dev", hub)
            sh("ip", "link", "set", hub, "up")
            inside = ["nsenter", "-t", str(self.pid), "-n"]
            sh(*inside, "ip", "link", "set", "lo", "up")
            sh(*inside, "ip", "addr", "add", f"{SUBNET}.{index}.2/24", "dev", end)
            sh(*inside, "ip", "link", "set", end, "up")
            sh(*inside, "tc", "qdisc", "add", "dev", end, "root", "tbf", "rate", rate, "burst", "1mb",
               "latency", "400ms")

    def send(self, msg: dict) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(msg) + "\n")
        self.process.stdin.flush()

    def read(self, timeout: float) -> dict:
        assert self.process.stdout is not None
        if not self._selector.select(timeout):
            raise TimeoutError(f"sender {self.index} did not answer within {timeout:.0f} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"sender {self.index} exited ({self.process.poll()})")
        return json.loads(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send({"cmd": "exit"})
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def answers(senders: Sequence[Sender], what: str) -> list[dict]:
    """Every sender's answer, each bounded; a failed one raises naming the sender."""
    out = []
    for s in senders:
        reply = s.read(REPLY_SECONDS)
        if not reply.get("ok"):
            raise RuntimeError(f"{what}: sender {s.index}: {reply}")
        out.append(reply)
    return out


def measure(*, namespaces: bool, rate: str, total_bytes: int, tensors: int, reps: int, counts: Sequence[int],
            workers: int) -> dict:
    from bench.servers import Server

    if namespaces:
        sh("ip", "link", "set", "lo", "up")
    sizes = model_sizes(total_bytes, tensors)
    bits = parse_rate(rate)  # a rate tc would refuse fails here, before any process starts
    pace = 0 if namespaces else bits
    listen = "0.0.0.0:0" if namespaces else "127.0.0.1:0"  # every hub address only inside the hub's namespace
    rows = [("gather", 1, False)] + [(f"parts {n}", n, True) for n in counts]
    with tempfile.TemporaryDirectory() as tmp:
        servers: list[Server] = []
        fleets: dict[str, list[Sender]] = {}
        try:
            for _ in range(SERVERS):
                servers.append(Server(workers, Path(tmp), extra=("--listen", listen, "--ingress-slot-count", str(max(2, *counts)))))
            index = 0
            for label, n, part in rows:
                fleet = []
                for rank, share in enumerate(split_tensors(sizes, n)):
                    index += 1
                    sender = Sender(index, namespaces, rate)
                    fleet.append(sender)
                    fleets.setdefault(label, []).append(sender)
                    sender.send({"cmd": "init", "servers": [f"{sender.address}:{s.port}" for s in servers],
                                 "tensors": [(name, dict(sizes)[name]) for name in share], "seed": 1,
                                 "rank": rank, "world": n, "part": part, "pace_bits_per_s": pace})
                answers(fleet, f"{label} init")
            times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
            version = 0
            for rep in range(reps + 1):  # rep 0: untimed (defines the store, warms every path)
                for label, _, _ in rows:
                    version += 1
                    started = time.perf_counter()
                    for s in fleets[label]:
                        s.send({"cmd": "push", "version": f"ms-{version}", "key": f"ms-{version}-key"})
                    answers(fleets[label], f"{label} push")
                    seconds = time.perf_counter() - started
                    if rep:
                        times[label].append(seconds)
                    log(f"multi_sender {label} run {rep}{' (untimed)' if not rep else ''}: {seconds:.2f} s")
                    if rep == reps:  # the last run's bytes, on every server, tensor for tensor
                        for s in fleets[label]:
                            s.send({"cmd": "verify"})
                        answers(fleets[label], f"{label} verify")
        finally:
            for fleet in fleets.values():
                for s in fleet:
                    s.stop()
            for server in servers:
                server.stop()
    model = sum(size for _, size in sizes)
    table = rows_table([Row(label, n, tuple(times[label]), model, SERVERS) for label, n, _ in rows], bits)
    return {"links": "namespaces" if namespaces else "paced",
            "config": {"rate": rate, "model_bytes": model, "tensors": tensors, "reps": reps, "servers": SERVERS,
                       "workers": workers, "counts": list(counts)},
            "table": table}


def parse_rate(rate: str) -> float:
    """tc's rate words the bench uses: 300mbit, 1gbit, 500kbit (bits per second)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: a number and kbit, mbit or gbit")


def run(*, quick: bool, rate: str = "300mbit", model_mib: int | None = None, reps: int | None = None) -> dict:
    """The hub in a network namespace of its own (namespaces: yes), else in this one with paced senders."""
    total = (model_mib or (64 if quick else 128)) * MIB
    reps = reps or (2 if quick else 4)
    args = ["--rate", rate, "--bytes", str(total), "--reps", str(reps)]
    why = namespaces_unavailable()
    if why is None:
        argv = ["unshare", "-n", sys.executable, "-m", "bench.multi_sender", "hub", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=REPO)
        sys.stderr.write(done.stderr[-6000:])
        if done.returncode != 0:
            raise RuntimeError(f"multi_sender: the hub exited {done.returncode}: {done.stderr.strip()[-600:]}")
        return json.loads(done.stdout)
    log(f"multi_sender: network namespaces unavailable ({why}); pacing each sender in user space instead")
    result = measure(namespaces=False, rate=rate, total_bytes=total, tensors=64, reps=reps, counts=COUNTS,
                     workers=1)
    return result | {"why_paced": why}


def namespaces_unavailable() -> str | None:
    """Why this machine cannot give each sender a namespace and a tc-limited veth link; None when it can."""
    probe = "ip link set lo up && ip link add wsa type veth peer name wsb && tc qdisc add dev wsa root tbf " \
            "rate 1mbit burst 32kb latency 50ms"
    try:
        done = subprocess.run(["unshare", "-n", "sh", "-c", probe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {error}"
    return None if done.returncode == 0 else f"unshare -n, ip link add veth, tc tbf: {done.stderr.strip()[-200:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["hub", "sender"])
    parser.add_argument("--rate", default="300mbit")
    parser.add_argument("--bytes", type=int, default=128 * MIB)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--paced", action="store_true", help="hub: no namespaces, senders paced in user space")
    args = parser.parse_args()
    if args.role == "sender":
        return sender_main()
    print(json.dumps(measure(namespaces=not args.paced, rate=args.rate, total_bytes=args.bytes, tensors=args.tensors,
                             reps=args.reps, counts=COUNTS, workers=args.workers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
