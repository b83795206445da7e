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
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import torch

from weightsync.client import transfer_group
from weightsync.client._loop import LoopThread
from weightsync.client.compression import worth_compressing
from weightsync.client.delta import Delta, DeltaBase
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.ingress import IngressLease, open_ingress
from weightsync.client.intra_op import one_intra_op_thread
from weightsync.client.packing import PackBuffers, is_zero_copy
from weightsync.client.patched_push import plan_patches, send_patches
from weightsync.client.plan_cache import PlanCache
from weightsync.client.plan_choice import PlanChoice, choose_plan
from weightsync.client.planning import DEFAULT_ZERO_COPY_MIN_BYTES, check_tensors
from weightsync.client.push import PushRun
from weightsync.client.revision import spoken
from weightsync.client.servers import Server, ServerSet
from weightsync.client.sinks import CollectiveSink, InlineSink, ShmSink, Sink
from weightsync.client.store_checksums import fetch_checksums, holds, mismatches
from weightsync.client.transfer_group import TransferGroup
from weightsync.client.types import (
    PushProgress,
    PushResult,
    ServerOutcome,
    StoreGeneration,
    TensorMismatch,
    TlsConfig,
    VerifyResult,
)
from weightsync.common import patch_kernels
from weightsync.common.address import parse_address
from weightsync.common.checksum import ws64
from weightsync.common.collective import CollectiveError
from weightsync.common.layout import DEFAULT_BUCKET_BYTES
from weightsync.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from weightsync.common.logging import get_logger
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")

Mode = Literal["in_place", "staged"]
Transport = Literal["collective", "inline", "shm"]
_MODES = {"in_place": pb.UPDATE_MODE_IN_PLACE, "staged": pb.UPDATE_MODE_STAGED}
_TRANSPORTS = {"collective": pb.TRANSPORT_COLLECTIVE, "inline": pb.TRANSPORT_INLINE, "shm": pb.TRANSPORT_SHM}
PROGRESS_BAR_MIN_BYTES = 256 << 20


def _serialized(method):
    """One call at a time per client: the SDK's caches and buffers are not shared state."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

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
        delta_host_copy: bool = True,
    ) -> None:
        """metadata: extra gRPC metadata on every call, e.g. a W3C ("traceparent", ...) the server
        logs with the update.
        delta_host_copy: keep the copy of the last committed tensors (what push(delta=...)
        compares against: as much memory as the model) in host memory (default; pinned for CUDA
        tensors, whose comparison then reads it across the bus); False: on the tensors' device
        (a second copy of the model in GPU memory)."""
        addresses = [servers] if isinstance(servers, str) else list(servers)
        if not addresses:
            raise ValueError("at least one server address is required")
        for address in addresses:
            parse_address(address, what="server address")
        self._lock = threading.RLock()
        self._loop = LoopThread()
        self._servers = ServerSet(
            self._loop, addresses, tls=tls, timeout=timeout, max_message_bytes=max_message_bytes,
            metadata=((("authorization", f"Bearer {token}"),) if token else ()) + tuple(metadata),
        )
        self._group: TransferGroup | None = None
        self._collective_buffers: PackBuffers | None = None
        """Pack buffers of COLLECTIVE pushes, on the group's device."""
        self._inline_buffers: PackBuffers | None = None
        """Pack buffers of INLINE pushes (host memory; no group needed)."""
        self._shm_sink: ShmSink | None = None
        self._ingress_lease: IngressLease | None = None
        self._server_infos: dict[str, pb.GetServerInfoResponse] = {}
        """GetServerInfo of each server (INLINE/SHM limits, worker counts, deferred buckets)."""
        self._server_infos_stale = False
        """A push failed, or the SHM server hung up, since they were asked: the next push asks again."""
        self._plans = PlanCache()
        self._delta = DeltaBase(host_copy=delta_host_copy)
        patch_kernels.warm_up_in_background()  # compiled once per numba cache; loaded before the first patch

    # -- queries ------------------------------------------------------------------
    def server_info(self) -> list[pb.GetServerInfoResponse]:
        """GetServerInfo of every server, in order."""
        return self._servers.each("GetServerInfo", pb.GetServerInfoRequest())

    def list_groups(self) -> dict[str, list[pb.TransferGroup]]:
        answers = self._servers.each("ListTransferGroups", pb.ListTransferGroupsRequest())
        return {address: list(a.groups) for address, a in zip(self._servers.addresses, answers, strict=True)}

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
        """Join every server's workers and this process (rank 0) in one group (COLLECTIVE pushes).

        backend "auto" picks NCCL when this process has CUDA, every server
        offers NCCL and no worker runs on this process's GPU (same UUID: NCCL
        cannot put two ranks of a group on one GPU), else Gloo; "nccl" on a
        shared GPU is refused. A server's refusal is raised at once; on any
        failure only the groups this call created are deleted. Returns the group id.
        store_host/store_port: where this process's rendezvous store listens (default:
        the address that routes to the first server, a free port); a fixed port lets a
        mesh or firewall rule name it.
        """
        if self._group is not None:
            raise WeightSyncClientError(f"group {self._group.group_id} exists; delete_group() first")
        group = transfer_group.create(self._servers, backend=backend, timeout=timeout, group_id=group_id,
                              store_host=store_host, store_port=store_port)
        self._group = group
        if self._collective_buffers is None or self._collective_buffers.device != group.device:
            self._collective_buffers = PackBuffers(group.device)
        return group.group_id

    @_serialized
    def delete_group(self) -> None:
        """Tear the group down on every server and locally.

        A server that cannot be reached (after retries) is logged, not raised: it drops the
        group by itself once it sees this client's rendezvous store close, within seconds.
        Raises WeightSyncClientError naming the servers that refused to delete it."""
        group, self._group = self._group, None
        if group is not None:
            transfer_group.delete(self._servers, group)

    @property
    def group_id(self) -> str | None:
        return self._group.group_id if self._group else None

    # -- push --------------------------------------------------------------------
    @_serialized
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
        delta: Delta = "auto",
        compress: bool | None = None,
    ) -> PushResult:
        """Send one version to every server and commit it.

        named_tensors: a state dict, or an iterator of (name, tensor). Every
        tensor is checked before anything is sent (TypeError/ValueError naming
        it). An iterator is streamed bucket by bucket only for mode="staged"
        repeating the last committed plan (gathered FSDP layers are then never
        all held at once; if it diverges, the update aborts and the committed
        weights stay as they were); otherwise it is materialised first, so
        that it is validated before any byte moves.
        checksums: each bucket carries a WS64 checksum that its receiving worker
        verifies (DATA_LOSS names the bucket on mismatch). None (default): on
        for every bucket whose bytes come from or through CUDA memory, where it
        costs a few percent of device bandwidth and nothing else checks the
        device copies and NCCL end to end; off for CPU tensors over Gloo, where
        TCP already checksums every segment and the extra passes over host
        memory compete with the broadcast for the same cores (about 40% of a
        push on 2 cores). verify() compares every tensor end to end either way.
        An iterator is always sent dense (it is not held whole to compare).
        zero_copy_min_bytes: contiguous tensors at least this large are
        broadcast from their own memory, in a bucket of their own (0: always pack).
        transport: "collective" (a broadcast to the group from create_group),
        "inline" (bytes inside the gRPC stream: no group, passes any proxy), or
        "shm" (one server on this host: buckets written into its shared memory;
        no group, no network; buckets at most its ingress slot).
        Every wait is bounded by the client's timeout (or the group's, for a
        broadcast): a server that stops answering fails the push with
        UpdateFailed naming it (reason SERVER_UNRESPONSIVE).
        Raises UpdateFailed, with a status code and a reason (the update is
        aborted on every server).
        Packing and checksums run with one torch intra-op thread, set for the
        calling thread and for the SDK's own ops only (intra_op.py): the
        process's torch.get_num_threads() is never changed.
        delta: send only what changed since this client's last commit (tensors
        unchanged bit for bit are left out, sparse changes go as patches; see
        client/delta.py). "auto" (default): where it pays on the measured costs,
        dense otherwise (the first push, a new layout, most of the model changed,
        an iterator). True: patches wherever they are smaller than the tensor.
        False: always dense, and no copy kept. A server that does not hold this
        client's last commit (restarted, or pushed to by someone else) gets the
        update dense: INLINE and SHM that server alone, COLLECTIVE the whole
        group. Keeping the copy costs as much memory as the pushed tensors, in
        host memory (on their device with delta_host_copy=False), but a view that
        reads elements more than once (expand()) only the storage it reads;
        delta=False frees it.
        PushResult.bytes_sent and dense_bytes say what it saved.
        compress: COLLECTIVE over a Gloo group, and INLINE: send each bucket of patches as a zstd
        frame (its owners decompress it). None (default): when this client's dense pushes measured the link
        slower than ~3 Gbit/s (client/compression.py); False: never; True: whenever it shrinks.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be 'in_place' or 'staged', got {mode!r}")
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be 'collective', 'inline' or 'shm', got {transport!r}")
        started = time.perf_counter()
        if self._ingress_lease is not None and self._ingress_lease.connection.hung_up():
            self._server_infos_stale = True  # the SHM server exited since the last push: restarted, or gone
        if self._server_infos_stale:
            self._refresh_server_infos()
            self._close_ingress()  # mapped from the server as it was: one restarted since has another
        group, sink = self._sink(transport)
        if transport == "shm":
            bucket_size_bytes = min(bucket_size_bytes, self._ingress_lease.slot_bytes)  # type: ignore[union-attr]
        if delta not in ("auto", True, False):
            raise ValueError(f"delta must be 'auto', True or False, got {delta!r}")
        common = dict(version=version, mode=mode, allow_new_tensors=allow_new_tensors, checksums=checksums,
                      progress=progress, started=started, show_progress=show_progress)
        sizes = dict(bucket_size_bytes=bucket_size_bytes, zero_copy_min_bytes=zero_copy_min_bytes)
        if delta is False or not isinstance(named_tensors, Mapping | list | tuple):
            self._delta.drop()  # an iterator streams (never held whole): nothing to compare
            items = None
        else:
            items = _materialized(named_tensors)
            self._delta.transport = transport
            if delta == "auto" and self._delta.cannot_pay(items):
                self._delta.drop()  # the sample and the copy would cost a few percent, for nothing
                items = None
        frames = getattr(sink, "frames", None)  # COLLECTIVE and INLINE: buckets of patches as zstd frames
        if frames is not None:
            frames.enabled = items is not None and compress is not False and self._compressing(compress)
        runs: list[tuple[PlanChoice, PushRun, list[ServerOutcome]]] = []
        delta_choice, targets = None, []
        patched = plan_patches(self._delta, items, delta, servers=self._servers.servers, infos=self._infos_by_address(),
                               collective=group is not None, **sizes) if items is not None else None
        if patched is not None:
            def push_once(servers, bases, begun, patched=patched):
                return self._push_once(group, sink, patched.choice, servers=servers, bases=bases, begun=begun, **common)

            try:
                runs, targets = send_patches(patched, self._delta, items, push_once, collective=group is not None)
            finally:
                patched.stop()
            delta_choice = patched.delta if targets else None
        rest = [s for s in self._servers.servers if s not in targets]
        if rest:
            dense = choose_plan(dict(items) if items is not None else named_tensors, self._plans,
                                may_stream=mode == "staged" and not allow_new_tensors, **sizes)
            if items is not None and not targets:
                self._delta.take_in_background(items, None)  # the copy refreshes while the bytes move
            runs.append((dense, *self._push_once(group, sink, dense, servers=rest, **common)))
            self._plans.committed(dense.cached, [s.address for s in rest])
        outcomes = [o for _, _, done in runs for o in done]
        if items is not None:
            self._delta.committed(items, delta_choice, {o.server: o.committed for o in outcomes})
        result = _committed(runs, outcomes, version, started, dense_bytes=_dense_bytes(items) if items else 0,
                            compressed=(frames.compressed_bytes, frames.saved_bytes) if frames else (0, 0))
        if result.bytes_sent >= result.dense_bytes and result.plan_reused:
            # All dense into stores that exist (a first push also allocates them): what the link and
            # the servers take, for auto's thresholds.
            self._delta.dense_push_timed(transport, result.bytes_sent, result.seconds)
        elif delta_choice is not None:
            waited = sum(run.wire_seconds for _, run, _ in runs) - (frames.seconds if frames else 0.0)
            self._delta.link_timed(transport, result.bytes_sent, waited, result.seconds)
        return result

    def _compressing(self, compress: bool | None) -> bool:
        """Whether this push sends its buckets of patches compressed (every server takes zstd frames)."""
        if compress is None and not worth_compressing(self._delta.dense_bytes_per_second):
            return False
        return all(pb.BUCKET_COMPRESSION_ZSTD in info.bucket_compressions for info in self._server_limits())

    def _infos_by_address(self) -> dict[str, pb.GetServerInfoResponse]:
        return dict(zip(self._servers.addresses, self._server_limits(), strict=True))

    def _push_once(self, group: TransferGroup | None, sink: Sink, choice: PlanChoice, *, servers: list[Server],
                   show_progress: bool | None, bases: dict[str, StoreGeneration] | None = None,
                   begun: Callable[[], None] | None = None, **common) -> tuple[PushRun, list[ServerOutcome]]:
        """One run of one plan to `servers`."""
        _prepare_buffers(sink, choice)
        frames = getattr(sink, "frames", None)
        if frames is not None:
            frames.new_run()
        bar = _progress_bar(choice.total_bytes, common["version"], show_progress)
        run = self._run_for(group, sink, choice, servers=servers, bar=bar, **common)
        run.bases = bases or {}
        run.begun = begun
        try:
            outcomes = run.run()
        except BaseException as error:
            if group is not None and (getattr(sink, "broken", False) or _broke_the_group(error)):
                # Unusable now, on every rank: abort its communicator at once (bounded), so nothing of it is
                # left for torch to act on later (NCCL's watchdog and monitor: common/nccl_env.py).
                group.broken = True
                group.collective.close()
            if getattr(error, "reason", "") != "BASE_MISMATCH":
                self._delta.forget()  # whatever the servers hold now, the next push re-establishes it densely
            # What the servers said of themselves (chunk size, worker counts, deferred buckets) and the SHM
            # ingress may be those of a server that restarted since: the next push asks and maps again.
            self._server_infos_stale = True
            raise
        finally:
            if bar is not None:
                bar.close()
        return run, outcomes

    def _run_for(self, group: TransferGroup | None, sink: Sink, choice: PlanChoice, *, servers: list[Server],
                 version: str, mode: Mode, allow_new_tensors: bool, checksums: bool | None,
                 progress: Callable[[PushProgress], None] | None, bar: object | None, started: float) -> PushRun:
        """The run of one plan over `servers`."""
        return PushRun(
            loop=self._loop, servers=servers, metadata=self._servers.metadata,
            rpc_timeout=self._servers.timeout,
            commit_timeout=(group.timeout.total_seconds() if group else self._servers.timeout) + 30,
            group_id=group.group_id if group else "", sink=sink, plans=self._plans, planned=choice.planned,
            plan=choice.cached.plan, plan_id=choice.cached.plan_id, source=choice.source, version=version,
            mode=_MODES[mode], allow_new_tensors=allow_new_tensors, checksums=checksums,
            progress=progress, bar=bar, started=started,
        )

    def _sink(self, transport: str) -> tuple[TransferGroup | None, Sink]:
        """The group (COLLECTIVE only) and where this push's bytes go."""
        if transport == "collective":
            group = self._group
            if group is None:
                raise WeightSyncClientError("no transfer group: call create_group() first (or push with "
                                            "transport='inline')")
            if group.broken:
                raise WeightSyncClientError(f"group {group.group_id} is broken; delete_group() and create_group() again")
            assert self._collective_buffers is not None
            return group, CollectiveSink(self._loop, group.collective, self._collective_buffers)
        infos = self._server_limits()
        for address, info in zip(self._servers.addresses, infos, strict=True):
            if _TRANSPORTS[transport] not in info.transports:
                raise WeightSyncClientError(f"{address} does not offer {transport} (it offers "
                                            f"{[pb.Transport.Name(t) for t in info.transports]})")
        if transport == "inline":
            if self._inline_buffers is None:
                self._inline_buffers = PackBuffers(torch.device("cpu"))
            chunk = min(i.limits.max_chunk_bytes for i in infos)
            return None, InlineSink(self._loop, self._inline_buffers, chunk)
        if len(self._servers.servers) != 1:
            raise WeightSyncClientError("SHM pushes to one server, on this host; use transport='inline' for several")
        if self._shm_sink is None:
            self._ingress_lease = open_ingress(self._servers.addresses[0], infos[0].local_socket, self._servers.token)
            lease = self._ingress_lease
            self._shm_sink = ShmSink(self._loop, lease.fd, lease.slot_bytes, lease.slot_count, self._servers.timeout)
        return None, self._shm_sink

    def _server_limits(self) -> list[pb.GetServerInfoResponse]:
        if any(a not in self._server_infos for a in self._servers.addresses):
            self._server_infos.update(spoken(self._servers.addresses, self.server_info()))
            self._server_infos_stale = False
        return [self._server_infos[a] for a in self._servers.addresses]

    def _refresh_server_infos(self) -> None:
        """Ask again, once a push: a server that does not answer keeps its last answer, and the push
        fails on its own terms (typed, naming the server) rather than on this query."""
        try:
            self._server_infos.update(spoken(self._servers.addresses, self.server_info()))
            self._server_infos_stale = False
        except WeightSyncRpcError:
            pass

    # -- verify ------------------------------------------------------------------
    @_serialized
    def verify(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> VerifyResult:
        """Compare local WS64 checksums with every server's store. A server started with `--tensors`
        answers for the tensors of its subset only; one that stores none of those asked for (a
        pattern that matches none of them) vouches for nothing, and fails the check: each is
        reported missing there (TensorMismatch.remote None)."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        check_tensors(items)
        with one_intra_op_thread():
            local = {name: ws64(t.detach()) for name, t in items}

        request = pb.GetTensorChecksumsRequest(names=sorted(local))

        async def fetch():
            return await asyncio.gather(*(fetch_checksums(self._servers, s, request) for s in self._servers.servers))

        answers = self._loop.run(fetch())
        found: list[TensorMismatch] = []
        for server, answer in zip(self._servers.servers, answers, strict=True):
            found.extend(mismatches(server, answer, local))
            if local and set(local) <= set(answer.not_stored):
                found.extend(TensorMismatch(server.address, name, value, None) for name, value in local.items())
        return VerifyResult(len(local), tuple(found))

    @_serialized
    def adopt_base(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Take these tensors as what the servers hold now, for push(delta=...), where they do:
        a new trainer process (or the CLI) resumes sending patches without a dense push first.
        Each server's store is checked tensor by tensor (WS64, as verify()); a server that
        holds them, CONSISTENT, is recorded at its committed generation; the others get the next
        push dense. Returns the addresses that hold them. Keeps a copy (see delta_host_copy)."""
        items = _materialized(named_tensors)
        with one_intra_op_thread():
            local = {name: ws64(t.detach()) for name, t in items}
        request = pb.GetTensorChecksumsRequest(names=sorted(local))

        async def fetch():
            return await asyncio.gather(*(fetch_checksums(self._servers, s, request) for s in self._servers.servers),
                                        return_exceptions=True)

        generations = {}
        for server, answer in zip(self._servers.servers, self._loop.run(fetch()), strict=True):
            if not isinstance(answer, BaseException) and holds(answer, local):
                generations[server.address] = StoreGeneration(answer.version.store_epoch, answer.version.generation)
        self._delta.committed(items, None, generations)
        return sorted(generations)

    # -- lifecycle ------------------------------------------------------------------
    @_serialized
    def close(self) -> None:
        """Delete the group (if any) and close every channel."""
        try:
            self._close_ingress()
            if self._group is not None:
                self.delete_group()
        finally:
            try:
                self._servers.close()
            finally:
                self._loop.stop()

    def _close_ingress(self) -> None:
        """Unmap the SHM ingress and leave the local socket; the next SHM push opens them again."""
        if self._shm_sink is not None:
            self._shm_sink.close()
            self._ingress_lease.close()  # type: ignore[union-attr]
            self._shm_sink = self._ingress_lease = None

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        try:
            self.close()
        except WeightSyncClientError as error:
            if kind is None:
                raise
            log.warning("close_failed", error=str(error))  # the error already in flight matters more


def _broke_the_group(error: BaseException) -> bool:
    """Whether a failed push broke its transfer group (a broadcast failed or timed out, on any rank)."""
    return getattr(error, "reason", "") in ("COLLECTIVE_TIMEOUT", "COLLECTIVE_FAILED") or isinstance(
        getattr(error, "cause", None), CollectiveError)


def _prepare_buffers(sink: Sink, choice: PlanChoice) -> None:
    """Grow our pack buffers to the plan's largest packed bucket (SHM packs into the server's slots)."""
    buffers = sink.buffers
    if sink.transport != pb.TRANSPORT_SHM:
        buffers.ensure(max((b.spec.size_bytes for b in choice.planned if not is_zero_copy(buffers, b)), default=0))
    buffers.use_plan(choice.cached.plan_id)


def _materialized(named_tensors) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    check_tensors(items)
    if not items:
        raise ValueError("nothing to push: no tensors")
    return items


def _dense_bytes(items: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def _committed(runs: list[tuple[PlanChoice, PushRun, list[ServerOutcome]]], outcomes: list[ServerOutcome],
               version: str, started: float, *, dense_bytes: int, compressed: tuple[int, int] = (0, 0)) -> PushResult:
    seconds = time.perf_counter() - started
    sent = sum(run.sent_bytes for _, run, _ in runs)  # a deferred bucket's layout, not its room
    result = PushResult(
        version=version,
        tensor_count=max(len({t.name for b in choice.planned for t in b.spec.tensors}) for choice, _, _ in runs),
        bucket_count=sum(len(choice.planned) for choice, _, _ in runs),
        size_bytes=sent,
        seconds=seconds,
        plan_reused=all(run.plan_reused for _, run, _ in runs),
        zero_copy_buckets=sum(run.zero_copy_buckets for _, run, _ in runs),
        servers=tuple(outcomes),
        bytes_sent=sent - compressed[1],
        dense_bytes=dense_bytes or sent,
        compressed_bytes=compressed[0],
    )
    log.info("push_committed", version=version, bytes=sent, dense_bytes=result.dense_bytes,
             seconds=round(seconds, 3), gbps=round(result.gigabytes_per_second, 3), buckets=result.bucket_count)
    return result


def _progress_bar(total: int, version: str, show: bool | None):
    if show is None:
        show = sys.stderr.isatty() and total >= PROGRESS_BAR_MIN_BYTES
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"push {version}", leave=False)
