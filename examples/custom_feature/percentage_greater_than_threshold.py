"""PercentageGreaterThanThreshold: a custom feature logging the share of elements above a threshold.

The example of TransformerEngine's precision-debug tutorial, written for tedebug. It logs
``<layer>_<tensor>_percentage_greater_than_threshold`` (in percent) every `freq` iterations.
"""

import torch

import tedebug.debug_api as debug_api
from tedebug.registry import FeatureMapper, api_method, register_feature

STAT = "percentage_greater_than_threshold"


@register_feature(namespace="transformer_engine")
class PercentageGreaterThanThreshold(FeatureMapper):
    """Logs the percentage of elements of the selected tensors that are greater than `threshold`.

    Config keys: `tensors` / `tensors_struct`, `threshold` (number, required), `freq` (default 1).
    """

    @classmethod
    def validate_feature_config(cls, cfg):
        unknown = set(cfg) - {"enabled", "tensors", "tensors_struct", "threshold", "freq"}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)}; expected threshold, freq, tensors/tensors_struct")
        threshold = cfg.get("threshold")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(f"threshold must be a number, got {threshold!r}")

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        freq = config.get("freq", 1)
        return iteration % freq == 0, (iteration // freq + 1) * freq

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, tensor, iteration, **kwargs):
        if tensor is None:  # weights kept only in a quantized form: nothing to look at
            return
        above = torch.count_nonzero(tensor.detach() > config["threshold"]).item()
        percentage = 100.0 * above / tensor.numel()
        debug_api.session().metric_logger.log_scalar(
            f"{layer_name}_{tensor_name}_{STAT}", percentage, iteration, layer=layer_name, tensor=tensor_name, stat=STAT
        )
