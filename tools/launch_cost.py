"""Where the host time of a statistics launch goes on a GPU host: the CUDA driver's call or tedebug's Python.

    python tools/launch_cost.py [--calls 5000] [--rounds 7]

Times, in a tight loop on one [128, 256] bf16 tensor (medians of interleaved rounds, µs per call):

- ``cuLaunchKernel`` alone: the driver call through ctypes with everything prepared (function, grid, stream, the
  packed parameter block), as `launch._launch_driver` makes it;
- `cupy_stats.basic_stats_into` (a lone statistics launch) and `basic_stats_group_into` of three tensors (the
  launch of a GEMM call's logged tensors), each also with the driver call replaced by a function that returns at
  once: their Python alone;
- two torch calls for scale: ``torch.empty(13)`` on the GPU and ``x.sum()``.

Why: `tools/profile_step.py --parts` puts about a third of a logged tensor's host time on the H200 hosts in the
grouped launches, and a tight loop there costs 16–17 µs per launch where the same Python with a stand-in driver
takes under 5 µs on the CI VM.  This tells the two apart on the host itself (docs/performance.md, section 17).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tedebug.backends import cupy_runtime, cupy_stats, launch


def per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn()
        if i % 512 == 511:  # (the GPU keeps up: this only bounds the queue)
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    xs = [torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    rows = torch.empty(3, cupy_stats.BASIC_ROW_LEN, dtype=torch.float64, device="cuda")
    items = [(x, rows[i].data_ptr()) for i, x in enumerate(xs)]
    x, row = xs[0], rows[0].data_ptr()
    cupy_stats.basic_stats_into(x, row)
    cupy_stats.basic_stats_group_into(items)
    torch.cuda.synchronize()

    # the driver call as `launch._launch_driver` makes it, everything prepared once
    kernel = cupy_stats._STATS_LAUNCH[(0, x.dtype)][0]
    stream = launch.raw_stream(0)
    partials, tickets = cupy_runtime.workspace_on(0, stream)
    grid = cupy_stats.lone_grid(x, 0)
    call_args = (x.data_ptr(), np.int64(x.numel()), partials, tickets + cupy_stats.STATS_TICKET_OFFSET, row)
    params = launch._arg_block(call_args, kernel.name).params
    launch_fn = launch._driver()[0]
    function = kernel.handle(0)

    def driver_only() -> None:
        launch_fn(function, grid, 1, 1, cupy_runtime.THREADS, 1, 1, 0, stream, params, None)

    lone = lambda: cupy_stats.basic_stats_into(x, row)  # noqa: E731
    group = lambda: cupy_stats.basic_stats_group_into(items)  # noqa: E731
    # name -> (call, whether the driver is replaced by a stand-in that returns at once)
    settings = {
        "cuLaunchKernel alone (ctypes, prepared)": (driver_only, False),
        "basic_stats_into (lone launch)": (lone, False),
        "  the same, its Python alone (stand-in driver)": (lone, True),
        "basic_stats_group_into (3 tensors)": (group, False),
        "  the same, Python alone (stand-in driver)": (group, True),
        "torch.empty(13) on the GPU": (lambda: torch.empty(13, device="cuda"), False),
        "x.sum()": (lambda: x.sum(), False),
    }
    real_driver = launch._driver
    stand_in = ((lambda *a: 0), None)
    samples = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, (fn, stand_in_driver) in settings.items():
            launch._driver = (lambda: stand_in) if stand_in_driver else real_driver
            try:
                samples[name].append(per_call_us(fn, args.calls))
            finally:
                launch._driver = real_driver
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: host µs per call, median of {args.rounds} rounds"
    )
    for name, values in samples.items():
        print(f"  {name:<45} {statistics.median(values):7.2f}  ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
