"""Keep a torch module at the node's latest committed version."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.engine.apply import apply_to_module
from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot
from weightsync.v1 import weight_sync_service_pb2 as pb

READABLE = (pb.STORE_STATE_CONSISTENT, pb.STORE_STATE_UPDATING)
"""Store states with a committed version to read (UPDATING: a STAGED update; the live bytes are whole)."""
NOT_NOW = frozenset({"STORE_EMPTY", "STORE_INCONSISTENT", "STORE_UPDATING"})
"""Refusals of an acquire that mean "nothing to apply now" (the store changed state since status()):
the model keeps its version and a later update() tries again."""


class ModuleFollower:
    """Call update() between forward passes: it applies a newer committed version, if any.

    The first update applies every tensor (a warm start from the node's store); later ones only
    the tensors written since the version applied last. A version is applied whole or not at all.
    Nothing committed yet, a store an aborted IN_PLACE update left inconsistent, or an update
    that kept the store busy past the lease wait: update() returns False, the model unchanged.
    A model that does not fit the store raises EngineError (TENSOR_MISMATCH, TENSOR_NOT_IN_MODEL).

    strict=True (the default): the store and the model hold the same tensors (the model's
    state_dict: parameters and persistent buffers; tied ones count once), as torch's
    load_state_dict(strict=True). A store tensor the model lacks is TENSOR_NOT_IN_MODEL; a model
    tensor the store lacks is TENSOR_NOT_IN_STORE (metadata: `count`, `tensors`, the first 20),
    raised before anything is copied. A node started with `--tensors` holds only its part of
    the model: follow it with strict=False, which applies the tensors both hold and leaves the
    model's others as they were (loaded from elsewhere, or stale).
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
        generation = status.version.generation
        if generation == 0 or generation <= self.applied_generation or status.store_state not in READABLE:
            return False  # generation 0: the first update is still being written (the store is UPDATING)
        try:
            snapshot = self.client.acquire()
        except EngineError as error:
            if error.reason in NOT_NOW:
                return False
            raise
        with snapshot:
            if self.strict:
                self._require_whole_model(snapshot)
            apply_to_module(self.module, snapshot, since_generation=self.applied_generation,
                            name_map=self.name_map, strict=self.strict)
            self.applied_generation = snapshot.generation
            self.applied_version = snapshot.version.version
        return True

    def _require_whole_model(self, snapshot: StoreSnapshot) -> None:
        """strict: every tensor of the model is in the store (under its name_map name), or raise."""
        held = {self.name_map.get(n, n) if self.name_map else n for n in snapshot.tensors}
        state = self.module.state_dict(keep_vars=True)
        filled = {id(t) for name, t in state.items() if name in held}  # a tied tensor is filled through any name
        missing = sorted(name for name, t in state.items() if name not in held and id(t) not in filled)
        if missing:
            raise EngineError(
                "TENSOR_NOT_IN_STORE",
                f"{len(missing)} tensor(s) of the model are not in the node's store, e.g. {missing[0]!r}: a node "
                "started with --tensors holds only its part (GetServerInfo.store.tensor_filter); follow it with "
                "strict=False to apply that part and leave the rest as it is",
                metadata={"count": str(len(missing)), "tensors": ",".join(missing[:20])},
            )
