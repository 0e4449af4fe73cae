"""Measure the CPU host-cost figures of issue 14 (the debug hot path), all in one run so that they compare:

    .venv/bin/python tools/probe_hot_path.py [--rounds 7] [--iters 20]

Three figures, each from interleaved rounds (settings measured in turn, `rounds` times), from the medians and from the
fastest rounds (other work on the machine only adds time), on CPU float32 with tiny shapes (12 blocks, hidden 32,
2 heads, 1 x 8 tokens) so that the host cost dominates:

1. host time per logged tensor: a 12-block stack of tedebug layers (`tedebug.bench._Block`: LayerNormLinear,
   Linear, LayerNormMLP = 4 GEMMs per block), LogTensorStats with 8 statistics on the 6 tensors of every GEMM at
   freq 1, minus the same steps without debug_api, divided by the 288 tensors logged per step; and the part of it
   that is the debug path without the statistics (the same logged steps with `StatsEngine.feed` replaced by a
   no-op: the gate, the plans, the debug quantizers, the autograd function with debug operands, the feature's
   inspection up to the statistics engine), and the part that is the emission (the same logged steps with
   `StatsEngine._emit` a no-op: the final formulas and the sinks' formatting and writing, on the writer thread);
2. a plain torch GPT stack (`tedebug.bench._TorchBlock`) converted with `tedebug.convert_model`, run without
   debug_api in high precision, against the plain torch model (overhead in %);
3. FP8 current scaling: the converted model under `Float8CurrentScaling` minus the plain torch model, per
   converted linear layer (4 per block) and step;
4. the statistics engine alone (``--only feed`` runs only this one): `StatsEngine.feed` of 288 CPU tensors [8, 32]
   with the 8 statistics and `StatsEngine.step` without the emission, per tensor;
5. LogFp8TensorStats (underflows%, mse, scale_inv_min, scale_inv_max on activation, weight and gradient at freq 1)
   over the stack under FP8 current scaling, minus the same steps without debug_api, per logged tensor
   (``--only fp8log``).
6. the GPU path's bookkeeping without a GPU (``--only gpu-path``): figure 1's logged steps with the statistics
   engine's `backend_for` answering the CPU stand-in of the kernel backend (`tests/support/slab_backend.py`, with its
   scratch launches), whose launches copy one fixed row (no arithmetic per tensor), so the feeds take the GPU
   path's Python - slab rows, row scratch, launch groups, the read-back of a one-row step - and the figure per
   logged tensor is that Python over the stack without debug_api.  It moves with the Python a GPU step spends per
   logged tensor (inside a GPU step each part costs several times more: docs/performance.md, section 25), so a change
   to that path can be compared on the CPU; the logged values are the fixed row's.

A machine shared with other work drifts: compare figures of one run only.  ``--clock cpu`` measures the process's
CPU time (`time.process_time`, every thread of the training process) instead of wall time: time
spent waiting for a core that other work holds does not count, which makes figures from a busy machine compare.
The statistics writer process (the default `background_logging`) is another process: its time is not counted;
it runs on another core, as it does in training.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

LAYERS, HIDDEN, HEADS, BATCH, SEQ = 12, 32, 2, 1, 8
STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]
FP8_STATS = ["underflows%", "mse", "scale_inv_min", "scale_inv_max"]  # the LogFp8TensorStats setting
FP8_TENSORS = ["activation", "weight", "gradient"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--only", choices=("stats", "convert", "feed", "fp8log", "gpu-path", "all"), default="all")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: time.process_time (all threads of this process)",
    )
    parser.add_argument(
        "--writer",
        choices=("process", "thread"),
        default="process",
        help="who writes the statistics files: the writer process (the sessions' default) or the writer thread "
        "(background_logging=True, which writes each step's batch in the training thread)",
    )
    args = parser.parse_args()
    background_logging = True if args.writer == "thread" else "process"
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    import copy
    import tempfile

    import tedebug
    from tedebug import debug_api
    from tedebug.bench import _Block, _TorchBlock
    from tedebug.recipe import Float8CurrentScaling

    torch.manual_seed(0)
    from tedebug.nn import compiled_linear

    compiled_linear.prepare()  # (built or loaded now: every timed step takes the same path)
    stack = torch.nn.Sequential(*[_Block(HIDDEN, HEADS, i) for i in range(LAYERS)])
    plain = torch.nn.Sequential(*[_TorchBlock(HIDDEN, HEADS) for _ in range(LAYERS)])
    converted = tedebug.convert_model(copy.deepcopy(plain))
    x = torch.randn(BATCH, SEQ, HIDDEN)
    gemms = 4 * LAYERS

    def run_steps(model, recipe=None, debug=False) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def one():
            with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
                y = model(x)
            y.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if debug:
                debug_api.step()

        for _ in range(3):
            one()
        start = clock()
        for _ in range(args.iters):
            one()
        return (clock() - start) * 1e6 / args.iters  # us per step

    full = {
        "all": {
            "enabled": True,
            "layers": {"layer_types": ["all"]},
            "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": STATS, "tensors": TENSORS, "freq": 1}},
        }
    }

    def logged() -> float:
        with tempfile.TemporaryDirectory() as log_dir:
            debug_api.initialize(full, log_dir=log_dir, background_logging=background_logging)
            try:
                return run_steps(stack, debug=True)
            finally:
                debug_api.end_debug()

    from tedebug.stats.engine import StatsEngine

    fp8_log = {
        "all": {
            "enabled": True,
            "layers": {"layer_types": ["all"]},
            "transformer_engine": {
                "LogFp8TensorStats": {"enabled": True, "stats": FP8_STATS, "tensors": FP8_TENSORS, "freq": 1}
            },
        }
    }

    def fp8_logged() -> float:
        with tempfile.TemporaryDirectory() as log_dir:
            debug_api.initialize(fp8_log, log_dir=log_dir, background_logging=background_logging)
            try:
                return run_steps(stack, Float8CurrentScaling(), debug=True)
            finally:
                debug_api.end_debug()

    def logged_without_statistics() -> float:
        real = StatsEngine.feed
        StatsEngine.feed = lambda self, *args, **kwargs: None
        try:
            return logged()
        finally:
            StatsEngine.feed = real

    def logged_without_emission() -> float:
        real = StatsEngine._emit
        StatsEngine._emit = lambda self, *args, **kwargs: None
        try:
            return logged()
        finally:
            StatsEngine._emit = real

    def gpu_path_logged() -> float:
        """`logged` with the engine's `backend_for` answering the stand-in kernel backend (figure 6)."""
        sys.path.insert(0, str(ROOT / "tests"))
        from support.slab_backend import slab_backend

        from tedebug.stats import engine as engine_module

        stand_in = slab_backend(scratch=True, fixed_row=torch.ones(BATCH * SEQ, HIDDEN))
        real = engine_module.backend_for
        engine_module.backend_for = lambda tensor: stand_in
        try:
            return logged()
        finally:
            engine_module.backend_for = real

    def engine_only() -> float:
        """The statistics engine alone: 288 CPU tensors [8, 32] fed per step (8 statistics), the step without the
        emission; us per step as the other settings (the figure divides by the 288 tensors)."""
        from tedebug import active
        from tedebug.stats.definitions import StatRequest

        requests = tuple(StatRequest.parse_hp(name, tensor_name="activation") for name in STATS)
        tensors = [torch.randn(BATCH * SEQ, HIDDEN) for _ in range(6 * gemms)]
        real = StatsEngine._emit
        StatsEngine._emit = lambda self, *args, **kwargs: None
        try:
            with tempfile.TemporaryDirectory() as log_dir:
                debug_api.initialize(full, log_dir=log_dir, background_logging=background_logging)
                try:
                    engine = active.session().stats

                    def one(iteration: int) -> None:
                        for i, t in enumerate(tensors):
                            engine.feed(f"L{i}", "activation", requests, t, iteration=iteration, options=(1,))
                        engine.step(iteration)

                    for i in range(3):
                        one(i)
                    start = clock()
                    for i in range(args.iters):
                        one(3 + i)
                    return (clock() - start) * 1e6 / args.iters
                finally:
                    debug_api.end_debug()
        finally:
            StatsEngine._emit = real

    settings = []
    if args.only in ("feed", "all"):
        settings.append(("statistics engine alone: 288 feeds + step, no emission", engine_only))
    if args.only in ("gpu-path", "stats", "all"):
        settings.append(("stack, no debug_api", lambda: run_steps(stack)))
    if args.only in ("gpu-path", "all"):
        settings.append(("stack, LogTensorStats through the GPU path (stand-in)", gpu_path_logged))
    if args.only in ("stats", "all"):
        settings += [
            ("stack, LogTensorStats 8 stats x 6 tensors, freq 1", logged),
            ("stack, the same without the statistics (feed a no-op)", logged_without_statistics),
            ("stack, the same without the emission (_emit a no-op)", logged_without_emission),
        ]
    if args.only in ("fp8log", "all"):
        settings += [
            ("stack, Float8CurrentScaling, no debug_api", lambda: run_steps(stack, Float8CurrentScaling())),
            ("stack, Float8CurrentScaling, LogFp8TensorStats", fp8_logged),
        ]
    if args.only in ("convert", "all"):
        settings += [
            ("plain torch", lambda: run_steps(plain)),
            ("converted, high precision", lambda: run_steps(converted)),
            ("converted, Float8CurrentScaling", lambda: run_steps(converted, Float8CurrentScaling())),
        ]
    samples = {label: [] for label, _ in settings}
    for _ in range(args.rounds):
        for label, fn in settings:
            samples[label].append(fn())
    med = {label: statistics.median(values) for label, values in samples.items()}
    low = {label: min(values) for label, values in samples.items()}
    from tedebug.backends import host_kernels

    cast = "compiled helpers" if host_kernels.host_fp8() is not None else "numpy"
    print(
        f"torch {torch.__version__}, CPU float32, {LAYERS} blocks, hidden {HIDDEN}, {BATCH}x{SEQ} tokens, "
        f"{args.rounds} interleaved rounds x {args.iters} steps, {args.clock} clock (median; min-max); "
        f"the CPU FP8 cast: {cast} (${host_kernels.ENV_VAR})"
    )
    for label, values in samples.items():
        print(f"  {label:55s} {med[label]:9.0f} us/step  ({min(values):.0f}-{max(values):.0f})")
    # figures from the medians, and from the fastest rounds (other work on the machine only ever adds time)
    for name, pick in (("median", med), ("min", low)):
        if "statistics engine alone: 288 feeds + step, no emission" in pick:
            alone = pick["statistics engine alone: 288 feeds + step, no emission"] / (6 * gemms)
            print(f"[{name}] statistics engine alone (StatsEngine.feed + step, no emission): {alone:.1f} us per tensor")
        if "stack, LogTensorStats through the GPU path (stand-in)" in pick:
            per = (pick["stack, LogTensorStats through the GPU path (stand-in)"] - pick["stack, no debug_api"]) / (
                6 * gemms
            )
            print(f"[{name}] host time per logged tensor through the GPU path's bookkeeping (stand-in): {per:.1f} us")
        if "stack, LogTensorStats 8 stats x 6 tensors, freq 1" in pick:
            logged = pick["stack, LogTensorStats 8 stats x 6 tensors, freq 1"]
            per = (logged - pick["stack, no debug_api"]) / (6 * gemms)
            print(f"[{name}] host time per logged tensor (LogTensorStats, 8 stats): {per:.1f} us")
            path = (pick["stack, the same without the statistics (feed a no-op)"] - pick["stack, no debug_api"]) / (
                6 * gemms
            )
            print(f"[{name}]   of which the debug path without the statistics: {path:.1f} us")
            unwritten = pick["stack, the same without the emission (_emit a no-op)"]
            print(
                f"[{name}]   of which the final formulas and the sinks (emission): "
                f"{(logged - unwritten) / (6 * gemms):.1f} us"
            )
        if "stack, Float8CurrentScaling, LogFp8TensorStats" in pick:
            per = (
                pick["stack, Float8CurrentScaling, LogFp8TensorStats"]
                - pick["stack, Float8CurrentScaling, no debug_api"]
            ) / (len(FP8_TENSORS) * gemms)
            print(f"[{name}] host time per logged tensor (LogFp8TensorStats over FP8 current scaling): {per:.1f} us")
        if "plain torch" in pick:
            base = pick["plain torch"]
            print(
                f"[{name}] converted model without debug_api vs plain torch: "
                f"{100 * (pick['converted, high precision'] / base - 1):+.1f} %"
            )
            extra = (pick["converted, Float8CurrentScaling"] - base) / gemms
            print(
                f"[{name}] FP8 current scaling, extra host time per layer-step over plain torch: {extra:.0f} us "
                f"(per converted linear layer and training step)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
