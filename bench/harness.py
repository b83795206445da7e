"""What every benchmark experiment shares: the run configuration, the harness
that starts (and always stops) servers and receivers, mode alternation, and
the bucket layouts of the baselines and of the SDK."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.baselines import BaselineCluster
from bench.progress import log
from bench.servers import Server, WeightSyncTrainer

MB = 1 << 20
GB = 1 << 30


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    reps: int
    """Timed repetitions of every mode in the main comparison (after one warm-up each)."""
    scaling_reps: int
    bucket_bytes: int
    dense_scale: float
    moe_scale: float
    tiny_count: int
    per_tensor_limit: int
    """per_tensor runs on at most this many tensors (a strided sample) and is scaled
    linearly to the whole workload; 0 runs every tensor."""
    latency_samples: int
    bytes_points: tuple[int, ...]
    bytes_tensor_size: int
    count_bytes: int
    count_points: tuple[int, ...]
    receivers_bytes: int
    receivers_tensors: int
    receivers_points: tuple[int, ...]
    store_budget_bytes: int
    """Most bytes a server's workers may hold before the harness starts a fresh server."""
    diagnostics: bool
    """Also time weightsync with checksums=True (the CUDA default), and raw with the SDK's own bucket plan
    (reported in latest.meta.json and latest.md, not in latest.json's runs)."""
    receiver_threads: int = 1
    """torch intra-op threads of each baseline receiver (see bench/receiver.py)."""
    trainer_threads: int = 1
    """torch intra-op threads of this process (the trainer of every mode). The SDK runs
    push() with one thread whatever this says; one thread here gives concat's torch.cat
    the same condition (with more, OpenMP barriers stall on the 2 busy cores)."""


FULL = Config(
    name="full", reps=5, scaling_reps=3, bucket_bytes=256 * MB,
    dense_scale=1.0, moe_scale=1.0, tiny_count=5000, per_tensor_limit=0, latency_samples=60,
    bytes_points=(128 * MB, 256 * MB, 512 * MB, 1024 * MB, 2048 * MB), bytes_tensor_size=8 * MB,
    count_bytes=256 * MB, count_points=(8, 64, 512, 4096, 16384),
    receivers_bytes=512 * MB, receivers_tensors=64, receivers_points=(1, 2, 4),
    store_budget_bytes=int(2.5 * GB), diagnostics=True,
)
QUICK = Config(
    name="quick", reps=3, scaling_reps=2, bucket_bytes=64 * MB,
    dense_scale=0.25, moe_scale=0.25, tiny_count=1500, per_tensor_limit=0, latency_samples=30,
    bytes_points=(32 * MB, 64 * MB, 128 * MB, 256 * MB), bytes_tensor_size=4 * MB,
    count_bytes=64 * MB, count_points=(4, 64, 512, 4096),
    receivers_bytes=128 * MB, receivers_tensors=32, receivers_points=(1, 2, 4),
    store_budget_bytes=int(1.5 * GB), diagnostics=False,
)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def median(values: list[float]) -> float:
    return statistics.median(values)


class Harness:
    """Owns every process the benchmark starts: at most one server set and one receiver set at a time."""

    def __init__(self, cfg: Config, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.servers: list[Server] = []
        """The servers of the current trainer (one per receiver, 1 worker each)."""
        self.trainer: WeightSyncTrainer | None = None
        self.cluster: BaselineCluster | None = None
        self.server_starts = 0
        self.processes: list = []
        """Every Popen started (servers, receivers), to check they all ended."""
        self.shm: set[str] = set()
        """Every shared-memory segment a server of ours had mapped."""

    def weightsync(self, receivers: int, adding_bytes: int) -> WeightSyncTrainer:
        """A trainer joined to `receivers` servers of 1 CPU worker each that can hold `adding_bytes` more.

        A server is a node and holds the model once whatever its worker count (server/store/node_store.py;
        Gloo sends each bucket to one worker per node), so `receivers` full copies, as raw's broadcast
        to `receivers` processes makes, are `receivers` nodes."""
        servers = self.servers
        if (len(servers) == receivers and self.trainer is not None
                and max(s.store_bytes for s in servers) + adding_bytes <= self.cfg.store_budget_bytes):
            return self.trainer
        self.stop_server()
        with ThreadPoolExecutor(receivers) as pool:  # the starts overlap (each waits for its ready file)
            starting = [pool.submit(Server, 1, self.workdir) for _ in range(receivers)]
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            for f in starting:
                if f.exception() is None:
                    f.result().stop()
            raise failed[0]
        self.servers = [f.result() for f in starting]
        self.server_starts += receivers
        for server in self.servers:
            self.processes.append(server.process)
            self.shm |= server.shm
        self.trainer = WeightSyncTrainer(self.servers, self.cfg.bucket_bytes)
        return self.trainer

    def receivers(self, count: int) -> BaselineCluster:
        if self.cluster is not None and self.cluster.receivers == count:
            return self.cluster
        self.stop_cluster()
        self.cluster = BaselineCluster(count, self.workdir, threads=self.cfg.receiver_threads)
        self.processes += self.cluster.procs
        return self.cluster

    def stop_server(self) -> None:
        """Stop the trainer's servers (every one, whatever fails)."""
        trainer, self.trainer = self.trainer, None
        servers, self.servers = self.servers, []
        try:
            if trainer is not None:
                trainer.close()
        finally:
            codes = [server.stop() for server in servers]
            if codes:
                log(f"{len(codes)} server(s) stopped (exit {codes})")

    def stop_cluster(self) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.close()
            log("baseline receivers stopped")

    def close(self) -> None:
        try:
            self.stop_cluster()
        finally:
            self.stop_server()

    def leftovers(self) -> dict:
        """Processes still running and shared-memory segments still present (both should be empty)."""
        running = [p.pid for p in self.processes if p.poll() is None]
        segments = sorted(n for n in self.shm if Path("/dev/shm", n).exists())
        return {"processes": running, "shm_segments": segments}

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def alternate(runners: dict[str, Callable[[], float]], reps: int, label: str) -> dict[str, list[float]]:
    """One warm-up of every mode, then A B C D A B C D ... `reps` times."""
    for mode, run in runners.items():
        seconds = run()
        log(f"{label}: warm-up {mode} {seconds:.3f} s")
    out: dict[str, list[float]] = {mode: [] for mode in runners}
    for rep in range(reps):
        for mode, run in runners.items():
            seconds = run()
            out[mode].append(seconds)
        log(f"{label}: rep {rep + 1}/{reps} " + " ".join(f"{m}={v[-1]:.3f}s" for m, v in out.items()))
    return out


def plan_layout(tensors: dict[str, torch.Tensor], bucket_bytes: int):
    """Greedy buckets of up to bucket_bytes in input order, tensors at 64-byte aligned
    offsets (weightsync.common.layout.plan_buckets): the layout raw and concat use."""
    from weightsync.common.layout import TensorMeta, plan_buckets

    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes)
    sizes = [b.size_bytes for b in buckets]
    layout = [[(p.meta.name, p.offset_bytes, p.meta.size_bytes) for p in b.tensors] for b in buckets]
    return sizes, layout


def sdk_layout(tensors: dict[str, torch.Tensor], bucket_bytes: int):
    """The bucket plan the SDK itself makes for these tensors (it may give large
    tensors buckets of their own): sizes and placement."""
    from weightsync.client.buckets.planning import build_plan

    planned = build_plan(list(tensors.items()), bucket_bytes)
    sizes = [p.spec.size_bytes for p in planned]
    layout = [[(t.name, t.offset_bytes, t.size_bytes) for t in p.spec.tensors] for p in planned]
    return sizes, layout
