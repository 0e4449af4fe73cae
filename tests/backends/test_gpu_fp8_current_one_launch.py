"""Current scaling in one launch (``ted_fp8_current_cast16``: the amax pass and the cast with a grid-wide barrier
between them; ``ted_fp8_current_stats_cast16``: the statistics pass in place of the amax pass, for a tensor that is
also logged): on the 16-bit fast shape its codes, amax, scale, scale_inv, statistics vector and basic statistics
row are bit for bit those of the two launches (``ted_fp8_amax_scale`` or ``ted_stats_amax``, then
``ted_fp8_cast_transpose16``) and the row that of a lone statistics launch, launch after launch on one stream (the
barrier's flag and tickets are left at 0); and it is the path a quantization takes there: one launch, and none on
the other shapes.  Every test needs CUDA and CuPy."""

import pytest
import torch

from tedebug.backends import cupy_fp8_tensor, launch
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

from support.kernel_inputs import bits, cast_inputs, lone_row

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
#: one tile (grid 1), a few, more tiles than one wave of blocks (grid-stride), and a tall and a wide one
SHAPES = [(64, 128), (128, 256), (192, 384), (4096, 2048), (8192, 128), (64, 8192)]


def inputs(shape, dtype, seed):
    """`cast_inputs` on the GPU: normal, special values spread in, zeros only (amax 0), NaN only."""
    return cast_inputs(shape, dtype, seed, DEV)


def quantize_both_ways(monkeypatch, x, fmt, epsilon, pow2, rowwise=True, columnwise=True, logged=False):
    """(one launch, two launches) of `fp8_current_quantize` (with the statistics pass when `logged`)."""
    one = cupy_fp8_tensor.fp8_current_quantize(x, fmt, epsilon, pow2, rowwise, columnwise, logged)
    with monkeypatch.context() as m:
        m.setattr(cupy_fp8_tensor, "_fused_current", lambda *args: None)
        two = cupy_fp8_tensor.fp8_current_quantize(x, fmt, epsilon, pow2, rowwise, columnwise, logged)
    return one, two


@pytest.mark.parametrize("logged", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt, pow2, epsilon", [("E4M3", False, 0.0), ("E5M2", True, 0.0), ("E4M3", False, 1e-3)])
def test_one_launch_gives_the_bytes_of_the_two_launches(monkeypatch, dtype, shape, fmt, pow2, epsilon, logged):
    empty = torch.empty(shape, dtype=dtype, device=DEV)
    plan = cupy_fp8_tensor._cast_plan(empty, DEV.index or 0, fmt)
    assert plan.fast
    fused = cupy_fp8_tensor._fused_current(plan, empty, 0, fmt, logged)
    # one launch wherever the cast's grid fits the blocks resident at once: every shape here without the statistics
    # pass (4 per SM), all but the largest with it (3 per SM: the statistics pass's register budget)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (fused is not None) == (not logged or plan.cast_grid <= 3 * sms)
    for x in inputs(shape, dtype, sum(shape)):
        one, two = quantize_both_ways(monkeypatch, x, fmt, epsilon, pow2, logged=logged)
        if logged:  # the row of the statistics pass in both, bit for bit a lone launch's (NaN payloads included)
            want = bits(lone_row(x))
            assert torch.equal(bits(one.high_precision_stats), want)
            assert torch.equal(bits(two.high_precision_stats), want)
        else:
            assert one.high_precision_stats is None and two.high_precision_stats is None
        assert torch.equal(bits(one.rowwise_data), bits(two.rowwise_data))
        assert torch.equal(bits(one.columnwise_data), bits(two.columnwise_data))
        assert torch.equal(bits(one.scale_inv), bits(two.scale_inv))
        assert torch.equal(bits(one.stats), bits(two.stats))  # underflows, squared error, overflows, scale partials
        # amax and scale too: the float32 slots (amax, scale, -, -, scale_inv) of the small allocation
        at = cupy_fp8_tensor._VECTOR_AT // 4
        small_one, small_two = one.scale_inv._base, two.scale_inv._base  # (scale_inv: a view of the allocation)
        slots = [0, 1, 4]
        assert torch.equal(
            bits(small_one.view(torch.float32)[at : at + 5][slots]),
            bits(small_two.view(torch.float32)[at : at + 5][slots]),
        )


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
def test_one_direction(monkeypatch, rowwise, columnwise):
    x = inputs((128, 256), torch.bfloat16, 7)[1]
    one, two = quantize_both_ways(monkeypatch, x, "E4M3", 0.0, False, rowwise, columnwise)
    assert (one.rowwise_data is None) is not rowwise and (one.columnwise_data is None) is not columnwise
    for a, b in ((one.rowwise_data, two.rowwise_data), (one.columnwise_data, two.columnwise_data)):
        assert (a is None and b is None) or torch.equal(bits(a), bits(b))
    assert torch.equal(bits(one.stats), bits(two.stats)) and torch.equal(bits(one.scale_inv), bits(two.scale_inv))


def test_launch_after_launch_on_one_stream():
    """Each launch leaves the barrier's slots at 0: many quantizations of different tensors queued back to back
    (no host wait between them) each give their own tensor's bytes, as a fresh one-at-a-time launch does."""
    xs = [inputs((256, 512), torch.bfloat16, seed)[0] * (seed + 1) for seed in range(24)]
    logged = [seed % 3 == 1 for seed in range(24)]  # the two kernels interleaved: they share the barrier's slots
    queued = [cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True, on) for x, on in zip(xs, logged)]
    for x, on, q in zip(xs, logged, queued):
        torch.cuda.synchronize()
        alone = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True, on)
        torch.cuda.synchronize()
        assert torch.equal(bits(q.rowwise_data), bits(alone.rowwise_data))
        assert torch.equal(bits(q.scale_inv), bits(alone.scale_inv)) and torch.equal(bits(q.stats), bits(alone.stats))
        if on:
            assert torch.equal(bits(q.high_precision_stats), bits(lone_row(x)))


@pytest.fixture
def launches(monkeypatch):
    """The kernel names launched, in order (through either launch function)."""
    names = []
    plain, cooperative = cupy_fp8_tensor.launch_on, cupy_fp8_tensor.launch_cooperative_on

    def count_plain(kernel, *args, **kwargs):
        names.append(kernel.name)
        return plain(kernel, *args, **kwargs)

    def count_cooperative(kernel, *args, **kwargs):
        names.append(kernel.name)
        return cooperative(kernel, *args, **kwargs)

    monkeypatch.setattr(cupy_fp8_tensor, "launch_on", count_plain)
    monkeypatch.setattr(cupy_fp8_tensor, "launch_cooperative_on", count_cooperative)
    return names


def test_the_quantizer_takes_one_launch_on_the_fast_shape(launches):
    q = Float8CurrentScalingQuantizer("E4M3")
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
    q(x)
    assert launches == ["ted_fp8_current_cast16"]
    launches.clear()
    q(torch.randn(96, 256, device=DEV, dtype=torch.bfloat16))  # M % 64 != 0: the general cast, two launches
    assert launches[0] == "ted_fp8_amax_scale" and "ted_fp8_current_cast16" not in launches
    launches.clear()
    cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True, high_precision_stats=True)
    assert launches == ["ted_fp8_current_stats_cast16"]  # the statistics pass, the scale and the cast


def test_two_launches_where_the_grid_does_not_fit(monkeypatch, launches):
    """A device that cannot hold the cast's grid at once (or no cooperative launch at all): the two launches."""
    monkeypatch.setattr(cupy_fp8_tensor, "_CURRENT_KERNELS", {})
    monkeypatch.setattr(cupy_fp8_tensor, "cooperative_blocks_per_sm", lambda kernel, index, block: 0)
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
    cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True)
    assert launches == ["ted_fp8_amax_scale", "ted_fp8_cast_transpose16"]
    launches.clear()
    logged = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True, high_precision_stats=True)
    assert launches == ["ted_fp8_cast_transpose16"]  # (after the statistics pass, which cupy_stats launches)
    assert torch.equal(bits(logged.high_precision_stats), bits(lone_row(x)))


def test_the_capacity_is_the_occupancy_times_the_sms():
    x = torch.empty(128, 256, device=DEV, dtype=torch.bfloat16)
    plan = cupy_fp8_tensor._cast_plan(x, 0, "E4M3")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for logged in (False, True):
        assert cupy_fp8_tensor._fused_current(plan, x, 0, "E4M3", logged) is not None
        kernel, capacity = cupy_fp8_tensor._CURRENT_KERNELS[(0, torch.bfloat16, "E4M3", logged)]
        # __launch_bounds__(256, 4): the cast's whole grid; with the statistics pass (256, 3)
        assert capacity >= (3 if logged else cupy_fp8_tensor.CT_BLOCKS_PER_SM) * sms
        assert launch.cooperative_blocks_per_sm(kernel, 0, 256) * sms == capacity


def test_two_launches_in_the_cupy_launch_mode(monkeypatch, launches):
    """``TEDEBUG_LAUNCH=cupy`` (no cooperative launch through CuPy here): the two launches, the same bytes."""
    x = inputs((128, 256), torch.bfloat16, 3)[1]
    one = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True)
    launches.clear()
    monkeypatch.setenv(launch.ENV_VAR, "cupy")
    two = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True)
    assert launches == ["ted_fp8_amax_scale", "ted_fp8_cast_transpose16"]
    assert torch.equal(bits(one.rowwise_data), bits(two.rowwise_data)) and torch.equal(bits(one.stats), bits(two.stats))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_no_local_memory(dtype):
    """The one-launch kernels keep their arrays in registers (a kernel with local memory makes its launches block in
    a training loop: docs/internals.md), within the registers their resident blocks per SM allow: 4 blocks of 256
    threads (64 registers), 3 with the statistics pass."""
    from tedebug.backends.cupy_runtime import dtype_options, get_kernel

    x = torch.zeros(64, 128, dtype=dtype, device=DEV)
    for name, blocks in (("ted_fp8_current_cast16", 4), ("ted_fp8_current_stats_cast16", 3)):
        for fmt in ("E4M3", "E5M2"):
            raw = get_kernel("fp8_tensor.cu", name, dtype_options(x, fmt)).raw(0)
            fits = raw.num_regs * 256 * blocks <= 65536
            assert raw.local_size_bytes == 0 and fits, (name, fmt, raw.local_size_bytes, raw.num_regs)
