"""Compute backends of the statistics partials.

`torch_ref` is the reference implementation (plain torch, any device); `cupy_stats` provides the same family
functions with the same signatures on the GPU kernels (CuPy); `backend_for(tensor)` picks the implementation for a
tensor.  Nothing here imports `tedebug.quantization`: the quantizers call `dispatch` and wrap the raw buffers the
kernels return.
"""

from __future__ import annotations

from tedebug.backends import torch_ref
from tedebug.backends import dispatch  # GPU dispatch hook (gpu helper)


#: the module whose family functions compute partials for a tensor (`tedebug.backends.dispatch.stats_backend`:
#: ``backend_for(tensor, kernel=None)`` decides under `kernel` or the default; a None tensor, for scale-only
#: statistics of a weight kept only in quantized form, gets the torch reference).  The same function, not a wrapper:
#: every logged tensor asks.
backend_for = dispatch.stats_backend


__all__ = ["backend_for", "dispatch", "torch_ref"]
