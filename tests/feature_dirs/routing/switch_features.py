"""Disable-GEMM-like test features: GemmSwitch (per listed GEMM) and LayerSwitch (whole layer, no parsing)."""

from tedebug.registry import FeatureMapper, api_method, register_feature


@register_feature(namespace="transformer_engine")
class GemmSwitch(FeatureMapper):
    """Turns the quantized GEMM off for the listed gemms (like DisableQuantizationGEMM)."""

    def __init__(self):
        self.parse_calls = 0
        self.calls = 0

    def parse_config_and_api(self, config, **kwargs):
        self.parse_calls += 1
        return super().parse_config_and_api(config, **kwargs)

    @api_method
    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        self.calls += 1
        return False, iteration + 1


@register_feature(namespace="transformer_engine")
class LayerSwitch(FeatureMapper):
    """Turns the quantized GEMMs of the whole layer off (like DisableQuantizationLayer): no gemm parsing."""

    def parse_config_and_api(self, config, **kwargs):
        return True, config

    @api_method
    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        return False, iteration + 1
