"""`tools/profile_step.py --parts` times the debug path's main functions inside real training steps: run on the CPU
with one block (4 GEMMs, 24 logged tensors per step), every timed function it reaches shows with its exact number of
calls per step (the wrappers reach the functions the layers call through their own module references), and every
name in its table still exists (a rename fails here, not in a later measurement)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from support.tools import TOOLS, load_tool

TOOL = TOOLS / "profile_step.py"


def _tool():
    return load_tool("profile_step")


def test_every_part_exists():
    for module_name, qualified in _tool().PARTS:
        owner = importlib.import_module(module_name)
        for part in qualified.split("."):
            owner = getattr(owner, part)
        assert callable(owner), (module_name, qualified)


@pytest.mark.parametrize(
    "writer, writes",
    [
        ("process", "tedebug.sinks.process_writer.ProcessWriter.submit"),
        ("thread", "tedebug.sinks.background.BackgroundWriter._write"),
    ],
)
def test_parts_of_a_logged_step_with_their_calls(writer, writes):
    shape = ["--layers", "1", "--hidden", "16", "--heads", "2", "--batch", "1", "--seq", "4", "--writer", writer]
    command = [sys.executable, str(TOOL), "--device", "cpu", "--setting", "hp-log", "--steps", "2", "--parts", *shape]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "24 logged tensors per step" in lines[0]
    calls = {}
    for line in lines[1:]:
        match = re.match(r"\s+(\S+)\s+[\d.]+ ms/step\s+(\d+) calls/step\s+[\d.]+ us/logged tensor$", line)
        assert match, line
        calls[match.group(1)] = int(match.group(2))
    assert calls == {
        "tedebug.nn.base.linear_gemm": 4,
        "tedebug.nn.debug_gate.LayerDebugState.debug_quantizers": 4,
        "tedebug.nn.base._inspected_linear": 4,  # (high precision, inspection only: torch's own linear)
        "tedebug.nn.base._inspect_backward": 4,
        "tedebug.debug_quantization.inspect_group": 8,  # (x, W, y and dy, dx, dW: `DebugQuantizer._inspect` not called)
        "tedebug.stats.engine.StatsEngine.feed": 24,
        "tedebug.debug_api.step": 1,
        "tedebug.stats.engine.StatsEngine.step": 1,
        "tedebug.stats.readback.OneRowStepInFlight.values": 1,  # (a one-row step: every buffer one host row)
        "tedebug.sinks.base.MetricLogger.flush_and_wait": 1,
        writes: 1,  # the statistics written in the step (thread), or handed to the writer process
    }  # (the grouped GPU launches, `launch_group._launch`, run only on CUDA)
