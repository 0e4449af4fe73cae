"""Inputs and comparisons shared by the GPU kernel tests (tests/backends/test_gpu_*.py): special values that hit
every rounding and saturation edge of the FP8 formats, and a tensor quantized through both backends."""

from __future__ import annotations

import torch

from tedebug.backends import dispatch


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """NaN, infinities, signed zeros, subnormals, the E4M3 / E5M2 maxima and their rounding neighbours, the dtype's
    extremes, in `dtype` (on the CPU)."""
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    vals = [
        float("nan"),
        float("inf"),
        -float("inf"),
        0.0,
        -0.0,
        tiny / 4,
        -tiny / 2,
        tiny,
        448.0,
        449.0,
        464.0,
        465.0,
        500.0,
        -1000.0,
        57344.0,
        61440.0,
        2.0**-10,
        1.5 * 2**-10,
        big,
        -big,
        1e-3,
        3.5,
    ]
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


def backend_pair(make_quantizer, x: torch.Tensor):
    """(the kernels' quantization of `x`, the torch path's), each by a fresh quantizer from `make_quantizer()`."""
    with dispatch.use_backend("cupy"):
        got = make_quantizer().quantize(x)
    with dispatch.use_backend("torch"):
        ref = make_quantizer().quantize(x)
    return got, ref
