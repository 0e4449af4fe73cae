"""The CPU host fast paths of issue 14 compute exactly what the paths they replace compute, and keep their promise
of fewer torch calls, pinned by counting calls (never by timing):

- `torch_ref.basic_partial_values` of a tensor of at most `HOST_PASS_MAX_NUMEL` elements runs numpy for what does
  not depend on an order and two torch sums for what does; its values are `basic_partials`' bit for bit, also with
  two torch threads on both sides of the threshold, for every float dtype, signed zeros, NaN and infinities;
- a logged CPU tensor's row is built from those values without a torch call per partial.
"""

from __future__ import annotations

import math

import pytest
import torch

from tedebug.backends import torch_ref

from support.concurrency import AtenCounter, run_in_two_threads
from support.kernel_inputs import fp8_cast_inputs


def _bits(values):
    """Values as comparable keys: NaN as one marker, the sign of a zero kept."""
    return [("nan",) if math.isnan(v) else (v, math.copysign(1.0, v)) for v in values]


def _reference(x):
    partials = torch_ref.basic_partials(x)
    return [partials[key].item() for key in torch_ref.BASIC_KEYS]


#: operators that compute nothing (views, wrapping a numpy array, the read of a 0-d value)
_NOT_COMPUTING = {"view", "detach", "alias", "lift_fresh", "_local_scalar_dense"}


def _computing(ops):
    """The names of the operators in `ops` that compute something, sorted."""
    return sorted(name for name in ops if name not in _NOT_COMPUTING)


def _tensors():
    g = torch.Generator().manual_seed(1414)
    limit = torch_ref.HOST_PASS_MAX_NUMEL
    # relu-like tensors (minimum exactly +0 or -0), all-negative tensors with a zero maximum, mixed signed zeros
    yield torch.relu(torch.randn(300, generator=g))
    yield -torch.relu(torch.randn(300, generator=g))
    yield torch.where(torch.randn(64, generator=g) > 0, 0.0, -0.0)
    yield torch.tensor([-0.0, 3.0, 0.0])
    yield torch.tensor([float("nan"), 0.0, -2.0, float("inf")], dtype=torch.bfloat16)
    yield torch.tensor([float("-inf")] * 5, dtype=torch.float16)
    yield torch.tensor([3e38, 3e38, -1.0])  # float32 values whose squares overflow float32 but not float64
    for n in (1, 2, 5, 31, 33, 255, 257, 1000, 12289, limit - 1, limit, limit + 1, 40000):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            scale = 10.0 ** ((n % 7) - 3)
            x = (torch.randn(n, generator=g) * scale).to(dtype)
            x[torch.rand(n, generator=g) < 0.1] = 0.0
            yield x


@pytest.mark.parametrize("x", list(_tensors()), ids=lambda x: f"{str(x.dtype)[6:]}-{x.numel()}")
def test_host_values_equal_the_reference_with_two_threads(x):
    """With two torch threads (a parallel sum splits a tensor above torch's grain size), on both sides of the
    threshold: every value is the reference's, the sign of a zero included."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _bits(torch_ref.basic_partial_values(x)) == _bits(_reference(x))
        assert _bits(torch_ref.basic_partial_values(x.reshape(-1, 1))) == _bits(_reference(x))
    finally:
        torch.set_num_threads(threads)


def test_small_tensor_costs_two_torch_sums():
    """A float32 tensor without a zero extreme: the only torch operators are the two sums (the reference runs a
    dozen operators and reads each value back)."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(3)) + 10.0
    torch_ref.basic_partial_values(x)  # the workspace of this size exists from here on
    with AtenCounter() as small:
        torch_ref.basic_partial_values(x)
    assert _computing(small.ops) == ["sum", "sum"], small.ops
    with AtenCounter() as reference:
        _reference(x)
    assert len(_computing(reference.ops)) > 10


def test_zero_extremes_are_taken_again_in_the_input_dtype():
    """A minimum (or maximum) that is a zero is read again by torch (amin / amax), whose choice of the zero's sign
    the reference fixes; other extremes are not."""
    relu = torch.relu(torch.randn(64, generator=torch.Generator().manual_seed(4)))
    relu[3] = 0.0
    with AtenCounter() as counter:
        values = torch_ref.basic_partial_values(relu)
    assert _computing(counter.ops) == ["amin", "sum", "sum"]
    assert _bits(values) == _bits(_reference(relu))


def test_large_tensor_takes_the_torch_path():
    """Above the threshold the torch calls run as before (no numpy workspace of that size is made)."""
    n = torch_ref.HOST_PASS_MAX_NUMEL + 1
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    with AtenCounter() as counter:
        values = torch_ref.basic_partial_values(x)
    assert len(_computing(counter.ops)) > 10
    assert _bits(values) == _bits(_reference(x))


def test_threads_do_not_share_a_workspace():
    """Two threads computing statistics of tensors of one size at the same time both get their own tensor's values
    (each thread has its own arrays)."""
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(512, generator=g) * (i + 1) for i in range(2)]
    expected = [_bits(_reference(t)) for t in tensors]
    results = run_in_two_threads(lambda i: _bits(torch_ref.basic_partial_values(tensors[i])), 200)
    for i in range(2):
        assert all(r == expected[i] for r in results[i])


# ------------------------------------------------------------------------------------------------ FP8 current scaling
_QUANTIZER_SETTINGS = [
    dict(fp8_format="E4M3"),
    dict(fp8_format="E5M2"),
    dict(fp8_format="E4M3", amax_epsilon=1e-2),
    dict(fp8_format="E5M2", force_pow_2_scales=True),
    dict(fp8_format="E4M3", amax_epsilon=1e-12, force_pow_2_scales=True),
]


def _torch_path(quantizer, x):
    """The torch expressions of the current-scaling cast (the reference the host path must equal)."""
    from tedebug.quantization.float8 import _cast_per_tensor
    from tedebug.quantization.formats import tensor_amax

    return _cast_per_tensor(quantizer, x, quantizer.compute_scale(tensor_amax(x)), quantizer.fp8_format)


@pytest.mark.usefixtures("host_kernels")
@pytest.mark.parametrize("settings", _QUANTIZER_SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize(
    "x", list(fp8_cast_inputs()), ids=lambda x: f"{str(x.dtype)[6:]}-{'x'.join(map(str, x.shape))}"
)
def test_current_scaling_host_path_stores_the_torch_paths_bytes(settings, x):
    """Codes of both directions, scale_inv and the dequantized values (both usages, the same strides) equal the
    torch path's bit for bit, for every format and scale option, NaN, infinities, zeros and subnormals."""
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    quantizer = Float8CurrentScalingQuantizer(**settings)
    host = quantizer.quantize(x)
    ref = _torch_path(quantizer, x)
    assert torch.equal(host.rowwise_data, ref.rowwise_data)
    assert torch.equal(host.columnwise_data, ref.columnwise_data)
    assert host.columnwise_data.is_contiguous() and host.rowwise_data.shape == x.shape
    assert host.scale_inv.shape == () and host.scale_inv.dtype == torch.float32
    assert host.scale_inv.view(torch.int32).item() == ref.scale_inv.view(torch.int32).item()
    for usage in ("rowwise", "columnwise"):
        fast = host.dequantize(usage=usage, dtype=torch.float32)
        codes = ref._codes_2d(usage)
        from tedebug.quantization.formats import decode_fp8

        slow = (decode_fp8(codes, ref.fp8_format) * ref.scale_inv.float().reshape(())).reshape(x.shape)
        assert fast.stride() == slow.stride()
        assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))


@pytest.mark.usefixtures("host_kernels")
def test_current_scaling_host_path_honours_the_usages():
    """Only the enabled directions are stored (rowwise only, columnwise only)."""
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    rowwise = Float8CurrentScalingQuantizer(columnwise=False).quantize(x)
    columnwise = Float8CurrentScalingQuantizer(rowwise=False).quantize(x)
    assert rowwise.columnwise_data is None and columnwise.rowwise_data is None
    assert torch.equal(columnwise.columnwise_data, rowwise.rowwise_data.t())


def test_current_scaling_on_cpu_runs_one_torch_cast(host_kernels):
    """A contiguous CPU tensor is quantized with one torch operator (the fp32 -> FP8 conversion) on the numpy path
    and none with the compiled helpers, and dequantized with none; the torch path runs several per call.  With the
    quantization-error statistics on (`error_stats`, a hand-made quantizer's default) the cast adds one torch sum
    (the squared errors, summed as the reference sums them)."""
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    cast = [] if host_kernels == "c" else ["_to_copy"]
    quantizer = Float8CurrentScalingQuantizer()
    quantizer.error_stats = False  # a layer's quantizer outside the debug path
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(8))
    quantizer.quantize(x)  # the decode table exists from here on
    with AtenCounter() as counter:
        q = quantizer.quantize(x)
    assert _computing(counter.ops) == cast, counter.ops
    quantizer.error_stats = True
    with AtenCounter() as counter:
        quantizer.quantize(x)
    assert _computing(counter.ops) == cast + ["sum"], counter.ops
    with AtenCounter() as counter:
        q.dequantize(usage="columnwise")
    assert _computing(counter.ops) in ([], ["t"]), counter.ops
    with AtenCounter() as counter:
        _torch_path(quantizer, x)
    assert len(_computing(counter.ops)) > 8
