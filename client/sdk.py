"""The trainer SDK: one client, one or many weightsync servers.

    with WeightSyncClient(["node1:50051", "node2:50051"]) as client:
        client.create_group()
        for step in training:
            ...
            result = client.push(model.state_dict(), version=f"step-{step}")
        client.verify(model.state_dict())

The API is synchronous (it is called from a training loop); the gRPC work runs
on an asyncio loop in a background thread, while packing and broadcasting run
in the caller's thread so they can overlap: bucket k+1 is packed while bucket k
is on the wire, into two preallocated buffers that are reused across pushes.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import grpc
import grpc.aio
import structlog
import torch

from weightsync.client._loop import LoopThread
from weightsync.client.errors import (
    PlanMismatch,
    UpdateFailed,
    WeightSyncClientError,
    WeightSyncRpcError,
)
from weightsync.client.packing import PackBuffers, TensorSource, fill_bucket, is_zero_copy
from weightsync.client.planning import (
    DEFAULT_ZERO_COPY_MIN_BYTES,
    PlannedBucket,
    PlanRecipe,
    build_plan,
    fingerprint,
    plan_proto,
    rebind,
    recipe_of,
)
from weightsync.client.streams import UpdateStream, first_failure, update_failed
from weightsync.client.types import (
    PushProgress,
    PushResult,
    ServerOutcome,
    TensorMismatch,
    TlsConfig,
    VerifyResult,
)
from weightsync.common.checksum import tensor_checksum, ws64
from weightsync.common.collective import (
    CollectiveError,
    CollectiveGroup,
    host_store,
    local_address_towards,
    open_group,
)
from weightsync.common.layout import DEFAULT_BUCKET_BYTES
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

log = structlog.get_logger("weightsync.client")

Mode = Literal["in_place", "staged"]
_MODES = {"in_place": pb.UPDATE_MODE_IN_PLACE, "staged": pb.UPDATE_MODE_STAGED}
MAX_MESSAGE_BYTES = 64 << 20
PROGRESS_BAR_MIN_BYTES = 256 << 20


@dataclass(slots=True)
class _Server:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WeightSyncServiceStub
    workers: int = 0
    rank_offset: int = 0
    last_plan: bytes = b""
    last_plan_id: str = ""


@dataclass(slots=True)
class _Group:
    group_id: str
    backend: int
    world_size: int
    timeout: datetime.timedelta
    device: torch.device
    collective: CollectiveGroup
    store: object
    broken: bool = False


def _one_intra_op_thread(method):
    """Run a CPU-heavy SDK method with one torch intra-op thread, then restore.

    Packing and checksums are many small memory-bound ops; with several
    OpenMP threads each op pays a barrier, and on a host whose cores are
    busy with the broadcast (sockets, receivers) a barrier waits for a thread
    that cannot run: measured 100x slower packing on 2 loaded cores. The
    setting is process-wide, so it is restored as soon as the call returns.
    """

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return method(*args, **kwargs)
        finally:
            torch.set_num_threads(previous)

    return wrapper


class WeightSyncClient:
    """Pushes named tensors to one or more weightsync servers."""

    def __init__(
        self,
        servers: Sequence[str] | str,
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        timeout: float = 60.0,
    ) -> None:
        addresses = [servers] if isinstance(servers, str) else list(servers)
        if not addresses:
            raise ValueError("at least one server address is required")
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"server address must be host:port, got {address!r}")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout
        self._loop = LoopThread()
        self._servers = self._loop.run(self._open_channels(addresses, tls))
        self._group: _Group | None = None
        self._buffers: PackBuffers | None = None
        self._stream_plan: list[PlannedBucket] | None = None
        self._recipe: PlanRecipe | None = None
        self._ids = itertools.count(1)

    # -- channels ------------------------------------------------------------------
    async def _open_channels(self, addresses: list[str], tls: TlsConfig | None) -> list[_Server]:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        out = []
        for address in addresses:
            if tls is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=_read(tls.ca_cert),
                    private_key=_read(tls.client_key),
                    certificate_chain=_read(tls.client_cert),
                )
                opts = options + ([("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else [])
                channel = grpc.aio.secure_channel(address, creds, options=opts)
            out.append(_Server(address, channel, pb_grpc.WeightSyncServiceStub(channel)))
        return out

    async def _unary(self, server: _Server, method: str, request, timeout: float | None = None):
        try:
            return await getattr(server.stub, method)(request, metadata=self._metadata, timeout=timeout or self._timeout)
        except grpc.aio.AioRpcError as error:
            raise WeightSyncRpcError.from_rpc(server.address, error) from None

    # -- queries ------------------------------------------------------------------
    def server_info(self) -> list[pb.GetServerInfoResponse]:
        """GetServerInfo of every server, in order."""
        return self._loop.run(self._infos())

    async def _infos(self) -> list[pb.GetServerInfoResponse]:
        return list(await asyncio.gather(*(self._unary(s, "GetServerInfo", pb.GetServerInfoRequest()) for s in self._servers)))

    def list_groups(self) -> dict[str, list[pb.TransferGroup]]:
        async def run():
            answers = await asyncio.gather(*(self._unary(s, "ListTransferGroups", pb.ListTransferGroupsRequest()) for s in self._servers))
            return {s.address: list(a.groups) for s, a in zip(self._servers, answers, strict=True)}

        return self._loop.run(run())

    # -- groups ------------------------------------------------------------------
    def create_group(
        self,
        *,
        backend: Literal["auto", "gloo", "nccl"] = "auto",
        timeout: float = 60.0,
        group_id: str | None = None,
        store_host: str | None = None,
    ) -> str:
        """Join every server's workers and this process (rank 0) in one group.

        backend "auto" picks NCCL when this process has CUDA and every server
        offers NCCL, else Gloo. Returns the group id.
        """
        if self._group is not None:
            raise WeightSyncClientError(f"group {self._group.group_id} exists; delete_group() first")
        infos = self.server_info()
        offered = [set(i.backends) for i in infos]
        if backend == "auto":
            use_nccl = torch.cuda.is_available() and all(pb.BACKEND_NCCL in o for o in offered)
            chosen = pb.BACKEND_NCCL if use_nccl else pb.BACKEND_GLOO
        else:
            chosen = {"gloo": pb.BACKEND_GLOO, "nccl": pb.BACKEND_NCCL}[backend]
        for server, info, backends in zip(self._servers, infos, offered, strict=True):
            if chosen not in backends:
                raise WeightSyncClientError(f"{server.address} does not offer {pb.Backend.Name(chosen)}")
            server.workers = len(info.workers)
        offset = 1
        for server in self._servers:
            server.rank_offset = offset
            offset += server.workers
        world_size = offset
        group_id = group_id or f"ws-{uuid.uuid4().hex[:12]}"
        first_host = self._servers[0].address.rpartition(":")[0].strip("[]")
        host = store_host or local_address_towards(first_host, int(self._servers[0].address.rpartition(":")[2]))
        delta = datetime.timedelta(seconds=timeout)
        store = host_store(host, delta)
        device = torch.device("cuda", torch.cuda.current_device()) if chosen == pb.BACKEND_NCCL else torch.device("cpu")
        log.info("group_creating", group_id=group_id, world_size=world_size, backend=pb.Backend.Name(chosen))

        def request(server: _Server) -> pb.CreateTransferGroupRequest:
            message = pb.CreateTransferGroupRequest(
                group_id=group_id, store_host=host, store_port=store.port, world_size=world_size,
                rank_offset=server.rank_offset, backend=chosen,
            )
            message.timeout.FromTimedelta(delta)
            return message

        async def create_everywhere():
            return await asyncio.gather(
                *(self._unary(s, "CreateTransferGroup", request(s), timeout + 30) for s in self._servers),
                return_exceptions=True,
            )

        calls = asyncio.run_coroutine_threadsafe(create_everywhere(), self._loop.loop)
        try:
            collective = open_group(
                group_id=group_id, backend=chosen, store=store, rank=0, world_size=world_size,
                timeout=delta, device=device, local_address=host,
            )
        except RuntimeError as error:
            results = calls.result(timeout + 60)
            failures = [r for r in results if isinstance(r, BaseException)]
            self._cleanup_group(group_id)
            if failures:
                raise failures[0] from error
            raise WeightSyncClientError(f"rendezvous of group {group_id} failed: {error}") from error
        results = calls.result(timeout + 60)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            collective.close()
            self._cleanup_group(group_id)
            raise failures[0]
        self._group = _Group(group_id, chosen, world_size, delta, device, collective, store)
        self._buffers = self._buffers if self._buffers and self._buffers.device == device else PackBuffers(device)
        log.info("group_ready", group_id=group_id)
        return group_id

    def _cleanup_group(self, group_id: str) -> None:
        async def run():
            await asyncio.gather(
                *(self._unary(s, "DeleteTransferGroup", pb.DeleteTransferGroupRequest(group_id=group_id)) for s in self._servers),
                return_exceptions=True,
            )

        self._loop.run(run())

    def delete_group(self) -> None:
        """Tear the group down on every server and locally."""
        group, self._group = self._group, None
        if group is None:
            return
        group.collective.close()
        self._cleanup_group(group.group_id)
        log.info("group_deleted", group_id=group.group_id)

    @property
    def group_id(self) -> str | None:
        return self._group.group_id if self._group else None

    # -- push --------------------------------------------------------------------
    @_one_intra_op_thread
    def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        mode: Mode = "in_place",
        bucket_size_bytes: int = DEFAULT_BUCKET_BYTES,
        allow_new_tensors: bool = False,
        checksums: bool | None = None,
        zero_copy_min_bytes: int = DEFAULT_ZERO_COPY_MIN_BYTES,
        progress: Callable[[PushProgress], None] | None = None,
        show_progress: bool | None = None,
    ) -> PushResult:
        """Send one version to every server and commit it.

        named_tensors: a state dict, or an iterator of (name, tensor). An
        iterator whose names, dtypes and shapes repeat the previous push is
        streamed bucket by bucket (gathered FSDP layers are never all held at
        once); otherwise it is materialised first.
        checksums: each bucket carries a WS64 checksum that every worker
        verifies (DATA_LOSS names the bucket on mismatch). None (default): on
        for CUDA buffers, where it costs a few percent of device bandwidth and
        NCCL checks nothing end to end; off for CPU/Gloo, where TCP already
        checksums every segment and the extra passes over host memory compete
        with the broadcast for the same cores (about 40% of a push on 2 cores).
        verify() compares every tensor end to end either way.
        zero_copy_min_bytes: contiguous tensors at least this large are
        broadcast from their own memory, in a bucket of their own (0: always pack).
        Raises UpdateFailed (the update is aborted on every server).
        """
        group = self._group
        if group is None:
            raise WeightSyncClientError("no transfer group: call create_group() first")
        if group.broken:
            raise WeightSyncClientError(f"group {group.group_id} is broken; delete_group() and create_group() again")
        if mode not in _MODES:
            raise ValueError(f"mode must be 'in_place' or 'staged', got {mode!r}")
        started = time.perf_counter()
        source: TensorSource
        if isinstance(named_tensors, Mapping):
            items = list(named_tensors.items())
            planned = self._plan(items, bucket_size_bytes, zero_copy_min_bytes)
            source = TensorSource(dict(items), None)
        elif self._stream_plan is not None and not allow_new_tensors:
            planned = [PlannedBucket(p.spec, None) for p in self._stream_plan]
            source = TensorSource(None, iter(named_tensors))
        else:
            items = list(named_tensors)
            planned = self._plan(items, bucket_size_bytes, zero_copy_min_bytes)
            source = TensorSource(dict(items), None)
        if not planned:
            raise ValueError("nothing to push: no tensors")
        self._stream_plan = [PlannedBucket(p.spec, None) for p in planned]
        plan = plan_proto(planned)
        plan_bytes = plan.SerializeToString(deterministic=True)
        total = sum(b.spec.size_bytes for b in planned)
        assert self._buffers is not None
        packed = [b.spec.size_bytes for b in planned if not is_zero_copy(self._buffers, b)]
        self._buffers.ensure(max(packed, default=0))
        self._buffers.use_plan(plan_bytes)
        if checksums is None:
            checksums = self._buffers.device.type == "cuda"
        streams, reused = self._loop.run(self._begin(group, plan, plan_bytes, version, _MODES[mode], allow_new_tensors))
        bar = _progress_bar(total, version, show_progress)
        zero_copy = 0
        failure: BaseException | None = None
        in_flight = None
        sent = 0
        try:
            for index, bucket in enumerate(planned):
                payload, copied = fill_bucket(self._buffers, bucket, index, source)
                zero_copy += not copied
                checksum = tensor_checksum(payload) if checksums else tensor_pb2.Checksum()
                failure = first_failure(streams)
                if failure is None and in_flight is not None:
                    failure = self._wait(group, in_flight)
                    in_flight = None
                if failure is not None:
                    break
                announce = pb.UpdateWeightsRequest(bucket_start=pb.BucketStart(sequence=index, checksum=checksum))
                for stream in streams:
                    self._loop.call_soon(stream.send, announce)
                in_flight = group.collective.broadcast_async(payload)
                sent += bucket.spec.size_bytes
                if progress is not None or bar is not None:
                    report = PushProgress(index, len(planned), sent, total, time.perf_counter() - started)
                    if progress is not None:
                        progress(report)
                    if bar is not None:
                        bar.update(bucket.spec.size_bytes)
            if in_flight is not None:
                failure = failure or self._wait(group, in_flight)
                in_flight = None
            if failure is None:
                source.finish()
        except (PlanMismatch, CollectiveError) as error:
            failure = error
            if in_flight is not None:
                failure = self._wait(group, in_flight) or error
        except BaseException:
            self._loop.run(self._abort(streams, "client error"))
            raise
        finally:
            if bar is not None:
                bar.close()
        if failure is None:
            failure = first_failure(streams)
        if failure is not None:
            self._loop.run(self._abort(streams, str(failure)))
            raise update_failed(failure, streams)
        outcomes = self._loop.run(self._commit(group, streams))
        for server in self._servers:
            server.last_plan = plan_bytes
        seconds = time.perf_counter() - started
        result = PushResult(
            version=version,
            tensor_count=sum(len(b.spec.tensors) for b in planned),
            bucket_count=len(planned),
            size_bytes=total,
            seconds=seconds,
            plan_reused=reused,
            zero_copy_buckets=zero_copy,
            servers=tuple(outcomes),
        )
        log.info("push_committed", version=version, bytes=total, seconds=round(seconds, 3),
                 gbps=round(result.gigabytes_per_second, 3), buckets=len(planned))
        return result

    def _plan(self, items: list[tuple[str, torch.Tensor]], bucket_size_bytes: int, zero_copy_min_bytes: int) -> list[PlannedBucket]:
        """build_plan, or the previous plan rebound when the tensors' layout is unchanged."""
        key = fingerprint(items, bucket_size_bytes, zero_copy_min_bytes)
        if self._recipe is not None and self._recipe.fingerprint == key:
            return rebind(self._recipe, dict(items))
        planned = build_plan(items, bucket_size_bytes, zero_copy_min_bytes)
        self._recipe = recipe_of(planned, key)
        return planned

    def _wait(self, group: _Group, work) -> BaseException | None:
        try:
            group.collective.wait(work)
            return None
        except CollectiveError as error:
            group.broken = True
            return error

    async def _begin(self, group: _Group, plan, plan_bytes: bytes, version: str, mode: int, allow_new: bool):
        reuse = all(s.last_plan == plan_bytes and s.last_plan_id for s in self._servers)
        for attempt in (0, 1):
            streams = []
            for server in self._servers:
                stream = UpdateStream(server.address, server.stub, self._metadata)
                begin = pb.BeginUpdate(group_id=group.group_id, version=version, mode=mode,
                                       transport=pb.TRANSPORT_COLLECTIVE, allow_new_tensors=allow_new)
                if reuse:
                    begin.plan_id = server.last_plan_id
                else:
                    begin.plan.CopyFrom(plan)
                stream.send(pb.UpdateWeightsRequest(begin=begin))
                streams.append(stream)
            results = await asyncio.gather(
                *(asyncio.wait_for(asyncio.shield(s.ready), self._timeout) for s in streams), return_exceptions=True
            )
            failures = [(s, r) for s, r in zip(streams, results, strict=True) if isinstance(r, BaseException)]
            if not failures:
                for server, ready in zip(self._servers, results, strict=True):
                    server.last_plan_id = ready.plan_id  # type: ignore[union-attr]
                return streams, reuse
            await self._abort(streams, "begin failed")
            stream, error = failures[0]
            if reuse and attempt == 0 and getattr(error, "reason", "") == "PLAN_NOT_FOUND":
                reuse = False  # a server forgot the plan (restart): send it in full
                continue
            if isinstance(error, TimeoutError):
                error = WeightSyncRpcError(stream.server, grpc.StatusCode.DEADLINE_EXCEEDED, "READY_TIMEOUT",
                                           f"no Ready within {self._timeout:g} s", {})
            raise UpdateFailed(f"update {version!r} refused by {stream.server}: {error}", error, stream.server)
        raise AssertionError("unreachable")

    async def _abort(self, streams: list[UpdateStream], reason: str) -> None:
        for stream in streams:
            stream.send(pb.UpdateWeightsRequest(abort=pb.AbortUpdate(reason=reason[:500])))
            stream.send(None)
        await asyncio.gather(*(s.finish(self._timeout) for s in streams))

    async def _commit(self, group: _Group, streams: list[UpdateStream]) -> list[ServerOutcome]:
        for stream in streams:
            stream.send(pb.UpdateWeightsRequest(commit=pb.CommitUpdate()))
            stream.send(None)
        timeout = group.timeout.total_seconds() + 30
        results = await asyncio.gather(
            *(asyncio.wait_for(asyncio.shield(s.committed), timeout) for s in streams), return_exceptions=True
        )
        await asyncio.gather(*(s.finish(5.0) for s in streams))
        failures = [(s, r) for s, r in zip(streams, results, strict=True) if isinstance(r, BaseException)]
        if failures:
            stream, error = failures[0]
            raise UpdateFailed(f"commit failed on {stream.server}: {error}", error, stream.server)
        return [
            ServerOutcome(
                server=s.server,
                version=c.version.version,
                generation=c.version.generation,
                size_bytes=c.size_bytes,
                seconds=c.duration.ToTimedelta().total_seconds(),
                fast_path_buckets=(s.ready.result().fast_path_bucket_count),
            )
            for s, c in zip(streams, results, strict=True)
        ]

    # -- verify ------------------------------------------------------------------
    @_one_intra_op_thread
    def verify(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> VerifyResult:
        """Compare local WS64 checksums with every worker of every server."""
        local = {name: ws64(t.detach()) for name, t in (named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)}

        async def fetch():
            request = pb.GetTensorChecksumsRequest(names=sorted(local))
            return await asyncio.gather(*(self._unary(s, "GetTensorChecksums", request, max(self._timeout, 300)) for s in self._servers))

        answers = self._loop.run(fetch())
        mismatches = []
        for server, answer in zip(self._servers, answers, strict=True):
            for worker in answer.workers:
                remote = {t.name: t.checksum.value for t in worker.tensors}
                for name, value in local.items():
                    if remote.get(name) != value:
                        mismatches.append(TensorMismatch(server.address, worker.worker_index, name, value, remote.get(name)))
        return VerifyResult(len(local), tuple(mismatches))

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Delete the group (if any) and close every channel."""
        try:
            if self._group is not None:
                self.delete_group()
        finally:
            async def close_all():
                await asyncio.gather(*(s.channel.close() for s in self._servers))

            try:
                self._loop.run(close_all(), timeout=10)
            finally:
                self._loop.stop()

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as handle:
        return handle.read()


def _progress_bar(total: int, version: str, show: bool | None):
    if show is None:
        show = sys.stderr.isatty() and total >= PROGRESS_BAR_MIN_BYTES
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"push {version}", leave=False)
