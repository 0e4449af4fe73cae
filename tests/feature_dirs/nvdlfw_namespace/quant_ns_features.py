"""Features of the custom namespace `quant_ns` (nvdlfw-inspect style; the mapper comes from the sibling file)."""

import torch
from nvdlfw_inspect.registry import Registry, api_method
from quant_ns_api import QuantNsConfigMapper


@Registry.register_feature(namespace="quant_ns")
class PerTensorFakeQuant(QuantNsConfigMapper):
    """torch.fake_quantize_per_tensor_affine with the config's scale, zero_point, quant_min, quant_max."""

    @api_method
    def process_tensor(self, config, layer_name, tensor, **kwargs):
        missing = [k for k in ("scale", "zero_point", "quant_min", "quant_max") if k not in config]
        if missing:
            raise ValueError(f"PerTensorFakeQuant needs {missing}")
        return {"tensor": torch.fake_quantize_per_tensor_affine(tensor, config["scale"], config["zero_point"],
                                                                config["quant_min"], config["quant_max"])}


@Registry.register_feature(namespace="quant_ns")
class Negate(QuantNsConfigMapper):
    """Returns the negated tensor."""

    @api_method
    def process_tensor(self, config, layer_name, tensor, **kwargs):
        return {"tensor": -tensor}


@Registry.register_feature(namespace="quant_ns")
class BadOutput(QuantNsConfigMapper):
    """Returns a dict without 'tensor' (the namespace's output check rejects it)."""

    @api_method
    def process_tensor(self, config, layer_name, tensor, **kwargs):
        return {"wrong": tensor}
