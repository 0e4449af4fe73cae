"""Inputs and comparisons shared by the kernel and host-path tests (tests/backends/test_gpu_*.py, the CPU host cast
tests): special values that hit every rounding and saturation edge of the FP8 formats, adversarial tensors for a
per-tensor FP8 cast, and a tensor quantized through both backends."""

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


def normal_and_special(shape, dtype: torch.dtype, generator: torch.Generator):
    """(a normal tensor of `shape` scaled by 3, the same with up to 40 `special_values` spread in at random
    places), in `dtype` on the CPU."""
    normal = (torch.randn(shape, generator=generator) * 3).to(dtype)
    special = normal.clone().reshape(-1)
    values = special_values(dtype)
    where = torch.randint(0, special.numel(), (min(special.numel(), 40),), generator=generator)
    special[where] = values[torch.randint(0, values.numel(), where.shape, generator=generator)]
    return normal, special.reshape(shape)


def sprinkled(numel: int, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    """A 1-D normal tensor of `numel` elements scaled by 3 with up to 30 `special_values` at random places, in
    `dtype` on `device` (the statistics launches' inputs)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(numel, generator=g) * 3).to(dtype)
    values = special_values(dtype)
    where = torch.randint(0, numel, (min(numel, 30),), generator=g)
    x[where] = values[torch.randint(0, values.numel(), where.shape, generator=g)]
    return x.to(device)


def cast_inputs(shape, dtype: torch.dtype, seed: int, device) -> list:
    """Four tensors of `shape` on `device` for comparing two paths of one cast: a normal tensor, one with
    `special_values` spread in (NaN, infinities, signed zeros, subnormals, FP8 maxima), one of zeros only (amax 0)
    and one of NaN only."""
    normal, special = normal_and_special(shape, dtype, torch.Generator().manual_seed(seed))
    zeros = torch.zeros(shape, dtype=dtype)
    nan = torch.full(shape, float("nan"), dtype=dtype)
    return [t.reshape(shape).to(device) for t in (normal, special, zeros, nan)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (on the CPU, flattened): what a bit-for-bit comparison compares."""
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def backend_pair(make_quantizer, x: torch.Tensor):
    """(the kernels' quantization of `x`, the torch path's), each by a fresh quantizer from `make_quantizer()`."""
    with dispatch.use_backend("cupy"):
        got = make_quantizer().quantize(x)
    with dispatch.use_backend("torch"):
        ref = make_quantizer().quantize(x)
    return got, ref


def fp8_cast_inputs():
    """CPU tensors for a per-tensor FP8 cast: zeros of both signs, fp32 subnormals, values at and beyond the FP8
    maxima, NaN, infinities, odd and N-D shapes, a dynamic range over 40 decades (a float64 sum of their squared
    errors depends on its order)."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(1416)
    yield torch.randn(8, 32, generator=g)
    yield torch.randn(3, 5, 7, generator=g).to(torch.bfloat16)  # N-D, odd sizes
    yield torch.randn(16, 16, generator=g).to(torch.float16)
    yield torch.randn(1, 9, generator=g)  # one row
    yield torch.randn(9, 1, generator=g)  # one column
    yield torch.randn(11, generator=g)  # 1-D
    # magnitudes over 40 decades: the float64 sum of the squared errors depends on the order of its additions
    yield torch.randn(33, 31, generator=g) * torch.exp(torch.empty(33, 31).uniform_(-46.0, 46.0, generator=g))
    yield torch.randn(4, 16, generator=g) * 1e-30  # products far below the smallest FP8 subnormal: all underflow
    yield torch.randn(4, 16, generator=g) * 3e38  # amax near FLT_MAX, some elements infinite
    yield torch.tensor([[0.0, -0.0, 1.0, -1.0]])
    yield torch.zeros(2, 8)
    yield torch.tensor([[-0.0, -0.0]])
    yield torch.tensor([[448.0, -448.0, 464.0, 57344.0, -61440.0, 0.25]])  # at and beyond the E4M3 / E5M2 maxima
    yield torch.tensor([[nan, 2.0, -3.0, nan]])
    yield torch.tensor([[nan, -nan]])
    yield torch.tensor([[inf, 2.0, -3.0, 0.5]])
    yield torch.tensor([[-inf, nan, 1e-3, 7.0]])
    yield torch.tensor([[1e-45, -1e-45, 0.0, 1e-39]])  # fp32 subnormals
    x = torch.randn(5, 7, generator=g)
    x[1, 2] = nan
    x[3, 4] = 0.0
    yield x


def reference_fp8_partials(x: torch.Tensor, q, usage: str) -> dict:
    """The partials of a per-tensor FP8 quantization's statistics vector (`fused_stats.FP8_STATS_WITH_SCALE` names)
    as the torch reference computes them from `x` and its quantization `q`: the oracle of the vectors."""
    from tedebug.backends import torch_ref

    return {
        **torch_ref.underflow_partials(x, q, usage),
        **torch_ref.mse_partials(x, q, usage),
        **torch_ref.overflow_partials(x, q, usage),
        **torch_ref.scale_inv_partials(q, usage),
        "numel": torch.tensor(float(x.numel()), dtype=torch.float64),
    }


def with_reference_vector(x: torch.Tensor, table=None):
    """`x` quantized with FP8 current scaling, carrying a rowwise statistics vector laid out as `table` (default
    `FP8_STATS_WITH_SCALE`) whose values are `reference_fp8_partials` (what a quantize kernel's vector holds)."""
    from tedebug.backends.fused_stats import FP8_STATS_WITH_SCALE, FusedStats, attach_fused
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    table = FP8_STATS_WITH_SCALE if table is None else table
    q = Float8CurrentScalingQuantizer("E4M3").quantize(x)
    partials = reference_fp8_partials(x, q, "rowwise")
    vector = torch.empty(len(table), dtype=torch.float64)
    for name, index in table.items():
        vector[index] = partials[name]
    attach_fused(q, x, {"rowwise": FusedStats(vector, table)})
    return q


def lone_row(x: torch.Tensor) -> torch.Tensor:
    """The basic statistics row of a lone statistics launch on the CUDA tensor `x` (``ted_stats`` through
    `cupy_stats.basic_stats_into`): what a kernel that runs the statistics pass inside another launch must write."""
    from tedebug.backends import cupy_stats  # (the kernel backend loads only where a GPU test runs)

    row = torch.empty(cupy_stats.BASIC_ROW_LEN, dtype=torch.float64, device=x.device)
    cupy_stats.basic_stats_into(x, row.data_ptr())
    return row
