"""One push of this process's part (WeightSyncClient(part=...)): checked, agreed, planned, run.

  1. check: the transport (INLINE, or SHM on the server's host: the servers run parts over those), the tensors,
     what this part declares of each (parts.declare), and every server's GetServerInfo.parts;
  2. agree (Part.group set): one all-gather: every rank learns rank 0's update key, or every rank
     raises PartInputsRefused naming the ranks whose checks failed (part_agreement.py). Without a
     group, the caller's part_key is the key and a failed check raises as it is, on this rank only;
  3. plan: the declared tensors as a dense plan would plan them (the boxes as their local shards'
     contiguous bytes: a box larger than a bucket travels as pieces, counted in the box's bytes);
     the plan sent is the same with each boxed spec's shape the whole tensor's and its TensorSpec.box;
  4. run: one stream per server with BeginUpdate.part, Ready once every part joined (bounded by the
     client's timeout plus the join timeout), the buckets, Commit; every part gets the same
     `committed`, one generation per server. A failure is PartUpdateFailed naming this part, and the
     part the server named (PART_FAILED) or the ranks that never came (PARTS_MISSING).

Dense always: delta is off with a part (no copy is kept), and the plan is sent in full each push.
Nothing here is a collective once the push starts: the ranks do not wait for each other inside a
push except through the servers, so a rank that fails mid-way fails the others through them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from weightsync.client.errors import PartsUnavailable, PartUpdateFailed, UpdateFailed
from weightsync.client.packing import TensorSource
from weightsync.client.part_agreement import agree
from weightsync.client.parts import Declared, Part, check_key, declare, draw_key
from weightsync.client.plan_cache import CachedPlan
from weightsync.client.plan_choice import PlanChoice
from weightsync.client.planning import build_plan, check_tensors, plan_proto
from weightsync.client.push_job import PushJob, push_result
from weightsync.client.sinks import Sink
from weightsync.client.types import PushProgress, PushResult
from weightsync.common.logging import get_logger
from weightsync.common.plan_id import plan_id_of

if TYPE_CHECKING:
    from weightsync.client.sdk import WeightSyncClient

log = get_logger("weightsync.client")


def push_part(client: WeightSyncClient, part: Part,
              named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, version: str,
              mode: int, transport: str, part_key: str | None, bucket_size_bytes: int, allow_new_tensors: bool,
              checksums: bool | None, zero_copy_min_bytes: int, progress: Callable[[PushProgress], None] | None,
              show_progress: bool | None) -> PushResult:
    """push() with a part (module docstring); the client's lock is held."""
    started = time.perf_counter()
    client._delta.drop()  # dense with a part: nothing to compare against, no copy kept
    key = ""
    failure: Exception | None = None
    declared: list[Declared] = []
    sink: Sink | None = None
    try:
        if part.group is None and part_key is None:
            raise ValueError("a part without a group needs push(part_key=...): the same key on every rank, "
                             "new for each push (e.g. the version and a suffix all ranks share)")
        if part_key is not None:
            key = check_key(part_key)
        elif part.rank == 0:
            key = draw_key(version)
        declared, sink = _checked(client, named_tensors, transport)
    except Exception as error:  # every rank's failure, whatever it is, fails every rank through agree()
        if part.group is None:
            raise
        failure = error
    if part.group is not None:
        key = agree(part, key, failure)  # PartInputsRefused on every rank if any failed
    assert sink is not None
    choice = _plan(declared, bucket_size_bytes, zero_copy_min_bytes)
    job = PushJob(loop=client._loop, servers=client._servers, group=None, sink=sink, delta=client._delta,
                  version=version, mode=mode, allow_new_tensors=allow_new_tensors, checksums=checksums,
                  progress=progress, show_progress=show_progress, started=started)
    log.info("part_push", version=version, update_key=key, rank=part.rank, world=part.world,
             whole=sum(d.box is None for d in declared), boxes=sum(d.box is not None for d in declared))
    try:
        ran = job.run(choice, client._fleet.states, part=part.proto(key, declared),
                      ready_timeout=client._servers.timeout + part.join_timeout)
    except UpdateFailed as error:
        raise _named(error, part, key) from error
    for outcome in ran.outcomes:
        client._fleet.by_address(outcome.server).committed(None, outcome.committed)
    return push_result([ran], version, started, dense_bytes=0)


def _checked(client: WeightSyncClient, named_tensors, transport: str) -> tuple[list[Declared], Sink]:
    """This rank's own checks, before any byte moves: what it declares, and the sink its bytes go to."""
    if transport not in PART_TRANSPORTS:
        raise PartsUnavailable(f"a part is pushed over INLINE, or SHM from the server's host (servers run parts "
                               f"over those two for now), not {transport!r}: push(..., transport='inline')")
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    check_tensors(items)
    declared = declare(items)
    check_tensors([(d.name, d.tensor) for d in declared])
    client._fleet.ask_again_if_stale()
    for address, info in zip(client._servers.addresses, client._fleet.infos(), strict=True):
        if not runs_parts(info):
            raise PartsUnavailable(f"{address} does not run updates sent in parts (GetServerInfo.parts is false): "
                                   "upgrade it, or push the whole update from one process")
    return declared, client._sink(transport)[1]


PART_TRANSPORTS = ("inline", "shm")
"""What a part is pushed over: INLINE (one stream per part per server), or SHM (parts on the server's host,
each writing its own share of the ingress slots: UpdateReady.ingress_slot_first/_count)."""


def runs_parts(info) -> bool:
    """Whether a server runs updates sent in parts (GetServerInfo.parts)."""
    return info.parts


def _plan(declared: list[Declared], bucket_size_bytes: int, zero_copy_min_bytes: int) -> PlanChoice:
    """The buckets over the declared bytes (a box as its local shard), and the plan sent: the same, each
    boxed spec with the whole tensor's shape and its box (pieces count in the box's bytes as planned)."""
    local = [(d.name, d.tensor) for d in declared]
    planned = build_plan(local, bucket_size_bytes, zero_copy_min_bytes) if local else []
    plan = plan_proto(planned)  # copies of the specs: the planned ones keep the local shapes for packing
    boxed = {d.name: d for d in declared if d.box is not None}
    for bucket in plan.buckets:
        for spec in bucket.tensors:
            d = boxed.get(spec.name)
            if d is not None:
                del spec.shape[:]
                spec.shape.extend(d.shape)
                spec.box.CopyFrom(d.box.proto())  # type: ignore[union-attr]
    plan_id = plan_id_of(plan)
    return PlanChoice(CachedPlan.of(planned, (), plan, plan_id), planned, TensorSource(dict(local), None))


def _named(error: UpdateFailed, part: Part, key: str) -> PartUpdateFailed:
    """The failure as this part's: which part the server blamed (PART_FAILED), who never came (PARTS_MISSING)."""
    metadata = getattr(error.cause, "metadata", {}) or {}
    failed = metadata.get("part")
    missing = tuple(int(r) for r in metadata.get("missing", "").split(",") if r.strip().isdigit())
    blame = (f"; part {failed} failed" if failed is not None and error.reason == "PART_FAILED"
             else f"; ranks {list(missing)} never joined" if missing else "")
    return PartUpdateFailed(f"part {part.rank} of {part.world} (update key {key!r}): {error}{blame}", error,
                            rank=part.rank, world=part.world, update_key=key,
                            failed_part=int(failed) if failed is not None and failed.isdigit() else None,
                            missing=missing)


__all__ = ["push_part"]
