"""Block-scaled GEMMs emulated on tensor cores (`tedebug.nn.gemm` + `tedebug.quantization.gemm_values`) and the
device Philox generator of NVFP4 stochastic rounding.

GPU tests (marked gpu, skipped without CUDA + CuPy):
- the tensor-core GEMM equals "dequantize to fp32, multiply" up to fp32 accumulation order: with an fp32 output
  |got - exact| <= (K + 2) · 2^-24 · (|op_B|·|op_A|) element by element, `exact` computed in float64 from the fp32
  dequantized operands (a bf16 rounding of any operand would exceed this by orders of magnitude); with a bf16 output
  one more rounding, 2^-8 |exact|;
- every recipe's format, the three layouts, bias, NVFP4's rotated wgrad operands, MXFP8 blocks with the smallest
  E8M0 scales (values below bf16's normal range), and the per-tensor FP8 pairs `torch._scaled_mm` cannot take;
- no host synchronisation on the quantize -> GEMM path (`torch.cuda.set_sync_debug_mode("error")`);
- Philox bytes from the kernel equal the torch reference; NVFP4 stochastic rounding gives the same bytes on CPU
  and GPU for one seed.
CPU tests: every format's `gemm_values` is exact (values · scale equals the fp32 dequantization).
"""

import pytest
import torch

from tedebug.backends import dispatch
from tedebug.nn.gemm import gemm
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer
from tedebug.quantization.float8_block import Float8BlockQuantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer
from tedebug.quantization.nvfp4 import NVFP4Quantizer
from tedebug.quantization.philox import philox_bytes

DEV = torch.device("cuda")
U = 2.0**-24

QUANTIZERS = {
    "mxfp8_e4m3": lambda: MXFP8Quantizer("E4M3"),
    "mxfp8_e5m2": lambda: MXFP8Quantizer("E5M2"),
    "fp8_block_1d": lambda: Float8BlockQuantizer("E4M3", block_scaling_dim=1),
    "fp8_block_2d": lambda: Float8BlockQuantizer("E4M3", block_scaling_dim=2),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
    "fp8_e5m2_tensor": lambda: Float8CurrentScalingQuantizer("E5M2"),  # E5M2 x E5M2: no cuBLAS FP8 GEMM
}


def _next(pool):
    """The next quantizer of a pool, round robin (quantizers with state reused across calls)."""
    pool.append(pool.pop(0))
    return pool[-1]


def spread(shape, seed, device=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    return x.to(torch.bfloat16).to(device or "cpu")


def reference(a, b, a_usage, b_usage, layout, bias):
    """float64 product of the fp32-dequantized operands (rotations undone), and the float64 |op_B|·|op_A|."""

    def deq(q, usage):
        return q.dequantize(dtype=torch.float32, usage=usage).reshape(-1, q.shape[-1]).double()

    a2, b2 = deq(a, a_usage), deq(b, b_usage)
    op_a = a2.t() if layout[0] == "T" else a2
    op_b = b2 if layout[1] == "N" else b2.t()
    exact = op_b @ op_a
    if bias is not None:
        exact = exact + bias.double()
    return exact, op_b.abs() @ op_a.abs()


def check(got, exact, magnitude, k, out_dtype):
    got = got.double()
    bound = (k + 2) * U * magnitude
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    assert torch.isfinite(got).all()
    excess = (got - exact).abs() - bound
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3g}"


# (layout, A role/usage, B role/usage) of the three linear GEMMs: x [M, K], W [N, K], dy [M, N]
GEMMS = [("TN", "rowwise", "rowwise"), ("NN", "columnwise", "rowwise"), ("NT", "columnwise", "columnwise")]


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_gemm_values_are_exact(name):
    x = spread((64, 256), 1)
    q = QUANTIZERS[name]().quantize(x)
    for usage in ("rowwise", "columnwise"):
        gv = q.gemm_values(usage)
        assert gv.values.dtype == torch.bfloat16 and tuple(gv.values.shape) == (64, 256)
        got = gv.values.float() * gv.scale
        ref = q.dequantize(dtype=torch.float32, usage=usage)
        if name.startswith("nvfp4"):  # (q · S_b) · (amax / 2688) vs q · ((S_b · amax) / 2688): one fp32 rounding
            assert ((got - ref).abs() <= 2 * U * ref.abs()).all()
        else:
            assert torch.equal(got, ref)


def test_mxfp8_smallest_scales_are_exact_in_bf16():
    """Blocks with E8M0 codes 0..3 (values down to 2^-136, below bf16's subnormal step without the lift)."""
    x = torch.full((32, 64), 2.0**-130)
    x[:, :32] *= torch.linspace(0.01, 1.0, 32)
    x[:, 32:] = torch.linspace(-3.0, 3.0, 32)
    q = MXFP8Quantizer("E4M3").quantize(x)
    assert int(q.rowwise_scale_inv[:, 0].min()) <= 3
    gv = q.gemm_values("rowwise")
    assert torch.equal(gv.values.float() * gv.scale, q.dequantize(dtype=torch.float32, usage="rowwise"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("layout, a_usage, b_usage", GEMMS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_tensor_core_gemm_matches_fp32(name, layout, a_usage, b_usage, out_dtype):
    m, n, k = 256, 192, 512
    x, w, dy = spread((m, k), 2, DEV), spread((n, k), 3, DEV) * 0.05, spread((m, n), 4, DEV)
    make = QUANTIZERS[name]
    xq, wq, dyq = make().quantize(x), make().quantize(w), make().quantize(dy)
    operands = {"TN": (wq, xq, k), "NN": (wq, dyq, n), "NT": (xq, dyq, m)}
    a, b, red = operands[layout]
    bias = (torch.randn(n, device=DEV) * 4).to(out_dtype) if layout == "TN" else None
    got = gemm(a, b, layout=layout, out_dtype=out_dtype, bias=bias)
    assert got.dtype == out_dtype
    exact, magnitude = reference(a, b, a_usage, b_usage, layout, bias)
    check(got, exact, magnitude, red, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_wgrad_on_rotated_operands(out_dtype):
    """RHT on both wgrad operands (the recipe's default): the GEMM consumes the rotated values, H·Hᵀ = I."""
    m, n, k = 256, 128, 192
    x, dy = spread((m, k), 5, DEV), spread((m, n), 6, DEV)
    xq = NVFP4Quantizer(with_rht=True).quantize(x)
    dyq = NVFP4Quantizer(with_rht=True, stochastic_rounding=True, seed=3).quantize(dy)
    assert xq.gemm_values("columnwise").rotated and dyq.gemm_values("columnwise").rotated
    got = gemm(xq, dyq, layout="NT", out_dtype=out_dtype)
    exact, magnitude = reference(xq, dyq, "columnwise", "columnwise", "NT", None)
    # the reference undoes each rotation in fp64 and rounds to fp32 (one rounding per element of both operands)
    check(got, exact, magnitude, m + 4, out_dtype)


@pytest.mark.gpu
def test_mxfp8_gemm_with_the_smallest_scales():
    """Products of blocks below bf16's normal range with large values: exact only through the lift."""
    m, n, k = 64, 64, 128
    x = torch.full((m, k), 2.0**-130, device=DEV) * (1 + torch.rand(m, k, device=DEV))
    x[:, 64:] = torch.randn(m, 64, device=DEV)
    w = torch.randn(n, k, device=DEV) * 1e-3
    w[:, :64] = 2.0**100 * (1 + torch.rand(n, 64, device=DEV))
    xq, wq = MXFP8Quantizer().quantize(x), MXFP8Quantizer().quantize(w)
    assert int(xq.rowwise_scale_inv.min()) <= 2
    got = gemm(wq, xq, layout="TN", out_dtype=torch.float32)
    exact, magnitude = reference(wq, xq, "rowwise", "rowwise", "TN", None)
    check(got, exact, magnitude, k, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(QUANTIZERS) + ["nvfp4_sr_rht", "fp8_current", "fp8_delayed"])
def test_quantize_and_gemm_never_synchronise(name):
    from tedebug.quantization.float8 import Float8Quantizer

    delayed = [Float8Quantizer.from_recipe_defaults("E4M3") for _ in range(3)]  # state moves to the GPU once
    makers = dict(
        QUANTIZERS,
        nvfp4_sr_rht=lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True, seed=1),
        fp8_current=lambda: Float8CurrentScalingQuantizer("E4M3"),
        fp8_delayed=lambda: _next(delayed),
    )
    x, w, dy = spread((256, 512), 7, DEV), spread((128, 512), 8, DEV), spread((256, 128), 9, DEV)
    bias = torch.randn(128, device=DEV, dtype=torch.bfloat16)

    def step():
        xq, wq, dyq = makers[name]().quantize(x), makers[name]().quantize(w), makers[name]().quantize(dy)
        for q in delayed if name == "fp8_delayed" else ():
            q.update_scale()
        gemm(wq, xq, layout="TN", out_dtype=torch.bfloat16, bias=bias)
        gemm(wq, dyq, layout="NN", out_dtype=torch.bfloat16)
        gemm(xq, dyq, layout="NT", out_dtype=torch.bfloat16)

    step()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("seed, offset, n", [(0, 0, 16), (1234, 5, 1000), (2**40 + 3, 2**35, 4099), (7, 1, 1 << 20)])
def test_philox_kernel_equals_reference(seed, offset, n):
    with dispatch.use_backend("cupy"):
        got = philox_bytes(seed, offset, n, DEV)
    ref = philox_bytes(seed, offset, n)  # CPU torch path
    assert torch.equal(got.cpu(), ref)


@pytest.mark.gpu
def test_nvfp4_stochastic_rounding_same_bytes_on_cpu_and_gpu():
    x = spread((128, 256), 10)
    for kw in ({}, {"with_rht": True}, {"with_2d_quantization": True}):
        cpu = NVFP4Quantizer(stochastic_rounding=True, seed=77, **kw).quantize(x)
        with dispatch.use_backend("cupy"):
            dev = NVFP4Quantizer(stochastic_rounding=True, seed=77, **kw).quantize(x.to(DEV))
        for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            assert torch.equal(getattr(cpu, field), getattr(dev, field).cpu()), (kw, field)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bf16 tensors, NaN matching NaN whatever its payload."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a.masked_fill(nan, 0).view(torch.int16), b.masked_fill(nan, 0).view(torch.int16)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
# the last two: more groups of 8 than the grid has threads, so every thread walks several rows (the kernels' walk
# across row ends)
@pytest.mark.parametrize("shape", [(64, 256), (96, 136), (256, 1024), (1536, 2080), (2048, 4096)])
def test_dequant_kernels_equal_the_torch_path(name, shape):
    if name.startswith(("mxfp8", "nvfp4")) and shape[1] % 32:
        pytest.skip("the format needs the dimension divisible by 32")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-130, 120, shape, generator=g).float())
    x.view(-1)[::97] = float("nan")
    x = x.to(torch.bfloat16).to(DEV)
    q = QUANTIZERS[name]().quantize(x)
    for usage in ("rowwise", "columnwise"):
        with dispatch.use_backend("cupy"):
            got = q.gemm_values(usage)
        with dispatch.use_backend("torch"):
            ref = q.gemm_values(usage)
        assert _same_bits(got.values, ref.values), usage
        assert got.scale == ref.scale if isinstance(ref.scale, float) else torch.equal(got.scale, ref.scale)


@pytest.mark.gpu
def test_nvfp4_gemm_factors_computed_at_quantization_equal_the_per_gemm_ones():
    """The kernel path computes both directions' GEMM factors amax · fp32(1/2688) in one op at quantization; each
    is the factor `gemm_values` computes from the stored amax otherwise, bit for bit, and a replaced amax is not
    served from that cache."""
    from tedebug.quantization.nvfp4 import _INV_GLOBAL_MAX, NVFP4Quantizer

    x = (torch.randn(256, 512, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16).to(DEV)
    with dispatch.use_backend("cupy"):
        q = NVFP4Quantizer(with_rht=True).quantize(x)
        assert q._gemm_factors is not None
        for usage in ("rowwise", "columnwise"):
            amax = getattr(q, f"amax_{usage}")
            expected = amax.float().reshape(()) * _INV_GLOBAL_MAX
            got = q.gemm_values(usage).scale
            assert got.shape == () and torch.equal(got.view(torch.int32), expected.view(torch.int32)), usage
        q.amax_rowwise = q.amax_rowwise * 2
        assert torch.equal(q.gemm_values("rowwise").scale, q.amax_rowwise * _INV_GLOBAL_MAX)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_epilogue_kernel_equals_the_torch_path(bias):
    """The fp32 -> bf16 epilogue (device factors, bias): bit for bit the torch ops it replaces."""
    from tedebug.backends import cupy_dequant

    g = torch.Generator().manual_seed(14)
    acc = torch.randn(96, 64, generator=g) * torch.exp2(torch.randint(-140, 120, (96, 64), generator=g).float())
    acc.view(-1)[::37] = float("nan")
    acc = acc.to(DEV)
    fa, fb = torch.tensor(3.7e-3, device=DEV), torch.tensor(0.11, device=DEV)
    b = torch.randn(64, device=DEV).to(torch.bfloat16) if bias else None
    got = cupy_dequant.epilogue_bf16(acc, fa, fb, b)
    ref = acc * (fa * fb)
    if b is not None:
        ref = ref + b.float()
    assert _same_bits(got, ref.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 3, 257, 1024])
@pytest.mark.parametrize("case", ["random", "nan", "inf", "zero", "tiny"])
def test_delayed_update_kernel_equals_the_torch_path(algo, length, case):
    from tedebug.quantization.float8 import Float8Quantizer

    g = torch.Generator().manual_seed(length)
    history = torch.rand(length, generator=g) * 100
    if case == "nan":
        history[length // 2] = float("nan")
    elif case == "inf":
        history[-1] = float("inf")
    elif case == "zero":
        history.zero_()
    elif case == "tiny":
        history.fill_(1e-45)
    qs = {}
    for backend in ("cupy", "torch"):
        q = Float8Quantizer(
            torch.full((), 3.0, device=DEV), history.clone().to(DEV), "E4M3", margin=1, amax_compute_algo=algo
        )
        with dispatch.use_backend(backend):
            q.update_scale()
            q.update_scale()
        qs[backend] = q
    got, ref = qs["cupy"], qs["torch"]
    assert torch.equal(got.amax_history.view(torch.int32), ref.amax_history.view(torch.int32))
    assert torch.equal(got.scale.view(torch.int32), ref.scale.view(torch.int32))
