"""Warnings for debug sessions that would otherwise do nothing without a word.

A config or training loop mistake can leave a session writing no statistics at all.  These checks turn the common
cases into one `UserWarning` each (also written to the main log):

- a config section that selects none of the layers that ran by the end of the session's first iteration (a typo in
  a selector, layer names that differ from what the config expects, a model that was not converted; when no
  tedebug layer ran but the hooks were called directly, by a custom integration, the check is left out);
- `end_debug()` while tedebug layers ran but `debug_api.step()` was never called (statistics are emitted at
  `step()`, so nothing was written);
- `end_debug()` while statistics fed since the last `step()` are still pending (they are dropped: call `step()`
  after the last iteration);
- a GEMM call inside a ``torch.func`` transform (``grad``, ``vmap``, ...; per-sample gradients): its tensors are
  functorch wrappers that hold no data tedebug can read, so the call runs as without a session (before, it raised);
  warned once per session, naming the layer (`note_functorch_call`);
- two modules that run under one layer name (a copy of a model keeps its layers' names: ``copy.deepcopy`` for an EMA
  model, ``torch.load`` of a saved one): their statistics would be merged into one layer's without a word.  Warned
  once per session, at the first such name; each such name is written to the main log.

Cost: each GEMM's debug gate notes its layer name once per session (`note_layer`); `after_step` does its work once,
at the first step; `before_close` once.  Nothing runs per tensor or per iteration beyond one dict lookup.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, List

__all__ = ["note_layer", "note_functorch_call", "after_step", "before_close"]

_LAYERS = "usage_checks.layers"  # session memo: layer name -> weak reference to the first gate that ran under it
_SHARED = "usage_checks.shared"  # session memo: the layer names two live gates ran under
_STATE = "usage_checks.state"  # session memo: "first_step" -> iteration of the first step, "steps" -> count


def _no_owner() -> None:
    return None


def note_layer(session: Any, layer_name: str, owner: Any = None) -> None:
    """Record that a tedebug layer named `layer_name` ran in `session`; `owner` is the GEMM's debug gate (one per
    GEMM of a module), which tells a second module under the same name from the same module called again."""
    layers = session.memo(_LAYERS)
    first = layers.get(layer_name)
    if first is None or first() is None:  # new, or its first module is gone: this one takes the name
        layers[layer_name] = _no_owner if owner is None else weakref.ref(owner)
        return
    if owner is None or first() is owner:
        return
    shared = session.memo(_SHARED)
    if layer_name in shared:
        return
    shared[layer_name] = True
    session.log_message(f"tedebug: a second module runs as layer {layer_name!r}; their statistics are merged")
    if len(shared) == 1:
        message = (
            f"tedebug: two modules run as layer {layer_name!r} in this session, so their statistics are merged into "
            f"one layer's (a weight keeps the first one's); the main log names every such layer.  A copy of a "
            f"model keeps its layers' names (copy.deepcopy, as for an EMA model, or torch.load of a saved model): "
            f"give the copy other names with tedebug.nn.prefix_layer_names(copy, 'ema.')"
        )
        warnings.warn(message, UserWarning, stacklevel=2)


def note_functorch_call(session: Any, layer_name: str) -> None:
    """Record that a GEMM call of `layer_name` ran inside a torch.func transform and was not debugged."""
    state = session.memo(_STATE)
    if state.get("functorch"):
        return
    state["functorch"] = True
    _warn(
        session,
        f"tedebug: layer {layer_name!r} ran inside a torch.func transform (grad, vmap, ...): its tensors there are "
        f"functorch wrappers, which hold no data tedebug can read, so such GEMM calls run without debug features "
        f"and log nothing (further ones are not reported)",
    )


def _warn(session: Any, message: str) -> None:
    session.log_message(message, level=logging.INFO)
    warnings.warn(message, UserWarning, stacklevel=4)


def after_step(session: Any, finished_iteration: int) -> None:
    """Called at the end of every `step()`; at the first one, warn about sections that selected no layer."""
    state = session.memo(_STATE)
    state["steps"] = state.get("steps", 0) + 1
    if state["steps"] != 1:
        return
    config = session.config
    layers: List[str] = list(session.memo(_LAYERS))
    if not layers and _hooks_called_directly(session):
        return  # the hooks were driven without tedebug layers (a custom integration): their layers are unknown here
    for section in getattr(config, "sections", {}).values():
        if any(section.matches(name) for name in layers):
            continue
        seen = ", ".join(layers[:8]) + (f", ... ({len(layers)} in all)" if len(layers) > 8 else "")
        where = f" (line {section.line})" if getattr(section, "line", None) else ""
        _warn(
            session,
            f"tedebug: config section '{section.name}'{where} selected no layer by the end of the first "
            f"iteration ({finished_iteration}); it will log nothing unless layers with other names run "
            f"later. Layers that ran: {seen or 'none (convert the model with tedebug.convert_model)'}",
        )


def _hooks_called_directly(session: Any) -> bool:
    namespaces = getattr(session, "namespaces", {})
    return any(getattr(ns, "cache_size", 0) for ns in namespaces.values())


def before_close(session: Any) -> None:
    """Called at `end_debug()` before anything is closed: warn when `step()` was never called while layers ran,
    and when statistics fed since the last `step()` are about to be dropped."""
    layers = session.memo(_LAYERS)
    steps = session.memo(_STATE).get("steps", 0)
    if layers and steps == 0:
        _warn(
            session,
            f"tedebug: {len(layers)} layers ran but debug_api.step() was never called; statistics are "
            f"emitted at step(), so nothing was logged. Call debug_api.step() at the end of every "
            f"training iteration.",
        )
        return
    store = getattr(session.stats, "_store", None)
    pending = store.fed() if store is not None else ()
    if pending:
        names = sorted({f"{row.key[0]}/{row.key[1]}" for row in pending if hasattr(row, "key")})
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        _warn(
            session,
            f"tedebug: end_debug() drops the statistics of {len(pending)} tensors fed since the last "
            f"debug_api.step() (iteration {session.iteration}{': ' + shown if shown else ''}); call "
            f"debug_api.step() after the last iteration to write them.",
        )
