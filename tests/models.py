"""Synthetic named tensors for tests."""

from __future__ import annotations

import torch


def mixed_model(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype, a 0-d tensor, an empty tensor, and one tensor bigger than 1 MiB."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "embed.weight": randn(64, 32).to(torch.bfloat16),
        "layers.0.attn.q_proj.weight": randn(32, 32).to(torch.float16),
        "layers.0.attn.q_proj.bias": randn(32),
        "layers.0.mlp.fp8_weight": randn(16, 16).to(torch.float8_e4m3fn),
        "layers.0.mlp.fp8_scale": randn(8).to(torch.float8_e5m2),
        "layers.0.norm.weight": randn(32).double(),
        "quant.int8": torch.randint(-128, 127, (33,), generator=g, dtype=torch.int8),
        "quant.uint8": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
        "quant.int16": torch.randint(-3000, 3000, (3, 3), generator=g, dtype=torch.int16),
        "quant.int32": torch.randint(-(2**30), 2**30, (10,), generator=g, dtype=torch.int32),
        "step": torch.tensor(seed * 1000 + 7, dtype=torch.int64),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "lm_head.weight": randn(300_000),  # 1.2 MB: larger than a 1 MiB bucket
        "final_norm.weight": randn(32).to(torch.bfloat16),
    }
