"""Read and write safetensors checkpoints (memory-mapped; never pickle)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file


class CheckpointError(Exception):
    """A checkpoint could not be read."""


def load_checkpoints(paths: Sequence[str | Path]) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, in file order; a name in two shards is an error."""
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in tensors:
                        raise CheckpointError(f"{path}: tensor {name!r} also appears in an earlier checkpoint")
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{path}: not a valid safetensors file ({error})") from error
    if not tensors:
        raise CheckpointError("the checkpoints hold no tensors")
    return tensors


def save_checkpoint(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
