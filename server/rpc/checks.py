"""Checking what a request asks for, before the server acts on it (no state of its own).

Every function raises the domain error (INVALID_ARGUMENT, NOT_FOUND,
FAILED_PRECONDITION, ...) that names what is wrong, and changes nothing.
"""

from __future__ import annotations

import datetime
import re

from weightsync.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unimplemented
from weightsync.common.plan_id import plan_id_of
from weightsync.common.plan_validation import PlanLimits, PlanSummary, validate_plan
from weightsync.server.groups import GroupRecord, GroupRegistry
from weightsync.server.store.version import PublishedVersion
from weightsync.server.update.plans import ValidatedPlans
from weightsync.server.workers.backends import available_backends_for
from weightsync.server.workers.supervisor import WorkerHandle
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

GROUP_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_GROUP_TIMEOUT = datetime.timedelta(seconds=60)
MAX_GROUP_TIMEOUT = datetime.timedelta(hours=1)
MAX_VERSION_BYTES = 256


def group_record(request: pb.CreateTransferGroupRequest, workers: list[WorkerHandle]) -> GroupRecord:
    """The group a CreateTransferGroupRequest asks for, or INVALID_ARGUMENT saying what is wrong."""
    if not GROUP_ID_PATTERN.match(request.group_id):
        raise InvalidArgument(
            "GROUP_ID_INVALID", "group_id must be 1 to 128 characters of [A-Za-z0-9._-]", group_id=request.group_id[:128]
        )
    if not request.store_host:
        raise InvalidArgument("STORE_HOST_MISSING", "store_host is required")
    if not 1 <= request.store_port <= 65535:
        raise InvalidArgument("STORE_PORT_INVALID", f"store_port {request.store_port} is not 1..65535", store_port=request.store_port)
    if request.backend == pb.BACKEND_UNSPECIFIED:
        raise InvalidArgument("BACKEND_UNSPECIFIED", "backend is required (BACKEND_GLOO or BACKEND_NCCL)")
    supported = available_backends_for(workers)
    if request.backend not in supported:
        raise InvalidArgument(
            "BACKEND_UNSUPPORTED",
            f"backend {request.backend} is not supported by this server's workers "
            f"(supported: {[pb.Backend.Name(b) for b in supported]})",
            backend=request.backend,
        )
    workers = len(workers)
    trainers = request.trainer_ranks or 1  # 0: one trainer process, rank 0
    if request.trainer_ranks < 0 or request.rank_offset < trainers:
        raise InvalidArgument(
            "RANKS_DO_NOT_FIT",
            f"the trainer holds ranks 0..{trainers - 1} (trainer_ranks {request.trainer_ranks}): this server's "
            f"workers must start at rank_offset >= {trainers}, got rank_offset {request.rank_offset}",
            world_size=request.world_size, rank_offset=request.rank_offset, workers=workers,
            trainer_ranks=request.trainer_ranks,
        )
    if request.world_size < 2 or request.rank_offset + workers > request.world_size:
        raise InvalidArgument(
            "RANKS_DO_NOT_FIT",
            f"this server's {workers} workers need ranks rank_offset..rank_offset+{workers - 1} "
            f"inside {trainers}..world_size-1; got rank_offset {request.rank_offset}, world_size {request.world_size}",
            world_size=request.world_size, rank_offset=request.rank_offset, workers=workers,
        )
    timeout = request.timeout.ToTimedelta() if request.HasField("timeout") else DEFAULT_GROUP_TIMEOUT
    if not datetime.timedelta(0) < timeout <= MAX_GROUP_TIMEOUT:
        raise InvalidArgument("TIMEOUT_INVALID", f"timeout must be in (0, 3600] s, got {timeout.total_seconds():g}")
    return GroupRecord(request.group_id, request.world_size, request.rank_offset, request.backend, timeout,
                       request.store_host, request.store_port, trainer_ranks=trainers)


def check_begin(begin: pb.BeginUpdate, offered: list[int]) -> None:
    """Transport, mode and version of a BeginUpdate, before anything else is looked at."""
    if begin.transport == pb.TRANSPORT_UNSPECIFIED:
        raise InvalidArgument("TRANSPORT_UNSPECIFIED", "transport is required (TRANSPORT_COLLECTIVE, INLINE or SHM)")
    if begin.transport not in pb.Transport.values():
        raise InvalidArgument("TRANSPORT_UNKNOWN", f"unknown transport number {begin.transport}", transport=begin.transport)
    if begin.transport not in offered:
        raise Unimplemented("TRANSPORT_UNAVAILABLE", f"transport {pb.Transport.Name(begin.transport)} is not "
                            "offered by this server (see GetServerInfo.transports)", transport=begin.transport)
    if begin.mode == pb.UPDATE_MODE_UNSPECIFIED:
        raise InvalidArgument("MODE_UNSPECIFIED", "mode is required (UPDATE_MODE_IN_PLACE or UPDATE_MODE_STAGED)")
    if begin.mode not in (pb.UPDATE_MODE_IN_PLACE, pb.UPDATE_MODE_STAGED):
        raise InvalidArgument("MODE_UNKNOWN", f"unknown mode number {begin.mode}", mode=begin.mode)
    if not begin.version or len(begin.version.encode()) > MAX_VERSION_BYTES:
        raise InvalidArgument("VERSION_INVALID", f"version must be 1 to {MAX_VERSION_BYTES} bytes")


def plan_for(begin: pb.BeginUpdate, plans: ValidatedPlans, limits: PlanLimits,
             ingress_slot_bytes: int) -> tuple[tensor_pb2.WeightPlan, str, PlanSummary]:
    """The update's plan (sent, or held under its content id), validated, and its id."""
    has_plan = begin.HasField("plan")
    if has_plan and begin.plan_id:
        raise InvalidArgument("PLAN_AND_PLAN_ID", "set either plan or plan_id, not both")
    if has_plan:
        plan = begin.plan
        summary = validate_plan(plan, limits)
        plan_id = plan_id_of(plan)
    elif begin.plan_id:
        cached = plans.get(begin.plan_id)
        if cached is None:
            raise NotFound("PLAN_NOT_FOUND", f"plan {begin.plan_id!r} is not held here; send the full plan",
                           plan_id=begin.plan_id[:64])
        plan, summary = cached  # validated when it was first sent; its id is its content
        plan_id = begin.plan_id
    else:
        raise InvalidArgument("PLAN_MISSING", "begin needs a plan or a plan_id")
    if begin.transport == pb.TRANSPORT_SHM and summary.max_bucket_bytes > ingress_slot_bytes:
        index = next(i for i, b in enumerate(plan.buckets) if b.size_bytes > ingress_slot_bytes)
        raise InvalidArgument(
            "BUCKET_TOO_LARGE_FOR_INGRESS",
            f"bucket {index} is {plan.buckets[index].size_bytes} bytes; SHM carries buckets of at most "
            f"{ingress_slot_bytes} bytes (GetServerInfo.limits.ingress_slot_bytes): plan smaller buckets",
            bucket=index, size_bytes=plan.buckets[index].size_bytes, limit=ingress_slot_bytes,
        )
    return plan, plan_id, summary


def require_base(begin: pb.BeginUpdate, summary: PlanSummary, version: PublishedVersion, store_state: int) -> None:
    """Patches apply to one committed generation of one store: the one this server holds, whole, or none."""
    if summary.patch_count and begin.base_generation < 1:
        raise InvalidArgument("BASE_GENERATION_MISSING", f"the plan sends {summary.patch_count} tensors as patches "
                              "but names no base_generation (the committed generation they apply to)",
                              patched_tensors=summary.patch_count)
    if begin.base_generation < 0:
        raise InvalidArgument("BASE_GENERATION_MISSING", f"base_generation {begin.base_generation} is negative")
    if begin.base_store_epoch < 0:  # no store has one (epochs are positive): a malformed field, not a mismatch
        raise InvalidArgument("BASE_EPOCH_INVALID", f"base_store_epoch {begin.base_store_epoch} is negative: send the "
                              "positive store_epoch the base was committed in (WeightVersion.store_epoch)",
                              base_store_epoch=begin.base_store_epoch)
    if begin.base_generation and begin.base_store_epoch <= 0:
        raise InvalidArgument("BASE_EPOCH_MISSING", "base_generation needs base_store_epoch (the store_epoch the "
                              "base was committed in: WeightVersion.store_epoch)")
    if begin.base_generation and begin.base_store_epoch != version.store_epoch:
        raise FailedPrecondition(
            "BASE_MISMATCH",
            f"the update applies to generation {begin.base_generation} of store epoch {begin.base_store_epoch}; this "
            f"server's store has epoch {version.store_epoch} (it restarted since): send it dense",
            base_generation=begin.base_generation, base_store_epoch=begin.base_store_epoch,
            store_epoch=version.store_epoch, current_generation=version.generation,
        )
    if begin.base_generation and (begin.base_generation != version.generation
                                  or store_state != pb.STORE_STATE_CONSISTENT):
        raise FailedPrecondition(
            "BASE_MISMATCH",
            f"the update applies to generation {begin.base_generation}; this store holds generation "
            f"{version.generation} ({pb.StoreState.Name(store_state)}): send it dense",
            base_generation=begin.base_generation, current_generation=version.generation,
            store_state=pb.StoreState.Name(store_state), base_store_epoch=begin.base_store_epoch,
            store_epoch=version.store_epoch,
        )


def group_for(begin: pb.BeginUpdate, groups: GroupRegistry) -> GroupRecord | None:
    """COLLECTIVE: the READY group that carries the buckets. INLINE/SHM: none."""
    if begin.transport != pb.TRANSPORT_COLLECTIVE:
        if begin.group_id:
            raise InvalidArgument("GROUP_ID_UNEXPECTED", f"{pb.Transport.Name(begin.transport)} needs no transfer "
                                  "group: leave group_id empty", group_id=begin.group_id[:128])
        return None
    group = groups.get(begin.group_id)
    if group is None:
        raise NotFound("GROUP_NOT_FOUND", f"no group {begin.group_id!r}", group_id=begin.group_id[:128])
    if group.state == pb.GROUP_STATE_BROKEN:
        raise FailedPrecondition(
            "GROUP_BROKEN", f"group {group.group_id!r} is broken ({group.broken_reason}); delete and recreate it",
            group_id=group.group_id,
        )
    if group.state != pb.GROUP_STATE_READY:
        raise FailedPrecondition("GROUP_NOT_READY", f"group {group.group_id!r} is still joining", group_id=group.group_id)
    return group
