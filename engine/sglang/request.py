"""A `/update_weights_from_tensor` request for SGLang's weightsync loader: the JSON body, and the
pickled entry of each rank.

The request itself (which version, as one named int64 tensor) is engine/request.py's, shared with
LMDeploy's loader. SGLang unpickles each rank's entry of `serialized_named_tensors`: weightsync's is
pickled with one global, `torch.LongTensor`, which SGLang's restricted unpickler allows; nothing else
(this module pickles and never unpickles). `update_body` builds the whole JSON body (one identical
entry per rank). Importing this module does not import SGLang.
"""

from __future__ import annotations

import base64
import io
import pickle

import torch

from weightsync.engine.request import REQUEST_NAME, UpdateRequest

LOAD_FORMAT = "weightsync.engine.sglang.loader.load"
"""The loader's dotted path: give it to `--custom-weight-loader` and as the request's load_format."""


class _Pickler(pickle.Pickler):
    """Pickles a tensor as `torch.LongTensor([...])`: one global SGLang's unpickler allows."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return torch.LongTensor, (obj.tolist(),)
        return NotImplemented


def encode(request: UpdateRequest) -> str:
    """One rank's entry of serialized_named_tensors (base64, as SGLang's HTTP route takes it)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=4).dump([(REQUEST_NAME, request.to_tensor())])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def update_body(request: UpdateRequest, *, tp_size: int, weight_version: str | None = None,
                flush_cache: bool = True) -> dict:
    """The JSON body of `POST /update_weights_from_tensor`: every rank gets the same request.

    tp_size: SGLang's own (GET /server_info's tp_size), which this function cannot know: a smaller one
    leaves ranks without an entry, which the plugin refuses on every rank (REQUEST_MALFORMED: SGLang
    keeps serving, the label unchanged) and SGLang without the plugin dies of (an IndexError in its
    scheduler); a larger one is harmless (SGLang reads rank R's entry R). The body's load_format must
    stay weightsync's: under any other (none included) the plugin refuses it (LOAD_FORMAT_MISMATCH),
    where SGLang's default loader would skip the request and report success.
    weight_version: the label SGLang records if every rank loaded (GET /model_info)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    body = {"serialized_named_tensors": [encode(request)] * tp_size, "load_format": LOAD_FORMAT,
            "flush_cache": flush_cache, "abort_all_requests": False, "selector": "target"}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body
