"""The rewritten RHT kernels of kernels/nvfp4.cu against the first ones (v1, `reference=True`), and no
local memory in any NVFP4 kernel.  GPU tests (marked gpu, skipped without CUDA + CuPy).

Both RHT versions sum a group's rotation in the order i = 0..15 wherever the fp64 sum is not provably exact, so
they agree bit for bit on every input, including groups whose reference result depends on cuBLAS's order (which
tests/backends/test_gpu_nvfp4.py has to avoid): column data, scale codes, the rotated amax and the underflow count; the
fp64 squared error is summed over other blocks, so it agrees within 2 (n + 1) fp64 roundings.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
U64 = 2.0**-53
# one group; M % 32 != 0 (8-byte column-data stores); partial group and column tiles; several tiles per block
SHAPES = [(16, 16), (48, 272), (1040, 2064), (4096, 1024)]


def wide_input(shape, dtype, seed):
    """Values over ~80 binades, ~32 for fp16 (every rotation path: fp32 and fp64 butterflies, sequential sums),
    zeros, NaN, Inf."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-20, 12) if dtype == torch.float16 else (-40, 40)  # fp16: mostly finite
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(lo, hi, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.05] = 0.0
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (3,), generator=g)
    flat[idx[0]], flat[idx[1]], flat[idx[2]] = float("nan"), float("inf"), -float("inf")
    return x.to(dtype).cuda()


def rht(x, variant, sr):
    from tedebug.backends import cupy_nvfp4

    amax = torch.zeros(2, dtype=torch.float32, device=x.device)
    data, scales, stats = cupy_nvfp4.nvfp4_rht_columnwise(x, amax, sr, reference=variant == "old")
    return data, scales, amax[1].clone(), stats


@pytest.mark.parametrize("sr", [None, (4321, 5)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_new_rht_kernels_equal_v1(shape, dtype, sr):
    for seed in (1, 2):
        x = wide_input(shape, dtype, seed)
        new = rht(x, "new", sr)
        old = rht(x, "old", sr)
        for a, b, name in zip(new[:3], old[:3], ("data", "scales", "amax")):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
                name,
                (a != b).sum().item(),
            )
        assert new[3][0].item() == old[3][0].item()  # underflows: exact counts
        err, want = new[3][1].item(), old[3][1].item()
        assert (
            err == want
            or (math.isnan(err) and math.isnan(want))
            or abs(err - want) <= 2 * (x.numel() + 1) * U64 * abs(want)
        ), (err, want)


@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_kernels_use_no_local_memory(dtype, sr):
    """Spills or dynamically indexed arrays (local memory) were seen to make launches blocking on the H200 host."""
    from tedebug.backends.cupy_runtime import get_kernel
    from tedebug.backends.cupy_nvfp4 import _general_options

    x = torch.zeros(64, 128, dtype=dtype, device="cuda")
    names = ["ted_nvfp4_quantize", "ted_nvfp4_rht_amax", "ted_nvfp4_rht_col"]
    if dtype != torch.float32 and not sr:
        names.append("ted_nvfp4_quantize16")
    for name in names:
        raw = get_kernel("nvfp4.cu", name, _general_options(x, sr)).raw(torch.cuda.current_device())
        assert raw.local_size_bytes == 0, (name, dtype, sr, raw.local_size_bytes, raw.num_regs)


def _time_rht_columnwise(shape, dtype, variant, sr=None, reps=20):
    """Mean microseconds of one `nvfp4_rht_columnwise` call (amax pass, quantize, partial sums) for `variant`."""
    from tedebug.backends import cupy_nvfp4

    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype).cuda()
    amax = torch.zeros(2, dtype=torch.float32, device=x.device)
    reference = variant == "old"
    cupy_nvfp4.nvfp4_rht_columnwise(x, amax, sr, reference=reference)  # compile, warm up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        cupy_nvfp4.nvfp4_rht_columnwise(x, amax, sr, reference=reference)
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


if __name__ == "__main__":
    # old vs new RHT kernels in one run: python tests/backends/test_gpu_nvfp4_rht_kernels.py
    for shape in ((8192, 2048), (8192, 6144), (8192, 8192)):
        for sr in (None, (1234, 0)):
            times = {v: _time_rht_columnwise(shape, torch.bfloat16, v, sr) for v in ("old", "new")}
            print(
                f"nvfp4_rht_columnwise bf16 {shape} sr={sr is not None}: "
                + ", ".join(f"{v} {t:.1f} us" for v, t in times.items())
            )


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", [(64, 128), (128, 1024), (1024, 640)])
def test_fast_2d_kernel_bit_identical(shape, dtype):
    """ted_nvfp4_quantize16 compiled for 16x16 tiles (NQ_2D=1) against the torch reference: data, scales, amaxes;
    underflows exact, squared errors within the fp32 per-block sums' bound (32 U relative)."""
    from tedebug.backends import cupy_nvfp4, dispatch, torch_ref
    from tedebug.quantization.nvfp4 import NVFP4Quantizer

    assert cupy_nvfp4.uses_fast_2d_kernel(*shape, dtype, True, False)
    for seed, with_inf in ((11, False), (12, True)):
        x = wide_input(shape, dtype, seed)
        if not with_inf:
            x = torch.where(x.isinf(), torch.zeros_like(x), x)
        for kw in ({}, {"columnwise": False}, {"rowwise": False}):
            with dispatch.use_backend("cupy"):
                got = NVFP4Quantizer(with_2d_quantization=True, **kw).quantize(x)
            with dispatch.use_backend("torch"):
                ref = NVFP4Quantizer(with_2d_quantization=True, **kw).quantize(x)
            for usage in ("rowwise", "columnwise"):
                if getattr(ref, f"{usage}_data") is None:
                    continue
                for field in (f"{usage}_data", f"{usage}_scale_inv", f"amax_{usage}"):
                    assert torch.equal(getattr(got, field), getattr(ref, field)), (usage, field)
                fused = got._fused_error_stats[usage]
                want_uf = torch_ref.underflow_partials(x, ref, usage)["underflows_num"].item()
                assert fused["underflows_num"].item() == want_uf, usage
                err, want = fused["sq_err"].item(), torch_ref.mse_partials(x, ref, usage)["sq_err"].item()
                assert (
                    (math.isnan(err) and math.isnan(want))
                    or err == want
                    or abs(err - want) <= 32 * 2.0**-24 * abs(want) + x.numel() * 2.0**-126
                ), (usage, err, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 16), (48, 272), (1040, 2064)])
def test_rht_amax_pass_also_gives_the_rowwise_amax_and_count(shape, dtype):
    """ted_nvfp4_rht_amax with the rowwise slots: max|x| (NaN ignored) and count_nonzero(x) as torch computes them,
    the rotated amax unchanged."""
    from tedebug.backends import cupy_nvfp4
    from tedebug.quantization.formats import abs_ignoring_nan

    for seed in (3, 4):
        x = wide_input(shape, dtype, seed)
        alone = torch.zeros(2, dtype=torch.float32, device=x.device)
        cupy_nvfp4.nvfp4_rht_amax(x, alone)
        both = torch.full((2,), 7.0, dtype=torch.float32, device=x.device)  # the pass zeroes the slots itself
        nonzero = torch.full((1,), 5, dtype=torch.int64, device=x.device)
        cupy_nvfp4.nvfp4_rht_amax(x, both, rowwise=True, nonzero=nonzero)
        assert both[1].item() == alone[1].item()
        assert both[0].item() == abs_ignoring_nan(x.float()).amax().item()
        assert nonzero.item() == torch.count_nonzero(x).item()


@pytest.mark.parametrize("sr", [None, (4321, 5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rht_kernel_without_statistics_writes_the_same_bytes(dtype, sr):
    """`stats=False` (the -DNR_STATS=0 build, no inverse rotation): the same column data and scales, no statistics;
    a quantizer with `error_stats=False` carries no columnwise statistics and the same fields."""
    from tedebug.backends import cupy_nvfp4
    from tedebug.quantization.nvfp4 import NVFP4Quantizer

    x = wide_input(SHAPES[-1], dtype, 3)
    amax = torch.zeros(2, dtype=torch.float32, device=x.device)
    with_stats = cupy_nvfp4.nvfp4_rht_columnwise(x, amax, sr)
    without = cupy_nvfp4.nvfp4_rht_columnwise(x, amax.clone(), sr, stats=False)
    assert with_stats[2] is not None and without[2] is None
    assert torch.equal(with_stats[0], without[0]) and torch.equal(with_stats[1], without[1])
    kw = dict(with_rht=True, stochastic_rounding=sr is not None, seed=7)
    full, lean = NVFP4Quantizer(**kw), NVFP4Quantizer(**kw)
    lean.error_stats = False
    a, b = full.quantize(x), lean.quantize(x)
    assert "columnwise" in a._fused_error_stats and "columnwise" not in b._fused_error_stats
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_rht_quantizations_across_zeroed_chunks_equal_the_torch_path():
    """The RHT path with both directions takes its amax / count slots from pre-zeroed chunks (`_zeroed_pair`): more
    quantizations than one chunk holds, each keeping its slots (the tensors stay alive), give the torch path's
    amaxes and bytes; the slots are distinct rows."""
    from tedebug.backends import cupy_nvfp4, dispatch
    from tedebug.quantization.nvfp4 import NVFP4Quantizer

    xs = [wide_input((32, 64), torch.bfloat16, seed) for seed in range(4)]
    kept = []
    with dispatch.use_backend("cupy"):
        for i in range(cupy_nvfp4.ZERO_CHUNK + 5):
            kept.append(NVFP4Quantizer(with_rht=True).quantize(xs[i % len(xs)]))
    with dispatch.use_backend("torch"):
        refs = [NVFP4Quantizer(with_rht=True).quantize(x) for x in xs]
    pointers = {q.amax_rowwise.data_ptr() for q in kept}
    assert len(pointers) == len(kept)
    for i, q in enumerate(kept):
        ref = refs[i % len(xs)]
        for field in ("amax_rowwise", "amax_columnwise", "rowwise_data", "columnwise_data", "columnwise_scale_inv"):
            got, want = getattr(q, field), getattr(ref, field)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (i, field)
