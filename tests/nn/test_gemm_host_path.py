"""The CPU GEMM of per-tensor FP8 operands decodes each operand in one step (`Float8Tensor.fp32_matrix`) and computes
exactly what "dequantize, flatten to 2-D, multiply in fp32" computes: the same operand values with the same strides,
the same result bits for every layout, bias and output dtype; pinned by counting the operators it runs."""

import pytest
import torch

from tedebug.nn.gemm import gemm
from tedebug.quantization import Float8CurrentScalingQuantizer, Float8Quantizer
from support.concurrency import AtenCounter

LAYOUTS = ("TN", "NN", "NT", "TT")


def _flat_dequantized(q, usage):
    """The reference operand: `dequantize` in fp32, flattened to 2-D as the GEMM's general path does."""
    values = q.dequantize(usage=usage, dtype=torch.float32)
    return values.reshape(1, -1) if values.dim() == 1 else values.reshape(-1, values.shape[-1])


def _reference(aq, bq, layout, out_dtype, bias):
    a = _flat_dequantized(aq, "rowwise" if layout[0] == "T" else "columnwise")
    b = _flat_dequantized(bq, "columnwise" if layout[1] == "T" else "rowwise")
    out = (b if layout[1] == "N" else b.t()) @ (a.t() if layout[0] == "T" else a)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


def _bits(t):
    return t.float().view(torch.int32) if t.dtype != torch.float32 else t.view(torch.int32)


_SHAPES = [(8, 32), (1, 32), (32, 1), (1, 1), (5, 7), (3, 4, 16), (16,)]


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_matrix_is_the_flattened_dequantize(fmt, shape):
    """Same values (bit for bit) and the same strides as the general path, also for size-1 dims (whose strides the
    reshapes of `dequantize` choose) and for 1-D and 3-D tensors (which take the general path)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(41)) * 3
    q = Float8CurrentScalingQuantizer(fmt).quantize(x)
    for usage in ("rowwise", "columnwise"):
        fast, ref = q.fp32_matrix(usage), _flat_dequantized(q, usage)
        assert fast.shape == ref.shape and fast.stride() == ref.stride(), usage
        assert torch.equal(_bits(fast), _bits(ref)), usage


def _operand_pair(layout, m, n, k, seed, quantizers):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((n, k) if layout[0] == "T" else (k, n), generator=g)
    b = torch.randn((m, k) if layout[1] == "N" else (k, m), generator=g) * 1e-3
    a[0, 0] = float("nan") if seed == 2 else a[0, 0]  # a NaN operand element (seed 2 only)
    return quantizers[0].quantize(a), quantizers[1].quantize(b)


def _delayed(fmt):
    return Float8Quantizer(torch.tensor(0.5), torch.zeros(4), fmt)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_fp8_gemm_equals_dequantize_then_matmul(layout, out_dtype, with_bias, seed):
    """Every layout, bias or not, fp32 or bf16 output, current and delayed scaling, E4M3 x E5M2, a NaN input:
    the result bits equal the reference expression's."""
    quantizers = [
        (Float8CurrentScalingQuantizer("E4M3"), Float8CurrentScalingQuantizer("E4M3")),
        (Float8CurrentScalingQuantizer("E4M3"), Float8CurrentScalingQuantizer("E5M2")),
        (_delayed("E4M3"), _delayed("E5M2")),
    ][seed]
    for m, n, k in ((8, 32, 32), (1, 16, 8), (24, 1, 40), (3, 5, 1)):
        aq, bq = _operand_pair(layout, m, n, k, seed, quantizers)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(out_dtype) if with_bias else None
        out = gemm(aq, bq, layout=layout, out_dtype=out_dtype, bias=bias)
        ref = _reference(aq, bq, layout, out_dtype, bias)
        assert out.dtype == out_dtype and out.shape == (m, n)
        assert torch.equal(_bits(out), _bits(ref)), (m, n, k)


def test_cpu_fp8_gemm_runs_only_the_product_and_its_epilogue():
    """Decoding the operands runs no torch operator (a table look-up in numpy); the GEMM is one `mm`, the bias one
    `add`, a bf16 output one `_to_copy`; besides those only a transposed view (`t`) may appear."""
    q = Float8CurrentScalingQuantizer()
    g = torch.Generator().manual_seed(3)
    w, x = q.quantize(torch.randn(32, 32, generator=g)), q.quantize(torch.randn(32, 32, generator=g))
    bias = torch.randn(32, generator=g)
    expected = {
        (torch.float32, False): ["mm"],
        (torch.float32, True): ["add", "mm"],
        (torch.bfloat16, False): ["_to_copy", "mm"],
    }
    for (out_dtype, with_bias), ops in expected.items():
        for layout in LAYOUTS:
            with AtenCounter() as counter:
                gemm(w, x, layout=layout, out_dtype=out_dtype, bias=bias if with_bias else None)
            computing = sorted(
                op for op in counter.ops if op not in ("t", "detach", "lift_fresh", "_local_scalar_dense")
            )
            assert computing == ops, (layout, counter.ops)
