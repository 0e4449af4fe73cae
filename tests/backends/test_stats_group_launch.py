"""The grouped statistics launch (`cupy_stats.basic_stats_group_into`, ``ted_stats_group``) built on the CPU with a
stand-in kernel and launch: the blocks each tensor gets (`group_grids`) and the exact arguments of the launch.  The
GPU test (test_gpu_stats_group.py) runs the kernel: a tensor's row is bit for bit a lone launch's with as many
blocks."""

import numpy as np
import pytest
import torch

from tedebug.backends import cupy_stats
from tedebug.backends.cupy_runtime import THREADS, TICKETS, dtype_options

SMS = 7
MAX_GRID = cupy_stats.STATS_BLOCKS_PER_SM * SMS  # 21


def test_group_grids():
    vec = 8  # bf16
    # lone grids 10 and 10 blocks (8 x 256 elements per block): they fit in one wave, each keeps its lone grid
    assert cupy_stats.group_grids([10 * 8 * 256, 10 * 8 * 256 - 5], vec, MAX_GRID) == (10, 10)
    assert cupy_stats.group_grids([1, 3], vec, MAX_GRID) == (1, 1)  # under one load: one block
    # lone grids 21, 21, 21 do not fit: shares of 21 in proportion, 21*1000//5500 = 3, 21*500//5500 = 1,
    # 21*4000//5500 = 15
    assert cupy_stats.group_grids([1000 * 2048, 500 * 2048, 4000 * 2048], vec, MAX_GRID) == (3, 1, 15)
    # a tiny tensor beside two large ones: at least one block, never more than its lone grid (1)
    assert cupy_stats.group_grids([16, 10**7, 10**7], vec, MAX_GRID) == (1, 10, 10)


@pytest.fixture
def launched(monkeypatch):
    """The (kernel, grid, block, args) of every launch of `cupy_stats`; stand-in kernels, one SM count, no GPU."""
    calls = []
    monkeypatch.setattr(cupy_stats, "get_kernel", lambda source, name, options: (source, name, tuple(options)))
    monkeypatch.setattr(cupy_stats, "sm_count", lambda index: SMS)
    monkeypatch.setattr(cupy_stats, "raw_stream", lambda index: 77)
    monkeypatch.setattr(cupy_stats, "workspace_on", lambda index, stream: (5000, 9000))
    monkeypatch.setattr(
        cupy_stats,
        "launch_on",
        lambda kernel, index, stream, grid, block, args: calls.append((kernel, grid, block, args)),
    )

    def signed(kernel, index, stream, grid, block, signature, values):  # the arguments typed as their signature says
        assert len(signature) == len(values)
        calls.append((kernel, grid, block, tuple(v if kind is int else kind(v) for kind, v in zip(signature, values))))

    monkeypatch.setattr(cupy_stats, "launch_signed", signed)
    monkeypatch.setattr(cupy_stats, "_STATS_LAUNCH", {})
    monkeypatch.setattr(cupy_stats, "_GROUP_LAUNCH", {})
    return calls


def test_launch_arguments(launched):
    xs = [torch.zeros(n, dtype=torch.bfloat16) for n in (1000 * 2048, 500 * 2048, 4000 * 2048)]
    cupy_stats.basic_stats_group_into([(xs[0], 100), (xs[1], 200), (xs[2], 300)])
    ((kernel, grid, block, args),) = launched
    assert kernel == ("stats.cu", "ted_stats_group", dtype_options(xs[0]))
    assert (grid, block) == (3 + 1 + 15, THREADS)
    expected = (
        (xs[0].data_ptr(), np.int64(1000 * 2048), np.uint32(3), 100)
        + (xs[1].data_ptr(), np.int64(500 * 2048), np.uint32(1), 200)
        + (xs[2].data_ptr(), np.int64(4000 * 2048), np.uint32(15), 300)
        + (5000, 9000 + 4 * TICKETS["stats_group"])
    )
    assert args == expected and [type(a) for a in args] == [type(e) for e in expected]
    launched.clear()
    cupy_stats.basic_stats_group_into([(xs[0], 100), (xs[1], 200)])  # two tensors: the third slot has no blocks
    ((_, grid, _, args),) = launched
    assert grid == 21 * 1000 // 1500 + 21 * 500 // 1500 and args[8:12] == (0, np.int64(0), np.uint32(0), 0)
    assert type(args[10]) is np.uint32


def test_the_blocks_are_found_once_per_group_of_shapes(launched, monkeypatch):
    grids = []
    monkeypatch.setattr(cupy_stats, "_GROUP_GRIDS", {})
    monkeypatch.setattr(cupy_stats, "group_grids", lambda numels, vec, most: grids.append(numels) or (2, 1))
    x, w = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
    for _ in range(2):
        cupy_stats.basic_stats_group_into([(x, 100), (w, 200)])
    cupy_stats.basic_stats_group_into([(w, 300), (x, 400)])
    assert [(grid, args[2], args[6]) for _, grid, _, args in launched] == [(3, 2, 1)] * 3
    assert grids == [(64 * 32, 16 * 32), (16 * 32, 64 * 32)]


def test_one_tensor_is_a_lone_launch(launched):
    x = torch.zeros(4096, dtype=torch.float32)
    cupy_stats.basic_stats_group_into([(x, 100)])
    ((kernel, grid, _, args),) = launched
    assert kernel == ("stats.cu", "ted_stats", dtype_options(x)) and grid == 4096 // 4 // THREADS
    assert args == (x.data_ptr(), np.int64(4096), 5000, 9000 + 4 * TICKETS["stats"], 100)


def test_the_queue_fills_groups_the_kernel_takes_whole():
    """`tedebug.stats.launch_group` (which must not import a kernel backend) sends its queue out when it holds as
    many tensors as one ``ted_stats_group`` launch takes: the two constants are one number."""
    from tedebug.stats import launch_group

    assert launch_group.GROUP_MAX == cupy_stats.GROUP_MAX == 3


def test_bad_groups(launched):
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.float64)
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        cupy_stats.basic_stats_group_into([(a, 1)] * 4)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        cupy_stats.basic_stats_group_into([(b, 1), (b, 2)])
    with pytest.raises(ValueError, match="one dtype"):
        cupy_stats.basic_stats_group_into([(a, 1), (a.half(), 2)])
    assert launched == []
