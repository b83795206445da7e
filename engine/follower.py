"""Keep a torch module at the node's latest committed version."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.engine.apply import apply_to_module
from weightsync.engine.client import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb


class ModuleFollower:
    """Call update() between forward passes: it applies a newer committed version, if any.

    The first update applies every tensor (a warm start from the node's store); later ones only
    the tensors written since the version applied last. A version is applied whole or not at all.
    """

    def __init__(self, client: EngineClient, module: torch.nn.Module, *,
                 name_map: Mapping[str, str] | None = None, strict: bool = True) -> None:
        self.client = client
        self.module = module
        self.name_map = name_map
        self.strict = strict
        self.applied_generation = -1
        self.applied_version = ""

    def update(self) -> bool:
        """Apply the committed version if it is newer than the applied one; True if it did."""
        status = self.client.status()
        if status.version.generation <= self.applied_generation or status.store_state in (
            pb.STORE_STATE_EMPTY, pb.STORE_STATE_UNSPECIFIED
        ):
            return False
        with self.client.acquire() as snapshot:
            apply_to_module(self.module, snapshot, since_generation=self.applied_generation,
                            name_map=self.name_map, strict=self.strict)
            self.applied_generation = snapshot.generation
            self.applied_version = snapshot.version.version
        return True
