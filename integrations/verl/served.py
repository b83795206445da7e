"""Driver mode's rollout side: waiting, bounded, until the node's engine serves a version.

With `receive: served` the node's weightsync server drives the inference engine itself (--engine
vllm-http=URL / sglang-http=URL: server/engine_driver.py) after each commit; verl's rollout worker
only waits until that engine serves the step the actor ranks pushed. It watches the node's
WatchWeights stream (the current state at once, then every change in order: a commit, the engine
starting to apply, the engine serving or failing) and decides on each event (`ServedWatch.see`):

- the engine serves the version (SERVING, applied_version labelled as asked): done;
- the engine failed (FAILED) after it started applying (APPLYING) once the node held the version:
  ENGINE_FAILED, with the engine's last_error. A FAILED state seen before that belongs to an older
  version the driver has not retried yet (the driver applies a new commit at once);
- the node holds a later version than the one asked: VERSION_GONE.

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


def _later(held: str, wanted: str) -> bool:
    return held.isdigit() and wanted.isdigit() and int(held) > int(wanted)


@dataclass(slots=True)
class ServedWatch:
    """What one rollout worker has seen of its node while waiting for `version` to be served."""

    version: str
    engine: str | None
    node: str
    committed: int = 0
    """The generation the node committed `version` as (0: not seen committed yet)."""
    attempted: bool = False
    """The engine started applying (APPLYING) once the node held `version`: a FAILED after that is this version's."""
    last: pb.EngineStatus | None = None

    def restart(self) -> None:
        """The stream broke (the server went away): what was seen of the engine's attempts is not kept."""
        self.attempted = False

    def see(self, event: pb.WatchWeightsResponse) -> pb.EngineStatus | None:
        """One event: the engine's status once it serves the version, None while undecided; raises
        ENGINE_FAILED, VERSION_GONE or ENGINE_NOT_FOUND."""
        engine = pick_engine(list(event.engines), self.engine, self.node)
        self.engine, self.last = engine.name, engine
        held = event.version.version
        if held == self.version:
            self.committed = event.version.generation
        elif _later(held, self.version):
            raise WeightSyncVerlError("VERSION_GONE", f"the node holds version {held!r}, later than {self.version!r}",
                                      version=self.version)
        applied = engine.applied_version
        if engine.state == pb.ENGINE_STATE_SERVING and applied.version == self.version:
            return engine
        if not self.committed:
            return None
        if engine.state == pb.ENGINE_STATE_APPLYING:
            self.attempted = True
        elif (self.attempted and engine.state == pb.ENGINE_STATE_FAILED
              and applied.generation < self.committed):
            raise self.failed()
        return None

    def failed(self) -> WeightSyncVerlError:
        engine = self.last
        assert engine is not None
        serving = engine.applied_version.version or "its own checkpoint"
        return WeightSyncVerlError("ENGINE_FAILED", f"engine {engine.name!r} did not take version {self.version!r} "
                                   f"(committed on the node as generation {self.committed}) and keeps serving "
                                   f"{serving!r}: {engine.last_error}", version=self.version)

    def timed_out(self, timeout_s: float, unreachable: str) -> WeightSyncVerlError:
        """At the deadline: ENGINE_FAILED when the engine is failing on this version, else VERSION_NOT_SERVED
        saying where it stands."""
        engine = self.last
        if (engine is not None and self.committed and engine.state == pb.ENGINE_STATE_FAILED
                and engine.applied_version.generation < self.committed):
            return self.failed()
        if unreachable:
            where = f"its node's server is unreachable ({unreachable})"
        elif not self.committed:
            where = "the node did not commit it"
        else:
            state = pb.EngineState.Name(engine.state) if engine is not None else "unknown"
            where = (f"engine {self.engine!r} is {state}, serving {engine.applied_version.version or 'nothing'!r}"
                     + (f"; last error: {engine.last_error}" if engine is not None and engine.last_error else ""))
        return WeightSyncVerlError("VERSION_NOT_SERVED", f"version {self.version!r} not served on the rollout's node "
                                   f"within {timeout_s:g} s ({where})", version=self.version)
