"""Compute backends of the statistics partials.

`torch_ref` is the reference implementation (plain torch, any device); `cupy_stats` provides the same family
functions with the same signatures on the GPU kernels (CuPy); `backend_for(tensor)` picks the implementation for a
tensor.  Nothing here imports `tedebug.quantization`: the quantizers call `dispatch` and wrap the raw buffers the
kernels return.
"""

from __future__ import annotations

from types import ModuleType

from tedebug.backends import torch_ref
from tedebug.backends import dispatch  # GPU dispatch hook (gpu helper)


def backend_for(tensor, kernel: dispatch.KernelChoice = None) -> ModuleType:
    """The module whose family functions compute partials for `tensor` (`tedebug.backends.dispatch` decides, under
    `kernel` or the default).

    `tensor` is None for scale-only statistics of a weight kept only in quantized form: torch handles those.
    """
    if tensor is None:
        return torch_ref
    return dispatch.stats_backend(tensor, kernel)


__all__ = ["backend_for", "dispatch", "torch_ref"]
