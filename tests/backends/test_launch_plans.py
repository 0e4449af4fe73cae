"""The per-shape launch plans of the GPU launchers, built on the CPU with stand-in kernels and launches (the plans
only look kernels up and do integer arithmetic; the GPU tests run the same plans on the kernels:
test_gpu_kernels.py, test_gpu_nvfp4.py, test_gpu_emulated_gemm.py).

- `cupy_runtime.PlanCache` keeps a plan per key and starts over at its limit;
- per-tensor FP8 (`cupy_fp8_tensor._cast_plan`), NVFP4 (`cupy_nvfp4._quantize_plan`) and the dequantization of
  the emulated GEMMs' operands (`cupy_dequant._plan`) look their kernels up once per shape, choose the kernel the
  shape calls for, and size the grid within one block per work item and the per-SM bound of their kernel;
- the one-launch current scaling (`cupy_fp8_tensor._fused_current`) is chosen only in the driver launch mode,
  outside a CUDA graph capture and where the device holds the cast's grid at once; a logged tensor's (with the
  statistics pass) has its own kernel and capacity, and so has delayed scaling's;
- the flat paths of per-tensor FP8 (`fp8_current_quantize`, `fp8_delayed_quantize`) build the amax pass's
  arguments themselves: they are exactly those of the general `amax_launch` for the same outputs.
"""

import numpy as np
import pytest
import torch

from tedebug.backends import cupy_dequant, cupy_fp8_tensor, cupy_mxfp8, cupy_nvfp4, cupy_runtime
from tedebug.backends.cupy_runtime import BLOCKS_PER_SM, FLAGS, THREADS, TICKETS, PlanCache

SMS = 7  # the stand-in device's SM count: small, so that the per-SM bound shows


@pytest.fixture
def asked(monkeypatch):
    """The (source, kernel name, options) of every kernel look-up of the three launchers; stand-in kernels."""
    calls = []

    def get_kernel(source, name, options):
        calls.append((source, name, tuple(options)))
        return ("kernel", name, tuple(options))

    for module in (cupy_fp8_tensor, cupy_nvfp4, cupy_dequant):
        monkeypatch.setattr(module, "get_kernel", get_kernel)
    monkeypatch.setattr(cupy_fp8_tensor, "sm_count", lambda index: SMS)
    monkeypatch.setattr(cupy_nvfp4, "_sm_count", lambda index: SMS)
    monkeypatch.setattr(cupy_runtime, "sm_count", lambda index: SMS)  # (`grid_on`'s)
    monkeypatch.setattr(cupy_fp8_tensor, "_DELAYED_KERNELS", {})  # (restored after the test: no stand-in outlives it)
    caches = (cupy_fp8_tensor._CAST_PLANS, cupy_nvfp4._QUANTIZE_PLANS, cupy_dequant._PLANS)
    for cache in caches:
        cache.clear()
    yield calls
    for cache in caches:  # no stand-in plan may outlive the test (a GPU test in this process would launch it)
        cache.clear()


def test_plan_cache_keeps_plans_and_starts_over_at_its_limit():
    cache = PlanCache(limit=2)
    assert cache.get((1,)) is None
    assert cache.put((1,), "a") == "a" and cache.get((1,)) == "a"
    cache.put((2,), "b")
    assert len(cache) == 2
    cache.put((3,), "c")  # the third plan: the cache starts over
    assert len(cache) == 1 and cache.get((1,)) is None and cache.get((3,)) == "c"
    cache.clear()
    assert len(cache) == 0
    assert FLAGS == (np.int32(0), np.int32(1)) and all(type(f) is np.int32 for f in FLAGS)


@pytest.mark.parametrize(
    "shape, dtype, fast",
    [((128, 256), torch.bfloat16, True), ((64, 128), torch.float16, True), ((96, 256), torch.bfloat16, False)]
    + [((128, 256), torch.float32, False), ((3, 5), torch.bfloat16, False)],
)
def test_fp8_cast_plan(asked, shape, dtype, fast):
    x = torch.empty(shape, dtype=dtype)
    plan = cupy_fp8_tensor._cast_plan(x, 0, "E5M2")
    m, k = shape
    assert plan.fast is fast and (plan.m, plan.k, plan.n) == (m, k, m * k)
    assert all(type(v) is np.int64 for v in (plan.m, plan.k, plan.n)) and type(plan.fp8_max) is np.float32
    assert plan.fp8_max == 57344.0  # E5M2's largest finite value
    cast = "ted_fp8_cast_transpose16" if fast else "ted_fp8_cast_transpose"
    assert [name for _, name, _ in asked] == [cast, "ted_fp8_amax_scale"]
    assert all(source == "fp8_tensor.cu" for source, _, _ in asked)
    tiles = (m // 64) * (k // 128) if fast else -(-m // 64) * -(-k // 64)
    per_sm = cupy_fp8_tensor.CT_BLOCKS_PER_SM if fast else BLOCKS_PER_SM
    assert plan.cast_grid == max(1, min(per_sm * SMS, tiles))
    vectors = -(-max(m * k // (16 // x.element_size()), 1) // THREADS)  # 16-byte loads, one per thread
    assert plan.amax_grid == max(1, min(BLOCKS_PER_SM * SMS, vectors))
    assert cupy_fp8_tensor._cast_plan(x, 0, "E5M2") is plan and len(asked) == 2  # planned once
    cupy_fp8_tensor._cast_plan(x, 0, "E4M3")  # another format: another plan
    assert len(asked) == 4


def test_one_launch_current_scaling_only_where_its_barrier_holds(asked, monkeypatch):
    """`_fused_current` picks ``ted_fp8_current_cast16`` for a fast-shape plan only in the driver launch mode,
    outside a CUDA graph capture, and where the device holds the cast's grid at once (its capacity is asked once
    per device, dtype and format)."""
    mode, capturing, capacities = ["driver"], [False], []

    def capacity(kernel, index, block):
        capacities.append((kernel[1], index, block))
        return 4  # blocks per SM

    monkeypatch.setattr(cupy_fp8_tensor, "launch_mode", lambda: mode[0])
    monkeypatch.setattr(cupy_fp8_tensor, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(cupy_fp8_tensor, "cooperative_blocks_per_sm", capacity)
    monkeypatch.setattr(cupy_fp8_tensor, "_CURRENT_KERNELS", {})
    x = torch.empty((64 * 4 * SMS, 128), dtype=torch.bfloat16)  # 4 x SMS tiles: a grid of 4 x SMS blocks
    plan = cupy_fp8_tensor._cast_plan(x, 0, "E4M3")
    asked.clear()
    assert cupy_fp8_tensor._fused_current(plan, x, 0, "E4M3") == ("kernel", "ted_fp8_current_cast16", asked[0][2])
    assert capacities == [("ted_fp8_current_cast16", 0, THREADS)]
    assert cupy_fp8_tensor._fused_current(plan, x, 0, "E4M3") is not None and len(capacities) == len(asked) == 1
    bigger = torch.empty((64 * 4 * SMS + 64, 128), dtype=torch.bfloat16)  # one tile more, and a grid of as many
    bigger_plan = cupy_fp8_tensor._cast_plan(bigger, 0, "E4M3")
    assert bigger_plan.cast_grid == 4 * SMS  # (the cast's grid stays within 4 blocks per SM: it still fits)
    assert cupy_fp8_tensor._fused_current(bigger_plan, bigger, 0, "E4M3") is not None
    monkeypatch.setattr(cupy_fp8_tensor, "_CURRENT_KERNELS", {})
    monkeypatch.setattr(cupy_fp8_tensor, "cooperative_blocks_per_sm", lambda kernel, index, block: 3)
    assert cupy_fp8_tensor._fused_current(plan, x, 0, "E4M3") is None  # 3 x SMS resident: the grid does not fit
    capturing[0] = True
    monkeypatch.setattr(cupy_fp8_tensor, "cooperative_blocks_per_sm", capacity)
    monkeypatch.setattr(cupy_fp8_tensor, "_CURRENT_KERNELS", {})
    assert cupy_fp8_tensor._fused_current(plan, x, 0, "E4M3") is None
    capturing[0], mode[0] = False, "cupy"
    assert cupy_fp8_tensor._fused_current(plan, x, 0, "E4M3") is None
    assert len(capacities) == 1  # neither of the last two asked


def test_logged_current_scaling_takes_the_statistics_kernel_with_its_own_capacity(launches, monkeypatch):
    """With `high_precision_stats`, `_fused_current` picks ``ted_fp8_current_stats_cast16``, whose capacity it asks
    and keeps apart from the plain kernel's (3 blocks per SM: a grid of 4 per SM does not fit it), and the one
    launch gets the plain kernel's arguments, then the statistics pass's ticket, the basic statistics row in the
    small allocation and the grid of a lone statistics launch on the tensor (uint32, `cupy_stats.lone_grid`)."""
    recorded, made = launches
    cooperative = []
    per_sm = {"ted_fp8_current_cast16": 4, "ted_fp8_current_stats_cast16": 3}
    monkeypatch.setattr(cupy_fp8_tensor, "launch_mode", lambda: "driver")
    monkeypatch.setattr(cupy_fp8_tensor, "_capturing", lambda: False)
    monkeypatch.setattr(cupy_fp8_tensor, "cooperative_blocks_per_sm", lambda kernel, index, block: per_sm[kernel[1]])
    monkeypatch.setattr(cupy_fp8_tensor, "_CURRENT_KERNELS", {})
    monkeypatch.setattr(
        cupy_fp8_tensor,
        "launch_cooperative_on",
        lambda kernel, index, stream, grid, block, args: cooperative.append((kernel[1], grid, args)),
    )
    monkeypatch.setattr(cupy_fp8_tensor, "lone_grid", lambda x, index: 11)
    x = torch.ones((128, 256), dtype=torch.bfloat16)
    plan = cupy_fp8_tensor._cast_plan(x, 0, "E4M3")
    assert (
        cupy_fp8_tensor._fused_current(plan, x, 0, "E4M3", True)
        == cupy_fp8_tensor._CURRENT_KERNELS[(0, torch.bfloat16, "E4M3", True)][0]
    )
    buffers = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True, high_precision_stats=True)
    unlogged = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True)
    assert recorded == []  # neither took a plain launch
    (logged_name, logged_grid, logged_args), (plain_name, plain_grid, plain_args) = cooperative
    assert (logged_name, plain_name) == ("ted_fp8_current_stats_cast16", "ted_fp8_current_cast16")
    assert logged_grid == plain_grid == plan.cast_grid
    small = made[0].small
    # the input, its shape, the barrier's slots, then (after the outputs' vector) FP8 max, epsilon, pow2, directions
    assert logged_args[:4] == plain_args[:4] and logged_args[5:10] == plain_args[5:10]
    assert len(logged_args) == len(plain_args) + 3
    assert logged_args[4] == small.data_ptr() + 128  # amax, scale, -, -, scale_inv
    assert logged_args[-6:-3] == (5000, 9000 + 4 * TICKETS["cast"], small.data_ptr())
    assert logged_args[-3:] == (9000 + 4 * TICKETS["stats"], small.data_ptr() + 160, np.uint32(11))
    assert type(logged_args[-1]) is np.uint32
    assert buffers.high_precision_stats.data_ptr() == small.data_ptr() + 160 and unlogged.high_precision_stats is None
    # a grid of 4 blocks per SM: the plain kernel holds it at once, the statistics kernel does not
    big = torch.empty((64 * 4 * SMS, 128), dtype=torch.bfloat16)
    big_plan = cupy_fp8_tensor._cast_plan(big, 0, "E4M3")
    assert big_plan.cast_grid == 4 * SMS
    assert cupy_fp8_tensor._fused_current(big_plan, big, 0, "E4M3") is not None
    assert cupy_fp8_tensor._fused_current(big_plan, big, 0, "E4M3", True) is None


@pytest.mark.parametrize("two_d, sr", [(False, False), (True, False), (False, True)])
def test_nvfp4_quantize_plan(asked, two_d, sr):
    fast_x = torch.empty((128, 256), dtype=torch.bfloat16)  # the 64 x 128 tiles of the fast kernel
    general_x = torch.empty((48, 80), dtype=torch.bfloat16)
    fast = cupy_nvfp4._quantize_plan(fast_x, two_d, sr)
    general = cupy_nvfp4._quantize_plan(general_x, two_d, sr)
    assert fast.fast and not general.fast
    assert [name for _, name, _ in asked] == ["ted_nvfp4_quantize16", "ted_nvfp4_quantize"]
    fast_options, general_options = asked[0][2], asked[1][2]
    assert (f"-DNV_SR={int(sr)}" in fast_options) and (f"-DNV_SR={int(sr)}" in general_options)
    assert ("-DNQ_2D=1" in fast_options) is two_d and "-DNQ_2D=1" not in general_options
    per_sm = cupy_nvfp4.NQ_SR_BLOCKS_PER_SM if sr else cupy_nvfp4.NQ_BLOCKS_PER_SM
    assert fast.grid == min(per_sm * SMS, (128 // 64) * (256 // 128))
    general_tiles = -(-48 // cupy_nvfp4.NV_TILE_ROWS) * -(-80 // 128)  # bf16: 128 columns per tile
    assert general.grid == max(1, min(cupy_nvfp4.NV_BLOCKS_PER_SM * SMS, general_tiles))
    assert (fast.m, fast.k, general.m, general.k) == (128, 256, 48, 80)
    assert cupy_nvfp4._quantize_plan(fast_x, two_d, sr) is fast and len(asked) == 2


def test_dequantization_plan(asked):
    kernel, grid, rows, cols = cupy_dequant._plan("ted_dequant_mxfp8", "E4M3", 0, 4096, 1024, 8)
    assert kernel == ("kernel", "ted_dequant_mxfp8", ("-DTED_FP8=0",))
    assert grid == min(BLOCKS_PER_SM * SMS, 4096 * 1024 // 8 // THREADS) and (rows, cols) == (4096, 1024)
    assert type(rows) is np.int64 and type(cols) is np.int64
    small = cupy_dequant._plan("ted_dequant_mxfp8", "E5M2", 0, 32, 32, 8)
    assert small[0][2] == ("-DTED_FP8=1",) and small[1] == 1  # 128 threads' work: one block
    assert cupy_dequant._plan("ted_dequant_mxfp8", "E4M3", 0, 4096, 1024, 8)[0] is kernel and len(asked) == 2


@pytest.fixture
def launches(monkeypatch, asked):
    """Every launch of `cupy_fp8_tensor` as (kernel name, grid, arguments), with a stand-in workspace and stream;
    `outputs` holds the small-output allocations the flat path made (so a test can address them)."""
    recorded = []
    made = []
    real_outputs = cupy_fp8_tensor._outputs

    def outputs(*args):
        out = real_outputs(*args)
        made.append(out)
        return out

    monkeypatch.setattr(cupy_fp8_tensor, "_outputs", outputs)
    monkeypatch.setattr(cupy_fp8_tensor, "raw_stream", lambda index: 1234)
    monkeypatch.setattr(cupy_fp8_tensor, "workspace_on", lambda index, stream: (5000, 9000))
    monkeypatch.setattr(cupy_fp8_tensor, "workspace", lambda device: (5000, 9000))
    monkeypatch.setattr(
        cupy_fp8_tensor, "grid_for", lambda device, items: max(1, min(BLOCKS_PER_SM * SMS, -(-items // THREADS)))
    )
    monkeypatch.setattr(
        cupy_fp8_tensor,
        "launch_on",
        lambda kernel, index, stream, grid, block, args: recorded.append((kernel[1], grid, args)),
    )
    monkeypatch.setattr(
        cupy_fp8_tensor, "launch", lambda kernel, grid, block, args, device: recorded.append((kernel[1], grid, args))
    )
    return recorded, made


@pytest.mark.parametrize("pow2", [False, True])
def test_flat_current_scaling_launches_what_the_general_amax_pass_launches(launches, pow2):
    """The flat path of `fp8_current_quantize` builds the amax pass's arguments itself; they are those
    `amax_launch` builds for the same outputs (current-scaling mode, scale_inv 16-byte aligned at vector[4]), and
    the cast reads the scale and scale_inv that pass writes."""
    recorded, made = launches
    x = torch.ones((128, 256), dtype=torch.bfloat16)
    cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.5, pow2, True, True)
    (amax_name, amax_grid, flat), (cast_name, _, cast_args) = recorded
    vector = made[0].small.view(torch.float32)[32:40]  # byte 128 of the small allocation
    recorded.clear()
    cupy_fp8_tensor.amax_launch(x, vector, "E4M3", 0.5, pow2, scale_inv_slot=4)
    assert recorded == [(amax_name, amax_grid, flat)] and amax_name == "ted_fp8_amax_scale"
    assert cast_name == "ted_fp8_cast_transpose16" and cast_args[3:5] == flat[8:10]  # scale, scale_inv by address


def test_flat_delayed_scaling_launches_what_the_general_amax_pass_launches(launches):
    """The same for `fp8_delayed_quantize`: the record mode into history[0], scale_inv = 1 / scale at vector[0]."""
    recorded, made = launches
    x = torch.ones((96, 256), dtype=torch.bfloat16)
    history, scale = torch.zeros(4), torch.full((1,), 2.0)
    cupy_fp8_tensor.fp8_delayed_quantize(x, history, scale, "E4M3", True, False)
    (amax_name, amax_grid, flat), (cast_name, _, cast_args) = recorded  # (the cast finishes its own statistics)
    small = made[0].small
    scale_inv = small.view(torch.float32)[32:33]
    recorded.clear()
    cupy_fp8_tensor.amax_launch(x, history, record=(scale, scale_inv))
    assert recorded == [(amax_name, amax_grid, flat)]
    assert cast_name == "ted_fp8_cast_transpose" and cast_args[3:5] == (scale.data_ptr(), scale_inv.data_ptr())
    # the workspace's partials, the cast's ticket and the statistics vector at the start of the small allocation
    assert cast_args[-3:] == (5000, 9000 + 4 * TICKETS["cast"], small.data_ptr())


def test_delayed_scaling_on_the_fast_shape_is_one_launch(launches):
    """`fp8_delayed_quantize` of a fast-shape tensor: one launch of ``ted_fp8_delayed_cast16`` with the cast's grid
    and the arguments in the kernel's order (input, shape, its amax slot, the history, scale, scale_inv at the small
    allocation's float32 vector, FP8 max, directions, codes, partials, the cast's ticket, the statistics vector);
    not with the statistics pass, nor on another shape."""
    recorded, made = launches
    x = torch.ones((128, 256), dtype=torch.bfloat16)
    history, scale = torch.zeros(4), torch.full((1,), 2.0)
    buffers = cupy_fp8_tensor.fp8_delayed_quantize(x, history, scale, "E4M3", True, False)
    small = made[0].small
    plan = cupy_fp8_tensor._cast_plan(x, 0, "E4M3")
    assert recorded == [
        (
            "ted_fp8_delayed_cast16",
            plan.cast_grid,
            (x.data_ptr(), plan.m, plan.k, 9000 + 4 * TICKETS["fp8_delayed"], history.data_ptr(), scale.data_ptr())
            + (small.data_ptr() + 128, plan.fp8_max, FLAGS[1], FLAGS[0], made[0].rowwise.data_ptr(), 0)
            + (5000, 9000 + 4 * TICKETS["cast"], small.data_ptr()),
        )
    ]
    assert buffers.scale_inv.data_ptr() == small.data_ptr() + 128 and buffers.stats.numel() == 9
    assert cupy_fp8_tensor._delayed_in_one_launch(plan, False)
    general = cupy_fp8_tensor._cast_plan(torch.ones((96, 256), dtype=torch.bfloat16), 0, "E4M3")
    assert not cupy_fp8_tensor._delayed_in_one_launch(general, False)
    assert not cupy_fp8_tensor._delayed_in_one_launch(general, True)


def test_logged_delayed_scaling_on_the_fast_shape_is_one_launch(launches, monkeypatch):
    """With the statistics pass (`high_precision_stats`), the one launch is ``ted_fp8_delayed_stats_cast16``: the
    arguments of ``ted_fp8_delayed_cast16``, then the statistics pass's ticket, the basic statistics row in the
    small allocation and the grid of a lone statistics launch on the tensor, as a uint32 (`cupy_stats.lone_grid`)."""
    recorded, made = launches
    monkeypatch.setattr(cupy_fp8_tensor, "lone_grid", lambda x, index: 11)
    x = torch.ones((128, 256), dtype=torch.bfloat16)
    history, scale = torch.zeros(4), torch.full((1,), 2.0)
    buffers = cupy_fp8_tensor.fp8_delayed_quantize(x, history, scale, "E4M3", True, True, high_precision_stats=True)
    small = made[0].small
    plan = cupy_fp8_tensor._cast_plan(x, 0, "E4M3")
    ((name, grid, args),) = recorded
    assert name == "ted_fp8_delayed_stats_cast16" and grid == plan.cast_grid
    assert args[:4] == (x.data_ptr(), plan.m, plan.k, 9000 + 4 * TICKETS["fp8_delayed"])
    assert args[-6:-3] == (5000, 9000 + 4 * TICKETS["cast"], small.data_ptr())
    assert args[-3:] == (9000 + 4 * TICKETS["stats"], small.data_ptr() + 160, np.uint32(11))
    assert type(args[-1]) is np.uint32
    assert buffers.high_precision_stats.data_ptr() == small.data_ptr() + 160


def test_flat_statistics_pass_gets_what_the_general_amax_pass_gives_it(launches, monkeypatch):
    """With `high_precision_stats` the flat paths' first launch is the statistics pass: it gets the arguments
    `amax_launch(..., high_precision_out=)` hands it for the same outputs, and its row is the small allocation's."""
    recorded, made = launches
    passes = []
    monkeypatch.setattr(
        cupy_fp8_tensor, "basic_stats_and_amax_into", lambda x, row, outputs, nz=0: passes.append((row, outputs, nz))
    )
    x = torch.ones((128, 256), dtype=torch.bfloat16)
    buffers = cupy_fp8_tensor.fp8_current_quantize(x, "E5M2", 0.25, True, True, True, high_precision_stats=True)
    small = made[0].small
    assert (
        buffers.high_precision_stats.data_ptr() == small.data_ptr() + 160 and buffers.high_precision_stats.numel() == 13
    )
    cupy_fp8_tensor.amax_launch(
        x,
        small.view(torch.float32)[32:40],
        "E5M2",
        0.25,
        True,
        scale_inv_slot=4,
        high_precision_out=buffers.high_precision_stats,
    )
    assert len(passes) == 2 and passes[0] == passes[1]
    history, scale = torch.zeros(4), torch.full((1,), 2.0)
    passes.clear()
    general = torch.ones((96, 256), dtype=torch.bfloat16)  # (on the fast shape delayed scaling takes one launch)
    buffers = cupy_fp8_tensor.fp8_delayed_quantize(
        general, history, scale, "E4M3", True, True, high_precision_stats=True
    )
    scale_inv = made[1].small.view(torch.float32)[32:33]
    cupy_fp8_tensor.amax_launch(
        general, history, record=(scale, scale_inv), high_precision_out=buffers.high_precision_stats
    )
    assert len(passes) == 2 and passes[0] == passes[1]
    # no amax launch of their own
    assert [name for name, _, _ in recorded] == ["ted_fp8_cast_transpose16", "ted_fp8_cast_transpose"]


def test_fp32_mxfp8_quantize_is_one_launch(monkeypatch):
    """`mxfp8_quantize_raw` of an fp32 tensor: one launch of ``ted_mxfp8_quantize`` whose last block adds the
    per-block partials up in the stream's workspace (the partials, the MXFP8 ticket and the statistics vector end
    its arguments); no second launch."""
    recorded = []
    monkeypatch.setattr(cupy_mxfp8, "get_kernel", lambda source, name, options: ("kernel", name, tuple(options)))
    monkeypatch.setattr(cupy_mxfp8, "device_index", lambda device: 0)
    monkeypatch.setattr(cupy_mxfp8, "sm_count", lambda index: SMS)
    monkeypatch.setattr(cupy_mxfp8, "workspace", lambda device: (5000, 9000))
    monkeypatch.setattr(
        cupy_mxfp8, "launch", lambda kernel, grid, block, args, device: recorded.append((kernel[1], grid, args))
    )
    x = torch.ones((64, 256), dtype=torch.float32)
    buffers = cupy_mxfp8.mxfp8_quantize_raw(x, "E4M3", True, True)
    ((name, grid, args),) = recorded
    tiles = (64 // 32) * (256 // 64)  # 32-row tiles of 64 columns (two per lane)
    assert name == "ted_mxfp8_quantize" and grid == max(1, min(BLOCKS_PER_SM * SMS, (tiles + 7) // 8))
    assert args[0] == x.data_ptr() and args[-3:] == (5000, 9000 + 4 * TICKETS["mxfp8"], buffers.stats.data_ptr())
    assert buffers.stats.dtype == torch.float64 and buffers.stats.numel() == 4
