"""When tedebug may compute a CPU result with numpy: a CPU tensor, outside torch.compile's tracing.

Some CPU paths take numpy where it gives the torch path's bits with fewer calls (FP8 current scaling and FP8
decoding, the statistics of small tensors, the Philox bytes of NVFP4 stochastic rounding).  torch.compile's tracer
(Dynamo) cannot follow numpy calls on a tensor's buffer (``Tensor.numpy()``), so while it traces, the torch path
runs instead: the same values, traced like any torch code.
"""

from __future__ import annotations

import torch

_compiler = getattr(torch, "compiler", None)
_is_compiling = getattr(_compiler, "is_compiling", None)
if _is_compiling is None:  # (torch before torch.compiler.is_compiling)
    try:
        from torch._dynamo import is_compiling as _is_compiling  # type: ignore[no-redef]
    except ImportError:  # pragma: no cover - no tracer at all

        def _is_compiling() -> bool:
            return False


def compiling() -> bool:
    """Whether torch.compile is tracing the code that calls this (True inside the traced region)."""
    return bool(_is_compiling())


def numpy_on(device: torch.device) -> bool:
    """Whether a tensor on `device` may take a numpy host path here: a CPU device, not while torch.compile traces."""
    return device.type == "cpu" and not _is_compiling()
