"""One verl worker per process (an actor rank or a rollout worker), built the way verl builds its
checkpoint engine, answering the calls verl's CheckpointEngineManager makes, over a pipe."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import Any

import torch


def weights_for(step: int, *, bad_shape: bool = False, bad_norm: bool = False) -> dict[str, torch.Tensor]:
    """The actor's full tensors at a step: three dtypes; between steps some rows change (delta).
    bad_shape: the embedding one row short; bad_norm: the norm one element short (shared out between
    two senders, the embedding goes from rank 0 and the norm from rank 1)."""
    g = torch.Generator().manual_seed(1234)
    embed = torch.randn(512, 64, generator=g)
    embed[step % 512] += step
    norm = (torch.randn(1000, generator=g) * (1 + step)).to(torch.bfloat16)
    counts = torch.arange(37, dtype=torch.int64) * step
    return {"model.embed.weight": embed if not bad_shape else embed[:511],
            "model.norm.weight": norm if not bad_norm else norm[:999], "model.counts": counts}


async def _generate(named: dict[str, torch.Tensor]):
    for name, tensor in named.items():  # verl's generators may be async ones
        yield name, tensor


def serve(conn: Connection, role: str, is_master: bool, engine_kwargs: dict[str, Any]) -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    # As verl's workers do (engine_workers.py, CheckpointEngineWorker): its config dataclass, the
    # custom module imported, the backend built from the registry with its kwargs.
    config = CheckpointEngineConfig(backend="weightsync", update_weights_bucket_megabytes=64,
                                    engine_kwargs={"weightsync": engine_kwargs},
                                    custom_backend_module="weightsync.integrations.verl")
    import_external_libs(config.custom_backend_module)
    kwargs = dict(bucket_size=config.update_weights_bucket_megabytes << 20,
                  **config.engine_kwargs.get(config.backend, {}))
    if role == "actor":
        kwargs["is_master"] = is_master
    engine = CheckpointEngineRegistry.new(config.backend, **kwargs)
    conn.send(("ready", type(engine).__qualname__))
    while True:
        method, args = conn.recv()
        if method == "stop":
            engine.close()
            conn.send(("ok", None))
            return
        try:
            if method == "update_weights":
                result: Any = asyncio.run(_update(engine, role, **args))
            else:
                result = getattr(engine, method)(**args)
            conn.send(("ok", result))
        except Exception as error:  # noqa: BLE001 - sent back whole, for the test to check
            conn.send(("error", {"type": type(error).__name__, "reason": getattr(error, "reason", ""),
                                 "rank": getattr(error, "rank", None), "version": getattr(error, "version", None),
                                 "cause_reason": getattr(error, "cause_reason", None), "message": str(error)}))


async def _update(engine, role: str, step: int, bad_shape: bool = False, bad_norm: bool = False) -> Any:
    if role == "actor":
        named = weights_for(step, bad_shape=bad_shape, bad_norm=bad_norm)
        return await engine.send_weights(_generate(named), global_steps=step)
    received = {}
    async for name, tensor in engine.receive_weights(global_steps=step):
        received[name] = tensor.clone()
    return received
