"""A section-level (namespace `base`) LogTensorStats, like nvdlfw's generic one, reduced to min and max."""

from tedebug.registry import FeatureMapper, api_method, register_feature


@register_feature(namespace="base")
class LogTensorStats(FeatureMapper):
    """Section-level statistics: returns {stat: 0-d tensor} for the configured `stats` (min, max)."""

    @api_method
    def log_tensor_stats(self, config, layer_name, tensor, tensor_name, iteration, **kwargs):
        ops = {"min": lambda t: t.min(), "max": lambda t: t.max()}
        return {stat: ops[stat](tensor) for stat in config["stats"]}
