"""tedebug.quantization: the quantization core (formats, quantizers, quantized tensors).

Public surface: the `Quantizer` / `QuantizedTensor` bases, `UnsupportedShapeError` (a shape a block-scaled format
cannot quantize), one quantizer/tensor pair per format (per-tensor FP8, MXFP8, NVFP4, FP8 blockwise, identity,
hybrid), and `split_quantize` for grouped layers.  Codecs live in `tedebug.quantization.formats`.

The format modules are imported on first access of one of their names (PEP 562 module `__getattr__`), so importing
one submodule (e.g. `tedebug.quantization.formats`) never imports the others.
"""

from __future__ import annotations

import importlib
from typing import Any, List

from .tensor import QuantizedTensor, Quantizer, UnsupportedShapeError

#: public name -> submodule that defines it
_LAZY = {
    "Float8Quantizer": "float8",
    "Float8CurrentScalingQuantizer": "float8",
    "Float8Tensor": "float8",
    "MXFP8Quantizer": "mxfp8",
    "MXFP8Tensor": "mxfp8",
    "NVFP4Quantizer": "nvfp4",
    "NVFP4Tensor": "nvfp4",
    "Float8BlockQuantizer": "float8_block",
    "Float8BlockwiseTensor": "float8_block",
    "IdentityQuantizer": "identity",
    "IdentityTensor": "identity",
    "HybridQuantizer": "hybrid",
    "HybridQuantizedTensor": "hybrid",
    "split_quantize": "hybrid",
}

__all__ = ["Quantizer", "QuantizedTensor", "UnsupportedShapeError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
