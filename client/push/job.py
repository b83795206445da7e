"""One push's runs: the settings they share, running one plan to some servers, and the result.

A push is one run (dense), or a patched run to the servers that hold this client's last commit
and a dense run to the others (client/push/patched.py), or a patched run that falls back to a
dense one. PushJob holds what every run of one push shares and runs one plan to the servers it is
given (PushRun, run.py). A run that fails is learnt from here, for every path alike: the group
is marked broken when a transfer broke it, the kept copy claims nothing (unless a server only
refused its base), and the run's servers go stale (what they said of themselves may be a
restarted server's).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from weightsync.client.buckets.packing import is_zero_copy
from weightsync.client.channels.loop import LoopThread
from weightsync.client.channels.server_set import ServerSet
from weightsync.client.delta.base import DeltaBase
from weightsync.client.errors import UpdateFailed
from weightsync.client.push.plans import PlanChoice
from weightsync.client.push.run import PushRun
from weightsync.client.servers.records import ServerState
from weightsync.client.transports.base import Sink
from weightsync.client.transports.transfer_group import TransferGroup
from weightsync.client.types import PushProgress, PushResult, ServerOutcome, StoreGeneration
from weightsync.common.collective import CollectiveError
from weightsync.common.logging import get_logger
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.client")

PROGRESS_BAR_MIN_BYTES = 256 << 20
COMMIT_GRACE_SECONDS = 30
"""Committed is waited for this long past the group's timeout (or the client's, with no group)."""


@dataclass(frozen=True, slots=True)
class Ran:
    """One run that committed: its plan, the run, and each of its servers' outcome."""

    choice: PlanChoice
    run: PushRun
    outcomes: list[ServerOutcome]


@dataclass(slots=True)
class PushJob:
    """What every run of one push shares."""

    loop: LoopThread
    servers: ServerSet
    """The client's channels: their metadata and RPC timeout."""
    group: TransferGroup | None
    """COLLECTIVE's group; None for INLINE and SHM."""
    sink: Sink
    delta: DeltaBase
    version: str
    mode: int
    """pb.UpdateMode."""
    allow_new_tensors: bool
    checksums: bool | None
    progress: Callable[[PushProgress], None] | None
    show_progress: bool | None
    started: float
    """time.perf_counter() when push() was called."""

    def run(self, choice: PlanChoice, targets: list[ServerState], *, bases: dict[str, StoreGeneration] | None = None,
            on_ready: Callable[[], None] | None = None, part: pb.UpdatePart | None = None,
            ready_timeout: float = 0.0) -> Ran:
        """Run `choice` to `targets` (bases: server address -> the generation its patches apply to;
        on_ready: called once every target took Begin; part: BeginUpdate.part, with ready_timeout
        bounding Ready: the other parts may join later. Committed's bound is a whole push's: it counts from the
        server's last message, and a part that finished hears PartsWaiting while the others send). Raises UpdateFailed as PushRun.run does,
        once the failure is learnt (module docstring)."""
        _prepare_buffers(self.sink, choice)
        if self.sink.frames is not None:
            self.sink.frames.new_run()
        bar = _progress_bar(choice.total_bytes, self.version, self.show_progress)
        group = self.group
        run = PushRun(
            loop=self.loop, servers=targets, metadata=self.servers.metadata, rpc_timeout=self.servers.timeout,
            commit_timeout=(group.timeout.total_seconds() if group else self.servers.timeout) + COMMIT_GRACE_SECONDS,
            group_id=group.group_id if group else "", sink=self.sink, planned=choice.planned,
            plan=choice.cached.plan, plan_id=choice.cached.plan_id, source=choice.source, version=self.version,
            mode=self.mode, allow_new_tensors=self.allow_new_tensors, checksums=self.checksums,
            progress=self.progress, bar=bar, started=self.started, bases=bases or {}, on_ready=on_ready,
            part=part, ready_timeout=ready_timeout,
        )
        try:
            outcomes = run.run()
        except BaseException as error:
            self._failed(error, targets)
            raise
        finally:
            if bar is not None:
                bar.close()
        return Ran(choice, run, outcomes)

    def _failed(self, error: BaseException, targets: list[ServerState]) -> None:
        if self.group is not None and (self.sink.broken or _broke_the_group(error)):
            # Unusable now, on every rank: abort its communicator at once (bounded), so nothing of it is
            # left for torch to act on later (NCCL's watchdog and monitor: common/nccl_env.py).
            self.group.broken = True
            self.group.collective.close()
        if getattr(error, "reason", "") != "BASE_MISMATCH":
            self.delta.forget()  # whatever the servers hold now, the next push re-establishes it densely
        # What the servers said of themselves (chunk size, worker counts, deferred buckets) and the SHM
        # ingress may be those of a server that restarted since: the next push asks and maps again.
        for server in targets:
            server.went_stale()


def push_result(runs: list[Ran], version: str, started: float, *, dense_bytes: int,
                compressed: tuple[int, int] = (0, 0)) -> PushResult:
    """The PushResult of a push whose runs all committed (compressed: the frames' bytes and what they saved)."""
    seconds = time.perf_counter() - started
    sent = sum(r.run.sent_bytes for r in runs)  # a deferred bucket's layout, not its room
    result = PushResult(
        version=version,
        tensor_count=max(len({t.name for b in r.choice.planned for t in b.spec.tensors}) for r in runs),
        bucket_count=sum(len(r.choice.planned) for r in runs),
        size_bytes=sent,
        seconds=seconds,
        plan_reused=all(r.run.plan_reused for r in runs),
        zero_copy_buckets=sum(r.run.zero_copy_buckets for r in runs),
        servers=tuple(o for r in runs for o in r.outcomes),
        bytes_sent=sent - compressed[1],
        dense_bytes=dense_bytes or sent,
        compressed_bytes=compressed[0],
    )
    log.info("push_committed", version=version, bytes=sent, dense_bytes=result.dense_bytes,
             seconds=round(seconds, 3), gbps=round(result.gigabytes_per_second, 3), buckets=result.bucket_count)
    return result


def _broke_the_group(error: BaseException) -> bool:
    """Whether a failed push broke its transfer group (a broadcast failed or timed out, on any rank)."""
    return getattr(error, "reason", "") in ("COLLECTIVE_TIMEOUT", "COLLECTIVE_FAILED") or isinstance(
        error.cause if isinstance(error, UpdateFailed) else None, CollectiveError)


def _prepare_buffers(sink: Sink, choice: PlanChoice) -> None:
    """Grow our pack buffers to the plan's largest packed bucket (SHM packs into the server's slots)."""
    buffers = sink.buffers
    if sink.transport != pb.TRANSPORT_SHM:
        buffers.ensure(max((b.spec.size_bytes for b in choice.planned if not is_zero_copy(buffers, b)), default=0))
    buffers.use_plan(choice.cached.plan_id)


def _progress_bar(total: int, version: str, show: bool | None):
    if show is None:
        show = sys.stderr.isatty() and total >= PROGRESS_BAR_MIN_BYTES
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"push {version}", leave=False)
