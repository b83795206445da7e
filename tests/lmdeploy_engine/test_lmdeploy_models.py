"""LMDeploy 0.18.0's own PyTorch-engine model classes, built on CPU, loading from a real node store.

A real weightsync server (its own process) holds what a trainer pushed (the SDK, a real push).
LMDeploy's Qwen2ForCausalLM and LlamaForCausalLM are built from a Hugging Face config with
LMDeploy's own builder (build_model_from_hf_config, device cpu): q/k/v fused into qkv_proj and
gate/up into gate_up_proj by LMDeploy's own load_weights. Each load is checked byte for byte
against the pushed tensors, fused parameters included; a refused version leaves every byte of the
model as it was, and the next push loads and verifies.

What only a GPU shows (LMDeploy's engine and pipeline, tokens after an update) is in
tests/gpu/test_lmdeploy_engine.py: LMDeploy's engine refuses device_type "cpu".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmdeploy.pytorch.models.qwen2", reason="LMDeploy is not installed here (make test-lmdeploy "
                    "runs this in .venv-lmdeploy)")

from lmdeploy.pytorch.models.module_map import CUSTOM_MODULE_MAP  # noqa: E402
from lmdeploy.pytorch.models.patch import build_model_from_hf_config, update_custom_module_map  # noqa: E402
from lmdeploy.pytorch.models.qwen2 import Qwen2ForCausalLM as LMDeployQwen2  # noqa: E402
from lmdeploy.pytorch.weight_loader.model_weight_loader import (  # noqa: E402
    ModelWeightLoader,
    process_weights_after_loading,
)
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from weightsync.engine.lmdeploy import MODULE_MAP_PATH, REQUEST_NAME, UpdateRequest  # noqa: E402
from weightsync.engine.lmdeploy import loader as lmdeploy_loader  # noqa: E402
from weightsync.engine.lmdeploy.loader import AttachConfig, LoadError, RankLoader, RankPlace  # noqa: E402
from weightsync.engine.lmdeploy.pipeline import model_agent_of  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server, sdk_client  # noqa: E402

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, VOCAB = 64, 4, 2, 96, 2, 128
HEAD_DIM = HIDDEN // HEADS


def hf_config(arch: str, inter: int = INTER) -> dict:
    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": inter, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32", "architectures": [arch]}
    if arch == "Qwen2ForCausalLM":
        return {**common, "model_type": "qwen2"}
    return {**common, "model_type": "llama", "attention_bias": False}


def checkpoint(arch: str, seed: int, inter: int = INTER) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's (Hugging Face) names, unfused."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN),
               "lm_head.weight": rand(VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        tensors |= {f"{p}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
                    f"{p}.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                    f"{p}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                    f"{p}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
                    f"{p}.mlp.gate_proj.weight": rand(inter, HIDDEN), f"{p}.mlp.up_proj.weight": rand(inter, HIDDEN),
                    f"{p}.mlp.down_proj.weight": rand(HIDDEN, inter),
                    f"{p}.input_layernorm.weight": rand(HIDDEN), f"{p}.post_attention_layernorm.weight": rand(HIDDEN)}
        if arch == "Qwen2ForCausalLM":
            tensors |= {f"{p}.self_attn.{x}_proj.bias": rand(n * HEAD_DIM)
                        for x, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    return tensors


def model_dir(tmp_path: Path, arch: str, inter: int = INTER) -> Path:
    """A model directory as LMDeploy starts from: config.json and a safetensors checkpoint (seed 0)."""
    directory = tmp_path / f"{arch}-{inter}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config(arch, inter)))
    save_file(checkpoint(arch, 0, inter), str(directory / "model.safetensors"))
    return directory


def build(directory: Path) -> torch.nn.Module:
    """LMDeploy's own model for `directory`, on CPU, loaded from its checkpoint by LMDeploy's loader."""
    config = AutoConfig.from_pretrained(str(directory))
    model = build_model_from_hf_config(config, dtype=torch.float32, device=torch.device("cpu"))
    ModelWeightLoader(str(directory)).load_model_weights(model)
    process_weights_after_loading(model)
    return model


def expected_params(tensors: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """LMDeploy's parameters (TP 1) for checkpoint `tensors`: q/k/v and gate/up concatenated."""
    out = {n: t for n, t in tensors.items() if not any(f".{x}_proj." in n for x in ("q", "k", "v", "gate", "up"))}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        out[f"{p}.self_attn.qkv_proj.weight"] = torch.cat([tensors[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
        if arch == "Qwen2ForCausalLM":
            out[f"{p}.self_attn.qkv_proj.bias"] = torch.cat([tensors[f"{p}.self_attn.{x}_proj.bias"] for x in "qkv"])
        out[f"{p}.mlp.gate_up_proj.weight"] = torch.cat([tensors[f"{p}.mlp.{x}_proj.weight"] for x in ("gate", "up")])
    return out


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().numpy().tobytes()


def assert_bytes(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(expected)
    wrong = [n for n, t in expected.items() if raw(params[n]) != raw(t)]
    assert not wrong, f"parameters whose bytes are not the pushed ones: {wrong}"


def snapshot_bytes(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: raw(p) for n, p in model.named_parameters()}


def engines(node) -> dict[str, pb.EngineStatus]:
    return {e.name: e for e in node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).engines}


def loader_for(node, directory: Path, name: str) -> RankLoader:
    return RankLoader(lambda: AttachConfig(server=node.address, engine_name=name), RankPlace(), str(directory))


@pytest.fixture
def node(tmp_path_factory):
    """A node of its own per test: the store keeps every name it ever received."""
    with running_server(tmp_path_factory.mktemp("node"), workers=1) as server:
        yield server


@pytest.fixture
def weightsync_module_map():
    """LMDeploy's CUSTOM_MODULE_MAP with weightsync's file loaded, as a model agent given
    custom_module_map=MODULE_MAP_PATH loads it; restored afterwards."""
    before = dict(CUSTOM_MODULE_MAP)
    update_custom_module_map(MODULE_MAP_PATH)
    yield
    CUSTOM_MODULE_MAP.clear()
    CUSTOM_MODULE_MAP.update(before)


def test_qwen2_loads_pushed_versions_fused_byte_for_byte_and_refuses_before_a_byte_moves(node, tmp_path):
    arch = "Qwen2ForCausalLM"
    model = build(model_dir(tmp_path, arch))
    assert type(model) is LMDeployQwen2 and "qkv_proj" in dict(model.named_modules())["model.layers.0.self_attn"]._modules
    rank = loader_for(node, tmp_path / f"{arch}-{INTER}", "lmdeploy-qwen2")
    with sdk_client(node) as trainer:
        v1 = checkpoint(arch, 1)
        g1 = trainer.push(v1, version="v1", transport="inline", allow_new_tensors=True).servers[0].generation
        stats = rank.load(model, UpdateRequest(generation=g1))
        assert (stats.generation, stats.tensors, stats.since_generation) == (g1, len(v1), -1)
        assert_bytes(model, expected_params(v1, arch))
        status = engines(node)["lmdeploy-qwen2"]
        assert (status.applied_version.version, status.applied_version.generation) == ("v1", g1)

        # A partial push: one part of a fused qkv_proj and one of a gate_up_proj; only those rows move.
        part = {"model.layers.1.self_attn.k_proj.weight": checkpoint(arch, 2)["model.layers.1.self_attn.k_proj.weight"],
                "model.layers.0.mlp.up_proj.weight": checkpoint(arch, 2)["model.layers.0.mlp.up_proj.weight"]}
        g2 = trainer.push(part, version="v2", transport="inline").servers[0].generation
        stats = rank.load(model, UpdateRequest(generation=g2, since_generation=g1))
        assert (stats.tensors, stats.since_generation) == (2, g1)
        v2 = v1 | part
        assert_bytes(model, expected_params(v2, arch))

        # A name the model does not take: refused with its reason before one byte moves.
        before = snapshot_bytes(model)
        bad = {"model.layers.0.self_attn.o_proj.weight": checkpoint(arch, 3)["model.layers.0.self_attn.o_proj.weight"],
               "model.layers.0.self_attn.extra_proj.weight": torch.ones(4, 4)}
        g3 = trainer.push(bad, version="bad", transport="inline", allow_new_tensors=True).servers[0].generation
        with pytest.raises(LoadError) as refused:
            rank.load(model, UpdateRequest(generation=g3, since_generation=g2))
        assert refused.value.reason == "TENSOR_NOT_IN_MODEL"
        assert "'model.layers.0.self_attn.extra_proj.weight'" in str(refused.value) and "Qwen2ForCausalLM" in str(refused.value)
        assert snapshot_bytes(model) == before
        status = engines(node)["lmdeploy-qwen2"]
        assert status.applied_version.generation == g2 and "TENSOR_NOT_IN_MODEL" in status.last_error

        # The next push loads, with the refused version's o_proj, skipping the stale unknown name.
        norm = {"model.norm.weight": checkpoint(arch, 4)["model.norm.weight"]}
        g4 = trainer.push(norm, version="v4", transport="inline").servers[0].generation
        stats = rank.load(model, UpdateRequest(generation=g4, since_generation=g2))
        assert stats.skipped == ["model.layers.0.self_attn.extra_proj.weight"] and stats.tensors == 2
        v4 = v2 | norm | {"model.layers.0.self_attn.o_proj.weight": bad["model.layers.0.self_attn.o_proj.weight"]}
        assert_bytes(model, expected_params(v4, arch))
        assert engines(node)["lmdeploy-qwen2"].applied_version.generation == g4


def test_a_shape_the_model_does_not_have_is_refused_then_the_next_push_loads(node, tmp_path):
    """An LMDeploy Llama with a smaller MLP than the pushed model: TENSOR_MISMATCH, nothing moved."""
    arch = "LlamaForCausalLM"
    small = build(model_dir(tmp_path, arch, inter=80))
    rank = loader_for(node, tmp_path / f"{arch}-80", "lmdeploy-llama-small")
    with sdk_client(node) as trainer:
        g = trainer.push(checkpoint(arch, 5), version="llama96", transport="inline",
                         allow_new_tensors=True).servers[0].generation
    before = snapshot_bytes(small)
    with pytest.raises(LoadError) as refused:
        rank.load(small, UpdateRequest(generation=g))
    assert refused.value.reason == "TENSOR_MISMATCH"
    assert "'model.layers.0.mlp.down_proj.weight' (model [64, 80], store [64, 96])" in str(refused.value)
    assert snapshot_bytes(small) == before
    assert "TENSOR_MISMATCH" in engines(node)["lmdeploy-llama-small"].last_error
    # The same store into a Llama of the pushed shape: the next load goes through, fused exact.
    fitting = build(model_dir(tmp_path, arch))
    rank = loader_for(node, tmp_path / f"{arch}-{INTER}", "lmdeploy-llama")
    with sdk_client(node) as trainer:
        layer = {"model.layers.1.mlp.gate_proj.weight": checkpoint(arch, 6)["model.layers.1.mlp.gate_proj.weight"]}
        g2 = trainer.push(layer, version="llama-next", transport="inline").servers[0].generation
    stats = rank.load(fitting, UpdateRequest(generation=g2))
    assert stats.generation == g2 and not stats.skipped
    tensors = checkpoint(arch, 5) | layer
    assert_bytes(fitting, expected_params(tensors, arch))


def test_the_module_map_builds_lmdeploys_class_whose_load_weights_takes_the_request(node, tmp_path, monkeypatch,
                                                                                    weightsync_module_map):
    """What an LMDeploy model agent given custom_module_map=MODULE_MAP_PATH does with a bucket that
    carries weightsync's request (as its update routes hand buckets to load_weights)."""
    arch = "Qwen2ForCausalLM"
    directory = model_dir(tmp_path, arch)
    model = build(directory)
    assert type(model).__module__ == "weightsync.engine.lmdeploy.models" and isinstance(model, LMDeployQwen2)
    assert_bytes(model, expected_params(checkpoint(arch, 0), arch))  # LMDeploy's own start-up load is unchanged
    monkeypatch.setenv("WEIGHTSYNC_SERVER", node.address)
    monkeypatch.setenv("WEIGHTSYNC_ENGINE_NAME", "lmdeploy-routed")
    monkeypatch.setattr(lmdeploy_loader, "_RANK", None)

    def bucket(request: UpdateRequest) -> None:  # LMDeploy's _load_updated_weight_bucket, then its finalisation
        model.load_weights(ModelWeightLoader._rename_weights_iterator([(REQUEST_NAME, request.to_tensor())], model))
        process_weights_after_loading(model)

    with sdk_client(node) as trainer:
        v7 = checkpoint(arch, 7) | {"value_head.weight": torch.ones(1, HIDDEN)}  # a name the model lacks
        g = trainer.push(v7, version="routed", transport="inline", allow_new_tensors=True).servers[0].generation
    # Strict refuses the version for the unknown name (nothing moves); lenient skips it.
    before = snapshot_bytes(model)
    with pytest.raises(LoadError) as refused:
        bucket(UpdateRequest(generation=g))
    assert refused.value.reason == "TENSOR_NOT_IN_MODEL" and snapshot_bytes(model) == before
    bucket(UpdateRequest(generation=g, strict=False))
    assert lmdeploy_loader.rank_loader().model_path == str(directory)
    assert lmdeploy_loader.rank_loader().last.skipped == ["value_head.weight"]
    assert_bytes(model, expected_params(checkpoint(arch, 7), arch))
    assert engines(node)["lmdeploy-routed"].applied_version.version == "routed"
    with pytest.raises(LoadError) as malformed:
        model.load_weights([(REQUEST_NAME, torch.tensor([1, 2, 3]))])
    assert malformed.value.reason == "REQUEST_MALFORMED"


def test_a_rank_reaches_a_restarted_server_again_and_loads_the_next_version(tmp_path):
    """The weightsync server stops and starts again on the same address (a new local socket, a new store).
    LMDeploy's Qwen2 rank attaches again at its next load and takes every tensor of the new store's version
    (it failed LOAD_FAILED on its dead connection for the life of the engine process), fused byte for byte."""
    from helpers import free_port, start_server

    arch = "Qwen2ForCausalLM"
    directory = model_dir(tmp_path, arch)
    model = build(directory)
    address = f"127.0.0.1:{free_port()}"
    rank = RankLoader(lambda: AttachConfig(server=address, engine_name="lmdeploy-restarted"), RankPlace(),
                      str(directory))
    server = start_server(tmp_path, "--listen", address, workers=1)
    try:
        with sdk_client(server) as trainer:
            v1 = checkpoint(arch, 1)
            g1 = trainer.push(v1, version="v1", transport="inline", allow_new_tensors=True).servers[0].generation
        assert rank.load(model, UpdateRequest(generation=g1)).tensors == len(v1)
        assert_bytes(model, expected_params(v1, arch))
        assert server.stop() == 0
        server = start_server(tmp_path, "--listen", address, workers=1)
        with sdk_client(server) as trainer:
            v2 = checkpoint(arch, 2)
            g2 = trainer.push(v2, version="v2", transport="inline", allow_new_tensors=True).servers[0].generation
        stats = rank.load(model, UpdateRequest(generation=g2))
        assert (stats.version, stats.since_generation, stats.tensors) == ("v2", -1, len(v2))
        assert_bytes(model, expected_params(v2, arch))
        status = engines(server)["lmdeploy-restarted"]
        assert (status.applied_version.version, status.applied_version.generation) == ("v2", g2)
    finally:
        server.stop()


class RankZeroOfTwo(RankLoader):
    """Rank 0 of TP 2, the other rank's verdicts scripted (LMDeploy's Gloo exchange needs its engine)."""

    def __init__(self, rank: RankLoader, other: list[str]) -> None:
        super().__init__(rank._config_source, RankPlace(0, 2), rank.model_path)  # noqa: SLF001
        self.other = other

    def _agree(self, verdict: str) -> list[tuple[str, str]]:
        return [(self.place.label, verdict), ("tp1/2", self.other.pop(0))]


def test_a_failed_load_or_a_refusing_rank_is_typed_and_the_next_load_takes_what_it_must(node, tmp_path):
    arch = "Qwen2ForCausalLM"
    directory = model_dir(tmp_path, arch)
    model = build(directory)
    failures: list[str] = []

    def post_load(target: torch.nn.Module) -> None:
        if failures:
            raise RuntimeError(failures.pop())
        process_weights_after_loading(target)

    rank = RankLoader(lambda: AttachConfig(server=node.address, engine_name="lmdeploy-fail"), RankPlace(), str(directory),
                      post_load=post_load)
    with sdk_client(node) as trainer:
        v1 = checkpoint(arch, 8)
        g1 = trainer.push(v1, version="f1", transport="inline", allow_new_tensors=True).servers[0].generation
        assert rank.load(model, UpdateRequest(generation=g1)).tensors == len(v1) and rank.served[id(model)][1] == g1
        # LMDeploy's post-load processing raises after load_weights ran: LOAD_FAILED, the weights a mix.
        failures.append("post-load broke")
        up = {"model.layers.1.mlp.up_proj.weight": checkpoint(arch, 9)["model.layers.1.mlp.up_proj.weight"]}
        g2 = trainer.push(up, version="f2", transport="inline").servers[0].generation
        with pytest.raises(LoadError) as failed:
            rank.load(model, UpdateRequest(generation=g2, since_generation=g1))
        assert failed.value.reason == "LOAD_FAILED" and "RuntimeError: post-load broke" in str(failed.value)
        status = engines(node)["lmdeploy-fail"]
        assert "LOAD_FAILED" in status.last_error and status.applied_version.generation == g1
        # The next version: the caller says the engine has g2, but the rank knows its weights are a
        # mix and takes every tensor.
        part = {"model.layers.0.mlp.gate_proj.weight": checkpoint(arch, 9)["model.layers.0.mlp.gate_proj.weight"]}
        g3 = trainer.push(part, version="f3", transport="inline").servers[0].generation
        stats = rank.load(model, UpdateRequest(generation=g3, since_generation=g2))
        assert (stats.since_generation, stats.tensors) == (-1, len(v1))
        v3 = v1 | up | part
        assert_bytes(model, expected_params(v3, arch))
        # Rank 1 refuses: rank 0 loads nothing and says why.
        before = snapshot_bytes(model)
        two = RankZeroOfTwo(rank, ["TENSOR_MISMATCH: rank 1's shard does not fit"])
        two.served[id(model)] = rank.served[id(model)]  # as rank 0 loaded it: g3, in this store
        g4 = trainer.push({"model.norm.weight": checkpoint(arch, 10)["model.norm.weight"]}, version="f4",
                          transport="inline").servers[0].generation
        with pytest.raises(LoadError) as refused:
            two.load(model, UpdateRequest(generation=g4, since_generation=g3))
        assert refused.value.reason == "RANK_REFUSED" and "rank tp1/2 refused: TENSOR_MISMATCH" in str(refused.value)
        assert snapshot_bytes(model) == before
        two.other = ["", ""]
        assert two.load(model, UpdateRequest(generation=g4, since_generation=g3)).tensors == 1
        assert_bytes(model, expected_params(v3 | {"model.norm.weight": checkpoint(arch, 10)["model.norm.weight"]}, arch))


def test_configuration_is_checked():
    with pytest.raises(LoadError, match="CONFIG_INVALID"):
        AttachConfig.from_environment({})
    with pytest.raises(LoadError, match="CONFIG_INVALID"):
        AttachConfig.from_environment({"WEIGHTSYNC_SERVER": "nohost"})
    assert AttachConfig.from_environment({"WEIGHTSYNC_SERVER": "h:1"}).engine_name == "lmdeploy"
    assert [RankPlace(r, 2).engine_name("e") for r in range(2)] == ["e", "e:tp1"]
    with pytest.raises(LoadError, match="CONFIG_INVALID"):
        RankPlace(2, 2)
    with pytest.raises(LoadError, match="CONFIG_INVALID: in-process loading needs"):
        model_agent_of(object())
