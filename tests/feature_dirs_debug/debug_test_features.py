"""Test-only features for the debug-path tests: every call is recorded in `CALLS` (hook name, layer, kwargs).

- `DebugInspect`: inspect_tensor_enabled / inspect_tensor, scheduled by the usual keys (freq, start_step, end_step,
  start_end_list); ``bare_bool: True`` answers with the deprecated bare bool instead of (bool, next).
- `DebugModify`: modify_tensor_enabled -> (True, iteration + 1); modify_tensor returns ``tensor * factor``
  (default 2.0), cast to ``dtype`` when given; with ``out`` it fills ``out`` and returns None.  ``wrong_dtype: True``
  returns float64 regardless of ``dtype`` (to test the dtype check); ``return_quantized: True`` returns
  ``default_quantizer.quantize(tensor)`` unchanged.
- `DebugDisableGemm`: fp8_gemm_enabled -> (False, iteration + 1) for the listed GEMMs.
- `DebugPostquantize`: the deprecated inspect_tensor_postquantize(_enabled) pair, always enabled.

The test reads `CALLS` from the module the registry loaded (``sys.modules[registry.user_module_name(path)]``); each
`debug_api.initialize()` loads the file afresh, so the list starts empty in every session.
"""

from tedebug.config.schedule import Schedule
from tedebug.registry import FeatureMapper, api_method, register_feature

CALLS = []


def _record(hook, layer_name, **kwargs):
    CALLS.append((hook, layer_name, kwargs))


@register_feature(namespace="transformer_engine")
class DebugInspect(FeatureMapper):
    """Counts inspect calls; scheduled by freq / start_step / end_step / start_end_list."""

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        _record("inspect_tensor_enabled", layer_name, tensor_name=tensor_name, iteration=iteration)
        active, nxt = Schedule.from_config(config).query(iteration)
        if config.get("bare_bool", False):
            return active
        return active, nxt

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, tensor, iteration, tp_group, tp_size,
                       rowwise_quantized_tensor, columnwise_quantized_tensor, quantizer):
        _record("inspect_tensor", layer_name, tensor_name=tensor_name, tensor=tensor, iteration=iteration,
                tp_group=tp_group, tp_size=tp_size, rowwise_quantized_tensor=rowwise_quantized_tensor,
                columnwise_quantized_tensor=columnwise_quantized_tensor, quantizer=quantizer)


@register_feature(namespace="transformer_engine")
class DebugModify(FeatureMapper):
    """Replaces the routed operands by ``tensor * factor``."""

    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        _record("modify_tensor_enabled", layer_name, gemm=gemm, tensor_name=tensor_name, iteration=iteration)
        return True, iteration + 1

    @api_method
    def modify_tensor(self, config, layer_name, gemm, tensor_name, tensor, default_quantizer, iteration,
                      dtype=None, out=None):
        _record("modify_tensor", layer_name, gemm=gemm, tensor_name=tensor_name, tensor=tensor,
                default_quantizer=default_quantizer, iteration=iteration, dtype=dtype, out=out)
        if config.get("return_quantized", False):
            return default_quantizer.quantize(tensor)
        result = tensor * float(config.get("factor", 2.0))
        if config.get("wrong_dtype", False):
            return result.double()
        if dtype is not None:
            result = result.to(dtype)
        if out is not None:
            out.copy_(result)
            return None
        return result


@register_feature(namespace="transformer_engine")
class DebugDisableGemm(FeatureMapper):
    """Quantized GEMM off for the listed GEMMs, re-asked every iteration."""

    @api_method
    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        _record("fp8_gemm_enabled", layer_name, gemm=gemm, iteration=iteration)
        return False, iteration + 1


@register_feature(namespace="transformer_engine")
class DebugPostquantize(FeatureMapper):
    """The deprecated post-quantization inspection pair."""

    @api_method
    def inspect_tensor_postquantize_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        _record("inspect_tensor_postquantize_enabled", layer_name, gemm=gemm, tensor_name=tensor_name,
                iteration=iteration)
        return True, iteration + 1

    @api_method
    def inspect_tensor_postquantize(self, config, layer_name, tensor, tensor_name, iteration, tp_group, tp_size,
                                    rowwise):
        _record("inspect_tensor_postquantize", layer_name, tensor=tensor, tensor_name=tensor_name,
                iteration=iteration, tp_group=tp_group, tp_size=tp_size, rowwise=rowwise)
