"""`DisableQuantizationGEMM`: run the listed GEMMs in high precision.

Config: ``gemms: [fprop, dgrad, wgrad]`` or ``gemms_struct`` entries with only ``gemm``.  For a listed GEMM,
``fp8_gemm_enabled`` answers ``(False, iteration + 1)``: both operands of that GEMM use high precision (unless a
feature modifies them) and the layer stays in debug mode every iteration.
"""

from __future__ import annotations

from tedebug.features.base import ValidatedFeature
from tedebug.features.config_checks import check_known_keys
from tedebug.registry import api_method, register_feature


@register_feature(namespace="transformer_engine")
class DisableQuantizationGEMM(ValidatedFeature):
    """Disable quantized GEMMs for the listed GEMMs (``gemms`` / ``gemms_struct``)."""

    USES_GEMMS = True
    USES_TENSORS = False

    @api_method
    def fp8_gemm_enabled(self, config: dict, layer_name: str, gemm: str, iteration: int):
        check_known_keys(type(self).__name__, config, ("gemm",))
        return False, iteration + 1
