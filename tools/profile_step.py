"""Profile the host side of training steps of the `tedebug bench --e2e` model (cProfile), for one debug setting:

    python tools/profile_step.py --setting fp8-log [--hidden 2048 --batch 8 --seq 1024] [--steps 10] [--top 40]

Settings: ``hp`` (no debug), ``hp-log`` (LogTensorStats, 8 statistics, 6 tensors), ``fp8`` (FP8 current scaling,
or --recipe, no debug), ``fp8-log`` (LogFp8TensorStats underflows%/mse/scale_inv_min/scale_inv_max on
activation/weight/gradient),
``fp8-both`` (that and LogTensorStats on the same tensors).  Prints the wall time per step and the functions with
the most own time and cumulative time.

``--issue`` (CUDA) answers "is this setting bound by the host?" instead: each step starts with the GPU idle, and the
tool prints the median time the host takes to issue a step (the Python returns) next to the synchronised step and
the GPU's kernel time per step (torch.profiler, over the same number of steps).  When the issue time comes close to
the kernel time, every µs of host work a feature adds shows in the step (docs/performance.md, section 2).

``--parts`` answers "where does a logged tensor's host time go, inside a real step?": the main functions of the
debug path (`PARTS`) are wrapped with a clock, and the tool prints each one's inclusive host time per step, its calls
per step and its time per logged tensor.  Unlike cProfile, which slows every Python call several times and so
shifts the balance between Python and the GPU, the wrappers time only these functions (a few tenths of a µs each),
so the figures are what the parts cost inside the step, where they cost several times what they cost in a tight loop
(docs/performance.md, sections 4 and 7).  The times nest (a feed runs inside an inspection, which runs inside a
layer's forward): compare a row with the rows inside it, not the sum of the rows.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import pstats
import statistics
import tempfile
import time
from typing import Callable, Dict

import torch

from tedebug import bench, debug_api
from tedebug import recipe as recipe_module


#: the functions `--parts` times: (module, qualified name in it), outermost first
PARTS = (
    ("tedebug.nn.base", "linear_gemm"),
    ("tedebug.nn.debug_gate", "LayerDebugState.debug_quantizers"),
    ("tedebug.nn.base", "_inspected_linear"),
    ("tedebug.nn.base", "_inspect_backward"),
    ("tedebug.debug_quantization", "inspect_group"),  # (the tensors of an inspect-only GEMM call's half)
    ("tedebug.nn.base", "_LinearFunction._forward"),
    ("tedebug.nn.base", "_LinearFunction._backward"),
    ("tedebug.nn.gemm", "gemm"),
    ("tedebug.quantization.tensor", "Quantizer.quantize"),
    ("tedebug.debug_quantization", "DebugQuantizer.quantize"),
    ("tedebug.debug_quantization", "DebugQuantizer._inspect"),
    ("tedebug.stats.engine", "StatsEngine.feed"),
    ("tedebug.stats.engine", "SlabFeeder.feed"),  # (LogTensorStats' usual GPU feed after a buffer's first)
    ("tedebug.stats.launch_group", "_launch"),
    ("tedebug.debug_api", "step"),
    ("tedebug.stats.engine", "StatsEngine.step"),
    ("tedebug.stats.readback", "RowsInFlight.__init__"),
    ("tedebug.stats.readback", "RowsInFlight.host_rows"),
    ("tedebug.stats.readback", "OneRowStepInFlight.values"),  # (a step whose every buffer holds one row)
    ("tedebug.sinks.base", "MetricLogger.flush_and_wait"),
    ("tedebug.sinks.background", "BackgroundWriter._write"),
    ("tedebug.sinks.process_writer", "ProcessWriter.submit"),
)
#: `--writer`: the session's ``background_logging`` (the writer process, the default, or the writer thread)
WRITERS = {"process": "process", "thread": True}


def config(setting: str):
    """The setting's debug config (`bench.logging_config`), None for the settings without debug_api."""
    return bench.logging_config(setting) if setting in bench.LOGGED_PER_LAYER else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--setting", default="fp8-log", choices=("hp", "hp-log", "fp8", "fp8-log", "fp8-both"))
    bench.add_shape_arguments(p, hidden=2048, heads=16, batch=8, seq=1024, layers=12)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--writer",
        choices=sorted(WRITERS),
        default="process",
        help="who writes the statistics files: the writer process (the default) or the writer thread",
    )
    p.add_argument("--recipe", default="Float8CurrentScaling", help="the recipe of the fp8* settings")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="instead of cProfile: torch.profiler's table of GPU kernels (total time over the steps)",
    )
    p.add_argument(
        "--sort",
        default="cuda_time_total",
        help="--kernels: the table's order (e.g. self_cpu_time_total for the host side of each op and runtime call)",
    )
    p.add_argument(
        "--parts",
        action="store_true",
        help="instead of cProfile: the inclusive host time per step of the debug path's main functions (PARTS)",
    )
    p.add_argument(
        "--issue",
        action="store_true",
        help="CUDA: the host's time to issue a step from an idle GPU, the synchronised step and the GPU kernel time",
    )
    a = p.parse_args()
    if a.issue and a.device != "cuda":
        p.error("--issue measures a CUDA step against its GPU kernel time: it needs --device cuda")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    if a.device == "cpu":  # one thread, as tools/probe_hot_path.py: idle OpenMP workers spinning on a shared machine
        torch.set_num_threads(1)  # inflated every figure many times over
    model, x, opt = bench.training_setup(a.layers, a.hidden, a.heads, a.batch, a.seq, a.device, dtype)
    recipe = getattr(recipe_module, a.recipe)() if a.setting.startswith("fp8") else None
    cfg = config(a.setting)

    def one():
        bench.train_step(model, x, opt, recipe)

    with tempfile.TemporaryDirectory() as d:
        if cfg is not None:
            debug_api.initialize(cfg, log_dir=d, background_logging=WRITERS[a.writer])
        for _ in range(3):
            one()
        if a.device == "cuda":
            torch.cuda.synchronize()
        if a.issue:
            issue_report(a, one)
            return
        if a.parts:
            logged = bench.LOGGED_PER_LAYER.get(a.setting, 0) * 4 * a.layers if cfg is not None else 0
            parts_report(a, one, logged)
            return
        if a.kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
                for _ in range(a.steps):
                    one()
                torch.cuda.synchronize()
            print(kprof.key_averages().table(sort_by=a.sort, row_limit=a.top, max_name_column_width=60))
            return
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        with torch.autograd.set_multithreading_enabled(False):  # backward in this thread, so cProfile sees it
            for _ in range(a.steps):
                one()
        prof.disable()
        host = (time.perf_counter() - t0) * 1e3 / a.steps
        if a.device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / a.steps
        if cfg is not None:
            debug_api.end_debug()
    print(f"{a.setting}: host (profiled) {host:.1f} ms/step, wall {wall:.1f} ms/step")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(a.top)
    st.sort_stats("cumulative").print_stats(a.top)


def _wrap_parts(totals: Dict[str, float], calls: Dict[str, int]) -> Callable[[], None]:
    """Wrap every function of `PARTS` with a clock adding into `totals` and `calls`; returns the undo.  A name that
    no longer exists is an AttributeError here (the table must follow the code)."""
    undo = []
    for module_name, qualified in PARTS:
        owner = importlib.import_module(module_name)
        *outer, name = qualified.split(".")
        for part in outer:
            owner = getattr(owner, part)
        raw = owner.__dict__[name]
        function = raw.__func__ if isinstance(raw, staticmethod) else raw
        key = f"{module_name}.{qualified}"

        def timed(*args, __function=function, __key=key, **kwargs):
            start = time.perf_counter()
            try:
                return __function(*args, **kwargs)
            finally:
                totals[__key] += time.perf_counter() - start
                calls[__key] += 1

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        undo.append((owner, name, raw))
        # modules that imported the function by name call their own reference: point it at the wrapper too
        for module in (importlib.import_module(m) for m in ("tedebug.nn.base", "tedebug.nn.parallel")):
            if not outer and module.__dict__.get(name) is function and module is not owner:
                setattr(module, name, timed)
                undo.append((module, name, function))

    def restore() -> None:
        for owner, name, raw in reversed(undo):
            setattr(owner, name, raw)

    return restore


def parts_report(a, one, logged: int) -> None:
    """`--parts`: the inclusive host time of each function of `PARTS` over `a.steps` steps (backward on autograd's
    thread, as in training)."""
    totals: Dict[str, float] = collections.defaultdict(float)
    calls: Dict[str, int] = collections.Counter()
    restore = _wrap_parts(totals, calls)
    try:
        for _ in range(3):  # warm-up through the wrappers
            one()
        if a.device == "cuda":
            torch.cuda.synchronize()
        totals.clear()
        calls.clear()
        start = time.perf_counter()
        for _ in range(a.steps):
            one()
        host = (time.perf_counter() - start) * 1e3 / a.steps
        if a.device == "cuda":
            torch.cuda.synchronize()
    finally:
        restore()
    per_tensor = f", {logged} logged tensors per step" if logged else ""
    print(f"{a.setting}: host time to issue a step {host:.2f} ms (the timed parts included){per_tensor}")
    for key, total in sorted(totals.items(), key=lambda item: -item[1]):
        line = f"  {key:52s} {total * 1e3 / a.steps:8.2f} ms/step {calls[key] / a.steps:7.0f} calls/step"
        if logged:
            line += f" {total * 1e6 / a.steps / logged:8.1f} us/logged tensor"
        print(line)


def issue_report(a, one) -> None:
    """`--issue`: medians over `a.steps` steps, each started with the GPU idle."""
    from torch.profiler import ProfilerActivity, profile

    issue, step = [], []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        issue.append(t1 - t0)
        step.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as kprof:
        for _ in range(a.steps):
            one()
        torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in kprof.key_averages()) / a.steps / 1e3  # µs -> ms
    print(
        f"{a.setting}: host time to issue a step {statistics.median(issue) * 1e3:.1f} ms, synchronised step "
        f"{statistics.median(step) * 1e3:.1f} ms, GPU kernel time {gpu:.1f} ms per step (medians of {a.steps})"
    )


if __name__ == "__main__":
    main()
