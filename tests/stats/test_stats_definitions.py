"""Statistic definitions: StatRequest parsing, dependency closure, exact combiners, final formulas, and the
reference partials of tedebug.backends.torch_ref (hand-derived vectors and TransformerEngine's direct oracles)."""

import math
import random

import pytest
import torch

from tedebug.backends import torch_ref
from tedebug.quantization.tensor import QuantizedTensor
from tedebug.stats.definitions import (
    HP_KINDS,
    NUMEL,
    Column,
    StatRequest,
    blockwise_stat_name,
    columns_for,
    combine_row_batches,
    combine_rows,
    finalize,
)


# ------------------------------------------------------------------------------------------------ StatRequest
@pytest.mark.parametrize("name", HP_KINDS)
def test_parse_hp_plain_names(name):
    req = StatRequest.parse_hp(name)
    assert (req.name, req.kind, req.recipe, req.columnwise, req.params) == (name, name, "", False, ())


def test_parse_hp_blockwise_mapping_and_orientation():
    entry = {"max_blockwise_dynamic_range": {"block_size": 4, "dims": 2}}
    act = StatRequest.parse_hp(entry, tensor_name="activation")
    grad = StatRequest.parse_hp(entry, tensor_name="gradient")
    assert act.name == "max_blockwise_dynamic_range_block_size_4_dims_2_max_over_orientations"
    assert act.params == (4, 2, True)
    assert grad.name == "max_blockwise_dynamic_range_block_size_4_dims_2"
    assert grad.params == (4, 2, False)
    assert StatRequest.parse_hp(entry, tensor_name="weight").params == (4, 2, True)
    default = StatRequest.parse_hp({"max_blockwise_dynamic_range": {}})
    assert default.params == (32, 1, False) and default.name == "max_blockwise_dynamic_range_block_size_32_dims_1"
    assert blockwise_stat_name(8, 1, True) == "max_blockwise_dynamic_range_block_size_8_dims_1_max_over_orientations"


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ("median", "Statistic median is not supported"),
        ("max_blockwise_dynamic_range", "mapping form"),
        ({"max_blockwise_dynamic_range": {"block_size": 4, "size": 2}}, "unknown key(s) ['size']"),
        ({"max_blockwise_dynamic_range": {"dims": 3}}, "dims must be 1 or 2"),
        ({"max_blockwise_dynamic_range": {"block_size": 0}}, "block_size must be an int > 0"),
        ({"max_blockwise_dynamic_range": {"block_size": True}}, "block_size must be an int > 0"),
        ({"max_blockwise_dynamic_range": {"block_size": 4.0}}, "block_size must be an int > 0"),
        ({"max_blockwise_dynamic_range": 4}, "expected a mapping"),
        ({"min": {}}, "single key"),
        (3, "must be a string or a mapping"),
    ],
)
def test_parse_hp_errors(entry, fragment):
    with pytest.raises(ValueError) as info:
        StatRequest.parse_hp(entry)
    assert fragment in str(info.value)


def test_stat_request_validation():
    with pytest.raises(ValueError, match="unknown kind"):
        StatRequest("x", "median")
    with pytest.raises(ValueError, match="takes no recipe"):
        StatRequest("min", "min", recipe="mxfp8")
    with pytest.raises(ValueError, match="quantized statistics take no params"):
        StatRequest("mse", "mse", params=(1,))
    with pytest.raises(ValueError, match="takes no params"):
        StatRequest("min", "min", params=(1,))
    req = StatRequest("mxfp8_mse_columnwise", "mse", recipe="mxfp8", columnwise=True)
    assert req.usage == "columnwise" and req.needs_tensor
    assert not StatRequest("scale_inv_min", "scale_inv_min").needs_tensor


# ------------------------------------------------------------------------------------------------ closure
def test_columns_closure_is_canonical_and_minimal():
    std = StatRequest.parse_hp("std")
    sstd = StatRequest("mxfp8_scale_inv_std", "scale_inv_std", recipe="mxfp8")
    cols = columns_for([sstd, std])
    assert cols == columns_for([std, sstd])
    q = ("mxfp8", False)
    assert cols == (
        NUMEL,
        Column("sum"),
        Column("m2"),
        Column("nan_count"),
        Column("inf_count"),
        Column("scale_count", q),
        Column("scale_sum", q),
        Column("scale_m2", q),
    )
    # quantized-only requests do not pull in basic partials (no pass over x for nothing)
    assert columns_for([StatRequest("underflows%", "underflows%")]) == (NUMEL, Column("underflows_num", ("", False)))
    blk = StatRequest.blockwise(4, 1, True)
    assert columns_for([blk]) == (NUMEL, Column("block_dr", (4, 1, True)))


# ------------------------------------------------------------------------------------------------ combiners
def _row(values):
    """Partials of a python list through the pure-python definitions (independent oracle)."""
    n = len(values)
    s = sum(values)
    m = s / n
    return [float(n), s, sum((v - m) ** 2 for v in values), min(values), max(values)]


COLS = (NUMEL, Column("sum"), Column("m2"), Column("min"), Column("max"))


def test_combine_rows_hand_vectors():
    # [1, 1] and [3, 3]: pooled M2 = 0 + 0 + 2*(1-2)^2 + 2*(3-2)^2 = 4 (= M2 of [1, 1, 3, 3])
    rows = torch.tensor([_row([1.0, 1.0]), _row([3.0, 3.0])], dtype=torch.float64)
    assert combine_rows(COLS, rows).tolist() == [4.0, 8.0, 4.0, 1.0, 3.0]


def test_combine_rows_matches_decisions_formula():
    rng = random.Random(5)
    groups = [[rng.gauss(3.0, 2.0) for _ in range(rng.randint(2, 9))] for _ in range(5)]
    merged = combine_rows(COLS, torch.tensor([_row(g) for g in groups], dtype=torch.float64)).tolist()
    n_tot = sum(len(g) for g in groups)
    mean = sum(map(sum, groups)) / n_tot

    # the exact pooled variance (Chan et al.): (Σ (n_i − 1)·var_i + Σ n_i·(m_i − m)²) / (N − 1)
    def var(g):
        return sum((v - sum(g) / len(g)) ** 2 for v in g) / (len(g) - 1)

    pooled = sum((len(g) - 1) * var(g) + len(g) * (sum(g) / len(g) - mean) ** 2 for g in groups) / (n_tot - 1)
    flat = [v for g in groups for v in g]
    assert merged[2] / (n_tot - 1) == pytest.approx(pooled, rel=1e-13)
    assert merged[2] / (n_tot - 1) == pytest.approx(torch.tensor(flat, dtype=torch.float64).var().item(), rel=1e-13)
    assert merged[3] == min(flat) and merged[4] == max(flat)


def test_combine_rows_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"expected a \[K, 5\] matrix"):
        combine_rows(COLS, torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected a \[B, K, 5\] tensor"):
        combine_row_batches(COLS, torch.zeros(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("k", list(range(1, 17)))
def test_combine_row_batches_is_combine_rows_of_each_batch_bit_for_bit(k, device):
    """The batched merge of the multi-rank read-back gives every buffer the bits `combine_rows` gives it, for 1 to 16
    rows (torch reduces a strided column of 5 or more float64 values with several accumulators, not in order; a
    sum taken in order would differ in the last bits there), with NaN, infinities and buffers of no element; on the
    CPU and on a CUDA device (marked gpu: skipped without CUDA and CuPy)."""
    columns = columns_for([StatRequest.parse_hp(name) for name in HP_KINDS])
    g = torch.Generator().manual_seed(k)
    scales = torch.logspace(-6, 6, len(columns), dtype=torch.float64)
    rows = torch.randn(6, k, len(columns), generator=g, dtype=torch.float64) * scales
    rows[:, :, 0] = torch.randint(0, 1000, (6, k), generator=g).double()  # numel
    rows[1, :, 0] = 0.0  # no element on any rank
    rows[2, 0, 3] = math.nan
    rows[3, -1, 2] = math.inf
    rows = rows.to(device)
    got = combine_row_batches(columns, rows)
    want = torch.stack([combine_rows(columns, rows[b]) for b in range(rows.shape[0])])
    assert got.shape == want.shape and got.device == want.device == rows.device
    assert bool(((got == want) | (got.isnan() & want.isnan())).all())


# ------------------------------------------------------------------------------------------------ final values
def test_finalize_edge_cases():
    dr = StatRequest.parse_hp("dynamic_range")
    vals = {NUMEL: 4.0, Column("nz_abs_min"): math.inf, Column("nz_abs_max"): 0.0}
    assert finalize(dr, vals) == math.inf  # no non-zero element: TE's top=+inf, bottom=0
    vals = {NUMEL: 4.0, Column("nz_abs_min"): 0.25, Column("nz_abs_max"): 8.0}
    assert finalize(dr, vals) == 5.0
    std = StatRequest.parse_hp("std")
    assert math.isnan(finalize(std, {NUMEL: 1.0, Column("sum"): 3.0, Column("m2"): 0.0}))
    assert finalize(std, {NUMEL: 3.0, Column("sum"): 3.0, Column("m2"): 8.0}) == 2.0
    q = ("", False)
    smin = StatRequest("scale_inv_min", "scale_inv_min")
    assert finalize(smin, {NUMEL: 4.0, Column("scale_nz_min", q): math.inf}) == 0.0
    sstd = StatRequest("scale_inv_std", "scale_inv_std")
    vals = {NUMEL: 4.0, Column("scale_count", q): 4.0, Column("scale_sum", q): 8.0, Column("scale_m2", q): 16.0}
    assert finalize(sstd, vals) == 2.0  # population std
    uf = StatRequest("underflows%", "underflows%")
    assert finalize(uf, {NUMEL: 8.0, Column("underflows_num", q): 2.0}) == 25.0


# ------------------------------------------------------------------------------------------------ torch_ref
def test_basic_partials_hand_vector():
    x = torch.tensor([-2.0, 0.0, 0.5, 4.0, -0.0])
    p = {k: v.item() for k, v in torch_ref.basic_partials(x).items()}
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in torch_ref.basic_partials(x).values())
    # mean 0.5; deviations -2.5, -0.5, 0, 3.5, -0.5
    assert p == {
        "min": -2.0,
        "max": 4.0,
        "sum": 2.5,
        "m2": 19.0,
        "abs_sum": 6.5,
        "sq_sum": 20.25,
        "amax": 4.0,
        "nz_abs_min": 0.5,
        "nz_abs_max": 4.0,
        "nonzero_count": 3.0,
        "nan_count": 0.0,
        "inf_count": 0.0,
    }


def test_basic_partials_nonfinite_counts():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), float("nan"), 0.0], dtype=torch.bfloat16)
    p = torch_ref.basic_partials(x)
    assert p["nan_count"].item() == 2.0 and p["inf_count"].item() == 2.0
    assert p["nonzero_count"].item() == 5.0


def test_basic_partials_all_zero():
    p = torch_ref.basic_partials(torch.zeros(3, 4, dtype=torch.float16))
    assert p["nz_abs_min"].item() == math.inf and p["nz_abs_max"].item() == 0.0


def _blockwise(t, b, d, orient):
    return torch_ref.blockwise_dynamic_range_partials(t, b, d, orient)["block_dr"].item()


def _te_direct_tensor(eps):
    t = torch.zeros(1024, 1024) + eps
    t[0, :] = 1000.0
    t[1:4, :] = 50.0
    return t


def test_blockwise_te_direct_checks():
    """Port of TE's test_compute_max_blockwise_dynamic_range_direct (six checks)."""
    eps = 0.01
    t = _te_direct_tensor(eps)
    a, b_, e = math.log2(1000.0), math.log2(50.0), math.log2(torch.tensor(eps).item())
    assert _blockwise(t, 4, 1, False) == 0.0  # rowwise blocks are uniform
    assert _blockwise(t, 4, 1, True) == pytest.approx(a - b_, abs=1e-12)  # columns [A, B, B, B]
    assert _blockwise(t, 4, 2, False) == pytest.approx(a - b_, abs=1e-12)  # 4x4 tiles span rows 0..3
    assert _blockwise(t, 8, 1, True) == pytest.approx(a - e, abs=1e-12)  # [A, B, B, B, eps x4]
    assert _blockwise(torch.full((64, 64), 42.0), 4, 1, True) == 0.0
    t2 = torch.tensor(
        [[1.0, 1.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0], [100.0, 100.0, 1000.0, 1000.0], [100.0, 100.0, 1000.0, 1000.0]]
    )
    assert _blockwise(t2, 2, 2, False) == 0.0  # every 2x2 tile is uniform
    assert _blockwise(t2.reshape(2, 2, 4), 2, 2, False) == _blockwise(t2, 2, 2, False)
    assert _blockwise(t2, 4, 2, False) == pytest.approx(math.log2(1000.0), abs=1e-12)


def _blockwise_oracle(rows, b, d, orient):
    """Pure-python oracle on a list-of-lists 2-D tensor."""

    def block_value(vals):
        mags = [abs(v) for v in vals]
        nz = [m for m in mags if m != 0]
        return math.log2(max(mags)) - math.log2(min(nz)) if nz else 0.0

    def one(r):
        n_r, n_c = len(r), len(r[0])
        if d == 1:
            flat = [v for row in r for v in row]
            return max(block_value(flat[i : i + b]) for i in range(0, len(flat), b))
        return max(
            block_value([r[i + di][j + dj] for di in range(b) for dj in range(b)])
            for i in range(0, n_r, b)
            for j in range(0, n_c, b)
        )

    value = one(rows)
    if orient:
        value = max(value, one([list(col) for col in zip(*rows)]))
    return value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, d, orient", [(4, 1, False), (4, 1, True), (2, 2, False), (4, 2, True), (8, 1, True)])
def test_blockwise_random_vs_python_oracle(dtype, b, d, orient):
    g = torch.Generator().manual_seed(11)
    t = (torch.randn(16, 8, generator=g) * torch.logspace(-3, 3, 8)).to(dtype)
    t[t.abs() < 0.05] = 0  # some zeros, and a whole zero block
    t[0:4, 0:4] = 0
    rows = t.double().tolist()
    assert _blockwise(t, b, d, orient) == pytest.approx(_blockwise_oracle(rows, b, d, orient), abs=1e-12)


def test_blockwise_shape_errors():
    with pytest.raises(ValueError, match="not divisible by block_size 4"):
        _blockwise(torch.ones(3, 5), 4, 1, False)
    with pytest.raises(ValueError, match="dims=2 needs both dims"):
        _blockwise(torch.ones(8, 6), 4, 2, False)


# ------------------------------------------------------------------------------------------------ quantized
class _HandQuantized(QuantizedTensor):
    """Test-only quantized tensor with given dequantized values, zero-code mask and scales per usage."""

    def __init__(self, deq, codes_nonzero, scales, fp8_format=None):
        super().__init__(deq["rowwise"].shape, torch.float32, "cpu", None)
        self.deq, self.codes_nonzero, self.scales = deq, codes_nonzero, scales
        if fp8_format:
            self.fp8_format = fp8_format

    has_rowwise = property(lambda self: True)
    has_columnwise = property(lambda self: True)

    def _dequantize(self, usage):
        return self.deq[usage]

    def nonzero_code_count(self, usage):
        return torch.tensor(self.codes_nonzero[usage], dtype=torch.int64)

    def scale_inv_values(self, usage):
        return torch.tensor(self.scales[usage], dtype=torch.float32)

    def _drop(self, usage):
        raise NotImplementedError

    def _tensor_fields(self):
        return ()


def test_quantized_partials_hand_values():
    x = torch.tensor([[1.0, -0.001, 0.0, 500.0]])
    q = _HandQuantized(
        {"rowwise": torch.tensor([[1.0, 0.0, 0.0, 448.0]]), "columnwise": torch.tensor([[1.0, -0.002, 0.0, 448.0]])},
        {"rowwise": 2, "columnwise": 3},
        {"rowwise": [0.5], "columnwise": [0.0, 0.25, 2.0, 0.25]},
        fp8_format="E4M3",
    )
    assert torch_ref.underflow_partials(x, q, "rowwise")["underflows_num"].item() == 1.0
    assert torch_ref.underflow_partials(x, q, "columnwise")["underflows_num"].item() == 0.0
    sq = torch_ref.mse_partials(x, q, "rowwise")["sq_err"].item()
    assert sq == pytest.approx(torch.tensor(-0.001).double().item() ** 2 + 52.0**2, rel=1e-15)
    sq_col = torch_ref.mse_partials(x, q, "columnwise")["sq_err"].item()
    assert sq_col == pytest.approx(
        (torch.tensor(-0.001).double().item() - torch.tensor(-0.002).double().item()) ** 2 + 52.0**2, rel=1e-15
    )
    # threshold 448 * 0.5 = 224: only 500 overflows
    assert torch_ref.overflow_partials(x, q, "rowwise")["overflows_num"].item() == 1.0
    # mean 0.625; deviations -0.625, -0.375, 1.375, -0.375 -> M2 = 0.390625 + 0.140625 + 1.890625 + 0.140625
    s = {k: v.item() for k, v in torch_ref.scale_inv_partials(q, "columnwise").items()}
    assert s == {"scale_count": 4.0, "scale_sum": 2.5, "scale_m2": 2.5625, "scale_nz_min": 0.25, "scale_max": 2.0}
    with pytest.raises(ValueError, match="per-tensor FP8"):
        torch_ref.overflow_partials(x, q, "columnwise")
    with pytest.raises(ValueError, match="does not match the tensor shape"):
        torch_ref.mse_partials(torch.zeros(2, 2), q, "rowwise")
