"""`PerTensorScaling`: current per-tensor scaling for selected GEMM operands.

Under a per-tensor FP8 recipe (delayed or current scaling), the selected operand is quantized with a fresh
per-tensor current-scaling quantizer of the layer quantizer's FP8 format (scale = fp8_max / amax of this tensor,
no power-of-two rounding, epsilon 0) instead of the layer's quantizer; the GEMM still runs in FP8 with the other
operand quantized as usual.  Any other recipe (or no quantizer) is an error naming it.  Scales are per rank (no amax
reduction across tensor-parallel shards).

Config: ``gemms`` / ``gemms_struct`` and ``tensors`` / ``tensors_struct`` (activation, gradient, weight); no other
keys.  ``modify_tensor_enabled`` answers ``(True, iteration + 1)`` for every routed (gemm, tensor).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tedebug.features.base import ValidatedFeature, log_once
from tedebug.features.config_checks import FeatureConfigError, check_known_keys
from tedebug.quantization.tensor import Quantizer
from tedebug.recipe import PER_TENSOR_RECIPE_NAMES, RecipeName
from tedebug.registry import api_method, register_feature

TENSORS = ("activation", "gradient", "weight")


def current_scaling_quantizer(default_quantizer: Optional[Quantizer], where: str):
    """The per-tensor current-scaling quantizer replacing `default_quantizer` (which must be per-tensor FP8)."""
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    recipe = getattr(default_quantizer, "recipe_name", None)
    if default_quantizer is None or recipe not in PER_TENSOR_RECIPE_NAMES:
        what = (
            "no quantizer (the layer runs outside autocast)"
            if default_quantizer is None
            else (f"recipe {recipe or '<none>'!r} ({type(default_quantizer).__name__})")
        )
        raise ValueError(
            f"PerTensorScaling ({where}) works only under a per-tensor FP8 recipe "
            f"({RecipeName.DELAYED} or {RecipeName.CURRENT}); the layer has {what}"
        )
    return Float8CurrentScalingQuantizer(default_quantizer.fp8_format, amax_epsilon=0.0, force_pow_2_scales=False)


@register_feature(namespace="transformer_engine")
class PerTensorScaling(ValidatedFeature):
    """Quantize the selected operands with per-tensor current scaling (see the module docstring)."""

    USES_GEMMS = True

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        tensor = params.get("tensor")
        if tensor is not None and tensor not in TENSORS:
            raise FeatureConfigError(
                f"{cls.__name__}: tensor {tensor!r} cannot be scaled (GEMM outputs are not "
                f"quantized); expected one of {list(TENSORS)}",
                path + ("tensor",),
            )

    @classmethod
    def validate_feature_config(cls, cfg: dict) -> None:
        super().validate_feature_config(cfg)
        tensors = cfg.get("tensors")
        listed = [tensors] if isinstance(tensors, str) else list(tensors or [])
        for entry in cfg.get("gemms_struct") or []:
            more = entry.get("tensors") if isinstance(entry, dict) else None
            listed += [more] if isinstance(more, str) else list(more or [])
        for name in listed:
            if name not in TENSORS:
                raise FeatureConfigError(
                    f"{cls.__name__}: tensor {name!r} cannot be scaled (GEMM outputs are not "
                    f"quantized); expected one of {list(TENSORS)}",
                    ("tensors",),
                )

    @api_method
    def modify_tensor_enabled(self, config: dict, layer_name: str, gemm: str, tensor_name: str, iteration: int):
        return True, iteration + 1

    @api_method
    def modify_tensor(
        self,
        config: dict,
        layer_name: str,
        gemm: str,
        tensor_name: str,
        tensor: torch.Tensor,
        default_quantizer: Optional[Quantizer] = None,
        iteration: int = 0,
        dtype: Optional[torch.dtype] = None,
        out: Any = None,
    ):
        check_known_keys(type(self).__name__, config, ("gemm", "tensor"))
        where = f"layer {layer_name!r}, gemm {gemm}, tensor {tensor_name}"
        quantizer = current_scaling_quantizer(default_quantizer, where)
        source = tensor.detach().contiguous()
        if dtype is not None:
            source = source.to(dtype)
        log_once(f"Feature={type(self).__name__}, API=process_tensor: {gemm}, {tensor_name}", layer_name)
        if out is not None:
            from tedebug.quantization.float8 import Float8Tensor

            if not isinstance(out, Float8Tensor):
                raise TypeError(f"PerTensorScaling ({where}): out= must be a Float8Tensor, got {type(out).__name__}")
            quantizer.quantize(source, out=out)
            return None
        return quantizer.quantize(source)
