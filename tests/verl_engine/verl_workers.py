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


class FsdpActor:
    """An actor rank with a real FSDP2 model: torch's fully_shard on CPU over Gloo, two ranks. Its
    state dict's tensors are DTensors (Shard(0), rows that do not divide evenly), which each rank's
    send_weights pushes as its local shards. The pushes it made are recorded (what each rank sent)."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        self.rank = rank
        torch.manual_seed(0)  # the same initial weights on every rank, then sharded
        self.model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 7), torch.nn.ReLU(),
                                         torch.nn.Linear(7, 3))
        self.model[3].to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (world,))
        for layer in (self.model[0], self.model[1], self.model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.pushed: list[list[tuple[str, str, list[int]]]] = []

    def watch(self) -> None:
        """Record each push this rank's SDK client makes: (name, type, the shape it holds locally)."""
        from weightsync.client import WeightSyncClient

        original = WeightSyncClient.push
        pushed = self.pushed

        def push(client, named, **kwargs):
            items = list(named.items()) if isinstance(named, dict) else list(named)
            pushed.append([(n, type(t).__name__, list(getattr(t, "to_local", lambda t=t: t)().shape)) for n, t in items])
            return original(client, items, **kwargs)

        WeightSyncClient.push = push  # type: ignore[method-assign]

    async def update(self, engine, step: int) -> dict[str, Any]:
        """One step: the state dict's DTensors sent as verl's generator yields them; their full
        tensors (a collective, so before the sync, not in it) and what this rank pushed come back.
        Then every shard changes, each rank its own way, for the next step."""
        state = self.model.state_dict()
        full = {name: t.full_tensor() for name, t in state.items()}
        placements = sorted({str(t.placements) for t in state.values()})
        metrics = await engine.send_weights(_generate(state), global_steps=step)
        with torch.no_grad():
            for param in self.model.parameters():
                param.to_local().mul_(2).add_(self.rank + step)
        return {"metrics": metrics, "full": full, "placements": placements, "pushed": self.pushed[-1]}


def _engine(role: str, is_master: bool, engine_kwargs: dict[str, Any]):
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
    return CheckpointEngineRegistry.new(config.backend, **kwargs)


def _init_actor_world(rank: int, world: int, port: int) -> None:
    """torch.distributed over Gloo among the actor ranks, as verl's actor workers have it (once a process)."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))


def serve(conn: Connection, role: str, is_master: bool, engine_kwargs: dict[str, Any],
          fsdp: tuple[int, int, int] | None = None) -> None:
    """fsdp (an actor rank): (rank, world, Gloo port): the actor is an FsdpActor, not weights_for.
    "rebuild" (this process's verl imports kept): the engine closed and built again with other
    engine_kwargs, the actor ranks' torch.distributed started first when `world` (rank, world, port) says."""
    engine = _engine(role, is_master, engine_kwargs)
    actor = FsdpActor(*fsdp) if fsdp is not None and role == "actor" else None
    if actor is not None:
        actor.watch()
    conn.send(("ready", type(engine).__qualname__))
    while True:
        method, args = conn.recv()
        if method == "stop":
            engine.close()
            conn.send(("ok", None))
            return
        try:
            if method == "rebuild":
                engine.close()
                if args.get("world"):
                    _init_actor_world(*args["world"])
                engine = _engine(role, is_master, args["engine_kwargs"])
                result: Any = None
            elif method == "update_weights" and actor is not None:
                result = asyncio.run(actor.update(engine, args["step"]))
            elif method == "update_weights":
                result = asyncio.run(_update(engine, role, **args))
            else:
                result = getattr(engine, method)(**args)
            conn.send(("ok", result))
        except Exception as error:  # noqa: BLE001 - sent back whole, for the test to check
            conn.send(("error", {"type": type(error).__name__, "reason": getattr(error, "reason", ""),
                                 "rank": getattr(error, "rank", None), "version": getattr(error, "version", None),
                                 "cause_reason": getattr(error, "cause_reason", None), "message": str(error)}))


LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
"""A LoRA adapter tensor as PEFT names it (get_peft_model_state_dict)."""


async def _update(engine, role: str, step: int, bad_shape: bool = False, bad_norm: bool = False,
                  lora: str = "", bytes_of: int | None = None) -> Any:
    """lora "tensors": the adapter's tensors among the weights; "config": a peft_config beside them.
    bytes_of: the actor pushes weights_for(bytes_of) under the label `step` (a repeated label, other bytes)."""
    if role == "actor":
        named = weights_for(step if bytes_of is None else bytes_of, bad_shape=bad_shape, bad_norm=bad_norm)
        if lora == "tensors":
            named[LORA_A] = torch.ones(8, 64)
        if lora == "config":
            return await engine.send_weights(_generate(named), global_steps=step,
                                             peft_config={"r": 8, "target_modules": ["q_proj"]})
        return await engine.send_weights(_generate(named), global_steps=step)
    received = {}
    async for name, tensor in engine.receive_weights(global_steps=step):
        received[name] = tensor.clone()
    return received
