"""Inspect-like test features: tuple and bare-bool answers, a legacy inspect_tensor signature, deprecated hooks."""

from tedebug.registry import FeatureMapper, api_method, register_feature


@register_feature(namespace="transformer_engine")
class TupleInspect(FeatureMapper):
    """Enabled every `freq` iterations; answers (enabled, next multiple of freq)."""

    def __init__(self):
        self.received = []

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        freq = config["freq"]
        return iteration % freq == 0, (iteration // freq + 1) * freq

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, **kwargs):
        self.received.append((layer_name, tensor_name, iteration, sorted(kwargs)))


@register_feature(namespace="transformer_engine")
class BoolInspect(FeatureMapper):
    """Answers with the deprecated bare bool `answer`."""

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return config["answer"]


@register_feature(namespace="transformer_engine")
class LegacyInspect(FeatureMapper):
    """An old-style inspect_tensor that does not know quantizer / *_quantized_tensor / tp_size."""

    def __init__(self):
        self.received = []

    @api_method
    def inspect_tensor(self, config, layer_name, tensor, tensor_name, iteration, tp_group):
        self.received.append((tensor_name, iteration, tp_group))


@register_feature(namespace="transformer_engine")
class PostquantizeInspect(FeatureMapper):
    """Implements the deprecated post-quantize hooks (without tp_size)."""

    def __init__(self):
        self.received = []

    @api_method
    def inspect_tensor_postquantize_enabled(self, config, layer_name, tensor_name, gemm, iteration):
        return True, iteration + 1

    @api_method
    def inspect_tensor_postquantize(self, config, layer_name, tensor, tensor_name, iteration, tp_group, rowwise):
        self.received.append((tensor_name, rowwise))
