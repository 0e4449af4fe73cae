"""Compute backends of the statistics partials.

`torch_ref` is the reference implementation (plain torch, any device).  GPU kernels (CuPy) will provide the same
family functions with the same signatures; `backend_for(tensor)` picks the implementation for a tensor.
"""

from __future__ import annotations

from types import ModuleType

from tedebug.backends import torch_ref


def backend_for(tensor) -> ModuleType:
    """The module whose family functions compute partials for `tensor` (today: always `torch_ref`)."""
    return torch_ref


__all__ = ["backend_for", "torch_ref"]
