"""The shapes of the checkpoint an engine started from, and whether a stored tensor fits them.

vLLM's and SGLang's models keep their parameters sharded over tensor-parallel ranks and fused
(q/k/v into qkv_proj, gate/up into gate_up_proj), and on CPU vLLM's packed linear layers even
drop their `.weight`: a model's own parameter shapes cannot say whether a checkpoint tensor
fits. The checkpoint the engine loaded at start can: its safetensors headers name every tensor
in the checkpoint's own (unfused, unsharded) layout, the layout the node's store holds too. Both
engine backends (engine/vllm_backend.py, engine/sglang/loader.py) read the headers once with
`safetensors_shapes` and check each changed tensor with `shape_problem` before one byte moves.

`shape_problem` is pure: a name the checkpoint does not list (a tied `lm_head.weight`, a tensor
the model does not take at all) has no shape to check and is left to the backend's name check;
so is every name when the headers could not be read (None: names only).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence

from weightsync.common.logging import get_logger

logger = get_logger("weightsync.engine")

CheckpointShapes = Mapping[str, tuple[int, ...]]
"""Checkpoint tensor name -> its whole shape (as the safetensors header says)."""


def shape_problem(checkpoint: CheckpointShapes | None, name: str, shape: Sequence[int]) -> str | None:
    """What is wrong with a stored tensor `name` of `shape` for this checkpoint, or None if it fits
    or there is nothing to compare it with (no checkpoint, or a name the checkpoint lacks)."""
    expected = (checkpoint or {}).get(name)
    if expected is not None and tuple(shape) != tuple(expected):
        return f"{name!r} (model {list(expected)}, store {list(shape)})"
    return None


def safetensors_shapes(directory: str) -> dict[str, tuple[int, ...]] | None:
    """name -> shape of the safetensors checkpoint in `directory` (every *.safetensors file, in name
    order; a name in two files keeps the first file's shape). None where there is no such
    directory or file, or a header cannot be read (the backend then checks names only)."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors"))) if directory and os.path.isdir(directory) else []
    if not files:
        return None
    try:
        from safetensors import safe_open
    except ImportError:  # no safetensors: names only
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for file in files:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes.setdefault(key, tuple(handle.get_slice(key).get_shape()))
    except Exception as error:  # noqa: BLE001 - an unreadable header: names only
        logger.warning("checkpoint_headers_unreadable", directory=directory, error=str(error))
        return None
    return shapes
