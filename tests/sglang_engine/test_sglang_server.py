"""A real SGLang server (CPU, TP 2) loads the node's versions through the weightsync loader.

Real processes: a weightsync server (its store), a trainer pushing with the SDK (this process)
and `python -m sglang.launch_server --device cpu --tp-size 2` on a tiny Qwen2 this module writes,
started once (about a minute on two cores) with `--custom-weight-loader` naming weightsync's
loader. The test drives SGLang's own routes as a driver would: /pause_generation,
/begin_weight_update, /update_weights_from_tensor (which version, no weights), /end_weight_update,
/continue_generation. After each update, SGLang's own /weights_checker checksums of both ranks
must equal the checksums of the pushed tensors as SGLang shards them (sharding.py), and
/model_info's weight_version the pushed label; each rank reports to weightsync under its own name
(NAME, NAME:tp1). Refused versions (a tensor the model lacks, a version gone, a malformed request,
an unknown load format, no begin, and one rank refusing while the other is ready) leave both ranks
serving their last version, and the next push lands on both.

No generation: SGLang's CPU forward pass needs its sgl-kernel CPU build (Intel AMX kernels), which
this machine has not; without it the first forward pass crashes (sglang_server.py). Token-level
checks (a hot update generates what a cold start of the same weights generates) need a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import sglang_server
import tiny_model
from sharding import expected_checksums

if problem := sglang_server.sglang_problem():
    pytest.skip(problem, allow_module_level=True)

import torch  # noqa: E402

from weightsync.engine.request import REQUEST_NAME  # noqa: E402
from weightsync.engine.sglang import LOAD_FORMAT, UpdateRequest, update_body  # noqa: E402
from weightsync.engine.sglang.request import encode  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import sdk_client, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
NAME = "sgl"
RANK_NAMES = (NAME, f"{NAME}:tp1")
TP = sglang_server.TP
LOADED = re.compile(r"weightsync (tp\d/\d): loaded version '([^']*)' \(generation (\d+)\) since generation (-?\d+): "
                    r"(\d+) tensors, (\d+) bytes")


@dataclass
class Served:
    """What SGLang should hold: the HF state, its label and generation."""

    state: dict[str, torch.Tensor]
    label: str = "default"
    generation: int = -1
    history: list[str] = field(default_factory=list)


class Node:
    """The weightsync server SGLang's ranks attach to (WEIGHTSYNC_SERVER: its fixed address), which a test
    can stop and start again on that address: a new store and a new local socket."""

    def __init__(self, directory, port: int) -> None:
        self.directory, self.address = directory, f"127.0.0.1:{port}"
        self.process = start_server(directory, "--listen", self.address, workers=1)

    def stub(self):
        return self.process.stub()

    def stop(self) -> None:
        assert self.process.stop() == 0, self.process.log()[-3000:]

    def restart(self) -> None:
        self.stop()
        self.process = start_server(self.directory, "--listen", self.address, workers=1)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = Node(tmp_path_factory.mktemp("sglang-node"), tiny_model.free_port())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def trainer(node):
    with sdk_client(node) as client:
        yield client


@pytest.fixture(scope="module")
def served() -> Served:
    return Served(tiny_model.weights(0))


@pytest.fixture(scope="module")
def sglang(node, served, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    model_dir = tiny_model.save(root / "base", served.state)
    server = sglang_server.SGLang(model_dir, tiny_model.free_port(), sglang_server.environment(node.address, NAME),
                                  root / "sglang.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def update(sglang, request: UpdateRequest, label: str, *, begin: bool = True,
           body: dict | None = None) -> tuple[int, dict]:
    """One update as a driver runs it: pause, begin, update, end, continue; the update's answer."""
    assert sglang.post("/pause_generation", {"mode": "retract"})[0] == 200
    try:
        if begin:
            status, answer = sglang.post("/begin_weight_update", {})
            assert status == 200 and answer["success"], answer
        try:
            return sglang.post("/update_weights_from_tensor",
                               body if body is not None else update_body(request, tp_size=TP, weight_version=label))
        finally:
            if begin:
                status, answer = sglang.post("/end_weight_update", {})
                assert status == 200 and answer["success"], answer
    finally:
        assert sglang.post("/continue_generation", {})[0] == 200


def engines(node) -> dict[str, pb.EngineStatus]:
    return {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}


def assert_serves(sglang, node, served: Served) -> None:
    """Both ranks hold exactly `served.state`, sharded; SGLang and weightsync say which version."""
    assert sglang.alive(), sglang.log()[-4000:]
    actual = sglang.checksums()
    for rank in range(TP):
        expected = expected_checksums(served.state, rank, TP)
        assert actual[rank] == expected, (rank, sorted(n for n in expected if actual[rank].get(n) != expected[n]))
    assert sglang.weight_version() == served.label
    if served.generation > 0:
        status = engines(node)
        for name in RANK_NAMES:
            assert status[name].kind == "local", status[name]
            assert status[name].applied_version.version == served.label, status[name]
            assert status[name].applied_version.generation == served.generation, status[name]


def push_and_load(trainer, sglang, node, served: Served, tensors: dict[str, torch.Tensor], label: str,
                  *, loaded: int, **push) -> dict:
    """Push `tensors` (all or some), load them into SGLang and check it serves the result; `loaded`:
    how many tensors each rank must have fed to load_weights (what changed since its version)."""
    result = trainer.push(tensors, version=label, transport="inline", **push)
    generation = result.servers[0].generation
    status, answer = update(sglang, UpdateRequest(generation=generation, since_generation=served.generation), label)
    assert status == 200 and answer["success"], answer
    reports = LOADED.findall(answer["message"])
    assert reports, answer  # rank 0's answer: SGLang returns one rank's message
    for _rank, version, gen, since, count, _ in reports:
        assert (version, int(gen), int(since), int(count)) == (label, generation, served.generation, loaded), answer
    served.state = {**served.state, **tensors}
    served.label, served.generation = label, generation
    served.history.append(label)
    assert_serves(sglang, node, served)
    return {"result": result, "answer": answer}


def nudged(state: dict[str, torch.Tensor], names: tuple[str, ...], seed: int) -> dict[str, torch.Tensor]:
    """`state` with about 2% of the elements of `names` moved by one bf16 ulp (what patches carry)."""
    generator = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in names:
        bits = state[name].clone().view(torch.int16)
        mask = torch.rand(bits.shape, generator=generator) < 0.02
        bits[mask] += 1
        out[name] = bits.view(torch.bfloat16)
    return out


def test_sglang_starts_from_its_checkpoint_as_sharded_here(sglang, node, served):
    # The checksum model (sharding.py) against SGLang's own, before weightsync moves a byte.
    assert_serves(sglang, node, served)
    assert not (set(engines(node)) & set(RANK_NAMES))  # the ranks attach on their first load


def test_dense_versions_staged_and_in_place(sglang, node, trainer, served):
    v1 = tiny_model.weights(1)
    push_and_load(trainer, sglang, node, served, v1, "v1", loaded=len(v1), mode="staged", allow_new_tensors=True)
    v2 = tiny_model.weights(2)
    push_and_load(trainer, sglang, node, served, v2, "v2", loaded=len(v2), mode="in_place", delta=False)


def test_partial_update_and_patches(sglang, node, trainer, served):
    before = sglang.checksums()
    layer0 = tiny_model.layer(tiny_model.weights(3), 0)
    push_and_load(trainer, sglang, node, served, layer0, "layer0", loaded=len(layer0), mode="staged")
    after = sglang.checksums()
    for rank in range(TP):  # only layer 0's parameters moved
        moved = {n for n in after[rank] if after[rank][n] != before[rank][n]}
        assert moved and all(n.startswith("model.layers.0.") for n in moved), moved

    # Patches: the trainer sends only the changed elements (IN_PLACE, then STAGED); each rank
    # loads the tensors that changed, whole, from the store.
    names = ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
    # The SDK's first delta push has no base yet: whole, every tensor written again.
    push_and_load(trainer, sglang, node, served, dict(served.state), "patch-base", loaded=len(served.state),
                  mode="in_place", delta=True)
    for step, mode in enumerate(("in_place", "staged")):
        state = nudged(served.state, names, seed=step)
        pushed = push_and_load(trainer, sglang, node, served, state, f"patch{step}", loaded=len(names), mode=mode,
                               delta=True)["result"]
        assert 0 < pushed.bytes_sent < pushed.dense_bytes / 4, (pushed.bytes_sent, pushed.dense_bytes)


def assert_refused(sglang, node, served, answer: tuple[int, dict], reason: str) -> None:
    """SGLang answered success: false naming `reason`, and still serves `served`, alive."""
    status, body = answer
    assert status == 400 and body["success"] is False, body
    assert reason in body["message"], body
    assert sglang.alive(), sglang.log()[-4000:]
    assert_serves(sglang, node, served)


def test_a_refused_version_leaves_sglang_serving_its_last_one(sglang, node, trainer, served):
    # A version that writes a tensor the model does not take: every rank refuses before one byte
    # moves (the changed q_proj with it); SGLang keeps serving, and says why.
    bad = {"model.layers.0.self_attn.q_proj.weight": tiny_model.weights(8)["model.layers.0.self_attn.q_proj.weight"],
           "model.layers.0.self_attn.extra.weight": torch.ones(4, 4, dtype=torch.bfloat16)}
    generation = trainer.push(bad, version="bad", transport="inline", mode="staged", allow_new_tensors=True,
                              delta=False).servers[0].generation
    answer = update(sglang, UpdateRequest(generation=generation, since_generation=served.generation), "bad")
    assert_refused(sglang, node, served, answer, "TENSOR_NOT_IN_MODEL")
    assert "model.layers.0.self_attn.extra.weight" in answer[1]["message"]
    status = engines(node)
    assert all("TENSOR_NOT_IN_MODEL" in status[name].last_error for name in RANK_NAMES), status

    # The next version loads: what changed since the served one, the refused version's q_proj
    # included; the unknown tensor, written by an older version now, is skipped.
    good = tiny_model.layer(tiny_model.weights(9), 1)
    served_state = {**served.state, **{k: v for k, v in bad.items() if "extra" not in k}}
    served.state = served_state
    push_and_load(trainer, sglang, node, served, good, "good", loaded=len(good) + 1, mode="in_place", delta=False)

    # A version the store has moved past; a malformed request; a load format SGLang does not know;
    # an update outside begin/end. Each answered, none stops SGLang; then a normal version loads.
    gone = UpdateRequest(generation=served.generation - 1, since_generation=-1)
    assert_refused(sglang, node, served, update(sglang, gone, "gone"), "VERSION_GONE")
    malformed = update_body(UpdateRequest(), tp_size=TP)
    malformed["serialized_named_tensors"] = [_entry([(REQUEST_NAME, torch.tensor([1, 2, 3]))])] * TP
    assert_refused(sglang, node, served, update(sglang, UpdateRequest(), "x", body=malformed), "REQUEST_MALFORMED")
    unknown = dict(update_body(UpdateRequest(), tp_size=TP), load_format="weightsync.no.such.loader")
    assert_refused(sglang, node, served, update(sglang, UpdateRequest(), "x", body=unknown), "LOAD_FORMAT_UNKNOWN")
    outside = update(sglang, UpdateRequest(generation=served.generation), "outside", begin=False)
    assert_refused(sglang, node, served, outside, "begin_weight_update")

    v5 = tiny_model.weights(5)
    push_and_load(trainer, sglang, node, served, v5, "v5", loaded=len(v5), mode="staged", delta=False)
    assert LOAD_FORMAT in sglang.log()  # the server was started with the loader listed


def test_one_rank_refusing_leaves_both_ranks_serving_their_last_version(sglang, node, trainer, served):
    # Each TP rank reads its own entry of serialized_named_tensors. Rank 1's names a generation the
    # store has moved past (VERSION_GONE, in rank 1's scheduler alone); rank 0's names the version
    # just pushed, which rank 0 by itself would load. The ranks agree first (Gloo): neither loads a
    # byte, and rank 0's message, the one SGLang answers, names both ranks' outcomes.
    v6 = tiny_model.weights(6)
    pushed = trainer.push(v6, version="v6", transport="inline", mode="staged", delta=False).servers[0].generation
    before = sglang.checksums()
    body = update_body(UpdateRequest(generation=pushed, since_generation=served.generation), tp_size=TP,
                       weight_version="v6")
    body["serialized_named_tensors"][1] = encode(UpdateRequest(generation=served.generation))
    answer = update(sglang, UpdateRequest(), "v6", body=body)
    assert_refused(sglang, node, served, answer, f"version 'v6' (generation {pushed}) not loaded, the engine keeps "
                   "its weights: rank tp0/2 ready; rank tp1/2 refused: VERSION_GONE: ")
    assert sglang.checksums() == before
    assert engines(node)[NAME].last_error.startswith(f"RANK_REFUSED: version 'v6' (generation {pushed}) not "
                                                     "loaded"), engines(node)[NAME]

    # The other way round: rank 0's entry is malformed, rank 1's names v6.
    body["serialized_named_tensors"] = [_entry([(REQUEST_NAME, torch.tensor([1, 2, 3]))]),
                                        encode(UpdateRequest(generation=pushed, since_generation=served.generation))]
    answer = update(sglang, UpdateRequest(), "v6", body=body)
    assert_refused(sglang, node, served, answer, "the version not loaded, the engine keeps its weights: rank tp0/2 "
                   "refused: REQUEST_MALFORMED: ")
    assert answer[1]["message"].endswith("; rank tp1/2 ready"), answer
    assert sglang.checksums() == before
    assert engines(node)[f"{NAME}:tp1"].last_error.startswith(f"RANK_REFUSED: version 'v6' (generation {pushed}) "
                                                              "not loaded"), engines(node)[f"{NAME}:tp1"]

    # The next push lands on both ranks: what changed since the served version, the refused v6's
    # tensors included; every checksum moves to the pushed bytes', sharded, on both ranks.
    served.state = {**served.state, **v6}
    layer = tiny_model.layer(tiny_model.weights(7), 0)
    push_and_load(trainer, sglang, node, served, layer, "after-split", loaded=len(v6), mode="in_place", delta=False)
    after = sglang.checksums()
    for rank in range(TP):
        expected = expected_checksums(served.state, rank, TP)
        assert {n for n in after[rank] if after[rank][n] != before[rank][n]} == {
            n for n in expected if expected[n] != before[rank][n]}
        assert any(after[rank][n] != before[rank][n] for n in after[rank]), rank


def _entry(pairs) -> str:
    """One rank's serialized_named_tensors entry for arbitrary (name, int tensor) pairs."""
    import base64
    import io

    from weightsync.engine.sglang.request import _Pickler

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=4).dump(pairs)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_bodies_sglang_would_misread_or_die_of_are_refused_and_the_label_stays(sglang, node, trainer, served):
    """update_body's body with its load_format left out (or another one): SGLang's default loader would
    skip weightsync's request and answer success, its label moving over the old weights; a body built for
    fewer TP ranks than SGLang's: SGLang's scheduler died of an IndexError; an entry SGLang's unpickler
    refuses under weightsync's load format. Each is refused on both ranks, SGLang serves on, its label
    where it was; then the next version loads, bytes checked."""
    state = tiny_model.weights(12)
    generation = trainer.push(state, version="v12", transport="inline", mode="staged", delta=False).servers[0].generation
    request = UpdateRequest(generation=generation, since_generation=served.generation)
    for load_format in (None, "direct"):
        body = update_body(request, tp_size=TP, weight_version="v12")
        if load_format is None:
            del body["load_format"]
        else:
            body["load_format"] = load_format
        answer = update(sglang, request, "v12", body=body)
        assert_refused(sglang, node, served, answer, "LOAD_FORMAT_MISMATCH: the body carries weightsync's request "
                       f"under load_format {load_format!r}")
    short = update_body(request, tp_size=TP - 1, weight_version="v12")
    assert_refused(sglang, node, served, update(sglang, request, "v12", body=short),
                   f"REQUEST_MALFORMED: serialized_named_tensors has {TP - 1} entries and this SGLang runs {TP} TP "
                   "ranks")
    garbage = dict(update_body(request, tp_size=TP, weight_version="v12"))
    garbage["serialized_named_tensors"] = [garbage["serialized_named_tensors"][0], "bm90IGEgcGlja2xl"]
    assert_refused(sglang, node, served, update(sglang, request, "v12", body=garbage),
                   "REQUEST_MALFORMED: entry 1 of serialized_named_tensors is not one SGLang reads")

    # The same version, as update_body builds it: every tensor of it loads on both ranks.
    status, answer = update(sglang, request, "v12")
    assert status == 200 and answer["success"], answer
    served.state, served.label, served.generation = {**served.state, **state}, "v12", generation
    assert_serves(sglang, node, served)


def test_a_restarted_weightsync_server_is_reached_again_by_every_rank(sglang, node, served):
    """The weightsync server stops and starts again on the same address (a new local socket, an empty store
    counting generations anew). Each rank attaches again at its next load and takes every tensor of the new
    store's version (each failed LOAD_FAILED on its dead connection for the life of SGLang); bytes checked."""
    node.restart()
    state = tiny_model.weights(13)
    with sdk_client(node) as trainer:
        generation = trainer.push(state, version="restarted", transport="inline", allow_new_tensors=True,
                                  delta=False).servers[0].generation
    status, answer = update(sglang, UpdateRequest(generation=generation, since_generation=-1), "restarted")
    assert status == 200 and answer["success"], answer
    reports = LOADED.findall(answer["message"])
    assert reports and all((version, int(gen), int(count)) == ("restarted", generation, len(state))
                           for _, version, gen, _, count, _ in reports), answer
    served.state, served.label, served.generation = {**served.state, **state}, "restarted", generation
    assert_serves(sglang, node, served)
