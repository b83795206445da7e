"""The trainer SDK: one client, one or many weightsync servers.

    with WeightSyncClient(["node1:50051", "node2:50051"]) as client:
        client.create_group()
        for step in training:
            ...
            result = client.push(model.state_dict(), version=f"step-{step}")
        client.verify(model.state_dict())

The API is synchronous (it is called from a training loop); the gRPC work runs
on an asyncio loop in a background thread, while packing and broadcasting run
in the caller's thread so they can overlap (see push.py).

A client is safe to share between threads: its calls run one at a time (a
second thread's push waits for the first to finish).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import sys
import threading
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
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.ingress import IngressLease, open_ingress
from weightsync.client.packing import PackBuffers, TensorSource, is_zero_copy
from weightsync.client.plan_cache import CachedPlan, PlanCache, fingerprint
from weightsync.client.planning import (
    DEFAULT_ZERO_COPY_MIN_BYTES,
    build_plan,
    check_tensors,
    plan_proto,
)
from weightsync.client.push import Endpoint, PushRun
from weightsync.client.rendezvous import Rendezvous
from weightsync.client.sinks import CollectiveSink, InlineSink, ShmSink, Sink
from weightsync.client.types import (
    PushProgress,
    PushResult,
    TensorMismatch,
    TlsConfig,
    VerifyResult,
)
from weightsync.common.address import parse_address
from weightsync.common.checksum import ws64
from weightsync.common.collective import CollectiveGroup, host_store, local_address_towards
from weightsync.common.layout import DEFAULT_BUCKET_BYTES
from weightsync.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from weightsync.common.plan_id import plan_id_of
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

log = structlog.get_logger("weightsync.client")

Mode = Literal["in_place", "staged"]
Transport = Literal["collective", "inline", "shm"]
_MODES = {"in_place": pb.UPDATE_MODE_IN_PLACE, "staged": pb.UPDATE_MODE_STAGED}
_TRANSPORTS = {"collective": pb.TRANSPORT_COLLECTIVE, "inline": pb.TRANSPORT_INLINE, "shm": pb.TRANSPORT_SHM}
PROGRESS_BAR_MIN_BYTES = 256 << 20


@dataclass(slots=True)
class _Server:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WeightSyncServiceStub
    workers: int = 0
    rank_offset: int = 0


@dataclass(slots=True)
class _Group:
    group_id: str
    backend: int
    world_size: int
    timeout: datetime.timedelta
    device: torch.device
    collective: CollectiveGroup
    store: object
    """The rendezvous TCPStore: kept listening for the group's life (servers probe it)."""
    broken: bool = False


def _serialized(method):
    """One call at a time per client: the SDK's caches and buffers are not shared state."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


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
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        """metadata: extra gRPC metadata on every call, e.g. a W3C ("traceparent", ...) the server
        logs with the update."""
        addresses = [servers] if isinstance(servers, str) else list(servers)
        if not addresses:
            raise ValueError("at least one server address is required")
        for address in addresses:
            parse_address(address, what="server address")
        self._metadata = ((("authorization", f"Bearer {token}"),) if token else ()) + tuple(metadata)
        self._timeout = timeout
        self._lock = threading.RLock()
        self._loop = LoopThread()
        self._servers = self._loop.run(self._open_channels(addresses, tls, max_message_bytes))
        self._group: _Group | None = None
        self._buffers: PackBuffers | None = None
        self._host_buffers: PackBuffers | None = None
        """Pack buffers of INLINE pushes (no group needed)."""
        self._ingress: ShmSink | None = None
        self._ingress_lease: IngressLease | None = None
        self._limits: dict[str, pb.GetServerInfoResponse] = {}
        """GetServerInfo of each server, fetched once for INLINE/SHM limits."""
        self._plans = PlanCache()

    # -- channels ------------------------------------------------------------------
    async def _open_channels(self, addresses: list[str], tls: TlsConfig | None, max_message_bytes: int) -> list[_Server]:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
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
    @_serialized
    def create_group(
        self,
        *,
        backend: Literal["auto", "gloo", "nccl"] = "auto",
        timeout: float = 60.0,
        group_id: str | None = None,
        store_host: str | None = None,
        store_port: int = 0,
    ) -> str:
        """Join every server's workers and this process (rank 0) in one group.

        backend "auto" picks NCCL when this process has CUDA and every server
        offers NCCL, else Gloo. A server's refusal is raised at once; on any
        failure only the groups this call created are deleted. Returns the group id.
        store_host/store_port: where this process's rendezvous store listens (default:
        the address that routes to the first server, a free port); a fixed port lets a
        mesh or firewall rule name it.
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
        first = parse_address(self._servers[0].address)
        host = store_host or local_address_towards(first.host, first.port)
        delta = datetime.timedelta(seconds=timeout)
        store = host_store(host, delta, store_port)
        device = torch.device("cuda", torch.cuda.current_device()) if chosen == pb.BACKEND_NCCL else torch.device("cpu")
        log.info("group_creating", group_id=group_id, world_size=world_size, backend=pb.Backend.Name(chosen))
        rendezvous = Rendezvous(group_id=group_id, backend=chosen, store=store, world_size=world_size,
                                timeout=delta, device=device, local_address=host)
        created, failure = self._loop.run(self._create_everywhere(group_id, host, store.port, world_size, chosen, delta))
        if failure is None:
            try:
                collective = rendezvous.result(timeout + 10)
            except BaseException:
                self._clean_up(created, group_id)
                raise
        else:
            rendezvous.abandon()
            self._clean_up(created, group_id)
            raise failure
        self._group = _Group(group_id, chosen, world_size, delta, device, collective, store)
        self._buffers = self._buffers if self._buffers and self._buffers.device == device else PackBuffers(device)
        log.info("group_ready", group_id=group_id)
        return group_id

    async def _create_everywhere(
        self, group_id: str, host: str, port: int, world_size: int, backend: int, timeout: datetime.timedelta
    ) -> tuple[list[_Server], BaseException | None]:
        """CreateTransferGroup on every server at once; returns at the first refusal, without
        waiting for the others' rendezvous (they fail at its deadline, and are cleaned up then)."""

        def request(server: _Server) -> pb.CreateTransferGroupRequest:
            message = pb.CreateTransferGroupRequest(
                group_id=group_id, store_host=host, store_port=port, world_size=world_size,
                rank_offset=server.rank_offset, backend=backend,
            )
            message.timeout.FromTimedelta(timeout)
            return message

        calls = {
            asyncio.ensure_future(self._unary(s, "CreateTransferGroup", request(s), timeout.total_seconds() + 30)): s
            for s in self._servers
        }
        created: list[_Server] = []
        failure: BaseException | None = None
        pending = set(calls)
        while pending and failure is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for call in done:
                if call.exception() is None:
                    created.append(calls[call])
                else:
                    failure = failure or call.exception()
        if pending:
            asyncio.ensure_future(self._delete_when_created({c: calls[c] for c in pending}, group_id))
        return created, failure

    async def _delete_when_created(self, calls: dict[asyncio.Future, _Server], group_id: str) -> None:
        await asyncio.wait(calls)
        request = pb.DeleteTransferGroupRequest(group_id=group_id)
        for call, server in calls.items():
            if not call.cancelled() and call.exception() is None:
                try:
                    await self._unary(server, "DeleteTransferGroup", request)
                except WeightSyncRpcError as error:
                    log.warning("group_cleanup_failed", server=server.address, error=str(error))

    def _delete_on(self, servers: list[_Server], group_id: str) -> list[WeightSyncRpcError]:
        """Delete the group on these servers only (the ones where this client created it).
        Returns the failures; a group already gone counts as deleted."""
        async def delete(server: _Server) -> None:
            request = pb.DeleteTransferGroupRequest(group_id=group_id)
            for attempt in range(3):
                try:
                    await self._unary(server, "DeleteTransferGroup", request)
                    return
                except WeightSyncRpcError as error:
                    if error.code == grpc.StatusCode.NOT_FOUND:
                        return
                    # A connection reset right after a network blip, or the update still finishing.
                    retry = error.code == grpc.StatusCode.UNAVAILABLE or error.reason == "UPDATE_IN_PROGRESS"
                    if not retry or attempt == 2:
                        raise
                await asyncio.sleep(0.5 * (attempt + 1))

        async def run():
            return await asyncio.gather(*(delete(s) for s in servers), return_exceptions=True)

        if not servers:
            return []
        return [r for r in self._loop.run(run()) if isinstance(r, WeightSyncRpcError)]

    def _clean_up(self, servers: list[_Server], group_id: str) -> None:
        """Best effort after a failed create: the original error is what the caller must see."""
        for error in self._delete_on(servers, group_id):
            log.warning("group_cleanup_failed", group_id=group_id, server=error.server, error=str(error))

    @_serialized
    def delete_group(self) -> None:
        """Tear the group down on every server and locally.

        A server that cannot be reached (after retries) is logged, not raised: it drops the
        group by itself once it sees this client's rendezvous store close, within seconds.
        Raises WeightSyncClientError naming the servers that refused to delete it."""
        group, self._group = self._group, None
        if group is None:
            return
        group.collective.close()
        failures = self._delete_on(self._servers, group.group_id)
        unreachable = [e for e in failures if e.code == grpc.StatusCode.UNAVAILABLE]
        for error in unreachable:
            # Our rendezvous store closes with the group: the server sees that and drops it itself.
            log.warning("group_delete_unreachable", group_id=group.group_id, server=error.server, error=str(error))
        refused = [e for e in failures if e.code != grpc.StatusCode.UNAVAILABLE]
        if refused:
            where = ", ".join(f"{e.server} ({e.code.name} {e.reason})" for e in refused)
            raise WeightSyncClientError(f"group {group.group_id} could not be deleted on {where}")
        log.info("group_deleted", group_id=group.group_id)

    @property
    def group_id(self) -> str | None:
        return self._group.group_id if self._group else None

    # -- push --------------------------------------------------------------------
    @_serialized
    @_one_intra_op_thread
    def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        mode: Mode = "in_place",
        transport: Transport = "collective",
        bucket_size_bytes: int = DEFAULT_BUCKET_BYTES,
        allow_new_tensors: bool = False,
        checksums: bool | None = None,
        zero_copy_min_bytes: int = DEFAULT_ZERO_COPY_MIN_BYTES,
        progress: Callable[[PushProgress], None] | None = None,
        show_progress: bool | None = None,
    ) -> PushResult:
        """Send one version to every server and commit it.

        named_tensors: a state dict, or an iterator of (name, tensor). Every
        tensor is checked before anything is sent (TypeError/ValueError naming
        it). An iterator is streamed bucket by bucket only for mode="staged"
        repeating the last committed plan (gathered FSDP layers are then never
        all held at once; if it diverges, the update aborts and the committed
        weights stay as they were); otherwise it is materialised first, so
        that it is validated before any byte moves.
        checksums: each bucket carries a WS64 checksum that every worker
        verifies (DATA_LOSS names the bucket on mismatch). None (default): on
        for CUDA buffers, where it costs a few percent of device bandwidth and
        NCCL checks nothing end to end; off for CPU/Gloo, where TCP already
        checksums every segment and the extra passes over host memory compete
        with the broadcast for the same cores (about 40% of a push on 2 cores).
        verify() compares every tensor end to end either way.
        zero_copy_min_bytes: contiguous tensors at least this large are
        broadcast from their own memory, in a bucket of their own (0: always pack).
        transport: "collective" (a broadcast to the group from create_group),
        "inline" (bytes inside the gRPC stream: no group, passes any proxy), or
        "shm" (one server on this host: buckets written into its shared memory;
        no group, no network; buckets at most its ingress slot).
        Raises UpdateFailed, with a status code and a reason (the update is
        aborted on every server).
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be 'in_place' or 'staged', got {mode!r}")
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be 'collective', 'inline' or 'shm', got {transport!r}")
        started = time.perf_counter()
        group, sink = self._sink(transport)
        if transport == "shm":
            bucket_size_bytes = min(bucket_size_bytes, self._ingress_lease.slot_bytes)  # type: ignore[union-attr]
        last = self._plans.last
        if not isinstance(named_tensors, Mapping) and mode == "staged" and last is not None and not allow_new_tensors:
            cached = last
            planned = last.unbound()
            source = TensorSource(None, iter(named_tensors))
        else:
            items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
            check_tensors(items)
            if not items:
                raise ValueError("nothing to push: no tensors")
            key = fingerprint(items, bucket_size_bytes, zero_copy_min_bytes)
            cached = self._plans.lookup(key)
            if cached is not None:
                planned = cached.rebind(dict(items))
            else:
                planned = build_plan(items, bucket_size_bytes, zero_copy_min_bytes)
                plan = plan_proto(planned)
                cached = CachedPlan.of(planned, key, plan, plan_id_of(plan))
            source = TensorSource(dict(items), None)
        buffers = sink.buffers
        if transport != "shm":
            buffers.ensure(max((b.spec.size_bytes for b in planned if not is_zero_copy(buffers, b)), default=0))
        buffers.use_plan(cached.plan_id)
        total = sum(b.spec.size_bytes for b in planned)
        bar = _progress_bar(total, version, show_progress)
        run = PushRun(
            loop=self._loop, endpoints=[Endpoint(s.address, s.stub) for s in self._servers],
            metadata=self._metadata, rpc_timeout=self._timeout,
            commit_timeout=(group.timeout.total_seconds() if group else self._timeout) + 30,
            group_id=group.group_id if group else "", sink=sink, plans=self._plans, planned=planned,
            plan=cached.plan, plan_id=cached.plan_id, source=source, version=version, mode=_MODES[mode],
            allow_new_tensors=allow_new_tensors,
            checksums=buffers.device.type == "cuda" if checksums is None else checksums,
            progress=progress, bar=bar, started=started,
        )
        try:
            outcomes = run.run()
        except BaseException as error:
            if group is not None and getattr(error, "reason", "") in ("COLLECTIVE_TIMEOUT", "COLLECTIVE_FAILED"):
                group.broken = True
            raise
        finally:
            if bar is not None:
                bar.close()
        self._plans.committed(cached, [s.address for s in self._servers])
        seconds = time.perf_counter() - started
        result = PushResult(
            version=version,
            tensor_count=sum(len(b.spec.tensors) for b in planned),
            bucket_count=len(planned),
            size_bytes=total,
            seconds=seconds,
            plan_reused=run.plan_reused,
            zero_copy_buckets=run.zero_copy_buckets,
            servers=tuple(outcomes),
        )
        log.info("push_committed", version=version, bytes=total, seconds=round(seconds, 3),
                 gbps=round(result.gigabytes_per_second, 3), buckets=len(planned))
        return result

    def _sink(self, transport: str) -> tuple[_Group | None, Sink]:
        """The group (COLLECTIVE only) and where this push's bytes go."""
        if transport == "collective":
            group = self._group
            if group is None:
                raise WeightSyncClientError("no transfer group: call create_group() first (or push with "
                                            "transport='inline')")
            if group.broken:
                raise WeightSyncClientError(f"group {group.group_id} is broken; delete_group() and create_group() again")
            assert self._buffers is not None
            return group, CollectiveSink(self._loop, group.collective, self._buffers)
        infos = self._server_limits()
        for server, info in zip(self._servers, infos, strict=True):
            if _TRANSPORTS[transport] not in info.transports:
                raise WeightSyncClientError(f"{server.address} does not offer {transport} (it offers "
                                            f"{[pb.Transport.Name(t) for t in info.transports]})")
        if transport == "inline":
            if self._host_buffers is None:
                self._host_buffers = PackBuffers(torch.device("cpu"))
            chunk = min(i.limits.max_chunk_bytes for i in infos)
            return None, InlineSink(self._loop, self._host_buffers, chunk)
        if len(self._servers) != 1:
            raise WeightSyncClientError("SHM pushes to one server, on this host; use transport='inline' for several")
        if self._ingress is None:
            token = next((v.removeprefix("Bearer ") for k, v in self._metadata if k == "authorization"), None)
            self._ingress_lease = open_ingress(self._servers[0].address, infos[0].local_socket, token)
            lease = self._ingress_lease
            self._ingress = ShmSink(self._loop, lease.fd, lease.slot_bytes, lease.slot_count, self._timeout)
        return None, self._ingress

    def _server_limits(self) -> list[pb.GetServerInfoResponse]:
        missing = [s for s in self._servers if s.address not in self._limits]
        if missing:
            for server, info in zip(self._servers, self.server_info(), strict=True):
                self._limits[server.address] = info
        return [self._limits[s.address] for s in self._servers]

    # -- verify ------------------------------------------------------------------
    @_serialized
    @_one_intra_op_thread
    def verify(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> VerifyResult:
        """Compare local WS64 checksums with every worker of every server."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        check_tensors(items)
        local = {name: ws64(t.detach()) for name, t in items}

        async def fetch():
            request = pb.GetTensorChecksumsRequest(names=sorted(local))
            return await asyncio.gather(
                *(self._fetch_checksums(s, request) for s in self._servers)
            )

        answers = self._loop.run(fetch())
        mismatches = []
        for server, answer in zip(self._servers, answers, strict=True):
            for worker in answer.workers:
                remote = {t.name: t.checksum.value for t in worker.tensors}
                for name, value in local.items():
                    if remote.get(name) != value:
                        mismatches.append(TensorMismatch(server.address, worker.worker_index, name, value, remote.get(name)))
        return VerifyResult(len(local), tuple(mismatches))

    async def _fetch_checksums(self, server: _Server, request: pb.GetTensorChecksumsRequest):
        """Every worker's checksums of the named tensors; a name a server lacks is left out."""
        timeout = max(self._timeout, 300)
        try:
            return await self._unary(server, "GetTensorChecksums", request, timeout)
        except WeightSyncRpcError as error:
            if error.reason != "TENSOR_NOT_FOUND":
                raise
        answer = await self._unary(server, "GetTensorChecksums", pb.GetTensorChecksumsRequest(), timeout)
        wanted = set(request.names)
        for worker in answer.workers:
            kept = [t for t in worker.tensors if t.name in wanted]
            del worker.tensors[:]
            worker.tensors.extend(kept)
        return answer

    # -- lifecycle ------------------------------------------------------------------
    @_serialized
    def close(self) -> None:
        """Delete the group (if any) and close every channel."""
        try:
            if self._ingress is not None:
                self._ingress.close()
                self._ingress_lease.close()  # type: ignore[union-attr]
                self._ingress = self._ingress_lease = None
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

    def __exit__(self, kind: object, *exc: object) -> None:
        try:
            self.close()
        except WeightSyncClientError as error:
            if kind is None:
                raise
            log.warning("close_failed", error=str(error))  # the error already in flight matters more


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
