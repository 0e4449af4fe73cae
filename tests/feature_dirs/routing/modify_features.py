"""Modify-like test features: ScaleModify multiplies by `factor`; OffsetModify adds `offset`."""

from tedebug.registry import FeatureMapper, api_method, register_feature


class _Modify(FeatureMapper):
    def __init__(self):
        self.seen = []  # (layer, gemm, tensor_name, parsed config) per modify_tensor call

    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return True, iteration + 1

    @api_method
    def modify_tensor(self, config, layer_name, gemm, tensor_name, tensor, iteration, default_quantizer=None,
                      out=None, dtype=None):
        self.seen.append((layer_name, gemm, tensor_name, dict(config)))
        result = self.apply(config, tensor)
        if dtype is not None:
            result = result.to(dtype)
        if out is not None:
            out.copy_(result)
            return None
        return result


@register_feature(namespace="transformer_engine")
class ScaleModify(_Modify):
    """Multiplies the tensor by `factor`."""

    def apply(self, config, tensor):
        return tensor * config["factor"]


@register_feature(namespace="transformer_engine")
class OffsetModify(_Modify):
    """Adds `offset` to the tensor."""

    def apply(self, config, tensor):
        return tensor + config["offset"]


@register_feature(namespace="transformer_engine")
class WrongOutput(FeatureMapper):
    """Breaks the output contract on purpose: modify_tensor returns a str, inspect_tensor returns 1, and
    inspect_tensor_enabled returns an int."""

    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return 1

    @api_method
    def modify_tensor(self, config, layer_name, gemm, tensor_name, tensor, iteration, **kwargs):
        return "not a tensor"

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, **kwargs):
        return 1
