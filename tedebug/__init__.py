"""tedebug: YAML-driven precision debugging for low-precision (FP8 / MXFP8 / NVFP4) training in PyTorch.

Public surface (imported on first access, so ``import tedebug`` stays cheap): `debug_api`, `autocast`,
`convert_model`, `nn`, `recipe`, `quantization`, `load_stats` (needs pandas: the ``report`` extra).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Imported eagerly (it needs nothing but the standard library): the submodule `tedebug.autocast` and the context
# manager share a name, and the package attribute must be the context manager.
from tedebug.autocast import autocast  # noqa: E402

_MODULES = ("debug_api", "nn", "recipe", "quantization")
_ATTRIBUTES = {"convert_model": "tedebug.nn.convert", "load_stats": "tedebug.analysis.load"}

__all__ = ["__version__", "autocast", *_MODULES, *_ATTRIBUTES]


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(f"tedebug.{name}")
    elif name in _ATTRIBUTES:
        value = getattr(importlib.import_module(_ATTRIBUTES[name]), name)
    else:
        raise AttributeError(f"module 'tedebug' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
