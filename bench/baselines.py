"""The trainer side of the baseline modes (raw, concat, per_tensor).

The receivers are real processes (`python -m bench.receiver`), spawned with
subprocess, joined with this process (rank 0) in a plain ProcessGroupGloo and
driven over a JSON control socket each. Nothing is pickled.
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed import TCPStore

from bench import control
from bench.progress import log
from bench.receiver import broadcast, make_group

REPO = Path(__file__).resolve().parent.parent
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.uint8: "uint8"}


class BaselineCluster:
    """`receivers` receiver processes plus this process as rank 0."""

    def __init__(self, receivers: int, workdir: Path, timeout: float = 300.0, threads: int = 1) -> None:
        self.receivers = receivers
        self.timeout = datetime.timedelta(seconds=timeout)
        self.group = f"bench-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen] = []
        self.conns: list[socket.socket] = []
        self.pg = None
        started = time.monotonic()
        self.store = TCPStore("127.0.0.1", 0, None, True, self.timeout, wait_for_workers=False)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        world = receivers + 1
        try:
            for rank in range(1, world):
                log_path = workdir / f"receiver-{self.group}-{rank}.log"
                with open(log_path, "wb") as out:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "bench.receiver", "--store-port", str(self.store.port),
                         "--group", self.group, "--rank", str(rank), "--world-size", str(world),
                         "--timeout", str(timeout), "--threads", str(threads)],
                        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                    ))
            self.store.set_timeout(datetime.timedelta(seconds=120))
            self.pg = make_group(self.store, self.group, 0, world, self.timeout)
            for rank in range(1, world):
                port = int(self.store.get(f"bench/{self.group}/control/{rank}"))
                sock = socket.create_connection(("127.0.0.1", port), timeout=120)
                sock.settimeout(None)
                self.conns.append(control.tune(sock))
        except BaseException:
            self.close()
            raise
        log(f"baseline receivers up: {receivers} processes in {time.monotonic() - started:.1f} s",
            pids=[p.pid for p in self.procs])

    # -- control --------------------------------------------------------------------
    def _request_all(self, message: dict) -> list[dict]:
        for conn in self.conns:
            control.send(conn, message)
        return [self._answer(conn) for conn in self.conns]

    def _answer(self, conn: socket.socket) -> dict:
        answer = control.recv(conn)
        if "error" in answer:
            raise RuntimeError(f"receiver error: {answer['error']}")
        return answer

    def _broadcast(self, tensor: torch.Tensor) -> None:
        broadcast(self.pg, tensor, self.timeout)

    # -- setup --------------------------------------------------------------------
    def setup(self, tensors: dict[str, torch.Tensor] | None, raw_bytes: int) -> None:
        """Allocate (and touch) the receivers' parameters and raw buffer."""
        dtype = DTYPE_NAMES[next(iter(tensors.values())).dtype] if tensors else "bfloat16"
        spec = [[name, list(t.shape)] for name, t in tensors.items()] if tensors else []
        self._request_all({"op": "setup", "dtype": dtype, "tensors": spec, "raw_bytes": raw_bytes})

    def verify(self, tensors: dict[str, torch.Tensor] | None, source: torch.Tensor | None, raw_bytes: int) -> None:
        """Untimed: every receiver holds the trainer's parameters (concat/per_tensor) and
        the raw bytes (raw). Raises on any difference."""
        from weightsync.common.checksum import ws64

        want_params = sum(ws64(t) for t in tensors.values()) % (1 << 64) if tensors else 0
        want_raw = ws64(source[:raw_bytes]) if source is not None else None
        for rank, answer in enumerate(self._request_all({"op": "digest", "raw_bytes": raw_bytes if source is not None else 0}), 1):
            if tensors and int(answer["params"]) != want_params:
                raise RuntimeError(f"receiver {rank}: parameters differ from the trainer's after concat/per_tensor")
            if want_raw is not None and int(answer["raw"]) != want_raw:
                raise RuntimeError(f"receiver {rank}: raw buffer differs from the trainer's")

    def free(self) -> None:
        self._request_all({"op": "free"})

    # -- modes ------------------------------------------------------------------
    def run_raw(self, source: torch.Tensor, bucket_sizes: Sequence[int]) -> float:
        """Broadcast `source` bucket by bucket into the receivers' preallocated buffers.

        The receivers are armed before the clock starts (they are already waiting
        in their first broadcast); the clock stops when every receiver has said
        it holds the last byte.
        """
        offsets = []
        cursor = 0
        for size in bucket_sizes:
            offsets.append([cursor, size])
            cursor += size
        assert cursor <= source.numel()
        self._request_all({"op": "raw", "buckets": offsets})
        started = time.perf_counter()
        for offset, size in offsets:
            self._broadcast(source[offset : offset + size])
        for conn in self.conns:
            self._answer(conn)
        return time.perf_counter() - started

    def run_p2p(self, source: torch.Tensor, bucket_sizes: Sequence[int]) -> float:
        """Like run_raw, with a point-to-point send per bucket (one in flight) to one receiver, which
        posts its recv into its preallocated buffer: the Gloo limit of delivering the bytes once."""
        assert self.receivers == 1, "p2p sends to one receiver"
        offsets = []
        cursor = 0
        for size in bucket_sizes:
            offsets.append([cursor, size])
            cursor += size
        assert cursor <= source.numel()
        self._request_all({"op": "p2p", "buckets": offsets})
        started = time.perf_counter()
        for tag, (offset, size) in enumerate(offsets):
            self.pg.send([source[offset : offset + size]], 1, tag).wait(self.timeout)
        for conn in self.conns:
            self._answer(conn)
        return time.perf_counter() - started

    def run_concat(self, buckets: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> float:
        """Per bucket: torch.cat pack, one control round trip (metadata out, answer after
        the receivers unpacked), one broadcast into a fresh buffer on every receiver."""
        started = time.perf_counter()
        for bucket in buckets:
            packed = torch.cat([t.detach().reshape(-1) for _, t in bucket])
            message = {
                "op": "bucket",
                "dtype": DTYPE_NAMES[packed.dtype],
                "names": [name for name, _ in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
            }
            for conn in self.conns:
                control.send(conn, message)
            self._broadcast(packed)
            for conn in self.conns:
                self._answer(conn)
        return time.perf_counter() - started

    def run_per_tensor(self, items: Sequence[tuple[str, torch.Tensor]]) -> float:
        """Per tensor: one control round trip and one broadcast of the tensor itself."""
        started = time.perf_counter()
        for name, tensor in items:
            message = {"op": "tensor", "name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}
            for conn in self.conns:
                control.send(conn, message)
            self._broadcast(tensor.detach().contiguous())
            for conn in self.conns:
                self._answer(conn)
        return time.perf_counter() - started

    # -- teardown ------------------------------------------------------------------
    def close(self) -> None:
        for conn in self.conns:
            try:
                control.send(conn, {"op": "quit"})
                conn.settimeout(10)
                control.recv(conn)
            except (OSError, ConnectionError, ValueError):
                pass
            conn.close()
        self.conns = []
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.procs = []
        self.pg = None

    def __enter__(self) -> BaselineCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bucket_bytes_needed(sizes: Sequence[int]) -> int:
    return int(sum(sizes))


def packed_source(tensors: dict[str, torch.Tensor], layout: Sequence[Sequence[tuple[str, int, int]]],
                  bucket_sizes: Sequence[int]) -> torch.Tensor:
    """One preallocated, touched send buffer holding every bucket back to back, filled
    with the real tensor bytes at their planned offsets (done before any clock starts)."""
    total = bucket_bytes_needed(bucket_sizes)
    source = torch.zeros(total, dtype=torch.uint8)
    base = 0
    for bucket, size in zip(layout, bucket_sizes, strict=True):
        for name, offset, nbytes in bucket:
            if nbytes:
                source[base + offset : base + offset + nbytes].copy_(tensors[name].reshape(-1).view(torch.uint8))
        base += size
    return source


def strided_subset(items: Sequence[tuple[str, torch.Tensor]], limit: int) -> list[tuple[str, torch.Tensor]]:
    """Every k-th tensor, so the subset has the whole workload's mix of sizes."""
    if limit <= 0 or limit >= len(items):
        return list(items)
    step = len(items) / limit
    return [items[math.floor(i * step)] for i in range(limit)]
