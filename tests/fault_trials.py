"""Kill trials (shared by tests/test_fault_injection.py and tools/measure_reliability.py).

`kill_trial(how, log_dir, after)` runs tests/fault_child.py in a subprocess, waits until `after` iterations have
returned from `debug_api.step()` (the child prints each), then ends it by `how`: ``"SIGKILL"``, ``"SIGTERM"``,
``"SIGINT"`` or ``"exception"`` (an uncaught error raised by the child itself), waits until the child's statistics
writer process has finished (it writes what it was handed, then ends), and reads what reached the disk.
It returns a `TrialResult`: the iterations whose step() had returned, the iterations found in the JSONL and text
statistics files and in the TensorBoard event files, and every malformed line (a partial or forged line) of either
statistics file.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Set

CHILD = pathlib.Path(__file__).resolve().parent / "fault_child.py"
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - INFO - layer_activation_(max|min|mean) \t\t\t\t "
    r"iteration=(\d{6}) \t\t\t\t value=-?\d+\.\d{4}$"
)


@dataclass
class TrialResult:
    how: str
    returned: Set[int]  # iterations whose step() returned before the end
    in_jsonl: Set[int] = field(default_factory=set)  # iterations with all three statistics in the JSONL file
    in_text: Set[int] = field(default_factory=set)
    in_tensorboard: Set[int] = field(default_factory=set)  # with all three statistics in the event files
    bad_lines: List[str] = field(default_factory=list)
    wrong_values: List[str] = field(default_factory=list)

    @property
    def lost(self) -> Set[int]:
        """Iterations whose step() returned but that are missing from the JSONL file, the text file or the
        TensorBoard event files."""
        return self.returned - (self.in_jsonl & self.in_text & self.in_tensorboard)


def read_statistics(log_dir: str, result: TrialResult) -> None:
    jsonl = pathlib.Path(log_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl")
    counts: dict = {}
    data = jsonl.read_bytes() if jsonl.exists() else b""
    if data and not data.endswith(b"\n"):
        result.bad_lines.append(f"jsonl ends without a newline: {data[-60:]!r}")
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            result.bad_lines.append(f"jsonl: {line!r}")
            continue
        iteration = record["iteration"]
        if record["stat"] == "max" and record["value"] != iteration + 0.5:
            result.wrong_values.append(line)
        counts[iteration] = counts.get(iteration, 0) + 1
    result.in_jsonl = {it for it, n in counts.items() if n == 3}
    text_dir = pathlib.Path(log_dir, "nvdlfw_inspect_statistics_logs")
    counts = {}
    for path in sorted(text_dir.glob("*.log")) if text_dir.exists() else []:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            result.bad_lines.append(f"text ends without a newline: {data[-60:]!r}")
        for line in data.decode("utf-8", "replace").splitlines():
            match = TEXT_LINE.match(line)
            if match is None:
                result.bad_lines.append(f"text: {line!r}")
                continue
            iteration = int(match.group(2))
            counts[iteration] = counts.get(iteration, 0) + 1
    result.in_text = {it for it, n in counts.items() if n == 3}
    result.in_tensorboard = _in_tensorboard(pathlib.Path(log_dir, "tensorboard"), result)


def _in_tensorboard(directory: pathlib.Path, result: TrialResult) -> Set[int]:
    """The iterations whose three statistics are in the event files of `directory` (a wrong max is recorded)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader  # (the events as written)

    counts: dict = {}
    for path in sorted(directory.glob("*tfevents*")) if directory.exists() else []:
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag not in ("layer/activation/max", "layer/activation/min", "layer/activation/mean"):
                    continue
                if value.tag.endswith("max") and value.simple_value != event.step + 0.5:
                    result.wrong_values.append(f"tensorboard: {value.tag} at {event.step} = {value.simple_value}")
                counts[event.step] = counts.get(event.step, 0) + 1
    return {it for it, n in counts.items() if n == 3}


def kill_trial(how: str, log_dir: str, after: int, timeout_s: float = 120.0) -> TrialResult:
    """See the module docstring."""
    args = [sys.executable, str(CHILD), "loop", log_dir]
    if how == "exception":
        args.append(str(after))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    returned: Set[int] = set()
    try:
        for line in child.stdout:
            returned.add(int(line))
            if len(returned) > after and how != "exception":
                child.send_signal(getattr(signal, how))
                break
        rest, _ = child.communicate(timeout=timeout_s)
        returned.update(int(line) for line in rest.split())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    wait_for_writer_process(child.pid)
    result = TrialResult(how, returned)
    read_statistics(log_dir, result)
    return result


def writer_processes(parent_pid: int) -> List[int]:
    """The pids of the statistics writer processes started by the process `parent_pid` (Linux: found by their
    command line, which names the writer's module and its parent's pid; the parent may be gone)."""
    found = []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes().decode("utf-8", "replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:  # ended meanwhile
            continue
        if "tedebug.sinks.writer_child" in command and f", {parent_pid}, " in command and state != "Z":
            found.append(int(entry.name))
    return found


def wait_for_writer_process(parent_pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the writer process of the (ended) process `parent_pid` has ended: it writes what it was handed,
    then ends (`tedebug.sinks.writer_child`), so the files are complete only then."""
    deadline = time.monotonic() + timeout_s
    while writer_processes(parent_pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the statistics writer process of {parent_pid} did not end within {timeout_s} s")
        time.sleep(0.05)
