"""A tedebug kernel may be the first CUDA work of a thread: launched from autograd's device thread before any torch
kernel ran there (a backward whose first op is tedebug's), or from a thread of the user's.  The runtime binds the
device's primary context to a thread only at that thread's first runtime call, so the driver launch finds none
(CUDA_ERROR_INVALID_CONTEXT) unless it binds the context itself (`launch._bind_primary_context`, on that error
only).  Checked on fresh threads: a plain launch gives the row the main thread's launch gives, the occupancy that
sizes a cooperative launch is the main thread's, a cooperative launch (FP8 current scaling) gives the same bytes,
and a kernel whose module was never loaded loads (CuPy's module load needs no context of ours) and launches.
Every test needs CUDA and CuPy."""

import os
import threading

import numpy as np
import pytest
import torch

from tedebug.backends import cupy_fp8_tensor, cupy_stats, launch
from tedebug.backends.cupy_runtime import THREADS, TICKETS, dtype_options, get_kernel, sm_count, workspace_on

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def _on_a_new_thread(work):
    """`work()` run on a new thread (its result, or the exception it raised, re-raised here)."""
    box = {}

    def run():
        try:
            box["result"] = work()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _row(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    cupy_stats.basic_stats_into(x, out.data_ptr())  # the thread's first CUDA work: nothing allocated here
    return out


def test_a_plain_launch_first_on_a_new_thread():
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
    expected = _row(x, torch.empty(len(cupy_stats.BASIC_ROW_KEYS), dtype=torch.float64, device=DEV)).cpu()
    out = torch.empty_like(expected, device=DEV)
    _on_a_new_thread(lambda: _row(x, out))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)


def test_the_occupancy_first_on_a_new_thread():
    x = torch.empty(128, 256, device=DEV, dtype=torch.bfloat16)
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_current_cast16", dtype_options(x, "E4M3"))
    expected = launch.cooperative_blocks_per_sm(kernel, 0, THREADS)
    assert expected > 0
    assert _on_a_new_thread(lambda: launch.cooperative_blocks_per_sm(kernel, 0, THREADS)) == expected


def test_launches_first_in_autograd_device_thread():
    """A backward whose first CUDA work is a tedebug launch (the backward of `sum` only expands the gradient)."""
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
    expected = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True)
    rows = torch.empty(2, len(cupy_stats.BASIC_ROW_KEYS), dtype=torch.float64, device=DEV)
    got = {}

    class _Launches(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, grad):
            cupy_stats.basic_stats_into(x, rows[0].data_ptr())
            got["fp8"] = cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True)
            return grad

    cupy_stats.basic_stats_into(x, rows[1].data_ptr())
    a = torch.zeros(4, device=DEV, requires_grad=True)
    _Launches.apply(a).sum().backward()
    torch.cuda.synchronize()
    assert torch.equal(rows[0], rows[1])
    fp8 = got["fp8"]
    assert torch.equal(fp8.rowwise_data, expected.rowwise_data)
    assert torch.equal(fp8.columnwise_data, expected.columnwise_data)
    assert torch.equal(fp8.scale_inv, expected.scale_inv)


def test_a_kernel_loaded_first_on_a_new_thread():
    """A kernel first used on a new thread (a define no other test compiles makes its module a new one) loads and
    launches there."""
    x = torch.randn(64, 64, device=DEV, dtype=torch.float16)
    options = dtype_options(x) + (f"-DTEDEBUG_TEST_FRESH_MODULE={os.getpid()}",)
    expected = _row(x, torch.empty(len(cupy_stats.BASIC_ROW_KEYS), dtype=torch.float64, device=DEV)).cpu()
    out = torch.zeros_like(expected, device=DEV)

    def work():
        kernel = get_kernel("stats.cu", "ted_stats", options)
        stream = launch.raw_stream(0)
        partials, tickets = workspace_on(0, stream)
        args = (x.data_ptr(), np.int64(x.numel()), partials, tickets + 4 * TICKETS["stats"], out.data_ptr())
        grid = cupy_stats._lone_grid(x.numel(), 16 // x.element_size(), cupy_stats.STATS_BLOCKS_PER_SM * sm_count(0))
        launch.launch_on(kernel, 0, stream, grid, THREADS, args)  # the grid of `basic_stats_into`

    _on_a_new_thread(work)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)
