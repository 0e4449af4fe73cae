"""What the built-in features share: two base classes and the run-time helpers of their hooks.

- `ValidatedFeature`: a feature declares its parameters (`PARAMS`), which selection keys it takes (`USES_GEMMS`,
  `USES_TENSORS`) and whether it is scheduled (`SCHEDULED`); every key of its config block is then checked when the
  config is loaded, and `check_params` checks the values of every effective config (`features.config_checks`).
- `ScheduledInspectFeature`: the inspecting features (statistics, dumps).  They take the schedule keys and answer
  `inspect_tensor_enabled` from them alone, so the caller knows between which iterations nothing is inspected.
- Run-time helpers: the parsed schedule of a config (`schedule_of`, parsed once per session through `tedebug.memo`),
  the reduction arguments of a statistics feed (`reduction_args`), the quantized storage behind a GEMM operand
  (`storage_for`) and a main-log line written once per layer (`log_once`).

Neither base class is registered as a feature: the registry registers only classes decorated with
`register_feature`.  Features read the active session from `tedebug.active`.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from tedebug import active, memo
from tedebug.config.schedule import SCHEDULE_KEYS, Schedule
from tedebug.features.config_checks import (
    FeatureConfigError,
    check_known_keys,
    check_schedule,
    check_selection,
    effective_configs,
    levels,
)
from tedebug.quantization.tensor import QuantizedTensor
from tedebug.registry import FeatureMapper, api_method


# ------------------------------------------------------------------------------------------------ base classes
class ValidatedFeature(FeatureMapper):
    """Base of the built-in features: declared parameters, checked at config load.

    Subclasses set `PARAMS` (feature parameter names), `USES_GEMMS` / `USES_TENSORS` (which selection keys the
    feature takes), `SCHEDULED` (whether freq / start_step / end_step / start_end_list are accepted) and may override
    `check_params(cls, params, path)` to check the values of one effective config.
    """

    PARAMS: Tuple[str, ...] = ()
    USES_GEMMS = False
    USES_TENSORS = True
    SCHEDULED = False

    @classmethod
    def param_names(cls) -> Tuple[str, ...]:
        return tuple(cls.PARAMS) + (SCHEDULE_KEYS if cls.SCHEDULED else ())

    @classmethod
    def validate_feature_config(cls, cfg: dict) -> None:
        if not isinstance(cfg, dict):
            raise FeatureConfigError(f"{cls.__name__}: the feature config must be a mapping, got {type(cfg).__name__}")
        for path, level, structural in levels(cfg, cls.USES_GEMMS, cls.USES_TENSORS):
            check_known_keys(cls.__name__, level, structural + cls.param_names(), path)
        check_selection(cls.__name__, cfg, cls.USES_GEMMS, cls.USES_TENSORS)
        for path, params in effective_configs(cfg, cls.USES_GEMMS, cls.USES_TENSORS):
            if cls.SCHEDULED:
                check_schedule(cls.__name__, params, path)
            cls.check_params(params, path)

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        """Check the parameter values of one effective config (raise `FeatureConfigError`)."""


class ScheduledInspectFeature(ValidatedFeature):
    """Base of the inspecting features (statistics, dumps): accepts the schedule keys and answers
    `inspect_tensor_enabled` from them.

    `NOTE_STATS` says whether the answer's next iteration is recorded for the layer in the stats engine (the
    statistics features: a layer takes part in a step's reduction only when it was due to log) or not (DumpTensors).
    `inspect_tensor` is reached once *any* feature selecting the tensor is enabled (the answers of several features
    are OR-ed), so a subclass's `inspect_tensor` re-checks its own schedule (`scheduled_now`) before doing anything.
    """

    SCHEDULED = True
    NOTE_STATS = True
    #: `*_enabled` hooks answered from the schedule keys alone: `tedebug.plan` evaluates the schedule instead of
    #: calling them (a subclass overriding one is called again unless it declares this itself)
    SCHEDULE_ONLY_HOOKS = frozenset({"inspect_tensor_enabled"})

    @api_method
    def inspect_tensor_enabled(self, config: dict, layer_name: str, tensor_name: str, iteration: int):
        active_now, next_iteration = schedule_of(config).query(iteration)
        if self.NOTE_STATS:  # the last feature to answer for a layer wins, as in TransformerEngine
            active.session().stats.note_next_iteration(layer_name, next_iteration)
        return active_now, next_iteration


# ------------------------------------------------------------------------------------------------ scheduling
def schedule_of(config: dict) -> Schedule:
    """`Schedule.from_config(config)`, parsed once per session for each distinct set of schedule values."""
    values = (config.get("freq"), config.get("start_step"), config.get("end_step"), config.get("start_end_list"))
    return memo.memoized("schedule", values, lambda: Schedule.from_config(config))


def scheduled_now(config: dict, iteration: int) -> bool:
    """True when the feature's own schedule is active at `iteration`."""
    return schedule_of(config).is_active(iteration)


def schedule_options(config: dict) -> Tuple[Any, ...]:
    """The schedule part of a statistics buffer key: (start_step, end_step, start_end_list as int tuples).  Two
    features logging the same statistic on different schedules never share a buffer."""
    pairs = config.get("start_end_list") or ()
    return (config.get("start_step"), config.get("end_step"), tuple((int(a), int(b)) for a, b in pairs))


# ------------------------------------------------------------------------------------------------ feeding
def stat_list(config: Dict[str, Any]) -> list:
    """The parsed config's ``stats`` list (ValueError when absent: validation should have caught it)."""
    stats = config.get("stats")
    if not isinstance(stats, list) or not stats:
        raise ValueError(f"the feature config has no 'stats' list (got {stats!r})")
    return stats


def reduction_args(current: Any, tensor_name: str, tp_group: Any, tp_size: Optional[int]) -> Tuple[Any, bool, bool]:
    """``(reduction_group, skip_reduction, is_weight)`` of a statistics feed in session `current`.

    Activations and gradients are reduced over the session's reduction group (None = every rank).  A weight is
    reduced over the layer's tensor-parallel group when `weight_tensor_tp_group_reduce` is on, the layer is split
    (tp_size > 1) and it has a group; otherwise a weight is not reduced (its shards differ, its replicas agree).
    """
    if tensor_name != "weight":
        return current.reduction_group, False, False
    if current.weight_tensor_tp_group_reduce and (tp_size or 1) > 1 and tp_group is not None:
        return tp_group, False, True
    return None, True, True


def feed_statistics(
    feature_name: str,
    layer_name: str,
    tensor_name: str,
    requests: Sequence[Any],
    tensor: Optional[torch.Tensor],
    *,
    iteration: int,
    options: Tuple[Any, ...],
    quantized: Optional[Dict[str, Any]],
    tp_group: Any,
    tp_size: int,
    names: Optional[list] = None,
) -> bool:
    """Feed `requests` of `tensor` to the active session's statistics engine, reduced as `reduction_args` says.  A
    statistic never stops training: a failure is one warning in the main log naming `names` (default: the requests'
    names), and the result is False."""
    current = active.session()
    group, skip, is_weight = reduction_args(current, tensor_name, tp_group, tp_size)
    try:
        current.stats.feed(
            layer_name,
            tensor_name,
            requests,
            tensor,
            iteration=iteration,
            options=options,
            quantized=quantized,
            reduction_group=group,
            skip_reduction=skip,
            is_weight=is_weight,
        )
    except (ValueError, TypeError, RuntimeError) as err:
        skipped = names if names is not None else [r.name for r in requests]
        log_once(
            f"Feature={feature_name}: skipping {skipped} of tensor {tensor_name}: computing them failed: {err}",
            layer_name,
            logging.WARNING,
        )
        return False
    return True


def storage_for(operand: Any, usage: str) -> Optional[QuantizedTensor]:
    """The quantized storage holding `usage` ("rowwise" / "columnwise") of a GEMM operand (a hybrid gives its
    sub-storage), or None when the operand is high precision (plain tensor, identity format) or absent."""
    from tedebug.quantization.hybrid import HybridQuantizedTensor
    from tedebug.quantization.identity import IdentityTensor

    while isinstance(operand, HybridQuantizedTensor):
        operand = getattr(operand, f"{usage}_sub_storage")
    if isinstance(operand, QuantizedTensor) and not isinstance(operand, IdentityTensor):
        return operand
    return None


def log_once(message: str, layer_name: Optional[str] = None, level: int = logging.INFO) -> None:
    """Write `message` to the main log once per (layer, message) in this session."""
    active.session().log_message(message, layer_name, level)
