"""Driver mode's rollout side: waiting, bounded, until the node's engine serves a version.

With `receive: served` the node's weightsync server drives the inference engine itself (--engine
vllm-http=URL / sglang-http=URL: server/engines/driver.py) after each commit; verl's rollout worker
only waits until that engine serves the step the actor ranks pushed. It watches the node's
WatchWeights stream (the current state at once, then every change in order: a commit, the engine
starting to apply, the engine serving or failing) and decides on each event (`ServedWatch.see`),
going by the commit this sync made (its generation in the node's store, from the senders'
outcomes), never by the step label:

- the engine serves that generation (SERVING): done;
- the engine failed (FAILED) after it started applying (APPLYING) once the node held it:
  ENGINE_FAILED, with the engine's last_error. A FAILED state seen before that belongs to an older
  version the driver has not retried yet (the driver applies a new commit at once);
- the node moved past that generation, or its store is not one the sync committed to (its server
  restarted since): VERSION_GONE.

No verl import here: the decisions are pure functions over the protos.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.integrations.verl.errors import WeightSyncVerlError
from weightsync.v1 import weight_sync_service_pb2 as pb

LOCAL_KIND = "local"
"""EngineStatus.kind of an engine that attached to the local socket itself (not driven by the server)."""


def pick_engine(engines: list[pb.EngineStatus], name: str | None, node: str) -> pb.EngineStatus:
    """The engine the rollout waits for: the one called `name`, else the node's only driven engine.
    ENGINE_NOT_FOUND saying what the node has and what to start."""
    if name is not None:
        for engine in engines:
            if engine.name == name:
                return engine
        raise WeightSyncVerlError("ENGINE_NOT_FOUND", f"the weightsync server {node} has no engine named {name!r} "
                                  f"(it has {', '.join(repr(e.name) for e in engines) or 'none'})")
    driven = [e for e in engines if e.kind != LOCAL_KIND]
    if len(driven) == 1:
        return driven[0]
    if not driven:
        raise WeightSyncVerlError("ENGINE_NOT_FOUND", f"receive 'served' needs the weightsync server {node} to drive "
                                  "the node's engine (start it with --engine vllm-http=URL or sglang-http=URL); it "
                                  f"drives none")
    raise WeightSyncVerlError("ENGINE_NOT_FOUND", f"the weightsync server {node} drives several engines "
                              f"({', '.join(repr(e.name) for e in driven)}): name the rollout's in "
                              "engine_kwargs.weightsync.engine")


@dataclass(slots=True)
class ServedWatch:
    """What one rollout worker has seen of its node while waiting for this sync's commit to be served.

    `commits` (store epoch -> generation, from the senders' outcomes) says which commit that is: the
    label alone cannot (another run, or another push, may have used it). The events may start before
    the commit (the rollout watches from the start of its receive, so that it sees the engine start
    on the commit and fail): an event of an older generation, or of another store before the node
    was seen holding the commit, is from before it and decides nothing."""

    version: str
    commits: dict[int, int]
    engine: str | None
    node: str
    generation: int = 0
    """The generation this sync committed in the node's store (0: not seen yet)."""
    reached: bool = False
    """The node was seen holding the commit: another store after that is the node's server restarted."""
    fresh: bool = False
    """The next event is the first of a stream opened after the commit: another store there is one that
    never held it (restarted since)."""
    attempted: bool = False
    """The engine started applying (APPLYING) once the node held the commit: a FAILED after that is this one's."""
    last: pb.EngineStatus | None = None

    def restart(self) -> None:
        """The stream broke (the server went away): what was seen of the engine's attempts is not kept,
        and the next stream opens after the commit."""
        self.attempted = False
        self.fresh = True

    def see(self, event: pb.WatchWeightsResponse) -> pb.EngineStatus | None:
        """One event: the engine's status once it serves the commit, None while undecided; raises
        ENGINE_FAILED, VERSION_GONE or ENGINE_NOT_FOUND."""
        engine = pick_engine(list(event.engines), self.engine, self.node)
        self.engine, self.last = engine.name, engine
        held = event.version
        fresh, self.fresh = self.fresh, False
        generation = self.commits.get(held.store_epoch)
        if generation is None:
            if self.reached or fresh:
                raise WeightSyncVerlError("VERSION_GONE", f"the node's store (epoch {held.store_epoch}) is not one "
                                          f"this sync committed version {self.version!r} to: its server restarted "
                                          "after the commit", version=self.version)
            return None  # a store from before the commit (the server restarted while the rollout waited)
        self.generation = generation
        applied = engine.applied_version
        if (engine.state == pb.ENGINE_STATE_SERVING and applied.generation == generation
                and applied.store_epoch in (0, held.store_epoch)):
            return engine
        if held.generation > generation:
            raise WeightSyncVerlError("VERSION_GONE", f"the node moved on to generation {held.generation} "
                                      f"({held.version!r}) before its engine served version {self.version!r} "
                                      f"(generation {generation})", version=self.version)
        if held.generation < generation:
            return None  # before the commit: an engine applying now applies an older version
        self.reached = True
        if engine.state == pb.ENGINE_STATE_APPLYING:
            self.attempted = True
        elif self.attempted and engine.state == pb.ENGINE_STATE_FAILED and applied.generation < generation:
            raise self.failed()
        return None

    def failed(self) -> WeightSyncVerlError:
        engine = self.last
        assert engine is not None
        serving = engine.applied_version.version or "its own checkpoint"
        return WeightSyncVerlError("ENGINE_FAILED", f"engine {engine.name!r} did not take version {self.version!r} "
                                   f"(committed on the node as generation {self.generation}) and keeps serving "
                                   f"{serving!r}: {engine.last_error}", version=self.version)

    def timed_out(self, timeout_s: float, unreachable: str) -> WeightSyncVerlError:
        """At the deadline: ENGINE_FAILED when the engine is failing on this commit, else VERSION_NOT_SERVED
        saying where it stands."""
        engine = self.last
        if (engine is not None and self.reached and engine.state == pb.ENGINE_STATE_FAILED
                and engine.applied_version.generation < self.generation):
            return self.failed()
        if unreachable:
            where = f"its node's server is unreachable ({unreachable})"
        elif engine is None or not self.reached:
            where = "its node was not seen holding the commit"
        else:
            state = pb.EngineState.Name(engine.state)
            where = (f"engine {self.engine!r} is {state}, serving {engine.applied_version.version or 'nothing'!r}"
                     + (f"; last error: {engine.last_error}" if engine.last_error else ""))
        return WeightSyncVerlError("VERSION_NOT_SERVED", f"version {self.version!r} not served on the rollout's node "
                                   f"within {timeout_s:g} s of its commit ({where})", version=self.version)
