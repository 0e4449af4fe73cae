"""`LogTensorStats`: high-precision statistics of a tensor (te_debug_reference C.1, F.2, F.5, F.6).

Statistics: min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range, nan_count, inf_count, and the mapping
entry ``{max_blockwise_dynamic_range: {block_size: int > 0 (default 32), dims: 1 | 2 (default 1)}}`` (taken over
both orientations iff the tensor is activation or weight).  Scheduled by freq / start_step / end_step /
start_end_list.  A weight that exists only in quantized form (``tensor=None``) is measured on the dequantized
rowwise data.  Values are buffered in the stats engine and emitted at `debug_api.step()`.
A blockwise entry whose block_size does not fit the tensor's 2-D view (numel, or for dims=2 both dims, not
divisible) is skipped for that tensor shape with one warning in the main log; the other statistics go on.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from tedebug.feature_support import (
    FeatureConfigError,
    ScheduledInspectFeature,
    cached_schedule,
    config_memoized,
    log_once,
    memoized,
    reduction_args,
    require_stats_list,
    schedule_options,
    session,
    stat_list,
)
from tedebug.quantization.tensor import QuantizedTensor
from tedebug.registry import api_method, register_feature
from tedebug.stats import StatRequest
from tedebug.stats.definitions import BLOCKWISE_KIND

#: the config keys an `InspectPlan` depends on (with the tensor name)
PLAN_KEYS = ("stats", "freq", "start_step", "end_step", "start_end_list")


def hp_requests(stats: list, tensor_name: Optional[str]) -> tuple:
    """StatRequests of a LogTensorStats ``stats`` list (ValueError for an unsupported entry)."""
    return tuple(StatRequest.parse_hp(entry, tensor_name=tensor_name) for entry in stats)


def feed_arguments(config: dict, tensor_name: Optional[str]) -> tuple:
    """``(requests, buffer-key options)`` of a parsed config, built once per session for each distinct config
    content; the same requests tuple is returned every time, which lets the stats engine skip its own parsing."""
    stats = stat_list(config)
    return memoized("LogTensorStats.feed", (stats, tensor_name, config.get("start_step"), config.get("end_step"),
                                            config.get("start_end_list")),
                    lambda: (hp_requests(stats, tensor_name), schedule_options(config)))


class InspectPlan:
    """What `inspect_tensor` derives from one parsed config and tensor name: the schedule, and the feed arguments
    (`feed_arguments`, filled in at the first active call, so a bad ``stats`` entry fails where it always did)."""

    __slots__ = ("schedule", "feed", "fitting")

    def __init__(self, config: dict) -> None:
        self.schedule = cached_schedule(config)
        self.feed: Optional[tuple] = None
        #: tensor shape -> the requests that fit it (only when a blockwise request exists; None otherwise)
        self.fitting: Optional[dict] = None


def blockwise_misfit(request: StatRequest, shape: torch.Size) -> Optional[str]:
    """Why a blockwise request cannot be computed on a tensor of `shape` (its 2-D view), or None when it can."""
    block_size, dims = request.params[0], request.params[1]
    cols = shape[-1] if len(shape) else 1
    rows = shape.numel() // cols if cols else 0
    if dims == 1 and (rows * cols) % block_size:
        return f"numel {rows * cols} is not divisible by block_size {block_size}"
    if dims == 2 and (rows % block_size or cols % block_size):
        return f"dims=2 needs both dims of the 2-D view {rows}x{cols} divisible by block_size {block_size}"
    return None


def fitting_requests(plan: InspectPlan, requests: tuple, x: torch.Tensor, layer_name: str, tensor_name: str,
                     ) -> tuple:
    """`requests` without the blockwise ones that do not fit `x` (one warning per layer, tensor and reason);
    memoised per shape on the plan, so the same tuple comes back for the same shape."""
    fitting = plan.fitting
    kept = fitting.get(x.shape)
    if kept is None:
        kept = []
        for request in requests:
            reason = blockwise_misfit(request, x.shape) if request.kind == BLOCKWISE_KIND else None
            if reason is None:
                kept.append(request)
            else:
                log_once(f"Feature=LogTensorStats: skipping {request.name} for tensor {tensor_name} of shape "
                         f"{list(x.shape)}: {reason}", layer_name, logging.WARNING)
        kept = fitting[x.shape] = requests if len(kept) == len(requests) else tuple(kept)
    return kept


def inspect_plan(config: dict, tensor_name: Optional[str]) -> InspectPlan:
    """The session's `InspectPlan` of this config object and tensor name (see `config_memoized`)."""
    return config_memoized("LogTensorStats.plan", config, PLAN_KEYS, tensor_name, lambda: InspectPlan(config))


#: (feature class name, tensor name) -> the once-per-layer "look_at_tensor_before_process" line (pure text)
_LOOK_MESSAGES: dict = {}


def look_message(feature: str, tensor_name: str) -> str:
    message = _LOOK_MESSAGES.get((feature, tensor_name))
    if message is None:
        message = _LOOK_MESSAGES[(feature, tensor_name)] = (
            f"Feature={feature}, API=look_at_tensor_before_process: {tensor_name}")
    return message


@register_feature(namespace="transformer_engine")
class LogTensorStats(ScheduledInspectFeature):
    """Log high-precision statistics of the selected tensors (see the module docstring)."""

    PARAMS = ("stats",)

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        stats = require_stats_list(cls.__name__, params, path)
        for i, entry in enumerate(stats):
            try:
                StatRequest.parse_hp(entry, tensor_name=params.get("tensor"))
            except ValueError as err:
                raise FeatureConfigError(f"{cls.__name__}: {err}", path + ("stats", i)) from err

    @api_method
    def inspect_tensor(self, config: dict, layer_name: str, tensor_name: str, iteration: int,
                       tensor: Optional[torch.Tensor] = None, tp_group: Any = None, tp_size: int = 1,
                       rowwise_quantized_tensor: Any = None, columnwise_quantized_tensor: Any = None,
                       quantizer: Any = None) -> None:
        self._feed(config, inspect_plan(config, tensor_name), layer_name, tensor_name, iteration, tensor, tp_group,
                   tp_size, rowwise_quantized_tensor)

    def bind_inspect_tensor(self, config: dict, layer_name: str, tensor_name: str):
        """`inspect_tensor` bound to one routed config, layer and tensor name for the rest of the session, as
        ``call(iteration, tensor, tp_group, tp_size, rowwise_quantized_tensor, columnwise_quantized_tensor,
        quantizer)`` (what `tedebug.plan` calls on the debug path; used only while this class also defines
        `inspect_tensor`).  The plan is looked up once: a route's config does not change during its session."""
        plan = inspect_plan(config, tensor_name)
        feed = self._feed

        def call(iteration: int, tensor: Optional[torch.Tensor], tp_group: Any, tp_size: int,
                 rowwise_quantized_tensor: Any, columnwise_quantized_tensor: Any, quantizer: Any) -> None:
            feed(config, plan, layer_name, tensor_name, iteration, tensor, tp_group, tp_size, rowwise_quantized_tensor)

        return call

    def _feed(self, config: dict, plan: "InspectPlan", layer_name: str, tensor_name: str, iteration: int,
              tensor: Optional[torch.Tensor], tp_group: Any, tp_size: int, rowwise_quantized_tensor: Any) -> None:
        """The work of `inspect_tensor` once its plan is known."""
        if not plan.schedule.is_active(iteration):
            return
        x = high_precision_input(layer_name, tensor_name, tensor, rowwise_quantized_tensor)
        if plan.feed is None:
            plan.feed = feed_arguments(config, tensor_name)
            if any(request.kind == BLOCKWISE_KIND for request in plan.feed[0]):
                plan.fitting = {}
        requests, options = plan.feed
        if plan.fitting is not None:
            requests = fitting_requests(plan, requests, x, layer_name, tensor_name)
            if not requests:
                return
        current = session()
        group, skip, is_weight = reduction_args(current, tensor_name, tp_group, tp_size)
        current.stats.feed(layer_name, tensor_name, requests, x, iteration=iteration, options=options,
                           reduction_group=group, skip_reduction=skip, is_weight=is_weight)
        log_once(look_message(type(self).__name__, tensor_name), layer_name)


def high_precision_input(layer_name: str, tensor_name: str, tensor: Any, rowwise_quantized_tensor: Any
                         ) -> torch.Tensor:
    """The tensor to measure: `tensor`, or (when None: a weight kept only in quantized form) the dequantized
    rowwise operand.  Quantized or integer tensors are rejected."""
    if tensor is None:
        source = rowwise_quantized_tensor
        if isinstance(source, QuantizedTensor):
            return source.dequantize()
        if isinstance(source, torch.Tensor) and source.is_floating_point():
            return source
        raise ValueError(f"LogTensorStats: layer {layer_name!r}, tensor {tensor_name!r}: no high-precision tensor "
                         f"and no quantized rowwise tensor to dequantize (got {type(source).__name__})")
    if isinstance(tensor, QuantizedTensor) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        kind = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else f"a {tensor.dtype} tensor"
        raise ValueError(
            f"LogTensorStats: tensor {tensor_name!r} of layer {layer_name!r} must be in high precision, got {kind}; "
            f"use LogFp8TensorStats (log_fp8_tensor_stats) for statistics of quantized tensors"
        )
    return tensor
