"""Sample where a logged step's host time goes, thread by thread, with py-spy (a sampling profiler: nothing in the
process is wrapped or slowed, unlike cProfile or `tools/profile_step.py --parts`):

    python tools/sample_step.py [--seconds 32] [--rate 1000] [--device cuda] [--lines _inspect_backward ...]
                                [--hidden 256 --heads 2 --batch 1 --seq 128]
    python tools/sample_step.py --report RAW --steps PLAIN DEBUG [--lines ...]   (a recorded file again)

Needs the ``py-spy`` executable (``pip install py-spy``; on the lent GPU machine, from a wheel carried there), and a
host that lets a process read a child's memory (ptrace).

What runs: `tedebug.bench`'s block stack at the given size (CUDA: bf16; CPU: float32, one torch thread), whose
training steps alternate, in 4 rounds of `--seconds` / 8 each, between steps without debug_api (inside the function
`phase_plain`) and steps with LogTensorStats (8 statistics on the six tensors of every GEMM, freq 1, a new session
per round; inside `phase_debug`).  py-spy records it (``record --nonblocking --threads -f raw``: the process is not
stopped to take a sample, so some samples are lost or show a torn stack; read shares, not totals), and the child
prints how many steps each phase ran.

What is printed, per phase of the main thread and for every other thread that ran Python (autograd's device thread
runs the backward's hooks on a GPU; its stacks have no phase, so they are counted against the logged steps, in
which alone they run Python): the samples' time per step (samples / rate / steps), split by what `train_step`
was doing (forward, backward, optimizer, ``debug_api.step()``), the inclusive time of every function of tedebug's
packages, and the functions with the most own time (the innermost Python frame: a function's own lines, with the C
code they call, torch's ops included).  ``--lines F`` adds, for each function named F (as py-spy names it, e.g.
``DebugQuantizer._inspect``), the split of its samples between its own time and each function it calls, and by its
lines.

A sample counts where the thread is running (py-spy leaves out idle threads: the main thread waiting in
``backward()`` while autograd's thread works is not sampled).  docs/performance.md, section 29, has a run on the
H200.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

PHASES = ("phase_plain", "phase_debug")
OTHER_THREADS = "other threads"
#: the path parts that mark tedebug's own functions in py-spy's frames (its packages, and the features folder)
TEDEBUG_PARTS = ("tedebug/", "features/")
_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


# ------------------------------------------------------------------------------------------------ the run
def child(seconds: float, device: str, hidden: int, heads: int, batch: int, seq: int, counts_path: str) -> None:
    """The sampled process: the alternating phases; writes ``{"phase_plain": steps, "phase_debug": steps}`` (JSON)
    to `counts_path` (py-spy prints its own lines on the same standard output)."""
    import warnings

    import torch

    from tedebug import bench, debug_api

    warnings.simplefilter("ignore")
    on_gpu = device == "cuda"
    if not on_gpu:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # (seed 0; the compiled linear built or loaded there: every sampled step takes the same path)
    model, x, optimizer = bench.training_setup(12, hidden, heads, batch, seq, device, dtype)

    def steps_until(end: float) -> int:
        count = 0
        while time.perf_counter() < end:
            bench.train_step(model, x, optimizer, None)
            count += 1
        return count

    def phase_plain(end: float) -> int:
        return steps_until(end)

    def phase_debug(end: float) -> int:
        return steps_until(end)

    counts = dict.fromkeys(PHASES, 0)
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(3):
            bench.train_step(model, x, optimizer, None)
        for _ in range(4):
            counts["phase_plain"] += phase_plain(time.perf_counter() + seconds / 8)
            debug_api.initialize(bench.logging_config("hp-log"), log_dir=log_dir, background_logging="process")
            for _ in range(3):
                bench.train_step(model, x, optimizer, None)
            counts["phase_debug"] += phase_debug(time.perf_counter() + seconds / 8)
            debug_api.end_debug()
    with open(counts_path, "w", encoding="utf-8") as f:
        json.dump(counts, f)


# ------------------------------------------------------------------------------------------------ the report
#: a py-spy frame: (function name as py-spy gives it, file, line or None)
Frame = Tuple[str, str, Optional[int]]


def parse_frame(text: str) -> Frame:
    """``name (file:line)`` -> (name, file, line); a frame without a location keeps the text as its name."""
    match = _FRAME.match(text)
    if match is None:
        return text, "", None
    line = match.group("line")
    return match.group("name"), match.group("file"), int(line) if line else None


def read_raw(path: str) -> List[Tuple[str, List[Frame], int]]:
    """py-spy's raw (collapsed) stacks: (thread label, frames outermost first, samples) per line."""
    stacks = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            thread, *frames = stack.split(";")
            stacks.append((thread, [parse_frame(frame) for frame in frames], int(count)))
    return stacks


def _label(frame: Frame) -> str:
    name, file, _ = frame
    return f"{name} ({'/'.join(file.split('/')[-2:])})" if file else name


class Tally:
    """The samples of one phase (or of the other threads): totals, train_step's parts, inclusive and own time per
    function, and for the functions of `lines` their callees and lines."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.total = 0
        self.parts: Dict[str, int] = collections.Counter()
        self.inclusive: Dict[str, int] = collections.Counter()
        self.own: Dict[str, int] = collections.Counter()
        self.lines = {name: (collections.Counter(), collections.Counter()) for name in lines}

    def add(self, frames: List[Frame], count: int) -> None:
        self.total += count
        names = [frame[0] for frame in frames]
        if "train_step" in names:
            at = names.index("train_step")
            self.parts[_label(frames[at + 1]) if at + 1 < len(frames) else "train_step itself"] += count
        for label in {_label(frame) for frame in frames}:
            self.inclusive[label] += count
        if frames:
            self.own[_label(frames[-1])] += count
        for name, (callees, by_line) in self.lines.items():
            if name in names:
                at = names.index(name)  # (the outermost call of it in the stack)
                callees[_label(frames[at + 1]) if at + 1 < len(frames) else "(own time)"] += count
                by_line[f"line {frames[at][2]}"] += count


def tally(stacks: List[Tuple[str, List[Frame], int]], lines: Sequence[str] = ()) -> Dict[str, Tally]:
    """Phase (`PHASES`, or `OTHER_THREADS`) -> its `Tally`.  A main-thread stack outside both phases (start-up, the
    warm-up steps) is left out."""
    out = {key: Tally(lines) for key in (*PHASES, OTHER_THREADS)}
    # py-spy labels a thread ``thread (<id>)``, with ``: <name>`` once it has read the name: the main thread's id
    main_ids = {thread.split(")")[0] for thread, _, _ in stacks if thread.endswith(": MainThread")}
    for thread, frames, count in stacks:
        # (the phases are functions nested in `child`: py-spy names them by qualified name)
        names = {frame[0].rpartition(".")[2] for frame in frames}
        phase = next((p for p in PHASES if p in names), None)
        if phase is None:
            if thread.split(")")[0] in main_ids:
                continue
            phase = OTHER_THREADS
        out[phase].add(frames, count)
    return out


def report(tallies: Dict[str, Tally], rate: float, steps: Dict[str, int], top: int = 30) -> str:
    """The printed report (µs per step: samples / rate / the phase's steps; other threads per logged step)."""
    out = []
    for phase, t in tallies.items():
        count = steps.get(phase, steps.get("phase_debug", 0))
        if not t.total or not count:
            continue

        def us(samples: int, count: int = count) -> float:
            return samples / rate / count * 1e6

        out.append(f"== {phase}: {t.total} samples over {count} steps, {us(t.total):.0f} us per step sampled")
        for label, n in sorted(t.parts.items(), key=lambda kv: -kv[1]):
            out.append(f"   {us(n):9.1f}  train_step -> {label}")
        out.append("   inclusive, tedebug's functions:")
        for label, n in sorted(t.inclusive.items(), key=lambda kv: -kv[1]):
            if any(part in label for part in TEDEBUG_PARTS) and n * 100 >= t.total:  # (1 % of the phase or more)
                out.append(f"   {us(n):9.1f}  {label}")
        out.append("   own time:")
        for label, n in sorted(t.own.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"   {us(n):9.1f}  {label}")
        for name, (callees, by_line) in t.lines.items():
            total = sum(callees.values())
            if not total:
                continue
            out.append(f"   {name}: {us(total):.1f} us per step")
            for label, n in sorted(callees.items(), key=lambda kv: -kv[1]):
                out.append(f"   {us(n):9.1f}  {100 * n / total:5.1f} %  -> {label}")
            for label, n in sorted(by_line.items(), key=lambda kv: -kv[1]):
                out.append(f"   {us(n):9.1f}  {100 * n / total:5.1f} %  at {label}")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ main
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=32.0)
    p.add_argument("--rate", type=int, default=1000, help="samples per second")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lines", nargs="*", default=[], help="functions to split by callee and line")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--keep", help="also write py-spy's raw stacks to this file")
    p.add_argument("--report", metavar="RAW", help="report a recorded raw file instead of running")
    p.add_argument("--steps", type=int, nargs=2, metavar=("PLAIN", "DEBUG"), help="with --report: the steps")
    p.add_argument("--child", metavar="COUNTS", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.seconds, a.device, a.hidden, a.heads, a.batch, a.seq, a.child)
        return 0
    if a.report:
        if not a.steps:
            p.error("--report needs --steps PLAIN DEBUG (the steps each phase ran)")
        steps = dict(zip(PHASES, a.steps))
        print(report(tally(read_raw(a.report), a.lines), a.rate, steps, a.top))
        return 0
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("sample_step: needs the py-spy executable on PATH (pip install py-spy)")
    with tempfile.TemporaryDirectory() as out:
        raw = a.keep or os.path.join(out, "stacks.txt")
        counts = os.path.join(out, "steps.json")
        command = [spy, "record", "--nonblocking", "--threads", "-r", str(a.rate), "-f", "raw", "-o", raw, "--"]
        command += [sys.executable, os.path.abspath(__file__), "--child", counts, "--seconds", str(a.seconds)]
        command += ["--device", a.device, "--hidden", str(a.hidden), "--heads", str(a.heads)]
        command += ["--batch", str(a.batch), "--seq", str(a.seq)]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0 or not os.path.exists(raw) or not os.path.exists(counts):
            raise SystemExit(f"sample_step: py-spy's run failed ({run.returncode}):\n{run.stderr[-3000:]}")
        with open(counts, encoding="utf-8") as f:
            steps = json.load(f)
        print(f"steps: {steps}")
        print(report(tally(read_raw(raw), a.lines), a.rate, steps, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
