"""The trainer SDK: one client, one or many weightsync servers.

    with WeightSyncClient(["node1:50051", "node2:50051"]) as client:
        client.create_group()
        for step in training:
            ...
            result = client.push(model.state_dict(), version=f"step-{step}")
        client.verify(model.state_dict())

The API is synchronous (it is called from a training loop); the gRPC work runs
on an asyncio loop in a background thread, while packing and broadcasting run
in the caller's thread so they can overlap (see client/push/run.py).

A client is safe to share between threads: its calls run one at a time (a
second thread's push waits for the first to finish).

A sharded trainer pushes from every rank, each its own tensors (DTensor shards as
boxes), into one version: WeightSyncClient(servers, part=Part(rank, world, group))
on every rank (client/parts/part.py; the push itself is client/parts/push.py).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import torch

from weightsync.client.buckets.packing import PackBuffers
from weightsync.client.buckets.plan_cache import PlanCache
from weightsync.client.buckets.planning import DEFAULT_ZERO_COPY_MIN_BYTES, check_tensors
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.server_set import ServerSet
from weightsync.client.delta.base import Delta, DeltaBase
from weightsync.client.delta.link_timings import LinkTimings
from weightsync.client.errors import WeightSyncClientError
from weightsync.client.intra_op import one_intra_op_thread
from weightsync.client.parts import group as part_group
from weightsync.client.parts.agreement import check_group
from weightsync.client.parts.part import Part, is_dtensor
from weightsync.client.parts.push import PartPushContext, push_part
from weightsync.client.parts.verify import checked_here, verify_parts
from weightsync.client.push.job import PushJob, Ran, push_result
from weightsync.client.push.patched import PatchedPlan, plan_patches, send_patches
from weightsync.client.push.plans import PlanChoice, choose_plan
from weightsync.client.servers.checksums import fetch_checksums, holds, mismatches
from weightsync.client.servers.fleet import Fleet
from weightsync.client.servers.records import ServerState
from weightsync.client.transports import transfer_group
from weightsync.client.transports.base import Sink
from weightsync.client.transports.collective import CollectiveSink
from weightsync.client.transports.compression import Frames, worth_compressing
from weightsync.client.transports.inline import InlineSink
from weightsync.client.transports.transfer_group import TransferGroup
from weightsync.client.types import (
    PushProgress,
    PushResult,
    StoreGeneration,
    TensorMismatch,
    TlsConfig,
    VerifyResult,
)
from weightsync.common import patch_kernels
from weightsync.common.address import parse_address
from weightsync.common.checksum import ws64
from weightsync.common.layout import DEFAULT_BUCKET_BYTES
from weightsync.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from weightsync.common.logging import get_logger
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")

Mode = Literal["in_place", "staged"]
Transport = Literal["collective", "inline", "shm"]
_MODES = {"in_place": pb.UPDATE_MODE_IN_PLACE, "staged": pb.UPDATE_MODE_STAGED}
_TRANSPORTS = {"collective": pb.TRANSPORT_COLLECTIVE, "inline": pb.TRANSPORT_INLINE, "shm": pb.TRANSPORT_SHM}
__all__ = ["TlsConfig", "WeightSyncClient"]


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
        part: Part | None = None,
    ) -> None:
        """metadata: extra gRPC metadata on every call, e.g. a W3C ("traceparent", ...) the server
        logs with the update.
        delta_host_copy: keep the copy of the last committed tensors (what push(delta=...)
        compares against: as much memory as the model) in host memory (default; pinned for CUDA
        tensors, whose comparison then reads it across the bus); False: on the tensors' device
        (a second copy of the model in GPU memory).
        part: this process is one of several trainer processes that push each version together, each
        its own tensors (client/parts/part.py: Part; over INLINE, or SHM on the server's host; its whole
        tensors and its boxes with delta). Construct the client with its Part on every rank."""
        addresses = [servers] if isinstance(servers, str) else list(servers)
        if not addresses:
            raise ValueError("at least one server address is required")
        for address in addresses:
            parse_address(address, what="server address")
        if part is not None:
            check_group(part)
        self._part = part
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
        self._fleet = Fleet(self._servers)
        """What this client knows of each server, one record each (client/servers/records.py)."""
        self._plans = PlanCache()
        self._delta = DeltaBase(host_copy=delta_host_copy)
        """The copy of this client's last commit, that delta pushes compare against."""
        self._links = LinkTimings()
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

        A client with a part calls it on every rank, at once: the group holds every part's rank (group
        rank = part rank) and then the workers; part 0 hosts the store, chooses the backend and the id
        and creates the group on the servers, and the parts learn them through Part.group (needed:
        ValueError without it); each part then pushes over transport="collective", sending its
        buckets point-to-point to their owners (parts.group.create_for_part).
        """
        if self._group is not None:
            raise WeightSyncClientError(f"group {self._group.group_id} exists; delete_group() first")
        part = self._part
        if part is not None and part.world > 1:
            if part.group is None:
                raise ValueError("create_group() with a part needs Part.group: the parts agree on the group's id, "
                                 "backend and rendezvous store through it")
            group = part_group.create_for_part(self._servers, rank=part.rank, world=part.world,
                                               part_group=part.group, backend=backend, timeout=timeout,
                                               group_id=group_id, store_host=store_host, store_port=store_port)
        else:
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
        transport: Transport | None = None,
        bucket_size_bytes: int = DEFAULT_BUCKET_BYTES,
        allow_new_tensors: bool = False,
        checksums: bool | None = None,
        zero_copy_min_bytes: int = DEFAULT_ZERO_COPY_MIN_BYTES,
        progress: Callable[[PushProgress], None] | None = None,
        show_progress: bool | None = None,
        delta: Delta = "auto",
        compress: bool | None = None,
        part_key: str | None = None,
    ) -> PushResult:
        """Send one version to every server and commit it.

        The lifecycle, in one pass: choose what to send (every tensor is checked first; with delta,
        each tensor is compared with the copy of this client's last commit, and the servers that
        hold that commit get a patched plan), run it (Begin on every server, the buckets, Commit:
        the patched plan to those servers, the dense plan to the others), and learn from it (each
        server's record, the kept copy, the link's measured throughput). Every wait is bounded by
        the client's timeout (or the group's, for a broadcast): a server that stops answering fails
        the push with UpdateFailed naming it (reason SERVER_UNRESPONSIVE). Packing and checksums
        run with one torch intra-op thread, set for the calling thread and for the SDK's own ops
        only (intra_op.py): the process's torch.get_num_threads() is never changed.

        Args:
            named_tensors: a state dict, or an iterator of (name, tensor). Every tensor is checked
                before anything is sent (TypeError/ValueError naming it). An iterator is streamed
                bucket by bucket only for mode="staged" repeating the last committed plan (gathered
                FSDP layers are then never all held at once; if it diverges, the update aborts and
                the committed weights stay as they were); otherwise it is materialised first, so
                that it is validated before any byte moves. An iterator is always sent dense (it
                is not held whole to compare).
            version: the label the servers publish the committed weights under.
            mode: "in_place" (buckets written straight into the live weights; an aborted update
                leaves the store INCONSISTENT) or "staged" (into a shadow that the commit flips;
                an aborted update leaves the committed weights untouched, bit for bit).
            transport: "collective" (a broadcast to the group from create_group), "inline" (bytes
                inside the gRPC stream: no group, passes any proxy), or "shm" (one server on this
                host: buckets written into its shared memory; no group, no network; buckets at
                most its ingress slot). None (default): "collective", or "inline" with a part (a
                part is pushed over INLINE, or SHM from the server's host).
            bucket_size_bytes: the most bytes one bucket holds (SHM: at most the server's slot).
            allow_new_tensors: accept tensors the servers' stores do not hold yet (they grow);
                False: such a tensor fails the push at Begin.
            checksums: each bucket carries a WS64 checksum that its receiving worker verifies
                (DATA_LOSS names the bucket on mismatch). None (default): on for every bucket
                whose bytes come from or through CUDA memory, where it costs a few percent of
                device bandwidth and nothing else checks the device copies and NCCL end to end;
                off for CPU tensors over Gloo, where TCP already checksums every segment and the
                extra passes over host memory compete with the broadcast for the same cores
                (about 40% of a push on 2 cores). verify() compares every tensor end to end
                either way. SHM buckets always carry one.
            zero_copy_min_bytes: contiguous tensors at least this large are broadcast from their
                own memory, in a bucket of their own (0: always pack). Over SHM, which copies every
                byte once anyway (into the server's store), the default packs them too: fewer,
                larger buckets.
            progress: called after each bucket with a PushProgress (buckets and bytes sent so far).
            show_progress: a tqdm bar on stderr; None (default): when stderr is a terminal and the
                push moves at least push.job.PROGRESS_BAR_MIN_BYTES (256 MiB).
            delta: send only what changed since this client's last commit (tensors unchanged bit
                for bit are left out, sparse changes go as patches; see client/delta/base.py). "auto"
                (default): where it pays on the measured costs, dense otherwise (the first push, a
                new layout, most of the model changed, an iterator). True: patches wherever they
                are smaller than the tensor. False: always dense, and no copy kept. A server that
                does not hold this client's last commit (restarted, or pushed to by someone else)
                gets the update dense: INLINE and SHM that server alone, COLLECTIVE the whole
                group. Keeping the copy costs as much memory as the pushed tensors, in host memory
                (on their device with delta_host_copy=False), but a view that reads elements more
                than once (expand()) only the storage it reads; delta=False frees it.
            compress: COLLECTIVE over a Gloo group, and INLINE: send each bucket of patches as a
                zstd frame (its owners decompress it). None (default): when this client's dense
                pushes measured the link slower than ~3 Gbit/s (client/transports/compression.py); False:
                never; True: whenever it shrinks.
            part_key: with a part (WeightSyncClient(part=...)): the update key every rank passes for
                this push, new each push (1 to 128 of [A-Za-z0-9._-]). Required when the Part has no
                group; with a group, rank 0's (or a key it draws: the version and a random suffix)
                is shared with every rank. A key ending in ".dense" is reserved for the dense retry
                after a refused base.

        With a part (WeightSyncClient(part=...)), push() on every rank sends that rank's tensors of
        one version to every server, one INLINE (or SHM) stream each (client/parts/push.py): plain
        tensors whole, with delta as above (each rank keeps the copy of its own; a refused base makes
        every rank resend the version dense under "<key>.dense"), DTensors as their local shards'
        boxes (client/parts/part.py), with delta as its plain tensors (a patch of a box is the local shard's);
        compress does not apply; the plan is sent in full. With Part.group the ranks
        share the key and check their inputs together first: one rank's bad input fails every rank
        at once (PartInputsRefused); the one collective is bounded by the group's timeout. Inside
        the push the ranks do not wait for each other except through the servers, which commit
        once every part asked to: every rank gets the same generation from each server. Call no
        collective between the parts while a push runs.
        Returns:
            PushResult: each server's outcome (version, generation, store epoch), the bytes sent
            and what a dense push would have sent (bytes_sent, dense_bytes: what delta saved), the
            seconds it took, and whether the plan was reused.

        Raises:
            ValueError: an unknown mode, transport or delta; no tensors; a tensor that cannot be
                sent (TypeError for a non-tensor), named.
            WeightSyncClientError: no group for a COLLECTIVE push (create_group() first) or a broken
                one; a server that does not offer the transport; SHM to several servers or to a
                server on another host; a server that speaks another data-plane revision
                (DataPlaneRevisionUnsupported).
            UpdateFailed: a server refused or failed the update, or a transfer failed; it carries
                a status code and an ErrorInfo reason, and the update is aborted on every server.
            WeightSyncRpcError: a server could not be asked for its info before the first push.
            PartsUnavailable: with a part, COLLECTIVE, or a server whose
                GetServerInfo.parts is false; before any byte moves.
            PartInputsRefused: with a part and its group, any rank's inputs failed its checks (a
                TypeError, a Partial DTensor, ...): raised on every rank, naming the failing ranks,
                before Begin; nothing sent.
            PartUpdateFailed: with a part, an UpdateFailed naming this part (rank, update_key) and
                the part a server blamed (PART_FAILED: failed_part) or the ranks that never joined
                (PARTS_MISSING: missing). The client stays usable: the next push (a new key) runs.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be 'in_place' or 'staged', got {mode!r}")
        if self._part is not None:
            return push_part(self._part_push_context(), self._part, named_tensors, version=version, mode=_MODES[mode],
                             transport=transport or "inline", part_key=part_key, bucket_size_bytes=bucket_size_bytes,
                             allow_new_tensors=allow_new_tensors, checksums=checksums,
                             zero_copy_min_bytes=zero_copy_min_bytes, progress=progress, show_progress=show_progress,
                             delta=delta)
        transport = transport or "collective"
        if part_key is not None:
            raise ValueError("part_key is for a client with a part (WeightSyncClient(part=...))")
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be 'collective', 'inline' or 'shm', got {transport!r}")
        started = time.perf_counter()
        self._fleet.ask_again_if_stale()
        group, sink = self._sink(transport)
        if transport == "shm":
            bucket_size_bytes = min(bucket_size_bytes, self._fleet.states[0].ingress.lease.slot_bytes)  # type: ignore[union-attr]
            if zero_copy_min_bytes == DEFAULT_ZERO_COPY_MIN_BYTES:
                # SHM copies every byte once (into the store, or a slot): a tensor gains nothing from a bucket of
                # its own, and fewer, larger buckets cost fewer announcements, checks and answers.
                zero_copy_min_bytes = 0
        if delta not in ("auto", True, False):
            raise ValueError(f"delta must be 'auto', True or False, got {delta!r}")
        sizes = dict(bucket_size_bytes=bucket_size_bytes, zero_copy_min_bytes=zero_copy_min_bytes)
        link = self._links.bytes_per_second(transport)
        job = PushJob(loop=self._loop, servers=self._servers, group=group, sink=sink, delta=self._delta,
                      version=version, mode=_MODES[mode], allow_new_tensors=allow_new_tensors, checksums=checksums,
                      progress=progress, show_progress=show_progress, started=started)

        # -- choose: the tensors kept for delta (None: dense, no copy), and the patched plan, if any
        items = self._compared(named_tensors, delta, transport)
        if sink.frames is not None:  # COLLECTIVE and INLINE: buckets of patches as zstd frames
            sink.frames.enabled = items is not None and compress is not False and self._compressing(compress, link)
        patched = plan_patches(self._delta, items, delta, servers=self._fleet.answered(), link=link,
                               collective=group is not None, **sizes) if items is not None else None

        # -- run: the patched plan to the servers that take it, the dense plan to the rest
        runs: list[Ran] = []
        took: list[ServerState] = []
        if patched is not None:
            assert items is not None  # only compared tensors are patched
            try:
                runs, took = send_patches(patched, self._delta, items, job, collective=group is not None)
            finally:
                patched.stop()
        rest = [s for s in self._fleet.states if s not in took]
        dense: PlanChoice | None = None
        if rest:
            dense = choose_plan(dict(items) if items is not None else named_tensors, self._plans,
                                may_stream=mode == "staged" and not allow_new_tensors, **sizes)
            if items is not None and not took:
                self._delta.take_in_background(items, None)  # the copy refreshes while the bytes move
            runs.append(job.run(dense, rest))

        # -- learn: each server's record, the kept copy, the result, the link's throughput
        return self._learn(runs, dense, patched if took else None, items, transport, sink.frames, version, started)

    def _compared(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                  delta: Delta, transport: str) -> list[tuple[str, torch.Tensor]] | None:
        """The tensors, materialised and checked, when this push compares them with the kept copy;
        None (and no copy kept) when it cannot: delta=False, an iterator (never held whole), or
        auto where no patch pays (LinkTimings.cannot_pay)."""
        if delta is False or not isinstance(named_tensors, Mapping | list | tuple):
            self._delta.drop()  # an iterator streams (never held whole): nothing to compare
            return None
        items = _materialized(named_tensors)
        if delta == "auto" and self._links.cannot_pay(items, transport):
            self._delta.drop()  # the sample and the copy would cost a few percent, for nothing
            return None
        return items

    def _learn(self, runs: list[Ran], dense: PlanChoice | None, patched: PatchedPlan | None,
               items: list[tuple[str, torch.Tensor]] | None, transport: str, frames: Frames | None,
               version: str, started: float) -> PushResult:
        """Every run committed: record it per server, let the copy claim it, time the link."""
        if dense is not None:
            self._plans.committed(dense.cached)
        for ran in runs:
            plan_id = dense.cached.plan_id if dense is not None and ran.choice is dense else None
            for outcome in ran.outcomes:
                self._fleet.by_address(outcome.server).committed(plan_id, outcome.committed)
        if items is not None:
            self._delta.committed(items, patched.delta if patched is not None else None)
        result = push_result(runs, version, started, dense_bytes=_dense_bytes(items) if items else 0,
                             compressed=(frames.compressed_bytes, frames.saved_bytes) if frames else (0, 0))
        if result.bytes_sent >= result.dense_bytes and result.plan_reused:
            # All dense into stores that exist (a first push also allocates them): what the link and
            # the servers take, for auto's thresholds.
            self._links.dense_push_timed(transport, result.bytes_sent, result.seconds)
        elif patched is not None:
            waited = sum(r.run.wire_seconds for r in runs) - (frames.seconds if frames else 0.0)
            self._links.link_timed(transport, result.bytes_sent, waited, result.seconds)
        return result

    def _compressing(self, compress: bool | None, link: float) -> bool:
        """Whether this push sends its buckets of patches compressed (every server takes zstd frames)."""
        if compress is None and not worth_compressing(link):
            return False
        return all(pb.BUCKET_COMPRESSION_ZSTD in info.bucket_compressions for info in self._fleet.infos())

    def _part_push_context(self) -> PartPushContext:
        """What a part's push uses of this client (client/parts/push.py)."""
        return PartPushContext(fleet=self._fleet, delta=self._delta, links=self._links, loop=self._loop,
                               servers=self._servers, group=self._group,
                               sink_for=lambda transport: self._sink(transport)[1])

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
        infos = self._fleet.infos()
        for address, info in zip(self._servers.addresses, infos, strict=True):
            if _TRANSPORTS[transport] not in info.transports:
                raise WeightSyncClientError(f"{address} does not offer {transport} (it offers "
                                            f"{[pb.Transport.Name(t) for t in info.transports]})")
        if transport == "inline":
            if self._inline_buffers is None:
                self._inline_buffers = PackBuffers(torch.device("cpu"))
            chunk = min(i.limits.max_chunk_bytes for i in infos)
            return None, InlineSink(self._loop, self._inline_buffers, chunk)
        return None, self._fleet.shm_sink(self._loop)

    # -- verify ------------------------------------------------------------------
    @_serialized
    def verify(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> VerifyResult:
        """Compare local WS64 checksums with every server's store. A server started with `--tensors`
        answers for the tensors of its subset only; one that stores none of those asked for (a
        pattern that matches none of them) vouches for nothing, and fails the check: each is
        reported missing there (TensorMismatch.remote None). With a part, what is asked is this
        rank's share, which may lie wholly outside a node's subset: that node then vouches for
        nothing only if it holds nothing at all (servers.checksums.not_its_to_hold).

        A DTensor (FSDP2, DTensor TP) is checked as this rank's local shard: the box of the whole
        tensor that its push declares, against the server's checksum of that box, with no
        collective and no gather; a replicated one by every rank that holds it; a box's mismatch is
        named `name[2:4, 0:8]` (see client/parts/verify.py). `checked` then counts whole tensors and
        boxes."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        check_tensors(items)
        if self._part is not None or any(is_dtensor(t) for _, t in items):
            with one_intra_op_thread():
                checked = checked_here(items)
            return self._loop.run(verify_parts(self._servers, self._fleet.states, checked,
                                               share=self._part is not None))
        with one_intra_op_thread():
            local = {name: ws64(t.detach()) for name, t in items}

        request = pb.GetTensorChecksumsRequest(names=sorted(local))

        async def fetch():
            return await asyncio.gather(*(fetch_checksums(self._servers, s, request) for s in self._fleet.states))

        answers = self._loop.run(fetch())
        found: list[TensorMismatch] = []
        for server, answer in zip(self._fleet.states, answers, strict=True):
            found.extend(mismatches(server, answer, local))
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
            return await asyncio.gather(*(fetch_checksums(self._servers, s, request) for s in self._fleet.states),
                                        return_exceptions=True)

        generations = {}
        for server, answer in zip(self._fleet.states, self._loop.run(fetch()), strict=True):
            if not isinstance(answer, BaseException) and holds(answer, local):
                generations[server.address] = StoreGeneration(answer.version.store_epoch, answer.version.generation)
        self._delta.committed(items, None)
        for state in self._fleet.states:
            if state.address in generations:
                state.committed(None, generations[state.address])
            else:
                state.base_refused()  # it does not hold them: the next push gets it dense
        return sorted(generations)

    # -- lifecycle ------------------------------------------------------------------
    @_serialized
    def close(self) -> None:
        """Delete the group (if any) and close every channel."""
        try:
            self._fleet.unmap()
            if self._group is not None:
                self.delete_group()
        finally:
            try:
                self._servers.close()
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


def _materialized(named_tensors) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    check_tensors(items)
    if not items:
        raise ValueError("nothing to push: no tensors")
    return items


def _dense_bytes(items: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)
