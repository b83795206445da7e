"""weightsync.engine.sglang: SGLang's TP ranks load the node's versions with their own loaders.

Start SGLang with the loader listed and the store's address in its environment:

    WEIGHTSYNC_SERVER=127.0.0.1:50051 WEIGHTSYNC_ENGINE_NAME=sglang \\
    python -m sglang.launch_server --model-path MODEL --tp-size 2 \\
        --custom-weight-loader weightsync.engine.sglang.loader.load

then, after each commit: POST /pause_generation, /begin_weight_update,
/update_weights_from_tensor with `update_body(UpdateRequest(generation=G, since_generation=S),
tp_size=2, weight_version=LABEL)`, /end_weight_update, /continue_generation. Every rank loads
what changed in its own scheduler process (loader.py); the plugin (plugin.py, registered through
the `sglang.srt.plugins` entry point) answers a refused version with `success: false` instead of
letting SGLang stop.
"""

from weightsync.engine.request import REQUEST_NAME, RequestError, UpdateRequest
from weightsync.engine.sglang.request import LOAD_FORMAT, update_body

__all__ = ["LOAD_FORMAT", "REQUEST_NAME", "RequestError", "UpdateRequest", "update_body"]
