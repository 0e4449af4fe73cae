"""`tools/bench_parallel.py`: the example's model timed in the four settings (one process on the CPU here; the
two-GPU runs are in docs/performance.md), and its count of the waits for the GPU inside ``debug_api.step()``."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import torch

from support.tools import TOOLS, load_tool

CPU, GPU = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name, thread, start, end, device=CPU):
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, thread=thread, time_range=span, device_type=device)


def test_waits_are_counted_inside_the_steps_on_their_thread_and_in_the_control():
    tool = load_tool("bench_parallel")
    events = [
        _event(tool.STEP_RANGE, 1, 0, 100),
        _event(tool.STEP_RANGE, 7, 0, 100, device=GPU),  # the range's copy on the GPU's timeline: not a step
        _event(tool.STEP_RANGE, 1, 400, 500),
        _event("cudaEventSynchronize", 1, 40, 43),  # inside the first step
        _event("cudaEventSynchronize", 1, 450, 452),  # inside the second
        _event("cudaStreamSynchronize", 2, 50, 60),  # in a step's time, on another thread
        _event("cudaStreamSynchronize", 1, 150, 170),  # between the steps
        _event("cudaLaunchKernel", 1, 60, 61),  # no wait
        _event(tool.CONTROL_RANGE, 1, 600, 700),
        _event("cudaDeviceSynchronize", 1, 610, 690),
    ]
    assert tool.count_waits(events) == {
        "steps": 2,
        "inside": {"cudaEventSynchronize": (2, 5)},
        "outside": {"cudaStreamSynchronize": (2, 30)},
        "control": (1, 1),
    }


def test_one_cpu_process_prints_the_four_settings_and_the_trace_and_writes_the_profiles(tmp_path):
    tiny = ["--device", "cpu", "--n-layer", "1", "--batch-size", "16", "--rounds", "1", "--iters", "1", "--warmup", "1"]
    traced = ["--trace", "--trace-steps", "2", "--cprofile", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(TOOLS / "bench_parallel.py"), *tiny, *traced],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("CPU x 1, TP=1 x DP=1, 1 blocks, hidden 64, 4 heads, global batch 16")
    rows = {line.split("|")[0].strip(): line for line in lines if "|" in line}
    tool = load_tool("bench_parallel")
    for label, _, per_gemm in tool.settings():
        assert label in rows
        assert ("us/tensor" in rows[label]) == bool(per_gemm)  # the baseline has no per-tensor figure
    assert lines[-1] == (
        "rank 0: 2 x debug_api.step() (FP8 + both features) traced; CUDA calls that wait for the GPU inside it: none; "
        "elsewhere in those steps: none"
    )
    for short, (label, _, _) in zip(tool.SHORT_NAMES, tool.settings()):
        text = (tmp_path / f"cprofile_{short}_rank0.txt").read_text()
        assert text.startswith(f"{label}: 2 steps\n") and "bench_parallel.py" in text  # the step function's frame
