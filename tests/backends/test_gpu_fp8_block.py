"""FP8 block-scaling kernels (kernels/fp8_block.cu) against the torch reference path: identical codes and scale_inv
for 1x128 and 128x128 blocks (rowwise, columnwise, both; pow2 and exact scales; epsilon; partial blocks; fp32 /
bf16 / fp16), fused statistics vs torch_ref's float64 values, dispatch routing, determinism.  Needs CUDA and CuPy.

Run as a script (``python tests/backends/test_gpu_fp8_block.py``) it times the kernels at 8192^2 bf16 against a device
copy.
"""

import math

import pytest
import torch

from tedebug.backends import cupy_fp8_block, cupy_stats, dispatch, torch_ref
from tedebug.quantization.float8_block import Float8BlockQuantizer

from support.kernel_inputs import backend_pair, special_values

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
U = 2.0**-24  # fp32 unit roundoff


def err_chunk(dtype) -> int:
    """Squared errors summed in fp32 before the fp64 accumulation: one 16-byte chunk (FB_EPC in fp8_block.cu)."""
    return 4 if dtype == torch.float32 else 8


def adversarial(shape, dtype, seed):
    """Magnitudes over 2^±20, special values sprinkled in, an all-zero first row stretch, a NaN-only block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    x = x.to(dtype).reshape(-1)
    sp = special_values(dtype)
    idx = torch.randint(0, x.numel(), (min(x.numel(), 96),), generator=g)
    x[idx] = sp[torch.randint(0, sp.numel(), idx.shape, generator=g)]
    if x.numel() >= 512:
        x[:128] = 0.0
        x[256:384] = float("nan")
    return x.reshape(shape).to(DEV)


def varied(shape, dtype, seed):
    """Finite data whose magnitude changes per row and column (many distinct block scales)."""
    g = torch.Generator().manual_seed(seed)
    m = math.prod(shape[:-1])
    rows = torch.exp2(torch.empty(m, 1).uniform_(-12, 8, generator=g))
    cols = torch.exp2(torch.empty(1, shape[-1]).uniform_(-4, 4, generator=g))
    return (torch.randn(m, shape[-1], generator=g) * rows * cols).reshape(shape).to(dtype).to(DEV)


def quantize_pair(x, **kw):
    return backend_pair(lambda: Float8BlockQuantizer(**kw), x)


def assert_same_fields(got, ref):
    for field in FIELDS:
        a, b = getattr(got, field), getattr(ref, field)
        assert (a is None) == (b is None), field
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (field, a.dtype, b.dtype, a.shape, b.shape)
        # scale_inv compared as bits (NaN never occurs; -0 would differ from +0)
        same = torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else torch.equal(a, b)
        assert same, (field, (a != b).sum().item(), a.shape)


def assert_fused_stats(x, got, ref):
    """The fused statistics are the ones the cupy family functions return, and match torch_ref's float64 values."""
    n = x.numel()
    for usage in ("rowwise", "columnwise"):
        if getattr(ref, f"{usage}_data") is None:
            continue
        fused = got._fused_error_stats[usage]
        uf = cupy_stats.underflow_partials(x, got, usage)["underflows_num"]
        assert uf is fused["underflows_num"]
        assert uf.item() == torch_ref.underflow_partials(x, ref, usage)["underflows_num"].item(), usage
        err = cupy_stats.mse_partials(x, got, usage)["sq_err"]
        assert err is fused["sq_err"]
        err, want = err.item(), torch_ref.mse_partials(x, ref, usage)["sq_err"].item()
        if math.isnan(want) or math.isinf(want):
            assert err == want or (math.isnan(err) and math.isnan(want)), (usage, err, want)
        else:
            bound = (err_chunk(x.dtype) + 4) * U * want + n * 2.0**-148
            assert abs(err - want) <= bound, (usage, err, want, bound)


SHAPES = [(128, 128), (256, 384), (1, 1), (3, 200), (130, 257), (2, 64, 96), (129, 7), (300, 136), (8, 1030)]


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_identical_both_directions(dim, dtype, shape):
    for i, x in enumerate((varied(shape, dtype, 1), adversarial(shape, dtype, 2))):
        fmt = "E4M3" if i == 0 else "E5M2"
        for pow2 in (True, False):
            got, ref = quantize_pair(x, fp8_format=fmt, block_scaling_dim=dim, force_pow_2_scales=pow2)
            assert_same_fields(got, ref)
            assert_fused_stats(x, got, ref)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_direction(dim, dtype):
    x = adversarial((200, 300), dtype, 3)
    for kw in ({"rowwise": True, "columnwise": False}, {"rowwise": False, "columnwise": True}):
        got, ref = quantize_pair(x, block_scaling_dim=dim, **kw)
        assert_same_fields(got, ref)
        assert_fused_stats(x, got, ref)
        usage = "rowwise" if kw["rowwise"] else "columnwise"
        assert set(got._fused_error_stats) == {"source", "version", usage}


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_epsilon(dim, dtype):
    x = varied((256, 256), dtype, 4)
    x[:128, :128] = 0.0  # an all-zero block: amax 0 < epsilon -> fp8_max / epsilon
    for eps, pow2 in ((1e-3, True), (1e-3, False), (0.5, False), (3.0, True), (-0.0, True)):
        got, ref = quantize_pair(x, block_scaling_dim=dim, amax_epsilon=eps, force_pow_2_scales=pow2)
        assert_same_fields(got, ref)
        assert_fused_stats(x, got, ref)
    with dispatch.use_backend("cupy"):
        q = Float8BlockQuantizer(block_scaling_dim=dim, amax_epsilon=0.5, force_pow_2_scales=False).quantize(x)
    assert q.rowwise_scale_inv[0, 0].item() == (1 / torch.tensor(448 / 0.5, dtype=torch.float32)).item()  # 1/896


def test_hand_derived_scales():
    """Hand-derived: block amax 3 -> scale 128 (pow2) / 448/3; amax 1 -> 256; amax 0.1 -> 4096 (fp32: 4480)."""
    x = torch.zeros(3, 384, dtype=torch.float32)
    x[0, 5], x[0, 200], x[0, 300] = 3.0, -1.0, 0.1
    x[1, :128] = 1.5
    x = x.to(DEV)
    with dispatch.use_backend("cupy"):
        p2 = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
        ex = Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False).quantize(x)
    s = p2.rowwise_scale_inv.cpu()
    assert s[0].tolist() == [1 / 128, 1 / 256, 1 / 4096]
    assert s[1].tolist() == [1 / 256, 1.0, 1.0]  # 448 / 1.5 = 298.67 -> 256; all-zero blocks -> scale 1
    want = [1 / torch.tensor(448 / 3, dtype=torch.float32), 1 / torch.tensor(448.0), 1 / torch.tensor(4480.0)]
    assert ex.rowwise_scale_inv[0].cpu().tolist() == [w.item() for w in want]
    codes = p2.rowwise_data.cpu()
    assert codes[0, 5].item() == 0x7C  # 3 * 128 = 384 = 1.5 * 2^8 (E4M3: exponent field 15, mantissa 100b)
    assert codes[0, 200].item() == 0x80 | 0x78  # -1 * 256 = -256 = -2^8
    assert codes[1, 0].item() == 0x7C  # 1.5 * 256 = 384
    # columnwise 1x128 blocks run along M: column 5 holds one block [3, 1.5, 0] -> scale 128, 1.5 * 128 = 1.5 * 2^7
    assert p2.columnwise_scale_inv[5, 0].item() == 1 / 128
    assert p2.columnwise_data[5].cpu().tolist() == [0x7C, 0x74, 0x00]
    assert p2.columnwise_scale_inv[300].tolist() == [1 / 4096]


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_edges(dtype):
    """Tiny blocks (fp8_max / amax overflows for bf16 / fp32 -> the dtype's max), dtype max, Inf and NaN blocks."""
    fin = torch.finfo(dtype)
    x = torch.zeros(256, 512, dtype=torch.float32)
    x[:128, 0:128] = fin.tiny / 8 if dtype != torch.float16 else 2.0**-24  # smallest magnitudes
    x[:128, 128:256] = fin.max
    x[:128, 256] = float("inf")
    x[:128, 384] = float("nan")
    x[128:, :] = torch.randn(128, 512) * 1e-30 if dtype != torch.float16 else torch.randn(128, 512) * 1e-6
    x = x.to(dtype).to(DEV)
    for dim in (1, 2):
        for pow2 in (True, False):
            got, ref = quantize_pair(x, block_scaling_dim=dim, force_pow_2_scales=pow2)
            assert_same_fields(got, ref)
            assert_fused_stats(x, got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_larger_multi_tile(dtype):
    """More tiles than resident blocks (grid-stride loop) and a ragged edge in both dims."""
    x = varied((1100, 2100), dtype, 5)
    for dim in (1, 2):
        got, ref = quantize_pair(x, block_scaling_dim=dim)
        assert_same_fields(got, ref)
        assert_fused_stats(x, got, ref)


def test_unaligned_and_strided_inputs():
    base = varied((1, 64 * 130 + 1), torch.bfloat16, 6).reshape(-1)
    x = base[1:].reshape(64, 130)  # data pointer not 16-byte aligned
    got, ref = quantize_pair(x, block_scaling_dim=1)
    assert_same_fields(got, ref)
    y = varied((96, 160), torch.float16, 7).t()  # non-contiguous
    got, ref = quantize_pair(y, block_scaling_dim=2)
    assert_same_fields(got, ref)


@pytest.mark.parametrize("dim", [1, 2])
def test_deterministic(dim):
    x = adversarial((777, 1000), torch.bfloat16, 8)
    with dispatch.use_backend("cupy"):
        a = Float8BlockQuantizer(block_scaling_dim=dim).quantize(x)
        b = Float8BlockQuantizer(block_scaling_dim=dim).quantize(x)
    assert_same_fields(a, b)
    for usage in ("rowwise", "columnwise"):
        for key in ("underflows_num", "sq_err"):
            va, vb = a._fused_error_stats[usage][key], b._fused_error_stats[usage][key]
            assert torch.equal(va.view(torch.int64), vb.view(torch.int64)), (usage, key)


def test_dispatch_routing():
    x = varied((128, 256), torch.bfloat16, 9)
    with dispatch.use_backend("auto"):
        q = Float8BlockQuantizer().quantize(x)
    assert hasattr(q, "_fused_error_stats")  # the kernel path
    with dispatch.use_backend("torch"):
        assert dispatch.quantize_fp8_block(x, "E4M3", 2, 0.0, True, 448.0, True, True) is None
        assert not hasattr(Float8BlockQuantizer().quantize(x), "_fused_error_stats")
    with dispatch.use_backend("auto"):
        assert dispatch.quantize_fp8_block(x.cpu(), "E4M3", 2, 0.0, True, 448.0, True, True) is None
        assert dispatch.quantize_fp8_block(x[:0], "E4M3", 2, 0.0, True, 448.0, True, True) is None  # empty: torch
    with dispatch.use_backend("cupy"):
        with pytest.raises(RuntimeError, match="cpu"):
            Float8BlockQuantizer().quantize(x.cpu())
        with pytest.raises(TypeError, match="float32/bfloat16/float16"):
            Float8BlockQuantizer().quantize(x.to(torch.float64))


def test_fused_stats_only_for_the_source_tensor_and_no_overflow_stat():
    x = varied((128, 256), torch.float32, 10)
    with dispatch.use_backend("cupy"):
        q = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    y = x.clone()
    assert cupy_stats.mse_partials(y, q, "rowwise")["sq_err"] is not q._fused_error_stats["rowwise"]["sq_err"]
    x.add_(1.0)  # a new version: the fused values no longer describe x
    want = torch_ref.underflow_partials(x, q, "rowwise")["underflows_num"]
    assert cupy_stats.underflow_partials(x, q, "rowwise")["underflows_num"].item() == want.item()
    with pytest.raises(ValueError, match="per-tensor"):  # overflows% is a per-tensor statistic
        cupy_stats.overflow_partials(x, q, "rowwise")


def test_raw_rejects_bad_arguments():
    x = torch.ones(4, 4, device=DEV)
    with pytest.raises(ValueError, match="block_scaling_dim"):
        cupy_fp8_block.fp8_block_quantize_raw(
            x, "E4M3", 3, epsilon=0.0, pow2=True, value_for_inf=1.0, rowwise=True, columnwise=True
        )
    with pytest.raises(ValueError, match="nothing to produce"):
        cupy_fp8_block.fp8_block_quantize_raw(
            x, "E4M3", 1, epsilon=0.0, pow2=True, value_for_inf=1.0, rowwise=False, columnwise=False
        )
