"""The weightsync side: a real server subprocess and the SDK as the trainer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from bench.progress import log

REPO = Path(__file__).resolve().parent.parent


def shm_names_of(pid: int) -> set[str]:
    """/dev/shm segments a process has mapped (the server's worker queues)."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                if "/dev/shm/" in line:
                    names.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
    except OSError:
        pass
    return names


class Server:
    """`python -m weightsync.server.cli --workers N --device cpu`, as a user starts it."""

    def __init__(self, workers: int, workdir: Path, start_timeout: float = 180.0, env: dict | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.workers = workers
        tag = uuid.uuid4().hex[:6]
        ready = workdir / f"server-{workers}w-{tag}.ready"
        self.log_path = workdir / f"server-{workers}w-{tag}.log"
        started = time.monotonic()
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "weightsync.server.cli", "--listen", "127.0.0.1:0",
                 "--workers", str(workers), "--device", "cpu", "--ready-file", str(ready),
                 "--log-level", "warning", *extra],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + start_timeout
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.log_path.read_text(errors='replace')}")
            time.sleep(0.05)
        self.port = json.loads(ready.read_text())["port"]
        ready.unlink()
        self.shm = shm_names_of(self.process.pid)
        self.store_bytes = 0
        """Bytes this server's store holds (defined by the bench): the harness restarts it past a budget."""
        log(f"server up: {workers} CPU workers on {self.address} in {time.monotonic() - started:.1f} s",
            pid=self.process.pid)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(10)
        leaked = sorted(n for n in getattr(self, "shm", ()) if os.path.exists(f"/dev/shm/{n}"))
        if leaked:
            log(f"WARNING: server left shared memory behind: {leaked}")
        return code

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class WeightSyncTrainer:
    """The trainer: WeightSyncClient over one or more servers, one transfer group, timed push() calls."""

    def __init__(self, servers: Server | list[Server], bucket_size_bytes: int) -> None:
        from weightsync.client.sdk import WeightSyncClient

        self.servers = servers if isinstance(servers, list) else [servers]
        self.bucket_size_bytes = bucket_size_bytes
        self.client = WeightSyncClient([s.address for s in self.servers], timeout=300)
        try:
            self.client.create_group(timeout=120)
        except BaseException:
            self.client.close()
            raise
        self._versions = 0
        self.last = None
        """The last PushResult (bucket count, zero-copy buckets, ...)."""

    def push(self, tensors: dict[str, torch.Tensor], *, allow_new: bool = False, checksums: bool | None = None,
             **options) -> float:
        """Seconds from the push() call to Committed on every server."""
        self._versions += 1
        started = time.perf_counter()
        self.last = self.client.push(tensors, version=f"bench-{self._versions}", bucket_size_bytes=self.bucket_size_bytes,
                                     allow_new_tensors=allow_new, checksums=checksums,
                                     **{"delta": False, **options})
        return time.perf_counter() - started

    def define(self, tensors: dict[str, torch.Tensor]) -> None:
        """First push of a tensor set: defines the server's store (untimed warm-up)."""
        self.push(tensors, allow_new=True)
        for server in self.servers:
            server.store_bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def verify(self, tensors: dict[str, torch.Tensor]) -> None:
        """Untimed: every server's checksums equal the trainer's (WeightSyncClient.verify)."""
        result = self.client.verify(tensors)
        if not result.ok:
            raise RuntimeError(f"weightsync: {len(result.mismatches)} tensors differ, e.g. {result.mismatches[0]}")

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> WeightSyncTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
