"""One push of this process's part (WeightSyncClient(part=...)): checked, agreed, planned, run.

  1. check: the transport (INLINE, or SHM on the server's host: the servers run parts over those), the tensors,
     what this part declares of each (part.declare), and every server's GetServerInfo.parts;
  2. agree (Part.group set): one all-gather: every rank learns rank 0's update key, or every rank
     raises PartInputsRefused naming the ranks whose checks failed (agreement.py). Without a
     group, the caller's part_key is the key and a failed check raises as it is, on this rank only;
  3. plan: the declared tensors as a dense plan would plan them (the boxes as their local shards'
     contiguous bytes: a box larger than a bucket travels as pieces, counted in the box's bytes), or,
     with delta, the patched plan of them (below); the plan sent is the same with each boxed spec's
     shape the whole tensor's and its TensorSpec.box (a patch of a box: its positions row-major in the
     box, its checksum the box's once patched);
  4. run: one stream per server with BeginUpdate.part, Ready once every part joined (bounded by the
     client's timeout plus the join timeout), the buckets, Commit; every part gets the same
     `committed`, one generation per server. A failure is PartUpdateFailed naming this part, and the
     part the server named (PART_FAILED) or the ranks that never came (PARTS_MISSING).

Delta per part (push(delta=...), "auto" by default, as for a whole update: client/delta/base.py). Each part
keeps the copy of its own whole tensors and boxes (PartPushContext.delta: this process's; a box as its local
shard, under the tensor's name) and compares them with it, as push() compares a whole update's:
unchanged ones are left out of its plan (still declared), sparse changes go as patches (of a box: the
local shard's patch, which the server maps into the whole tensor), and the choice between a patched
plan and a dense one is this part's alone (its own bytes). Nothing is compared while the bytes travel
(a deferred bucket takes no box: BOX_PATCH_UNAVAILABLE). Patches go only when every server holds the
last commit (one plan per part to all of them). The base is the update's, not the part's: every part names, to each server, the
generation that server committed last (BeginUpdate.base_generation/base_store_epoch, from its record),
whether it sends patches or not; every commit gives every part the same generation, so the parts name
the same base (the server requires it: PART_MISMATCH). A server that refuses the base at Begin
(BASE_MISMATCH: restarted, or its store moved on) refuses it to every part, each hearing it as its own
refusal or as PART_FAILED with part_reason BASE_MISMATCH (part.base_refused); each part then sends the
whole version dense, naming no base, to every server, under part.dense_key(key), which every part
derives alone: no collective. (A part reads the failure of the first server, in the client's order,
that failed its Begin: give every rank its servers in one order.) A part whose push fails, for any reason, forgets every server's
generation (the next push names no base: the parts that failed agree again); the copy is taken again
from the tensors pushed. A part's dense push into stores that held its last commit is timed for auto's
thresholds by what each node measured of the whole update (UpdateCommitted: every part's bytes over
the seconds from Begin to commit, the slowest node's: LinkTimings.node_timed), not by the part's own
bytes, which understate the link by the number of parts; until then the transport's assumed rate holds.

Nothing here is a collective once the push starts: the ranks do not wait for each other inside a
push except through the servers, so a rank that fails mid-way fails the others through them. The
plan is sent in full each push.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from weightsync.client.buckets.packing import TensorSource
from weightsync.client.buckets.plan_cache import CachedPlan
from weightsync.client.buckets.planning import PlannedBucket, build_plan, check_tensors, plan_proto
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.server_set import ServerSet
from weightsync.client.delta.base import Delta, DeltaBase
from weightsync.client.delta.link_timings import LinkTimings
from weightsync.client.errors import PartsUnavailable, PartUpdateFailed, UpdateFailed
from weightsync.client.parts.agreement import agree
from weightsync.client.parts.part import (
    Declared,
    Part,
    base_refused,
    check_key,
    declare,
    dense_key,
    draw_key,
)
from weightsync.client.push.job import PushJob, Ran, push_result
from weightsync.client.push.patched import PatchedPlan, plan_patches
from weightsync.client.push.plans import PlanChoice
from weightsync.client.servers.fleet import Fleet
from weightsync.client.servers.records import ServerState
from weightsync.client.transports.base import Sink
from weightsync.client.transports.transfer_group import TransferGroup
from weightsync.client.types import PushProgress, PushResult, StoreGeneration
from weightsync.common.logging import get_logger
from weightsync.common.plan_id import plan_id_of

log = get_logger("weightsync.client")


@dataclass(frozen=True, slots=True)
class PartPushContext:
    """What a part's push uses of its client (WeightSyncClient hands it over, its lock held): the records
    of the servers, the kept copy, the link timings, the loop, the channels, the parts' group, and the
    client's choice of sink for a transport (its checks: a transport the servers do not offer)."""

    fleet: Fleet
    delta: DeltaBase
    links: LinkTimings
    loop: LoopThread
    servers: ServerSet
    group: TransferGroup | None
    """The parts' transfer group (create_group() on every rank); None before it."""
    sink_for: Callable[[str], Sink]


def push_part(context: PartPushContext, part: Part,
              named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, version: str,
              mode: int, transport: str, part_key: str | None, bucket_size_bytes: int, allow_new_tensors: bool,
              checksums: bool | None, zero_copy_min_bytes: int, progress: Callable[[PushProgress], None] | None,
              show_progress: bool | None, delta: Delta = "auto") -> PushResult:
    """push() with a part (module docstring); the client's lock is held. delta: as push()'s, for this
    part's whole tensors and boxes."""
    started = time.perf_counter()
    key = ""
    failure: Exception | None = None
    declared: list[Declared] = []
    sink: Sink | None = None
    try:
        if delta not in ("auto", True, False):
            raise ValueError(f"delta must be 'auto', True or False, got {delta!r}")
        if part.group is None and part_key is None:
            raise ValueError("a part without a group needs push(part_key=...): the same key on every rank, "
                             "new for each push (e.g. the version and a suffix all ranks share)")
        if part_key is not None:
            key = check_key(part_key)
        elif part.rank == 0:
            key = draw_key(version)
        declared, sink = _checked(context, named_tensors, transport)
    except Exception as error:  # every rank's failure, whatever it is, fails every rank through agree()
        if part.group is None:
            raise
        failure = error
    if part.group is not None:
        key = agree(part, key, failure)  # PartInputsRefused on every rank if any failed
    assert sink is not None
    sizes = dict(bucket_size_bytes=bucket_size_bytes, zero_copy_min_bytes=zero_copy_min_bytes)
    items = _compared(context, named_tensors, declared, delta, transport)
    boxes = [d.name for d in declared if d.box is not None]
    states = context.fleet.answered()
    # The update's base, named alike by every part (their records agree: each commit gives them all one
    # generation per server), whether this part sends patches or not.
    bases = {s.address: s.generation for s in states if s.generation is not None}
    # boxes=[]: the boxes are among the items (compared, kept, patched as the whole tensors are), and a
    # part defers no comparison (a deferred bucket takes no box).
    patched = plan_patches(context.delta, items, delta, servers=states, link=context.links.bytes_per_second(transport),
                           collective=True, boxes=[], **sizes) if items is not None else None
    group = context.group if transport == "collective" else None  # the parts' group (create_group on every rank)
    job = PushJob(loop=context.loop, servers=context.servers, group=group, sink=sink, delta=context.delta,
                  version=version, mode=mode, allow_new_tensors=allow_new_tensors, checksums=checksums,
                  progress=progress, show_progress=show_progress, started=started)
    log.info("part_push", version=version, update_key=key, rank=part.rank, world=part.world,
             whole=len(declared) - len(boxes), boxes=len(boxes), patches=len(patched.delta.patches) if patched else 0,
             base=bool(bases))
    choice = (_boxed(patched.choice.planned, patched.choice.source, declared) if patched is not None
              else _plan(declared, **sizes))
    try:
        ran = _run(context, job, part, key, declared, choice, bases, items, patched)
    except BaseException as error:
        _forget_bases(states)
        if not isinstance(error, UpdateFailed):
            raise
        if not bases or not base_refused(error.reason, getattr(error.cause, "metadata", {}) or {}):
            raise _named(error, part, key) from error
        # A server refused the base at Begin (restarted, or its store moved on): every part hears it from
        # that server and retries, the whole version dense, under the key they all derive from this one.
        retry = dense_key(key)
        log.info("part_base_refused_sending_dense", server=error.server, update_key=key, retry_key=retry,
                 rank=part.rank)
        context.delta.base_refused()
        patched, key, bases = None, retry, {}  # no base: a store that moved on, or restarted (allocating)
        try:
            ran = _run(context, job, part, key, declared, _plan(declared, **sizes), {}, items, None)
        except UpdateFailed as again:
            raise _named(again, part, key) from again
    for outcome in ran.outcomes:
        context.fleet.by_address(outcome.server).committed(None, outcome.committed)
    if items is not None:
        context.delta.committed(items, patched.delta if patched is not None else None)
    if patched is None and bases and len(bases) == len(states):
        # Dense into stores that held our last commit (no allocation timed): the nodes' figure of the whole
        # update, what auto's thresholds read next push (not this part's share over those seconds).
        context.links.node_timed(transport, ran.outcomes)
    return push_result([ran], version, started, dense_bytes=sum(d.tensor.numel() * d.tensor.element_size()
                                                                for d in declared))


def _forget_bases(states: list[ServerState]) -> None:
    """This part's push failed: every server's record forgets its generation, so the next push names no
    base. Every part whose push failed does the same, whatever failed it (its own error, or another part's
    through the servers), so their next bases agree; a part that committed while another lost the answer
    names a base the other does not, and that push fails once (PART_MISMATCH on every part) before they
    agree again."""
    for state in states:
        state.base_refused()  # the transition that forgets the generation


def _run(context: PartPushContext, job: PushJob, part: Part, key: str, declared: list[Declared], choice: PlanChoice,
         bases: dict[str, StoreGeneration], items: list[tuple[str, torch.Tensor]] | None,
         patched: PatchedPlan | None) -> Ran:
    """One run of this part's plan to every server under `key`, naming `bases`; the kept copy (items: None,
    none kept) refreshes while the bytes move, from Ready on for a patched plan (a refused base leaves
    it as the comparison made it)."""
    on_ready = None
    if patched is not None:
        delta = patched.delta

        def on_ready() -> None:
            context.delta.take_in_background(items, delta)  # type: ignore[arg-type]
    elif items is not None:
        context.delta.take_in_background(items, None)
    return job.run(choice, context.fleet.states, bases=bases, on_ready=on_ready, part=part.proto(key, declared),
                   ready_timeout=context.servers.timeout + part.join_timeout)


def _compared(context: PartPushContext, named_tensors: object, declared: list[Declared], delta: Delta,
              transport: str) -> list[tuple[str, torch.Tensor]] | None:
    """What this part sends, its whole tensors and its boxes (each as its local shard, contiguous, under the
    tensor's name), when this push compares them with the kept copy (as push() decides for a whole update:
    not with delta=False, an iterator, or auto where no patch pays); None, and no copy kept, otherwise, or
    when the part sends nothing."""
    mine = [(d.name, d.tensor) for d in declared]
    if (delta is False or not isinstance(named_tensors, Mapping | list | tuple) or not mine
            or (delta == "auto" and context.links.cannot_pay(mine, transport))):
        context.delta.drop()
        return None
    return mine


def _checked(context: PartPushContext, named_tensors, transport: str) -> tuple[list[Declared], Sink]:
    """This rank's own checks, before any byte moves: what it declares, and the sink its bytes go to."""
    if transport not in PART_TRANSPORTS:
        raise PartsUnavailable(f"a part is pushed over INLINE, SHM from the server's host, or COLLECTIVE over a "
                               f"group of every part (create_group() on each rank), not {transport!r}")
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    check_tensors(items)
    declared = declare(items)
    check_tensors([(d.name, d.tensor) for d in declared])
    context.fleet.ask_again_if_stale()
    for address, info in zip(context.servers.addresses, context.fleet.infos(), strict=True):
        if not runs_parts(info):
            raise PartsUnavailable(f"{address} does not run updates sent in parts (GetServerInfo.parts is false): "
                                   "upgrade it, or push the whole update from one process")
    return declared, context.sink_for(transport)


PART_TRANSPORTS = ("inline", "shm", "collective")
"""What a part is pushed over: INLINE (one stream per part per server), SHM (parts on the server's host,
each writing its own share of the ingress slots: UpdateReady.ingress_slot_first/_count), or COLLECTIVE (a group
holding every part's rank, from create_group() on each: each bucket point-to-point to its owners)."""


def runs_parts(info) -> bool:
    """Whether a server runs updates sent in parts (GetServerInfo.parts)."""
    return info.parts


def _plan(declared: list[Declared], bucket_size_bytes: int, zero_copy_min_bytes: int) -> PlanChoice:
    """The dense plan: the buckets over the declared bytes (a box as its local shard), each boxed spec sent
    with the whole tensor's shape and its box (_boxed)."""
    local = [(d.name, d.tensor) for d in declared]
    planned = build_plan(local, bucket_size_bytes, zero_copy_min_bytes) if local else []
    return _boxed(planned, TensorSource(dict(local), None), declared)


def _boxed(planned: list[PlannedBucket], source: TensorSource, declared: list[Declared]) -> PlanChoice:
    """The plan sent of these buckets (a dense or a patched plan's): each boxed spec with the whole tensor's
    shape and its box (pieces count in the box's bytes as planned), and its id."""
    plan = plan_proto(planned)  # copies of the specs: the planned ones keep the local shapes for packing
    boxed = {d.name: d for d in declared if d.box is not None}
    for bucket in plan.buckets:
        for spec in bucket.tensors:
            d = boxed.get(spec.name)
            if d is not None:
                del spec.shape[:]
                spec.shape.extend(d.shape)
                spec.box.CopyFrom(d.box.proto())  # type: ignore[union-attr]
    return PlanChoice(CachedPlan.of(planned, (), plan, plan_id_of(plan)), planned, source)


def _named(error: UpdateFailed, part: Part, key: str) -> PartUpdateFailed:
    """The failure as this part's: which other part the server blamed (metadata `part`: PART_FAILED, or the
    reason of a part refused before it joined), who never came (PARTS_MISSING's `missing`), who went silent
    (CLIENT_IDLE's `silent`). Lists end in "..." past 20 ranks (docs/data-plane.md)."""
    metadata = getattr(error.cause, "metadata", {}) or {}
    failed = metadata.get("part", "")
    failed_part = int(failed) if failed.isdigit() and int(failed) != part.rank else None
    missing = _ranks(metadata.get("missing", ""))
    silent = _ranks(metadata.get("silent", ""))
    blame = (f"; part {failed_part} failed" if failed_part is not None
             else f"; ranks {list(missing)} never joined" if missing
             else f"; parts {list(silent)} went silent" if silent else "")
    return PartUpdateFailed(f"part {part.rank} of {part.world} (update key {key!r}): {error}{blame}", error,
                            rank=part.rank, world=part.world, update_key=key, failed_part=failed_part,
                            missing=missing)


def _ranks(listed: str) -> tuple[int, ...]:
    """The ranks of a metadata list ("1,4,..."): its trailing "..." (more than it lists) dropped."""
    return tuple(int(r) for r in listed.split(",") if r.strip().isdigit())


__all__ = ["push_part"]
