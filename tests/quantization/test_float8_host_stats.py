"""The CPU host cast of per-tensor FP8 (current and delayed scaling) and the statistics vector it attaches.

- the delayed-scaling host path stores the torch path's bytes and scale_inv and records the same amax history;
- with `Quantizer.error_stats` on, the quantized tensor carries a float64 vector (`FP8_STATS_WITH_SCALE` order,
  one vector for both directions) whose every entry equals, bit for bit, the partial that the torch reference
  (`tedebug.backends.torch_ref`) computes from the tensor and the torch path's quantization - over adversarial
  inputs (zeros of both signs, fp32 subnormals, values at and beyond the FP8 maximum, NaN, infinities, odd and
  N-D shapes, a dynamic range that makes the float64 sum depend on its order, a tensor above torch's parallel
  grain) and state (zero, infinite, huge and tiny delayed scales);
- with the flag off nothing is attached;
- each of these holds for the compiled helpers (kernels/host_fp8.c) and for the numpy path.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tedebug.backends.fused_stats import FP8_STATS_WITH_SCALE, fused_vector
from tedebug.quantization.float8 import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    _cast_per_tensor,
)
from tedebug.quantization.formats import decode_fp8, tensor_amax

from support.concurrency import run_in_two_threads
from support.kernel_inputs import fp8_cast_inputs, reference_fp8_partials

NAN, INF = float("nan"), float("inf")

#: every test here runs with the compiled CPU helpers and with the numpy path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("host_kernels")


_CURRENT = [
    dict(fp8_format="E4M3"),
    dict(fp8_format="E5M2"),
    dict(fp8_format="E4M3", amax_epsilon=1e-2),
    dict(fp8_format="E5M2", force_pow_2_scales=True),
]
#: delayed-scaling scales: ordinary, powers of two, huge and tiny (products overflow / underflow), zero (scale_inv
#: Inf), infinite (scale_inv 0; 0 · Inf is NaN)
_DELAYED_SCALES = [1.0, 3.7, 2.0**-10, 1e30, 1e-30, 0.0, INF]


def _ids(x):
    return f"{str(x.dtype)[6:]}-{'x'.join(map(str, x.shape))}"


def _key(value: float):
    """A float as a comparable key: NaN as one marker, the sign of a zero kept."""
    return ("nan",) if math.isnan(value) else (value, math.copysign(1.0, value))


def _reference_vector(x, q_ref, usage):
    """The vector's entries as the torch reference computes them from x and the torch path's quantization."""
    partials = reference_fp8_partials(x, q_ref, usage)
    return {name: _key(partials[name].item()) for name in FP8_STATS_WITH_SCALE}


def _check_vector(x, q_host, q_ref):
    assert torch.equal(q_host.rowwise_data, q_ref.rowwise_data)
    assert torch.equal(q_host.columnwise_data, q_ref.columnwise_data)
    assert _key(q_host.scale_inv.item()) == _key(q_ref.scale_inv.item())
    for usage in ("rowwise", "columnwise"):
        fused = fused_vector(q_host, x, usage)
        assert fused is not None and fused.vector.dtype == torch.float64 and fused.vector.device.type == "cpu"
        got = {name: _key(fused[name].item()) for name in FP8_STATS_WITH_SCALE}
        assert got == _reference_vector(x, q_ref, usage)


@pytest.mark.parametrize("settings", _CURRENT, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("x", list(fp8_cast_inputs()), ids=_ids)
def test_current_scaling_vector_equals_the_reference(settings, x):
    quantizer = Float8CurrentScalingQuantizer(**settings)
    q_host = quantizer.quantize(x)
    q_ref = _cast_per_tensor(quantizer, x, quantizer.compute_scale(tensor_amax(x)), quantizer.fp8_format)
    _check_vector(x, q_host, q_ref)


def _delayed(fmt, scale, history):
    return Float8Quantizer(torch.tensor(scale, dtype=torch.float32), history.clone(), fmt)


def _delayed_torch_path(quantizer, x):
    """The torch expressions of the delayed-scaling cast: amax recorded into history[0], cast with the scale."""
    history = quantizer.amax_history.view(-1)
    history[0] = torch.maximum(history[0], tensor_amax(x))
    return _cast_per_tensor(quantizer, x, quantizer.scale, quantizer.fp8_format)


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("scale", _DELAYED_SCALES, ids=str)
@pytest.mark.parametrize("x", list(fp8_cast_inputs()), ids=_ids)
def test_delayed_scaling_host_path_equals_the_torch_path(fmt, scale, x):
    """Bytes, scale_inv, the recorded history and the statistics vector, with a history row that is below, above
    or equal to the tensor's amax."""
    for start in (0.0, 5.0, NAN):
        history = torch.tensor([start, 1.0, 2.0])
        host, ref = _delayed(fmt, scale, history), _delayed(fmt, scale, history)
        q_host = host.quantize(x)
        q_ref = _delayed_torch_path(ref, x)
        assert [_key(v) for v in host.amax_history.tolist()] == [_key(v) for v in ref.amax_history.tolist()]
        _check_vector(x, q_host, q_ref)


def test_large_tensor_vector_equals_the_reference_with_two_threads():
    """Above torch's parallel grain (32768 elements) a sum may split over threads: the vector's sum still equals
    the reference's, since both sum the same contiguous float64 terms."""
    g = torch.Generator().manual_seed(1417)
    x = torch.randn(301, 257, generator=g) * torch.exp(torch.empty(301, 257).uniform_(-30.0, 30.0, generator=g))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        quantizer = Float8CurrentScalingQuantizer()
        q_host = quantizer.quantize(x)
        q_ref = _cast_per_tensor(quantizer, x, quantizer.compute_scale(tensor_amax(x)), "E4M3")
        _check_vector(x, q_host, q_ref)
    finally:
        torch.set_num_threads(threads)


def test_vector_counts_are_exact():
    """Hand-counted: E4M3 with scale 1 (delayed), inputs 1e-4 (below half the smallest subnormal 2^-9: a zero code),
    -0.0, 500 (beyond 448: saturates, overflows), 2.0 and NaN."""
    x = torch.tensor([1e-4, -0.0, 500.0, 2.0, NAN])
    q = _delayed("E4M3", 1.0, torch.zeros(1)).quantize(x)
    fused = fused_vector(q, x, "rowwise")
    values = dict(zip(fused.keys_in_order, fused.vector.tolist()))
    assert values["underflows_num"] == 1.0 and values["overflows_num"] == 1.0 and values["numel"] == 5.0
    assert math.isnan(values["sq_err"])
    assert (values["scale_count"], values["scale_sum"], values["scale_m2"]) == (1.0, 1.0, 0.0)
    assert (values["scale_nz_min"], values["scale_max"]) == (1.0, 1.0)
    finite = torch.tensor([1e-4, -0.0, 500.0, 2.0])
    q = _delayed("E4M3", 1.0, torch.zeros(1)).quantize(finite)
    sq_err = fused_vector(q, finite, "columnwise")["sq_err"].item()
    assert sq_err == float(torch.tensor(1e-4).double()) ** 2 + 52.0**2  # 1e-4 -> 0, 500 -> 448, 2 exact


def test_only_the_produced_directions_and_only_with_the_flag():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    rowwise_only = Float8CurrentScalingQuantizer(columnwise=False).quantize(x)
    assert fused_vector(rowwise_only, x, "rowwise") is not None
    assert fused_vector(rowwise_only, x, "columnwise") is None
    for quantizer in (Float8CurrentScalingQuantizer(), _delayed("E4M3", 1.0, torch.zeros(2))):
        quantizer.error_stats = False
        quiet = quantizer.quantize(x)
        assert fused_vector(quiet, x, "rowwise") is None and fused_vector(quiet, x, "columnwise") is None


def test_vector_is_for_that_tensor_at_that_version_only():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10))
    q = Float8CurrentScalingQuantizer().quantize(x)
    assert fused_vector(q, x.clone(), "rowwise") is None
    x.mul_(2.0)
    assert fused_vector(q, x, "rowwise") is None


@pytest.mark.parametrize(
    "make", [Float8CurrentScalingQuantizer, lambda: Float8Quantizer(torch.tensor(3.0), torch.zeros(4), "E4M3")]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_that_requires_grad_is_read_without_autograd(make, dtype):
    """A layer's weight requires grad: its codes, scale_inv and statistics vector are those of its detached copy."""
    x = (torch.randn(6, 16, generator=torch.Generator().manual_seed(12)) * 40).to(dtype)
    leaf = x.clone().requires_grad_(True)
    plain, graded = make().quantize(x), make().quantize(leaf)
    assert torch.equal(graded.rowwise_data, plain.rowwise_data)
    assert torch.equal(graded.columnwise_data, plain.columnwise_data)
    assert torch.equal(graded.scale_inv, plain.scale_inv)
    values = [{k: v.item() for k, v in fused_vector(q, t, "rowwise").items()} for q, t in ((graded, leaf), (plain, x))]
    assert values[0] == values[1] and values[0]["sq_err"] > 0


def test_an_infinite_delayed_scale_raises_no_numpy_warning():
    """A delayed scale of Inf gives scale_inv 0: E5M2's infinite codes then decode to 0 · Inf = NaN, as torch's
    product does, without numpy's RuntimeWarning in the user's run."""
    x = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.5, -0.25]])
    quantizer = Float8Quantizer(torch.tensor(INF), torch.zeros(4), "E5M2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = quantizer.quantize(x)
        values = q.dequantize(dtype=torch.float32)
    reference = decode_fp8(q.rowwise_data, "E5M2") * q.scale_inv  # (torch's product: x · Inf, 0 · Inf = NaN)
    assert q.scale_inv.item() == 0.0 and torch.equal(values.view(torch.int32), reference.view(torch.int32))


def test_threads_casting_tensors_of_one_shape_do_not_share_a_workspace():
    """x·scale lands in a per-thread array per shape before the cast: two threads casting different tensors of the
    same shape at once each get their own tensor's bytes."""
    g = torch.Generator().manual_seed(1419)
    tensors = [torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g) * 1e3]
    expected = [Float8CurrentScalingQuantizer().quantize(x).rowwise_data for x in tensors]
    quantizers = [Float8CurrentScalingQuantizer(), Float8CurrentScalingQuantizer()]
    results = run_in_two_threads(lambda i: quantizers[i].quantize(tensors[i]).rowwise_data, 300)
    for i in range(2):
        assert len(results[i]) == 300 and all(torch.equal(r, expected[i]) for r in results[i])


def test_delayed_scaling_history_of_shape_l_by_1():
    """A [L, 1] history (TE's layout) records the amax in its first row, as the torch path does."""
    x = torch.tensor([[3.0, -7.5], [0.25, NAN]])
    host = Float8Quantizer(torch.tensor([2.0]), torch.tensor([[1.0], [9.0]]), "E5M2")
    ref = Float8Quantizer(torch.tensor([2.0]), torch.tensor([[1.0], [9.0]]), "E5M2")
    q_host, q_ref = host.quantize(x), _delayed_torch_path(ref, x)
    assert host.amax_history.tolist() == ref.amax_history.tolist() == [[7.5], [9.0]]
    _check_vector(x, q_host, q_ref)


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_products_just_above_the_maximum_round_to_it_without_saturation(fmt):
    """Products between fp8_max and `_ROUNDS_TO_MAX` skip the saturation (the cast rounds them to fp8_max) and still
    store the torch path's bytes, which clamps first; from `_ROUNDS_TO_MAX` on the saturation runs.  The bound is
    fp8_max plus half the spacing of the two largest finite codes, and the largest fp32 below it casts to fp8_max."""
    from tedebug.quantization.float8 import _ROUNDS_TO_MAX
    from tedebug.quantization.formats import FP8_MAX, TORCH_FP8_DTYPE, fp8_decode_table

    fmax = FP8_MAX[fmt]
    table = fp8_decode_table(fmt)
    finite = sorted({float(v) for v in table if math.isfinite(v) and 0.0 <= v < fmax})
    bound = _ROUNDS_TO_MAX[fmt]
    assert bound == fmax + (fmax - finite[-1]) / 2
    below = torch.tensor(bound).nextafter(torch.tensor(0.0))
    assert below.to(TORCH_FP8_DTYPE[fmt]).float().item() == fmax
    for top in (below.item(), (fmax + bound) / 2, fmax * (1 + 2**-20), bound, bound * 1.001):
        products = torch.tensor([[top, -top * 0.999, fmax, 1.0, -0.0, top / 3]])
        for scale in (1.0, 2.0):  # (halving is exact: the products are the values above)
            x = products / scale
            host, ref = _delayed(fmt, scale, torch.zeros(1)), _delayed(fmt, scale, torch.zeros(1))
            _check_vector(x, host.quantize(x), _delayed_torch_path(ref, x))
