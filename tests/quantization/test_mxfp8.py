"""Tests of tedebug.quantization.mxfp8 against hand-derived E8M0 vectors and an independent scalar oracle.

The oracle (pure Python + numpy float32, no tedebug code) is `tests/support/fp8_oracle.py`, shared with
test_nvfp4.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tedebug.quantization.mxfp8 import MXFP8Quantizer, MXFP8Tensor, mxfp8_scale_codes

from support.fp8_oracle import FLT_MAX, FP8_MAX, e8m0_rceil, mxfp8_block, mxfp8_oracle, mxfp8_dequant64, spread_tensor


# ================================================================================================ vectors
E8M0_TABLE = [  # amax, RCEIL code, q(amax) E4M3 code, decoded amax (derived by hand, checked on H200)
    (1.0, 119, 0x78, 1.0),
    (448.0, 127, 0x7E, 448.0),
    (449.0, 128, 0x76, 448.0),
    (500.0, 128, 0x78, 512.0),
    (300.0, 127, 0x79, 288.0),
    (0.001, 109, 0x78, 0.0009765625),
    (0.0, 0, 0x00, 0.0),
    (2.0**-130, 0, 0x20, 2.0**-130),
]


def _block_with_amax(amax: float) -> torch.Tensor:
    """A 32-element block whose amax is `amax` (at position 5, negated at 17) with smaller companions."""
    block = torch.tensor([amax * (i % 7) / 8.0 for i in range(32)], dtype=torch.float32)
    block[5] = amax
    block[17] = -amax
    return block


@pytest.mark.parametrize("amax, code, q_code, decoded", E8M0_TABLE)
def test_e8m0_table_vectors_in_real_blocks_both_directions(amax, code, q_code, decoded):
    block = _block_with_amax(amax)
    x = torch.zeros(32, 64)
    x[3, 32:] = block  # rowwise block (3, 1)
    x[:, 7] = block  # columnwise block (0, 7)
    q = MXFP8Quantizer("E4M3")(x)
    assert q.rowwise_scale_inv[3, 1].item() == code
    assert q.columnwise_scale_inv[0, 7].item() == code
    assert q.rowwise_data[3, 32 + 5].item() == q_code
    assert q.rowwise_data[3, 32 + 17].item() == (q_code | 0x80 if amax else 0x80)
    assert q.columnwise_data[5, 7].item() == q_code
    assert q.dequantize(usage="rowwise")[3, 32 + 5].item() == decoded
    assert q.dequantize(usage="columnwise")[5, 7].item() == decoded
    exp_codes = mxfp8_block(block.tolist(), "E4M3")
    assert exp_codes[0] == code
    assert q.rowwise_data[3, 32:].tolist() == exp_codes[1]


def test_e8m0_scale_rule_specials():
    amaxes = torch.tensor([math.nan, math.inf, 0.0, FLT_MAX])
    # a finite amax cannot reach code 254 for E4M3: FLT_MAX / 448 ~ 2^119.2 -> 247
    assert mxfp8_scale_codes(amaxes, "E4M3").tolist() == [255, 254, 0, 247]
    assert e8m0_rceil(FLT_MAX * float(np.float32(1 / 448))) == 247
    # amax 449: 449 * fp32(1/448) > 1 -> rounds up to 2^1; E5M2 amax 1.0 -> ceil(log2(1/57344)) = -15
    assert mxfp8_scale_codes(torch.tensor([449.0, 448.0]), "E4M3").tolist() == [128, 127]
    assert mxfp8_scale_codes(torch.tensor([1.0]), "E5M2").tolist() == [112]


def test_inf_block_gets_code_254_and_saturates():
    block = _block_with_amax(1.0)
    block[9] = math.inf
    x = torch.cat([block, torch.ones(32)]).reshape(1, 64).repeat(32, 1)
    q = MXFP8Quantizer()(x)
    assert q.rowwise_scale_inv[0].tolist() == [254, 119]
    assert q.rowwise_data[0, 9].item() == 0x7E  # Inf * 2^-127 = Inf -> satfinite 448
    assert q.rowwise_data[0, 5].item() == 0x00  # 1.0 * 2^-127 underflows
    assert q.rowwise_data[0, 32].item() == 0x78
    assert math.isinf(q.dequantize()[0, 9].item())


def test_nan_element_keeps_block_scale_and_becomes_nan():
    """The block amax ignores NaN like TE's fmaxf reduction: the block scale comes from the other values."""
    block = _block_with_amax(1.0)
    block[2] = math.nan
    x = block.reshape(1, 32).repeat(32, 2)
    q = MXFP8Quantizer()(x)
    assert q.rowwise_scale_inv[0].tolist() == [119, 119]
    assert q.rowwise_data[0, 2].item() == 0x7F
    assert q.rowwise_data[0, 5].item() == 0x78
    assert q.columnwise_scale_inv[0, 2].item() == 0  # a column of only NaN: amax 0 -> code 0
    assert q.columnwise_data[:, 2].tolist() == [0x7F] * 32
    assert math.isnan(q.dequantize()[0, 2].item())
    assert q.nonzero_code_count("rowwise").item() == int((x != 0).sum().item())


def test_e5m2_vectors():
    x = torch.zeros(32, 32)
    x[0, 0] = 1.0
    x[0, 1] = -3.0 * 2.0**-10  # 3 * 2^-10 * 2^15 = 96 -> E5M2 0x56 (1.5 * 2^6), negative 0xD6
    q = MXFP8Quantizer("E5M2")(x)
    assert q.rowwise_scale_inv[0, 0].item() == 112
    assert q.rowwise_data[0, 0].item() == 0x78
    assert q.rowwise_data[0, 1].item() == 0xD6
    assert q.dequantize()[0, :2].tolist() == [1.0, -3.0 * 2.0**-10]


# ================================================================================================ oracle sweep
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_oracle_bit_exact(fmt, dtype):
    x = spread_tensor(64, 64, seed=11, dtype=torch.float32)
    if dtype == torch.float16:
        x = x.clamp(-65504, 65504)
    x = x.to(dtype)
    q = MXFP8Quantizer(fmt)(x)
    rc, rs, cc, cs = mxfp8_oracle(x, fmt)
    assert torch.equal(q.rowwise_data, rc)
    assert torch.equal(q.rowwise_scale_inv, rs)
    assert torch.equal(q.columnwise_data, cc)
    assert torch.equal(q.columnwise_scale_inv, cs)
    deq = q.dequantize(dtype=torch.float32).double()
    ref_r = mxfp8_dequant64(rc, rs, fmt, rowwise=True)
    # fp32 product of an FP8 value and a power of two is exact unless it leaves the fp32 range
    assert torch.equal(q.dequantize(usage="rowwise", dtype=torch.float32).double(), ref_r.float().double())
    assert torch.equal(deq, ref_r.float().double())
    ref_c = mxfp8_dequant64(cc, cs, fmt, rowwise=False)
    assert torch.equal(q.dequantize(usage="columnwise", dtype=torch.float32).double(), ref_c.float().double())
    assert q.dequantize().dtype == dtype


@pytest.mark.parametrize("fmt, mbits, sub_exp", [("E4M3", 3, -9), ("E5M2", 2, -16)])
def test_round_trip_error_bound(fmt, mbits, sub_exp):
    """|x - deq| <= max(2^-(m+1) |x|, 2^(sub_exp-1) * block scale): half an ulp, normal or subnormal range."""
    x = spread_tensor(64, 96, seed=3).double()
    q = MXFP8Quantizer(fmt)(x.float())
    for usage, dim in (("rowwise", 1), ("columnwise", 0)):
        scales = q.scale_inv_values(usage).double().reshape(q.rowwise_scale_inv.shape if dim else (2, 96))
        scales = scales.repeat_interleave(32, dim=dim)
        err = (q.dequantize(usage=usage).double() - x).abs()
        bound = torch.maximum(x.abs() * 2.0 ** -(mbits + 1), scales * 2.0 ** (sub_exp - 1))
        assert bool((err <= bound).all()), f"{usage}: max excess {(err - bound).max().item()}"
        # nothing clips under RCEIL: the block amax is within half an ulp
        assert bool((q.dequantize(usage=usage).abs() <= scales.float() * FP8_MAX[fmt]).all())


# ================================================================================================ layouts
def test_columnwise_equals_rowwise_of_transpose():
    x = spread_tensor(64, 96, seed=5)
    q = MXFP8Quantizer()(x)
    t = MXFP8Quantizer(columnwise=False)(x.t().contiguous())
    assert torch.equal(q.columnwise_data, t.rowwise_data.t())
    assert torch.equal(q.columnwise_scale_inv, t.rowwise_scale_inv.t())
    assert torch.equal(q.dequantize(usage="columnwise"), t.dequantize().t())
    # rowwise and columnwise really differ (different blocks)
    row_scales = q.rowwise_scale_inv.repeat_interleave(32, 1)
    assert not torch.equal(row_scales, q.columnwise_scale_inv.repeat_interleave(32, 0))


def test_layouts_and_dtypes_for_3d_input():
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    q = MXFP8Quantizer()(x)
    assert isinstance(q, MXFP8Tensor)
    assert q.rowwise_data.shape == (2, 16, 64) and q.rowwise_data.dtype == torch.uint8
    assert q.columnwise_data.shape == (2, 16, 64)
    assert q.rowwise_scale_inv.shape == (32, 2) and q.columnwise_scale_inv.shape == (1, 64)
    assert q.shape == x.shape and q.dtype == torch.bfloat16
    assert q.dequantize().shape == x.shape
    flat = MXFP8Quantizer()(x.reshape(32, 64))
    assert torch.equal(flat.rowwise_data, q.rowwise_data.reshape(32, 64))
    assert torch.equal(flat.columnwise_scale_inv, q.columnwise_scale_inv)
    assert MXFP8Quantizer.recipe_name == "mxfp8"


def test_all_zero_and_signed_zero_blocks():
    x = torch.zeros(32, 64)
    x[0, 0] = -0.0
    q = MXFP8Quantizer()(x)
    assert q.rowwise_scale_inv.eq(0).all() and q.columnwise_scale_inv.eq(0).all()
    assert q.rowwise_data[0, 0].item() == 0x80 and q.rowwise_data[0, 1].item() == 0x00
    assert q.nonzero_code_count("rowwise").item() == 0
    assert q.nonzero_code_count("columnwise").item() == 0
    assert torch.equal(q.dequantize(), x) and math.copysign(1, q.dequantize()[0, 0].item()) == -1
    assert q.scale_inv_values("rowwise").tolist() == [2.0**-127] * 64


def test_fp32_subnormal_inputs_match_oracle():
    x = torch.zeros(32, 32)
    x[0, :4] = torch.tensor([1e-40, -3e-41, 2.0**-149, 7e-39])
    q = MXFP8Quantizer()(x)
    s, codes = mxfp8_block(x[0].tolist(), "E4M3")
    assert q.rowwise_scale_inv[0, 0].item() == s == 0  # 7e-39 / 448 < 2^-127
    assert q.rowwise_data[0].tolist() == codes
    assert codes[0] != 0  # 1e-40 * 2^127 ~ 0.017 is representable


def test_statistics_helpers():
    x = torch.zeros(64, 32)
    x[0, :3] = torch.tensor([4.0, 1e-9, -2.0])  # 1e-9 underflows under the 2^-6 block scale
    x[40, 0] = 0.5
    q = MXFP8Quantizer()(x)
    assert q.nonzero_code_count("rowwise").item() == 3
    assert q.nonzero_code_count("columnwise").item() == 4  # 1e-9 has a 32x1 block of its own there
    row_scales = q.scale_inv_values("rowwise")
    assert row_scales.dtype == torch.float32 and row_scales.shape == (64,)
    assert row_scales[0].item() == 2.0**-6 and row_scales[40].item() == 2.0**-9 and row_scales[1].item() == 2.0**-127
    col_scales = q.scale_inv_values("columnwise")
    assert col_scales.shape == (64,)
    assert col_scales[0].item() == 2.0**-6 and col_scales[32].item() == 2.0**-9
    with pytest.raises(ValueError, match="usage"):
        q.scale_inv_values("both")


# ================================================================================================ API
@pytest.mark.parametrize(
    "shape", [(64,), (3, 40), (3, 32), (2, 5, 32), (32, 48)], ids=["1d", "k40", "m3", "m10", "k48"]
)
def test_shape_errors_name_the_shape(shape):
    with pytest.raises(ValueError, match=r"shape \(" + ", ".join(str(s) for s in shape)):
        MXFP8Quantizer()(torch.zeros(shape))
    with pytest.raises(ValueError, match="MXFP8"):
        MXFP8Quantizer().make_empty(shape)


def test_rejects_bad_dtype_and_format():
    with pytest.raises(TypeError, match="int32"):
        MXFP8Quantizer()(torch.zeros(32, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="E4M2"):
        MXFP8Quantizer("E4M2")
    assert MXFP8Quantizer(torch.float8_e5m2).fp8_format == "E5M2"


def test_usage_flags():
    x = torch.randn(32, 64)
    rq = MXFP8Quantizer(columnwise=False)(x)
    assert rq.has_rowwise and not rq.has_columnwise and rq.columnwise_scale_inv is None
    with pytest.raises(RuntimeError, match="columnwise"):
        rq.dequantize(usage="columnwise")
    with pytest.raises(RuntimeError, match="columnwise"):
        rq.update_usage(columnwise_usage=True)
    cq = MXFP8Quantizer(rowwise=False)(x)
    assert cq.has_columnwise and not cq.has_rowwise
    assert torch.equal(cq.dequantize(), MXFP8Quantizer()(x).dequantize(usage="columnwise"))
    both = MXFP8Quantizer()(x)
    both.update_usage(rowwise_usage=False)
    assert not both.has_rowwise and both.rowwise_scale_inv is None and both.has_columnwise
    off = MXFP8Quantizer(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="nothing to produce"):
        off(x)


def test_save_restore_and_update_in_place():
    x = torch.randn(32, 64)
    q = MXFP8Quantizer()(x)
    before = (q.dequantize(usage="rowwise"), q.dequantize(usage="columnwise"))
    tensors, obj = q.prepare_for_saving()
    assert obj is q and len(tensors) == 4 and all(isinstance(t, torch.Tensor) for t in tensors)
    assert q.rowwise_data is None and not q.has_rowwise
    rest = q.restore_from_saved(tensors + ["extra"])
    assert rest == ["extra"]
    assert torch.equal(q.dequantize(usage="rowwise"), before[0])
    assert torch.equal(q.dequantize(usage="columnwise"), before[1])

    quantizer = MXFP8Quantizer()
    out = quantizer.make_empty((32, 64), dtype=torch.bfloat16)
    assert out.rowwise_scale_inv.shape == (32, 2) and out.columnwise_scale_inv.shape == (1, 64)
    data_ptr = out.rowwise_data.data_ptr()
    y = torch.randn(32, 64)
    res = quantizer.quantize(y, out=out)
    assert res is out and out.rowwise_data.data_ptr() == data_ptr
    fresh = MXFP8Quantizer()(y)
    assert torch.equal(out.rowwise_data, fresh.rowwise_data)
    assert torch.equal(out.columnwise_scale_inv, fresh.columnwise_scale_inv)
    assert out.dtype == torch.bfloat16
