"""Workloads generated in memory, bf16, one separate tensor (own storage) per name.

Every tensor owns its storage, as the parameters of an ordinary (non-FSDP) model
do, so no mode gets the SDK's flat-parameter zero-copy path for free.

- dense: Qwen2-shaped decoder (embeddings, attention with q/k/v biases, MLP,
  RMSNorms, untied lm_head): ~0.73 GB, 291 tensors at full size.
- moe:   Qwen-MoE-shaped: attention + router + many small expert matrices:
  ~0.75 GB, ~3,000 tensors at full size.
- tiny:  N tensors of 64 KiB each (5,000 at full size).
- flat:  `count` equal tensors totalling `total_bytes` (scaling curves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPE = torch.bfloat16
_POOL_ELEMENTS = 16 << 20  # 32 MiB of bf16 noise, sliced into every tensor


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    shapes: list[tuple[str, tuple[int, ...]]]

    @property
    def tensor_count(self) -> int:
        return len(self.shapes)

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes) * DTYPE.itemsize

    def materialize(self, seed: int = 0, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every tensor its own storage, filled with (cheap, varied) noise.

        prefix keeps the names of different workloads apart on one server."""
        g = torch.Generator().manual_seed(seed)
        pool = (torch.randn(_POOL_ELEMENTS, generator=g) * 0.02).to(DTYPE)
        out: dict[str, torch.Tensor] = {}
        cursor = 0
        for name, shape in self.shapes:
            n = math.prod(shape)
            t = torch.empty(shape, dtype=DTYPE)
            flat = t.view(-1)
            done = 0
            while done < n:
                take = min(n - done, _POOL_ELEMENTS - cursor)
                flat[done : done + take].copy_(pool[cursor : cursor + take])
                done += take
                cursor = (cursor + take) % (_POOL_ELEMENTS - 7)  # drift so tensors differ
            out[prefix + name] = t
        return out


def _attention(p: str, hidden: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2 attention projections with biases (grouped-query: k and v are kv wide)."""
    return [
        (p + "self_attn.q_proj.weight", (hidden, hidden)),
        (p + "self_attn.q_proj.bias", (hidden,)),
        (p + "self_attn.k_proj.weight", (kv, hidden)),
        (p + "self_attn.k_proj.bias", (kv,)),
        (p + "self_attn.v_proj.weight", (kv, hidden)),
        (p + "self_attn.v_proj.bias", (kv,)),
        (p + "self_attn.o_proj.weight", (hidden, hidden)),
    ]


def _layer_norms(p: str, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]


def dense(scale: float = 1.0) -> Workload:
    """Qwen2-style decoder. scale < 1 keeps the shape family but shrinks layers and widths."""
    layers = max(2, round(24 * scale))
    hidden, kv, ff, vocab = 896, 128, 4096, 32_000
    if scale < 1.0:
        vocab = max(1024, int(vocab * scale))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += _attention(p, hidden, kv)
        shapes += [
            (p + "mlp.gate_proj.weight", (ff, hidden)),
            (p + "mlp.up_proj.weight", (ff, hidden)),
            (p + "mlp.down_proj.weight", (hidden, ff)),
            *_layer_norms(p, hidden),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return Workload("dense", shapes)


def moe(scale: float = 1.0) -> Workload:
    """Qwen-MoE-style: per layer attention, a router, and `experts` x (gate, up, down)."""
    layers = max(2, round(16 * scale))
    hidden, kv, expert_ff, experts, vocab = 512, 128, 224, 60, 32_000
    if scale < 1.0:
        vocab = max(1024, int(vocab * scale))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += _attention(p, hidden, kv)
        shapes += [
            (p + "mlp.gate.weight", (experts, hidden)),
            *_layer_norms(p, hidden),
        ]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes += [
                (q + "gate_proj.weight", (expert_ff, hidden)),
                (q + "up_proj.weight", (expert_ff, hidden)),
                (q + "down_proj.weight", (hidden, expert_ff)),
            ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return Workload("moe", shapes)


def tiny(count: int = 5000, tensor_bytes: int = 64 << 10) -> Workload:
    elements = tensor_bytes // DTYPE.itemsize
    return Workload("tiny", [(f"tiny.{i}.weight", (elements // 256, 256)) for i in range(count)])


def flat(total_bytes: int, count: int, name: str = "flat") -> Workload:
    """`count` equal 2-D tensors, total_bytes in all (rounded down to whole 512-byte rows)."""
    per = max(512, total_bytes // count) // 512 * 512
    cols = 256
    return Workload(name, [(f"{name}.{i}.weight", (per // DTYPE.itemsize // cols, cols)) for i in range(count)])
