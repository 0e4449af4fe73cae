"""Count the CPU instructions of the debug hot path (callgrind): the figures of tools/probe_hot_path.py, without the
noise of a shared machine.

    .venv/bin/python tools/count_hot_path.py [--steps 5] [--settings hp,hp-log,fp8,fp8-log]

Why: on the 2-core CI VM the probe's timed figures move by ±30 % between identical runs, as much as most single
changes to the hot path; the number of instructions a step executes moves by well under 1 %.  Instructions are not
time (a cache miss costs more than an add), so the probe stays the measure of the issue's targets; this tool tells
whether a change removed work.

How: one child process per setting runs the probe's stack (`tedebug.bench._Block` × 12, hidden 32, 2 heads, 1 × 8
tokens, fp32, one torch thread) under ``valgrind --tool=callgrind``: warm-up steps first, then `--steps` training
steps inside one `functools.reduce` call, which is the only C function callgrind collects in
(``--toggle-collect=functools_reduce``; tedebug never calls `functools.reduce`, so no nested call switches the
collection off).  Settings (the probe's): ``hp`` the stack in high precision without debug_api, ``hp-log``
LogTensorStats with 8 statistics on the 6 tensors of every GEMM at freq 1 (288 logged tensors per step),
``hp-idle`` that feature with ``start_step: 1000000000`` (a session in which no step logs: what an idle step
costs), ``gpu-path`` hp-log with the statistics engine's `backend_for` answering the CPU stand-in of the kernel
backend (`tests/support/slab_backend.py`, as `tools/probe_hot_path.py --only gpu-path`: the GPU path's Python -
slab rows, row scratch, launch groups, the one-row read-back - without the statistics' arithmetic), ``fp8`` the
stack under Float8CurrentScaling without debug_api, ``fp8-log`` that with LogFp8TensorStats (underflows%, mse,
scale_inv_min, scale_inv_max) on activation, weight and gradient (144 per step).  The
instructions of the training thread are counted (callgrind collects per thread; with ``--writer thread`` `step()`
writes the statistics in that thread; the writer process, the default, is another process, which callgrind does not
follow).

Prints the instructions per measured step of each setting and, where both settings of a difference ran: per logged
tensor of LogTensorStats (hp-log − hp), of the GPU path's Python (gpu-path − hp) and of LogFp8TensorStats
(fp8-log − fp8), and FP8 current scaling's extra per linear layer and step (fp8 − hp, 48 layers).  Needs
valgrind; takes a few minutes (torch imports slowly under callgrind).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

LAYERS, HIDDEN, HEADS, BATCH, SEQ = 12, 32, 2, 1, 8
LOGGED = {"hp-log": 6 * 4 * LAYERS, "gpu-path": 6 * 4 * LAYERS, "fp8-log": 3 * 4 * LAYERS}  # logged tensors per step
LINEAR_LAYERS = 4 * LAYERS
SETTINGS = ("hp", "hp-idle", "hp-log", "gpu-path", "fp8", "fp8-log")


#: `--writer`: the sessions' ``background_logging`` (the writer process, the default, or the writer thread)
WRITERS = {"thread": True, "process": "process"}


def child(setting: str, steps: int, warmup: int, writer: str = "process") -> None:
    """The measured run (inside callgrind): warm-up steps, then `steps` steps inside one functools.reduce."""
    import functools
    import warnings

    import torch

    from tedebug import bench, debug_api
    from tedebug import recipe as recipe_module

    torch.set_num_threads(1)
    # (the compiled linear built or loaded there: every counted step takes the same path)
    model, x, optimizer = bench.training_setup(LAYERS, HIDDEN, HEADS, BATCH, SEQ, "cpu", torch.float32)
    recipe = recipe_module.Float8CurrentScaling() if setting.startswith("fp8") else None
    config = None
    if setting in ("hp-log", "hp-idle", "gpu-path"):
        tensors = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]
        # hp-idle: the same feature scheduled to start far beyond the run, so every step is idle (bench's "idle")
        when = {"start_step": 10**9} if setting == "hp-idle" else {"freq": 1}
        config = bench.debug_section("s", LogTensorStats={"stats": bench.LOG_STATS, "tensors": tensors, **when})
    elif setting == "fp8-log":
        tensors = ["activation", "weight", "gradient"]
        config = bench.debug_section(
            "s", LogFp8TensorStats={"stats": bench.FP8_LOG_STATS, "freq": 1, "tensors": tensors}
        )

    if setting == "gpu-path":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from support.slab_backend import slab_backend

        from tedebug.stats import engine as engine_module

        stand_in = slab_backend(scratch=True, fixed_row=torch.ones(BATCH * SEQ, HIDDEN))
        engine_module.backend_for = lambda tensor: stand_in

    def step(count, _):
        bench.train_step(model, x, optimizer, recipe)
        return count + 1

    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if config is not None:
            debug_api.initialize(config, log_dir=log_dir, background_logging=WRITERS[writer])
        for _ in range(warmup):
            bench.train_step(model, x, optimizer, recipe)
        functools.reduce(step, range(steps), 0)  # the only window callgrind collects in
        if config is not None:
            debug_api.end_debug()


def count(setting: str, steps: int, warmup: int, writer: str = "process") -> int:
    """Instructions (callgrind's Ir) of `steps` measured steps of `setting`, in a child process under callgrind."""
    with tempfile.TemporaryDirectory() as out:
        out_file = os.path.join(out, "callgrind.out")
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out_file}",
            "--toggle-collect=functools_reduce",
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            setting,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--writer",
            writer,
        ]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{setting}: callgrind run failed ({run.returncode}):\n{run.stderr[-3000:]}")
        with open(out_file) as f:
            for line in f:
                match = re.match(r"(?:summary|totals):\s+(\d+)", line)
                if match:
                    return int(match.group(1))
    raise SystemExit(f"{setting}: no instruction total in the callgrind output")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument(
        "--writer",
        choices=sorted(WRITERS),
        default="process",
        help="who writes the statistics files: the writer process (the sessions' default; its own instructions "
        "run in another process and are not counted) or the writer thread (background_logging=True: `step()` "
        "writes the statistics in the training thread, counted; the figures before the writer process)",
    )
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup, args.writer)
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("count_hot_path: needs valgrind (e.g. `apt-get install valgrind`)")
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"count_hot_path: unknown settings {unknown}; expected some of {list(SETTINGS)}")
    totals = {}
    for setting in settings:
        totals[setting] = count(setting, args.steps, args.warmup, args.writer)
        print(f"{setting:8s} {totals[setting] / args.steps / 1e6:9.2f} M instructions per step", flush=True)
    per_step = {s: t / args.steps for s, t in totals.items()}
    if "hp" in per_step and "hp-log" in per_step:
        print(
            f"LogTensorStats: {(per_step['hp-log'] - per_step['hp']) / LOGGED['hp-log'] / 1e3:.1f} k per logged tensor"
        )
    if "hp" in per_step and "gpu-path" in per_step:
        extra = (per_step["gpu-path"] - per_step["hp"]) / LOGGED["gpu-path"]
        print(f"the GPU path's Python (stand-in backend): {extra / 1e3:.1f} k per logged tensor")
    if "hp" in per_step and "hp-idle" in per_step:
        extra = per_step["hp-idle"] - per_step["hp"]
        print(f"an idle step: {extra / 1e3:.1f} k instructions over high precision ({extra / per_step['hp']:+.2%})")
    if "fp8" in per_step and "fp8-log" in per_step:
        extra = (per_step["fp8-log"] - per_step["fp8"]) / LOGGED["fp8-log"]
        print(f"LogFp8TensorStats over FP8 current scaling: {extra / 1e3:.1f} k per logged tensor")
    if "hp" in per_step and "fp8" in per_step:
        extra = (per_step["fp8"] - per_step["hp"]) / LINEAR_LAYERS
        print(f"FP8 current scaling: {extra / 1e3:.1f} k per linear layer and step over high precision")
    return 0


if __name__ == "__main__":
    sys.exit(main())
