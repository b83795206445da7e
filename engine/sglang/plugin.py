"""SGLang plugin: a failed weight load answers `success: false` instead of stopping SGLang.

SGLang loads the general plugins of the entry-point group `sglang.srt.plugins` in every process
it starts (each TP rank's scheduler included) and calls them before it serves; weightsync's
pyproject declares `weightsync = "weightsync.engine.sglang.plugin:register"`. A deployment that
sets SGLANG_PLUGINS must list `weightsync` in it.

In SGLang 0.5.23 an exception inside a custom weight loader, or a load_format it does not know,
escapes the scheduler's request handler and the launcher stops every process of the server.
`register()` wraps each rank's `WeightUpdater.update_weights_from_tensor` (SGLang's HookRegistry,
an AROUND hook) so that, for weightsync's load format and for unknown ones only:

  - a LoadError becomes (False, "REASON: message") (every rank agreed before loading, see
    loader.py, so no rank holds a byte of the refused version, and each rank's message names
    every rank's outcome: SGLang answers with rank 0's alone);
  - any other exception becomes (False, "LOAD_FAILED: ...");
  - an unknown load_format becomes (False, "LOAD_FORMAT_UNKNOWN: ...") without calling SGLang;
  - a success answers with what the rank loaded (the HTTP answer joins the ranks' messages).

Other load formats (None, "direct", "flattened_bucket", other custom loaders) go through
untouched. Importing this module does not import SGLang.
"""

from __future__ import annotations

from typing import Any

from weightsync.common.logging import get_logger

logger = get_logger("weightsync.engine.sglang")

TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor"
"""SGLang's per-rank tensor update: (self, named_tensors, load_format=None) -> (success, message)."""
BUILTIN_FORMATS = (None, "direct", "flattened_bucket")
"""The load formats SGLang 0.5.23's update_weights_from_tensor knows besides custom loaders."""

_registered = False


def register() -> None:
    """Register the hook with SGLang's HookRegistry (SGLang applies it); idempotent."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, guarded_update, HookType.AROUND)
    _registered = True


def _load_format(args: tuple, kwargs: dict) -> Any:
    if "load_format" in kwargs:
        return kwargs["load_format"]
    return args[2] if len(args) > 2 else None


def _custom_loaders(updater: Any) -> Any:
    return getattr(updater, "custom_weight_loaders", None) or ()


def guarded_update(original, *args, **kwargs):
    """The AROUND hook: args[0] is the rank's WeightUpdater."""
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
