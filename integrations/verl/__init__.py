"""weightsync.integrations.verl: weightsync as a verl (0.9.x) checkpoint engine.

    pip install 'weightsync[verl]'

Two lines of verl's config choose it (verl's trainer reads actor_rollout_ref.rollout.checkpoint_engine);
verl imports this module in every worker, which registers the backend "weightsync" with verl's
CheckpointEngineRegistry:

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.servers='[node-a:50051,node-b:50051]'

Other engine_kwargs.weightsync keys: transport, token, mode, delta, timeout_s, node_server,
outcome_host, senders (config.py: over INLINE every actor rank sends its share by default), receive
("tensors", or "served": driver mode, the node's server updates the engine), engine. Each sync's
version label is verl's global_steps; what the rollout reads is the commit of that sync (its
generation on each server), whatever labels the nodes held before. Importing this package (or
any module of it) imports verl and registers the backend.
"""

from __future__ import annotations

from weightsync.integrations.verl.config import VerlSyncConfig
from weightsync.integrations.verl.engine import BACKEND, WeightSyncCheckpointEngine
from weightsync.integrations.verl.errors import WeightSyncVerlError

__all__ = ["BACKEND", "VerlSyncConfig", "WeightSyncCheckpointEngine", "WeightSyncVerlError"]
