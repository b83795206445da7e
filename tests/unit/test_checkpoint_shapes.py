"""The checkpoint-shape check both engine backends run before loading (engine/checkpoint_shapes.py).

A literal table against the headers of a tiny Qwen2-like checkpoint with grouped-query attention
(k/v smaller than q: a check that compared against the fused qkv_proj, or against q_proj's shape,
would take a wrong k_proj) and tied embeddings (no lm_head.weight in the checkpoint: nothing to
compare, the backend's name check decides). Then the headers as read from real safetensors files.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from weightsync.engine.checkpoint_shapes import safetensors_shapes, shape_problem

CHECKPOINT = {
    "model.embed_tokens.weight": (32, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.self_attn.k_proj.weight": (4, 8),
    "model.layers.0.self_attn.v_proj.weight": (4, 8),
    "model.layers.0.self_attn.q_proj.bias": (8,),
    "model.layers.0.self_attn.k_proj.bias": (4,),
    "model.layers.0.self_attn.o_proj.weight": (8, 8),
    "model.layers.0.mlp.gate_proj.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (16, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 16),
    "model.norm.weight": (8,),
    "model.scale": (),
}


@pytest.mark.parametrize("name, shape, problem", [
    # Parts of a fused qkv_proj / gate_up_proj: each against its own checkpoint shape.
    ("model.layers.0.self_attn.q_proj.weight", (8, 8), None),
    ("model.layers.0.self_attn.k_proj.weight", (4, 8), None),
    ("model.layers.0.self_attn.k_proj.weight", (8, 8),
     "'model.layers.0.self_attn.k_proj.weight' (model [4, 8], store [8, 8])"),
    ("model.layers.0.self_attn.qkv_proj.weight", (16, 8), None),  # not a checkpoint name: the name check's
    ("model.layers.0.self_attn.k_proj.bias", (8,), "'model.layers.0.self_attn.k_proj.bias' (model [4], store [8])"),
    ("model.layers.0.mlp.gate_proj.weight", (16, 8), None),
    ("model.layers.0.mlp.up_proj.weight", (8, 16),
     "'model.layers.0.mlp.up_proj.weight' (model [16, 8], store [8, 16])"),  # transposed: same count, refused
    ("model.layers.0.mlp.down_proj.weight", (8, 16), None),
    # Tied embeddings: the checkpoint has no lm_head.weight, so there is no shape to hold it to.
    ("lm_head.weight", (32, 8), None),
    ("model.embed_tokens.weight", (33, 8), "'model.embed_tokens.weight' (model [32, 8], store [33, 8])"),
    # Rank: a flattened or a 0-d tensor is not the checkpoint's.
    ("model.norm.weight", (8,), None),
    ("model.norm.weight", (1, 8), "'model.norm.weight' (model [8], store [1, 8])"),
    ("model.scale", (), None),
    ("model.scale", (1,), "'model.scale' (model [], store [1])"),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", (4,), None),  # not in the checkpoint
])
def test_shape_problem(name, shape, problem):
    assert shape_problem(CHECKPOINT, name, shape) == problem
    assert shape_problem(CHECKPOINT, name, torch.Size(shape)) == problem  # what the backends pass


def test_no_checkpoint_checks_names_only():
    assert shape_problem(None, "model.norm.weight", (1, 2, 3)) is None
    assert shape_problem({}, "model.norm.weight", (1, 2, 3)) is None


def test_headers_of_every_shard_in_name_order(tmp_path):
    save_file({"b": torch.zeros(2, 3), "shared": torch.zeros(5)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"a": torch.zeros(4, dtype=torch.bfloat16), "shared": torch.zeros(6),
               "scalar": torch.tensor(1.0)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    assert safetensors_shapes(str(tmp_path)) == {"b": (2, 3), "shared": (5,), "a": (4,), "scalar": ()}


def test_no_headers_is_names_only(tmp_path):
    assert safetensors_shapes("") is None
    assert safetensors_shapes(str(tmp_path / "missing")) is None
    assert safetensors_shapes(str(tmp_path)) is None  # a directory without safetensors files
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)  # a header length past the file's end
    assert safetensors_shapes(str(tmp_path)) is None
