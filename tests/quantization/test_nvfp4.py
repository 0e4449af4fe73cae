"""Tests of tedebug.quantization.nvfp4 against hand-derived E2M1 vectors and an independent scalar oracle.

The oracle (pure Python + numpy float32) recomputes TE's scale rule with numpy scalars, E4M3 rounding with the
table search of test_mxfp8.py, E2M1 rounding by nearest grid value (ties to even code), the RHT with the closed
form H[i, j] = (-1)^popcount(i & j), and stochastic rounding with exact arithmetic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tedebug.quantization.philox import philox_bytes

from tedebug.quantization.nvfp4 import (
    RHT_SIGNS,
    NVFP4Quantizer,
    NVFP4Tensor,
    rht_matrix,
    stochastic_round_e2m1,
)
from support.fp8_oracle import FLT_MAX, fp8_rne, fp8_value, nan_max_abs, nearest_code

# ================================================================================================ oracle
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = [(v, c) for c, v in enumerate(E2M1_GRID)]


def e2m1_rne(v: float) -> int:
    if math.isnan(v):
        return 7
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    return sign | nearest_code(abs(v), _E2M1_TABLE)


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_GRID[code & 7]


def global_scale(amax: float) -> np.float32:
    with np.errstate(all="ignore"):
        s = np.float32(2688.0) / np.float32(amax)
    if math.isinf(float(s)):
        s = np.float32(FLT_MAX)
    if amax == 0 or s == 0:
        s = np.float32(1.0)
    return s


def nvfp4_block(values, amax: float, block_amax: float = None):
    """(E4M3 scale code, E2M1 codes) of one block (TE rule in numpy float32)."""
    s_enc = global_scale(amax)
    ba = nan_max_abs(values) if block_amax is None else block_amax
    with np.errstate(all="ignore"):
        sb_code = fp8_rne(min(float(np.float32(ba) * (s_enc * np.float32(1.0 / 6.0))), FLT_MAX), "E4M3")
        s_dec = np.float32(1.0) / s_enc
        mult = min(float(np.float32(1.0) / (np.float32(fp8_value(sb_code, "E4M3")) * s_dec)), FLT_MAX)
        codes = [e2m1_rne(float(np.float32(v) * np.float32(mult))) for v in values]
    return sb_code, codes


def nvfp4_rows_oracle(rows: torch.Tensor, amax: float, block_amax=None):
    """(E2M1 codes [R, C], scale codes [R, C/16]) of fp32 rows with 1x16 blocks."""
    xs = rows.tolist()
    codes, scales = [], []
    for i, row in enumerate(xs):
        crow, srow = [], []
        for b in range(len(row) // 16):
            ba = None if block_amax is None else block_amax[i][b]
            s, c = nvfp4_block(row[16 * b : 16 * b + 16], amax, ba)
            srow.append(s)
            crow.extend(c)
        codes.append(crow)
        scales.append(srow)
    return torch.tensor(codes, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Low nibble = even element, high nibble = odd element (independent of tedebug's unpack_fp4)."""
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8)
    out[..., 0::2] = packed % 16
    out[..., 1::2] = packed // 16
    return out


def dequant_oracle(codes: torch.Tensor, scales: torch.Tensor, amax: float) -> torch.Tensor:
    """TE's dequantize kernel in numpy float32: q * ((s_b * amax) * fp32(1/2688))."""
    out = []
    for crow, srow in zip(codes.tolist(), scales.tolist()):
        row = []
        for j, c in enumerate(crow):
            with np.errstate(all="ignore"):
                f = (np.float32(fp8_value(srow[j // 16], "E4M3")) * np.float32(amax)) * np.float32(1.0 / 2688.0)
                row.append(float(np.float32(e2m1_value(c)) * f))
        out.append(row)
    return torch.tensor(out, dtype=torch.float32)


def hadamard_closed_form(n: int = 16) -> torch.Tensor:
    return torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=torch.float64)


def rht_oracle(rows: torch.Tensor) -> torch.Tensor:
    """Rows of 16 right-multiplied by diag(signs) H / 4 in float64."""
    m = torch.tensor(RHT_SIGNS, dtype=torch.float64).unsqueeze(1) * hadamard_closed_form() / 4
    r, c = rows.shape
    return (rows.double().reshape(r, c // 16, 16) @ m).reshape(r, c)


def amax_of(x: torch.Tensor) -> float:
    return nan_max_abs(x.flatten().tolist())


# ================================================================================================ hand vectors
def _vector_tensor() -> torch.Tensor:
    x = torch.zeros(16, 32)
    x[0, :5] = torch.tensor([6.0, 5.0, 2.9, -0.3, 0.0])
    x[1, 0] = 2688.0
    x[2, :2] = torch.tensor([1.0, 6.0])
    return x


def test_vector_global_2688():
    q = NVFP4Quantizer()(_vector_tensor())
    assert q.amax_rowwise.item() == 2688.0 and q.amax_columnwise.item() == 2688.0
    assert q.rowwise_scale_inv[0, 0].item() == 0x38
    assert unpack(q.rowwise_data)[0, :5].tolist() == [0x7, 0x6, 0x5, 0x9, 0x0]
    # packing order on real data: [1.0, 6.0] -> byte 0x72
    assert q.rowwise_data[2, 0].item() == 0x72
    assert q.rowwise_data.shape == (16, 16)


def test_vector_global_1():
    x = torch.zeros(16, 32)
    x[0, :4] = torch.tensor([1.0, 0.5, -0.25, 0.07])
    x[5, 16:19] = torch.tensor([0.1, 0.05, -0.02])
    q = NVFP4Quantizer()(x)
    assert q.rowwise_scale_inv[0, 0].item() == 0x7E
    assert unpack(q.rowwise_data)[0, :4].tolist() == [0x7, 0x5, 0xB, 0x1]
    assert q.rowwise_scale_inv[5, 1].item() == 0x63
    assert unpack(q.rowwise_data)[5, 16:19].tolist() == [0x7, 0x5, 0xA]
    deq = q.dequantize()
    assert round(deq[0, 3].item(), 5) == 0.08333
    assert [round(v, 6) for v in deq[5, 16:19].tolist()] == [0.098214, 0.049107, -0.016369]
    assert deq[5, 16].item() == float(np.float32(6.0) * ((np.float32(44.0) * np.float32(1.0)) * np.float32(1 / 2688)))


def test_vector_amax_zero():
    q = NVFP4Quantizer()(torch.zeros(16, 32))
    assert q.amax_rowwise.item() == 0.0 and q.amax_columnwise.item() == 0.0
    for usage in ("rowwise", "columnwise"):
        assert getattr(q, f"{usage}_data").eq(0).all() and getattr(q, f"{usage}_scale_inv").eq(0).all()
        assert q.nonzero_code_count(usage).item() == 0
        assert q.dequantize(usage=usage).eq(0).all()


def test_multiplier_uses_reciprocal_of_product_not_quotient():
    """TE's per-element multiplier 1/(fp32(S_dec_b) * fp32(1/S_enc)) is the bit-exact rule; S_enc/S_dec_b is one ulp
    larger here (5.9768900871 vs 5.9768896103) and would move each of these values just below a threshold one code
    up."""
    amax, block_amax = 81.76950073242188, 1.039381504058838
    values = [
        0.04182777553796768,
        0.12548331916332245,
        0.209138885140419,
        0.292794406414032,
        0.418277770280838,
        0.585588812828064,
        0.836555540561676,
    ]
    x = torch.zeros(16, 16)
    x[0, 0] = amax
    x[1, 0] = block_amax
    x[1, 1:8] = torch.tensor(values)
    q = NVFP4Quantizer(columnwise=False)(x)
    assert unpack(q.rowwise_data)[1, 1:8].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert unpack(q.rowwise_data)[1, 1:8].tolist() == nvfp4_block([block_amax] + values + [0.0] * 8, amax)[1][1:8]


# ================================================================================================ oracle sweep
def spread(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-6, 7, (m, k // 16), generator=g).float()
    x = torch.randn(m, k, generator=g) * torch.exp2(exponents).repeat_interleave(16, 1)
    x[torch.rand(m, k, generator=g) < 0.05] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_oracle_both_directions(dtype):
    x = spread(32, 64, seed=1).to(dtype)
    q = NVFP4Quantizer()(x)
    xf = x.float()
    amax = amax_of(xf)
    codes, scales = nvfp4_rows_oracle(xf, amax)
    assert torch.equal(unpack(q.rowwise_data), codes) and torch.equal(q.rowwise_scale_inv, scales)
    assert torch.equal(q.dequantize(dtype=torch.float32), dequant_oracle(codes, scales, amax))
    ccodes, cscales = nvfp4_rows_oracle(xf.t(), amax)
    assert q.columnwise_data.shape == (64, 16) and q.columnwise_scale_inv.shape == (64, 2)
    assert torch.equal(unpack(q.columnwise_data), ccodes) and torch.equal(q.columnwise_scale_inv, cscales)
    assert torch.equal(q.dequantize(usage="columnwise", dtype=torch.float32), dequant_oracle(ccodes, cscales, amax).t())
    assert q.dequantize().dtype == dtype


def test_round_trip_error_bound():
    """|x - deq| <= d_b (the largest half spacing of E2M1 is 1, at 4..6; clamping overshoot is < 0.5)."""
    x = spread(64, 64, seed=2).double()
    q = NVFP4Quantizer()(x.float())
    for usage, xs in (("rowwise", x), ("columnwise", x.t())):
        sb = q.scale_inv_values(usage).double().reshape(xs.shape[0], -1).repeat_interleave(16, 1)
        d_b = sb * getattr(q, f"amax_{usage}").double() / 2688
        deq = q.dequantize(usage=usage).double()
        deq = deq if usage == "rowwise" else deq.t()
        assert bool(((deq - xs).abs() <= d_b * (1 + 1e-6)).all())


def test_specials_nan_inf_zero_subnormal_and_huge():
    x = torch.zeros(16, 32)
    x[0, :4] = torch.tensor([math.nan, 1.0, -0.0, -2.0])
    x[1, :3] = torch.tensor([1e-40, -2e-41, 1e-39])  # fp32 subnormals
    x[2, :2] = torch.tensor([3e38, -1e30])  # huge values (no clipping under the global scale)
    q = NVFP4Quantizer()(x)
    amax = amax_of(x)
    assert amax == float(np.float32(3e38)) and q.amax_rowwise.item() == amax
    codes, scales = nvfp4_rows_oracle(x, amax)
    assert torch.equal(unpack(q.rowwise_data), codes) and torch.equal(q.rowwise_scale_inv, scales)
    assert codes[0, 0].item() == 7 and codes[0, 2].item() == 8  # NaN -> +6, -0 -> code 8
    assert unpack(q.rowwise_data)[2, 0].item() == 7
    assert q.nonzero_code_count("rowwise").item() == int((unpack(q.rowwise_data) % 8 != 0).sum())

    inf = torch.zeros(16, 16)
    inf[0, :3] = torch.tensor([math.inf, 448.0, 1.0])
    qi = NVFP4Quantizer(columnwise=False)(inf)
    assert math.isinf(qi.amax_rowwise.item())
    assert qi.rowwise_scale_inv[0, 0].item() == 0x7E  # S_enc falls back to 1; Inf * 1/6 saturates to 448
    assert unpack(qi.rowwise_data)[0, :3].tolist() == [0x7, 0x2, 0x0]  # Inf -> 6, 448/448 -> 1, 1/448 -> 0
    assert not torch.isfinite(qi.dequantize()).any()  # TE's decode multiplies by amax = Inf


def test_subnormal_e4m3_block_scale():
    x = torch.zeros(16, 32)
    x[0, 0] = 2688.0
    x[1, :2] = torch.tensor([0.03, -0.01])  # S_enc = 1: block scale 0.03 / 6 = 0.005 -> E4M3 subnormal
    q = NVFP4Quantizer()(x)
    codes, scales = nvfp4_rows_oracle(x, 2688.0)
    assert scales[1, 0].item() == 0x03  # 0.005 -> 3 * 2^-9
    assert torch.equal(q.rowwise_scale_inv, scales) and torch.equal(unpack(q.rowwise_data), codes)


# ================================================================================================ 2D
def test_2d_rowwise_equals_columnwise():
    x = spread(48, 64, seed=4)
    q = NVFP4Quantizer(with_2d_quantization=True)(x)
    assert torch.equal(q.dequantize(usage="rowwise"), q.dequantize(usage="columnwise"))
    assert torch.equal(unpack(q.columnwise_data), unpack(q.rowwise_data).t())
    tiles = x.abs().reshape(3, 16, 4, 16).amax(dim=(1, 3))
    expected_scales = [
        [fp8_rne(float(np.float32(t) * (global_scale(amax_of(x)) * np.float32(1 / 6))), "E4M3") for t in row]
        for row in tiles.tolist()
    ]
    assert torch.equal(q.rowwise_scale_inv, torch.tensor(expected_scales, dtype=torch.uint8).repeat_interleave(16, 0))
    block_amax = tiles.repeat_interleave(16, 0).tolist()
    codes, _ = nvfp4_rows_oracle(x, amax_of(x), block_amax)
    assert torch.equal(unpack(q.rowwise_data), codes)
    # 1D quantization of the same tensor differs
    assert not torch.equal(NVFP4Quantizer()(x).dequantize(), q.dequantize())


# ================================================================================================ RHT
def test_rht_matrix_is_signed_hadamard_and_orthogonal():
    m = rht_matrix()
    expected = torch.tensor(RHT_SIGNS, dtype=torch.float64).unsqueeze(1) * hadamard_closed_form() / 4
    assert torch.equal(m, expected)
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))
    assert RHT_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rht_columnwise_matches_oracle_and_inverts(dtype):
    x = spread(32, 48, seed=6).to(dtype)
    q = NVFP4Quantizer(with_rht=True)(x)
    rotated = rht_oracle(x.t()).float().to(dtype).float()
    amax = amax_of(rotated)
    assert q.amax_columnwise.item() == amax and q.amax_rowwise.item() == amax_of(x.float())
    codes, scales = nvfp4_rows_oracle(rotated, amax)
    assert torch.equal(unpack(q.columnwise_data), codes) and torch.equal(q.columnwise_scale_inv, scales)
    # rowwise is not rotated
    plain = NVFP4Quantizer(columnwise=False)(x)
    assert torch.equal(q.rowwise_data, plain.rowwise_data)
    # dequantize undoes the rotation: error in each run of 16 is bounded by the L2 norm of the rotated error
    deq = q.dequantize(usage="columnwise", dtype=torch.float32).double().t()  # [K, M]
    sb = q.scale_inv_values("columnwise").double().reshape(48, 2).repeat_interleave(16, 1)
    d_b = sb * amax / 2688
    err = (deq - x.t().double()).reshape(48, 2, 16).pow(2).sum(-1).sqrt()
    bound = d_b.reshape(48, 2, 16).pow(2).sum(-1).sqrt()
    assert bool((err <= bound * (1 + 1e-3) + 1e-6).all())
    # and the inverse really is needed: without it the values are far off
    not_inverted = dequant_oracle(codes, scales, amax).t()
    assert (q.dequantize(usage="columnwise") - x).abs().max() < (not_inverted - x.float()).abs().max()


def test_rht_and_2d_are_exclusive():
    with pytest.raises(ValueError, match="with_2d_quantization"):
        NVFP4Quantizer(with_2d_quantization=True, with_rht=True)


# ================================================================================================ SR
def test_stochastic_round_rule_hand_vectors():
    v = torch.tensor([1.9, 1.9, -0.1, -0.1, math.nan, 5.0, 5.0, 6.0, 0.0])
    bits = torch.tensor([51, 52, 0, 255, 0, 127, 128, 255, 255], dtype=torch.uint8)
    # 1.9 + 51/256*0.5 = 1.9996 -> 1.5; 52 -> 2.0016 -> 2; -0.1: 0 -> -0, 255 -> -0.1+0.498 -> -0.5
    # 5.0 + 127/256*2 = 5.992 -> 4; 128 -> 6.0 -> 6; 6 + anything stays 6; 0 + 255/256*0.5 < 0.5 -> 0
    out = stochastic_round_e2m1(v, bits)
    assert out.tolist()[:4] == [1.5, 2.0, -0.0, -0.5]
    assert math.copysign(1, out[2].item()) == -1
    assert out.tolist()[4:] == [6.0, 4.0, 6.0, 6.0, 0.0]


def _sr_tensor(values, reps: int) -> torch.Tensor:
    """Blocks [6, v x15] (block scale 1, multiplier 1 under global amax 2688) repeated `reps` times per value."""
    rows = [[2688.0] + [0.0] * 15]
    for v in values:
        rows += [[6.0] + [v] * 15] * reps
    rows += [[0.0] * 16] * ((-len(rows)) % 16)
    return torch.tensor(rows)


def test_sr_reproducible_and_seed_dependent():
    x = spread(32, 64, seed=7)
    a = NVFP4Quantizer(stochastic_rounding=True, seed=5)(x)
    b = NVFP4Quantizer(stochastic_rounding=True, seed=5)(x)
    c = NVFP4Quantizer(stochastic_rounding=True, seed=6)(x)
    for usage in ("rowwise", "columnwise"):
        assert torch.equal(getattr(a, f"{usage}_data"), getattr(b, f"{usage}_data"))
        assert not torch.equal(getattr(a, f"{usage}_data"), getattr(c, f"{usage}_data"))
        assert torch.equal(getattr(a, f"{usage}_scale_inv"), getattr(c, f"{usage}_scale_inv"))
    # each SR code is one of the two grid neighbours of the scaled value (RNE code or the other side)
    rne = unpack(NVFP4Quantizer()(x).rowwise_data)
    sr = unpack(a.rowwise_data)
    diff = (
        torch.tensor([e2m1_value(c) for c in sr.flatten().tolist()])
        - torch.tensor([e2m1_value(c) for c in rne.flatten().tolist()])
    ).abs()
    assert diff.max().item() <= 2.0 and (diff > 0).any()


def test_sr_matches_oracle_with_philox_bits():
    x = _sr_tensor([0.3, 1.7, -2.2, 4.9], reps=4)
    quant = NVFP4Quantizer(stochastic_rounding=True, seed=9, columnwise=False)
    q = quant(x)
    bits = philox_bytes(9, 0, x.numel()).view(x.shape)  # draw 0 of seed 9 (checked against Random123 elsewhere)

    def sr_exact(t: float, b: int) -> float:
        a = abs(t)
        lower = max(g for g in E2M1_GRID if g <= a)
        if lower == 6.0:
            return math.copysign(6.0, t)
        upper = min(g for g in E2M1_GRID if g > a)
        return math.copysign(upper if b / 256.0 * (upper - lower) >= upper - a else lower, t)

    expected = [
        [e2m1_rne(sr_exact(float(np.float32(v)), b)) for v, b in zip(row, brow)]
        for row, brow in zip(x[1:17].tolist(), bits[1:17].tolist())
    ]
    assert unpack(q.rowwise_data)[1:17].tolist() == expected


@pytest.mark.parametrize("v", [0.3, 1.7, -2.2, 4.9, 0.6])
def test_sr_is_unbiased(v):
    """mean of N SR results -> v: |mean - v| <= step/256 (8-bit probability quantisation) + 5 sigma/sqrt(N)."""
    reps = 256
    x = _sr_tensor([v], reps=reps)
    q = NVFP4Quantizer(stochastic_rounding=True, seed=1234, columnwise=False)(x)
    samples = [e2m1_value(c) for c in unpack(q.rowwise_data)[1 : 1 + reps, 1:].flatten().tolist()]
    n = len(samples)
    a = abs(float(np.float32(v)))
    lower = max(g for g in E2M1_GRID if g <= a)
    upper = min(g for g in E2M1_GRID if g > a)
    step = upper - lower
    p = (a - lower) / step
    sigma = step * math.sqrt(p * (1 - p))
    tol = step / 256 + 5 * sigma / math.sqrt(n)
    mean = sum(samples) / n
    assert abs(mean - float(np.float32(v))) <= tol
    assert set(abs(s) for s in samples) == {lower, upper}
    # the tolerance is tight enough to reject round-to-nearest (which is biased for these values)
    rne = e2m1_value(e2m1_rne(float(np.float32(v))))
    assert abs(rne - float(np.float32(v))) > tol


def test_sr_state_advances_between_calls():
    x = spread(16, 64, seed=8)
    quant = NVFP4Quantizer(stochastic_rounding=True, seed=3, columnwise=False)
    assert not torch.equal(quant(x).rowwise_data, quant(x).rowwise_data)


# ================================================================================================ API
@pytest.mark.parametrize(
    "shape, kwargs",
    [((64,), {}), ((16, 40), {}), ((10, 32), {}), ((10, 32), {"with_2d_quantization": True, "columnwise": False})],
    ids=["1d", "k40", "m10-columnwise", "m10-2d"],
)
def test_shape_errors(shape, kwargs):
    with pytest.raises(ValueError, match=r"shape \(" + ", ".join(str(s) for s in shape)):
        NVFP4Quantizer(**kwargs)(torch.zeros(shape))


def test_rowwise_only_allows_any_row_count():
    x = torch.randn(10, 32)
    q = NVFP4Quantizer(columnwise=False)(x)
    assert q.rowwise_data.shape == (10, 16) and q.rowwise_scale_inv.shape == (10, 2)
    assert not q.has_columnwise
    with pytest.raises(RuntimeError, match="columnwise"):
        q.dequantize(usage="columnwise")


def test_3d_input_layouts_and_dtype():
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    q = NVFP4Quantizer()(x)
    assert isinstance(q, NVFP4Tensor) and NVFP4Quantizer.recipe_name == "nvfp4"
    assert q.rowwise_data.shape == (2, 8, 16) and q.rowwise_scale_inv.shape == (16, 2)
    assert q.columnwise_data.shape == (32, 8) and q.columnwise_scale_inv.shape == (32, 1)
    assert q.dequantize().shape == x.shape and q.dequantize().dtype == torch.bfloat16
    flat = NVFP4Quantizer()(x.reshape(16, 32))
    assert torch.equal(flat.columnwise_data, q.columnwise_data)
    assert torch.equal(flat.dequantize(usage="columnwise"), q.dequantize(usage="columnwise").reshape(16, 32))


def test_statistics_helpers():
    x = torch.zeros(16, 32)
    x[0, :3] = torch.tensor([6.0, 1e-6, -3.0])  # S_enc = 1, block scale 1: 1e-6 rounds to 0
    x[1, 0] = 2688.0
    q = NVFP4Quantizer()(x)
    assert q.nonzero_code_count("rowwise").item() == 3
    vals = q.scale_inv_values("rowwise")
    assert vals.dtype == torch.float32 and vals.shape == (32,)
    assert vals[0].item() == 1.0 and vals[2].item() == 448.0 and vals[1].item() == 0.0
    assert q.scale_inv_values("columnwise").shape == (32,)
    with pytest.raises(ValueError, match="usage"):
        q.nonzero_code_count("rows")


def test_usage_save_restore_update_in_place():
    x = torch.randn(32, 32)
    q = NVFP4Quantizer()(x)
    before = (q.dequantize(usage="rowwise"), q.dequantize(usage="columnwise"))
    tensors, _ = q.prepare_for_saving()
    assert len(tensors) == 6 and q.amax_rowwise is None and not q.has_columnwise
    assert q.restore_from_saved(tensors) == []
    assert torch.equal(q.dequantize(usage="rowwise"), before[0])
    assert torch.equal(q.dequantize(usage="columnwise"), before[1])
    q.update_usage(columnwise_usage=False)
    assert not q.has_columnwise and q.amax_columnwise is None and q.has_rowwise

    quant = NVFP4Quantizer(with_rht=True)
    out = quant.make_empty((32, 32), dtype=torch.bfloat16)
    assert out.rowwise_data.shape == (32, 16) and out.columnwise_data.shape == (32, 16)
    ptr = out.columnwise_data.data_ptr()
    y = torch.randn(32, 32)
    assert quant.quantize(y, out=out) is out and out.columnwise_data.data_ptr() == ptr
    fresh = NVFP4Quantizer(with_rht=True)(y)
    assert torch.equal(out.columnwise_data, fresh.columnwise_data) and out.columnwise_rht
    assert torch.equal(out.amax_columnwise, fresh.amax_columnwise)
    with pytest.raises(TypeError, match="float64"):
        quant(torch.zeros(32, 32, dtype=torch.float64))


def test_underflows_of_an_rht_columnwise_representation_count_in_the_rotated_domain():
    """Underflows compare codes with the values they encode: for RHT columnwise data those are the rotated rows, so
    the count is never negative on a sparse input (it was -46.9 % when compared with the un-rotated input)."""
    from tedebug.backends import torch_ref
    from tedebug.quantization.nvfp4 import apply_rht

    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    x[torch.arange(32), torch.arange(32)] = torch.linspace(0.01, 4.0, 32).to(torch.bfloat16)
    q = NVFP4Quantizer(with_rht=True).quantize(x)
    rotated = apply_rht(x.t(), out_dtype=torch.bfloat16)
    assert torch.equal(q.code_domain(x, "columnwise"), rotated)
    assert torch.equal(q.code_domain(x, "rowwise"), x)
    got = torch_ref.underflow_partials(x, q, "columnwise")["underflows_num"].item()
    expected = int(torch.count_nonzero(rotated)) - int(q.nonzero_code_count("columnwise"))
    assert got == expected >= 0
    assert int(torch.count_nonzero(rotated)) > int(torch.count_nonzero(x))  # the case that used to go negative


def test_tiny_global_amax_clamps_the_global_scale_to_flt_max():
    """amax below 2688/FLT_MAX: S_enc = 2688/amax overflows and is clamped to FLT_MAX (not inf), which decides the
    block scale codes (3 here; an unclamped inf scale gives 126)."""
    from tedebug.quantization.nvfp4 import global_encode_scale

    x = torch.full((16, 32), 1e-40)
    amax = x.abs().max().item()
    assert global_encode_scale(torch.tensor(amax)).item() == FLT_MAX
    q = NVFP4Quantizer(rowwise=True, columnwise=False).quantize(x)
    codes, scales = nvfp4_rows_oracle(x, amax)
    assert torch.equal(q.rowwise_scale_inv, scales) and bool((scales == 3).all())
    assert torch.equal(unpack(q.rowwise_data), codes)
