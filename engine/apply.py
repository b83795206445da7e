"""Applying a snapshot to a model: all of it, or none of it.

Everything is checked before the first byte is copied (every changed name
exists in the model, with the same shape and dtype), so an engine whose model
does not match keeps serving its old version, bit for bit, and learns which
tensor is wrong. Call these between forward passes: the copy is the only
moment the model changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from weightsync.engine.client import EngineError, StoreSnapshot


def plan_module_update(
    module: torch.nn.Module,
    snapshot: StoreSnapshot,
    *,
    since_generation: int = -1,
    name_map: Mapping[str, str] | None = None,
    strict: bool = True,
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, model tensor, store view) for every tensor to copy; EngineError if one cannot be."""
    targets = module.state_dict(keep_vars=True)
    plan: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    unknown: list[str] = []
    mismatched: list[str] = []
    for name in snapshot.changed_since(since_generation):
        target_name = name_map.get(name, name) if name_map else name
        target = targets.get(target_name)
        if target is None:
            unknown.append(target_name)
            continue
        source = snapshot.tensors[name]
        if target.shape != source.shape or target.dtype != source.dtype:
            mismatched.append(f"{target_name} (model {target.dtype} {list(target.shape)}, "
                              f"store {source.dtype} {list(source.shape)})")
            continue
        plan.append((target_name, target, source))
    if mismatched:
        raise EngineError("TENSOR_MISMATCH", f"{len(mismatched)} tensor(s) differ from the model: "
                          + "; ".join(mismatched[:5]), metadata={"tensors": ",".join(m.split(" ")[0] for m in mismatched[:20])})
    if unknown and strict:
        raise EngineError("TENSOR_NOT_IN_MODEL", f"{len(unknown)} tensor(s) of the store are not in the model, e.g. "
                          f"{unknown[0]!r} (map names with name_map, or pass strict=False)",
                          metadata={"tensors": ",".join(unknown[:20])})
    return plan


def apply_to_module(
    module: torch.nn.Module,
    snapshot: StoreSnapshot,
    *,
    since_generation: int = -1,
    name_map: Mapping[str, str] | None = None,
    strict: bool = True,
) -> list[str]:
    """Copy what changed since `since_generation` (-1: everything) into the module's parameters and
    buffers; returns the names copied. Marks the snapshot applied.

    Copies into a CUDA module are queued on the device's current stream and return at once (from
    the pinned store mapping of a CUDA engine they run asynchronously, at DMA speed); the snapshot's
    release waits for them (every device copied to is added to `snapshot.devices`) before the lease
    goes, since an IN_PLACE update may overwrite the store's bytes from then on. Host copies are
    synchronous."""
    plan = plan_module_update(module, snapshot, since_generation=since_generation, name_map=name_map, strict=strict)
    same_device = [(t, s) for _, t, s in plan if t.device == s.device]
    crossing = [(t, s) for _, t, s in plan if t.device != s.device]
    snapshot.devices = snapshot.devices | {d for pair in crossing for d in (pair[0].device, pair[1].device)
                                           if d.type == "cuda"}
    with torch.no_grad():
        if same_device:
            torch._foreach_copy_([t for t, _ in same_device], [s for _, s in same_device])
        for target, source in crossing:
            target.copy_(source, non_blocking=True)
    snapshot.applied = True
    return [name for name, _, _ in plan]


def feed_load_weights(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    snapshot: StoreSnapshot,
    *,
    since_generation: int = -1,
    name_map: Mapping[str, str] | None = None,
) -> list[str]:
    """Hand what changed to a load_weights(iterable of (name, tensor)) callable, the convention of
    vLLM and SGLang models (they map names, fuse, shard and quantize). The tensors are read-only
    views of the store: load_weights copies them into its parameters. Marks the snapshot applied."""
    names = snapshot.changed_since(since_generation)
    load_weights((name_map.get(n, n) if name_map else n, snapshot.tensors[n]) for n in names)
    snapshot.applied = True
    return names
