"""Load a node version into a running LMDeploy pipeline in this process (no pickle, no HTTP).

LMDeploy 0.18.0's PyTorch engine with one GPU and no separate engine process (tp=1, the default
"uni" executor, `enable_mp_engine` off) keeps its model agent in the pipeline's own process:
`load_into_pipeline(pipe, UpdateRequest(...))` (a Pipeline, or the PyTorch Engine) loads there, inside the agent's own device and
distributed context, what changed since the agent's last version, then runs LMDeploy's own
finalisation of an external update (`process_weights_after_loading`, a CUDA synchronise, the
graph runner's reset). Call it between generations (the Pipeline's blocking calls have returned):
LMDeploy's model agent runs its forward passes on the same model.

Other executors (mp, ray: a model agent per rank in other processes) are reached only through
LMDeploy's own update routes (models.py); weightsync does not unpickle into them.
"""

from __future__ import annotations

import torch

from weightsync.engine.lmdeploy.loader import (
    ApplyStats,
    AttachConfig,
    LoadError,
    RankLoader,
    lmdeploy_rank_place,
)
from weightsync.engine.request import UpdateRequest

_LOADERS: dict[int, RankLoader] = {}


def model_agent_of(pipe: object) -> object:
    """The in-process model agent of a Pipeline (lmdeploy.pipeline) or of LMDeploy's PyTorch Engine
    itself (lmdeploy.pytorch.engine.Engine); LoadError CONFIG_INVALID where there is none."""
    engine = pipe if hasattr(pipe, "executor") else getattr(getattr(pipe, "async_engine", None), "engine", None)
    agent = getattr(getattr(engine, "executor", None), "model_agent", None)
    if agent is None or not hasattr(agent, "patched_model"):
        raise LoadError("CONFIG_INVALID", "in-process loading needs LMDeploy's PyTorch engine with its single-process "
                        "executor (tp=1, enable_mp_engine off); got "
                        f"{type(engine).__name__ if engine is not None else 'no PyTorch engine'}")
    return agent


def load_into_pipeline(pipe: object, request: UpdateRequest, config: AttachConfig | None = None) -> ApplyStats:
    """Load the version `request` names into `pipe`'s model (LoadError: refused, nothing loaded; or
    LOAD_FAILED). config: where the store is (default: the environment, as in LMDeploy's processes)."""
    agent = model_agent_of(pipe)

    def finalise(model: torch.nn.Module) -> None:
        agent._finalize_updated_weights()  # noqa: SLF001 - LMDeploy's own end of an external update

    with agent.all_context():  # type: ignore[attr-defined]
        loader = _LOADERS.get(id(agent))
        if loader is None:
            source = (lambda: config) if config is not None else AttachConfig.from_environment
            loader = _LOADERS[id(agent)] = RankLoader(source, lmdeploy_rank_place(), str(agent.model_path),  # type: ignore[attr-defined]
                                                      post_load=finalise)
        model = agent.patched_model.get_model()  # type: ignore[attr-defined]
        return loader.load(model, request)
