"""Load a version into a shadow of a vLLM model while the model serves; swap it in at a step boundary.

vLLM's layerwise reload (vllm/model_executor/model_loader/reload/) takes new checkpoint-format
weights into a live model in four steps per layer: put the layer's tensors back on the meta
device, buffer what load_weights hands each parameter's loader, and once the layer has all its
elements materialize it, run the loaders and process_weights_after_loading (on CPU: oneDNN
packing; on a GPU: kernel layouts), then copy the processed tensors into the layer's original
("kernel") tensors. The model cannot run a step between the first and the last: its layers sit
on the meta device. So everything is inside the engine's pause.

Here the same steps run on a *shadow* of the model, while the live model keeps serving:

  stage (a background thread, the engine stepping meanwhile)
      shadow_model()    every module shallow-copied, with dictionaries of tensors and
                        children of its own (the live objects are never written);
      each shadow layer is put on meta from the metadata vLLM recorded at load (weight
      loaders rebound to the shadow) and wrapped by vLLM's own online-processing loaders;
      shadow.load_weights(the store's tensors): vLLM maps names, fuses, shards, and
      processes each shadow layer once complete, into fresh tensors on the model's device
      (on a GPU: the device-side staging buffer).
  swap (the pause)
      for every processed layer: copy each processed tensor into the live kernel tensor of
      the same name (as vLLM's own reload does last: references held by CUDA graphs stay
      valid) and set on the live layer the attributes processing changed on the shadow
      (CPU: the packed-weight kernel handle, `cpu_linear`).

The swap is the only moment the live model changes; it costs a copy of the processed bytes (on
CPU, where linear layers keep only their packed handle, less than the checkpoint's bytes), or a
device copy on a GPU. A model or an update this cannot stage (a deferred attention layer takes
weights, a processed tensor whose shape is not the live one, no room for the staged copy)
raises StagingUnavailable before the live model is touched: the caller loads in the pause as
before.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import MethodType

import torch

MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
"""A module's own tables: the shadow has copies of these; every other attribute is shared until processing
replaces it."""
ROOM_FACTOR = 1.25
"""The staged copy needs the update's bytes (processed layouts may pad) with this margin to spare."""


class StagingUnavailable(Exception):
    """This update cannot be staged beside the live model (the reason says why): load it in the pause."""


@dataclass(slots=True)
class StagedLayer:
    """One live layer and what its processed shadow holds for it."""

    name: str
    live: torch.nn.Module
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    """(live kernel tensor, its processed value) pairs: copied in the swap."""
    attributes: dict[str, object]
    """Attributes processing set or replaced on the shadow: set on the live layer in the swap."""
    removed: list[str]
    """Attributes processing deleted on the shadow."""

    @property
    def copy_bytes(self) -> int:
        return sum(staged.numel() * staged.element_size() for _, staged in self.copies)


@dataclass(slots=True)
class StagedModel:
    """A version loaded and processed beside the live model, ready to swap in."""

    layers: list[StagedLayer] = field(default_factory=list)

    @property
    def copy_bytes(self) -> int:
        return sum(layer.copy_bytes for layer in self.layers)

    def swap(self) -> None:
        """Copy every processed tensor into the live model and set the changed attributes. Call it
        between two steps (in vLLM: inside update_weights, which runs between the engine's steps)."""
        with torch.no_grad():
            for layer in self.layers:
                same = [(live, staged) for live, staged in layer.copies if live.device == staged.device]
                if same:
                    torch._foreach_copy_([live for live, _ in same], [staged for _, staged in same])
                for live, staged in layer.copies:
                    if live.device != staged.device:
                        live.copy_(staged, non_blocking=True)
                for key, value in layer.attributes.items():
                    object.__setattr__(layer.live, key, value)
                for key in layer.removed:
                    layer.live.__dict__.pop(key, None)
        self.layers = []  # the processed tensors go with the last reference


def shadow_model(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[int, torch.nn.Module]]:
    """A shallow copy of every module of `model`, and id(shadow) -> live module. A shadow has its own
    tables of parameters, buffers and children (so loading into it never touches a live tensor) and
    shares every other attribute with its live module. Aliases stay aliases (a tied lm_head is the
    shadow of embed_tokens)."""
    shadows: dict[int, torch.nn.Module] = {}
    live_of: dict[int, torch.nn.Module] = {}

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        known = shadows.get(id(module))
        if known is not None:
            return known
        shadow = module.__class__.__new__(module.__class__)
        shadow.__dict__.update(module.__dict__)
        shadow.__dict__["_parameters"] = dict(module._parameters)
        shadow.__dict__["_buffers"] = dict(module._buffers)
        shadow.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        shadows[id(module)] = shadow
        live_of[id(shadow)] = module
        shadow.__dict__["_modules"] = {key: None if child is None else clone(child)
                                       for key, child in module._modules.items()}
        return shadow

    return clone(model), live_of


def _rebound(tensor: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module, *, keep_data: bool) -> torch.Tensor:
    """A new tensor object like `tensor` (its class and attributes; on meta unless keep_data) whose
    bound weight loaders are bound to `shadow` instead of `live` (or vLLM's sentinel for "the layer")."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    data = tensor.data.clone() if keep_data else tensor.data.to("meta")
    data.__class__ = tensor.__class__
    attributes = dict(tensor.__dict__)
    for key, value in attributes.items():
        # vLLM's own reload leaves its online-processing wrapper (a closure over the live layer's record)
        # on the metadata tensors it registered: the shadow takes the loader it wraps.
        while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__
        if isinstance(value, MethodType) and (value.__self__ is live or value.__self__ is layer_ref_sentinel):
            value = value.__func__.__get__(shadow)
        attributes[key] = value
    data.__dict__ = attributes
    return data


def _prepare_layer(shadow: torch.nn.Module, live: torch.nn.Module) -> bool:
    """Put one shadow layer on meta (from the metadata vLLM recorded at load) with vLLM's online-processing
    loaders; False for a layer vLLM has no such record of (it takes no weights)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, SKIP_TENSORS
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    recorded = LAYERWISE_INFO.get(live)
    if recorded is None or live.__class__.__name__ in SKIP_MODULES:
        return False
    params, buffers = recorded.restore_metadata
    if not params and not buffers and "bias" not in live._parameters:
        return False
    LAYERWISE_INFO[shadow] = LayerReloadingInfo(restore_metadata=recorded.restore_metadata,
                                                restore_device=recorded.restore_device)
    non_persistent = set(shadow._non_persistent_buffers_set)
    for name in (set(shadow._parameters) | set(shadow._buffers) | params.keys() | buffers.keys()) - SKIP_TENSORS:
        if hasattr(shadow, name):
            delattr(shadow, name)
    for name, meta in params.items():
        if name not in SKIP_TENSORS:
            shadow.register_parameter(name, _rebound(meta, live, shadow, keep_data=False))
    for name, meta in buffers.items():
        if name not in SKIP_TENSORS:
            shadow.register_buffer(name, _rebound(meta, live, shadow, keep_data=False),
                                   persistent=name not in non_persistent)
    # vLLM never moves a bias to meta: its loader writes the live one. The shadow gets its own.
    bias = shadow._parameters.get("bias")
    if bias is not None:
        shadow._parameters["bias"] = _rebound(bias, live, shadow, keep_data=True)
    initialize_online_processing(shadow)
    return True


def staging_room(device: torch.device, needed_bytes: int) -> str | None:
    """Why there is no room for a staged copy of `needed_bytes` on `device`, or None."""
    wanted = int(needed_bytes * ROOM_FACTOR)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return None if free >= wanted else f"{free / 1e9:.2f} GB free on {device}, {wanted / 1e9:.2f} GB wanted"
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None  # cannot tell: try
    return None if available >= wanted else f"{available / 1e9:.2f} GB of host memory available, {wanted / 1e9:.2f} GB wanted"


def stage(model: torch.nn.Module, model_config, weights: Iterable[tuple[str, torch.Tensor]]) -> StagedModel:
    """Load `weights` (checkpoint names, as load_weights takes them) into a shadow of `model` and process
    every layer they complete; the live model is only read. StagingUnavailable when a layer cannot be
    completed this way (nothing of the live model changed). Every layer the weights touch must be
    completed by them (the caller hands each touched layer all its tensors)."""
    del model_config  # processing a deferred attention layer needs it: such updates are not staged
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    shadow, live_of = shadow_model(model)
    before = {id(s): dict(live_of[id(s)].__dict__) for s in shadow.modules()}
    prepared = [(name, s) for name, s in shadow.named_modules() if _prepare_layer(s, live_of[id(s)])]
    with torch.no_grad():
        shadow.load_weights(weights)
    staged = StagedModel()
    for name, layer in prepared:
        info = LAYERWISE_INFO.get(layer)
        loaded = info is None or not info.can_load()  # vLLM resets a layer's record once it processed it
        if not loaded:
            if info.load_numel == 0:
                continue  # the update does not touch it
            what = "an attention layer (processed only at finalize)" if is_deferred_attention_layer(layer) \
                else f"{info.load_numel} of its {info.load_numel_total} elements"
            raise StagingUnavailable(f"layer {name or '<model>'} got {what}")
        live = live_of[id(layer)]
        staged.layers.append(_staged_layer(name, live, layer, before[id(layer)]))
    return staged


def _staged_layer(name: str, live: torch.nn.Module, shadow: torch.nn.Module, before: dict) -> StagedLayer:
    """What the swap does for one processed shadow layer: as vLLM's _copy_and_restore_kernel_tensors, every
    live parameter (and persistent, or loaded, buffer) gets the processed value of its name."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    live_tables = [(n, t) for n, t in live._parameters.items() if t is not None]
    live_tables += [(n, t) for n, t in live._buffers.items() if t is not None and n in shadow._buffers
                    and n not in live._non_persistent_buffers_set]
    for tensor_name, kernel in live_tables:
        processed = getattr(shadow, tensor_name, None)
        if not isinstance(processed, torch.Tensor):
            raise StagingUnavailable(f"layer {name}: processing left no {tensor_name!r}")
        if processed.shape != kernel.shape or processed.dtype != kernel.dtype:
            raise StagingUnavailable(f"layer {name}: {tensor_name} is {processed.dtype} {list(processed.shape)} "
                                     f"processed, {kernel.dtype} {list(kernel.shape)} live")
        if kernel.numel():
            copies.append((kernel.data, processed.data))
    after = shadow.__dict__
    attributes = {k: v for k, v in after.items() if k not in MODULE_INTERNALS and before.get(k, _MISSING) is not v}
    removed = [k for k in before if k not in after and k not in MODULE_INTERNALS]
    return StagedLayer(name, live, copies, attributes, removed)


_MISSING = object()


def feed(tensors: dict[str, torch.Tensor], names: Iterable[str], fed: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `names` in order, recording each in `fed`."""
    for name in names:
        fed.add(name)
        yield name, tensors[name]


def staging_disabled() -> bool:
    """WEIGHTSYNC_VLLM_STAGING=0 in vLLM's environment: load in the pause, as before staging existed."""
    return os.environ.get("WEIGHTSYNC_VLLM_STAGING", "1") == "0"
