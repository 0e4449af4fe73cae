"""The plain-operand entry of `tedebug.nn.gemm.gemm` (two plain tensors of one dtype: every GEMM of a layer on the
high-precision debug path) runs only the product, and computes exactly what the torch ops compute; pinned by
counting the operators it runs (never by timing)."""

import pytest
import torch

from tedebug.nn.gemm import gemm
from support.concurrency import AtenCounter


def _operands(dtype=torch.float32):
    """x [8, 32], W [16, 32], dy [8, 16], a bias for fprop [16] and one for the other layouts' outputs [32]."""
    g = torch.Generator().manual_seed(5)
    shapes = ((8, 32), (16, 32), (8, 16), (16,), (32,))
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]


@pytest.mark.parametrize("with_bias", [False, True])
def test_two_d_operands_run_only_the_product(with_bias):
    x, w, dy, bias16, bias32 = _operands()
    cases = [
        # (A, B, layout, bias, the operators of the product, the torch reference)
        (w, x, "TN", bias16, ["t", "addmm" if with_bias else "mm"], lambda b: torch.nn.functional.linear(x, w, b)),
        (w, dy, "NN", bias32, ["mm"], lambda b: dy @ w if b is None else dy @ w + b),
        (x, dy, "NT", bias32, ["t", "mm"], lambda b: dy.t() @ x if b is None else dy.t() @ x + b),
    ]
    for a_op, b_op, layout, bias, ops, reference in cases:
        bias = bias if with_bias else None
        expected_ops = ops + (["add"] if with_bias and layout != "TN" else [])
        with AtenCounter() as counter:
            out = gemm(a_op, b_op, layout=layout, out_dtype=torch.float32, bias=bias)
        assert counter.ops == expected_ops, layout  # no view, reshape or copy of an operand or of the result
        assert torch.equal(out, reference(bias)), layout


def test_nd_operand_is_flattened_once_and_other_out_dtype_is_one_conversion():
    x, w, _, bias16, _ = _operands()
    x3 = x.reshape(2, 4, 32)
    with AtenCounter() as counter:
        out = gemm(w, x3, layout="TN", out_dtype=torch.bfloat16, bias=bias16)
    assert counter.ops == ["view", "t", "addmm", "_to_copy"]
    assert out.dtype == torch.bfloat16 and out.shape == (8, 16)
    assert torch.equal(out, torch.nn.functional.linear(x, w, bias16).to(torch.bfloat16))


def test_default_out_dtype_is_the_operands_dtype():
    """Without `out_dtype` the result has the operands' dtype, also when a bias of another dtype promotes the sum."""
    x, w, dy, _, bias32 = _operands(torch.bfloat16)
    out = gemm(w, dy, layout="NN", bias=bias32.float())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (dy @ w + bias32.float()).to(torch.bfloat16))


def test_plain_entry_keeps_the_checks():
    x, w, dy, _, _ = _operands()
    with pytest.raises(ValueError, match="layout must be one of"):
        gemm(w, x, layout="XN")
    with pytest.raises(ValueError, match=r"GEMM 'fprop' \(layout TN\): reduction sizes differ: 'A' \(16, 32\)"):
        gemm(w, dy, layout="TN", gemm_name="fprop")
    with pytest.raises(ValueError, match="at least 1 dimension"):
        gemm(w, torch.tensor(1.0), layout="TN")
    with pytest.raises(RuntimeError, match="GEMM 'dgrad': operands on different devices"):
        gemm(w, torch.empty(8, 16, device="meta"), layout="NN", gemm_name="dgrad")
