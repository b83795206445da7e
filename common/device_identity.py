"""Which GPU is which: a GPU's UUID is the same in every process, its ordinal is not.

A CUDA ordinal ("cuda:0") means something only inside one process: it depends on that
process's CUDA_VISIBLE_DEVICES (Ray, for one, gives every vLLM worker its own GPU as
cuda:0). Workers report their GPU's UUID (GetServerInfo), so a trainer can tell whether
it shares a worker's GPU (NCCL refuses two ranks of a group on one GPU).
"""

from __future__ import annotations


def normalize_uuid(text: str) -> str:
    """One spelling of a GPU UUID: lowercase, without the "GPU-" prefix (nvidia-smi and NVML write
    "GPU-<uuid>", torch the bare <uuid>)."""
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def cuda_uuid(ordinal: int) -> str:
    """The UUID of this process's CUDA device `ordinal` (initializes CUDA)."""
    import torch

    return normalize_uuid(str(torch.cuda.get_device_properties(ordinal).uuid))
