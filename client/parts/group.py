"""create_group() for a client with a part (WeightSyncClient(part=Part(rank, world, group))), called on every
rank: one transfer group of every part's rank (group rank = part rank, 0..world-1; CreateTransferGroupRequest.
trainer_ranks) and then the servers' workers.

Part 0 hosts the rendezvous store, chooses the backend (parts_backend: every part's GPU counts) and the group
id, and creates the group on the servers (client/transports/transfer_group.py's pieces); the parts learn what it chose through
Part.group (one all-gather of a fixed-size record per rank, as agreement.py does: a rank whose checks
failed fails every rank at once; a part that is gone is PartGroupFailed on the others), then each joins the
rendezvous from its own thread. A refusal on part 0 closes its store, which ends every part's rendezvous at
once (client/transports/rendezvous.py).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.client.channels.revision import spoken
from weightsync.client.channels.server_set import Server, ServerSet
from weightsync.client.errors import WeightSyncClientError
from weightsync.client.parts.agreement import gather
from weightsync.client.transports.rendezvous import HostedStore, Rendezvous
from weightsync.client.transports.transfer_group import (
    ServerDevices,
    TransferGroup,
    choose_backend,
    clean_up,
    create_everywhere,
    gpu_uuid,
    rank_offsets,
    trainer_cuda_device,
)
from weightsync.common.address import parse_address
from weightsync.common.collective import (
    RendezvousTimeout,
    connect_store,
    host_store,
    local_address_towards,
)
from weightsync.common.device_identity import normalize_uuid
from weightsync.common.logging import get_logger
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")

AGREED_BYTES = 512
"""The fixed size of each rank's record in create_for_part's all-gather."""


@dataclass(frozen=True, slots=True)
class Agreed:
    """What part 0 chose for the group, as every part learns it."""

    group_id: str
    backend: int
    store_host: str
    store_port: int
    world_size: int


def encode_agreed(agreed: Agreed | None, failure: BaseException | None) -> torch.Tensor:
    """One rank's record: what it chose (part 0's is the one read), or that its checks failed and why."""
    text = (f"ok\n{agreed.group_id}\n{agreed.backend}\n{agreed.store_host}\n{agreed.store_port}\n{agreed.world_size}"
            if failure is None and agreed is not None
            else f"failed\n{type(failure).__name__}: {failure}" if failure is not None else "ok")
    raw = text.encode()[: AGREED_BYTES - 2]
    record = torch.zeros(AGREED_BYTES, dtype=torch.uint8)
    record[0], record[1] = len(raw) & 0xFF, len(raw) >> 8
    record[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return record


def decide_agreed(records: list[torch.Tensor], rank: int) -> Agreed:
    """Every rank's record -> part 0's choice, or WeightSyncClientError naming every rank that failed."""
    texts = []
    for record in records:
        data = bytes(record.cpu().tolist())
        texts.append(data[2 : 2 + (data[0] | data[1] << 8)].decode("utf-8", errors="replace"))
    failed = {r: t.split("\n", 1)[1] if "\n" in t else t for r, t in enumerate(texts) if not t.startswith("ok")}
    if failed:
        said = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        raise WeightSyncClientError(f"part {rank}: create_group failed before any rendezvous: {said}")
    fields = texts[0].split("\n")
    return Agreed(fields[1], int(fields[2]), fields[3], int(fields[4]), int(fields[5]))


def parts_backend(requested: str, *, part_gpu_uuids: Sequence[str], servers: Sequence[ServerDevices]) -> int:
    """choose_backend for a group of several parts' ranks: every part's GPU counts, not part 0's alone (each part
    is a rank of the group, and over NCCL its sends run on a communicator with each owner: a part on a worker's
    GPU, or two parts on one GPU, fail there). "auto": NCCL only when every part has a GPU of its own and each
    passes choose_backend; "nccl" where a part has no GPU, or two share one, is refused naming them."""
    gpus = [normalize_uuid(u) if u else "" for u in part_gpu_uuids]
    missing = [rank for rank, gpu in enumerate(gpus) if not gpu]
    shared = sorted({gpu for gpu in gpus if gpu and gpus.count(gpu) > 1})
    if requested == "nccl" and missing:
        raise WeightSyncClientError(f"backend 'nccl': part(s) {missing} use no CUDA device; set it "
                                    "(torch.cuda.set_device) before create_group on every rank, or use backend='gloo'")
    if requested == "nccl" and shared:
        raise WeightSyncClientError(f"backend 'nccl': parts {[r for r, g in enumerate(gpus) if g == shared[0]]} run "
                                    f"on one GPU ({shared[0]}); NCCL cannot put two ranks of one group on one GPU. "
                                    "Use backend='gloo' (or 'auto', which then picks Gloo)")
    if requested == "auto" and (missing or shared):
        log.info("nccl_not_chosen", reason="a part has no GPU, or two parts share one", without_gpu=missing,
                 shared=shared)
        requested = "gloo"
    chosen = {choose_backend(requested, trainer_gpu_uuid=gpu or None, servers=servers) for gpu in gpus or [""]}
    return pb.BACKEND_GLOO if pb.BACKEND_GLOO in chosen else pb.BACKEND_NCCL


GPU_UUID_BYTES = 64
"""A part's GPU UUID in create_for_part's all-gather: ASCII, zero-padded ("" for a part without CUDA)."""


def _gather_gpu_uuids(part_group: object, mine: str, *, rank: int, world: int) -> list[str]:
    record = torch.zeros(GPU_UUID_BYTES, dtype=torch.uint8)
    raw = mine.encode("ascii")[:GPU_UUID_BYTES]
    record[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    records = gather(part_group, record, rank=rank, world=world, during="create_group")
    return [bytes(r.cpu().tolist()).rstrip(b"\0").decode("ascii") for r in records]


def create_for_part(servers: ServerSet, *, rank: int, world: int, part_group: object, backend: str, timeout: float,
                    group_id: str | None, store_host: str | None, store_port: int) -> TransferGroup:
    """One group of every part's rank (0..world-1) and every server's workers (module docstring); called on
    every part's rank. Part 0 hosts the store, chooses, and creates the group on the servers. A part gone before
    or during the parts' all-gathers is PartGroupFailed on the others (agreement.gather); a refusal on part 0
    closes its store, which ends every part's rendezvous at once."""
    delta = datetime.timedelta(seconds=timeout)
    trainer_device = trainer_cuda_device(available=torch.cuda.is_available(), initialized=torch.cuda.is_initialized())
    chosen: Agreed | None = None
    hosted: HostedStore | None = None
    offsets: dict[str, int] = {}
    failure: BaseException | None = None
    # Every part's GPU, for part 0's choice (parts_backend): a part on a worker's GPU matters as part 0's would.
    part_gpus = _gather_gpu_uuids(part_group, gpu_uuid(trainer_device) if trainer_device is not None else "",
                                  rank=rank, world=world)
    try:
        if rank == 0:
            infos = [info for _, info in spoken(servers.addresses,
                                                servers.each("GetServerInfo", pb.GetServerInfoRequest()))]
            backend_number = parts_backend(backend, part_gpu_uuids=part_gpus, servers=[
                ServerDevices.of(s.address, i) for s, i in zip(servers.servers, infos, strict=True)])
            counts = [len(info.workers) for info in infos]
            offsets = dict(zip(servers.addresses, rank_offsets(counts, world), strict=True))
            first = parse_address(servers.servers[0].address)
            host = store_host or local_address_towards(first.host, first.port)
            hosted = HostedStore(host_store(host, delta, store_port))
            chosen = Agreed(group_id or f"ws-{uuid.uuid4().hex[:12]}", backend_number, host, hosted.port,
                            world + sum(counts))
    except Exception as error:  # every rank learns it through the all-gather, at once
        failure = error
    try:
        agreed = decide_agreed(gather(part_group, encode_agreed(chosen, failure), rank=rank, world=world,
                                      during="create_group"), rank)
        return _join_as_part(servers, agreed, rank=rank, world=world, delta=delta, trainer_device=trainer_device,
                             hosted=hosted, offsets=offsets)
    except BaseException:
        if hosted is not None:
            hosted.close()
        if failure is not None:
            raise failure from None
        raise


def connected_key(group_id: str, rank: int) -> str:
    """The store key part `rank` sets once it holds its connection to part 0's store."""
    return f"weightsync-parts/{group_id}/connected/{rank}"


def _close_when_connected(rendezvous: Rendezvous, hosted: HostedStore, group_id: str, world: int,
                          delta: datetime.timedelta) -> None:
    """Part 0's create was refused: close its store, which fails every part's rendezvous at once, but only once
    every other part holds its connection to it (or the group's timeout passed: a part that never comes). A part
    that found the store already closed would retry connecting until its timeout."""
    try:
        hosted.store.wait([connected_key(group_id, rank) for rank in range(1, world)], delta)
    except RuntimeError as error:  # torch's wait timed out: close anyway
        log.warning("parts_not_connected_at_refusal", group_id=group_id, error=str(error)[:200])
    rendezvous.abandon()


def _join_as_part(servers: ServerSet, agreed: Agreed, *, rank: int, world: int, delta: datetime.timedelta,
                  trainer_device: torch.device | None, hosted: HostedStore | None,
                  offsets: dict[str, int]) -> TransferGroup:
    """create_for_part once every part learnt what part 0 chose: each joins the rendezvous from its own thread,
    and part 0 creates the group on the servers meanwhile."""
    if agreed.backend == pb.BACKEND_NCCL and trainer_device is None:
        raise WeightSyncClientError(f"part {rank}: the group's backend is NCCL (chosen by part 0) but this process "
                                    "uses no CUDA device: set it (torch.cuda.set_device) before create_group, or "
                                    "create the group with backend='gloo'")
    device = trainer_device if agreed.backend == pb.BACKEND_NCCL and trainer_device is not None else torch.device("cpu")
    # Part 0 holds its store only through `hosted` (no reference here), so that closing it stops it.
    client = None
    if hosted is None:
        client = connect_store(agreed.store_host, agreed.store_port, delta)
        client.set(connected_key(agreed.group_id, rank), b"1")  # part 0 may close the store now (_close_when_connected)
    local = local_address_towards(agreed.store_host, agreed.store_port)
    log.info("group_creating", group_id=agreed.group_id, world_size=agreed.world_size, rank=rank, parts=world,
             backend=pb.Backend.Name(agreed.backend))
    rendezvous = Rendezvous(group_id=agreed.group_id, backend=agreed.backend,
                            store=client if hosted is None else hosted.client(), world_size=agreed.world_size,
                            timeout=delta, device=device, local_address=local, rank=rank, trainer_ranks=world,
                            hosted=hosted)
    created: list[Server] = []
    if hosted is not None:
        created, failure = servers.loop.run(create_everywhere(
            servers, agreed.group_id, agreed.store_host, agreed.store_port, agreed.world_size, agreed.backend, delta,
            offsets, world))
        if failure is not None:
            _close_when_connected(rendezvous, hosted, agreed.group_id, world, delta)
            clean_up(servers, created, agreed.group_id)
            raise failure
    try:
        collective = rendezvous.result(delta.total_seconds() + 10)
    except BaseException as error:
        rendezvous.abandon()
        if rank == 0:
            clean_up(servers, created, agreed.group_id)
            raise
        if isinstance(error, RuntimeError) and not isinstance(error, RendezvousTimeout):
            raise WeightSyncClientError(
                f"part {rank} of {world}: create_group failed in the group's rendezvous, nothing created: part 0 "
                f"closed its store (its create_group failed: its error says why) or is gone; torch said: "
                f"{str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__}"
            ) from error
        raise
    log.info("group_ready", group_id=agreed.group_id, rank=rank)
    return TransferGroup(agreed.group_id, agreed.backend, agreed.world_size, delta, device, collective,
                         hosted.store if hosted is not None else client, offsets, rank=rank, trainer_ranks=world)
