"""TestDummyFeature: TE's test-only feature. Counts its calls; keeps layers in debug mode unless told otherwise."""

from tedebug.registry import FeatureMapper, api_method, register_feature


@register_feature(namespace="transformer_engine")
class TestDummyFeature(FeatureMapper):
    """Test feature: inspect_tensor_enabled returns the bare bool True (or (False, None) with inspect_only_once)."""

    def __init__(self):
        self.enabled_calls = 0
        self.inspect_calls = 0

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        self.enabled_calls += 1
        if config.get("inspect_only_once", False):
            return False, None
        return True

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, **kwargs):
        self.inspect_calls += 1
