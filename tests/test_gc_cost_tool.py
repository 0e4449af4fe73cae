"""`tools/gc_cost.py`: its cyclic-garbage check counts exactly the cycles a step leaves (none for tedebug's logged CPU
step, one per step for a step that makes one), and its timed run prints one collection count per generation."""

from __future__ import annotations

import re
import subprocess
import sys

from support.tools import TOOLS, load_tool

TOOL = TOOLS / "gc_cost.py"


def _tool():
    return load_tool("gc_cost")


def test_the_cycles_check_counts_the_cycles_a_step_leaves():
    tool = _tool()
    assert (
        tool.cycles_report("clean", lambda: [object() for _ in range(100)]) == "clean: 0.0 unreachable objects per step"
    )

    def one_cycle():  # a list holding itself: one unreachable object per step once it goes out of scope
        cycle: list = []
        cycle.append(cycle)

    assert tool.cycles_report("cyclic", one_cycle) == "cyclic: 1.0 unreachable objects per step (builtins.list 1.0)"


def _run(*args: str) -> str:
    tiny = ("--device", "cpu", "--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "4")
    done = subprocess.run([sys.executable, str(TOOL), *tiny, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_logged_cpu_step_leaves_no_cycle_and_the_timed_run_counts_every_generation():
    assert _run("--setting", "fp8-log", "--cycles") == "fp8-log: 0.0 unreachable objects per step"
    line = _run("--setting", "hp-log", "--steps", "4")
    assert re.fullmatch(
        r"hp-log, 4 steps: median step \d+\.\d\d ms; collections: gen0 \d+\.\d{3} per step, gen1 \d+\.\d{3} per step, "
        r"gen2 \d+\.\d{3} per step; collector \d+ us per step \(\d+ tracked objects in the process\)",
        line,
    ), line
