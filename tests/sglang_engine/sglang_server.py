"""Start SGLang's HTTP server on a CPU with TP 2, and call its routes.

What starting SGLang 0.5.23 on this CPU machine takes, none of it in the weightsync package:

  - SGLANG_NCCL_SO_PATH names a file that does not exist: SGLang's wheel pins the default (CUDA)
    torch build, and with it SGLang tries to open its own NCCL communicator even with
    --device cpu; a missing library makes it skip that (the ranks talk over Gloo).
  - SGLANG_CPU_OMP_THREADS_BIND="0|1": one OpenMP thread per rank, each on its own core.
  - PYTHONPATH starts with tests/sglang_engine/cpu_env: a stand-in for `vllm._custom_ops`, which
    SGLang's rotary embedding imports while the model is built (see cpu_env/vllm/__init__.py).
  - --attention-backend torch_native: the CPU attention that needs no sgl-kernel build.
  - --skip-server-warmup: the warm-up is a generation, and generation cannot run here: SGLang's
    CPU forward pass needs its sgl-kernel CPU build (Intel AMX kernels, source only), without which
    the first forward pass crashes. So the tests drive the weight-update routes and read
    /weights_checker and /model_info; they never generate. Token-level checks need a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import tiny_model
from tiny_model import http

from weightsync.engine.sglang import LOAD_FORMAT

TP = 2
CPU_ENV = {
    "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
    "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
}


def sglang_problem() -> str | None:
    """Why SGLang cannot be used here, or None."""
    try:
        import sglang  # noqa: F401
        from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means: skip
        return f"SGLang is not importable ({type(error).__name__}: {error}); run make test-sglang (.venv-sglang)"
    return None


def command(model_dir: str, port: int, *, custom_loader: bool = True) -> list[str]:
    loader = ["--custom-weight-loader", LOAD_FORMAT] if custom_loader else []
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--tp-size", str(TP), "--dtype", "bfloat16",
            "--attention-backend", "torch_native", "--skip-server-warmup", "--skip-tokenizer-init",
            "--max-total-tokens", "1024", "--context-length", "256", "--disable-radix-cache", *loader]


CPU_STAND_INS = Path(__file__).resolve().parent / "cpu_env"


def environment(weightsync: str, engine_name: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(CPU_STAND_INS), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, **CPU_ENV, PYTHONPATH=path, WEIGHTSYNC_SERVER=weightsync,
                WEIGHTSYNC_ENGINE_NAME=engine_name)


class SGLang:
    """A running SGLang server (a process group of its own) and its routes."""

    def __init__(self, model_dir: str, port: int, env: dict[str, str], log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command(model_dir, port), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.process.returncode}:\n{self.log()[-6000:]}")
            try:
                if http(self.url + "/model_info", timeout=2)[0] == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang at {self.url} not up after {timeout} s:\n{self.log()[-6000:]}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def post(self, route: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict]:
        return http(self.url + route, "POST", body if body is not None else {}, timeout=timeout)

    def weight_version(self) -> str:
        status, info = http(self.url + "/model_info", timeout=30)
        assert status == 200, info
        return info["weight_version"]

    def checksums(self) -> list[dict[str, str]]:
        """Each TP rank's checksums by parameter name, in rank order."""
        status, body = self.post("/weights_checker", {"action": "checksum"})
        assert status == 200 and body.get("success"), body
        # One entry per rank; its parallelism_info lists the runners it merged (the target alone here).
        assert all([p["role"] for p in r["parallelism_info"]] == ["target"] for r in body["ranks"]), body
        ranks = sorted(body["ranks"], key=lambda r: r["parallelism_info"][0]["tp_rank"])
        assert [r["parallelism_info"][0]["tp_rank"] for r in ranks] == list(range(TP)), body
        return [r["checksums"] for r in ranks]

    def stop(self) -> int | None:
        return tiny_model.stop_process_group(self.process)
