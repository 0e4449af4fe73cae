"""`FakeQuant`: replace selected GEMM operands by their quantize-then-dequantize values.

``quant_format`` (required) selects the format; values are quantized with the quantization core and dequantized
back to the input dtype (then to ``dtype`` when the caller gives one), on any device:

- ``FP8E4M3`` / ``FP8E5M2``: per-tensor FP8 with scale = fp8_max / amax, amax = max|x| in fp32; the scale stays 1
  when amax is 0 or not finite (a NaN anywhere makes amax NaN) and is FLT_MAX when the quotient overflows (the
  delayed-scaling scale rule with margin 0 and a previous scale of 1);
- ``MXFP8E4M3`` / ``MXFP8E5M2``: MXFP8 (1x32 blocks along the last dim, E8M0 scales);
- ``NVFP4``: NVFP4 (1x16 blocks along the last dim, E4M3 block scales, fp32 global scale, round to nearest).

A GEMM with a fake-quantized operand runs in high precision: ``fp8_gemm_enabled`` answers False for the routed
GEMMs (so the partner operand is not quantized either) and ``modify_tensor_enabled`` answers
``(True, iteration + 1)``.  tedebug's ``fp8_gemm_enabled`` answers ``(False, iteration + 1)`` where
TransformerEngine answers ``(False, None)``: with None, a layer whose routed GEMM has no fake-quantized operand
(e.g. ``gemms: [wgrad], tensors: [weight]``) would leave debug mode after one iteration and silently quantize that
GEMM again from then on.

An operand whose shape the format cannot take (MXFP8's blocks of 32 or NVFP4's of 16 along the last dimension) is
left in high precision, with one warning in the main log per layer, GEMM and tensor.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from tedebug.features.base import ValidatedFeature, log_once
from tedebug.features.config_checks import FeatureConfigError, check_known_keys, require_param
from tedebug.quantization.tensor import QuantizedTensor, UnsupportedShapeError
from tedebug.registry import api_method, register_feature

QUANT_FORMATS = ("FP8E4M3", "FP8E5M2", "MXFP8E4M3", "MXFP8E5M2", "NVFP4")


def fake_quant_fp8_scale(tensor: torch.Tensor, fp8_format: str) -> torch.Tensor:
    """0-d fp32 scale: fp8_max / max|x|; 1 when the amax is 0 or not finite; FLT_MAX when the quotient is inf."""
    from tedebug.quantization.formats import FP8_MAX, compute_scale_from_amax

    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=tensor.device)
    amax = tensor.detach().float().abs().amax()  # NaN propagates (-> scale 1), unlike the NaN-ignoring amax
    return compute_scale_from_amax(amax, FP8_MAX[fp8_format])


def fake_quantize(tensor: torch.Tensor, quant_format: str) -> torch.Tensor:
    """Quantize `tensor` in `quant_format` and dequantize it back to `tensor.dtype` (see the module docstring)."""
    if quant_format not in QUANT_FORMATS:
        raise ValueError(f"FakeQuant: unsupported quant_format {quant_format!r}; expected one of {list(QUANT_FORMATS)}")
    x = tensor.detach()
    if quant_format.startswith("FP8"):
        from tedebug.quantization.float8 import Float8Quantizer

        fmt = quant_format[3:]
        quantizer = Float8Quantizer(
            fake_quant_fp8_scale(x, fmt), torch.zeros(1, device=x.device), fmt, columnwise=False
        )
    elif quant_format.startswith("MXFP8"):
        from tedebug.quantization.mxfp8 import MXFP8Quantizer

        quantizer = MXFP8Quantizer(quant_format[5:], columnwise=False)
    else:
        from tedebug.quantization.nvfp4 import NVFP4Quantizer

        quantizer = NVFP4Quantizer(columnwise=False)
    return quantizer.quantize(x).dequantize(dtype=x.dtype)


@register_feature(namespace="transformer_engine")
class FakeQuant(ValidatedFeature):
    """Fake-quantize the selected operands; the GEMMs they feed run in high precision."""

    PARAMS = ("quant_format",)
    USES_GEMMS = True

    @classmethod
    def check_params(cls, params: dict, path: tuple) -> None:
        fmt = require_param(cls.__name__, params, "quant_format", path, f"one of {list(QUANT_FORMATS)}")
        if fmt not in QUANT_FORMATS:
            raise FeatureConfigError(
                f"{cls.__name__}: unsupported quant_format {fmt!r}; expected one of {list(QUANT_FORMATS)}",
                path + ("quant_format",),
            )

    @api_method
    def fp8_gemm_enabled(self, config: dict, layer_name: str, gemm: str, iteration: int):
        return False, iteration + 1

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
        default_quantizer: Any = None,
        iteration: int = 0,
        dtype: Optional[torch.dtype] = None,
        out: Any = None,
    ):
        name = type(self).__name__
        check_known_keys(name, config, ("gemm", "tensor", "quant_format"))
        if "quant_format" not in config:
            raise ValueError(
                f"{name}: layer {layer_name!r}, gemm {gemm}, tensor {tensor_name}: missing required "
                f"parameter 'quant_format' (one of {list(QUANT_FORMATS)})"
            )
        if isinstance(tensor, QuantizedTensor) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{name}: layer {layer_name!r}, tensor {tensor_name}: expected a high-precision "
                f"torch.Tensor, got {type(tensor).__name__}"
            )
        try:
            result = fake_quantize(tensor, config["quant_format"])
        except UnsupportedShapeError as err:  # a debug feature does not stop training: this operand stays as it is
            log_once(
                f"Feature={name}: skipping {gemm}, {tensor_name} of shape {tuple(tensor.shape)}: {err}; the operand "
                f"is left in high precision",
                layer_name,
                logging.WARNING,
            )
            result = tensor
        if dtype is not None:
            result = result.to(dtype)
        log_once(f"Feature={name}, API=process_tensor: {gemm}, {tensor_name}", layer_name)
        if out is not None:
            out.copy_(result)
            return None
        return result
