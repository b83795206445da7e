"""The SGLang loader against a real weightsync server, with a stand-in for SGLang's model.

Runs without SGLang (make test's .venv as well as .venv-sglang): the stand-in has what the loader
uses of an SGLang model, fused parameters (qkv_proj) and a `load_weights` that fills their parts
(as SGLang's do), and records what it was fed. The ranks' agreement runs here with the other
rank's side scripted (RankZeroOfTwo); over SGLang's real Gloo group, two scheduler processes, in
test_sglang_server.py, with what else only SGLang itself shows.
"""

from __future__ import annotations

import pickletools

import pytest
import torch
from safetensors.torch import save_file

from weightsync.engine.request import REQUEST_NAME, RequestError
from weightsync.engine.sglang import UpdateRequest, update_body
from weightsync.engine.sglang.loader import AttachConfig, LoadError, RankLoader, RankPlace
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import running_server, sdk_client

H = 4
NAMES = ("layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.0.v_proj.weight", "layers.0.o_proj.weight",
         "norm.weight")


class StandIn(torch.nn.Module):
    """Parameters as SGLang keeps them at TP 1: q/k/v fused into qkv_proj."""

    def __init__(self, drop: str = "") -> None:
        super().__init__()
        params = {"layers.0.qkv_proj.weight": torch.zeros(3 * H, H), "layers.0.o_proj.weight": torch.zeros(H, H),
                  "norm.weight": torch.zeros(H)}
        self.params = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v, requires_grad=False)
                                              for k, v in params.items() if k != drop})
        self.fed: list[str] = []

    def named_parameters(self, *args, **kwargs):  # the dotted names SGLang's models have
        for key, value in self.params.items():
            yield key.replace("__", "."), value

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            self.fed.append(name)
            for index, part in enumerate(("q_proj", "k_proj", "v_proj")):
                if f".{part}." in name:
                    params[name.replace(part, "qkv_proj")].data[index * H : (index + 1) * H].copy_(tensor)
                    break
            else:
                params[name].data.copy_(tensor)

    def as_checkpoint(self) -> dict[str, torch.Tensor]:
        params = dict(self.named_parameters())
        qkv = params["layers.0.qkv_proj.weight"]
        return {"layers.0.q_proj.weight": qkv[:H].clone(), "layers.0.k_proj.weight": qkv[H : 2 * H].clone(),
                "layers.0.v_proj.weight": qkv[2 * H :].clone(), "layers.0.o_proj.weight": params["layers.0.o_proj.weight"].clone(),
                "norm.weight": params["norm.weight"].clone()}


def version(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn((H,) if n == "norm.weight" else (H, H), generator=generator) for n in NAMES}


def entry(request: UpdateRequest) -> list:
    return [(REQUEST_NAME, request.to_tensor())]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("node"), workers=1) as server:
        yield server


def loader_for(node, tmp_path, name: str, place: RankPlace | None = None, **shapes: tuple[int, ...]) -> RankLoader:
    """A rank whose SGLang started from a checkpoint of NAMES (shapes as given, else the model's)."""
    checkpoint = {n: torch.zeros(shapes.get(n.split(".")[-2], (H,) if n == "norm.weight" else (H, H))) for n in NAMES}
    save_file(checkpoint, str(tmp_path / "model.safetensors"))
    return RankLoader(lambda: AttachConfig(server=node.address, engine_name=name), place or RankPlace(), str(tmp_path))


def engines(node) -> dict[str, pb.EngineStatus]:
    return {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}


def test_the_request_pickles_with_one_global_and_round_trips():
    request = UpdateRequest(generation=7, since_generation=3, wait_s=2.5, strict=False)
    body = update_body(request, tp_size=2, weight_version="v7")
    assert len(body["serialized_named_tensors"]) == 2 and body["weight_version"] == "v7"
    import base64
    import pickle

    raw = base64.b64decode(body["serialized_named_tensors"][0])
    globals_ = [arg for op, arg, _ in pickletools.genops(raw) if op.name in ("GLOBAL", "STACK_GLOBAL")]
    strings = [arg for op, arg, _ in pickletools.genops(raw) if op.name == "SHORT_BINUNICODE"]
    assert globals_ == [None] and strings[1:3] == ["torch", "LongTensor"]  # STACK_GLOBAL torch.LongTensor
    assert UpdateRequest.from_named_tensors(pickle.loads(raw)) == request  # noqa: S301 - our own bytes
    for bad in ([], [("other", request.to_tensor())], [(REQUEST_NAME, torch.tensor([2, 1, 0, 0, 1]))],
                [(REQUEST_NAME, torch.tensor([1, 1, 0, 0]))], [(REQUEST_NAME, request.to_tensor().float())]):
        with pytest.raises(RequestError):
            UpdateRequest.from_named_tensors(bad)
    with pytest.raises(RequestError):
        UpdateRequest(generation=3, since_generation=3)


def test_each_load_feeds_what_changed_since_the_ranks_version(node, tmp_path):
    model, rank = StandIn(), loader_for(node, tmp_path, "standin")
    with sdk_client(node) as trainer:
        g1 = trainer.push(version(1), version="v1", transport="inline", allow_new_tensors=True).servers[0].generation
        rank.load(model, entry(UpdateRequest(generation=g1)))
        assert sorted(model.fed) == sorted(NAMES) and model.as_checkpoint().keys() == version(1).keys()
        assert all(torch.equal(model.as_checkpoint()[n], version(1)[n]) for n in NAMES)
        # A partial push: only what it wrote since the rank's version; a caller that does not know
        # what the engine serves (-1) gets every tensor.
        part = {"layers.0.k_proj.weight": version(2)["layers.0.k_proj.weight"]}
        g2 = trainer.push(part, version="k", transport="inline").servers[0].generation
        model.fed.clear()
        rank.load(model, entry(UpdateRequest(generation=g2, since_generation=g1)))
        assert model.fed == ["layers.0.k_proj.weight"] and rank.last.since_generation == g1
        model.fed.clear()
        rank.load(model, entry(UpdateRequest(generation=g2, since_generation=-1)))
        assert sorted(model.fed) == sorted(NAMES) and rank.last.since_generation == -1
        assert torch.equal(model.as_checkpoint()["layers.0.k_proj.weight"], part["layers.0.k_proj.weight"])
        status = engines(node)["standin"]
        assert (status.applied_version.version, status.applied_version.generation) == ("k", g2)
        # A name the model does not take: refused before one byte moves; then the next version loads
        # the refused one's changes as well, skipping the stale unknown name.
        before = {n: t.clone() for n, t in model.as_checkpoint().items()}
        bad = {"layers.0.o_proj.weight": version(3)["layers.0.o_proj.weight"], "layers.0.extra.weight": torch.ones(2)}
        g3 = trainer.push(bad, version="bad", transport="inline", allow_new_tensors=True).servers[0].generation
        model.fed.clear()
        with pytest.raises(LoadError) as refused:
            rank.load(model, entry(UpdateRequest(generation=g3)))
        assert refused.value.reason == "TENSOR_NOT_IN_MODEL" and "layers.0.extra.weight" in str(refused.value)
        assert model.fed == [] and all(torch.equal(model.as_checkpoint()[n], before[n]) for n in NAMES)
        assert "TENSOR_NOT_IN_MODEL" in engines(node)["standin"].last_error
        good = {"norm.weight": version(4)["norm.weight"]}
        g4 = trainer.push(good, version="good", transport="inline").servers[0].generation
        rank.load(model, entry(UpdateRequest(generation=g4, since_generation=g2)))
        assert sorted(model.fed) == ["layers.0.o_proj.weight", "norm.weight"] and rank.last.skipped == ["layers.0.extra.weight"]
        # A version the store moved past.
        with pytest.raises(LoadError) as gone:
            rank.load(model, entry(UpdateRequest(generation=g3)))
        assert gone.value.reason == "VERSION_GONE"


def test_a_shape_that_is_not_the_checkpoints_is_refused(node, tmp_path):
    # The checkpoint SGLang started from says v_proj is [2, 8]: the store's [4, 4] does not fit.
    model, rank = StandIn(), loader_for(node, tmp_path, "shapes", v_proj=(2, 2 * H))
    with sdk_client(node) as trainer:
        g1 = trainer.push({"layers.0.v_proj.weight": version(1)["layers.0.v_proj.weight"]}, version="v", transport="inline",
                          allow_new_tensors=True).servers[0].generation
    with pytest.raises(LoadError) as refused:
        rank.load(model, entry(UpdateRequest(generation=g1)))
    assert refused.value.reason == "TENSOR_MISMATCH" and "layers.0.v_proj.weight" in str(refused.value)
    assert model.fed == []


def test_configuration_and_requests_are_checked():
    with pytest.raises(LoadError, match="CONFIG_INVALID"):
        AttachConfig.from_environment({})
    with pytest.raises(LoadError, match="CONFIG_INVALID"):
        AttachConfig.from_environment({"WEIGHTSYNC_SERVER": "nohost"})
    assert AttachConfig.from_environment({"WEIGHTSYNC_SERVER": "h:1"}).engine_name == "sglang"
    assert [RankPlace(r, 2).engine_name("e") for r in range(2)] == ["e", "e:tp1"]
    assert RankPlace(1, 2, 1, 2).engine_name("e") == "e:pp1tp1"
    with pytest.raises(LoadError, match="REQUEST_MALFORMED"):
        RankLoader(lambda: AttachConfig(server="h:1"), RankPlace()).load(StandIn(), [("x", torch.zeros(1))])


class RankZeroOfTwo(RankLoader):
    """Rank 0 of TP 2, the other rank's side of each agreement scripted: (verdict, generation it
    acquired; None: the same as rank 0's). SGLang's Gloo exchange itself runs in test_sglang_server.py."""

    def __init__(self, rank: RankLoader, other: list[tuple[str, int | None]]) -> None:
        super().__init__(rank._config_source, RankPlace(0, 2), rank.model_path)  # noqa: SLF001
        self.other = other

    def _gather(self, mine):
        verdict, generation = self.other.pop(0)
        return [mine, ("tp1/2", verdict, mine[2] if generation is None else generation)]


def test_a_split_between_ranks_loads_nothing_and_names_every_ranks_outcome(node, tmp_path):
    model = StandIn()
    with sdk_client(node) as trainer:
        g1 = trainer.push(version(1), version="s1", transport="inline", allow_new_tensors=True).servers[0].generation
        rank = RankZeroOfTwo(loader_for(node, tmp_path, "split"), [("", None), ("", None)])
        rank.load(model, entry(UpdateRequest(generation=g1)))
        g2 = trainer.push(version(2), version="s2", transport="inline").servers[0].generation
        kept = f"version 's2' (generation {g2}) not loaded, the engine keeps its weights: "

        def refused(other: list[tuple[str, int | None]], named_tensors: list) -> LoadError:
            rank.other = other
            model.fed.clear()
            with pytest.raises(LoadError) as caught:
                rank.load(model, named_tensors)
            assert model.fed == [] and rank.other == [] and rank.served[id(model)][1] == g1
            assert all(torch.equal(model.as_checkpoint()[n], version(1)[n]) for n in NAMES)
            return caught.value

        # The other rank refused: this one, ready, loads nothing either and says both.
        error = refused([("VERSION_GONE: generation 1 is gone", None)], entry(UpdateRequest(generation=g2)))
        assert (error.reason, error.detail) == ("RANK_REFUSED", kept + "rank tp0/2 ready; rank tp1/2 refused: "
                                                "VERSION_GONE: generation 1 is gone")
        assert engines(node)["split"].last_error == "RANK_REFUSED: " + error.detail
        # This rank refused, the other was ready: its own reason, both named.
        error = refused([("", -1)], [("weightsync.update", torch.zeros(2, dtype=torch.int64))])
        assert error.reason == "REQUEST_MALFORMED" and error.detail.startswith(
            "the version not loaded, the engine keeps its weights: rank tp0/2 refused: REQUEST_MALFORMED: ")
        assert error.detail.endswith("; rank tp1/2 ready"), error.detail
        # Both ready, but for two versions (the other rank's entry named another, or generation 0 met a commit).
        error = refused([("", g1)], entry(UpdateRequest(generation=g2)))
        assert (error.reason, error.detail) == ("RANK_VERSIONS_DIFFER", kept + f"the ranks acquired different "
                                                f"versions (rank tp0/2 generation {g2}; rank tp1/2 generation {g1}): "
                                                "name the generation in the request")
        # Both refused alike: one line for both ranks.
        with pytest.raises(RequestError) as malformed:
            UpdateRequest.from_named_tensors([])
        same = f"REQUEST_MALFORMED: {malformed.value}"
        error = refused([(same, -1)], [])
        assert (error.reason, error.detail) == ("REQUEST_MALFORMED", "the version not loaded, the engine keeps its "
                                                f"weights: rank tp0/2, tp1/2 refused: {same}")
        # A long verdict is cut, so that every rank fits in the one message SGLang answers.
        long = "TENSOR_MISMATCH: " + "x" * 400
        error = refused([(long, None)], entry(UpdateRequest(generation=g2)))
        assert (error.reason, error.detail) == ("RANK_REFUSED", kept + "rank tp0/2 ready; rank tp1/2 refused: "
                                                + long[:297] + "...")

        # The next load, both ranks ready for the same version: loads every tensor changed since.
        rank.other = [("", None), ("", None)]
        model.fed.clear()
        rank.load(model, entry(UpdateRequest(generation=g2, since_generation=g1)))
        assert sorted(model.fed) == sorted(NAMES) and rank.served[id(model)][1] == g2
        assert all(torch.equal(model.as_checkpoint()[n], version(2)[n]) for n in NAMES)
        status = engines(node)["split"]
        assert (status.applied_version.version, status.last_error) == ("s2", "")

        # The other rank's load_weights raised part-way: LOAD_FAILED naming both, and this rank's next
        # load takes every tensor (its weights may be a mix).
        g3 = trainer.push({"norm.weight": version(3)["norm.weight"]}, version="s3", transport="inline").servers[0].generation
        rank.other = [("", None), ("RuntimeError: out of memory", None)]
        with pytest.raises(LoadError) as caught:
            rank.load(model, entry(UpdateRequest(generation=g3, since_generation=g2)))
        assert (caught.value.reason, caught.value.detail) == ("LOAD_FAILED", f"version 's3' (generation {g3}) loaded "
                                                              "in part, the weights are a mix until the next load: rank "
                                                              "tp0/2 loaded; rank tp1/2 failed: RuntimeError: out of memory")
        assert id(model) not in rank.served
        rank.other = [("", None), ("", None)]
        model.fed.clear()
        rank.load(model, entry(UpdateRequest(generation=g3, since_generation=g2)))
        assert sorted(model.fed) == sorted(NAMES)  # since -1: every tensor


def test_a_rank_reaches_a_restarted_server_again_and_loads_every_tensor_of_its_new_store(tmp_path):
    """The weightsync server is stopped and started again on the same address (a new local socket, a new
    store counting generations from 1 again). A load while it is down is SERVER_UNREACHABLE once the
    request's wait_s is out, nothing fed; the next load attaches again and, since the new store is not the
    one its record counts in, takes every tensor, whatever since_generation the caller still knows (it
    failed LOAD_FAILED on the old connection for the life of the engine process)."""
    from helpers import free_port, start_server

    address = f"127.0.0.1:{free_port()}"
    model = StandIn()
    rank = RankLoader(lambda: AttachConfig(server=address, engine_name="restarted"), RankPlace(), "")
    server = start_server(tmp_path, "--listen", address, workers=1)
    try:
        with sdk_client(server) as trainer:
            g1 = trainer.push(version(1), version="r1", transport="inline", allow_new_tensors=True).servers[0].generation
            g2 = trainer.push({"norm.weight": version(2)["norm.weight"]}, version="r2",
                              transport="inline").servers[0].generation
        rank.load(model, entry(UpdateRequest(generation=g2)))
        assert sorted(model.fed) == sorted(NAMES)
        assert server.stop() == 0

        model.fed.clear()
        with pytest.raises(LoadError) as down:
            rank.load(model, entry(UpdateRequest(generation=g2 + 1, since_generation=g2, wait_s=1.0)))
        assert down.value.reason == "SERVER_UNREACHABLE", down.value
        assert model.fed == []

        server = start_server(tmp_path, "--listen", address, workers=1)
        with sdk_client(server) as trainer:
            trainer.push(version(3), version="r3", transport="inline", allow_new_tensors=True)
            g_new = trainer.push({"norm.weight": version(4)["norm.weight"]}, version="r4",
                                 transport="inline").servers[0].generation
        assert g_new == g2  # a new store counts from the start again: the rank's record of g2 is the old store's
        stats = rank.load(model, entry(UpdateRequest(generation=g_new, since_generation=g1)))
        assert (stats.version, stats.since_generation) == ("r4", -1)
        assert sorted(model.fed) == sorted(NAMES)
        expected = {**version(3), "norm.weight": version(4)["norm.weight"]}
        assert all(torch.equal(model.as_checkpoint()[n], expected[n]) for n in NAMES)
        status = engines(server)["restarted"]
        assert (status.applied_version.version, status.applied_version.generation) == ("r4", g_new)
    finally:
        server.stop()


def test_a_generation_the_store_has_not_committed_is_not_called_gone(node, tmp_path):
    """A request naming a later generation than the store's: VERSION_NOT_COMMITTED with both numbers (it was
    VERSION_GONE, which says the store moved past it); nothing fed; the current one then loads."""
    model, rank = StandIn(), loader_for(node, tmp_path, "future")
    with sdk_client(node) as trainer:
        current = trainer.push(version(7), version="v7", transport="inline",
                               allow_new_tensors=True).servers[0].generation
    with pytest.raises(LoadError) as future:
        rank.load(model, entry(UpdateRequest(generation=current + 5)))
    assert (future.value.reason, future.value.detail) == (
        "VERSION_NOT_COMMITTED", f"the version not loaded, the engine keeps its weights: rank tp0/1 refused: "
        f"VERSION_NOT_COMMITTED: generation {current + 5} is not committed; the store holds generation {current} (a "
        "later one, or one of the store before this server started)")
    assert model.fed == []
    rank.load(model, entry(UpdateRequest(generation=current)))
    assert sorted(model.fed) == sorted(NAMES)
    assert all(torch.equal(model.as_checkpoint()[n], version(7)[n]) for n in NAMES)
