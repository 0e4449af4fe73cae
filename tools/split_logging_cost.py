"""Split a logging feature's step-time cost into its parts by replacing one part at a time with a no-op:

    python tools/split_logging_cost.py --setting hp-log [--device cuda] [--hidden 256 --heads 2 --batch 1 --seq 128]

Settings (`tedebug.bench.logging_config`, as in `tedebug bench --e2e` and `tools/profile_step.py`): ``hp-log`` is
LogTensorStats (8 statistics, the 6 tensors of every GEMM, freq 1) on the bf16 model; ``fp8-log`` is
LogFp8TensorStats (underflows%, mse, scale_inv_min/max on activation, weight and gradient, freq 1) on the model
under FP8 current scaling.  The model is `tedebug.bench`'s
12-block stack.  The variants, each run as whole training steps in interleaved rounds (CUDA: back-to-back steps
timed by the wall clock between two synchronisations; CPU: one torch thread, process time):

- ``no debug``: the model without debug_api, the baseline;
- ``whole feature``: the setting as it is;
- ``feature's feed a no-op``: the feature's per-tensor feed returns at once.  What remains over the baseline is the
  debug path: the gate, the debug quantizers and the autograd function with debug operands (for ``fp8-log`` also
  the quantization-error statistics the debug quantizers ask of the quantizer: free in the CUDA cast kernel,
  computed by numpy on the CPU);
- ``engine's feed a no-op``: `StatsEngine.feed` returns at once.  Nothing is fed, so the step's read-back and
  emission have nothing to do either;
- ``emission a no-op``: `StatsEngine._emit` returns at once: no final formulas, no sink writes.
- ``backward's inspection a no-op`` (``hp-log``): the hook that inspects a GEMM's dy, dx and dW
  (`tedebug.nn.base._inspect_backward`, registered on the node of the linear) returns at once: the backward's half
  of the logged tensors is neither inspected nor fed.

Each row also gives the host time of the step's four phases (`bench.train_step`'s ``phases``: forward,
backward, optimizer, ``debug_api.step()``; medians over the steps of all rounds).  On a CUDA step bound by the host
they say where the time goes: the backward runs on autograd's device thread, so its inspections are paid there.

The part of a logged tensor is then the difference of two rows: the engine's (its feed, its launches, the
read-back) is ``whole feature`` − ``engine's feed a no-op`` − the emission's, and the emission's is ``whole
feature`` − ``emission a no-op``.  A host that drifts during the run moves every row: compare rows of one run, and
repeat it.  The no-ops replace internals (`tedebug.features.log_tensor_stats.InspectPlan.feed`,
`tedebug.features.log_fp8_tensor_stats._BoundFeed.__call__`, `StatsEngine.feed`, `StatsEngine._emit` and
`tedebug.nn.base._inspect_backward`); the tool fails loudly if one of them is renamed.  docs/performance.md
sections 5 and 25 have runs on the H200.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from typing import Callable, Dict, List

import torch

from tedebug import bench, debug_api
from tedebug import recipe as recipe_module
from tedebug.features import log_fp8_tensor_stats, log_tensor_stats
from tedebug.nn import base as nn_base
from tedebug.stats.engine import StatsEngine

VARIANTS = ("no debug", "whole feature", "feature's feed a no-op", "engine's feed a no-op", "emission a no-op")
BACKWARD_NO_OP = "backward's inspection a no-op"
LAYERS = 12  # blocks of the model, 4 linear layers each


def _no_op(*args, **kwargs) -> None:
    return None


def _patches(setting: str) -> Dict[str, List[tuple]]:
    """Variant -> the (owner, attribute) pairs it replaces with `_no_op`."""
    feature_feed = (
        (log_tensor_stats.InspectPlan, "feed") if setting == "hp-log" else (log_fp8_tensor_stats._BoundFeed, "__call__")
    )
    patches = {
        "feature's feed a no-op": [feature_feed],
        "engine's feed a no-op": [(StatsEngine, "feed")],
        "emission a no-op": [(StatsEngine, "_emit")],
    }
    if setting == "hp-log":  # (the FP8 setting's GEMMs inspect in `_LinearFunction`'s backward instead)
        patches[BACKWARD_NO_OP] = [(nn_base, "_inspect_backward")]
    return patches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", default="hp-log", choices=("hp-log", "fp8-log"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    bench.add_shape_arguments(p, hidden=256, heads=2, batch=1, seq=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    on_gpu = a.device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    # (the compiled linear built or loaded there: every timed step takes the same path)
    model, x, opt = bench.training_setup(LAYERS, a.hidden, a.heads, a.batch, a.seq, a.device, dtype)
    config = bench.logging_config(a.setting)
    recipe = recipe_module.Float8CurrentScaling() if a.setting == "fp8-log" else None
    patches = _patches(a.setting)
    originals = {pair: pair[0].__dict__[pair[1]] for pairs in patches.values() for pair in pairs}
    clock: Callable[[], float] = time.perf_counter if on_gpu else time.process_time

    def timed(phases: list) -> float:
        for _ in range(3):
            bench.train_step(model, x, opt, recipe)
        if on_gpu:
            torch.cuda.synchronize()
        start = clock()
        for _ in range(a.steps):
            bench.train_step(model, x, opt, recipe, phases)
        if on_gpu:
            torch.cuda.synchronize()
        return (clock() - start) * 1e3 / a.steps

    variants = VARIANTS + tuple(v for v in patches if v not in VARIANTS)
    results: Dict[str, List[float]] = {v: [] for v in variants}
    phases: Dict[str, list] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as log_dir:
        for r in range(a.rounds):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                for owner, name in patches.get(variant, ()):
                    setattr(owner, name, _no_op)
                try:
                    if variant != "no debug":
                        debug_api.initialize(config, log_dir=log_dir)
                    try:
                        results[variant].append(timed(phases[variant]))
                    finally:
                        if variant != "no debug":
                            debug_api.end_debug()
                finally:
                    for (owner, name), original in originals.items():
                        setattr(owner, name, original)
    base = statistics.median(results["no debug"])
    per_step = bench.LOGGED_PER_LAYER[a.setting] * 4 * LAYERS
    print(
        f"{a.setting} on {a.device}, hidden {a.hidden}, {a.batch}x{a.seq} tokens, medians of {a.rounds} interleaved "
        f"rounds of {a.steps} steps ({per_step} logged tensors per step)"
    )
    for variant in variants:
        median = statistics.median(results[variant])
        extra = median - base
        rounds = ", ".join(f"{v:.1f}" for v in results[variant])
        print(
            f"  {variant:30s} {median:8.2f} ms/step  {extra:+8.2f} ms  {extra * 1e3 / per_step:+7.1f} us/tensor"
            f"   [{rounds}]"
        )
    print("host time per phase (ms; medians over the steps of all rounds): forward, backward, optimizer, step()")
    for variant in variants:
        columns = (statistics.median(column) * 1e3 for column in zip(*phases[variant]))
        print(f"  {variant:30s} " + "  ".join(f"{value:7.2f}" for value in columns))


if __name__ == "__main__":
    main()
