"""The public debug API (``import tedebug.debug_api as debug_api``): a thin facade over one `DebugSession`.

`DEBUG_MANAGER` is the active session or None (it lives in `tedebug.active`, which the rest of tedebug reads; this
module re-exports it with `session`, `is_enabled`, `get_iteration` and `log_message`); it is the only global mutable
state of the API, besides the sinks (and the weight-TP-reduction flag) queued before `initialize`.  Compatible
with nvdlfw_inspect's ``api`` module:

- ``initialize(config_file="", feature_dirs=None, statistics_logger=None, log_dir=".", init_training_step=0, *,
  tb_writer=None, default_logging_enabled=False, background_logging="process", on_sink_error="warn",
  statistics_rank0_only=False)``: RuntimeError if already initialised; unknown keyword arguments raise TypeError; a
  failure leaves nothing set (retry works).  `background_logging` (tedebug's own addition): ``"process"`` (the
  default) has a writer process of its own write the text and JSONL statistics files (`tedebug.sinks.process_writer`:
  the training process spends almost no host time on them), True a writer thread, False `step()` itself (see
  `tedebug.session`).  `on_sink_error` (tedebug's
  own addition): ``"warn"`` reports a failing sink once and stops it, training goes on; ``"raise"`` raises from
  `step()` / `end_debug()`.  `statistics_rank0_only` (tedebug's own addition): only global rank 0 writes the
  statistics files (text and JSONL); reduced statistics are the same on every rank, so the other ranks' files
  would repeat them.
  A second live run on the same `log_dir` (same rank) raises `tedebug.log_dir_lock.LogDirInUseError`.
  In the main thread, SIGINT / SIGTERM are held back while `step()` runs and SIGTERM flushes the statistics before
  the process ends (`tedebug.signal_guard`; only default handlers are replaced, and restored at `end_debug()`).
- ``step()``, ``end_debug()``, ``initialize_training_step(n)``: no-ops before initialize.  ``paused()`` (tedebug's
  own addition): a context manager inside which GEMM calls run as without a session (an evaluation loop).
- ``log_message``, ``set_tensor_reduction_group``, ``get_tensor_reduction_group``, ``get_iteration``,
  ``session()`` and the namespaces (``debug_api.transformer_engine``) raise RuntimeError before initialize.
- ``list_features()`` / ``explain_features()`` and ``infer_and_assign_layer_names()`` also work before initialize.
- Unknown attribute names raise AttributeError (so ``hasattr(debug_api, "x")`` is False); known namespace names
  before initialize raise RuntimeError.  No caller-stack inspection.

Layer naming (`infer_and_assign_layer_names`): names are dotted module paths rooted at ``model``; a ModuleList adds
no segment of its own and its children use their ``layer_number`` attribute when they have one, else their index
(``model.decoder.3.mlp.fc1`` for ``decoder.layers[2]`` with ``layer_number == 3``).  A list of several models (e.g.
pipeline chunks) is disambiguated by the root: ``model0``, ``model1``, ...; a one-element list uses ``model``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import types
from typing import Any, Iterator, List, Optional, Sequence, Union

import torch

from tedebug import active
from tedebug.active import NOT_INITIALIZED as _NOT_INITIALIZED
from tedebug.active import get_iteration, is_enabled, log_message, session  # noqa: F401 (re-exported API)
from tedebug.registry import Registry, build_registry
from tedebug.session import DebugSession, global_rank, open_session
from tedebug.signal_guard import SignalGuard
from tedebug.sinks.base import add_statistics_sink, check_sink  # noqa: F401 (re-exported API)

#: the same objects as `tedebug.active.QUEUED_SINKS` / `QUEUED_SETTINGS` (what waits for the next `initialize`)
_queued_sinks: List[Any] = active.QUEUED_SINKS
_queued_settings: dict = active.QUEUED_SETTINGS
_atexit_registered = False

_NAMESPACE_NAMES = ("transformer_engine", "base")
_BASE_API_NAMES = ("log_tensor_stats",)  # nvdlfw's section-level API, routed when a base feature provides it


class _DebugApiModule(types.ModuleType):
    """This module's type: ``debug_api.DEBUG_MANAGER`` reads and writes `tedebug.active.DEBUG_MANAGER`, so the
    active session has one home however it is reached (also for a test's ``monkeypatch.setattr``).

    Any attribute of a module whose type is not exactly `types.ModuleType` takes Python's generic lookup (about
    70 ns instead of 30 ns; ``DEBUG_MANAGER`` about 160 ns), so code that runs every iteration reads the session
    from `tedebug.active`, not from here."""

    @property
    def DEBUG_MANAGER(self) -> Optional[DebugSession]:  # the nvdlfw / TE name
        return active.DEBUG_MANAGER

    @DEBUG_MANAGER.setter
    def DEBUG_MANAGER(self, value: Optional[DebugSession]) -> None:
        active.DEBUG_MANAGER = value


sys.modules[__name__].__class__ = _DebugApiModule


# ------------------------------------------------------------------------------------------------- lifecycle
def initialize(
    config_file: Any = "",
    feature_dirs: Union[None, str, Sequence[str]] = None,
    statistics_logger: Any = None,
    log_dir: Any = ".",
    init_training_step: int = 0,
    *,
    tb_writer: Any = None,
    default_logging_enabled: bool = False,
    background_logging: Union[bool, str] = "process",
    on_sink_error: str = "warn",
    statistics_rank0_only: bool = False,
    plan_cache: bool = True,
) -> None:
    """Start a debug session: load features and config, open logs and sinks (see tedebug.session).

    ``plan_cache=False`` makes every hook question of the debug path reach the features, through
    ``debug_api.transformer_engine`` (for tests that count or intercept hook calls; see `tedebug.plan`)."""
    if active.DEBUG_MANAGER is not None:
        raise RuntimeError(
            "tedebug is already initialized; call tedebug.debug_api.end_debug() before initializing again"
        )
    if not isinstance(plan_cache, bool):
        raise TypeError(f"initialize: plan_cache must be a bool, got {plan_cache!r}")
    session = open_session(
        config_file,
        feature_dirs,
        statistics_logger,
        log_dir,
        init_training_step,
        tb_writer=tb_writer,
        default_logging_enabled=default_logging_enabled,
        queued_sinks=list(_queued_sinks),
        weight_tensor_tp_group_reduce=_queued_settings.get("weight_tensor_tp_group_reduce", True),
        background_logging=background_logging,
        on_sink_error=on_sink_error,
        statistics_rank0_only=statistics_rank0_only,
    )
    _queued_sinks.clear()
    _queued_settings.clear()
    session.signal_guard = SignalGuard(session.flush)
    session.plan_cache = plan_cache
    active.DEBUG_MANAGER = session
    _register_atexit()


def step() -> None:
    """Advance the iteration by one, emit the statistics of the finished iteration, flush the sinks."""
    current = active.DEBUG_MANAGER
    if current is not None:
        guard = current.signal_guard
        if guard is None:
            current.step()
            return
        guard.entering_step()
        try:
            current.step()
        finally:
            guard.step_done()


def end_debug() -> None:
    """Close the session: reset buffers and caches, flush and close sinks, remove log handlers."""
    session, active.DEBUG_MANAGER = active.DEBUG_MANAGER, None
    if session is not None:
        if session.signal_guard is not None:
            session.signal_guard.restore()
        session.close()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Inside the block, the GEMM calls that start run as without a debug session: not inspected, quantized by the
    layer's own recipe (no debug feature changes them), nothing logged, forward and backward.  The iteration does
    not advance and the statistics of the iteration's other calls are not touched; a backward of a forward that
    ran before the block is inspected as usual.  For an evaluation loop between two steps, whose forwards would
    otherwise be counted in the next iteration's statistics.  Blocks nest; no-op before initialize."""
    current = active.DEBUG_MANAGER
    if current is None:
        yield
        return
    current.paused += 1
    try:
        yield
    finally:
        current.paused -= 1


def initialize_training_step(step_number: int) -> None:
    """Set the iteration counter (e.g. when resuming); no-op before initialize."""
    if active.DEBUG_MANAGER is not None:
        if isinstance(step_number, bool) or not isinstance(step_number, int):
            raise TypeError(f"initialize_training_step expects an int, got {step_number!r}")
        active.DEBUG_MANAGER.iteration = step_number


def _flush_at_exit() -> None:
    if active.DEBUG_MANAGER is not None:
        active.DEBUG_MANAGER.flush()


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_flush_at_exit)
        _atexit_registered = True


# ------------------------------------------------------------------------------------------------- session access
# `session`, `is_enabled`, `get_iteration` and `log_message` are `tedebug.active`'s (imported above).


def set_tensor_reduction_group(group: Any, layer_name: Optional[str] = None) -> None:
    """Set the process group over which activation/gradient statistics are reduced (None = world)."""
    current = session()
    current.reduction_group = group
    current.log_message(
        "Tensor reduction group set for statistics: activation and gradient statistics are reduced "
        "over it (weights over their TP group); pass skip_reduction=True to keep per-rank values.",
        level=logging.WARNING,
    )


def get_tensor_reduction_group() -> Any:
    return session().reduction_group


def set_weight_tensor_tp_group_reduce(enabled: bool) -> None:
    """Whether weight statistics are reduced over the layer's TP group (default True).  Before initialize the
    value is kept for the next session."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_weight_tensor_tp_group_reduce expects a bool, got {enabled!r}")
    if active.DEBUG_MANAGER is None:
        _queued_settings["weight_tensor_tp_group_reduce"] = enabled
    else:
        active.DEBUG_MANAGER.weight_tensor_tp_group_reduce = enabled


# ------------------------------------------------------------------------------------------------- features
def _feature_registry() -> Registry:
    return active.DEBUG_MANAGER.registry if active.DEBUG_MANAGER is not None else build_registry()


def _print_rank_0(text: str) -> None:
    if global_rank() == 0:
        print(text)


def list_features() -> List[str]:
    """``["namespace.FeatureName", ...]`` of the active session (built-in features before initialize);
    printed on rank 0 and returned."""
    names = _feature_registry().qualified_names()
    _print_rank_0(str(names))
    return names


def explain_features(features: Union[None, str, Sequence[str]] = None) -> str:
    """Print (rank 0) and return the docstrings of `features`: a name (``"LogTensorStats"`` or
    ``"transformer_engine.LogTensorStats"``), a list of names, or ``"all"``; None prints a usage hint."""
    registry = _feature_registry()
    if features is None:
        text = (
            "explain_features(features): pass a feature name such as 'transformer_engine.LogTensorStats', a list "
            "of names, or 'all'. list_features() lists the available features."
        )
        _print_rank_0(text)
        return text
    if isinstance(features, str):
        features = [info.qualified_name for info in registry.all_features()] if features == "all" else [features]
    blocks = []
    for requested in features:
        matches = [info for info in registry.all_features() if requested in (info.qualified_name, info.name)]
        if not matches:
            blocks.append(f"Feature {requested!r} is not supported. Available: {registry.qualified_names()}")
        for info in matches:
            blocks.append(f"-----\nfeature: {info.qualified_name}\n{info.doc}\n*****")
    text = "\n".join(blocks)
    _print_rank_0(text)
    return text


# ------------------------------------------------------------------------------------------------- layer names
def _as_module(obj: Any, where: str) -> torch.nn.Module:
    if isinstance(obj, torch.nn.Module):
        return obj
    inner = getattr(obj, "module", None)
    if isinstance(inner, torch.nn.Module):
        return inner
    raise TypeError(
        f"infer_and_assign_layer_names: {where} is a {type(obj).__name__}, expected a torch.nn.Module "
        f"(or an object with a .module attribute that is one)"
    )


def _assign_names(module: torch.nn.Module, name: str, assigned: List[str]) -> None:
    module.name = name
    assigned.append(name)
    _assign_children(module, name, assigned)


def _assign_children(module: torch.nn.Module, prefix: str, assigned: List[str]) -> None:
    for child_name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList):
            for index, item in enumerate(child):
                segment = getattr(item, "layer_number", None)
                _assign_names(item, f"{prefix}.{index if segment is None else segment}", assigned)
        else:
            _assign_names(child, f"{prefix}.{child_name}", assigned)


def infer_and_assign_layer_names(model: Any) -> List[str]:
    """Set ``.name`` on every module of `model` (a module or a list of modules) from its dotted path; see the module
    docstring for the rules.  Returns the assigned names in visiting order; works without initialize."""
    if isinstance(model, (list, tuple)):
        roots = [
            ("model" if len(model) == 1 else f"model{i}", _as_module(m, f"model[{i}]")) for i, m in enumerate(model)
        ]
    else:
        roots = [("model", _as_module(model, "model"))]
    assigned: List[str] = []
    for root_name, root in roots:
        _assign_names(root, root_name, assigned)
    if active.DEBUG_MANAGER is not None:
        for name in assigned:
            active.DEBUG_MANAGER.log_message(f"Assigned layer name: {name}")
    return assigned


# ------------------------------------------------------------------------------------------------- namespaces
def __getattr__(name: str) -> Any:
    current = active.DEBUG_MANAGER
    if current is None:
        if name in _NAMESPACE_NAMES or name in _BASE_API_NAMES:
            raise RuntimeError(_NOT_INITIALIZED)
    elif name in current.namespaces:
        return current.namespaces[name]
    elif not name.startswith("_") and current.base.has_api(name):
        return getattr(current.base, name)
    raise AttributeError(f"module 'tedebug.debug_api' has no attribute {name!r}")
