"""The checkpoint names a vLLM model's load_weights takes, checked before anything is loaded.

engine/vllm_backend.py checks every tensor of a version against these before it touches the
model (TENSOR_NOT_IN_MODEL, TENSOR_MISMATCH), and groups names by the vLLM layer they load
into, so that a fused layer is always loaded whole.
"""

from __future__ import annotations

import os
import re

import torch

from weightsync.engine.checkpoint_shapes import safetensors_shapes, shape_problem

# Tensors vLLM's AutoWeightsLoader drops by itself (old checkpoints carry them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq", "rotary_emb.cos_cached",
                    "rotary_emb.sin_cached")
EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


class ModelNames:
    """The checkpoint names a vLLM model's load_weights takes, and their shapes where known.

    Shapes come from the checkpoint vLLM loaded (safetensors headers, read once); names also
    from the model itself: its parameters and persistent buffers (tied aliases included),
    reached directly, through the model's hf_to_vllm_mapper, or through packed_modules_mapping
    (q_proj -> qkv_proj, ...). vLLM's own parameter shapes cannot be used: they are sharded,
    fused, and on CPU the packed linear weights are empty.
    """

    def __init__(self, model: torch.nn.Module, model_config) -> None:
        self.model_class = type(model).__name__
        self.params = set(model.state_dict(keep_vars=True).keys())
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.packed = {part: fused for fused, parts in packed.items() for part in parts}
        self.checkpoint = _checkpoint_shapes(model_config)
        self._mapped: dict[str, str | None] = {}

    def vllm_name(self, name: str) -> str | None:
        """The model parameter `name` lands in (None: vLLM drops it on purpose)."""
        if name in self._mapped:
            return self._mapped[name]
        result: str | None = name if name in self.params else ""
        if result == "" and self.mapper is not None:
            try:
                mapped = self.mapper.map_name(name)
            except Exception:  # noqa: BLE001 - a mapper that cannot map it: try the other ways
                mapped = ""
            if mapped is None or mapped in self.params:
                result = mapped
        if result == "":
            module, _, leaf = name.rpartition(".")
            parent, _, last = module.rpartition(".")
            fused = self.packed.get(last)
            if fused is not None and f"{parent}.{fused}.{leaf}".lstrip(".") in self.params:
                result = f"{parent}.{fused}.{leaf}".lstrip(".")
        if result == "" and name.endswith(IGNORED_SUFFIXES):
            result = None
        self._mapped[name] = result
        return result

    def known(self, name: str) -> bool:
        return name in (self.checkpoint or {}) or self.vllm_name(name) != ""

    def shape_problem(self, name: str, tensor: torch.Tensor) -> str | None:
        return shape_problem(self.checkpoint, name, tensor.shape)

    def group(self, name: str) -> str:
        """The vLLM layer a checkpoint tensor loads into: names of one group are loaded together."""
        target = self.vllm_name(name) or name
        module = target.rpartition(".")[0]
        return EXPERT_INDEX.sub(".experts.", module + ".").rstrip(".")


def _checkpoint_shapes(model_config) -> dict[str, tuple[int, ...]] | None:
    """name -> shape of the safetensors checkpoint vLLM loaded; None if it cannot be found."""
    path = str(getattr(model_config, "model", "") or "")
    directory = path if os.path.isdir(path) else None
    if directory is None and path:
        try:  # a hub id: the files vLLM downloaded are in the local cache
            from huggingface_hub import snapshot_download

            directory = snapshot_download(path, revision=getattr(model_config, "revision", None),
                                          allow_patterns=["*.safetensors"], local_files_only=True)
        except Exception:  # noqa: BLE001 - no local copy: names only
            return None
    return safetensors_shapes(directory or "")
