"""LMDeploy's model classes with weightsync's request understood by their `load_weights`.

LMDeploy loads these in place of its own when its engine is built with weightsync's custom module
map (module_map.py): `PytorchEngineConfig(custom_module_map=MODULE_MAP_PATH)`, LMDeploy 0.18's Python
API only (its CLI has no flag for it). Each is LMDeploy's own class, unchanged, except that
`load_weights` also takes one pair ("weightsync.update", int64 tensor [format, generation,
since_generation, wait_ms, strict]) (engine/request.py's format): on it the rank
loads that version from the node's store (loader.py), every other pair going to LMDeploy's own
`load_weights` as before, and LMDeploy's own finalisation (`process_weights_after_loading`, graph
reset) runs after it as after any bucket. Nothing is unpickled by weightsync.

Which of LMDeploy 0.18's routes can hand a model agent that pair: `/update_weights_from_distributed`
(Ray executor, CUDA: names ["weightsync.update"], dtypes ["int64"], shapes [[5]] in its JSON, the
five numbers broadcast by the trainer over the NCCL group `/init_weights_update_group` made; not
run here: it needs Ray and GPUs). Not `/update_weights`: it rebuilds every value from a CUDA IPC
handle it unpickles, so it cannot carry a plain tensor; not `/update_weights_from_ipc`
(checkpoint-engine's ZMQ buckets of CUDA memory). What runs on one GPU without any route is
pipeline.py's in-process load.

This module imports LMDeploy: only LMDeploy imports it (by the qualified names module_map.py lists).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from lmdeploy.pytorch.models.llama import LlamaForCausalLM as _Llama
from lmdeploy.pytorch.models.mistral import MistralForCausalLM as _Mistral
from lmdeploy.pytorch.models.qwen2 import Qwen2ForCausalLM as _Qwen2
from lmdeploy.pytorch.models.qwen3 import Qwen3ForCausalLM as _Qwen3

from weightsync.engine.lmdeploy.loader import LoadError, rank_loader, request_of
from weightsync.engine.request import REQUEST_NAME


class WeightsyncLoading:
    """Mixin before an LMDeploy model class: its load_weights also loads a version from the store."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        requests: list[tuple[str, torch.Tensor]] = []

        def checkpoint_pairs() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == REQUEST_NAME:
                    requests.append((name, tensor))
                else:
                    yield name, tensor

        super().load_weights(checkpoint_pairs())  # type: ignore[misc]
        if not requests:
            return
        if len(requests) > 1:
            raise LoadError("REQUEST_MALFORMED", f"{len(requests)} weightsync requests in one bucket, expected one")
        config = getattr(self, "config", None)
        loader = rank_loader(str(getattr(config, "_name_or_path", "") or ""))
        loader.load(self, request_of(requests), post_load=False)  # type: ignore[arg-type]


class Qwen2ForCausalLM(WeightsyncLoading, _Qwen2):
    """LMDeploy's Qwen2ForCausalLM; load_weights also takes weightsync's request."""


class Qwen3ForCausalLM(WeightsyncLoading, _Qwen3):
    """LMDeploy's Qwen3ForCausalLM; load_weights also takes weightsync's request."""


class LlamaForCausalLM(WeightsyncLoading, _Llama):
    """LMDeploy's LlamaForCausalLM; load_weights also takes weightsync's request."""


class MistralForCausalLM(WeightsyncLoading, _Mistral):
    """LMDeploy's MistralForCausalLM; load_weights also takes weightsync's request."""
