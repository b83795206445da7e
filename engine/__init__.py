"""weightsync.engine: an inference engine's side of weightsync.

An engine on the server's host attaches to the worker store on its device,
reads the committed version through a lease (the bytes are mapped read-only,
no copy until its own), and applies what changed to its model between
forward passes:

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
