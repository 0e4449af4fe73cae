"""GPU kernels (CuPy) against the torch reference path: bit-identical quantized bytes and scales, exact extrema and
counts, sums within a stated bound of a float64 oracle, determinism.  Every test needs CUDA and CuPy."""

import math

import pytest
import torch

from tedebug.backends import cupy_fp8_tensor, cupy_stats, dispatch, fused_stats, torch_ref
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer

from support.kernel_inputs import special_values

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
U = 2.0**-24  # fp32 unit roundoff
CHUNK = 16  # elements summed in fp32 before the fp64 accumulation (kernels/stats.cu)
ERR_CHUNK = 32  # squared errors summed in fp32 per thread chunk before fp64 (mxfp8.cu, fp8_tensor.cu)
TINY_SQ = 2.0**-126  # squared errors below the fp32 normal range are lost by the fp32 per-element squares


def adversarial(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    x = x.to(dtype).reshape(-1)
    sp = special_values(dtype)
    idx = torch.randint(0, x.numel(), (min(x.numel(), 64),), generator=g)
    x[idx] = sp[torch.randint(0, sp.numel(), idx.shape, generator=g)]
    if x.numel() >= 64:
        x[:32] = 0.0  # an all-zero block
    return x.reshape(shape).to(DEV)


def random_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)


def finite_input(shape, dtype, seed):
    x = adversarial(shape, dtype, seed).float()
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    return x.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN."""
    a, b = a.double().cpu(), b.double().cpu()
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


# ------------------------------------------------------------------------------------------------ statistics
EXACT = ("min", "max", "amax", "nz_abs_min", "nz_abs_max", "nonzero_count", "nan_count", "inf_count")
STATS_SHAPES = [(1,), (7,), (33, 17), (4099,), (257, 129), (3, 1000, 37), (4096, 1025)]  # last: unrolled loop


def check_stats(x):
    got = cupy_stats.basic_partials(x)
    ref = torch_ref.basic_partials(x)
    for key in EXACT:
        assert same(got[key], ref[key]), (key, got[key].item(), ref[key].item())
    x64 = x.double().reshape(-1)
    finite = bool(torch.isfinite(x64).all())
    abs_sum = x64.abs().sum().item()
    bound = CHUNK * U * abs_sum + 1e-300
    if finite:
        assert abs(got["sum"].item() - x64.sum().item()) <= bound
        assert abs(got["abs_sum"].item() - abs_sum) <= bound
        sq = (x64 * x64).sum().item()
        assert abs(got["sq_sum"].item() - sq) <= CHUNK * U * sq + 1e-300
        mean = x64.mean()
        m2 = ((x64 - mean) ** 2).sum().item()
        assert abs(got["m2"].item() - m2) <= 1e-5 * m2 + 1e-300, (got["m2"].item(), m2)
    else:
        for key in ("sum", "abs_sum", "sq_sum", "m2"):
            assert same(got[key], ref[key]) or (
                math.isfinite(ref[key].item()) and abs(got[key].item() - ref[key].item()) <= bound
            ), key


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", STATS_SHAPES)
def test_basic_stats_random_and_adversarial(dtype, shape):
    check_stats(random_input(shape, dtype, 1))
    check_stats(adversarial(shape, dtype, 2))
    check_stats(finite_input(shape, dtype, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_basic_stats_special_values_only(dtype):
    check_stats(special_values(dtype).to(DEV))
    check_stats(torch.zeros(1000, dtype=dtype, device=DEV))
    check_stats(-torch.zeros(5, dtype=dtype, device=DEV))
    check_stats(torch.full((77,), float("inf"), dtype=dtype, device=DEV))


def test_stats_catastrophic_cancellation():
    g = torch.Generator().manual_seed(5)
    x = (1e4 + 1e-3 * torch.randn(1 << 20, generator=g, dtype=torch.float64)).float().to(DEV)
    got = cupy_stats.basic_partials(x)
    x64 = x.double()
    m2 = ((x64 - x64.mean()) ** 2).sum().item()
    assert m2 > 0
    assert abs(got["m2"].item() - m2) <= 1e-5 * m2
    std = math.sqrt(got["m2"].item() / (x.numel() - 1))
    assert abs(std - x64.std().item()) <= 1e-5 * x64.std().item()


def test_stats_unaligned_and_strided_inputs():
    base = random_input((4096 + 1,), torch.bfloat16, 7)
    check_stats(base[1:])  # data pointer not 16-byte aligned
    m = random_input((64, 96), torch.float16, 8)
    check_stats(m.t())  # non-contiguous


def test_stats_deterministic():
    x = random_input((3000, 1001), torch.bfloat16, 9)
    a = cupy_stats.basic_stats_tensor(x)
    b = cupy_stats.basic_stats_tensor(x)
    assert torch.equal(a.view(torch.int64), b.view(torch.int64))


def test_stats_through_dispatch():
    x = random_input((64, 64), torch.bfloat16, 10)
    with dispatch.use_backend("auto"):
        assert dispatch.stats_backend(x) is cupy_stats
    with dispatch.use_backend("torch"):
        assert dispatch.stats_backend(x) is torch_ref
    with dispatch.use_backend("cupy"):
        with pytest.raises(RuntimeError, match="CPU|cpu"):
            dispatch.stats_backend(x.cpu())


def test_a_quantizer_kernel_argument_wins_over_the_default():
    """kernel= at construction picks the path of a CUDA tensor whatever use_backend says; both paths give the same
    bytes (the kernel path is recognisable by the fused statistics it attaches)."""
    x = random_input((64, 128), torch.bfloat16, 11)
    with dispatch.use_backend("torch"):
        kernel_q = MXFP8Quantizer(kernel=dispatch.KernelPreference.CUPY).quantize(x)
        assert dispatch.stats_backend(x, "cupy") is cupy_stats
    with dispatch.use_backend("cupy"):
        torch_q = MXFP8Quantizer(kernel="torch").quantize(x)
        assert dispatch.stats_backend(x, dispatch.KernelPreference.TORCH) is torch_ref
    assert hasattr(kernel_q, "_fused_error_stats") and not hasattr(torch_q, "_fused_error_stats")
    for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(kernel_q, field), getattr(torch_q, field)), field


# ------------------------------------------------------------------------------------------------ MXFP8
# 16-bit inputs use the tiled kernel (32 x 256 tiles, partial last tile when K % 256 != 0, several tiles per block
# for the last shape); fp32 inputs use the general kernel.
MX_SHAPES = [(32, 32), (64, 96), (96, 160), (2, 48, 64), (256, 4096), (64, 800), (1024, 4096)]


def mx_pair(x, fmt):
    with dispatch.use_backend("cupy"):
        got = MXFP8Quantizer(fmt).quantize(x)
    with dispatch.use_backend("torch"):
        ref = MXFP8Quantizer(fmt).quantize(x)
    return got, ref


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MX_SHAPES)
def test_mxfp8_bit_identical(fmt, dtype, shape):
    for x in (random_input(shape, dtype, 11), adversarial(shape, dtype, 12)):
        got, ref = mx_pair(x, fmt)
        for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            a, b = getattr(got, field), getattr(ref, field)
            assert a.shape == b.shape and torch.equal(a, b), (field, (a != b).sum().item())
        for usage in ("rowwise", "columnwise"):
            uf = cupy_stats.underflow_partials(x, got, usage)["underflows_num"]
            assert uf.item() == torch_ref.underflow_partials(x, ref, usage)["underflows_num"].item()
            err = cupy_stats.mse_partials(x, got, usage)["sq_err"].item()
            want = torch_ref.mse_partials(x, ref, usage)["sq_err"].item()
            assert (
                (math.isnan(err) and math.isnan(want))
                or err == want
                or abs(err - want) <= ERR_CHUNK * U * abs(want) + x.numel() * TINY_SQ
            )


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_single_direction_and_deterministic(dtype):
    x = adversarial((128, 512), dtype, 13)
    with dispatch.use_backend("torch"):
        ref = MXFP8Quantizer("E4M3").quantize(x)
    for usage in ("rowwise", "columnwise"):
        kw = {"columnwise": False} if usage == "rowwise" else {"rowwise": False}
        with dispatch.use_backend("cupy"):
            one = MXFP8Quantizer("E4M3", **kw).quantize(x)
            again = MXFP8Quantizer("E4M3", **kw).quantize(x)
        other = "columnwise" if usage == "rowwise" else "rowwise"
        assert getattr(one, f"{other}_data") is None
        for field in (f"{usage}_data", f"{usage}_scale_inv"):
            assert torch.equal(getattr(one, field), getattr(ref, field)), field
            assert torch.equal(getattr(one, field), getattr(again, field)), field
        uf = cupy_stats.underflow_partials(x, one, usage)["underflows_num"].item()
        assert uf == torch_ref.underflow_partials(x, ref, usage)["underflows_num"].item()
        assert same(one._fused_error_stats[usage]["sq_err"], again._fused_error_stats[usage]["sq_err"])
        err = one._fused_error_stats[usage]["sq_err"].item()
        want = torch_ref.mse_partials(x, ref, usage)["sq_err"].item()
        assert (math.isnan(err) and math.isnan(want)) or abs(err - want) <= ERR_CHUNK * U * abs(
            want
        ) + x.numel() * TINY_SQ


# ------------------------------------------------------------------------------------------------ per-tensor FP8
# 16-bit inputs with M % 64 == 0 and K % 128 == 0 use the tiled cast + transpose ((64, 128), (2, 64, 256), and
# (2048, 4096) with several tiles per block); the others and fp32 use the general kernel.
FP8_SHAPES = [(1, 1), (3, 5), (65, 63), (130, 257), (64, 128), (2, 3, 70), (2, 64, 256), (2048, 4096)]


def check_fp8(got, ref, x):
    assert torch.equal(got.scale_inv.reshape(()), ref.scale_inv.reshape(()))
    for usage in ("rowwise", "columnwise"):  # the scale_inv partials and the count both casts write
        fused = fused_stats.fused_vector(got, x, usage)
        assert fused is not None and fused.keys_in_order == tuple(fused_stats.FP8_STATS_WITH_SCALE)
        for key, want in torch_ref.scale_inv_partials(ref, usage).items():
            assert same(fused[key], want), (usage, key, fused[key].item(), want.item())
        assert fused["numel"].item() == x.numel()
    assert torch.equal(got.rowwise_data, ref.rowwise_data), (got.rowwise_data != ref.rowwise_data).sum().item()
    assert torch.equal(got.columnwise_data, ref.columnwise_data)
    for usage in ("rowwise", "columnwise"):
        assert got.nonzero_code_count(usage).item() == ref.nonzero_code_count(usage).item()
        uf = cupy_stats.underflow_partials(x, got, usage)["underflows_num"].item()
        assert uf == torch_ref.underflow_partials(x, ref, usage)["underflows_num"].item()
        of = cupy_stats.overflow_partials(x, got, usage)["overflows_num"].item()
        assert of == torch_ref.overflow_partials(x, ref, usage)["overflows_num"].item()
        err = cupy_stats.mse_partials(x, got, usage)["sq_err"].item()
        want = torch_ref.mse_partials(x, ref, usage)["sq_err"].item()
        assert (
            (math.isnan(err) and math.isnan(want))
            or err == want
            or abs(err - want) <= ERR_CHUNK * U * abs(want) + x.numel() * TINY_SQ
        )


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_current_scaling_bit_identical(fmt, dtype, shape):
    for pow2 in (False, True):
        for x in (random_input(shape, dtype, 21), adversarial(shape, dtype, 22), finite_input(shape, dtype, 23)):
            with dispatch.use_backend("cupy"):
                got = Float8CurrentScalingQuantizer(fmt, force_pow_2_scales=pow2).quantize(x)
            with dispatch.use_backend("torch"):
                ref = Float8CurrentScalingQuantizer(fmt, force_pow_2_scales=pow2).quantize(x)
            check_fp8(got, ref, x)


@pytest.mark.parametrize("shape, dtype", [((4, 8), torch.float32), ((64, 128), torch.bfloat16)])  # both casts
def test_fp8_current_scaling_tiny_and_zero_amax(shape, dtype):
    """A zero amax, and a tiny one whose scale_inv is subnormal in fp32 (its scale_inv partials exact, not flushed)."""
    for value in (0.0, 1e-40):
        x = torch.full(shape, value, device=DEV, dtype=dtype)
        with dispatch.use_backend("cupy"):
            got = Float8CurrentScalingQuantizer("E4M3").quantize(x)
        with dispatch.use_backend("torch"):
            ref = Float8CurrentScalingQuantizer("E4M3").quantize(x)
        check_fp8(got, ref, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8 * 256 * 7 + 5, 3 * 2**20 + 3])
def test_amax_count_pass(dtype, n):
    """ted_amax_count (NVFP4's amax pass): max|x| (NaN ignored) in both slots and count_nonzero(x) (NaN counts,
    -0 does not), for sizes that end in the partial last round and in the scalar tail; the plain amax launch
    beside it gives the same amax."""
    x = adversarial((n,), dtype, 41 + n)
    if n >= 8:
        x[1::3] = 0.0
        x[2::5] = -0.0
    amaxes = torch.empty(2, dtype=torch.float32, device=DEV)
    count = torch.full((1,), -1, dtype=torch.int64, device=DEV)
    cupy_fp8_tensor.amax_launch(x, amaxes, count_out=count)
    plain = torch.empty(1, dtype=torch.float32, device=DEV)
    cupy_fp8_tensor.amax_launch(x, plain)
    ref = x.float().abs().nan_to_num(nan=0.0, posinf=float("inf")).max()
    assert amaxes[0].item() == amaxes[1].item() == plain[0].item() == ref.item()
    assert count.item() == torch.count_nonzero(x).item()
    cupy_fp8_tensor.amax_launch(x, amaxes, count_out=count)  # the running count was reset by the last block
    assert count.item() == torch.count_nonzero(x).item()
    with pytest.raises(ValueError, match="int64"):
        cupy_fp8_tensor.amax_launch(x, amaxes, count_out=count.int())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(70, 130), (128, 256)])
def test_fp8_delayed_scaling_bit_identical(dtype, shape):
    x = adversarial(shape, dtype, 31)
    quantizers = []
    for backend in ("cupy", "torch"):
        q = Float8Quantizer.from_recipe_defaults("E4M3", 4, device=DEV)
        q.scale.fill_(300.0)  # stale, too large: overflows
        with dispatch.use_backend(backend):
            quantizers.append((q, q.quantize(x)))
    (qg, got), (qr, ref) = quantizers
    assert torch.equal(qg.amax_history, qr.amax_history)
    check_fp8(got, ref, x)
    assert cupy_stats.overflow_partials(x, got, "rowwise")["overflows_num"].item() > 0


def test_kernels_reject_cpu_tensor():
    with pytest.raises(ValueError, match="CUDA tensor"):
        cupy_stats.basic_stats_tensor(torch.ones(4))


def test_quantized_statistics_row_is_one_gather_of_the_cast_vector():
    """LogFp8TensorStats' row (underflows%, mse, scale_inv_min/max, rowwise and columnwise) on either cast (the
    single-launch 16-bit one; the general one, for fp32 and for shapes off the 16-bit tiles) equals the torch path's,
    and comes from the kernel's vector without the torch reference."""
    from support.features import RecordingSink
    from tedebug.stats import StatRequest
    from tedebug.stats.engine import StatsEngine

    requests = {
        usage: tuple(
            StatRequest(f"{stat}{suffix}", stat, columnwise=usage == "columnwise")
            for stat in ("underflows%", "mse", "scale_inv_min", "scale_inv_max")
        )
        for usage, suffix in (("rowwise", ""), ("columnwise", "_columnwise"))
    }
    g = torch.Generator().manual_seed(5)
    xs = [(torch.randn(256, 512, generator=g) * s).to(DEV, torch.bfloat16) for s in (1.0, 1e-4, 300.0)]
    xs.append(finite_input((128, 256), torch.bfloat16, 9))
    general = [
        torch.randn(96, 200, generator=g).to(DEV),
        (torch.randn(65, 63, generator=g) * 3).to(DEV, torch.bfloat16),
    ]
    xs += general  # fp32, and 16-bit off the tiles: the general cast
    emitted = {}
    for backend in ("torch", "cupy"):
        sink = RecordingSink()
        engine = StatsEngine(sink)
        with dispatch.use_backend(backend):
            for i, x in enumerate(xs):
                q = Float8CurrentScalingQuantizer("E4M3").quantize(x)
                for usage, reqs in requests.items():
                    engine.feed(f"l{i}", "activation", reqs, x, iteration=0, options=(usage,), quantized={"": q})
            if backend == "cupy":  # the fused row does not fall back to the torch reference

                def refuse(*args):
                    raise AssertionError("torch reference used")

                real = torch_ref.scale_inv_partials
                torch_ref.scale_inv_partials = refuse
                try:
                    for j, x in enumerate([xs[0]] + general):
                        q = Float8CurrentScalingQuantizer("E4M3").quantize(x)
                        for usage, reqs in requests.items():
                            engine.feed(
                                f"probe{j}", "activation", reqs, x, iteration=0, options=(usage,), quantized={"": q}
                            )
                finally:
                    torch_ref.scale_inv_partials = real
            engine.step(0)
        emitted[backend] = [r for r in sink.rows if not r[0].startswith("probe")]
    assert len(emitted["torch"]) == len(xs) * 8
    for (name, ref, it), (name2, got, it2) in zip(emitted["torch"], emitted["cupy"]):
        assert (name, it) == (name2, it2)
        if name.endswith("mse") or name.endswith("mse_columnwise"):
            assert got == pytest.approx(ref, rel=ERR_CHUNK * U, abs=1e-300), name
        else:
            assert got == ref or (math.isnan(got) and math.isnan(ref)), name


@pytest.mark.parametrize("delayed", [False, True])
def test_fp8_quantize_plans_once_per_shape_and_takes_any_input_layout(monkeypatch, delayed):
    """The per-tensor FP8 kernel path works out its kernels and grids once per (device, dtype, shape, format)
    (`cupy_fp8_tensor._cast_plan`): quantizing the same shape again looks up no kernel.  Inputs the kernels cannot
    read by address as they are (a transposed view, a 16-byte misaligned view) and a 3-D input give the bytes and
    scale_inv of their contiguous 2-D copy."""
    base = adversarial((96, 256), torch.bfloat16, 51)

    def quantize(x):
        if delayed:
            q = Float8Quantizer.from_recipe_defaults("E4M3", 4, device=DEV)
            q.scale.fill_(3.0)
        else:
            q = Float8CurrentScalingQuantizer("E4M3")
        with dispatch.use_backend("cupy"):
            return q.quantize(x)

    cupy_fp8_tensor._CAST_PLANS.clear()
    quantize(base)  # plans the shape
    asked = []
    real = cupy_fp8_tensor.get_kernel
    monkeypatch.setattr(cupy_fp8_tensor, "get_kernel", lambda *a: asked.append(a) or real(*a))
    again = quantize(base)  # (the same tensor: check_fp8 below reads the statistics fused for it)
    assert asked == []
    transposed = base.t().contiguous().t()  # same values, column-major strides
    storage = torch.empty(base.numel() + 1, dtype=base.dtype, device=DEV)
    misaligned = storage[1:].view(base.shape)  # 2-byte offset
    misaligned.copy_(base)
    for x in (transposed, misaligned, base.reshape(8, 12, 256)):
        got = quantize(x)
        assert torch.equal(got.rowwise_data.reshape(base.shape), again.rowwise_data)
        assert torch.equal(got.columnwise_data, again.columnwise_data)
        assert torch.equal(got.scale_inv, again.scale_inv)
    with dispatch.use_backend("torch"):
        ref = Float8CurrentScalingQuantizer("E4M3").quantize(base) if not delayed else None
    if ref is not None:
        check_fp8(again, ref, base)
