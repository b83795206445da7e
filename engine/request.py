"""What every engine's weightsync loader is asked: which committed version to load, as one named tensor.

SGLang's `/update_weights_from_tensor` (engine/sglang/request.py sends it over HTTP) and LMDeploy's
`update_params` (engine/lmdeploy/) hand each rank's loader a list of (name, tensor); weightsync's is
one pair and no weights:

    ("weightsync.update", int64 tensor [FORMAT, generation, since_generation, wait_ms, strict])

FORMAT is 1. generation: the committed version to load (0: the store's current one; a driver
names it, so that the label it sets is the one loaded). since_generation: the generation the
engine serves now as far as the caller knows (-1: unknown, load every tensor); each rank loads
what changed since the older of this and its own record. wait_ms: how long a rank waits while an
IN_PLACE update is writing the store. strict: 1 refuses a version that writes a tensor the model
does not take; 0 skips such tensors. Importing this module imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REQUEST_NAME = "weightsync.update"
FORMAT = 1


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


def _length(value: object) -> str:
    return f"{len(value)} entries" if hasattr(value, "__len__") else "no length"


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
