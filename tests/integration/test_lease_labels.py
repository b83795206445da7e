"""A lease's bytes are exactly its version's, always.

An engine acquiring in a loop while a trainer pushes many STAGED dense versions must never get a
snapshot labelled version N that maps the bytes of N+1 (outside testing saw 6-8 of ~750 do so: the
server took a worker's new layout as its commit answer arrived, and published the new version only
after every worker answered; a lease granted in between mixed the two). Every snapshot's bytes are
checked against the bytes its label names, on each transport.
"""

from __future__ import annotations

import threading

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.engine import EngineClient

from helpers import running_server

pytestmark = pytest.mark.timeout(300)
PUSHES = 60


def weights(step: int) -> dict[str, torch.Tensor]:
    """Version `step`: every element says which version it is."""
    return {f"layers.{i}.w": torch.full((64, 64), float(step * 10 + i)) for i in range(4)}


def snapshot_label_and_bytes_agree(engine: EngineClient, stop: threading.Event, checked: list[int],
                                   wrong: list[str]) -> None:
    while not stop.is_set():
        with engine.acquire(wait=30) as snapshot:
            step = int(snapshot.version.version.removeprefix("v"))
            for name, tensor in snapshot.tensors.items():
                expected = weights(step)[name]
                if not torch.equal(tensor, expected):
                    wrong.append(f"{snapshot.version.version} (generation {snapshot.generation}): {name} holds "
                                 f"{tensor.view(-1)[0].item()}, the label says {expected.view(-1)[0].item()}")
            snapshot.applied = True
        checked.append(step)


@pytest.mark.parametrize("transport", ["collective", "inline", "shm"])
def test_every_snapshot_during_staged_pushes_holds_its_labels_bytes(tmp_path, transport):
    with running_server(tmp_path, workers=2) as node, WeightSyncClient(node.address, timeout=60) as trainer:
        if transport == "collective":
            trainer.create_group(timeout=30)
        trainer.push(weights(0), version="v0", transport=transport, mode="staged", allow_new_tensors=True)
        stop, checked, wrong = threading.Event(), [], []
        with EngineClient(server=node.address, name="reader") as engine:
            reader = threading.Thread(target=snapshot_label_and_bytes_agree, args=(engine, stop, checked, wrong))
            reader.start()
            try:
                for step in range(1, PUSHES + 1):
                    trainer.push(weights(step), version=f"v{step}", transport=transport, mode="staged")
            finally:
                stop.set()
                reader.join(60)

        assert not wrong, f"{len(wrong)} of {len(checked)} snapshots mapped other bytes than their label's: {wrong[:3]}"
        assert len(checked) > PUSHES // 2 and len(set(checked)) > 10  # the reader really raced the pushes
        assert trainer.verify(weights(PUSHES)).ok
