"""`DisableQuantizationLayer`: run every GEMM of the selected layers in high precision.

The feature applies to whole layers: it needs no ``gemms`` / ``tensors`` and receives the raw feature config.
Only ``enabled`` is a valid key (``gemm`` is tolerated, as in TransformerEngine).  ``fp8_gemm_enabled`` answers
``(False, iteration + 1)`` for every GEMM and logs "Quantization Disabled" once per layer.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from tedebug.features.base import ValidatedFeature, log_once
from tedebug.features.config_checks import FeatureConfigError, check_known_keys
from tedebug.registry import api_method, register_feature

ALLOWED_KEYS = ("enabled", "gemm")


@register_feature(namespace="transformer_engine")
class DisableQuantizationLayer(ValidatedFeature):
    """Disable quantized GEMMs for the whole layer."""

    USES_GEMMS = False
    USES_TENSORS = False

    @classmethod
    def validate_feature_config(cls, cfg: dict) -> None:
        if not isinstance(cfg, dict):
            raise FeatureConfigError(f"{cls.__name__}: the feature config must be a mapping, got {type(cfg).__name__}")
        check_known_keys(cls.__name__, cfg, ALLOWED_KEYS)

    def parse_config_and_api(
        self,
        config: dict,
        *,
        gemm_parsing: bool = False,
        tensor_parsing: bool = False,
        gemm: Optional[str] = None,
        tensor_name: Optional[str] = None,
        **kwargs: Any,
    ) -> Tuple[bool, Optional[dict]]:
        """Applies to every call of an enabled block; the config is passed through unparsed."""
        return bool(config.get("enabled")), config

    @api_method
    def fp8_gemm_enabled(self, config: dict, layer_name: str, gemm: str, iteration: int):
        check_known_keys(type(self).__name__, config, ALLOWED_KEYS)
        log_once("Quantization Disabled", layer_name)
        return False, iteration + 1
