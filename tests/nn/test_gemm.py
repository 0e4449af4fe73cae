"""tedebug.nn.gemm: layouts, operand selection and unwrapping, emulation accuracy, native FP8 (CUDA only)."""

import pytest
import torch

from tedebug.nn.gemm import gemm, gemm_operand
from tedebug.quantization import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

EPS32 = 2.0**-24


def _ref64(a, b, layout):
    """out = op_B(B) · op_A(A) in float64 (A, B plain 2-D tensors)."""
    a, b = a.double(), b.double()
    op_a = a.t() if layout[0] == "T" else a
    op_b = b if layout[1] == "N" else b.t()
    return torch.einsum("mk,kn->mn", op_b, op_a)


def _assert_fp32_bound(out, a, b, layout):
    """|out - exact| <= (K + 2)·2^-24 · (|op_B|·|op_A|): the fp32 accumulation error bound plus the final rounding."""
    ref = _ref64(a, b, layout)
    k = a.shape[-1] if layout[0] == "T" else a.shape[0]
    bound = (k + 2) * EPS32 * _ref64(a.abs(), b.abs(), layout)
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def _operands(layout, m=32, n=64, k=96, seed=0):
    """A and B plain fp32 tensors with the shapes `layout` expects for an [m, n] output reducing over k."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((n, k) if layout[0] == "T" else (k, n), generator=g)
    b = torch.randn((m, k) if layout[1] == "N" else (k, m), generator=g)
    return a, b


# ------------------------------------------------------------------------------------------------ plain tensors
@pytest.mark.parametrize("layout", ["TN", "NN", "NT", "TT"])
def test_plain_layouts_match_float64(layout):
    a, b = _operands(layout)
    out = gemm(a, b, layout=layout, out_dtype=torch.float32)
    assert out.shape == (32, 64)
    _assert_fp32_bound(out, a, b, layout)


def test_plain_linear_layouts_equal_torch_exactly():
    g = torch.Generator().manual_seed(1)
    x, w, dy, bias = (
        torch.randn(16, 48, generator=g),
        torch.randn(24, 48, generator=g),
        torch.randn(16, 24, generator=g),
        torch.randn(24, generator=g),
    )
    assert torch.equal(
        gemm(w, x, layout="TN", out_dtype=torch.float32, bias=bias), torch.nn.functional.linear(x, w, bias)
    )
    assert torch.equal(gemm(w, dy, layout="NN", out_dtype=torch.float32), dy @ w)
    assert torch.equal(gemm(x, dy, layout="NT", out_dtype=torch.float32), dy.t() @ x)


def test_nd_operand_is_flattened():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 3, 32, generator=g), torch.randn(8, 32, generator=g)
    out = gemm(w, x, layout="TN", out_dtype=torch.float32)
    assert out.shape == (6, 8)
    assert torch.equal(out, torch.nn.functional.linear(x.reshape(6, 32), w))


def test_bad_layout_and_shape_errors():
    a, b = _operands("TN")
    with pytest.raises(ValueError, match="layout must be one of"):
        gemm(a, b, layout="XN", out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"GEMM 'fprop' \(layout TN\): reduction sizes differ"):
        gemm(a, b[:, :64], layout="TN", out_dtype=torch.float32, gemm_name="fprop")


# ------------------------------------------------------------------------------------------------ quantized
def _quantizers():
    return {
        "delayed": Float8Quantizer.from_recipe_defaults("E4M3", history_len=4, margin=0, amax_compute_algo="max"),
        "current": Float8CurrentScalingQuantizer("E4M3"),
        "current_e5m2": Float8CurrentScalingQuantizer("E5M2"),
        "mxfp8": MXFP8Quantizer("E4M3"),
        "nvfp4": NVFP4Quantizer(),
        "nvfp4_rht": NVFP4Quantizer(with_rht=True),
        "block1d": Float8BlockQuantizer("E4M3", block_scaling_dim=1),
        "block2d": Float8BlockQuantizer("E4M3", block_scaling_dim=2),
    }


@pytest.mark.parametrize("name", list(_quantizers()))
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_emulated_gemm_equals_float64_of_dequantized(name, layout):
    qa, qb = _quantizers()[name], _quantizers()[name]
    a, b = _operands(layout, m=128, n=128, k=128, seed=3)
    aq, bq = qa.quantize(a), qb.quantize(b)
    a_usage = "rowwise" if layout[0] == "T" else "columnwise"
    b_usage = "columnwise" if layout[1] == "T" else "rowwise"
    a_dq, b_dq = aq.dequantize(usage=a_usage), bq.dequantize(usage=b_usage)
    out = gemm(aq, bq, layout=layout, out_dtype=torch.float32, use_native=False)
    _assert_fp32_bound(out, a_dq, b_dq, layout)
    # the result is the quantized product, not the high-precision one
    assert not torch.allclose(out, _ref64(a, b, layout).float(), rtol=0, atol=1e-3)


def _within_fp32_bound(out, a, b, layout) -> bool:
    k = a.shape[-1] if layout[0] == "T" else a.shape[0]
    bound = (k + 2) * EPS32 * _ref64(a.abs(), b.abs(), layout)
    return bool(((out.double() - _ref64(a, b, layout)).abs() <= bound).all())


def _with_distinct_directions(shape, seed):
    """An NVFP4 (1x16 blocks) tensor of Gaussian values.  Its 1x16 row blocks and 16x1 column blocks get different
    E4M3 scales (not powers of two), so nearly every element decodes differently in the two representations.
    (MXFP8 is unsuitable here: its power-of-two scales give identical values in both directions except for
    subnormals.)"""
    g = torch.Generator().manual_seed(seed)
    q = NVFP4Quantizer().quantize(torch.randn(shape, generator=g))
    row, col = q.dequantize(usage="rowwise"), q.dequantize(usage="columnwise")
    assert (row != col).float().mean() > 0.3
    return q, row, col


@pytest.mark.parametrize("layout", ["TN", "NN", "NT", "TT"])
def test_operand_selection_per_layout(layout):
    a_shape = (64, 96) if layout[0] == "T" else (96, 64)
    b_shape = (32, 96) if layout[1] == "N" else (96, 32)
    aq, a_row, a_col = _with_distinct_directions(a_shape, 4)
    bq, b_row, b_col = _with_distinct_directions(b_shape, 5)
    out = gemm(aq, bq, layout=layout, out_dtype=torch.float32)
    a_used, a_other = (a_row, a_col) if layout[0] == "T" else (a_col, a_row)
    b_used, b_other = (b_col, b_row) if layout[1] == "T" else (b_row, b_col)
    assert _within_fp32_bound(out, a_used, b_used, layout)
    assert not _within_fp32_bound(out, a_other, b_used, layout)
    assert not _within_fp32_bound(out, a_used, b_other, layout)


@pytest.mark.parametrize(
    "layout,operand,usage,role,gemm_name",
    [
        ("NN", "A", "columnwise", "weight", "dgrad"),
        ("TN", "A", "rowwise", "weight", "fprop"),
        ("NT", "B", "columnwise", "gradient", "wgrad"),
        ("NN", "B", "rowwise", "gradient", "dgrad"),
    ],
)
def test_missing_representation_error(layout, operand, usage, role, gemm_name):
    a, b = _operands(layout, m=32, n=32, k=64)
    q = MXFP8Quantizer("E4M3")
    q.set_usage(rowwise=usage != "rowwise", columnwise=usage != "columnwise")
    if operand == "A":
        a = q.quantize(a)
    else:
        b = q.quantize(b)
    roles = (role, "other") if operand == "A" else ("other", role)
    msg = f"GEMM '{gemm_name}' requested the {usage} representation of '{role}', but it is unavailable"
    with pytest.raises(RuntimeError, match=msg):
        gemm(a, b, layout=layout, out_dtype=torch.float32, gemm_name=gemm_name, roles=roles)


def test_debug_tensor_unwrap_selects_direction():
    from tedebug.debug_quantization import DebugQuantizedTensor

    g = torch.Generator().manual_seed(6)
    row, col = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    d = DebugQuantizedTensor(row, col, None, "layer", "weight")
    assert gemm_operand(d, "rowwise", "weight", "fprop") is row
    assert gemm_operand(d, "columnwise", "weight", "dgrad") is col
    d_missing = DebugQuantizedTensor(row, None, None, "layer", "weight")
    with pytest.raises(RuntimeError, match="GEMM 'dgrad' requested the columnwise representation of 'weight'"):
        gemm_operand(d_missing, "columnwise", "weight", "dgrad")


def test_hybrid_and_identity_unwrap():
    from tedebug.debug_quantization import DebugQuantizedTensor

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 64, generator=g)
    hybrid = HybridQuantizer(IdentityQuantizer(), MXFP8Quantizer("E4M3")).quantize(x)
    row = gemm_operand(hybrid, "rowwise", "activation", "fprop")
    assert isinstance(row, torch.Tensor) and torch.equal(row, x)
    col = gemm_operand(hybrid, "columnwise", "activation", "wgrad")
    assert type(col).__name__ == "MXFP8Tensor"
    # a debug wrapper around a hybrid: direction first, then sub-storage
    d = DebugQuantizedTensor(hybrid, hybrid, None, "layer", "activation")
    assert gemm_operand(d, "columnwise", "activation", "wgrad") is col
    hybrid.update_usage(columnwise_usage=False)
    with pytest.raises(RuntimeError, match="GEMM 'wgrad' requested the columnwise representation of 'activation'"):
        gemm_operand(d, "columnwise", "activation", "wgrad")


def test_mixed_plain_and_quantized_operands():
    a, b = _operands("TN", m=64, n=32, k=64, seed=8)
    aq = MXFP8Quantizer("E4M3").quantize(a)
    out = gemm(aq, b, layout="TN", out_dtype=torch.float32)
    _assert_fp32_bound(out, aq.dequantize(usage="rowwise"), b, "TN")


def test_out_dtype_and_bias_with_quantized_operands():
    a, b = _operands("TN", m=64, n=32, k=64, seed=9)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(10))
    aq, bq = MXFP8Quantizer("E4M3").quantize(a), MXFP8Quantizer("E4M3").quantize(b)
    ref = (bq.dequantize() @ aq.dequantize().t()) + bias
    out = gemm(aq, bq, layout="TN", out_dtype=torch.bfloat16, bias=bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
@pytest.mark.parametrize("formats", [("E4M3", "E4M3"), ("E4M3", "E5M2"), ("E5M2", "E4M3"), ("E5M2", "E5M2")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_emulation(layout, formats, out_dtype, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 GEMMs (sm >= 8.9)")
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    a, b = _operands(layout, m=64, n=128, k=256, seed=11)
    aq = Float8CurrentScalingQuantizer(formats[0]).quantize(a.cuda())
    bq = Float8CurrentScalingQuantizer(formats[1]).quantize(b.cuda())
    native = gemm(aq, bq, layout=layout, out_dtype=out_dtype)
    emulated = gemm(aq, bq, layout=layout, out_dtype=torch.float32, use_native=False)
    assert calls == ([] if formats == ("E5M2", "E5M2") else [out_dtype])  # cuBLAS has no E5M2 x E5M2
    assert native.dtype == out_dtype and native.shape == emulated.shape
    # FP8 tensor cores accumulate with limited precision (Hopper): a tolerance relative to the output scale
    rtol = 2.0**-8 if out_dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(native.float(), emulated, rtol=rtol, atol=2e-3 * float(emulated.abs().max()))
