"""Test helpers: a real server subprocess, and a trainer written with plain
torch.distributed and the generated stubs (deliberately not the SDK)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from weightsync.common.numba_cache import COMPILE_AHEAD_SECONDS
from weightsync.server.config import ServerConfig
from weightsync.server.workers.supervisor import STARTUP_TIMEOUT_SECONDS, STOP_TIMEOUT_SECONDS
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

DTYPE = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.float8_e4m3fn: tensor_pb2.DTYPE_FLOAT8_E4M3FN,
    torch.float8_e5m2: tensor_pb2.DTYPE_FLOAT8_E5M2,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.int16: tensor_pb2.DTYPE_INT16,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("psm_")}


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    ready: dict = field(default_factory=dict)
    """The server's ready file: port, pid, health_port, metrics_port."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=[("grpc.max_receive_message_length", 64 << 20)])

    def stub(self) -> pb_grpc.WeightSyncServiceStub:
        return pb_grpc.WeightSyncServiceStub(self.channel())

    def worker_pids(self) -> list[int]:
        info = self.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        return [w.pid for w in info.workers]

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int:
        """Signal the server and wait for its exit, by default SERVER_STOP_SECONDS (the server's own bounds
        on its shutdown and an interpreter's exit)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(SERVER_STOP_SECONDS if timeout is None else timeout)

    def segments(self) -> set[str]:
        """The /dev/shm segments this server has mapped (read from /proc/<pid>/maps)."""
        maps = Path(f"/proc/{self.process.pid}/maps").read_text()
        return {line.split("/dev/shm/")[1].split()[0] for line in maps.splitlines() if "/dev/shm/psm_" in line}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


INTERPRETER_EXIT_SECONDS = 120.0
"""A loaded host's allowance for a server's interpreter to exit once it stopped (seen: over 29 s after the server
logged server_stopped, at load 60)."""
SERVER_STOP_SECONDS = ServerConfig().shutdown_grace_seconds + STOP_TIMEOUT_SECONDS + INTERPRETER_EXIT_SECONDS
"""stop()'s default: a running update's grace (the default --shutdown-grace-seconds; a test that raises it passes
its own bound, server_stop_seconds), the workers' stop (server/workers/supervisor.py), the interpreter's exit."""


def server_stop_seconds(grace: float) -> float:
    """How long a server started with --shutdown-grace-seconds `grace` may take to exit once signalled."""
    return grace + STOP_TIMEOUT_SECONDS + INTERPRETER_EXIT_SECONDS


INTERPRETER_START_SECONDS = 120.0
"""A loaded host's allowance for a fresh interpreter importing torch and weightsync (seen: over 100 s at load 70)."""
SERVER_START_SECONDS = INTERPRETER_START_SECONDS + max(STARTUP_TIMEOUT_SECONDS, COMPILE_AHEAD_SECONDS)
"""start_server's backstop: the server itself serves, or exits, within its own bounds on its workers' start and
the kernels' compile (server/workers/supervisor.py), once its interpreter started."""


def start_server(tmp_path: Path, *extra: str, workers: int = 2, env: dict | None = None,
                 devices: str = "") -> ServerProcess:
    """A server process; `devices` (e.g. "cuda:0") instead of `workers` CPU workers."""
    ready = tmp_path / f"ready-{uuid.uuid4().hex[:6]}.json"
    log_path = tmp_path / f"server-{uuid.uuid4().hex[:6]}.log"
    placement = ["--devices", devices] if devices else ["--workers", str(workers), "--device", "cpu"]
    argv = [sys.executable, "-m", "weightsync.server.cli", "--listen", "127.0.0.1:0", *placement,
            "--ready-file", str(ready), *extra]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + SERVER_START_SECONDS
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"server not ready:\n{log_path.read_text()}")
        time.sleep(0.05)
    announced = json.loads(ready.read_text())
    return ServerProcess(process, announced["port"], log_path, announced)


def start_servers(paths: list[Path], *extra: str, workers: int = 2) -> list[ServerProcess]:
    """start_server on each path, in turn; if one fails to start, the ones already started are killed first (a
    fixture that fails at its second server left its first running, loading the host for every later test)."""
    started: list[ServerProcess] = []
    try:
        for path in paths:
            started.append(start_server(path, *extra, workers=workers))
    except BaseException:
        for server in started:
            server.process.kill()
            server.process.wait()
        raise
    return started


@contextlib.contextmanager
def running_server(tmp_path: Path, *extra: str, workers: int = 2) -> Iterator[ServerProcess]:
    """start_server for a fixture: the server must then stop cleanly (exit 0) on SIGTERM."""
    server = start_server(tmp_path, *extra, workers=workers)
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]


@contextlib.contextmanager
def sdk_client(server: ServerProcess) -> Iterator:
    from weightsync.client import WeightSyncClient

    with WeightSyncClient(server.address) as client:
        yield client


def error_reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)
    if status is None:
        return ""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)
    assert status is not None, f"no rich status on {error}"
    assert len(status.details) == 1
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


# -- a trainer with plain torch.distributed --------------------------------------------
def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int, align: int = 64) -> tensor_pb2.WeightPlan:
    plan = tensor_pb2.WeightPlan()
    bucket = None
    cursor = 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        start = -(-cursor // align) * align
        if bucket is None or (bucket.tensors and start + size > bucket_bytes):
            if bucket is not None:
                bucket.size_bytes = -(-cursor // align) * align
            bucket = plan.buckets.add()
            start = 0
        bucket.tensors.add(name=name, dtype=DTYPE[tensor.dtype], shape=list(tensor.shape), offset_bytes=start, size_bytes=size)
        cursor = start + size
    bucket.size_bytes = -(-cursor // align) * align
    return plan


def pack(plan: tensor_pb2.WeightPlan, named: dict[str, torch.Tensor], index: int) -> torch.Tensor:
    spec = plan.buckets[index]
    buf = torch.zeros(spec.size_bytes, dtype=torch.uint8)
    for t in spec.tensors:
        src = named[t.name].contiguous().reshape(-1)
        if t.size_bytes:
            buf[t.offset_bytes : t.offset_bytes + t.size_bytes].copy_(src.view(torch.uint8))
    return buf


class UpdateStream:
    """The client side of UpdateWeights over a sync stub, message by message."""

    def __init__(self, stub: pb_grpc.WeightSyncServiceStub) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.UpdateWeights(iter(self._requests.get, None), timeout=120)

    def send(self, **kwargs) -> None:
        self._requests.put(pb.UpdateWeightsRequest(**kwargs))

    def recv(self) -> pb.UpdateWeightsResponse:
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)

    def cancel(self) -> None:
        self._responses.cancel()


@dataclass
class PlainTrainer:
    """Rank 0 of a group spanning the given servers."""

    servers: list[ServerProcess]
    group_id: str = field(default_factory=lambda: f"g-{uuid.uuid4().hex[:8]}")
    timeout: float = 120.0
    """The group's timeout: every collective of a healthy push finishes well within it, and a server bounds
    each worker's answer to a bucket by it (+ 2 s) on a loaded host too (30 s saw a worker answer past 32 s)."""
    pg: ProcessGroupGloo | None = None
    store: TCPStore | None = None
    receivers: list[list[int]] = field(default_factory=list)
    """Per server of the update in flight: the group rank that receives each bucket (UpdateReady.bucket_owner_ranks)."""

    def create_group(self, workers_per_server: int = 2) -> list[pb.CreateTransferGroupResponse]:
        timeout = datetime.timedelta(seconds=self.timeout)
        self.store = TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
        world = 1 + workers_per_server * len(self.servers)
        results: list = [None] * len(self.servers)

        def call(i: int, server: ServerProcess) -> None:
            request = pb.CreateTransferGroupRequest(
                group_id=self.group_id, store_host="127.0.0.1", store_port=self.store.port, world_size=world,
                rank_offset=1 + i * workers_per_server, backend=pb.BACKEND_GLOO,
            )
            request.timeout.FromTimedelta(timeout)
            try:
                results[i] = server.stub().CreateTransferGroup(request, timeout=self.timeout + 30)
            except grpc.RpcError as error:
                results[i] = error

        threads = [threading.Thread(target=call, args=(i, s)) for i, s in enumerate(self.servers)]
        for t in threads:
            t.start()
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.pg = ProcessGroupGloo(PrefixStore(f"weightsync/{self.group_id}", self.store), 0, world, options)
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, grpc.RpcError):
                raise r
        return results

    def send_bucket(self, buf: torch.Tensor, sequence: int) -> None:
        """Send bucket `sequence` as docs/data-plane.md says for Gloo: to each server's owner of it (its Ready
        named the rank), tag = the sequence. A sequence a server named no owner for goes to its first worker."""
        works = [self.pg.send([buf], owners[sequence] if 0 <= sequence < len(owners) else 1, sequence)
                 for owners in self.receivers]
        for work in works:
            work.wait()

    def expect(self, ready: pb.UpdateReady) -> None:
        """The update in flight is this Ready's (one server)."""
        self.receivers = [list(ready.bucket_owner_ranks)]

    def begin(self, stub, plan, version: str, mode=pb.UPDATE_MODE_IN_PLACE, **kw) -> tuple[UpdateStream, pb.UpdateReady]:
        stream = UpdateStream(stub)
        stream.send(begin=pb.BeginUpdate(group_id=self.group_id, version=version, plan=plan, mode=mode,
                                         transport=pb.TRANSPORT_COLLECTIVE, **kw))
        response = stream.recv()
        assert response.WhichOneof("message") == "ready", response
        self.expect(response.ready)
        return stream, response.ready

    def push(self, named: dict[str, torch.Tensor], version: str, *, mode=pb.UPDATE_MODE_IN_PLACE,
             bucket_bytes: int = 1 << 20, abort_after: int | None = None, checksum_override=None,
             plan: tensor_pb2.WeightPlan | None = None) -> pb.UpdateCommitted | None:
        """One update on server 0 (single-server tests). abort_after=k aborts after k buckets."""
        plan = plan if plan is not None else plan_buckets(list(named.items()), bucket_bytes)
        stream, ready = self.begin(self.servers[0].stub(), plan, version, mode)
        from weightsync.common.checksum import tensor_checksum
        from weightsync.common.collective import bucket_tail

        for index in range(len(plan.buckets)):
            if abort_after is not None and index == abort_after:
                stream.send(abort=pb.AbortUpdate(reason="test abort"))
                try:
                    stream.recv()
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.ABORTED, error
                    return None
                raise AssertionError("abort did not end the stream")
            buf = pack(plan, named, index)
            checksum = tensor_checksum(buf) if checksum_override is None else checksum_override(index, buf)
            stream.send(bucket_start=pb.BucketStart(sequence=index, checksum=checksum, tail=bucket_tail(buf)))
            self.send_bucket(buf, index)
            response = stream.recv()
            assert response.WhichOneof("message") == "bucket_applied", f"bucket {index} not applied: {response}"
            assert response.bucket_applied.sequence == index
        stream.send(commit=pb.CommitUpdate())
        response = stream.recv()
        assert response.WhichOneof("message") == "committed", response
        stream.close()
        return response.committed

    def delete_group(self) -> None:
        for server in self.servers:
            try:
                server.stub().DeleteTransferGroup(pb.DeleteTransferGroupRequest(group_id=self.group_id), timeout=30)
            except grpc.RpcError:
                pass
        self.pg = None


def mixed_model(seed: int) -> dict[str, torch.Tensor]:
    """Four small tensors of four dtypes (bf16, fp32, int64, bool) for the raw-protocol patch tests."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(4096, 64, generator=g).to(torch.bfloat16),
        "w": torch.randn(3001, generator=g),
        "steps": torch.arange(999, dtype=torch.int64),
        "flags": torch.zeros(77, dtype=torch.bool),
    }


def local_checksums(named: dict[str, torch.Tensor]) -> dict[str, int]:
    from weightsync.common.checksum import ws64

    return {name: ws64(t) for name, t in named.items()}


def server_checksums(server: ServerProcess, names: list[str] | None = None) -> list[dict[str, int]]:
    """The store's checksums, as a one-element list (a node has one store, whatever its worker count)."""
    response = server.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(names=names or []), timeout=60)
    assert not response.workers, "servers answer for their one store, not per worker"
    return [{t.name: t.checksum.value for t in response.tensors}]


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def pids_alive(pids: Iterator[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a trainer group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], world: int, out: Path, timeout: float) -> list[dict]:
    """`world` trainer processes (ranks_exit_codes), each of which must exit 0 (else the tail of every failed
    rank's log fails the test: the first to fail is often only the one that saw its peer go); returns what each
    wrote to out/rank{r}.json."""
    codes = ranks_exit_codes(argv, world, out, timeout)
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    assert not failed, "\n".join(f"rank {rank} exited {codes[rank]}:\n"
                                  + (out / f"rank{rank}.log").read_text()[-4000 // len(failed):] for rank in failed)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def ranks_exit_codes(argv: list[str], world: int, out: Path, timeout: float) -> list[int]:
    """`world` trainer processes, `python ARGV... RANK` style as each script takes them: rank r runs
    `sys.executable` with argv where "{rank}" is replaced by r, logging to out/rank{r}.log; every one waited
    for (bounded, killed past the bound); returns their exit codes, by rank."""
    procs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed below)
        args = [a.replace("{rank}", str(rank)) for a in argv]
        procs.append((subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return [proc.returncode for proc, _ in procs]
