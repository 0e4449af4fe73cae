"""tedebug.nn: layers whose GEMMs run in low precision inside `tedebug.autocast`, the GEMM entry point, and
`convert_model` (swap `torch.nn.Linear` layers of any model, and transformers' Conv1D and MoE experts).  Submodules are
imported on first attribute access."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Linear": "tedebug.nn.linear",
    "LayerNormLinear": "tedebug.nn.layernorm_linear",
    "LayerNormMLP": "tedebug.nn.layernorm_mlp",
    "GroupedLinear": "tedebug.nn.grouped_linear",
    "Conv1DLinear": "tedebug.nn.hf",
    "convert_model": "tedebug.nn.convert",
    "prefix_layer_names": "tedebug.nn.convert",
    "init_recipe_state": "tedebug.nn.state",
    "gemm": "tedebug.nn.gemm",
    "gemm_operand": "tedebug.nn.gemm",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tedebug.nn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
