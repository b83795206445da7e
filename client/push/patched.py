"""A push's patched run: which servers take patches, the plan of them, and what happens when a
server refuses the base or the patches do not fit.

    plan_patches   the servers holding this client's last commit (COLLECTIVE: all or none), the
                   choice per tensor (client/delta/base.py), the patched plan (client/push/plans.py);
                   on a slow link (delta.policy.defers_comparison), where every server takes
                   deferred buckets, the kept host tensors are compared while the buckets travel
                   (client/delta/deferred.py), from before Begin on
    send_patches   the run; a server that refuses the base at Begin gets the update dense and the
                   others the same patches (nothing is compared again); patches that outgrow their
                   deferred bucket send the whole update dense
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weightsync.client.delta.base import Delta, DeltaBase, DeltaChoice
from weightsync.client.delta.deferred import (
    DEFERRED_GROUPS,
    DeferredCompare,
    PatchesOverflow,
    deferred_groups,
)
from weightsync.client.delta.policy import auto_dense_above, defers_comparison
from weightsync.client.errors import UpdateFailed
from weightsync.client.push.job import PushJob, Ran
from weightsync.client.push.plans import PlanChoice, patched_plan
from weightsync.client.servers.records import ServerState
from weightsync.client.types import StoreGeneration
from weightsync.common.logging import get_logger
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")

MAX_PATCH_BUCKETS = 16
"""Patches are cut into at most this many buckets to share them out among a node's workers."""


@dataclass(slots=True)
class PatchedPlan:
    """The patched run of one push."""

    choice: PlanChoice
    delta: DeltaChoice
    targets: list[ServerState]
    bases: dict[str, StoreGeneration]
    """Server address -> the committed generation its patches apply to (read before the comparison
    advanced the kept copy)."""
    compare: DeferredCompare | None

    def stop(self) -> None:
        """The deferred comparison, if any, is over (it writes the kept copy)."""
        if self.compare is not None:
            self.compare.stop()


def plan_patches(delta: DeltaBase, items: list[tuple[str, torch.Tensor]], mode: Delta, *, servers: list[ServerState],
                 link: float, collective: bool, bucket_size_bytes: int, zero_copy_min_bytes: int,
                 boxes: list[tuple[str, torch.Tensor]] | None = None) -> PatchedPlan | None:
    """The patched plan, or None: all dense (no server holds our last commit, a new layout, nothing
    or too much changed). COLLECTIVE sends one plan to the whole group: patches only if every
    server can take them. link: the transport's dense bytes per second (LinkTimings). The deferred
    comparison, if any, is started here. boxes: tensors planned dense beside the items, never compared
    and no part of the choice between patches and dense (either sends them whole); the plan's box specs
    are the caller's to complete. Not None (a part, client/parts/push.py, which passes its boxes among the items
    and [] here): nothing is deferred (a deferred bucket takes no box). None: no part, deferring allowed."""
    targets = patch_targets(servers, claims=delta.claims, collective=collective)
    if not targets:
        return None
    if not delta.same_layout(items):
        return None
    # Read before choose(): the comparison may advance the copy, which then claims nothing until committed.
    bases = {s.address: s.generation for s in targets if s.generation is not None}
    defer = boxes is None and defers_comparison(link) and all(_info(s).deferred_buckets for s in targets)
    choice = delta.choose(items, link=link, auto=mode == "auto", defer=defer)
    choice.keep_patches_within(bucket_size_bytes)
    if not choice.patches and not choice.deferred and (not choice.unchanged or len(choice.unchanged) == len(items)):
        # Every tensor changed too much, or nothing changed at all: the plain dense push, whose
        # plan may be reused (a version re-pushed as it is).
        return None
    dense_above = auto_dense_above(link)
    if mode == "auto" and choice.sent_bytes(items) > dense_above * sum(t.numel() * t.element_size() for _, t in items):
        delta.went_dense(items)
        return None  # patches would not pay
    workers = workers_per_node(targets)
    compare = None
    if choice.deferred:
        groups = deferred_groups(choice, groups=max(DEFERRED_GROUPS, workers), bucket_size_bytes=bucket_size_bytes)
        compare = DeferredCompare(delta, choice, groups)
    plan = patched_plan([*items, *(boxes or [])], choice, bucket_size_bytes=bucket_size_bytes,
                        zero_copy_min_bytes=zero_copy_min_bytes,
                        patch_buckets=workers, deferred=compare)
    if compare is not None:
        compare.start()  # while Begin goes out and the servers get ready
    return PatchedPlan(plan, choice, targets, bases, compare)


def patch_targets(servers: list[ServerState], *, claims: bool, collective: bool) -> list[ServerState]:
    """The servers that may take patches: those whose store is where this client's last commit left
    it, while the kept copy is that commit (claims); COLLECTIVE sends one plan to the whole group,
    so all of them or none."""
    targets = [s for s in servers if claims and s.generation is not None]
    return [] if collective and len(targets) != len(servers) else targets


def workers_per_node(servers: list[ServerState]) -> int:
    """How many buckets give every worker of every one of these servers an equal share: the least
    common multiple of their worker counts (their largest, past MAX_PATCH_BUCKETS)."""
    counts = {max(1, len(_info(s).workers)) for s in servers}
    common = math.lcm(*counts)
    return common if common <= MAX_PATCH_BUCKETS else max(counts)


def _info(server: ServerState) -> pb.GetServerInfoResponse:
    assert server.info is not None, "push() asks every server for its info before it plans"
    return server.info


def send_patches(patched: PatchedPlan, delta: DeltaBase, items: list[tuple[str, torch.Tensor]], job: PushJob,
                 *, collective: bool) -> tuple[list[Ran], list[ServerState]]:
    """Run the patched plan; returns the runs and the servers that took the patches (the others get
    the update dense)."""
    targets = list(patched.targets)
    while targets:
        # Once no server refused the base, the copy takes the rest of the push while it moves and the
        # servers check and apply it (it claims nothing until committed(); a failure from
        # here on makes the next push dense).
        taking: list[bool] = []

        def on_ready(taking: list[bool] = taking) -> None:
            taking.append(True)
            delta.take_in_background(items, patched.delta)

        try:
            return [job.run(patched.choice, targets, bases=patched.bases, on_ready=on_ready)], targets
        except PatchesOverflow as error:
            log.info("patches_overflow_sending_dense", error=str(error))
            return [], []
        except UpdateFailed as error:
            if error.reason != "BASE_MISMATCH":
                raise
            # Refused at Begin, before any byte moved, everywhere: that server gets it dense, the
            # others the same patches (the comparison is not run again: the copy holds the new
            # tensors already). COLLECTIVE sends one plan to the whole group: all of it dense.
            # (Only Begin refuses a base, so the copy has taken nothing from the servers' answers.)
            log.info("base_mismatch_sending_dense", server=error.server)
            delta.base_refused()
            for server in targets:
                if server.address == error.server:
                    server.base_refused()
            refused = collective or bool(taking)
            targets = [] if refused else [s for s in targets if s.address != error.server]
    return [], []
