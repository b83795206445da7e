"""SGLang plugin: a refused weight load answers `success: false` instead of stopping SGLang.

SGLang loads the general plugins of the entry-point group `sglang.srt.plugins` in every process
it starts (each TP rank's scheduler included) and calls them before it serves; weightsync's
pyproject declares `weightsync = "weightsync.engine.sglang.plugin:register"`. A deployment that
sets SGLANG_PLUGINS must list `weightsync` in it.

In SGLang 0.5.23 an exception inside a custom weight loader, a load_format it does not know, or a
body with fewer serialized_named_tensors entries than TP ranks (an IndexError in the scheduler)
escapes the scheduler's request handler, and the launcher stops every process of the server.
`register()` wraps two of SGLang's functions with AROUND hooks (SGLang's HookRegistry):

- each rank's scheduler-level update (SCHEDULER_TARGET), before SGLang reads the body. Every rank
  sees the whole body, so every rank decides alike (`body_problem`), and no rank is left waiting for
  another in the loader's agreement or SGLang's barrier:
  - fewer entries than TP ranks, whatever the load format: (False, "REQUEST_MALFORMED: ...");
  - weightsync's load format, an entry SGLang's own unpickler refuses: (False, "REQUEST_MALFORMED: ...").
- each rank's tensor update (TARGET), with the rank's own entry read:
  - an unknown load_format: (False, "LOAD_FORMAT_UNKNOWN: ...") without calling SGLang;
  - weightsync's request ("weightsync.update") under any other load format SGLang knows (none: its
    default loader would skip it silently and answer success, moving the label over the old
    weights): (False, "LOAD_FORMAT_MISMATCH: ...");
  - weightsync's load format: a LoadError becomes (False, "REASON: message") (every rank agreed
    before loading, see loader.py, so no rank holds a byte of the refused version, and each rank's
    message names every rank's outcome: SGLang answers with rank 0's alone); any other exception
    (False, "LOAD_FAILED: ..."); a success answers with what the rank loaded (the HTTP answer joins
    the ranks' messages).
Other load formats (None, "direct", "flattened_bucket", other custom loaders) carrying no weightsync
request go through untouched. A refusal leaves the label (weight_version) where it was: SGLang
records it only after every rank succeeded.

What the plugin cannot protect SGLang from (SGLang's own code, before or around these hooks): an
entry of another load format that SGLang cannot read (its deserialisation raises in the scheduler);
entries that differ between ranks in kind (one rank's weightsync's request, another's weights: each
rank decides on its own entry); a rank that dies or stalls inside an update (the other ranks wait
in the loader's agreement, then SGLang's barrier, for SGLang's process-group timeout); an exception
in SGLang's own steps after the load (its cache flush). Importing this module does not import SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from weightsync.common.logging import get_logger

logger = get_logger("weightsync.engine.sglang")

TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor"
"""SGLang's per-rank tensor update: (self, named_tensors, load_format=None) -> (success, message)."""
SCHEDULER_TARGET = ("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."
                    "update_weights_from_tensor")
"""SGLang's scheduler-level update of one rank: (self, recv_req) -> UpdateWeightsFromTensorReqOutput; it
indexes the body's entries by the rank's TP rank, then calls TARGET."""
BUILTIN_FORMATS = (None, "direct", "flattened_bucket")
"""The load formats SGLang 0.5.23's update_weights_from_tensor knows besides custom loaders."""

_registered = False


def register() -> None:
    """Register the hooks with SGLang's HookRegistry (SGLang applies them); idempotent."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_TARGET, guarded_request, HookType.AROUND)
    HookRegistry.register(TARGET, guarded_update, HookType.AROUND)
    _registered = True


def body_problem(entries: Sequence[Any], load_format: str | None, tp_size: int,
                 deserialize: Callable[[Any], object]) -> str | None:
    """Why no rank may read this body ("REASON: message"), or None: decided from the whole body, which
    every rank holds, so every rank decides alike."""
    from weightsync.engine.sglang.request import LOAD_FORMAT

    if len(entries) < tp_size:
        return (f"REQUEST_MALFORMED: serialized_named_tensors has {len(entries)} entries and this SGLang runs "
                f"{tp_size} TP ranks, one entry each (update_body(..., tp_size={tp_size}): GET /server_info "
                "says tp_size); nothing loaded")
    if load_format != LOAD_FORMAT:
        return None
    for index, entry in enumerate(entries[:tp_size]):
        try:
            deserialize(entry)  # weightsync's entries are a few hundred bytes: reading every rank's is cheap
        except Exception as error:  # noqa: BLE001 - SGLang's unpickler refusing, a truncated pickle, ...
            return (f"REQUEST_MALFORMED: entry {index} of serialized_named_tensors is not one SGLang reads "
                    f"({type(error).__name__}: {error}); nothing loaded")
    return None


def guarded_request(original, *args, **kwargs):
    """The scheduler-level AROUND hook: args are (the rank's SchedulerWeightUpdaterManager, recv_req)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqOutput
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import MultiprocessingSerializer

    request = kwargs.get("recv_req", args[1] if len(args) > 1 else None)
    entries = getattr(request, "serialized_named_tensors", None)
    if entries is None:
        return original(*args, **kwargs)
    problem = body_problem(list(entries), getattr(request, "load_format", None), int(get_parallel().tp_size),
                           MultiprocessingSerializer.deserialize)
    if problem is None:
        return original(*args, **kwargs)
    logger.warning("sglang_update_body_refused", problem=problem[:300])
    return UpdateWeightsFromTensorReqOutput(success=False, message=problem)


def _load_format(args: tuple, kwargs: dict) -> Any:
    if "load_format" in kwargs:
        return kwargs["load_format"]
    return args[2] if len(args) > 2 else None


def _named_tensors(args: tuple, kwargs: dict) -> Any:
    if "named_tensors" in kwargs:
        return kwargs["named_tensors"]
    return args[1] if len(args) > 1 else None


def _custom_loaders(updater: Any) -> Any:
    return getattr(updater, "custom_weight_loaders", None) or ()


def carries_request(named_tensors: Any) -> bool:
    """Whether a rank's entry holds weightsync's request: a list of (name, tensor), or flattened_bucket's
    {"flattened_tensor", "metadata"} with named metadata."""
    from weightsync.engine.request import REQUEST_NAME

    if isinstance(named_tensors, dict):
        return any(getattr(meta, "name", None) == REQUEST_NAME for meta in named_tensors.get("metadata", None) or ())
    if isinstance(named_tensors, list | tuple):
        return any(isinstance(pair, list | tuple) and len(pair) == 2 and pair[0] == REQUEST_NAME
                   for pair in named_tensors)
    return False


def guarded_update(original, *args, **kwargs):
    """The tensor-update AROUND hook: args[0] is the rank's WeightUpdater."""
    from weightsync.engine.sglang import loader
    from weightsync.engine.sglang.request import LOAD_FORMAT

    load_format = _load_format(args, kwargs)
    ours = load_format == LOAD_FORMAT
    known = load_format in BUILTIN_FORMATS or load_format in _custom_loaders(args[0] if args else None)
    if not known:
        hint = (f"; start SGLang with --custom-weight-loader {LOAD_FORMAT}" if ours else "")
        message = f"LOAD_FORMAT_UNKNOWN: load_format {load_format!r} is not one this SGLang loads{hint}"
        logger.warning("sglang_load_format_unknown", load_format=str(load_format))
        return False, message
    if not ours and carries_request(_named_tensors(args, kwargs)):
        logger.warning("sglang_load_format_mismatch", load_format=str(load_format))
        return False, (f"LOAD_FORMAT_MISMATCH: the body carries weightsync's request under load_format "
                       f"{load_format!r}, which would not load it; set load_format to {LOAD_FORMAT!r} "
                       "(update_body does); nothing loaded, the weight version unchanged")
    if not ours:
        return original(*args, **kwargs)
    try:
        success, message = original(*args, **kwargs)
    except loader.LoadError as error:
        return False, str(error)
    except Exception as error:  # noqa: BLE001 - SGLang would stop the whole server
        logger.error("sglang_load_raised", error=f"{type(error).__name__}: {error}")
        return False, f"LOAD_FAILED: {type(error).__name__}: {error}"
    if success:
        return True, loader.last_summary() or message
    return success, message
