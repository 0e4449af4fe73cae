"""Per-tensor FP8 (current and delayed scaling) and Float8Tensor: hand-derived vectors and float64 oracles.

Expected codes come from an FP8 table built from the bit fields (round to nearest, ties to the even code); expected
scales from float64 arithmetic rounded once to fp32 (exact for a single fp32 division or product).
"""

import math
import struct

import pytest
import torch

from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from tedebug.quantization.formats import FLT_MAX

NAN = float("nan")
INF = float("inf")


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def e4m3_table() -> torch.Tensor:
    vals = []
    for c in range(0x7F):
        e, m = c >> 3, c & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


def oracle_e4m3(x: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of float64 values: saturate to 448, nearest with ties to the even code, NaN -> 0x7F."""
    table = e4m3_table()
    a = x.abs().clamp(max=448.0).nan_to_num(0.0)
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo) | (torch.signbit(x).long() << 7)
    return torch.where(torch.isnan(x), torch.full_like(code, 0x7F), code).to(torch.uint8)


def current(x, **kw):
    return Float8CurrentScalingQuantizer(**kw).quantize(x)


# ------------------------------------------------------------------------------------------------ current scaling
def test_current_scaling_spec_vector():
    q = current(torch.tensor([1.0, 3.5, -0.01, 1e-4]))
    assert q.scale_inv.shape == () and q.scale_inv.dtype == torch.float32
    assert q.scale_inv.item() == 1 / 128
    assert q.rowwise_data.tolist() == [0x70, 0x7E, 0xBA, 0x07]
    assert q.dequantize().tolist() == [1.0, 3.5, -0.009765625, 0.013671875 / 128]
    assert q.fp8_format == "E4M3" and q.dtype == torch.float32


@pytest.mark.parametrize(
    "amax, fmt, pow2, scale",
    [
        (3.5, "E4M3", False, 128.0),
        (3.0, "E4M3", False, f32(448.0 / 3.0)),
        (3.0, "E4M3", True, 128.0),
        (1.0, "E4M3", False, 448.0),
        (1.0, "E4M3", True, 256.0),
        (1.0, "E5M2", False, 57344.0),
        (1.0, "E5M2", True, 32768.0),
        (0.0, "E4M3", False, 1.0),
        (1e-40, "E4M3", False, FLT_MAX),
        (1e-40, "E4M3", True, 2.0**127),
    ],
)
def test_current_scaling_scales(amax, fmt, pow2, scale):
    x = torch.tensor([amax, -amax / 2, 0.0])
    q = current(x, fp8_format=fmt, force_pow_2_scales=pow2)
    assert q.scale_inv.item() == f32(1.0 / scale)
    if fmt == "E4M3":
        expected = oracle_e4m3(x.double() * torch.tensor(scale, dtype=torch.float32).double())
        assert torch.equal(q.rowwise_data, expected)
    assert f32(448.0 / 3.0) == pytest.approx(149.3333282, abs=1e-7)


def test_current_scaling_epsilon():
    q = current(torch.zeros(4), amax_epsilon=1.0)
    assert q.scale_inv.item() == f32(1 / 448)
    q = current(torch.tensor([0.25, 0.5]), amax_epsilon=2.0)
    assert q.scale_inv.item() == f32(1 / 224)
    assert q.rowwise_data.tolist() == oracle_e4m3(torch.tensor([56.0, 112.0], dtype=torch.float64)).tolist()


def test_current_scaling_random_matches_oracle():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.empty(64, 1).uniform_(-12, 6, generator=g))
    for pow2 in (False, True):
        q = current(x, force_pow_2_scales=pow2)
        amax = x.abs().max().item()
        scale = f32(448.0 / amax)
        if pow2:
            scale = 2.0 ** math.floor(math.log2(scale))
        assert q.scale_inv.item() == f32(1.0 / scale)
        scaled = (x.double() * scale).float().double()  # the fp32 product, rounded once
        assert torch.equal(q.rowwise_data, oracle_e4m3(scaled))
        assert torch.equal(q.dequantize(), (oracle_deq := e4m3_decode(q.rowwise_data) * q.scale_inv))
        assert oracle_deq.dtype == torch.float32


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    table = e4m3_table().float()
    mag = table[(codes & 0x7F).long().clamp(max=0x7E)]
    return torch.where((codes & 0x80) != 0, -mag, mag)


def test_round_trip_error_bound_normal_range():
    """|x - deq| <= 2^-4 |x| (relative half-ulp of a 3-bit mantissa) when x·scale is a normal E4M3 value."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4096, generator=g) * 10
    for pow2 in (False, True):
        q = current(x, force_pow_2_scales=pow2)
        deq = q.dequantize()
        normal = x.abs() / q.scale_inv >= 2.0**-6
        assert normal.sum() > 4000
        err = (x - deq).abs()[normal]
        assert torch.all(err <= 2.0**-4 * x.abs()[normal])
        assert err.max() > 0  # not trivially exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    x = torch.tensor([[1.0, -2.5, 0.125], [7.0, 0.0, -0.0078125]], dtype=dtype)
    q = current(x)
    ref = current(x.float())
    assert torch.equal(q.rowwise_data, ref.rowwise_data) and q.scale_inv.item() == 64.0**-1
    assert q.dtype == dtype and q.dequantize().dtype == dtype
    assert q.dequantize(dtype=torch.float32).dtype == torch.float32
    assert torch.equal(q.dequantize().float(), ref.dequantize())


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0), (2, 0, 5)])
def test_empty_tensors(shape):
    q = current(torch.empty(shape))
    assert q.scale_inv.item() == 1.0
    assert q.rowwise_data.shape == shape and q.dequantize().shape == shape
    m = math.prod(shape[:-1])
    assert q.columnwise_data.shape == (shape[-1], m)
    assert q.dequantize(usage="columnwise").shape == shape
    assert q.nonzero_code_count("rowwise").item() == 0
    d = Float8Quantizer.from_recipe_defaults("E4M3", 4)
    assert d.quantize(torch.empty(shape)).dequantize().shape == shape
    assert d.amax_history.tolist() == [0.0] * 4


def test_nan_and_inf_inputs():
    # NaN is ignored by the amax (TE's fmaxf reduction) and stored as the NaN code
    q = current(torch.tensor([NAN, 3.5, -1.0]))
    assert q.scale_inv.item() == 1 / 128
    assert q.rowwise_data.tolist() == [0x7F, 0x7E, 0xF0]  # -1.0·128 = -2^7
    assert math.isnan(q.dequantize()[0].item())
    # an infinite amax gives scale 1; Inf saturates to 448
    q = current(torch.tensor([INF, -INF, 3.0]))
    assert q.scale_inv.item() == 1.0
    assert q.rowwise_data.tolist() == [0x7E, 0xFE, 0x44]


# ------------------------------------------------------------------------------------------------ delayed scaling
def delayed(history, algo="max", margin=0, scale=1.0):
    return Float8Quantizer(
        torch.tensor(scale),
        torch.tensor(history, dtype=torch.float32),
        "E4M3",
        margin=margin,
        amax_compute_algo=algo,
    )


@pytest.mark.parametrize("algo, margin, scale", [("max", 0, 56.0), ("max", 1, 28.0), ("most_recent", 0, 224.0)])
def test_delayed_history_vector(algo, margin, scale):
    q = delayed([2.0, 8.0, 1.0, 4.0], algo, margin)
    q.update_scale()
    assert q.scale.item() == scale
    assert q.amax_history.tolist() == [0.0, 1.0, 4.0, 2.0]


def test_delayed_callable_algo_and_2d_history():
    q = Float8Quantizer(
        torch.ones(1),
        torch.tensor([[2.0], [8.0], [1.0], [4.0]]),
        "E4M3",
        amax_compute_algo=lambda h: h[1:].min(),
    )
    q.update_scale()
    assert q.scale.tolist() == [448.0]
    assert q.amax_history.tolist() == [[0.0], [1.0], [4.0], [2.0]]


def test_delayed_keeps_scale_on_zero_or_nonfinite_and_flt_max_on_overflow():
    q = delayed([0.0, 0.0], scale=3.0)
    q.update_scale()
    assert q.scale.item() == 3.0
    q = delayed([INF, 1.0], scale=5.0)
    q.update_scale()
    assert q.scale.item() == 5.0
    q = delayed([1e-40, 0.0])
    q.update_scale()
    assert q.scale.item() == FLT_MAX


def test_delayed_quantize_records_amax_and_uses_stale_scale():
    q = Float8Quantizer.from_recipe_defaults("E4M3", history_len=3)
    assert q.scale.item() == 1.0 and q.amax_history.tolist() == [0.0, 0.0, 0.0]
    assert q.recipe_name == "fp8_delayed_scaling"
    q.quantize(torch.tensor([1.0, -3.0]))
    q.quantize(torch.tensor([2.0, NAN]))
    assert q.amax_history.tolist() == [3.0, 0.0, 0.0]
    q.update_scale()
    assert q.scale.item() == f32(448.0 / 3.0) and q.amax_history.tolist() == [0.0, 0.0, 3.0]
    q.scale.fill_(2.0)
    t = q.quantize(torch.tensor([1.0, 300.0, -0.5]))
    assert t.scale_inv.item() == 0.5
    assert t.rowwise_data.tolist() == [0x40, 0x7E, 0xB8]  # 600 saturates to 448 with the stale scale
    q.update_scale()
    assert t.scale_inv.item() == 0.5  # the tensor keeps its own scale_inv
    assert q.scale.item() == f32(448.0 / 300.0)


def test_delayed_copy_shares_state():
    q = Float8Quantizer.from_recipe_defaults("E5M2", 2)
    c = q.copy()
    c.set_usage(columnwise=False)
    c.quantize(torch.tensor([4.0]))
    assert q.amax_history.tolist() == [4.0, 0.0] and q.columnwise_usage
    q.update_scale()
    assert c.scale.item() == 57344.0 / 4.0


def test_delayed_constructor_errors():
    with pytest.raises(ValueError, match="amax_compute_algo"):
        delayed([0.0], algo="mean")
    with pytest.raises(ValueError, match="amax_history"):
        Float8Quantizer(torch.ones(()), torch.zeros(2, 2), "E4M3")
    with pytest.raises(ValueError, match="scale"):
        Float8Quantizer(torch.ones(2), torch.zeros(2), "E4M3")
    with pytest.raises(ValueError, match="margin"):
        delayed([0.0], margin=-1)
    with pytest.raises(ValueError, match="history_len"):
        Float8Quantizer.from_recipe_defaults("E4M3", 0)


# ------------------------------------------------------------------------------------------------ Float8Tensor
def test_columnwise_is_transpose_of_rowwise_bytes():
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(5))
    for quantizer in (Float8CurrentScalingQuantizer(), Float8Quantizer.from_recipe_defaults("E4M3", 4)):
        q = quantizer.quantize(x)
        assert q.rowwise_data.shape == (2, 3, 5) and q.columnwise_data.shape == (5, 6)
        assert torch.equal(q.columnwise_data, q.rowwise_data.reshape(6, 5).t())
        assert torch.equal(q.dequantize(usage="columnwise"), q.dequantize(usage="rowwise"))
    one_d = current(torch.tensor([1.0, 2.0, 3.0]))
    assert one_d.columnwise_data.shape == (3, 1)


def test_usage_flags_and_update_usage():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(6))
    full = current(x)
    quantizer = Float8CurrentScalingQuantizer()
    quantizer.set_usage(rowwise=True, columnwise=False)
    q = quantizer.quantize(x)
    assert q.has_rowwise and not q.has_columnwise and q.columnwise_data is None
    with pytest.raises(RuntimeError, match="columnwise representation is not available"):
        q.dequantize(usage="columnwise")
    q.update_usage(columnwise_usage=True)
    assert torch.equal(q.columnwise_data, full.columnwise_data)
    q.update_usage(rowwise_usage=False)
    assert not q.has_rowwise and q.rowwise_data is None
    q.update_usage(rowwise_usage=True)
    assert torch.equal(q.rowwise_data, full.rowwise_data)
    quantizer.set_usage(rowwise=False, columnwise=True)
    only_col = quantizer.quantize(x)
    assert only_col.rowwise_data is None and torch.equal(only_col.columnwise_data, full.columnwise_data)
    assert torch.equal(only_col.dequantize(), full.dequantize())
    with pytest.raises(ValueError, match="drop both"):
        q.update_usage(rowwise_usage=False, columnwise_usage=False)
    quantizer.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="both rowwise and columnwise usage are off"):
        quantizer.quantize(x)


def test_prepare_for_saving_round_trip():
    q = current(torch.randn(3, 4, generator=torch.Generator().manual_seed(7)))
    before = (q.rowwise_data, q.columnwise_data, q.scale_inv, q.dequantize())
    tensors, obj = q.prepare_for_saving()
    assert obj is q and len(tensors) == 3 and q.rowwise_data is None and q.scale_inv is None
    extra = torch.ones(1)
    rest = q.restore_from_saved(tensors + [extra])
    assert rest == [extra]
    assert q.rowwise_data is before[0] and q.columnwise_data is before[1] and q.scale_inv is before[2]
    assert torch.equal(q.dequantize(), before[3])


def test_make_empty_and_out_refresh():
    quantizer = Float8CurrentScalingQuantizer()
    e = quantizer.make_empty((2, 3, 4), dtype=torch.bfloat16)
    assert e.rowwise_data.shape == (2, 3, 4) and e.columnwise_data.shape == (4, 6)
    assert e.rowwise_data.dtype == torch.uint8 and e.scale_inv.shape == () and e.dtype == torch.bfloat16
    quantizer.set_usage(columnwise=False)
    assert quantizer.make_empty((5,)).columnwise_data is None
    quantizer.set_usage(columnwise=True)

    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(8)).bfloat16()
    ptrs = (e.rowwise_data.data_ptr(), e.columnwise_data.data_ptr(), e.scale_inv.data_ptr())
    out = quantizer.quantize(x, out=e)
    fresh = quantizer.quantize(x)
    assert out is e
    assert (e.rowwise_data.data_ptr(), e.columnwise_data.data_ptr(), e.scale_inv.data_ptr()) == ptrs
    assert torch.equal(e.rowwise_data, fresh.rowwise_data) and torch.equal(e.columnwise_data, fresh.columnwise_data)
    assert e.scale_inv.item() == fresh.scale_inv.item()
    with pytest.raises(ValueError, match="cannot refresh"):
        quantizer.quantize(torch.randn(3, 3), out=e)


def test_out_refresh_respects_directions_of_out():
    quantizer = Float8CurrentScalingQuantizer()
    quantizer.set_usage(columnwise=False)
    e = quantizer.make_empty((4, 2))
    quantizer.set_usage(columnwise=True)
    quantizer.quantize(torch.randn(4, 2), out=e)
    assert e.has_rowwise and not e.has_columnwise and quantizer.columnwise_usage


def test_statistics_helpers():
    q = current(torch.tensor([[1.0, 0.0, 1e-6], [-3.5, -0.0, 2.0]]))
    assert q.nonzero_code_count("rowwise").dtype == torch.int64
    assert q.nonzero_code_count("rowwise").item() == 3  # 1e-6·128 underflows to 0
    assert q.nonzero_code_count("columnwise").item() == 3
    vals = q.scale_inv_values("columnwise")
    assert vals.shape == (1,) and vals.dtype == torch.float32 and vals.item() == 1 / 128
    q.update_usage(columnwise_usage=False)
    with pytest.raises(RuntimeError):
        q.scale_inv_values("columnwise")
    with pytest.raises(ValueError, match="usage must be"):
        q.nonzero_code_count("both")


def test_input_validation_errors():
    quantizer = Float8CurrentScalingQuantizer()
    with pytest.raises(ValueError, match="at least 1 dim"):
        quantizer.quantize(torch.tensor(1.0))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantizer.quantize(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantizer.quantize([1.0])
    with pytest.raises(ValueError, match="unknown FP8 format"):
        Float8CurrentScalingQuantizer("E2M1")
    with pytest.raises(ValueError, match="columnwise_data"):
        Float8Tensor(
            (2, 3),
            torch.float32,
            None,
            None,
            fp8_format="E4M3",
            scale_inv=torch.ones(()),
            columnwise_data=torch.zeros(2, 3, dtype=torch.uint8),
        )
    assert Float8CurrentScalingQuantizer.recipe_name == "fp8_current_scaling"
