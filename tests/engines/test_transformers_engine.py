"""A transformers Qwen2ForCausalLM in its own process follows a weightsync node.

Real processes: a weightsync server, the trainer (this process, the SDK), and the engine
(tests/engines/transformers_engine.py: EngineClient + ModuleFollower, forward passes in a
loop). The engine's logits must equal, bit for bit, those of the trainer's model at the
version the engine says it serves; during STAGED updates no step sees a torn version.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the engine virtualenv (make engine-install)")

import tiny_model  # noqa: E402
import transformers_engine  # noqa: E402

from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server, sdk_client, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ENGINE = Path(transformers_engine.__file__)


@contextlib.contextmanager
def one_thread():
    """The engine computes its logits on one thread; so do we, for the same reduction order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def expected_digest(state: dict[str, torch.Tensor]) -> str:
    model = tiny_model.model(transformers_engine.SEED_NEVER_PUSHED)
    model.load_state_dict(state)
    with one_thread():
        return transformers_engine.logits_digest(model)


class EngineProcess:
    def __init__(self, address: str, work: Path) -> None:
        self.out, self.stop_file = work / "steps.jsonl", work / "stop"
        self.process = subprocess.Popen([sys.executable, str(ENGINE), address, str(self.out), str(self.stop_file)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.process.stdout.readline()
        assert line.strip() == "ENGINE READY", line + self.process.stdout.read()

    def steps(self) -> list[dict]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.endswith("}")]

    def wait_serving(self, generation: int, timeout: float = 60.0) -> dict:
        """The first step computed with `generation` applied."""
        def served():
            return next((s for s in self.steps() if s["generation"] == generation), None)
        return wait_for(served, timeout)

    def stop(self) -> int:
        self.stop_file.touch()
        try:
            return self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("transformers-engine"), workers=1) as server:
        yield server


@pytest.fixture(scope="module")
def trainer(node):
    with sdk_client(node) as client:
        yield client


@pytest.fixture(scope="module")
def engine(node, tmp_path_factory):
    process = EngineProcess(node.address, tmp_path_factory.mktemp("engine"))
    yield process
    assert process.stop() == 0, process.process.stdout.read()


def served_by_server(node) -> pb.EngineStatus:
    engines = {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}
    return engines["transformers"]


def test_hot_updates_give_the_trainers_logits_bit_for_bit(node, trainer, engine):
    never_pushed = expected_digest(tiny_model.weights(transformers_engine.SEED_NEVER_PUSHED))
    # The engine says READY before its first step is written: wait for that step (bounded as wait_serving is).
    first = wait_for(lambda: next(iter(engine.steps()), None), 60.0)
    assert first["digest"] == never_pushed  # the engine's own weights before any push
    state = {}
    for seed, label in ((1, "v1"), (2, "v2"), (3, "v3")):
        state = tiny_model.weights(seed)
        generation = trainer.push(state, version=label, transport="inline",
                                  allow_new_tensors=seed == 1).servers[0].generation
        step = engine.wait_serving(generation)
        assert (step["version"], step["applied"]) == (label, True)
        assert step["digest"] == expected_digest(state), f"{label}: the engine's logits differ from the trainer's"
        wait_for(lambda g=generation: served_by_server(node).applied_version.generation == g, 10)
        assert served_by_server(node).applied_version.version == label
    assert len({expected_digest(tiny_model.weights(s)) for s in (1, 2, 3)}) == 3  # versions are told apart

    # A partial update (layer 0 only): the engine copies just those tensors, the rest stays v3.
    layer0 = tiny_model.layer(tiny_model.weights(4), 0)
    generation = trainer.push(layer0, version="v3+layer0", transport="shm").servers[0].generation
    step = engine.wait_serving(generation)
    assert step["digest"] == expected_digest({**state, **layer0})
    assert step["digest"] != expected_digest(state)


def test_generation_during_staged_updates_never_sees_a_torn_version(node, trainer, engine):
    versions = {f"s{seed}": tiny_model.weights(seed) for seed in (11, 12, 13, 14)}
    digests = {}
    for label, state in versions.items():
        generation = trainer.push(state, version=label, transport="inline", mode="staged").servers[0].generation
        digests[generation] = expected_digest(state)
        time.sleep(0.05)  # let forward passes interleave with the next update
    engine.wait_serving(max(digests))
    steps = [s for s in engine.steps() if s["generation"] in digests]
    assert steps, "the engine never served a STAGED version"
    torn = [s for s in steps if s["digest"] != digests[s["generation"]]]
    assert not torn, f"{len(torn)} of {len(steps)} steps saw logits of no single version: {torn[:2]}"
    assert max(s["generation"] for s in steps) == max(digests)

    # The next normal update after these still lands exactly.
    final = tiny_model.weights(15)
    generation = trainer.push(final, version="final", transport="inline").servers[0].generation
    assert engine.wait_serving(generation)["digest"] == expected_digest(final)


def test_the_engine_follows_five_patched_versions_bit_for_bit(node, trainer, engine):
    """Sparse fine-tune steps go as patches (a fraction of the bytes); the engine copies
    the tensors whose generation moved and its logits equal the trainer's, bit for bit, each time."""
    state = {n: t.clone() for n, t in tiny_model.weights(50).items()}
    # The module's trainer pushed whole other models before: auto keeps only samples of tensors that
    # went dense. delta=False forgets that history; the next push keeps a copy.
    trainer.push(state, version="p0-dense", transport="inline", delta=False)
    trainer.push(state, version="p0", transport="inline")
    g = torch.Generator().manual_seed(50)
    for step in range(1, 6):
        for tensor in state.values():  # 0.5% of each matrix's elements move
            if tensor.dim() == 2:
                flat = tensor.view(-1)
                picks = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 200)]
                flat[picks] += torch.randn(picks.numel(), generator=g).to(flat.dtype) * 1e-2
        result = trainer.push(state, version=f"p{step}", transport="inline", delta="auto")
        assert result.bytes_sent < 0.1 * result.dense_bytes, (step, result.bytes_sent, result.dense_bytes)
        served = engine.wait_serving(result.servers[0].generation)
        assert served["digest"] == expected_digest(state), f"p{step}: the engine's logits differ from the trainer's"
