"""API of the custom namespace `quant_ns`, written against nvdlfw-inspect only (no tedebug import).

APIs: `process_tensor(layer, tensor=, gemm=, tensor_name=)` -> {"tensor": t}; the default keeps the tensor.
Routing: GEMM and tensor parsing by the mapper below; cache key (gemm, tensor_name); one feature per call.
"""

import copy

from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry

CALLS = {"routing_condition": 0, "step": 0, "end_debug": 0}


class QuantNsConfigMapper(BaseConfigAPIMapper):
    def parse_config_and_api(self, config, **kwargs):
        cfg = copy.deepcopy(config)
        gemms = cfg.pop("gemms", None)
        if gemms is None:
            raise ValueError("quant_ns features need 'gemms'")
        if kwargs["gemm"] not in gemms:
            return False, None
        cfg = self._process_tensor_config(cfg, kwargs["tensor_name"])
        if cfg is None:
            return False, None
        cfg.pop("enabled", None)
        cfg["gemm"] = kwargs["gemm"]
        return True, cfg


class QuantNsDefaults:
    def process_tensor(self, config, layer_name, **kwargs):
        return {"tensor": kwargs["tensor"]}


@Registry.register_namespace_api(namespace="quant_ns")
class QuantNsAPI(BaseNamespaceAPI):
    def __init__(self):
        BaseNamespaceAPI.__init__(self)
        self._default_api_impl = QuantNsDefaults()
        self._cacheable_api_kwargs_map = {"process_tensor": ["tensor_name", "gemm"]}

    def input_assertions_hook(self, api_name, **kwargs):
        for name in ("tensor", "gemm", "tensor_name"):
            assert name in kwargs, f"{api_name} needs {name}"

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        CALLS["routing_condition"] += 1
        return feature_obj.parse_config_and_api(config, gemm=kwargs["gemm"], tensor_name=kwargs["tensor_name"])

    def output_assertions_hook(self, api_name, ret, **kwargs):
        assert "tensor" in ret, f"{api_name} must return a dict with 'tensor'"

    def is_multiple_feature_invocation_allowed(self, api_name):
        return False

    def step(self):
        CALLS["step"] += 1

    def end_debug(self):
        CALLS["end_debug"] += 1
