"""`LogNvfp4TensorStats`: underflows% and mse of NVFP4-quantized tensors.

Stats (bare names only): ``underflows%`` and ``mse``, logged as ``nvfp4_underflows%`` and ``nvfp4_mse``.  They are
read from the rowwise GEMM operand when it is NVFP4, else from the columnwise operand when that one is NVFP4 (a
hybrid quantizer with NVFP4 in the backward direction).  When neither is NVFP4 (a high-precision layer, e.g. a
bf16 run or a layer outside `tedebug.autocast`, or another recipe) the high-precision tensor is quantized with a
what-if NVFP4 quantizer (`what_if_nvfp4`, a tedebug extension), so any run can ask what NVFP4 would do to its
tensors.  A tensor whose statistics cannot be computed (a shape NVFP4 cannot take, no high-precision tensor) is
skipped with one warning; training goes on.  Scheduled like the other statistics features; buffer marker "nvfp4".
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from tedebug.features.base import (
    ScheduledInspectFeature,
    feed_statistics,
    log_once,
    schedule_options,
    scheduled_now,
    stat_list,
    storage_for,
)
from tedebug.features.config_checks import FeatureConfigError, require_stats_list
from tedebug.quantization.tensor import Quantizer
from tedebug.registry import api_method, register_feature
from tedebug.stats import StatRequest

MARKER = "nvfp4"
NVFP4_STATS = ("underflows%", "mse")
PREFIX = "nvfp4_"


def nvfp4_request(stat: str, usage: str) -> StatRequest:
    """The request of one bare NVFP4 stat, logged as ``nvfp4_<stat>``, read from `usage` of the NVFP4 operand."""
    return StatRequest(PREFIX + stat, stat, recipe=MARKER, columnwise=usage == "columnwise")


def what_if_nvfp4(tensor_name: str, tensor: torch.Tensor):
    """`tensor` quantized rowwise as NVFP4BlockScaling would (weights 16x16 2D blocks, other tensors 1x16 blocks),
    with round-to-nearest (no stochastic rounding: the statistics stay deterministic); RHT only ever applies to
    the columnwise operand, which these statistics do not read."""
    from tedebug.quantization.nvfp4 import NVFP4Quantizer

    quantizer = NVFP4Quantizer(with_2d_quantization=tensor_name == "weight")
    quantizer.set_usage(rowwise=True, columnwise=False)
    return quantizer.quantize(tensor.detach())


@register_feature(namespace="transformer_engine")
class LogNvfp4TensorStats(ScheduledInspectFeature):
    """Log NVFP4 quantization statistics (see the module docstring)."""

    PARAMS = ("stats",)

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        stats = require_stats_list(cls.__name__, params, path)
        for i, entry in enumerate(stats):
            if entry not in NVFP4_STATS:
                raise FeatureConfigError(
                    f"{cls.__name__}: statistic {entry!r} is not supported; supported stats: "
                    f"{list(NVFP4_STATS)} (logged as {[PREFIX + s for s in NVFP4_STATS]})",
                    path + ("stats", i),
                )

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
        quantizer: Optional[Quantizer] = None,
    ) -> None:
        from tedebug.quantization.nvfp4 import NVFP4Tensor

        if not scheduled_now(config, iteration):
            return
        name = type(self).__name__
        stats = stat_list(config)
        for stat in stats:
            if stat not in NVFP4_STATS:
                raise ValueError(f"{name}: statistic {stat!r} is not supported; supported stats: {list(NVFP4_STATS)}")
        if tensor is None:
            log_once(
                f"Feature={name}: skipping {list(stats)} of tensor {tensor_name}: they need the high-precision "
                f"tensor, which is not available (weight kept only in quantized form)",
                layer_name,
                logging.WARNING,
            )
            return
        source = usage = None
        for usage, operand in (("rowwise", rowwise_quantized_tensor), ("columnwise", columnwise_quantized_tensor)):
            source = storage_for(operand, usage)
            if isinstance(source, NVFP4Tensor):
                break
            source = None
        if source is None:  # no NVFP4 operand (high precision or another format): the what-if NVFP4 quantization
            usage = "rowwise"
            try:
                source = what_if_nvfp4(tensor_name, tensor)
            except (ValueError, TypeError, RuntimeError) as err:
                log_once(
                    f"Feature={name}: skipping {list(stats)} of tensor {tensor_name}: the what-if NVFP4 "
                    f"quantization of shape {tuple(tensor.shape)} failed: {err}",
                    layer_name,
                    logging.WARNING,
                )
                return
        fed = feed_statistics(
            name,
            layer_name,
            tensor_name,
            [nvfp4_request(s, usage) for s in stats],
            tensor,
            iteration=iteration,
            options=schedule_options(config) + (MARKER,),
            quantized={MARKER: source},
            tp_group=tp_group,
            tp_size=tp_size,
            names=list(stats),
        )
        if not fed:
            return
        log_once(f"Feature={name}, API=inspect_tensor: {tensor_name}", layer_name)
