"""What SGLang's /weights_checker should report for a tiny Qwen2, computed from the pushed tensors.

SGLang's checksum of a parameter (sglang/srt/utils/weight_checker.py, CPU path) is the first 8
bytes of the SHA-256 of its bytes, contiguous, as 16 hex digits. Its parameters on TP rank r of
N are the checkpoint's tensors sharded and fused as SGLang's parallel layers do (written out
here from the layer definitions, so that a wrong shard shows as a wrong checksum):

  embed_tokens, lm_head (vocab-parallel)     rows  [r*V/N, (r+1)*V/N)  (V a multiple of 64*N here)
  qkv_proj (weight, bias)                    q rows of rank r, then k rows, then v rows
  gate_up_proj                               gate rows of rank r, then up rows
  o_proj, down_proj (row-parallel)           columns of rank r
  norms                                      whole
"""

from __future__ import annotations

import hashlib

import torch

COLUMN_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def checksum(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def rows(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    assert tensor.shape[0] % size == 0, (list(tensor.shape), size)
    part = tensor.shape[0] // size
    return tensor[rank * part : (rank + 1) * part]


def columns(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    assert tensor.shape[1] % size == 0, (list(tensor.shape), size)
    part = tensor.shape[1] // size
    return tensor[:, rank * part : (rank + 1) * part]


def rank_parameters(state: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """SGLang's parameters of TP rank `rank` of `size` for the HF Qwen2 state dict `state`."""
    out: dict[str, torch.Tensor] = {}
    fused_parts = {part: fused for fused, parts in COLUMN_FUSED.items() for part in parts}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if name in VOCAB_PARALLEL:
            out[name] = rows(tensor, rank, size)
        elif last in fused_parts:
            pending.setdefault(f"{parent}.{fused_parts[last]}.{leaf}", {})[last] = rows(tensor, rank, size)
        elif last in ROW_PARALLEL and leaf == "weight":
            out[name] = columns(tensor, rank, size)
        else:
            out[name] = tensor
    for name, parts in pending.items():
        fused = name.rpartition(".")[0].rpartition(".")[2]
        out[name] = torch.cat([parts[p] for p in COLUMN_FUSED[fused]])
    return out


def expected_checksums(state: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, str]:
    return {name: checksum(t) for name, t in rank_parameters(state, rank, size).items()}
