"""A TE-style custom feature written against nvdlfw-inspect and TransformerEngine (no tedebug import): logs the
percentage of elements above `threshold` as <layer>_<tensor>_percentage_above every `freq` iterations."""

import nvdlfw_inspect.api as debug_api
import torch
from nvdlfw_inspect.logging import MetricLogger
from nvdlfw_inspect.registry import Registry, api_method
from transformer_engine.debug.features.api import TEConfigAPIMapper


@Registry.register_feature(namespace="transformer_engine")
class PercentageAbove(TEConfigAPIMapper):
    """Logs the percentage of elements greater than `threshold`."""

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        freq = config.get("freq", 1)
        return iteration % freq == 0, (iteration // freq + 1) * freq

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, tensor, iteration, tp_group=None, **kwargs):
        share = (tensor > config["threshold"]).float().mean() * 100
        MetricLogger.log_scalar(f"{layer_name}_{tensor_name}_percentage_above", share, iteration)
        debug_api.log_message(f"percentage_above of {tensor_name} logged", layer_name)
