"""ModuleFollower.update() in the store states an engine polling in a loop meets (engine/follower.py).

A transformers engine polls between forward passes from the moment it starts. Polled while
the node's first update was being written (store UPDATING, generation 0), update() acquired,
the server refused (nothing committed), and the EngineError ended the engine's loop: seen as a
flake of test_transformers_engine.py under load. These cases run against a scripted client,
so that each state is met every time, not when the timing happens to allow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from weightsync.engine import EngineError, ModuleFollower, StoreSnapshot
from weightsync.v1 import local_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


@dataclass
class ScriptedClient:
    """status() answers `state` at `generation`; acquire() raises `refusal` if set, else serves `tensors`."""

    state: int
    generation: int
    refusal: str = ""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    acquired: int = 0
    released: list[bool] = field(default_factory=list)

    def status(self) -> local_pb2.GetStatusResponse:
        return local_pb2.GetStatusResponse(version=pb.WeightVersion(version=f"g{self.generation}",
                                                                    generation=self.generation),
                                           store_state=self.state)

    def acquire(self) -> StoreSnapshot:
        self.acquired += 1
        if self.refusal:
            raise EngineError(self.refusal, "refused")
        version = pb.WeightVersion(version=f"g{self.generation}", generation=self.generation)
        return StoreSnapshot(self, self.acquired, version, dict(self.tensors),
                             {n: self.generation for n in self.tensors})

    def _release(self, lease_id: int, *, applied: bool, error: str) -> None:
        self.released.append(applied)


def model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2, bias=False)


@pytest.mark.parametrize(("state", "generation"), [
    (pb.STORE_STATE_EMPTY, 0),
    (pb.STORE_STATE_UPDATING, 0),  # the first update is being written: nothing committed yet
    (pb.STORE_STATE_INCONSISTENT, 3),  # an aborted IN_PLACE update: no whole version to read
    (pb.STORE_STATE_UNSPECIFIED, 3),
])
def test_nothing_to_read_is_not_an_acquire(state, generation):
    client = ScriptedClient(state, generation)
    net = model()
    before = net.weight.detach().clone()
    assert ModuleFollower(client, net).update() is False
    assert client.acquired == 0 and torch.equal(net.weight, before)


@pytest.mark.parametrize("refusal", ["STORE_EMPTY", "STORE_INCONSISTENT", "STORE_UPDATING"])
def test_a_store_that_changed_state_since_status_leaves_the_model_and_a_later_update_applies(refusal):
    weight = torch.arange(8, dtype=torch.float32).view(2, 4)
    client = ScriptedClient(pb.STORE_STATE_CONSISTENT, 3, refusal=refusal, tensors={"weight": weight})
    net = model()
    before = net.weight.detach().clone()
    follower = ModuleFollower(client, net)
    assert follower.update() is False
    assert torch.equal(net.weight, before) and follower.applied_generation == -1
    client.refusal = ""
    assert follower.update() is True
    assert torch.equal(net.weight, weight) and (follower.applied_generation, follower.applied_version) == (3, "g3")
    assert client.released == [True]


def test_a_model_that_does_not_fit_still_raises():
    client = ScriptedClient(pb.STORE_STATE_CONSISTENT, 2, tensors={"weight": torch.zeros(3, 3)})
    with pytest.raises(EngineError) as raised:
        ModuleFollower(client, model()).update()
    assert raised.value.reason == "TENSOR_MISMATCH"
    assert client.released == [False]


def test_an_unexpected_refusal_is_raised():
    client = ScriptedClient(pb.STORE_STATE_CONSISTENT, 2, refusal="TOKEN_INVALID")
    with pytest.raises(EngineError, match="TOKEN_INVALID"):
        ModuleFollower(client, model()).update()
