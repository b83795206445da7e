"""weightsync.engine: an inference engine's side of weightsync.

The node has one store: host memory the weightsync server keeps. Every engine
process on the server's host (every tensor-parallel rank of vLLM included)
attaches to the server's local socket, reads the committed version through a
lease (the store is mapped read-only, no copy until its own; a CUDA engine
pins the mapping and copies host to device) and applies what changed to its
model between forward passes, with its own loader:

    from weightsync.engine import EngineClient, ModuleFollower

    client = EngineClient(server="127.0.0.1:50051", name="my-engine")
    follower = ModuleFollower(client, model)
    while serving:
        follower.update()        # applies a newer committed version, if any
        logits = model(batch)

`load_weights`-style models (vLLM, SGLang) take the changed tensors through
`feed_load_weights`; the vLLM backend is weightsync.engine.vllm_backend.
"""

from weightsync.engine.apply import apply_to_module, feed_load_weights, plan_module_update
from weightsync.engine.client import EngineClient, EngineError, StoreSnapshot
from weightsync.engine.follower import ModuleFollower

__all__ = [
    "EngineClient",
    "EngineError",
    "ModuleFollower",
    "StoreSnapshot",
    "apply_to_module",
    "feed_load_weights",
    "plan_module_update",
]
