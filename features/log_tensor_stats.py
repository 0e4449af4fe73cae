"""`LogTensorStats`: high-precision statistics of the selected tensors.

Statistics: min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range, nan_count, inf_count, and the mapping
entry ``{max_blockwise_dynamic_range: {block_size: int > 0 (default 32), dims: 1 | 2 (default 1)}}`` (taken over
both orientations iff the tensor is activation or weight).  Scheduled by freq / start_step / end_step /
start_end_list.  A weight that exists only in quantized form (``tensor=None``) is measured on the dequantized
rowwise data.  Values are buffered in the stats engine and emitted at `debug_api.step()`, reduced across ranks
(activations and gradients over the session's reduction group, weights over their tensor-parallel group).
A blockwise entry whose block_size does not fit the tensor's 2-D view (numel, or for dims=2 both dims, not
divisible) is skipped for that tensor shape with one warning per layer in the main log; the other statistics go on.

What the hook derives from the config alone (schedule, statistic requests, log line) is an `InspectPlan`, built
once per session for each distinct config content and tensor name (`tedebug.memo`).
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Dict, Optional, Tuple

import torch

from tedebug import active, memo
from tedebug.features.base import (
    ScheduledInspectFeature,
    log_once,
    reduction_args,
    schedule_of,
    schedule_options,
    stat_list,
)
from tedebug.features.config_checks import FeatureConfigError, require_stats_list
from tedebug.quantization.tensor import QuantizedTensor
from tedebug.registry import api_method, register_feature
from tedebug.stats import StatRequest
from tedebug.stats.definitions import BLOCKWISE_KIND


@register_feature(namespace="transformer_engine")
class LogTensorStats(ScheduledInspectFeature):
    """Log high-precision statistics of the selected tensors (see the module docstring)."""

    PARAMS = ("stats",)
    #: it feeds the inspected tensor's basic statistics: a quantizer of that tensor may compute them in its amax
    #: pass (`tedebug.plan.InspectCall.feeds_basic_statistics`, `Quantizer.high_precision_stats`)
    FEEDS_BASIC_STATISTICS = True

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        stats = require_stats_list(cls.__name__, params, path)
        for i, entry in enumerate(stats):
            try:
                StatRequest.parse_hp(entry, tensor_name=params.get("tensor"))
            except ValueError as err:
                raise FeatureConfigError(f"{cls.__name__}: {err}", path + ("stats", i)) from err

    @api_method
    def inspect_tensor(
        self,
        config: dict,
        layer_name: str,
        tensor_name: str,
        iteration: int,
        tensor: Optional[torch.Tensor] = None,
        tp_group: Any = None,
        tp_size: int = 1,
        rowwise_quantized_tensor: Any = None,
        columnwise_quantized_tensor: Any = None,
        quantizer: Any = None,
    ) -> None:
        inspect_plan(config, tensor_name, type(self).__name__).feed(
            layer_name, iteration, tensor, tp_group, tp_size, rowwise_quantized_tensor
        )

    def bind_inspect_tensor(self, config: dict, layer_name: str, tensor_name: str):
        """`inspect_tensor` bound to one routed config, layer and tensor name for the rest of the session, as
        ``call(iteration, tensor, tp_group, tp_size, rowwise_quantized_tensor, columnwise_quantized_tensor,
        quantizer)`` (what `tedebug.plan` calls on the debug path; used only while this class also defines
        `inspect_tensor`): the plan's `InspectPlan.feed` with the layer name bound (`functools.partial`, so a logged
        tensor costs one Python call here).  The plan is looked up once: a route's config does not change during
        its session."""
        return functools.partial(inspect_plan(config, tensor_name, type(self).__name__).feed, layer_name)


def inspect_plan(config: dict, tensor_name: Optional[str], feature_name: str = "LogTensorStats") -> "InspectPlan":
    """The session's `InspectPlan` for this config content, tensor name and feature class name."""
    key = (
        feature_name,
        tensor_name,
        config.get("stats"),
        config.get("freq"),
        config.get("start_step"),
        config.get("end_step"),
        config.get("start_end_list"),
    )
    return memo.memoized("LogTensorStats.plan", key, lambda: InspectPlan(config, tensor_name, feature_name))


class InspectPlan:
    """What `inspect_tensor` derives from one config content and tensor name, and the feed it does each call.

    The statistic requests are parsed at the first *active* call, so a bad ``stats`` entry fails there (after the
    schedule and tensor checks), not at an inactive iteration."""

    def __init__(self, config: dict, tensor_name: Optional[str], feature_name: str) -> None:
        self.tensor_name = tensor_name
        self.stats = copy.deepcopy(config.get("stats"))  # the content the plan was built for
        self.schedule = schedule_of(config)
        self.options = schedule_options(config)
        self.message = f"Feature={feature_name}, API=look_at_tensor_before_process: {tensor_name}"
        self.requests: Optional[Tuple[StatRequest, ...]] = None
        #: tensor shape -> (the requests that fit it, warnings for the others); used only with blockwise requests
        self.by_shape: Optional[Dict[torch.Size, tuple]] = None
        #: the layers whose `message` this plan wrote (the session writes a line once per layer anyway; the plan
        #: lives no longer than its session)
        self.logged_layers: set = set()
        #: (iteration, the schedule active at it) of the last feed: the plan of a config and tensor name serves that
        #: tensor of every layer the config selects, so the schedule is evaluated once per iteration (one tuple:
        #: threads read it whole)
        self.active_at: Tuple[Optional[int], bool] = (None, False)
        #: layer name -> the stats engine's feeder of that layer's buffer (`StatsEngine.slab_feeder`: its usual GPU
        #: feed in a few steps), renewed by each feed that takes the general path
        self.feeders: Dict[str, Any] = {}

    def feed(
        self,
        layer_name: str,
        iteration: int,
        tensor: Optional[torch.Tensor],
        tp_group: Any,
        tp_size: int,
        rowwise_quantized_tensor: Any,
        columnwise_quantized_tensor: Any = None,
        quantizer: Any = None,
    ) -> bool:
        """Feed the tensor's statistics to the stats engine when the schedule is active at `iteration`, and at the
        first feed of a layer write `message` to the main log; True when it fed.  (The last two arguments are those
        of the bound ``inspect_tensor`` call, which this feature does not read.)"""
        active_at = self.active_at
        if active_at[0] != iteration:
            active_at = self.active_at = (iteration, self.schedule.is_active(iteration))
        if not active_at[1]:
            return False
        feeder = self.feeders.get(layer_name)
        if feeder is not None:  # the usual GPU feed (a slab row) in a few steps, when the feeder takes it
            current = active.DEBUG_MANAGER
            if current is not None and feeder.engine is current.stats:
                if self.tensor_name != "weight":  # `reduction_args` of a tensor that is no weight, without its call
                    fed = feeder.feed(tensor, iteration, current.reduction_group, False, False)
                else:
                    fed = feeder.feed(tensor, iteration, *reduction_args(current, self.tensor_name, tp_group, tp_size))
                if fed:
                    return True
        if type(tensor) is torch.Tensor and tensor.is_floating_point():  # the common case of the check below
            x = tensor
        else:
            x = high_precision_input(layer_name, self.tensor_name, tensor, rowwise_quantized_tensor)
        requests = self.requests
        if requests is None:
            requests = self.requests = self._parse_requests()
        if self.by_shape is not None:
            requests = self._fitting(requests, x, layer_name)
            if not requests:
                return False
        current = active.DEBUG_MANAGER
        if current is None:
            current = active.session()  # (raises: not initialised)
        group, skip, is_weight = reduction_args(current, self.tensor_name, tp_group, tp_size)
        engine = current.stats
        engine.feed(
            layer_name,
            self.tensor_name,
            requests,
            x,
            iteration=iteration,
            options=self.options,
            reduction_group=group,
            skip_reduction=skip,
            is_weight=is_weight,
        )
        if engine.has_slab_routes and self.by_shape is None:  # (blockwise requests: no slab route)
            self.feeders[layer_name] = engine.slab_feeder((layer_name, self.tensor_name, self.options), requests)
        if layer_name not in self.logged_layers:
            log_once(self.message, layer_name)
            self.logged_layers.add(layer_name)
        return True

    def _parse_requests(self) -> Tuple[StatRequest, ...]:
        stats = stat_list({"stats": self.stats})
        requests = tuple(StatRequest.parse_hp(entry, tensor_name=self.tensor_name) for entry in stats)
        if any(request.kind == BLOCKWISE_KIND for request in requests):
            self.by_shape = {}
        return requests

    def _fitting(self, requests: tuple, x: torch.Tensor, layer_name: str) -> tuple:
        """`requests` without the blockwise ones that do not fit `x` (a warning per layer, tensor and reason)."""
        entry = self.by_shape.get(x.shape)
        if entry is None:
            kept, warnings = [], []
            for request in requests:
                reason = blockwise_misfit(request, x.shape) if request.kind == BLOCKWISE_KIND else None
                if reason is None:
                    kept.append(request)
                else:
                    warnings.append(
                        f"Feature=LogTensorStats: skipping {request.name} for tensor {self.tensor_name} "
                        f"of shape {list(x.shape)}: {reason}"
                    )
            entry = self.by_shape[x.shape] = (requests if not warnings else tuple(kept), tuple(warnings))
        for warning in entry[1]:
            log_once(warning, layer_name, logging.WARNING)
        return entry[0]


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


def high_precision_input(layer_name: str, tensor_name: str, tensor: Any, rowwise_quantized_tensor: Any) -> torch.Tensor:
    """The tensor to measure: `tensor`, or (when None: a weight kept only in quantized form) the dequantized
    rowwise operand.  Quantized or integer tensors are rejected."""
    if tensor is None:
        source = rowwise_quantized_tensor
        if isinstance(source, QuantizedTensor):
            return source.dequantize()
        if isinstance(source, torch.Tensor) and source.is_floating_point():
            return source
        raise ValueError(
            f"LogTensorStats: layer {layer_name!r}, tensor {tensor_name!r}: no high-precision tensor "
            f"and no quantized rowwise tensor to dequantize (got {type(source).__name__})"
        )
    if isinstance(tensor, QuantizedTensor) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        kind = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else f"a {tensor.dtype} tensor"
        raise ValueError(
            f"LogTensorStats: tensor {tensor_name!r} of layer {layer_name!r} must be in high precision, got {kind}; "
            f"use LogFp8TensorStats (log_fp8_tensor_stats) for statistics of quantized tensors"
        )
    return tensor
