"""NVFP4 quantize kernel (kernels/nvfp4.cu via tedebug.backends.cupy_nvfp4) against the torch reference.

GPU tests (marked gpu, skipped without CUDA + CuPy): bit-identical data, scale codes and amaxes for rowwise,
columnwise, both, 2D and stochastic rounding; fused underflow counts exactly equal to torch_ref, fused squared errors
within the stated bound of torch_ref's float64 value; determinism; dispatch routing.  CPU tests: the dispatch hook
in `NVFP4Quantizer._quantize` leaves CPU tensors on the torch path, and `cupy_nvfp4.supports` picks the calls the
kernel takes.

Run as a script on a GPU machine (``python tests/test_gpu_nvfp4.py``) to time the kernel against a copy.
"""

import math

import pytest
import torch

from tedebug.backends import dispatch, torch_ref
from tedebug.quantization.nvfp4 import NVFP4Quantizer

HAS_GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401

    HAS_CUPY = True
except ImportError:
    HAS_CUPY = False
gpu = [pytest.mark.gpu, pytest.mark.skipif(not (HAS_GPU and HAS_CUPY), reason="needs CUDA and CuPy")]

DEV = torch.device("cuda") if HAS_GPU else None
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
U = 2.0 ** -24        # fp32 unit roundoff
ERR_CHUNK = 32        # fp32 |x| - |deq|, square and 16-term fp32 sum per block before fp64 (nvfp4.cu): < 32 U
TINY_SQ = 2.0 ** -126  # squared errors below the fp32 normal range are lost by the fp32 per-element squares
FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax_rowwise", "columnwise_data", "columnwise_scale_inv",
          "amax_columnwise")
# (M, K) or N-d shapes: one tile, partial tiles in both dims, 3-D, several tiles per block
SHAPES = [(16, 16), (64, 128), (48, 272), (2, 40, 96), (256, 1024), (1040, 2064)]


def special_values(dtype):
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    vals = [float("nan"), -float("nan"), 0.0, -0.0, tiny / 4, -tiny / 2, tiny, 448.0, -1000.0, 2688.0, 6.0, 5.0,
            0.25, -0.75, 2.0 ** -10, big, -big, 1e-3, 3.5]
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


def adversarial(shape, dtype, seed, with_inf=False):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    x = x.to(dtype)
    sp = special_values(dtype)
    if with_inf:
        sp = torch.cat([sp, torch.tensor([float("inf"), -float("inf")], dtype=dtype)])
    idx = torch.randint(0, n, (min(n, 64),), generator=g)
    x[idx] = sp[torch.randint(0, sp.numel(), idx.shape, generator=g)]
    x[:16] = 0.0  # an all-zero block
    return x.reshape(shape).to(DEV)


def random_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)


def pair(x, **kw):
    with dispatch.use_backend("cupy"):
        got = NVFP4Quantizer(**kw).quantize(x)
    with dispatch.use_backend("torch"):
        ref = NVFP4Quantizer(**kw).quantize(x)
    return got, ref


def check_fields(got, ref):
    for field in FIELDS:
        a, b = getattr(got, field), getattr(ref, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, (field, a.shape, b.shape)
            assert torch.equal(a, b) or (a.dtype == torch.float32 and torch.equal(a.isnan(), b.isnan())), \
                (field, (a != b).sum().item())


def check_stats(x, got, ref):
    """Fused statistics: underflows exact, squared error within the bound of the fp32 per-block sums."""
    assert getattr(got, "_fused_error_stats", None), "the kernel path must attach fused statistics"
    from tedebug.backends import cupy_kernels

    for usage in ("rowwise", "columnwise"):
        if getattr(got, f"{usage}_data") is None:
            assert usage not in got._fused_error_stats
            continue
        fused = got._fused_error_stats[usage]
        uf = cupy_kernels.underflow_partials(x, got, usage)["underflows_num"]
        assert uf is fused["underflows_num"]
        assert uf.item() == torch_ref.underflow_partials(x, ref, usage)["underflows_num"].item(), usage
        err = cupy_kernels.mse_partials(x, got, usage)["sq_err"].item()
        want = torch_ref.mse_partials(x, ref, usage)["sq_err"].item()
        assert (math.isnan(err) and math.isnan(want)) or err == want or \
            abs(err - want) <= ERR_CHUNK * U * abs(want) + x.numel() * TINY_SQ, (usage, err, want)


# ================================================================================================ GPU
def _gpu(fn):
    return gpu[1](gpu[0](fn))


@_gpu
@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rn_bit_identical_with_fused_stats(shape, dtype, usage):
    kw = {"both": {}, "rowwise": {"columnwise": False}, "columnwise": {"rowwise": False}}[usage]
    for x in (random_input(shape, dtype, 1), adversarial(shape, dtype, 2)):
        got, ref = pair(x, **kw)
        check_fields(got, ref)
        check_stats(x, got, ref)


@_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_only_any_row_count(dtype):
    for shape in [(3, 32), (130, 48), (1, 2, 5, 16)]:
        x = adversarial(shape, dtype, 3)
        got, ref = pair(x, columnwise=False)
        check_fields(got, ref)
        check_stats(x, got, ref)


@_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 16), (48, 272), (256, 1024)])
def test_2d_bit_identical(shape, dtype):
    for kw in ({}, {"columnwise": False}, {"rowwise": False}):
        for x in (random_input(shape, dtype, 4), adversarial(shape, dtype, 5)):
            got, ref = pair(x, with_2d_quantization=True, **kw)
            check_fields(got, ref)
            check_stats(x, got, ref)


@_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 32), (48, 272), (256, 1024)])
def test_stochastic_rounding_bit_identical(shape, dtype):
    """Same seed -> same generator stream: the kernel consumes exactly the reference's random bits."""
    for kw in ({}, {"columnwise": False}, {"rowwise": False}, {"with_2d_quantization": True}):
        for x in (random_input(shape, dtype, 6), adversarial(shape, dtype, 7)):
            got, ref = pair(x, stochastic_rounding=True, seed=1234, **kw)
            check_fields(got, ref)
            check_stats(x, got, ref)


@_gpu
def test_stochastic_rounding_advances_the_generator_like_the_reference():
    x = random_input((64, 128), torch.bfloat16, 8)
    qk, qt = NVFP4Quantizer(stochastic_rounding=True, seed=9), NVFP4Quantizer(stochastic_rounding=True, seed=9)
    for _ in range(2):
        with dispatch.use_backend("cupy"):
            got = qk.quantize(x)
        with dispatch.use_backend("torch"):
            ref = qt.quantize(x)
        check_fields(got, ref)


@_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_degenerate_amaxes(dtype):
    """All zeros (S_enc = 1), a tiny amax (S_enc clamped to FLT_MAX), an Inf (S_enc = 1, NaN/Inf decodes)."""
    zeros = torch.zeros(32, 64, dtype=dtype, device=DEV)
    tiny = torch.zeros(32, 64, dtype=dtype, device=DEV)
    tiny[3, 5] = torch.finfo(dtype).tiny / (4 if dtype != torch.float16 else 1)
    tiny[7, 9] = -tiny[3, 5]
    inf = adversarial((32, 64), dtype, 10, with_inf=True)
    inf[0, 0] = float("inf")
    for x in (zeros, tiny, inf):
        got, ref = pair(x)
        check_fields(got, ref)
        check_stats(x, got, ref)


# Shapes the fast kernel (ted_nvfp4_quantize16: bf16/fp16, RN, 1D, M % 64 == 0, K % 128 == 0) takes: one tile,
# 3 x 3 tiles, 3-D, and 1024 tiles (more than the grid: every block walks several tiles across tile-row ends).
FAST_SHAPES = [(64, 128), (192, 384), (2, 64, 256), (1024, 8192)]


@_gpu
@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", FAST_SHAPES)
def test_fast_kernel_bit_identical(shape, dtype, usage):
    from tedebug.backends import cupy_nvfp4

    kw = {"both": {}, "rowwise": {"columnwise": False}, "columnwise": {"rowwise": False}}[usage]
    m, k = math.prod(shape[:-1]), shape[-1]
    assert cupy_nvfp4.uses_fast_kernel(m, k, dtype, False, False)
    for x in (random_input(shape, dtype, 21), adversarial(shape, dtype, 22), adversarial(shape, dtype, 23, True)):
        got, ref = pair(x, **kw)
        check_fields(got, ref)
        check_stats(x, got, ref)


@_gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_fast_kernel_degenerate_amaxes(dtype):
    """The fast kernel on all zeros, a tiny amax (S_enc clamped) and an Inf (S_enc = 1, every block redone)."""
    zeros = torch.zeros(64, 128, dtype=dtype, device=DEV)
    tiny = zeros.clone()
    tiny[3, 5] = torch.finfo(dtype).tiny / (4 if dtype != torch.float16 else 1)
    tiny[40, 100] = -tiny[3, 5]
    inf = adversarial((64, 128), dtype, 24, with_inf=True)
    inf[0, 0] = float("inf")
    for x in (zeros, tiny, inf):
        got, ref = pair(x)
        check_fields(got, ref)
        check_stats(x, got, ref)


@_gpu
def test_deterministic():
    x = adversarial((256, 1024), torch.bfloat16, 11)
    with dispatch.use_backend("cupy"):
        a = NVFP4Quantizer().quantize(x)
        b = NVFP4Quantizer().quantize(x)
    check_fields(a, b)
    for usage in ("rowwise", "columnwise"):
        for key in ("underflows_num", "sq_err"):
            va, vb = a._fused_error_stats[usage][key].item(), b._fused_error_stats[usage][key].item()
            assert va == vb or (math.isnan(va) and math.isnan(vb)), (usage, key, va, vb)


@_gpu
def test_dispatch_routing():
    x = random_input((64, 128), torch.bfloat16, 12)
    q = NVFP4Quantizer().quantize(x)  # auto: CUDA tensor + CuPy -> kernel
    assert getattr(q, "_fused_error_stats", None)
    with dispatch.use_backend("torch"):
        assert not getattr(NVFP4Quantizer().quantize(x), "_fused_error_stats", None)
    with dispatch.use_backend("cupy"):
        rht = NVFP4Quantizer(with_rht=True).quantize(x)  # not taken by the kernel: torch, same as the reference
        assert not getattr(rht, "_fused_error_stats", None)
        with pytest.raises(ValueError, match="divisible by 16"):
            NVFP4Quantizer().quantize(random_input((20, 32), torch.bfloat16, 13))
        with pytest.raises(TypeError, match="float32/bfloat16/float16"):
            NVFP4Quantizer().quantize(x.double())
    with dispatch.use_backend("torch"):
        ref = NVFP4Quantizer(with_rht=True).quantize(x)
    check_fields(rht, ref)


@_gpu
def test_non_contiguous_input():
    x = random_input((128, 64), torch.bfloat16, 14).t()  # [64, 128], not contiguous
    got, ref = pair(x)
    check_fields(got, ref)
    check_stats(x, got, ref)


# ================================================================================================ CPU
def test_cpu_tensor_stays_on_the_torch_path():
    x = torch.randn(32, 32)
    q = NVFP4Quantizer().quantize(x)
    assert not getattr(q, "_fused_error_stats", None)
    assert dispatch.quantize_nvfp4(NVFP4Quantizer(), x) is None
    with dispatch.use_backend("cupy"), pytest.raises(RuntimeError, match="CUDA"):
        NVFP4Quantizer().quantize(x)


def test_fast_kernel_selection():
    from tedebug.backends.cupy_nvfp4 import uses_fast_kernel

    assert uses_fast_kernel(64, 128, torch.bfloat16, False, False)
    assert uses_fast_kernel(8192, 8192, torch.float16, False, False)
    assert not uses_fast_kernel(64, 128, torch.float32, False, False)  # fp32: general kernel
    assert not uses_fast_kernel(64, 128, torch.bfloat16, True, False)  # 2D
    assert not uses_fast_kernel(64, 128, torch.bfloat16, False, True)  # stochastic rounding
    assert not uses_fast_kernel(48, 128, torch.bfloat16, False, False)  # M % 64
    assert not uses_fast_kernel(64, 144, torch.bfloat16, False, False)  # K % 128


def test_supports_picks_the_calls_the_kernel_takes():
    from tedebug.backends import cupy_nvfp4

    x = torch.zeros(32, 64)
    assert cupy_nvfp4.supports(NVFP4Quantizer(), x)
    assert cupy_nvfp4.supports(NVFP4Quantizer(with_2d_quantization=True, stochastic_rounding=True, seed=0), x)
    assert not cupy_nvfp4.supports(NVFP4Quantizer(with_rht=True), x)
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), x.double())
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), torch.zeros(0, 64))
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), torch.zeros(24, 64))  # columnwise needs M % 16 == 0
    assert cupy_nvfp4.supports(NVFP4Quantizer(columnwise=False), torch.zeros(24, 64))
    assert not cupy_nvfp4.supports(NVFP4Quantizer(columnwise=False), torch.zeros(24, 40))
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), torch.zeros(64))
