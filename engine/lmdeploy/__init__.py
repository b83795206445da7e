"""weightsync.engine.lmdeploy: LMDeploy's PyTorch engine loads the node's versions into its own
model classes with their own `load_weights`, read straight from the node's store.

LMDeploy 0.18.0 has no custom-loader hook, and its update routes unpickle CUDA IPC handles
(`/update_weights`) or broadcast weights over NCCL under its Ray executor. weightsync comes in
where LMDeploy lets user code in without pickle:

- in process (pipeline.py): one GPU, the default single-process executor:

      WEIGHTSYNC_SERVER=127.0.0.1:50051 python ...
      pipe = lmdeploy.pipeline(MODEL, backend_config=PytorchEngineConfig(custom_module_map=MODULE_MAP_PATH))
      load_into_pipeline(pipe, UpdateRequest(generation=G, since_generation=S))  # between generations

- through LMDeploy's own routes (models.py, module_map.py): with `custom_module_map` set to
  MODULE_MAP_PATH (Python API only: LMDeploy 0.18's CLI has no flag for it) every model agent
  builds LMDeploy's classes whose load_weights also takes weightsync's request pair (one int64
  tensor naming a version) and loads that version from the store on that rank, with LMDeploy's own
  finalisation afterwards. Of LMDeploy 0.18's routes only `/update_weights_from_distributed` (Ray,
  NCCL) can hand a rank that pair; `/update_weights` cannot (models.py says why).

Each rank (loader.py) attaches as WEIGHTSYNC_ENGINE_NAME (default "lmdeploy"; rank R: NAME:tpR),
checks names and shapes before a byte moves, agrees with the other ranks, feeds load_weights what
changed since its own version, and releases the lease saying whether it applied.
"""

import os

from weightsync.engine.lmdeploy.loader import AttachConfig, LoadError, RankLoader, RankPlace
from weightsync.engine.request import REQUEST_NAME, UpdateRequest

MODULE_MAP_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_map.py")
"""The file to give LMDeploy as custom_module_map."""

__all__ = ["MODULE_MAP_PATH", "REQUEST_NAME", "AttachConfig", "LoadError", "RankLoader", "RankPlace", "UpdateRequest"]
