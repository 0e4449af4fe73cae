"""A/B in one process: an FP8 per-tensor quantization of a logged tensor in one launch, or in two.

    python tools/ab_logged_quantization.py [--rounds 9] [--calls 1000] [--steps 10]

On the 16-bit fast shape a quantization whose input LogTensorStats also logs (`high_precision_stats`) runs the
statistics pass and the cast in one launch (``ted_fp8_current_stats_cast16``, ``ted_fp8_delayed_stats_cast16``).
The tool switches those two kernels off and on in turn inside one process (by replacing
`cupy_fp8_tensor._fused_current` and `cupy_fp8_tensor._delayed_in_one_launch` with choosers that refuse a logged
quantization), so that both variants run on the same host minute, and prints medians of interleaved rounds:

1. the host time of one `fp8_current_quantize` / `fp8_delayed_quantize` of a [128, 256] bf16 tensor with the
   statistics pass, in a loop of `--calls` calls, and the kernel launches per call; and for reference the same of
   an unlogged current-scaling quantization, whose one launch (``ted_fp8_current_cast16``) is switched off too: what
   a cooperative launch saves over two plain ones on this host;
2. the `fp8-both` setting of `tedebug bench --e2e` (LogTensorStats and LogFp8TensorStats on activation, weight and
   gradient) on the host-bound model (12 blocks, hidden 256, 1 x 128 tokens) under FP8 current scaling: the host
   time to issue a step from an idle GPU, the step timed by CUDA events, and tedebug's kernel launches per step.

It needs CUDA, CuPy and the driver launch mode (launches are counted at ``cuLaunchKernel`` /
``cuLaunchCooperativeKernel``); docs/performance.md section 16 has a run on the H200.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tedebug import bench, debug_api
from tedebug import recipe as recipe_module
from tedebug.backends import cupy_fp8_tensor, launch

_ONE_LAUNCH = (cupy_fp8_tensor._fused_current, cupy_fp8_tensor._delayed_in_one_launch)


def _two_launch_current(plan, x2d, index, fp8_format, high_precision_stats=False):
    if high_precision_stats:
        return None
    return _ONE_LAUNCH[0](plan, x2d, index, fp8_format, high_precision_stats)


def _two_launch_delayed(plan, high_precision_stats):
    return plan.fast and not high_precision_stats


def _no_current_launch(plan, x2d, index, fp8_format, high_precision_stats=False):
    return None


def use_one_launch(one: bool, unlogged_too: bool = False) -> None:
    """Let a logged quantization take its one-launch kernel (`one`), or the two launches (with `unlogged_too`, an
    unlogged current-scaling quantization too: the reference row)."""
    two = (_no_current_launch if unlogged_too else _two_launch_current, _two_launch_delayed)
    cupy_fp8_tensor._fused_current, cupy_fp8_tensor._delayed_in_one_launch = _ONE_LAUNCH if one else two


class LaunchCounter:
    """Counts tedebug's kernel launches by wrapping the driver functions `tedebug.backends.launch` calls."""

    def __init__(self) -> None:
        self.count = 0
        plain, cooperative = launch._driver(), launch._cooperative_driver()
        if plain is None or cooperative is None or launch.launch_mode() != "driver":
            raise SystemExit("the A/B counts driver launches: it needs libcuda and the driver launch mode")
        launch._driver = lambda: (self._counted(plain[0]),) + tuple(plain[1:])
        launch._cooperative_driver = lambda: (self._counted(cooperative[0]),) + tuple(cooperative[1:])

    def _counted(self, fn):
        def call(*args):
            self.count += 1
            return fn(*args)

        return call


def quantization_ab(a: argparse.Namespace, counter: LaunchCounter) -> None:
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    history, scale = torch.zeros(4, device="cuda"), torch.full((1,), 2.0, device="cuda")
    kinds = {
        "current scaling, logged": lambda: cupy_fp8_tensor.fp8_current_quantize(
            x, "E4M3", 0.0, False, True, True, True
        ),
        "delayed scaling, logged": lambda: cupy_fp8_tensor.fp8_delayed_quantize(
            x, history, scale, "E4M3", True, True, True
        ),
        # the reference: what the cooperative launch of `ted_fp8_current_cast16` saves over two plain launches
        "current scaling, not logged": lambda: cupy_fp8_tensor.fp8_current_quantize(x, "E4M3", 0.0, False, True, True),
    }
    for name, call in kinds.items():
        unlogged = "not logged" in name
        times = {True: [], False: []}
        launches = {}
        for _ in range(a.rounds):
            for one in (True, False):
                use_one_launch(one, unlogged)
                for _ in range(50):
                    call()
                torch.cuda.synchronize()
                counter.count = 0
                start = time.perf_counter()
                for _ in range(a.calls):
                    call()
                times[one].append((time.perf_counter() - start) * 1e6 / a.calls)
                launches[one] = counter.count / a.calls
                torch.cuda.synchronize()
        print(
            f"{name}, [128, 256] bf16: host µs per quantization, one launch "
            f"{statistics.median(times[True]):.1f} ({launches[True]:.0f} launch per call), two launches "
            f"{statistics.median(times[False]):.1f} ({launches[False]:.0f})"
        )


def step_ab(a: argparse.Namespace, counter: LaunchCounter) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[bench._Block(256, 2, i) for i in range(12)]).to("cuda", torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(1, 128, 256, device="cuda", dtype=torch.bfloat16)
    recipe = recipe_module.Float8CurrentScaling()

    def one_step():
        bench.train_step(model, x, optimizer, recipe)

    issue = {True: [], False: []}
    steps = {True: [], False: []}
    launches = {}
    with tempfile.TemporaryDirectory() as log_dir:
        debug_api.initialize(bench.logging_config("fp8-both"), log_dir=log_dir)
        try:
            for _ in range(a.rounds):
                for one in (True, False):
                    use_one_launch(one)
                    for _ in range(3):
                        one_step()
                    samples = []
                    for _ in range(a.steps):
                        torch.cuda.synchronize()
                        counter.count = 0
                        start = time.perf_counter()
                        one_step()
                        samples.append((time.perf_counter() - start) * 1e3)
                        launches[one] = counter.count
                    issue[one].append(statistics.median(samples))
                    steps[one].append(bench.timed_steps_ms(one_step, 2, a.steps, True))
        finally:
            debug_api.end_debug()
    for one in (True, False):
        print(
            f"fp8-both step, {'one launch' if one else 'two launches'}: host issue "
            f"{statistics.median(issue[one]):.2f} ms (rounds {min(issue[one]):.2f}-{max(issue[one]):.2f}), step "
            f"{statistics.median(steps[one]):.2f} ms, tedebug launches per step {launches[one]}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the A/B compares CUDA kernel launches: it needs a GPU")
    counter = LaunchCounter()
    try:
        quantization_ab(a, counter)
        step_ab(a, counter)
    finally:
        use_one_launch(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
