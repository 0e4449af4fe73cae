"""FP8 blockwise (1x128 / 128x128) quantization: hand-derived vectors and a per-block float64 oracle.

The oracle computes each block's amax, scale (fp32 division rounded once from float64, power-of-two by taking
2^floor(log2)), and element codes from an E4M3/E5M2 table built from the bit fields (ties to the even code,
saturating), with no use of the library's codecs.
"""

import math

import pytest
import torch

from tedebug.quantization.float8_block import Float8BlockQuantizer, Float8BlockwiseTensor
from tedebug.quantization.formats import FLT_MAX

NAN = float("nan")
INF = float("inf")


def f32(v: float) -> float:
    """Round a Python float to fp32 once (overflow gives inf)."""
    return torch.tensor(v, dtype=torch.float64).float().item()


def fp8_table(fmt: str) -> torch.Tensor:
    vals = []
    if fmt == "E4M3":
        for c in range(0x7F):
            e, m = c >> 3, c & 7
            vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    else:
        for c in range(0x7C):
            e, m = c >> 2, c & 3
            vals.append(m * 2.0**-16 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15))
    return torch.tensor(vals, dtype=torch.float64)


def oracle_codes(x: torch.Tensor, fmt: str) -> torch.Tensor:
    table = fp8_table(fmt)
    a = x.abs().clamp(max=table[-1].item()).nan_to_num(0.0).contiguous()
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    pick_hi = (table[hi] - a < a - table[lo]) | ((table[hi] - a == a - table[lo]) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo) | (torch.signbit(x).long() << 7)
    return torch.where(torch.isnan(x), torch.full_like(code, 0x7F), code).to(torch.uint8)


def oracle_blockwise(x2d, block_rows, fmt="E4M3", pow2=True, eps=0.0):
    """(codes, scale_inv) of a 2-D tensor with `block_rows x 128` blocks, block by block in float64."""
    fmax = 448.0 if fmt == "E4M3" else 57344.0
    big = torch.finfo(x2d.dtype).max
    rows, cols = x2d.shape
    rb, cb = -(-rows // block_rows), -(-cols // 128)
    xd = x2d.double()
    scale = torch.empty(rb, cb, dtype=torch.float64)
    for i in range(rb):
        for j in range(cb):
            blk = xd[i * block_rows : (i + 1) * block_rows, j * 128 : (j + 1) * 128]
            amax = max(blk.abs().nan_to_num(0.0).max().item(), eps)
            if amax == 0 or math.isinf(amax):
                s = 1.0
            else:
                s = f32(fmax / amax)
                s = big if math.isinf(s) else s
                s = 2.0 ** math.floor(math.log2(s)) if pow2 else s
            scale[i, j] = s
    per_elem = scale.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)[:rows, :cols]
    scaled = (xd * per_elem).float().double()  # fp32 product rounded once
    scale_inv = torch.tensor([[f32(1.0 / s) for s in row] for row in scale.tolist()], dtype=torch.float32)
    return oracle_codes(scaled, fmt), scale_inv.reshape(rb, cb)


def varied(shape, seed):
    """Random data whose magnitude changes from row to row and column to column (many distinct block scales)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.empty(shape[0], 1).uniform_(-10, 8, generator=g))
    cols = torch.exp2(torch.empty(1, shape[1]).uniform_(-4, 4, generator=g))
    return torch.randn(shape, generator=g) * rows * cols


# ------------------------------------------------------------------------------------------------ spec vectors
@pytest.mark.parametrize(
    "pow2, expected",
    [
        (True, [1 / 128, 1 / 256, 1 / 4096]),
        (False, [f32(1 / f32(448 / 3)), f32(1 / 448), f32(1 / 4480)]),
    ],
)
def test_spec_block_scales(pow2, expected):
    x = torch.zeros(1, 384)
    x[0, 5], x[0, 130], x[0, 300] = -3.0, 1.0, 0.1
    x[0, 6], x[0, 131] = 1.5, 0.25
    q = Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=pow2).quantize(x)
    assert q.rowwise_scale_inv.shape == (1, 3)
    assert q.rowwise_scale_inv[0].tolist() == expected
    if not pow2:
        assert expected[0] == pytest.approx(3 / 448, rel=1e-7) and f32(448 / 3) == pytest.approx(149.333, abs=1e-3)
        assert f32(448 / f32(0.1)) == 4480.0
    codes, scale_inv = oracle_blockwise(x, 1, pow2=pow2)
    assert torch.equal(q.rowwise_data, codes) and torch.equal(q.rowwise_scale_inv, scale_inv)
    if pow2:  # amax 3.0 -> scale 128: -3·128 = -384 = -1.5·2^8 (0xFC), 1.5·128 = 192 = 1.5·2^7 (0x74)
        assert q.rowwise_data[0, 5].item() == 0xFC and q.rowwise_data[0, 6].item() == 0x74


def test_defaults_and_recipe_name():
    q = Float8BlockQuantizer()
    assert (q.block_scaling_dim, q.force_pow_2_scales, q.amax_epsilon, q.fp8_format) == (2, True, 0.0, "E4M3")
    assert q.recipe_name == "fp8_block_scaling"
    with pytest.raises(ValueError, match="block_scaling_dim must be 1 or 2"):
        Float8BlockQuantizer(block_scaling_dim=3)


# ------------------------------------------------------------------------------------------------ 1D vs 2D
@pytest.mark.parametrize("dim, pow2", [(1, True), (2, True), (1, False), (2, False)])
def test_random_matches_oracle(dim, pow2):
    x = varied((256, 256), seed=dim + 2 * pow2)
    q = Float8BlockQuantizer(block_scaling_dim=dim, force_pow_2_scales=pow2).quantize(x)
    br = 1 if dim == 1 else 128
    codes, scale_inv = oracle_blockwise(x, br, pow2=pow2)
    assert q.rowwise_scale_inv.shape == ((256, 2) if dim == 1 else (2, 2))
    assert torch.equal(q.rowwise_data, codes) and torch.equal(q.rowwise_scale_inv, scale_inv)
    col_codes, col_scale_inv = oracle_blockwise(x.t(), br, pow2=pow2)
    assert torch.equal(q.columnwise_data, col_codes) and torch.equal(q.columnwise_scale_inv, col_scale_inv)
    deq = codes.view(torch.float8_e4m3fn).float() * scale_inv.repeat_interleave(br, 0).repeat_interleave(128, 1)
    assert torch.equal(q.dequantize(), deq)


def test_1d_and_2d_differ_where_blocks_differ():
    x = torch.ones(128, 128)
    x[0, 0] = 100.0  # one large value: 2D tile shares its scale, 1D rows do not
    q1 = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    q2 = Float8BlockQuantizer(block_scaling_dim=2).quantize(x)
    assert q2.rowwise_scale_inv.tolist() == [[f32(1 / 4.0)]]  # 448/100 = 4.48 -> 4
    assert q1.rowwise_scale_inv[0, 0].item() == 1 / 4 and q1.rowwise_scale_inv[1, 0].item() == 1 / 256
    assert torch.equal(q1.dequantize()[1:], x[1:]) and torch.equal(q2.dequantize()[1:], x[1:])
    # 100·4 = 400 lies halfway between E4M3 384 and 416: ties to the even code, 384 -> 96
    assert q1.dequantize()[0, 0].item() == 96.0 and q2.dequantize()[0, 0].item() == 96.0
    assert q1.dequantize()[0, 1].item() == 1.0 and q2.dequantize()[0, 1].item() == 1.0


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape", [(130, 200), (2, 65, 200), (5,), (129, 1)])
def test_non_multiple_of_128_shapes(dim, shape):
    x = varied((math.prod(shape[:-1]), shape[-1]), seed=11).reshape(shape)
    q = Float8BlockQuantizer(block_scaling_dim=dim).quantize(x)
    m, k = math.prod(shape[:-1]), shape[-1]
    br = 1 if dim == 1 else 128
    codes, scale_inv = oracle_blockwise(x.reshape(m, k), br)
    assert q.rowwise_data.shape == shape and torch.equal(q.rowwise_data.reshape(m, k), codes)
    assert torch.equal(q.rowwise_scale_inv, scale_inv)
    col_codes, col_scale_inv = oracle_blockwise(x.reshape(m, k).t(), br)
    assert q.columnwise_data.shape == (k, m) and torch.equal(q.columnwise_data, col_codes)
    assert torch.equal(q.columnwise_scale_inv, col_scale_inv)
    assert q.dequantize().shape == shape and q.dequantize(usage="columnwise").shape == shape


# ------------------------------------------------------------------------------------------------ directions
def test_2d_columnwise_is_transpose_of_rowwise():
    x = varied((300, 260), seed=12)
    quantizer = Float8BlockQuantizer(block_scaling_dim=2)
    q = quantizer.quantize(x)
    assert torch.equal(q.columnwise_data, q.rowwise_data.t())
    assert torch.equal(q.columnwise_scale_inv, q.rowwise_scale_inv.t())
    assert torch.equal(q.dequantize(usage="columnwise"), q.dequantize(usage="rowwise"))
    quantizer.set_usage(rowwise=False)
    only_col = quantizer.quantize(x)  # computed from x.T, not transposed from rowwise
    assert torch.equal(only_col.columnwise_data, q.columnwise_data)
    assert torch.equal(only_col.columnwise_scale_inv, q.columnwise_scale_inv)


def test_1d_columnwise_is_rowwise_of_transpose():
    x = varied((200, 300), seed=13)
    quantizer = Float8BlockQuantizer(block_scaling_dim=1)
    q, qt = quantizer.quantize(x), quantizer.quantize(x.t().contiguous())
    assert torch.equal(q.columnwise_data, qt.rowwise_data)
    assert torch.equal(q.columnwise_scale_inv, qt.rowwise_scale_inv)
    assert torch.equal(q.dequantize(usage="columnwise"), qt.dequantize(usage="rowwise").t())
    # the two 1D directions really are different quantizations
    assert not torch.equal(q.dequantize(usage="columnwise"), q.dequantize(usage="rowwise"))


def test_usage_flags_and_update_usage():
    x = varied((130, 140), seed=14)
    q1 = Float8BlockQuantizer(block_scaling_dim=1, columnwise=False).quantize(x)
    assert q1.has_rowwise and not q1.has_columnwise and q1.columnwise_scale_inv is None
    with pytest.raises(RuntimeError, match="cannot create the columnwise representation"):
        q1.update_usage(columnwise_usage=True)
    full2 = Float8BlockQuantizer(block_scaling_dim=2).quantize(x)
    q2 = Float8BlockQuantizer(block_scaling_dim=2, columnwise=False).quantize(x)
    q2.update_usage(columnwise_usage=True)
    assert torch.equal(q2.columnwise_data, full2.columnwise_data)
    assert torch.equal(q2.columnwise_scale_inv, full2.columnwise_scale_inv)
    q2.update_usage(rowwise_usage=False)
    assert q2.rowwise_data is None and q2.rowwise_scale_inv is None
    q2.update_usage(rowwise_usage=True)
    assert torch.equal(q2.rowwise_data, full2.rowwise_data)
    assert torch.equal(q2.rowwise_scale_inv, full2.rowwise_scale_inv)


def test_prepare_for_saving_round_trip():
    q = Float8BlockQuantizer(block_scaling_dim=1).quantize(varied((4, 130), seed=15))
    deq = q.dequantize(usage="columnwise")
    tensors, obj = q.prepare_for_saving()
    assert obj is q and len(tensors) == 4 and not q.has_rowwise and not q.has_columnwise
    assert q.restore_from_saved(tensors) == []
    assert torch.equal(q.dequantize(usage="columnwise"), deq)


@pytest.mark.parametrize("dim", [1, 2])
def test_make_empty_and_out_refresh(dim):
    quantizer = Float8BlockQuantizer(block_scaling_dim=dim)
    e = quantizer.make_empty((2, 100, 260), dtype=torch.bfloat16)
    rows = (200, 3) if dim == 1 else (2, 3)
    cols = (260, 2) if dim == 1 else (3, 2)
    assert e.rowwise_data.shape == (2, 100, 260) and e.rowwise_scale_inv.shape == rows
    assert e.columnwise_data.shape == (260, 200) and e.columnwise_scale_inv.shape == cols
    assert e.dtype == torch.bfloat16 and e.rowwise_data.dtype == torch.uint8
    x = varied((200, 260), seed=16).reshape(2, 100, 260).bfloat16()
    ptrs = [getattr(e, f).data_ptr() for f in e._tensor_fields()]
    assert quantizer.quantize(x, out=e) is e
    assert [getattr(e, f).data_ptr() for f in e._tensor_fields()] == ptrs
    fresh = quantizer.quantize(x)
    for f in e._tensor_fields():
        assert torch.equal(getattr(e, f), getattr(fresh, f)), f


@pytest.mark.parametrize("shape", [(0, 128), (4, 0), (0,)])
def test_empty_tensors(shape):
    for dim in (1, 2):
        q = Float8BlockQuantizer(block_scaling_dim=dim).quantize(torch.empty(shape))
        assert q.dequantize().shape == shape and q.dequantize(usage="columnwise").shape == shape
        assert q.nonzero_code_count("rowwise").item() == 0


# ------------------------------------------------------------------------------------------------ special values
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inf_scale_uses_input_dtype_max(dtype):
    x = torch.full((1, 128), 1e-39, dtype=dtype)  # 448 / 1e-39 overflows fp32
    q = Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False).quantize(x)
    big = torch.finfo(dtype).max
    assert q.rowwise_scale_inv.item() == f32(1 / big)
    assert torch.equal(q.rowwise_data, oracle_blockwise(x, 1, pow2=False)[0])
    q = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    assert q.rowwise_scale_inv.item() == 2.0**-127
    if dtype == torch.bfloat16:
        assert big != FLT_MAX


def test_inf_nan_and_clamp_before_cast():
    x = torch.zeros(2, 128)
    x[0, :3] = torch.tensor([INF, -2.0, NAN])
    x[1, :2] = torch.tensor([NAN, 3.0])
    for fmt in ("E4M3", "E5M2"):
        q = Float8BlockQuantizer(fmt, block_scaling_dim=1).quantize(x)
        top = 0x7E if fmt == "E4M3" else 0x7B  # +Inf saturates to max normal, never the E5M2 Inf code
        assert q.rowwise_scale_inv[0].item() == 1.0  # Inf amax -> scale 1
        assert q.rowwise_data[0, :3].tolist() == [top, oracle_codes(torch.tensor([-2.0]).double(), fmt).item(), 0x7F]
        fmax = 448.0 if fmt == "E4M3" else 57344.0
        assert q.rowwise_scale_inv[1].item() == 2.0 ** -math.floor(math.log2(fmax / 3.0))  # NaN ignored
        assert q.rowwise_data[1, 0].item() == 0x7F


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    x = varied((128, 256), seed=17).to(dtype)
    for dim in (1, 2):
        q = Float8BlockQuantizer(block_scaling_dim=dim).quantize(x)
        codes, scale_inv = oracle_blockwise(x, 1 if dim == 1 else 128)
        assert torch.equal(q.rowwise_data, codes) and torch.equal(q.rowwise_scale_inv, scale_inv)
        assert q.dequantize().dtype == dtype


def test_epsilon_and_round_trip_bound():
    q = Float8BlockQuantizer(block_scaling_dim=1, amax_epsilon=1.0).quantize(torch.zeros(1, 128))
    assert q.rowwise_scale_inv.item() == 1 / 256  # amax 0 -> eps 1 -> 448 -> pow2 256
    x = varied((256, 384), seed=18)
    q = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    scale = (1 / q.rowwise_scale_inv).repeat_interleave(128, 1)
    normal = x.abs() * scale >= 2.0**-6
    err = (q.dequantize() - x).abs()
    assert normal.float().mean() > 0.99 and torch.all(err[normal] <= 2.0**-4 * x.abs()[normal])


def test_statistics_helpers():
    x = torch.zeros(130, 128)
    x[0, 0], x[1, 1], x[129, 5] = 1.0, 1e-9, -2.0  # 1e-9 underflows next to 1.0 in its 128x128 tile
    q = Float8BlockQuantizer(block_scaling_dim=2).quantize(x)
    assert q.nonzero_code_count("rowwise").item() == 2 and q.nonzero_code_count("columnwise").item() == 2
    vals = q.scale_inv_values("rowwise")
    assert vals.dtype == torch.float32 and vals.tolist() == [1 / 256, 1 / 128]
    assert q.scale_inv_values("columnwise").tolist() == [1 / 256, 1 / 128]
    q1 = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    assert q1.scale_inv_values("rowwise").shape == (130,) and q1.scale_inv_values("columnwise").shape == (256,)
    assert q1.nonzero_code_count("rowwise").item() == 3


def test_layout_validation():
    with pytest.raises(ValueError, match="rowwise_scale_inv: expected float32 of shape"):
        Float8BlockwiseTensor(
            (4, 256),
            torch.float32,
            None,
            None,
            fp8_format="E4M3",
            block_scaling_dim=1,
            rowwise_data=torch.zeros(4, 256, dtype=torch.uint8),
            rowwise_scale_inv=torch.ones(4, 1),
        )
    with pytest.raises(ValueError, match="given together"):
        Float8BlockwiseTensor(
            (4, 256),
            torch.float32,
            None,
            None,
            fp8_format="E4M3",
            block_scaling_dim=2,
            rowwise_data=torch.zeros(4, 256, dtype=torch.uint8),
        )
    with pytest.raises(ValueError, match="at least 1 dim"):
        Float8BlockQuantizer().quantize(torch.tensor(2.0))


@pytest.mark.parametrize("eps", [-1.0, float("nan")])
def test_negative_or_nan_amax_epsilon_is_rejected(eps):
    with pytest.raises(ValueError, match="amax_epsilon must be >= 0"):
        Float8BlockQuantizer(amax_epsilon=eps)
