"""Creating and deleting a transfer group (COLLECTIVE pushes) across the SDK's servers.

Rank 0's rendezvous runs in a thread while CreateTransferGroup goes to every
server at once, so a server's refusal comes back at once (rendezvous.py), and
closing the store rank 0 hosts then ends every rank's join: nothing the call
started outlives it. On failure only the servers where this call created the
group are cleaned up; a group nobody can reach is dropped by its server when it
sees the trainer's store close.

A client with a part creates its group through client/parts/group.py, with the same pieces.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from weightsync.client.channels.revision import spoken
from weightsync.client.channels.server_set import Server, ServerSet
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.transports.rendezvous import HostedStore, Rendezvous
from weightsync.common.address import parse_address
from weightsync.common.collective import (
    CollectiveGroup,
    host_store,
    local_address_towards,
)
from weightsync.common.device_identity import normalize_uuid
from weightsync.common.logging import get_logger
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")


@dataclass(slots=True)
class TransferGroup:
    group_id: str
    backend: int
    world_size: int
    timeout: datetime.timedelta
    device: torch.device
    collective: CollectiveGroup
    store: object
    """The rendezvous TCPStore: kept listening for the group's life (servers probe it)."""
    rank_offsets: dict[str, int]
    """Server address -> the group rank of its worker 0 (its worker w is rank offset + w; rank_offsets)."""
    broken: bool = False
    rank: int = 0
    """This process's rank in the group (its part's rank; 0 without a part)."""
    trainer_ranks: int = 1
    """The trainer's ranks, 0..trainer_ranks-1: one per part (1 without a part)."""


# -- which backend ----------------------------------------------------------------------------
WORKER_UUID_FIELD = "device_uuid"
"""WorkerInfo's device UUID ("GPU-...", empty for CPU workers), once servers report it; until then every
worker reads as "" and no GPU is known to be shared."""


def gpu_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device: which physical GPU it is, whatever ordinal CUDA_VISIBLE_DEVICES gives it."""
    return normalize_uuid(str(torch.cuda.get_device_properties(device).uuid))


def trainer_cuda_device(*, available: bool, initialized: bool) -> torch.device | None:
    """The trainer's GPU for backend choice: its current CUDA device if this process already uses CUDA,
    else None (Gloo). Asking torch.cuda.current_device() in a process that never touched CUDA creates a
    context on GPU 0 (hundreds of MiB there, and every later pack buffer pinned for it)."""
    if not (available and initialized):
        return None
    return torch.device("cuda", torch.cuda.current_device())


@dataclass(frozen=True, slots=True)
class ServerDevices:
    """What backend choice needs to know of one server."""

    address: str
    backends: frozenset[int]
    worker_uuids: tuple[str, ...]
    """Each worker's GPU UUID ("" for a CPU worker, or a server that does not report it)."""

    @staticmethod
    def of(address: str, info: pb.GetServerInfoResponse) -> ServerDevices:
        return ServerDevices(address, frozenset(info.backends),
                             tuple(getattr(w, WORKER_UUID_FIELD, "") for w in info.workers))


def choose_backend(requested: str, *, trainer_gpu_uuid: str | None, servers: Sequence[ServerDevices]) -> int:
    """The group's backend. "auto": NCCL when this process has a GPU, every server offers NCCL, and no
    worker runs on this process's GPU (NCCL cannot put two ranks of one group on one GPU: the group
    hangs or fails at its first collective), nor two workers share one GPU (two servers on one host given
    the same GPUs); else Gloo. "nccl" on a shared GPU is refused, naming it."""
    trainer = normalize_uuid(trainer_gpu_uuid) if trainer_gpu_uuid else ""
    sharing = [(s.address, index) for s in servers for index, uuid in enumerate(s.worker_uuids)
               if trainer and uuid and normalize_uuid(uuid) == trainer]
    crowded = workers_sharing_a_gpu(servers)
    if requested == "auto":
        nccl = bool(trainer) and all(pb.BACKEND_NCCL in s.backends for s in servers)
        if nccl and sharing:
            log.info("nccl_not_chosen", reason="a worker shares this process's GPU", gpu=trainer,
                     workers=[f"{address} worker {index}" for address, index in sharing])
        if nccl and crowded:
            log.info("nccl_not_chosen", reason="two workers share a GPU",
                     gpus={gpu: [f"{a} worker {i}" for a, i in where] for gpu, where in crowded.items()})
        chosen = pb.BACKEND_NCCL if nccl and not sharing and not crowded else pb.BACKEND_GLOO
    elif requested in ("gloo", "nccl"):
        chosen = pb.BACKEND_GLOO if requested == "gloo" else pb.BACKEND_NCCL
    else:
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {requested!r}")
    if chosen == pb.BACKEND_NCCL and sharing:
        address, index = sharing[0]
        raise WeightSyncClientError(
            f"backend 'nccl': worker {index} of {address} runs on this process's GPU ({trainer}); NCCL cannot "
            "put two ranks of one group on one GPU. Use backend='gloo' (or 'auto', which then picks Gloo), or "
            "train on another GPU"
        )
    if chosen == pb.BACKEND_NCCL and crowded:
        gpu, where = next(iter(crowded.items()))
        raise WeightSyncClientError(
            f"backend 'nccl': {' and '.join(f'worker {i} of {a}' for a, i in where)} run on one GPU ({gpu}); NCCL "
            "cannot put two ranks of one group on one GPU. Use backend='gloo' (or 'auto', which then picks Gloo), "
            "or give each server's workers GPUs of their own"
        )
    for server in servers:
        if chosen not in server.backends:
            raise WeightSyncClientError(f"{server.address} does not offer {pb.Backend.Name(chosen)}")
    return chosen


def workers_sharing_a_gpu(servers: Sequence[ServerDevices]) -> dict[str, list[tuple[str, int]]]:
    """GPU UUID -> the workers (server address, worker index) on it, for each GPU that holds more than one:
    two servers on one host whose workers were given the same GPUs would put two ranks of a group on it."""
    on: dict[str, list[tuple[str, int]]] = {}
    for server in servers:
        for index, worker_uuid in enumerate(server.worker_uuids):
            if worker_uuid:
                on.setdefault(normalize_uuid(worker_uuid), []).append((server.address, index))
    return {gpu: where for gpu, where in on.items() if len(where) > 1}


def rank_offsets(worker_counts: Sequence[int], trainer_ranks: int = 1) -> list[int]:
    """Each server's first rank in a group of the trainer's ranks (0..trainer_ranks-1) and these servers'
    workers, in order: the servers' workers follow one another."""
    offsets, offset = [], trainer_ranks
    for count in worker_counts:
        offsets.append(offset)
        offset += count
    return offsets


# -- create and delete --------------------------------------------------------------------------
def create(servers: ServerSet, *, backend: str, timeout: float, group_id: str | None, store_host: str | None,
           store_port: int) -> TransferGroup:
    """Join every server's workers and this process (rank 0) in one group (see WeightSyncClient.create_group)."""
    infos = [info for _, info in spoken(servers.addresses, servers.each("GetServerInfo", pb.GetServerInfoRequest()))]
    trainer_device = trainer_cuda_device(available=torch.cuda.is_available(), initialized=torch.cuda.is_initialized())
    trainer_gpu = gpu_uuid(trainer_device) if trainer_device is not None else None
    chosen = choose_backend(backend, trainer_gpu_uuid=trainer_gpu,
                            servers=[ServerDevices.of(s.address, i) for s, i in zip(servers.servers, infos, strict=True)])
    offsets = rank_offsets([len(info.workers) for info in infos])
    world_size = 1 + sum(len(info.workers) for info in infos)
    by_address = dict(zip(servers.addresses, offsets, strict=True))
    group_id = group_id or f"ws-{uuid.uuid4().hex[:12]}"
    first = parse_address(servers.servers[0].address)
    host = store_host or local_address_towards(first.host, first.port)
    delta = datetime.timedelta(seconds=timeout)
    hosted = HostedStore(host_store(host, delta, store_port))
    device = trainer_device if chosen == pb.BACKEND_NCCL and trainer_device is not None else torch.device("cpu")
    log.info("group_creating", group_id=group_id, world_size=world_size, backend=pb.Backend.Name(chosen))
    rendezvous = Rendezvous(group_id=group_id, backend=chosen, store=hosted.client(), world_size=world_size,
                            timeout=delta, device=device, local_address=host, hosted=hosted)
    created, failure = servers.loop.run(create_everywhere(servers, group_id, host, hosted.port, world_size, chosen,
                                                           delta, by_address, 1))
    if failure is None:
        try:
            collective = rendezvous.result(timeout + 10)
        except BaseException:
            rendezvous.abandon()
            clean_up(servers, created, group_id)
            raise
    else:
        rendezvous.abandon()  # closes our store: the join ends now, not at its timeout
        clean_up(servers, created, group_id)
        raise failure
    log.info("group_ready", group_id=group_id)
    return TransferGroup(group_id, chosen, world_size, delta, device, collective, hosted.store, by_address)


async def create_everywhere(
    servers: ServerSet, group_id: str, host: str, port: int, world_size: int, backend: int, timeout: datetime.timedelta,
    offsets: dict[str, int], trainer_ranks: int,
) -> tuple[list[Server], BaseException | None]:
    """CreateTransferGroup on every server at once; returns at the first refusal, without
    waiting for the others' rendezvous (they fail at its deadline, and are cleaned up then)."""

    def request(server: Server) -> pb.CreateTransferGroupRequest:
        message = pb.CreateTransferGroupRequest(
            group_id=group_id, store_host=host, store_port=port, world_size=world_size,
            rank_offset=offsets[server.address], backend=backend, trainer_ranks=trainer_ranks,
        )
        message.timeout.FromTimedelta(timeout)
        return message

    calls = {
        asyncio.ensure_future(servers.unary(s, "CreateTransferGroup", request(s), timeout.total_seconds() + 30)): s
        for s in servers.servers
    }
    created: list[Server] = []
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
        asyncio.ensure_future(_delete_when_created(servers, {c: calls[c] for c in pending}, group_id))
    return created, failure


async def _delete_when_created(servers: ServerSet, calls: dict[asyncio.Future, Server], group_id: str) -> None:
    await asyncio.wait(calls)
    request = pb.DeleteTransferGroupRequest(group_id=group_id)
    for call, server in calls.items():
        if not call.cancelled() and call.exception() is None:
            try:
                await servers.unary(server, "DeleteTransferGroup", request)
            except WeightSyncRpcError as error:
                log.warning("group_cleanup_failed", server=server.address, error=str(error))


def _delete_on(servers: ServerSet, targets: list[Server], group_id: str) -> list[WeightSyncRpcError]:
    """Delete the group on these servers only; returns the failures (a group already gone is deleted)."""
    async def delete(server: Server) -> None:
        request = pb.DeleteTransferGroupRequest(group_id=group_id)
        for attempt in range(3):
            try:
                await servers.unary(server, "DeleteTransferGroup", request)
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
        return await asyncio.gather(*(delete(s) for s in targets), return_exceptions=True)

    if not targets:
        return []
    return [r for r in servers.loop.run(run()) if isinstance(r, WeightSyncRpcError)]


def clean_up(servers: ServerSet, targets: list[Server], group_id: str) -> None:
    """Best effort after a failed create: the original error is what the caller must see."""
    for error in _delete_on(servers, targets, group_id):
        log.warning("group_cleanup_failed", group_id=group_id, server=error.server, error=str(error))


def delete(servers: ServerSet, group: TransferGroup) -> None:
    """Tear the group down on every server and locally (see WeightSyncClient.delete_group). A part but
    part 0 only leaves it: part 0 created it on the servers and deletes it there."""
    group.collective.close()
    if group.rank != 0:
        log.info("group_left", group_id=group.group_id, rank=group.rank)
        return
    failures = _delete_on(servers, servers.servers, group.group_id)
    for error in (e for e in failures if e.code == grpc.StatusCode.UNAVAILABLE):
        # Our rendezvous store closes with the group: the server sees that and drops it itself.
        log.warning("group_delete_unreachable", group_id=group.group_id, server=error.server, error=str(error))
    refused = [e for e in failures if e.code != grpc.StatusCode.UNAVAILABLE]
    if refused:
        where = ", ".join(f"{e.server} ({e.code.name} {e.reason})" for e in refused)
        raise WeightSyncClientError(f"group {group.group_id} could not be deleted on {where}")
    log.info("group_deleted", group_id=group.group_id)
