"""Hot == cold on SGLang: an SGLang server updated through weightsync generates, greedy, the tokens
of an SGLang started cold from the same weights. Only a GPU shows this.

On the CPU machine tests/sglang_engine proves the update path on a real SGLang (every TP rank's
loader, /weights_checker checksums of both ranks, versions), but it cannot generate: SGLang's CPU
forward pass needs its sgl-kernel CPU build (Intel AMX kernels). Here, on CUDA:

  1. a weightsync server (its store) and SGLang (TP 1, weightsync's loader listed) started from a
     tiny Qwen2 checkpoint (seed 0) generate the base tokens;
  2. a trainer (this process) pushes version v1 (every tensor, STAGED) and then v2 (one layer,
     IN_PLACE); after each push the test drives SGLang's own routes as the driver does (pause,
     begin, /update_weights_from_tensor naming the generation, end, continue);
  3. the hot SGLang's greedy tokens for PROMPTS; then it stops, and an SGLang started cold from a
     checkpoint of v2's weights (no weightsync at all) generates the same prompts.

hot == cold, and base != cold (so an update that loaded nothing could not pass). Needs CUDA and
SGLang importable in the interpreter that runs it (SGLang's virtualenv: make sglang-install
builds .venv-sglang; its wheel pins a CUDA torch). The machines lent to make test-gpu have no
SGLang: there this module skips, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "engines"))  # tiny_model
sys.path.insert(0, str(TESTS / "sglang_engine"))  # sglang_server


def _problem() -> str | None:
    """Why this module cannot run here, or None."""
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"no CUDA device (torch {torch.__version__})")
    try:
        import sglang  # noqa: F401
        from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means: skip
        missing.append(f"SGLang is not importable ({type(error).__name__}: {error}); the lent GPU machines of "
                       "make test-gpu have no SGLang: run this file with .venv-sglang's python (make "
                       "sglang-install) on a CUDA machine")
    return "; ".join(missing) or None


if problem := _problem():
    pytest.skip(f"hot == cold on SGLang needs CUDA and SGLang: {problem}", allow_module_level=True)

import tiny_model  # noqa: E402
from tiny_model import PROMPTS, http  # noqa: E402

from weightsync.engine.sglang import LOAD_FORMAT, UpdateRequest, update_body  # noqa: E402

from helpers import running_server, sdk_client  # noqa: E402

pytestmark = pytest.mark.timeout(900)
NAME = "sgl-gpu"
MAX_NEW_TOKENS = 16


class GpuSglang:
    """SGLang on cuda:0, TP 1, its own process group; stopped by stop()."""

    def __init__(self, model_dir: str, log_path: Path, *, weightsync: str | None) -> None:
        port = tiny_model.free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        loader = ["--custom-weight-loader", LOAD_FORMAT] if weightsync else []
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
                   "--port", str(port), "--tp-size", "1", "--dtype", "bfloat16", "--skip-tokenizer-init",
                   "--context-length", "256", "--mem-fraction-static", "0.3", "--disable-radix-cache",
                   "--disable-cuda-graph", *loader]
        env = dict(os.environ)
        if weightsync:
            env.update(WEIGHTSYNC_SERVER=weightsync, WEIGHTSYNC_ENGINE_NAME=NAME)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.process.returncode}:\n{self.log()[-6000:]}")
            try:
                if http(self.url + "/model_info", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang at {self.url} not up after {timeout} s:\n{self.log()[-6000:]}")

    def post(self, route: str, body: dict) -> dict:
        status, answer = http(self.url + route, "POST", body, timeout=300)
        assert status == 200, (route, status, answer)
        return answer

    def tokens(self) -> list[list[int]]:
        """Greedy continuations of PROMPTS, one request at a time (no batching effects)."""
        out = []
        for prompt in PROMPTS:
            answer = self.post("/generate", {"input_ids": prompt, "sampling_params": {
                "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}})
            out.append([int(t) for t in answer["output_ids"]])
        return out

    def load(self, generation: int, since_generation: int, label: str) -> dict:
        """One update as the driver runs it (server/engines/sglang.py)."""
        self.post("/pause_generation", {"mode": "retract"})
        try:
            assert self.post("/begin_weight_update", {})["success"]
            try:
                answer = self.post("/update_weights_from_tensor", update_body(
                    UpdateRequest(generation=generation, since_generation=since_generation), tp_size=1,
                    weight_version=label))
            finally:
                assert self.post("/end_weight_update", {})["success"]
        finally:
            self.post("/continue_generation", {})
        assert answer["success"], answer
        return answer

    def stop(self) -> None:
        tiny_model.stop_process_group(self.process)


def test_a_hot_updated_sglang_generates_what_a_cold_one_does(tmp_path):
    base = tiny_model.weights(0)
    v1 = tiny_model.weights(1)
    v2_layer = tiny_model.layer(tiny_model.weights(2), 1)
    final = {**v1, **v2_layer}
    (tmp_path / "node").mkdir()
    with running_server(tmp_path / "node", workers=1) as node, sdk_client(node) as trainer:
        hot = GpuSglang(tiny_model.save(tmp_path / "base", base), tmp_path / "hot.log", weightsync=node.address)
        try:
            hot.wait_ready()
            base_tokens = hot.tokens()
            g1 = trainer.push(v1, version="v1", transport="inline", mode="staged",
                               allow_new_tensors=True).servers[0].generation
            hot.load(g1, -1, "v1")
            g2 = trainer.push(v2_layer, version="v2", transport="inline", mode="in_place").servers[0].generation
            hot.load(g2, g1, "v2")
            assert http(hot.url + "/model_info")[1]["weight_version"] == "v2"
            hot_tokens = hot.tokens()
        finally:
            hot.stop()
    cold = GpuSglang(tiny_model.save(tmp_path / "final", final), tmp_path / "cold.log", weightsync=None)
    try:
        cold.wait_ready()
        cold_tokens = cold.tokens()
    finally:
        cold.stop()
    assert all(len(t) == MAX_NEW_TOKENS for t in cold_tokens), cold_tokens
    assert base_tokens != cold_tokens  # the pushed weights change what SGLang generates
    assert hot_tokens == cold_tokens
