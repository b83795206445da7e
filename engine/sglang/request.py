"""What a `/update_weights_from_tensor` request for the weightsync loader carries: which version.

SGLang hands each TP rank's loader the list of (name, tensor) its entry of
`serialized_named_tensors` unpickles to. weightsync's entry is one pair and no weights:

    ("weightsync.update", int64 tensor [FORMAT, generation, since_generation, wait_ms, strict])

FORMAT is 1. generation: the committed version to load (0: the store's current one; a driver
names it, so that the label it sets is the one loaded). since_generation: the generation the
engine serves now as far as the caller knows (-1: unknown, load every tensor); each rank loads
what changed since the older of this and its own record. wait_ms: how long a rank waits while an
IN_PLACE update is writing the store. strict: 1 refuses a version that writes a tensor the model
does not take; 0 skips such tensors.

The entry is pickled with one global, `torch.LongTensor`, which SGLang's restricted unpickler
allows; nothing else. `update_body` builds the whole JSON body (one identical entry per rank).
Importing this module does not import SGLang.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass

import torch

REQUEST_NAME = "weightsync.update"
FORMAT = 1
LOAD_FORMAT = "weightsync.engine.sglang.loader.load"
"""The loader's dotted path: give it to `--custom-weight-loader` and as the request's load_format."""


class RequestError(ValueError):
    """A request the loader cannot read. `reason` is REQUEST_MALFORMED."""

    reason = "REQUEST_MALFORMED"


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateRequest:
    """Which committed version each rank loads."""

    generation: int = 0
    """The version to load: 0 = the store's current one; else exactly that generation (VERSION_GONE
    if the store moved past it)."""
    since_generation: int = -1
    """The generation the engine serves now as the caller knows it (-1: unknown: every tensor)."""
    wait_s: float = 30.0
    """How long to wait while an IN_PLACE update is writing the store."""
    strict: bool = True
    """False: skip tensors the model does not take instead of refusing the version."""

    def __post_init__(self) -> None:
        for name, minimum in (("generation", 0), ("since_generation", -1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise RequestError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.generation and self.since_generation >= self.generation:
            raise RequestError(f"since_generation ({self.since_generation}) must be below generation "
                               f"({self.generation})")
        if isinstance(self.wait_s, bool) or not isinstance(self.wait_s, int | float) or not 0 <= self.wait_s <= 3600:
            raise RequestError(f"wait_s must be a number of seconds in [0, 3600], got {self.wait_s!r}")
        if not isinstance(self.strict, bool):
            raise RequestError(f"strict must be a boolean, got {self.strict!r}")

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([FORMAT, self.generation, self.since_generation, round(self.wait_s * 1000),
                             int(self.strict)], dtype=torch.int64)

    @classmethod
    def from_named_tensors(cls, named_tensors: list) -> UpdateRequest:
        """The request in what SGLang passed the loader; RequestError if it is not one."""
        if not isinstance(named_tensors, list | tuple) or len(named_tensors) != 1:
            raise RequestError(f"expected one ({REQUEST_NAME!r}, tensor) pair, got "
                               f"{type(named_tensors).__name__} of {_length(named_tensors)}")
        entry = named_tensors[0]
        if not isinstance(entry, list | tuple) or len(entry) != 2 or entry[0] != REQUEST_NAME:
            raise RequestError(f"expected the pair ({REQUEST_NAME!r}, tensor), got {_short(entry)}")
        tensor = entry[1]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tuple(tensor.shape) != (5,):
            raise RequestError(f"{REQUEST_NAME!r} must be an int64 tensor of 5 elements, got {_short(tensor)}")
        version, generation, since, wait_ms, strict = (int(v) for v in tensor.cpu().tolist())
        if version != FORMAT:
            raise RequestError(f"request format {version} (this loader reads format {FORMAT})")
        if strict not in (0, 1) or wait_ms < 0:
            raise RequestError(f"strict must be 0 or 1 and wait_ms >= 0, got {strict}, {wait_ms}")
        return cls(generation=generation, since_generation=since, wait_s=wait_ms / 1000, strict=bool(strict))


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


def _length(value: object) -> str:
    return f"{len(value)} entries" if hasattr(value, "__len__") else "no length"


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
