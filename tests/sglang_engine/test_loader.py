"""The SGLang loader against a real weightsync server, with a stand-in for SGLang's model.

Runs without SGLang (make test's .venv as well as .venv-sglang): the stand-in has what the loader
uses of an SGLang model, fused parameters (qkv_proj) and a `load_weights` that fills their parts
(as SGLang's do), and records what it was fed. Two ranks agreeing over a real Gloo group run as two
processes. What only SGLang itself shows is in test_sglang_server.py.
"""

from __future__ import annotations

import pickletools

import pytest
import torch
from safetensors.torch import save_file

from weightsync.engine.sglang import UpdateRequest, update_body
from weightsync.engine.sglang.loader import AttachConfig, LoadError, RankLoader, RankPlace
from weightsync.engine.sglang.request import REQUEST_NAME, RequestError
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
