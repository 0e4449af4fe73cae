"""A feature in a sub-directory that imports a sibling module by its bare name (loader puts the dir on sys.path)."""

from factor_constants import NESTED_FACTOR

from tedebug.registry import FeatureMapper, api_method, register_feature


@register_feature(namespace="transformer_engine")
class NestedFeature(FeatureMapper):
    """Answers (True, iteration + NESTED_FACTOR) for the listed tensors."""

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return True, iteration + NESTED_FACTOR
