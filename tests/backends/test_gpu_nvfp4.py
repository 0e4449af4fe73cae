"""NVFP4 quantize kernels (kernels/nvfp4.cu via tedebug.backends.cupy_nvfp4) against the torch reference.

GPU tests (marked gpu, skipped without CUDA + CuPy): bit-identical data, scale codes and amaxes for rowwise,
columnwise, both, 2D, stochastic rounding and the columnwise random Hadamard transform (RHT); fused underflow counts
exactly equal to torch_ref, fused squared errors within the stated bound of torch_ref's float64 value; determinism;
dispatch routing.  CPU tests: the dispatch hook in `NVFP4Quantizer._quantize` leaves CPU tensors on the torch path,
`cupy_nvfp4.supports` picks the calls the kernels take, and the RHT kernels' sign mask and squared-error formula
reproduce the reference on CPU.

Run as a script on a GPU machine (``python tests/backends/test_gpu_nvfp4.py``) to time the RHT kernel path against the
torch path.
"""

import math

import pytest
import torch

from tedebug.backends import dispatch, torch_ref
from tedebug.quantization.nvfp4 import NVFP4Quantizer

from support.kernel_inputs import backend_pair

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
U = 2.0**-24  # fp32 unit roundoff
U64 = 2.0**-53  # fp64 unit roundoff
ERR_CHUNK = 32  # fp32 |x| - |deq|, square and 16-term fp32 sum per block before fp64 (nvfp4.cu): < 32 U
TINY_SQ = 2.0**-126  # squared errors below the fp32 normal range are lost by the fp32 per-element squares
FIELDS = (
    "rowwise_data",
    "rowwise_scale_inv",
    "amax_rowwise",
    "columnwise_data",
    "columnwise_scale_inv",
    "amax_columnwise",
)
# (M, K) or N-d shapes: one tile, partial tiles in both dims, 3-D, several tiles per block
SHAPES = [(16, 16), (64, 128), (48, 272), (2, 40, 96), (256, 1024), (1040, 2064)]


def special_values(dtype):
    """NVFP4's edges (no infinities: `adversarial` adds them on request): NaN of both signs, signed zeros,
    subnormals, the E2M1 maximum 6 and the global-scale constant 2688, the dtype's extremes."""
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    vals = [
        float("nan"),
        -float("nan"),
        0.0,
        -0.0,
        tiny / 4,
        -tiny / 2,
        tiny,
        448.0,
        -1000.0,
        2688.0,
        6.0,
        5.0,
        0.25,
        -0.75,
        2.0**-10,
        big,
        -big,
        1e-3,
        3.5,
    ]
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
    return backend_pair(lambda: NVFP4Quantizer(**kw), x)


def check_fields(got, ref):
    for field in FIELDS:
        a, b = getattr(got, field), getattr(ref, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, (field, a.shape, b.shape)
            # equal, or for fp32 fields (amaxes): NaN at the same places and equal values elsewhere
            nan = a.isnan() if a.dtype == torch.float32 else None
            assert torch.equal(a, b) or (
                nan is not None and torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
            ), (
                field,
                (a != b).sum().item(),
            )


def check_stats(x, got, ref, *, rht=False):
    """Fused statistics: underflows exact, squared error within the bound of the fp32 per-block sums.  With `rht`
    the columnwise squared error is computed per element in fp64 exactly as torch_ref's (x - inverse-rotated
    dequantization)^2 and summed in another order: both sums of n non-negative terms are within (n - 1) U64 of the
    exact sum, each term within U64 of its own."""
    assert getattr(got, "_fused_error_stats", None), "the kernel path must attach fused statistics"
    from tedebug.backends import cupy_stats

    for usage in ("rowwise", "columnwise"):
        if getattr(got, f"{usage}_data") is None:
            assert usage not in got._fused_error_stats
            continue
        fused = got._fused_error_stats[usage]
        uf = cupy_stats.underflow_partials(x, got, usage)["underflows_num"]
        assert uf is fused["underflows_num"]
        assert uf.item() == torch_ref.underflow_partials(x, ref, usage)["underflows_num"].item(), usage
        err_partial = cupy_stats.mse_partials(x, got, usage)["sq_err"]
        assert err_partial is fused["sq_err"]
        err = err_partial.item()
        want = torch_ref.mse_partials(x, ref, usage)["sq_err"].item()
        if rht and usage == "columnwise":
            bound = 2 * (x.numel() + 1) * U64 * abs(want)
        else:
            bound = ERR_CHUNK * U * abs(want) + x.numel() * TINY_SQ
        assert (math.isnan(err) and math.isnan(want)) or err == want or abs(err - want) <= bound, (usage, err, want)


# ================================================================================================ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rn_bit_identical_with_fused_stats(shape, dtype, usage):
    kw = {"both": {}, "rowwise": {"columnwise": False}, "columnwise": {"rowwise": False}}[usage]
    for x in (random_input(shape, dtype, 1), adversarial(shape, dtype, 2)):
        got, ref = pair(x, **kw)
        check_fields(got, ref)
        check_stats(x, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise_only_any_row_count(dtype):
    for shape in [(3, 32), (130, 48), (1, 2, 5, 16)]:
        x = adversarial(shape, dtype, 3)
        got, ref = pair(x, columnwise=False)
        check_fields(got, ref)
        check_stats(x, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 16), (48, 272), (256, 1024)])
def test_2d_bit_identical(shape, dtype):
    for kw in ({}, {"columnwise": False}, {"rowwise": False}):
        for x in (random_input(shape, dtype, 4), adversarial(shape, dtype, 5)):
            got, ref = pair(x, with_2d_quantization=True, **kw)
            check_fields(got, ref)
            check_stats(x, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 32), (48, 272), (256, 1024)])
def test_stochastic_rounding_bit_identical(shape, dtype):
    """Same seed -> same generator stream: the kernel consumes exactly the reference's random bits."""
    for kw in ({}, {"columnwise": False}, {"rowwise": False}, {"with_2d_quantization": True}):
        for x in (random_input(shape, dtype, 6), adversarial(shape, dtype, 7)):
            got, ref = pair(x, stochastic_rounding=True, seed=1234, **kw)
            check_fields(got, ref)
            check_stats(x, got, ref)


@pytest.mark.gpu
def test_stochastic_rounding_advances_the_generator_like_the_reference():
    x = random_input((64, 128), torch.bfloat16, 8)
    qk, qt = NVFP4Quantizer(stochastic_rounding=True, seed=9), NVFP4Quantizer(stochastic_rounding=True, seed=9)
    for _ in range(2):
        with dispatch.use_backend("cupy"):
            got = qk.quantize(x)
        with dispatch.use_backend("torch"):
            ref = qt.quantize(x)
        check_fields(got, ref)


@pytest.mark.gpu
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


# Shapes the fast kernel (ted_nvfp4_quantize16: bf16/fp16, 1D, M % 64 == 0, K % 128 == 0) takes: one tile,
# 3 x 3 tiles, 3-D, and 1024 tiles (more than the grid: every block walks several tiles across tile-row ends).
FAST_SHAPES = [(64, 128), (192, 384), (2, 64, 256), (1024, 8192)]


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("shape", FAST_SHAPES)
def test_fast_kernel_stochastic_rounding_bit_identical(shape, two_d, usage):
    """The NV_SR=1 compile of the fast kernel: the bytes of the torch path's Philox draws, rowwise and columnwise,
    1D and 2D, on random and adversarial inputs (NaN, Inf and the redo path included)."""
    from tedebug.backends import cupy_nvfp4

    kw = {"both": {}, "rowwise": {"columnwise": False}, "columnwise": {"rowwise": False}}[usage]
    kw.update(stochastic_rounding=True, seed=1234, with_2d_quantization=two_d)
    m, k = math.prod(shape[:-1]), shape[-1]
    assert cupy_nvfp4.takes_fast_kernel(m, k, torch.bfloat16, two_d, True)
    for x in (
        random_input(shape, torch.bfloat16, 31),
        adversarial(shape, torch.bfloat16, 32),
        adversarial(shape, torch.bfloat16, 33, True),
    ):
        got, ref = pair(x, **kw)
        check_fields(got, ref)
        check_stats(x, got, ref)


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_fast_kernel_needs_the_nonzero_count():
    from tedebug.backends import cupy_nvfp4

    x = random_input((64, 128), torch.bfloat16, 25)
    amaxes = torch.full((2,), 4.0, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="nonzero"):
        cupy_nvfp4.nvfp4_quantize_raw(x, amaxes, True, True)


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_dispatch_routing():
    x = random_input((64, 128), torch.bfloat16, 12)
    q = NVFP4Quantizer().quantize(x)  # auto: CUDA tensor + CuPy -> kernel
    assert getattr(q, "_fused_error_stats", None)
    with dispatch.use_backend("torch"):
        assert not getattr(NVFP4Quantizer().quantize(x), "_fused_error_stats", None)
    with dispatch.use_backend("cupy"):
        rht = NVFP4Quantizer(with_rht=True).quantize(x)  # the RHT kernels take it
        assert getattr(rht, "_fused_error_stats", None)
        with pytest.raises(ValueError, match="divisible by 16"):
            NVFP4Quantizer().quantize(random_input((20, 32), torch.bfloat16, 13))
        with pytest.raises(TypeError, match="float32/bfloat16/float16"):
            NVFP4Quantizer().quantize(x.double())
    with dispatch.use_backend("torch"):
        ref = NVFP4Quantizer(with_rht=True).quantize(x)
    check_fields(rht, ref)


@pytest.mark.gpu
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
    assert uses_fast_kernel(64, 128, torch.bfloat16, False, True)  # stochastic rounding: its NV_SR=1 compile
    assert not uses_fast_kernel(48, 128, torch.bfloat16, False, False)  # M % 64
    assert not uses_fast_kernel(64, 144, torch.bfloat16, False, False)  # K % 128
    assert not uses_fast_kernel(64, 2**24, torch.bfloat16, False, False)  # 32-bit offsets inside the kernel
    assert not uses_fast_kernel(2**24, 128, torch.bfloat16, False, False)


def test_supports_picks_the_calls_the_kernel_takes():
    from tedebug.backends import cupy_nvfp4

    x = torch.zeros(32, 64)
    assert cupy_nvfp4.supports(NVFP4Quantizer(), x)
    assert cupy_nvfp4.supports(NVFP4Quantizer(with_2d_quantization=True, stochastic_rounding=True, seed=0), x)
    assert cupy_nvfp4.supports(NVFP4Quantizer(with_rht=True), x)
    assert cupy_nvfp4.supports(NVFP4Quantizer(with_rht=True, stochastic_rounding=True, seed=0), x)
    assert not cupy_nvfp4.supports(NVFP4Quantizer(with_rht=True), torch.zeros(24, 64))
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), x.double())
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), torch.zeros(0, 64))
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), torch.zeros(24, 64))  # columnwise needs M % 16 == 0
    assert cupy_nvfp4.supports(NVFP4Quantizer(columnwise=False), torch.zeros(24, 64))
    assert not cupy_nvfp4.supports(NVFP4Quantizer(columnwise=False), torch.zeros(24, 40))
    assert not cupy_nvfp4.supports(NVFP4Quantizer(), torch.zeros(64))


# ================================================================================================ RHT
# Columnwise with the random Hadamard transform: rows keep the 1x16 kernels (fast-kernel shapes included), columns
# take ted_nvfp4_rht_amax + ted_nvfp4_rht_col.  Shapes: one group, the fast-kernel class, partial tiles, 3-D, several
# tiles per block.
RHT_SHAPES = [(16, 16), (64, 128), (48, 272), (2, 40, 96), (256, 1024), (1040, 2064), (1024, 8192)]
RHT_SPECIAL_SHAPES = [(16, 16), (64, 128), (48, 272), (256, 1024)]
RHT_SR_SHAPES = [(16, 32), (64, 128), (48, 272), (256, 1024)]


def rht_specials(shape, dtype, seed):
    """Adversarial values plus whole 16-row groups built to stress the rotation: a group aligned with the first
    RHT column (its y_0 = 4 * value overflows the dtype), an all-zero and an all-minus-zero group, a group of
    subnormals (subnormal y), a NaN, an Inf and opposite Infs (NaN in y), two maximal values that cancel exactly
    in every odd y_j.  No finite group mixes huge values with values they would absorb: there the reference's fp64
    matmul result depends on cuBLAS's summation order (see `test_rht_inputs_are_order_independent`)."""
    from tedebug.quantization.nvfp4 import RHT_SIGNS

    x = adversarial(shape, dtype, seed, with_inf=True)
    m, k = math.prod(shape[:-1]), shape[-1]
    x2 = x.view(m, k)
    fi = torch.finfo(dtype)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(seed))[:8].tolist()
    groups = torch.randint(0, m // 16, (8,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    rows = [slice(16 * g, 16 * g + 16) for g in groups]
    x2[rows[0], cols[0]] = (signs * (fi.max / 2)).to(dtype).to(x.device)  # y_0 = 2 max: overflow -> Inf
    x2[rows[1], cols[1]] = 0.0
    x2[rows[2], cols[2]] = -0.0
    sub = fi.tiny * torch.tensor([(-1) ** i * (i + 1) / 32 for i in range(16)])
    x2[rows[3], cols[3]] = sub.to(dtype).to(x.device)  # subnormal inputs (fp16: 2^-14 / 32 steps)
    x2[rows[4], cols[4]] = float("nan")
    x2[16 * groups[5] + 3, cols[5]] = float("inf")
    x2[16 * groups[6] + 1, cols[6]] = float("inf")
    x2[16 * groups[6] + 9, cols[6]] = -float("inf")
    x2[rows[7], cols[7]] = 0.0
    x2[16 * groups[7], cols[7]] = fi.max
    x2[16 * groups[7] + 1, cols[7]] = fi.max  # y_j = max/2 for even j, exactly 0 for odd j
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("usage", ["both", "columnwise", "rowwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RHT_SHAPES)
def test_rht_bit_identical_with_fused_stats(shape, dtype, usage):
    kw = {"both": {}, "rowwise": {"columnwise": False}, "columnwise": {"rowwise": False}}[usage]
    for x in (random_input(shape, dtype, 31), adversarial(shape, dtype, 32)):
        got, ref = pair(x, with_rht=True, **kw)
        assert got.columnwise_rht and ref.columnwise_rht
        check_fields(got, ref)
        check_stats(x, got, ref, rht=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RHT_SPECIAL_SHAPES)
def test_rht_special_groups(shape, dtype):
    """Overflowing rotations, zero / minus-zero / subnormal groups, NaN and Inf groups, cancelling huge values."""
    from tedebug.quantization.nvfp4 import apply_rht

    for seed in (33, 34):
        x = rht_specials(shape, dtype, seed)
        y = apply_rht(x.reshape(-1, shape[-1]).t(), out_dtype=dtype)
        assert y.isinf().any() and y.isnan().any()  # the inputs reach the intended cases
        got, ref = pair(x, with_rht=True)
        check_fields(got, ref)
        check_stats(x, got, ref, rht=True)
        got, ref = pair(x, with_rht=True, rowwise=False)
        check_fields(got, ref)
        check_stats(x, got, ref, rht=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rht_subnormal_rotations(dtype):
    """Groups whose rotated values are subnormal in the dtype (and in fp32): kept, not flushed, on both paths."""
    from tedebug.quantization.nvfp4 import apply_rht

    tiny = torch.finfo(dtype).tiny
    g = torch.Generator().manual_seed(35)
    x = (torch.randint(-64, 65, (64, 128), generator=g).float() * (tiny / 64)).to(dtype).to(DEV)
    y = apply_rht(x.t(), out_dtype=dtype)
    assert ((y != 0) & (y.abs() < tiny)).any()
    got, ref = pair(x, with_rht=True)
    check_fields(got, ref)
    check_stats(x, got, ref, rht=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RHT_SR_SHAPES)
def test_rht_stochastic_rounding_bit_identical(shape, dtype):
    """Same seed: the kernel path draws the rowwise bits, then the columnwise bits, as the reference does."""
    for kw in ({}, {"rowwise": False}, {"columnwise": False}):
        for x in (random_input(shape, dtype, 36), rht_specials(shape, dtype, 37)):
            got, ref = pair(x, with_rht=True, stochastic_rounding=True, seed=4321, **kw)
            check_fields(got, ref)
            check_stats(x, got, ref, rht=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rht_degenerate_amaxes(dtype):
    """All zeros (both amaxes 0), a single tiny value (S_enc clamped to FLT_MAX in both directions)."""
    zeros = torch.zeros(32, 64, dtype=dtype, device=DEV)
    tiny = zeros.clone()
    tiny[3, 5] = torch.finfo(dtype).tiny
    for x in (zeros, tiny):
        got, ref = pair(x, with_rht=True)
        check_fields(got, ref)
        check_stats(x, got, ref, rht=True)


@pytest.mark.gpu
def test_rht_deterministic():
    x = rht_specials((256, 1024), torch.bfloat16, 38)
    with dispatch.use_backend("cupy"):
        a = NVFP4Quantizer(with_rht=True).quantize(x)
        b = NVFP4Quantizer(with_rht=True).quantize(x)
    check_fields(a, b)
    for usage in ("rowwise", "columnwise"):
        for key in ("underflows_num", "sq_err"):
            va, vb = a._fused_error_stats[usage][key].item(), b._fused_error_stats[usage][key].item()
            assert va == vb or (math.isnan(va) and math.isnan(vb)), (usage, key, va, vb)
    y = random_input((256, 1024), torch.float32, 41)
    with dispatch.use_backend("cupy"):
        a, b = NVFP4Quantizer(with_rht=True).quantize(y), NVFP4Quantizer(with_rht=True).quantize(y)
    check_fields(a, b)
    sq = a._fused_error_stats["columnwise"]["sq_err"].item()
    assert sq == b._fused_error_stats["columnwise"]["sq_err"].item() and math.isfinite(sq) and sq > 0


# ------------------------------------------------------------------------------------------------ RHT, CPU
def test_rht_sign_mask_matches_the_reference_matrix():
    """The kernels' M[i][j] = (-1)^(bit i of the mask) * (-1)^popcount(i & j) / 4 is the reference's matrix."""
    from tedebug.backends.cupy_nvfp4 import rht_sign_mask
    from tedebug.quantization.nvfp4 import rht_matrix

    mask = rht_sign_mask()
    built = torch.tensor(
        [[(-1.0) ** ((mask >> i) & 1) * (-1.0) ** bin(i & j).count("1") / 4 for j in range(16)] for i in range(16)],
        dtype=torch.float64,
    )
    assert torch.equal(built, rht_matrix())
    assert 0 < mask < 2**16 and mask != 0xFFFF  # a mixed sign vector


def test_rht_error_formula_matches_the_reference_on_cpu():
    """ted_nvfp4_rht_col's squared error: per block, z = fp32(s_i / 4 * butterfly(deq)) and sum (x - z)^2 in fp64,
    where deq are the fp32 dequantized rotated values; equals torch_ref.mse_partials of the RHT tensor."""
    from tedebug.backends.cupy_nvfp4 import rht_sign_mask
    from tedebug.quantization.formats import E4M3, decode_e2m1, decode_fp8, unpack_fp4

    x = (torch.randn(64, 32, generator=torch.Generator().manual_seed(39)) * 5).to(torch.bfloat16)
    q = NVFP4Quantizer(with_rht=True, rowwise=False).quantize(x)
    amax = q.amax_columnwise.float()
    dscale = (decode_fp8(q.columnwise_scale_inv, E4M3) * amax) * torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    deq = decode_e2m1(unpack_fp4(q.columnwise_data)).reshape(32, 4, 16) * dscale.unsqueeze(-1)  # [K, M/16, 16]
    t = deq.double()
    h = 1
    while h < 16:  # Walsh-Hadamard butterflies: t[a], t[a + h] <- t[a] + t[a + h], t[a] - t[a + h]
        t = t.reshape(32, 4, 16 // (2 * h), 2, h)
        t = torch.stack((t[..., 0, :] + t[..., 1, :], t[..., 0, :] - t[..., 1, :]), dim=-2).reshape(32, 4, 16)
        h *= 2
    signs = torch.tensor([-0.25 if (rht_sign_mask() >> i) & 1 else 0.25 for i in range(16)], dtype=torch.float64)
    z = (t * signs).float().reshape(32, 64).t().contiguous()
    err = ((x.double() - z.double()) ** 2).sum()
    assert err.item() == torch_ref.mse_partials(x, q, "columnwise")["sq_err"].item()


def _order_sensitive_outputs(x: torch.Tensor) -> int:
    """How many finite rotated values of `x` (in its dtype) change when the fp64 group sums run in another order
    (reversed, or two interleaved accumulators) instead of i = 0..15."""
    from tedebug.quantization.nvfp4 import rht_matrix

    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    terms = x.reshape(m // 16, 16, k).permute(0, 2, 1).double().unsqueeze(-1) * rht_matrix()  # [G, K, i, j]
    seq, rev, even, odd = (torch.zeros_like(terms[:, :, 0]) for _ in range(4))
    for i in range(16):
        seq = seq + terms[:, :, i]
        rev = rev + terms[:, :, 15 - i]
        even, odd = (even + terms[:, :, i], odd) if i % 2 == 0 else (even, odd + terms[:, :, i])
    finite = torch.isfinite(terms).all(dim=2)
    base = seq.float().to(x.dtype)
    changed = [(other.float().to(x.dtype) != base) & ~base.isnan() for other in (rev, even + odd)]
    return int(((changed[0] | changed[1]) & finite).sum())


def test_rht_inputs_are_order_independent(monkeypatch):
    """The GPU tests' special inputs avoid groups whose rotation depends on the fp64 summation order (huge values
    absorbing small ones before cancelling): there the reference follows cuBLAS's order, which is not specified.
    The check itself finds such a group when one is built."""
    monkeypatch.setitem(globals(), "DEV", torch.device("cpu"))
    used = [(shape, seed) for shape in RHT_SPECIAL_SHAPES for seed in (33, 34)]  # test_rht_special_groups
    used += [(shape, 37) for shape in RHT_SR_SHAPES] + [((256, 1024), 38)]  # stochastic rounding, determinism
    for dtype in DTYPES:
        for shape, seed in used:
            assert _order_sensitive_outputs(rht_specials(shape, dtype, seed)) == 0, (shape, dtype, seed)
    x = torch.zeros(16, 16)
    x[0, 3], x[1, 3], x[2:, 3] = 3e38, 3e38, 1.0  # 3e38/4 absorbs the ones unless it cancels first
    assert _order_sensitive_outputs(x) > 0
    assert _order_sensitive_outputs(x.half()) == 0  # fp16 sums are exact in fp64: never order-dependent


def _time_rht(m=8192, k=8192, dtype=torch.bfloat16, reps=20):
    """Mean milliseconds of an RHT row + column quantization on the kernel path and on the torch path."""
    x = random_input((m, k), dtype, 40)
    times = {}
    for backend in ("cupy", "torch"):
        with dispatch.use_backend(backend):
            NVFP4Quantizer(with_rht=True).quantize(x)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                NVFP4Quantizer(with_rht=True).quantize(x)
            end.record()
            torch.cuda.synchronize()
            times[backend] = start.elapsed_time(end) / reps
    return times


if __name__ == "__main__":
    for dt in (torch.bfloat16, torch.float32):
        print(f"RHT row+col 8192x8192 {dt}: ms per quantize", _time_rht(dtype=dt))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"with_2d_quantization": True},
        {"stochastic_rounding": True, "seed": 7},
        {"with_rht": True},
        {"with_rht": True, "stochastic_rounding": True, "seed": 7},
        {"with_rht": True, "rowwise": False},
    ],
)
def test_without_error_statistics_the_bytes_are_the_same(options):
    """A quantizer with `error_stats` off keeps no statistics (the kernels write them to a scratch slot) and gives the
    same codes, scales and amaxes as one computing them."""
    x = adversarial((256, 512), torch.bfloat16, 31)
    with dispatch.use_backend("cupy"):
        on = NVFP4Quantizer(**options).quantize(x)
        quiet = NVFP4Quantizer(**options)
        quiet.error_stats = False
        off = quiet.quantize(x)
        again = NVFP4Quantizer(**options).quantize(x)  # the scratch slot does not disturb a later quantization
    check_fields(off, on)
    check_fields(again, on)
    assert not off._fused_error_stats.get("rowwise") and not off._fused_error_stats.get("columnwise")
    fused, later = on._fused_error_stats, again._fused_error_stats
    assert fused.get("columnwise")  # every option set quantizes columnwise: the loop below checks something
    if options.get("rowwise", True):
        assert fused.get("rowwise")
    for usage in ("rowwise", "columnwise"):
        for key, value in (fused.get(usage) or {}).items():  # the same bits (NaN included)
            assert torch.equal(value.view(torch.int64), later[usage][key].view(torch.int64)), (usage, key)
