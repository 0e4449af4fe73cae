"""Delayed scaling in one launch (``ted_fp8_delayed_cast16``: the cast records max|x| into the history, and the block
that finishes the statistics writes the entry and scale_inv): on the 16-bit fast shape its codes, history entry,
scale_inv and statistics vector are bit for bit those of the two launches (``ted_fp8_amax_scale`` in its recording
mode, then ``ted_fp8_cast_transpose16``), launch after launch on one stream (its amax slot is left at 0); with the
statistics pass (``ted_fp8_delayed_stats_cast16``, for a tensor that is also logged) the same, and the basic
statistics row is a lone statistics launch's; and it is the path a delayed-scaling quantization takes there: one
launch, two on the other shapes.  Every test needs CUDA and CuPy."""

import pytest
import torch

from tedebug.backends import cupy_fp8_tensor
from tedebug.quantization.float8 import Float8Quantizer

from support.kernel_inputs import bits, cast_inputs, lone_row

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
#: one tile (grid 1), a few, more tiles than one wave of blocks (grid-stride), and a tall and a wide one
SHAPES = [(64, 128), (128, 256), (4096, 2048), (8192, 128), (64, 8192)]
#: the history's entry 0 before the quantization: zero, above and below the tensor's amax, NaN (kept), +Inf
ENTRIES = [0.0, 1e6, 1e-3, float("nan"), float("inf")]
#: the quantizer's scale: a usual one, a power of two, a tiny and a huge one (scale_inv 1 / scale), and 0 (Inf)
SCALES = [448.0 / 3.7, 2.0**-3, 1e-30, 3e38, 0.0]


def inputs(shape, dtype, seed):
    """`cast_inputs` on the GPU: normal, special values spread in, zeros only (amax 0), NaN only."""
    return cast_inputs(shape, dtype, seed, DEV)


def quantize_both_ways(monkeypatch, x, entry, scale, fmt, rowwise=True, columnwise=True, logged=False):
    """(one launch, its history), (two launches, their history) of `fp8_delayed_quantize` from the same state (with
    the statistics pass when `logged`)."""
    results = []
    for one in (True, False):
        history = torch.tensor([entry, 5.0, 7.0], dtype=torch.float32, device=DEV)
        state = torch.tensor([scale], dtype=torch.float32, device=DEV)
        with monkeypatch.context() as m:
            if not one:
                m.setattr(cupy_fp8_tensor, "_delayed_in_one_launch", lambda plan, high_precision_stats: False)
            q = cupy_fp8_tensor.fp8_delayed_quantize(x, history, state, fmt, rowwise, columnwise, logged)
        results.append((q, history))
    return results


@pytest.mark.parametrize("logged", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ("E4M3", "E5M2"))
def test_one_launch_gives_the_bytes_of_the_two_launches(monkeypatch, dtype, shape, fmt, logged):
    assert cupy_fp8_tensor._cast_plan(torch.empty(shape, dtype=dtype, device=DEV), DEV.index or 0, fmt).fast
    for i, x in enumerate(inputs(shape, dtype, sum(shape))):
        want = bits(lone_row(x)) if logged else None
        for entry, scale in zip(ENTRIES, SCALES[i:] + SCALES[:i]):  # every pair of (input, entry, scale) kinds
            (one, one_history), (two, two_history) = quantize_both_ways(
                monkeypatch, x, entry, scale, fmt, logged=logged
            )
            if logged:  # the row of the statistics pass in both, bit for bit a lone launch's (NaN payloads included)
                assert torch.equal(bits(one.high_precision_stats), want)
                assert torch.equal(bits(two.high_precision_stats), want)
            else:
                assert one.high_precision_stats is None and two.high_precision_stats is None
            assert torch.equal(bits(one.rowwise_data), bits(two.rowwise_data))
            assert torch.equal(bits(one.columnwise_data), bits(two.columnwise_data))
            assert torch.equal(bits(one.scale_inv), bits(two.scale_inv))
            assert torch.equal(bits(one.stats), bits(two.stats))  # underflows, squared error, overflows, scale
            assert torch.equal(bits(one_history), bits(two_history))  # entry 0 recorded, the others untouched


def test_the_recorded_entry_is_the_maximum_with_the_amax():
    """An independent check of what the one launch records: maximum(entry, max|x|), a NaN entry kept."""
    x = inputs((128, 256), torch.bfloat16, 5)[0]
    amax = x.float().abs().max().item()
    for entry in ENTRIES:
        history = torch.tensor([entry, 1.0], device=DEV)
        cupy_fp8_tensor.fp8_delayed_quantize(x, history, torch.tensor([2.0], device=DEV), "E4M3", True, True)
        want = torch.maximum(torch.tensor(entry), torch.tensor(amax))
        assert torch.equal(bits(history[:1]), bits(want.reshape(1))), entry
        assert history[1].item() == 1.0


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
def test_one_direction(monkeypatch, rowwise, columnwise):
    x = inputs((128, 256), torch.bfloat16, 7)[1]
    (one, h1), (two, h2) = quantize_both_ways(monkeypatch, x, 0.5, 100.0, "E4M3", rowwise, columnwise)
    assert (one.rowwise_data is None) is not rowwise and (one.columnwise_data is None) is not columnwise
    for a, b in ((one.rowwise_data, two.rowwise_data), (one.columnwise_data, two.columnwise_data)):
        assert (a is None and b is None) or torch.equal(bits(a), bits(b))
    assert torch.equal(bits(one.stats), bits(two.stats)) and torch.equal(bits(h1), bits(h2))


def test_launch_after_launch_on_one_stream():
    """Each launch leaves its amax slot at 0: quantizations of different tensors queued back to back (no host wait
    between them), each into its own history, give each tensor's own bytes and entry, as one launch at a time does."""
    xs = [inputs((256, 512), torch.bfloat16, seed)[0] * (seed + 1) for seed in range(24)]
    scale = torch.tensor([3.0], device=DEV)
    histories = [torch.zeros(2, device=DEV) for _ in xs]
    logged = [seed % 3 == 1 for seed in range(24)]  # the two kernels interleaved
    queued = [
        cupy_fp8_tensor.fp8_delayed_quantize(x, h, scale, "E4M3", True, True, on)
        for x, h, on in zip(xs, histories, logged)
    ]
    for x, q, h, on in zip(xs, queued, histories, logged):
        torch.cuda.synchronize()
        alone_history = torch.zeros(2, device=DEV)
        alone = cupy_fp8_tensor.fp8_delayed_quantize(x, alone_history, scale, "E4M3", True, True, on)
        torch.cuda.synchronize()
        assert torch.equal(bits(q.rowwise_data), bits(alone.rowwise_data))
        assert torch.equal(bits(q.stats), bits(alone.stats)) and torch.equal(bits(h), bits(alone_history))
        if on:
            assert torch.equal(bits(q.high_precision_stats), bits(lone_row(x)))


@pytest.fixture
def launches(monkeypatch):
    """The kernel names launched, in order."""
    names = []
    plain = cupy_fp8_tensor.launch_on

    def count_plain(kernel, *args, **kwargs):
        names.append(kernel.name)
        return plain(kernel, *args, **kwargs)

    monkeypatch.setattr(cupy_fp8_tensor, "launch_on", count_plain)
    return names


def test_the_quantizer_takes_one_launch_on_the_fast_shape(launches):
    q = Float8Quantizer(torch.ones((), device=DEV), torch.zeros(4, device=DEV), "E4M3")
    q(torch.randn(128, 256, device=DEV, dtype=torch.bfloat16))
    assert launches == ["ted_fp8_delayed_cast16"]
    launches.clear()
    q(torch.randn(96, 256, device=DEV, dtype=torch.bfloat16))  # M % 64 != 0: the recording pass, the general cast
    assert launches[0] == "ted_fp8_amax_scale" and "ted_fp8_delayed_cast16" not in launches
    launches.clear()
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
    cupy_fp8_tensor.fp8_delayed_quantize(x, q.amax_history, q.scale, "E4M3", True, True, high_precision_stats=True)
    assert launches == ["ted_fp8_delayed_stats_cast16"]  # the statistics pass records the amax, then the cast


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_no_local_memory(dtype):
    """The kernels keep their arrays in registers (a kernel with local memory makes its launches block in a training
    loop: docs/internals.md), within the registers of their resident blocks per SM: the cast's 4 blocks of 256
    threads (64 registers), 3 with the statistics pass."""
    from tedebug.backends.cupy_runtime import dtype_options, get_kernel

    x = torch.zeros(64, 128, dtype=dtype, device=DEV)
    for name, blocks in (("ted_fp8_delayed_cast16", 4), ("ted_fp8_delayed_stats_cast16", 3)):
        for fmt in ("E4M3", "E5M2"):
            raw = get_kernel("fp8_tensor.cu", name, dtype_options(x, fmt)).raw(0)
            fits = raw.num_regs * 256 * blocks <= 65536
            assert raw.local_size_bytes == 0 and fits, (name, fmt, raw.local_size_bytes, raw.num_regs)
